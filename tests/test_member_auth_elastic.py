"""Member authentication against an intruder, with a real torchft lighthouse and real worker processes.

Two honest workers (``gasloc-elastic``, tiny GPT, H = 5) train while a torchft member *without* the run's secret
joins every quorum it can. It posts receives for the gossip message from every member, attests with a guess as an
honest member would, and, behind the others, asks for a heal in every quorum. With member authentication on (the
default), the honest members agree on an admitted set without it before any exchange: it receives no message and no
state, and the honest workers finish on one model with no failed exchange (nothing was ever attempted with it).
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from app_utils import CONF, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import free_port, lighthouse_command, run_elastic  # noqa: E402
from gasloc_lightning.app.elastic_worker import read_progress  # noqa: E402
from gasloc_lightning.comm.flat import FlatLayout  # noqa: E402
from gasloc_lightning.comm.member_auth import MemberAuthenticator, verify_members  # noqa: E402
from gasloc_lightning.comm.membership import ElasticMembership, MembershipError, lighthouse_reachable  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Each quorum the intruder is in costs the honest members their agreement deadline (gossip_timeout, 3 s: its
# attestation never appears under their secret's key names), so rounds, not steps, set this test's length.
MAX_STEPS = 40
GOSSIP_TAG = 1000  # ElasticTransport's message tag


@pytest.fixture
def lighthouse():
    """A lighthouse of min 2 workers shared by the honest workers and the intruder; stopped by pid."""
    port = free_port()
    process = subprocess.Popen(lighthouse_command(port, 2, 5000, 1500), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a failure deadline: a loaded machine starts it late
    while not lighthouse_reachable(address, timeout=0.5) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    yield address
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()
    return path


class Intruder:
    """A torchft member with a guessed secret, in every quorum it can reach from when it is started."""

    def __init__(self, lighthouse: str, numel: int) -> None:
        self.numel, self.loaded, self.quorums = numel, [], []
        self.buffers: list[torch.Tensor] = []  # every receive it posted: NaN until a message lands
        self.works: list = []
        self.closed_groups = 0  # quorums whose members had closed the group before the intruder could post
        self.error: BaseException | None = None
        self.membership = ElasticMembership(
            lighthouse=lighthouse, worker_id=9, min_workers=2, state_dict=lambda: {"x": torch.zeros(1)},
            load_state_dict=self.loaded.append, connect_timeout=10, quorum_timeout=5, gossip_timeout=30,
            transfer_timeout=10, secret=b"a-guess-of-16-chars")

    def run(self, stop: threading.Event) -> None:
        try:
            self._run(stop)
        except BaseException as error:  # noqa: BLE001 - the test reports it
            self.error = error
            raise

    def _run(self, stop: threading.Event) -> None:
        self.membership.connect()
        challenged = None
        while not stop.is_set():
            try:  # the first quorum finds it behind the others: its heal is asked for and refused
                quorum = self.membership.start_quorum()
            except MembershipError:
                continue
            self.quorums.append(quorum)
            self.attack(quorum, challenged)
            challenged = quorum.quorum_id
            self.membership.commit(quorum.max_step)  # up to date from now on: no heal source, no heal

    def attack(self, quorum, challenged) -> None:
        """Post a receive for every member's gossip message, then attest with a guess. (Its receives wait long: in
        gloo a receive that times out closes the connection, and would end the attack early. Its attestation wait
        is short: see below.)"""
        pg = self.membership.process_group
        if quorum.size <= 1 or quorum.quorum_id == challenged:
            return
        for peer in range(quorum.size):
            if peer != quorum.index:
                buffer = torch.full((self.numel,), math.nan)
                try:
                    work = pg.recv([buffer], peer, GOSSIP_TAG)
                except RuntimeError as error:  # the members already left this group (their deadline passed):
                    if "Connection closed by peer" not in str(error):  # gloo refuses to post on a closed pair,
                        raise  # and nothing can reach the intruder through it
                    self.closed_groups += 1
                    return
                self.buffers.append(buffer)
                self.works.append(work)
        # It never sees the members' attestations (their key names follow the secret), so it waits out its own
        # deadline: a short one brings it back to the lighthouse before the members, whose next quorum then forms
        # as soon as they ask (a long one held each of their quorums for it, up to the lighthouse's join timeout).
        verify_members(pg.quorum_store, quorum_id=quorum.quorum_id, members=quorum.members, index=quorum.index,
                       authenticator=MemberAuthenticator(b"a-guess"), timeout=1)

    def received_a_message(self) -> bool:
        return any(not torch.isnan(buffer).all() for buffer in self.buffers)


def _config(tmp_path: Path, cache_dir: Path, method: str, lighthouse: str):
    overrides = [
        "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", f"trainer.max_steps={MAX_STEPS}",
        f"trainer.val_check_interval={MAX_STEPS}", "trainer.enable_progress_bar=false", "data.batch_size=4",
        "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=2",
        "elastic.min_workers=2", "elastic.max_workers=3", "elastic.heartbeat_timeout_ms=1500",
        "elastic.join_timeout_ms=5000", "elastic.gossip_timeout=3", "elastic.quorum_timeout=30",
        "elastic.timeout_s=240", f"elastic.method={method}", f"elastic.lighthouse={lighthouse}",
        f"output_dir={tmp_path}", f"cache_dir={cache_dir}",  # member_auth is on by default
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="elastic/app", overrides=overrides)


def _intrude_once_training(intruder: Intruder, output_dir: Path, stop: threading.Event) -> None:
    """Join once worker 0 has trained a round (so the intruder is behind, not a founder), then intrude."""
    deadline = time.monotonic() + 180
    while not stop.is_set() and time.monotonic() < deadline:
        if ((read_progress(output_dir / "worker_0") or {}).get("round") or 0) >= 1:
            intruder.run(stop)
            return
        time.sleep(0.1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["gasloc", "diloco"])
def test_an_intruder_without_the_secret_is_refused_before_any_exchange(tmp_path, cache_dir, lighthouse, method):
    cfg = _config(tmp_path, cache_dir, method, lighthouse)
    assert cfg.elastic.member_auth is True
    intruder = Intruder(lighthouse, FlatLayout(instantiate(cfg.model), bind=False).numel)
    stop = threading.Event()
    thread = threading.Thread(target=_intrude_once_training, args=(intruder, tmp_path, stop), daemon=True)
    thread.start()
    try:
        summary = run_elastic(cfg)
    finally:
        stop.set()
        thread.join(timeout=30)
        intruder.membership.shutdown()
    assert not thread.is_alive() and intruder.error is None, repr(intruder.error)
    assert any(quorum.size == 3 for quorum in intruder.quorums), "the intruder never made a quorum: nothing tested"
    assert intruder.works, f"the intruder posted no receive ({intruder.closed_groups} groups closed): nothing tested"
    assert not intruder.received_a_message(), "the intruder received a member's message"
    assert intruder.loaded == [], "the intruder took a member's state"
    progress = [read_progress(tmp_path / f"worker_{worker}") or {} for worker in range(2)]
    assert [row["exit_code"] for row in summary["workers"]] == [0, 0], summary
    assert [record.get("step") for record in progress] == [MAX_STEPS, MAX_STEPS], progress
    assert len({record["model_checksum"] for record in progress}) == 1, f"not one model: {progress}"
    assert all(record["refused_members"] >= 1 for record in progress), progress
    assert all(record["failed_exchanges"] == 0 and record["failed_collectives"] == 0 for record in progress), progress
