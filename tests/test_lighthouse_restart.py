"""A torchft lighthouse that dies: no request waits past one deadline, workers wait for it to come back on the same
address and go on, and ``gasloc-elastic``'s ``lighthouse@STEP`` chaos event kills and restarts it mid-run.

Every wait is on an event: the lighthouse's own log line for a request it received, the worker's ``lighthouse
down`` log record, the lighthouse answering again, a step in the progress files. Timeouts are failure deadlines
only. The real ``torchft_lighthouse`` runs in each test that needs one; every process is stopped by pid.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402

from app_utils import CONF, shared_cache_dir  # noqa: E402
from log_utils import log_records  # noqa: E402
from gasloc_lightning.app.elastic import (  # noqa: E402
    ChaosEvent,
    check_elastic,
    free_port,
    lighthouse_command,
    parse_chaos,
    run_elastic,
)
from gasloc_lightning.comm.lighthouse_watch import (  # noqa: E402
    DOWN_MARK,
    needs_new_group,
    quorum_retries,
    rendezvous_prefix,
)
from gasloc_lightning.comm.membership import ElasticMembership, MembershipError, lighthouse_reachable  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

HOST = "127.0.0.1"
SECRET = b"test-run-secret-of-16+"


# ------------------------------------------------------------------ pieces (nothing started)
def test_the_lighthouse_chaos_event_is_parsed_and_needs_the_launchers_lighthouse():
    assert parse_chaos(["lighthouse@40", "kill:1@30", "lighthouse@60:5"], workers=2) == [
        ChaosEvent("kill", 1, 30), ChaosEvent("lighthouse", -1, 40), ChaosEvent("lighthouse", -1, 60, 5.0)]
    assert [str(event) for event in parse_chaos(["lighthouse@40", "lighthouse@60:2.5"], workers=2)] == [
        "lighthouse@40", "lighthouse@60:2.5"]
    with pytest.raises(ValueError, match=r"lighthouse@STEP\[:SECONDS\]"):
        parse_chaos(["lighthouse:0@40"], workers=2)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app", overrides=["elastic.lighthouse=node0:29510",
                                                            "elastic.chaos=[lighthouse@40]", "output_dir=/none"])
    with pytest.raises(ValueError, match="lighthouse@STEP needs the lighthouse the launcher starts"):
        check_elastic(cfg)


def test_torchft_retries_a_dropped_request_for_about_the_whole_request():
    assert quorum_retries(30.0, 0.5) == 60  # 30 s / 61 ~ 0.49 s between two tries
    assert quorum_retries(0.2, 0.5) == 1
    with pytest.raises(ValueError, match="request_timeout"):
        quorum_retries(0.0)


def test_a_restarted_lighthouses_quorum_ids_get_their_own_rendezvous():
    members = ["worker_0000:a", "worker_0001:b"]
    first = rendezvous_prefix("127.0.0.1:1234", members, 0)
    assert first.startswith("127.0.0.1:1234/") and first == rendezvous_prefix("127.0.0.1:1234", members, 0)
    assert first != rendezvous_prefix("127.0.0.1:1234", members, 7)  # same id, later round: other keys
    assert first != rendezvous_prefix("127.0.0.1:1234", members[:1], 0)  # other members
    assert needs_new_group(1, members[:1], 1, members)  # an id reused for other members: only after a restart
    assert not needs_new_group(1, members, 1, members) and not needs_new_group(2, members[:1], 1, members)


# ------------------------------------------------------------------ membership with a real lighthouse
class _Lighthouse:
    """A ``torchft_lighthouse`` on a fixed port (min 2 workers), that a test kills and starts again there."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.log = log_dir / "lighthouse.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log_file:
            self.process = subprocess.Popen(lighthouse_command(self.port, 2, 200, 1000), stdout=log_file,
                                            stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"},
                                            start_new_session=True)
        _until(lambda: lighthouse_reachable(self.address, timeout=0.2), 60, "the lighthouse did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def received(self, worker: str) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(f"Received quorum request for replica {worker}")


def _until(condition, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


@pytest.fixture
def records():
    """The membership modules' log lines."""
    with log_records("gasloc_lightning.comm") as handler:
        yield handler


@pytest.fixture
def lighthouse(tmp_path):
    server = _Lighthouse(tmp_path)
    server.start()
    yield server
    if server.process.poll() is None:
        server.kill()


def _member(address: str, worker_id: int, **overrides) -> ElasticMembership:
    state = {"x": torch.zeros(3)}
    settings = dict(lighthouse=address, worker_id=worker_id, min_workers=2, state_dict=lambda: dict(state),
                    load_state_dict=state.update, connect_timeout=5, quorum_timeout=60, gossip_timeout=5,
                    transfer_timeout=10, secret=SECRET, lighthouse_timeout=60)
    return ElasticMembership(**{**settings, **overrides})


def _rounds(members: list[ElasticMembership], pool: ThreadPoolExecutor, errors: list[Exception | None]) -> None:
    """One quorum per entry of ``errors``, each committed as round 1 with that error (an error bumps the next id)."""
    for index, error in enumerate(errors):
        ask = [member.join if index == 0 else member.start_quorum for member in members]
        quorums = [future.result(timeout=60) for future in [pool.submit(call) for call in ask]]
        assert [quorum.size for quorum in quorums] == [2, 2] and {q.quorum_id for q in quorums} == {index + 1}
        for member in members:
            member.commit(1, error)


@pytest.mark.timeout(180)
def test_a_quorum_request_in_flight_when_the_lighthouse_dies_is_answered_by_its_restart(lighthouse, records):
    """Three quorums first (ids 1..3: two rounds report a failed exchange). Then worker 0 asks while worker 1
    computes, so its request waits in the lighthouse, and the lighthouse dies. Once worker 0 says it waits for it,
    it restarts on the same address and worker 1 asks: both get the quorum of two, long before quorum_timeout and
    lighthouse_timeout (60 s: torchft 0.2.0 alone waits for them, its request lost). The restarted lighthouse
    numbers from 1 again: that quorum is usable although quorum 1's rendezvous keys are still in worker 0's store."""
    members = [_member(lighthouse.address, w) for w in range(2)]
    pool = ThreadPoolExecutor(2)
    try:
        for member in members:
            member.connect()
        _rounds(members, pool, errors=[RuntimeError("a failed exchange")] * 2 + [None])
        asked = lighthouse.received("worker_0000")
        in_flight = pool.submit(members[0].start_quorum)
        _until(lambda: lighthouse.received("worker_0000") > asked, 30, "worker 0's request never reached it")
        lighthouse.kill()
        records.wait(f"{DOWN_MARK} worker=worker_0000", timeout=30)
        lighthouse.start()
        start = time.monotonic()
        second = pool.submit(members[1].start_quorum)
        quorums = [in_flight.result(timeout=40), second.result(timeout=40)]
        assert time.monotonic() - start < 40
        assert [quorum.size for quorum in quorums] == [2, 2]
        assert all(quorum.usable for quorum in quorums), [str(quorum.error)[:200] for quorum in quorums]
        assert {quorum.quorum_id for quorum in quorums} == {1} and {quorum.max_step for quorum in quorums} == {1}
    finally:
        for member in members:
            member.shutdown()
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(120)
def test_a_lighthouse_that_stays_dead_fails_the_worker_after_lighthouse_wait(lighthouse, records):
    """No restart: the worker waiting in a quorum fails after lighthouse_wait (plus at most one lighthouse_timeout),
    naming the setting, not after quorum_timeout (60 s)."""
    members = [_member(lighthouse.address, w, lighthouse_wait=1, lighthouse_timeout=3) for w in range(2)]
    pool = ThreadPoolExecutor(2)
    try:
        for member in members:
            member.connect()
        _rounds(members, pool, errors=[None])
        asked = lighthouse.received("worker_0000")
        in_flight = pool.submit(members[0].start_quorum)
        _until(lambda: lighthouse.received("worker_0000") > asked, 30, "worker 0's request never reached it")
        lighthouse.kill()
        start = time.monotonic()
        with pytest.raises(MembershipError, match=r"lighthouse_wait=1s .*restart it on the same address"):
            in_flight.result(timeout=50)
        assert time.monotonic() - start < 30  # well before quorum_timeout=60
    finally:
        for member in members:
            member.shutdown()
        pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------ gasloc-elastic, the whole run
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()
    return path


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_gasloc_elastic_goes_on_through_a_lighthouse_killed_and_restarted_mid_run(tmp_path, cache_dir, capfd):
    """``lighthouse@30``: the lighthouse is killed once a worker reaches step 30 and restarted on the same address
    once every running worker logs that it waits for it; the three workers finish at max_steps on one model."""
    steps = 60
    overrides = [
        "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}", "trainer.enable_progress_bar=false", "data.batch_size=4",
        "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=3",
        "elastic.min_workers=2", "elastic.heartbeat_timeout_ms=1500", "elastic.join_timeout_ms=5000",
        "elastic.gossip_timeout=3", "elastic.quorum_timeout=90", "elastic.lighthouse_wait=80",
        "elastic.timeout_s=400", "elastic.chaos=[lighthouse@30]", f"output_dir={tmp_path}", f"cache_dir={cache_dir}",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app", overrides=overrides)
    summary = run_elastic(cfg)
    printed = capfd.readouterr().out
    assert "lighthouse killed" in printed and "lighthouse restarted" in printed, printed
    rows = summary["workers"]
    assert all(row["status"] == "finished" and row["final_step"] == steps for row in rows), rows
    checksums = {row["model_checksum"] for row in rows}
    assert len(checksums) == 1 and None not in checksums, checksums
    waited = [w for w in range(3) if DOWN_MARK in (tmp_path / f"worker_{w}" / "worker.log").read_text()]
    assert waited == [0, 1, 2]
    lighthouse_pids = [pid for pid in summary["pids"] if pid == summary["lighthouse_pid"]]
    assert len(lighthouse_pids) == 1 and len(summary["pids"]) == 3 + 2  # three workers, two lighthouses
