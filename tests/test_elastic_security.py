"""Elastic membership against hostile or failing peers, with a real torchft lighthouse (no training).

- A rogue member that claims the highest step is every joiner's heal source. Whether it signs with the
  run's secret or not, the pickle it serves never runs, nothing is applied, and the joiner fails cleanly.
- A quorum larger than ``max_workers``: the surplus member leaves with a clear error, the others go on.
- A heal source that dies while its state is being fetched: nothing partial is applied.
- Setup and teardown in-process leave no listening socket and no thread behind.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("torchft")

from net_utils import listening_sockets, non_loopback  # noqa: E402
from gasloc_lightning.app.elastic import free_port, lighthouse_command  # noqa: E402
from gasloc_lightning.comm.membership import (  # noqa: E402
    ElasticMembership,
    MembershipError,
    SurplusWorkerError,
    lighthouse_reachable,
)

SECRET = b"the-run-secret"
HOST = "127.0.0.1"


class Payload:
    """Unpickling this creates ``marker``: a stand-in for any code a rogue peer would like to run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.fixture
def lighthouse():
    """A lighthouse of min 1 worker, a 200 ms join timeout and a 1 s heartbeat timeout; stopped by pid."""
    port = free_port()
    process = subprocess.Popen(lighthouse_command(port, 1, 200, 1000), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"{HOST}:{port}"
    deadline = time.monotonic() + 10
    while not lighthouse_reachable(address, timeout=0.2):
        if time.monotonic() > deadline or process.poll() is not None:
            break
        time.sleep(0.05)
    yield address
    process.kill()
    process.wait()


class Member:
    """One membership with a state of its own; records what it was asked to load."""

    def __init__(self, address: str, worker_id: int, state=None, **overrides) -> None:
        self.state = {"x": torch.full((4,), float(worker_id))} if state is None else state
        self.loaded: list[dict] = []
        settings = dict(lighthouse=address, worker_id=worker_id, min_workers=1, state_dict=self._state,
                        load_state_dict=self.loaded.append, connect_timeout=5, quorum_timeout=5, gossip_timeout=2,
                        transfer_timeout=3, heartbeat_interval=0.1, secret=SECRET)
        self.membership = ElasticMembership(**{**settings, **overrides})

    def _state(self):
        return self.state() if callable(self.state) else self.state


def _serve_rounds(member: Member, stop: threading.Event, step: int) -> None:
    """A running member: joins, then takes part in every quorum and always claims round ``step``."""
    try:
        member.membership.join()
    except MembershipError:
        pass
    while not stop.is_set():
        try:
            member.membership.start_quorum()
        except MembershipError:
            continue
        member.membership.commit(step)
        time.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rogue_secret", [SECRET, b"not-the-run-secret"], ids=["knows-secret", "wrong-secret"])
def test_a_rogue_heal_source_never_runs_code_and_the_joiner_fails_cleanly(lighthouse, tmp_path, rogue_secret):
    marker = tmp_path / "payload_ran"
    pickle.loads(pickle.dumps(Payload(marker)))  # the payload is live: unpickled, it creates the marker
    assert marker.exists()
    marker.unlink()
    rogue = Member(lighthouse, 9, state={"x": Payload(marker)}, start_step=5, secret=rogue_secret)
    joiner = Member(lighthouse, 0, quorum_timeout=4)
    stop = threading.Event()
    rogue.membership.connect()
    joiner.membership.connect()
    serving = threading.Thread(target=_serve_rounds, args=(rogue, stop, 5), daemon=True)
    try:
        serving.start()
        start = time.monotonic()
        with pytest.raises(MembershipError, match="no usable quorum to join") as failure:
            joiner.membership.join()
        assert time.monotonic() - start < 15
        reason = str(failure.value)
        assert ("weights_only" in reason or "unsafe" in reason.lower() or "refused" in reason
                or "authentic" in reason.lower() or "MAC" in reason), reason
    finally:
        stop.set()
        serving.join(timeout=10) if serving.is_alive() else None
        joiner.membership.shutdown()
        rogue.membership.shutdown()
    assert not marker.exists(), "the rogue's pickle ran on the joiner"
    assert joiner.loaded == []  # nothing was applied


@pytest.mark.timeout(60)
def test_a_quorum_larger_than_max_workers_sends_the_surplus_member_away(lighthouse):
    members = [Member(lighthouse, worker_id, max_workers=2, first_quorum_delay=1.5, quorum_timeout=10)
               for worker_id in range(3)]
    for member in members:
        member.membership.connect()
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(member.membership.join) for member in members]
            outcomes = []
            for future in futures:
                try:
                    outcomes.append(future.result(timeout=40))
                except SurplusWorkerError as error:
                    outcomes.append(error)
    finally:
        for member in members:
            member.membership.shutdown()
    surplus = [outcome for outcome in outcomes if isinstance(outcome, SurplusWorkerError)]
    assert len(surplus) == 1 and "max_workers=2" in str(surplus[0]), outcomes
    assert isinstance(outcomes[2], SurplusWorkerError)  # worker_0002 sorts past max_workers
    assert [outcome.size for outcome in outcomes[:2]] == [2, 2]
    assert all(outcome.usable for outcome in outcomes[:2])
    assert not members[2].membership.connected  # it left: no heartbeat, no server


@pytest.mark.timeout(60)
def test_a_heal_source_that_dies_during_the_transfer_leaves_nothing_partial(lighthouse):
    def slow_state():
        time.sleep(1.5)  # staged long after the joiner asked for it
        return {"x": torch.full((4,), 7.0)}

    source = Member(lighthouse, 1, state=slow_state, start_step=3)
    joiner = Member(lighthouse, 0, quorum_timeout=8)
    source.membership.connect()
    joiner.membership.connect()
    stop = threading.Event()
    killer = threading.Timer(0.8, source.membership.shutdown)
    serving = threading.Thread(target=_serve_rounds, args=(source, stop, 3), daemon=True)
    try:
        serving.start()
        killer.start()
        try:
            quorum = joiner.membership.join()
        except MembershipError:
            quorum = None
    finally:
        stop.set()
        killer.cancel()
        joiner.membership.shutdown()
        source.membership.shutdown()
    assert joiner.loaded == []
    if quorum is not None:  # it went on alone once the source was gone, from its own state
        assert not quorum.healed and quorum.members == tuple(m for m in quorum.members if m.startswith("worker_0000"))


@pytest.mark.timeout(60)
def test_connect_and_shutdown_in_process_leave_no_socket_or_thread(lighthouse):
    before_sockets = set(listening_sockets(os.getpid()))
    before_threads = {thread.ident for thread in threading.enumerate()}
    member = Member(lighthouse, 0)
    member.membership.connect()
    member.membership.join()
    member.membership.commit(1)
    during = set(listening_sockets(os.getpid())) - before_sockets
    assert during and not non_loopback(during)  # it did listen, on loopback only
    member.membership.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left_sockets = set(listening_sockets(os.getpid())) - before_sockets
        left_threads = [t for t in threading.enumerate() if t.ident not in before_threads and t.is_alive()]
        if not left_sockets and not left_threads:
            break
        time.sleep(0.2)
    assert not left_sockets, left_sockets
    assert not left_threads, [thread.name for thread in left_threads]
