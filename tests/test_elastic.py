"""Elastic membership on torchft: bad input and faults, each with a real lighthouse (fast: no training)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

pytest.importorskip("torchft")

from app_utils import CONF  # noqa: E402
from log_utils import log_records  # noqa: E402
from dist_utils import TinyRegressor  # noqa: E402
from gasloc_lightning.app.elastic import (  # noqa: E402
    check_elastic,
    free_port,
    lighthouse_command,
    parse_chaos,
    random_chaos,
)
from gasloc_lightning.app.elastic_worker import load_worker_config  # noqa: E402
from gasloc_lightning.comm.lighthouse_watch import DOWN_MARK  # noqa: E402
from gasloc_lightning.comm.membership import ElasticMembership, MembershipError, lighthouse_reachable  # noqa: E402
from gasloc_lightning.comm.quorum_floor import SplitQuorumWarning  # noqa: E402
from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy  # noqa: E402

HOST = "127.0.0.1"  # every service binds loopback unless told otherwise
SECRET = b"test-run-secret-of-16+"


@pytest.fixture(autouse=True)
def _run_secret(monkeypatch):
    """The run's secret, as gasloc-elastic hands it to its workers."""
    monkeypatch.setenv("GASLOC_ELASTIC_SECRET", SECRET.decode())


def _membership(address: str, worker_id: int = 0, **overrides) -> ElasticMembership:
    state = {"x": torch.zeros(3)}
    settings = dict(lighthouse=address, worker_id=worker_id, min_workers=1, state_dict=lambda: dict(state),
                    load_state_dict=state.update, connect_timeout=2, quorum_timeout=2, gossip_timeout=2,
                    transfer_timeout=5, secret=SECRET)
    return ElasticMembership(**{**settings, **overrides})


def _start_lighthouse(min_workers: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(lighthouse_command(port, min_workers, 200, 1000), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"{HOST}:{port}"
    deadline = time.monotonic() + 10
    while not lighthouse_reachable(address, timeout=0.2):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            process.wait()
            raise AssertionError("the lighthouse did not start")
        time.sleep(0.05)
    return process, address


def _lighthouse(min_workers: int):
    process, address = _start_lighthouse(min_workers)
    yield process, address
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.fixture
def lighthouse_process():
    """A ``torchft_lighthouse`` process (min 1 worker, 1 s heartbeat timeout); stopped by pid."""
    yield from _lighthouse(1)


@pytest.fixture
def lighthouse_of_two():
    """A lighthouse that forms no quorum below 2 workers: a lone worker's quorum request really times out."""
    yield from _lighthouse(2)


@pytest.mark.timeout(30)
def test_the_lighthouse_listens_without_loading_torch(lighthouse_process):
    """Its start-up is the Rust server's alone: torchft's package (which imports torch, seconds of CPU) is not run."""
    process, _ = lighthouse_process
    maps = Path(f"/proc/{process.pid}/maps").read_text()
    assert "torchft/_torchft" in maps, "the lighthouse did not load torchft's extension"
    assert "libtorch" not in maps and "libc10" not in maps, "the lighthouse process loaded torch"


@pytest.mark.timeout(30)
def test_unreachable_lighthouse_fails_within_connect_timeout():
    address = f"{HOST}:{free_port()}"
    membership = _membership(address, connect_timeout=1)
    start = time.monotonic()
    with pytest.raises(MembershipError, match=r"could not reach the lighthouse at http://.*connect_timeout=1s"):
        membership.connect()
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_quorum_below_min_workers_waits_then_fails_clearly(lighthouse_process, caplog):
    """The lighthouse forms quorums of 1, this worker wants 2: it asks again until quorum_timeout."""
    _, address = lighthouse_process
    membership = _membership(address, min_workers=2, quorum_timeout=2)
    membership.connect()
    try:
        start = time.monotonic()
        with caplog.at_level("INFO", logger="gasloc_lightning.comm.membership"):
            with pytest.raises(MembershipError, match=r"min_workers=2 .*quorum_timeout=2s"):
                membership.start_quorum()
        assert 1.5 < time.monotonic() - start < 10
        assert "waiting for a quorum" in caplog.text
    finally:
        membership.shutdown()


@pytest.mark.timeout(60)
def test_a_timed_out_quorum_request_is_not_sticky(lighthouse_of_two):
    """torchft's own quorum request times out (the lighthouse wants 2): torchft would re-raise that failure on
    every later call; the next call must wait again, and then join a quorum that does form."""
    _, address = lighthouse_of_two
    first = _membership(address, worker_id=0, quorum_timeout=2)
    second = _membership(address, worker_id=1, quorum_timeout=20)
    first.connect()
    try:
        start = time.monotonic()
        with pytest.raises(MembershipError, match="quorum_timeout=2s"):
            first.start_quorum()
        assert 1.5 < time.monotonic() - start < 10
        start = time.monotonic()
        with pytest.raises(MembershipError):
            first.start_quorum()
        assert time.monotonic() - start > 1.5  # it waited again instead of re-raising at once
        second.connect()
        first.quorum_timeout = 20.0  # now wait for the second worker (it connects, then asks)
        with ThreadPoolExecutor(2) as pool:
            quorums = [future.result(timeout=30) for future in
                       [pool.submit(member.join) for member in (first, second)]]
        assert [q.size for q in quorums] == [2, 2] and sorted(q.index for q in quorums) == [0, 1]
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.timeout(60)
def test_lighthouse_death_fails_clearly_instead_of_hanging(lighthouse_process):
    process, address = lighthouse_process
    membership = _membership(address, min_workers=1, quorum_timeout=2)
    membership.connect()
    try:
        quorum = membership.start_quorum()
        assert quorum.size == 1 and quorum.index == 0 and quorum.names == ["worker_0000"]
        membership.commit(1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        with pytest.raises(MembershipError, match="stopped answering"):
            membership.start_quorum()
    finally:
        membership.shutdown()


def test_lighthouse_address_is_checked():
    with pytest.raises(ValueError, match="HOST:PORT"):
        _membership("no-port-here")
    with pytest.raises(ValueError, match="min_workers"):
        _membership(f"{HOST}:1", min_workers=0)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"min_workers": 3, "max_workers": 2}, "max_workers"),
        ({"overlap": True}, "overlap"),
        ({"message_dtype": "bfloat16"}, "message_dtype"),
        ({"worker_id": -1}, "worker_id"),
        ({"lighthouse": "nowhere"}, "HOST:PORT"),
        ({"first_quorum_delay": -1.0}, "first_quorum_delay"),
    ],
)
def test_strategy_arguments_are_validated(arguments, message):
    settings = {"lighthouse": f"{HOST}:29510", "worker_id": 0, **arguments}
    with pytest.raises(ValueError, match=message):
        ElasticGASLoCStrategy(**settings)


def test_momentum_is_checked_for_every_allowed_quorum_size():
    strategy = ElasticGASLoCStrategy(lighthouse=f"{HOST}:29510", worker_id=0, max_workers=4, inner_steps=2)
    strategy.check_configuration(1)
    assert 0.0 < strategy.outer_momentum < 1.0
    # post_mix with gamma 0.99 on one_peer is stable for 2 and 4 workers but not for 3: a quorum of 3 can happen.
    unstable = ElasticGASLoCStrategy(lighthouse=f"{HOST}:29510", worker_id=0, max_workers=4,
                                     outer_momentum=0.99, outer_form="post_mix", topology="one_peer")
    with pytest.raises(ValueError, match="unstable .* with 3 workers"):
        unstable.check_configuration(1)
    with pytest.warns(SplitQuorumWarning):  # a quorum of 2 must be allowed for two_peer to refuse it
        two_peer = ElasticGASLoCStrategy(lighthouse=f"{HOST}:29510", worker_id=0, min_workers=2, topology="two_peer",
                                         allow_split_quorum=True)
    with pytest.raises(ValueError, match="world_size >= 3"):
        two_peer.check_configuration(1)
    with pytest.raises(ValueError, match="one process per worker"):
        strategy.check_configuration(2)


def test_chaos_schedule_is_parsed_and_checked():
    events = parse_chaos(["restart:2@50", "kill:2@40", "stall:1@30:2.5", "stall:0@60-80"], workers=3)
    assert [str(event) for event in events] == ["stall:1@30:2.5", "kill:2@40", "restart:2@50", "stall:0@60-80"]
    assert events[-1].until_step == 80 and events[0].until_step is None
    for bad in ("kill:3@4", "kill:1", "stall:1@4", "kill:1@4:2", "explode:1@2", "kill:1@4-9", "stall:1@9-9",
                "stall:1@4-9:2"):
        with pytest.raises(ValueError, match="elastic.chaos"):
            parse_chaos([bad], workers=3)


def test_random_chaos_is_seeded_restarts_every_kill_and_keeps_min_workers():
    events = random_chaos(10, 4, 300, 3, seed=0)
    assert [str(e) for e in events] == [str(e) for e in random_chaos(10, 4, 300, 3, seed=0)]
    assert [str(e) for e in events] != [str(e) for e in random_chaos(10, 4, 300, 3, seed=1)]
    down: set[int] = set()
    for event in events:
        assert 30 <= event.step < 240
        if event.action == "kill":
            assert event.worker not in down
            down.add(event.worker)
        else:
            down.remove(event.worker)
        assert len(down) <= 4 - 3
    assert not down and sum(e.action == "kill" for e in events) == 5
    assert len({e.step for e in events}) == 10
    for bad, message in ((dict(events=3), "even"), (dict(events=4, min_workers=4), "min_workers"),
                         (dict(events=200), "does not fit")):
        arguments = {"events": 10, "workers": 4, "max_steps": 300, "min_workers": 2, "seed": 0, **bad}
        with pytest.raises(ValueError, match=message):
            random_chaos(**arguments)


@pytest.mark.parametrize(
    "trainer_arguments, message",
    [
        ({"val_check_interval": "00:00:00:05", "check_val_every_n_epoch": None}, "val_check_interval .* not as a time"),
        ({"val_check_interval": 1.0}, "check_val_every_n_epoch=1 schedules validation from each worker's own epoch"),
        ({"accumulate_grad_batches": 2, "limit_val_batches": 0}, "accumulate_grad_batches must be 1"),
    ],
)
def test_trainer_settings_that_would_desynchronise_the_workers_are_refused_before_joining(trainer_arguments, message):
    """Members must validate at the same global steps (the consensus evaluation is a collective over the quorum),
    and a healed worker's counters move by one batch per step."""
    strategy = ElasticGASLoCStrategy(lighthouse=f"{HOST}:1", worker_id=0, inner_steps=2, connect_timeout=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                         **trainer_arguments)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyRegressor())


def test_the_launcher_refuses_a_join_timeout_not_longer_than_the_gossip_timeout():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        default = compose(config_name="elastic/app")
        short = compose(config_name="elastic/app", overrides=["elastic.join_timeout_ms=10000", "elastic.gossip_timeout=10"])
        remote = compose(config_name="elastic/app", overrides=["elastic.join_timeout_ms=10000", "elastic.gossip_timeout=10",
                                                                "elastic.lighthouse=node0:29510"])
    check_elastic(default)
    check_elastic(remote)  # a lighthouse the launcher does not start: its join timeout is not known here
    with pytest.raises(ValueError, match="join_timeout_ms=10000 must exceed elastic.gossip_timeout=10s"):
        check_elastic(short)


def test_worker_config_takes_dotlist_overrides_of_existing_keys(tmp_path):
    path = tmp_path / "worker_config.yaml"
    OmegaConf.save(OmegaConf.create({"strategy": {"worker_id": 0, "lighthouse": "a:1"}, "data": {"rank": 0}}), path)
    cfg = load_worker_config(path, ["strategy.worker_id=3", "data.rank=3", "strategy.lighthouse=node0:29510"])
    assert (cfg.strategy.worker_id, cfg.data.rank, cfg.strategy.lighthouse) == (3, 3, "node0:29510")
    assert load_worker_config(path).strategy.worker_id == 0
    with pytest.raises(ValueError, match="not a key"):
        load_worker_config(path, ["strategy.worker_idd=3"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_worker_config(path, ["strategy.worker_id"])


@pytest.mark.timeout(90)
def test_workers_go_on_through_a_lighthouse_that_restarts():
    """The lighthouse dies between two quorums and comes back on the same address: the failed requests are asked
    again (torchft raises a connection error, not a timeout, and would re-raise it forever) and the next quorum
    forms with both workers."""
    port = free_port()
    command = lighthouse_command(port, 2, 200, 1000)
    address = f"{HOST}:{port}"

    def start() -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        deadline = time.monotonic() + 10
        while not lighthouse_reachable(address, timeout=0.2) and time.monotonic() < deadline:
            time.sleep(0.05)
        return process

    process = start()
    members = [_membership(address, worker_id=w, quorum_timeout=20, min_workers=2) for w in range(2)]
    try:
        for member in members:
            member.connect()
        with ThreadPoolExecutor(2) as pool, log_records("gasloc_lightning.comm") as records:
            first = [f.result(timeout=30) for f in [pool.submit(m.join) for m in members]]
            for member in members:
                member.commit(1)
            process.kill()
            process.wait()
            futures = [pool.submit(m.start_quorum) for m in members]
            for member in members:  # both ask while it is down, and have found it down
                records.wait(f"{DOWN_MARK} worker={member.name}", timeout=30)
            process = start()
            second = [f.result(timeout=40) for f in futures]
        assert [q.size for q in first] == [2, 2] and [q.size for q in second] == [2, 2]
        assert all(q.usable for q in second) and {q.max_step for q in second} == {1}
    finally:
        for member in members:
            member.shutdown()
        process.kill()
        process.wait()
