"""ElasticTransport against a fake torchft process group: one deadline per exchange, failures counted once.

The fake stands in for the membership (its quorum and its reconfigurable process group): a peer can
answer at once, be dead (its operations fail at once) or hang (its operations wait out whatever
timeout they are given, then fail, as gloo's do).
"""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.membership import Quorum


class FakeWork:
    def __init__(self, behaviour: str, on_done=None):
        self.behaviour, self.on_done = behaviour, on_done
        self.waited: list[float] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = 30.0 if timeout is None or not timeout.total_seconds() else timeout.total_seconds()
        self.waited.append(seconds)
        if self.behaviour == "dead":
            raise RuntimeError("Connection closed by peer")
        if self.behaviour == "hung":
            time.sleep(seconds)
            raise RuntimeError(f"Timed out waiting {seconds}s")
        if self.on_done is not None:
            self.on_done()
        return True


class FakeProcessGroup:
    """Peers by quorum index: 'ok' echoes ``value`` into the receive buffer, 'dead' and 'hung' fail."""

    def __init__(self, peers: dict[int, str], value: float = 3.0, allreduce: str = "ok"):
        self.peers, self.value, self.allreduce_behaviour = peers, value, allreduce
        self.works: list[FakeWork] = []

    def _work(self, behaviour: str, on_done=None) -> FakeWork:
        self.works.append(FakeWork(behaviour, on_done))
        return self.works[-1]

    def send(self, tensors, peer, tag):
        return self._work(self.peers[peer])

    def recv(self, tensors, peer, tag):
        return self._work(self.peers[peer], lambda: tensors[0].fill_(self.value))

    def allreduce(self, tensors, options):
        return self._work(self.allreduce_behaviour, lambda: tensors[0].mul_(2))


def _transport(peers: dict[int, str], timeout: float = 0.4, allreduce: str = "ok", size: int = 4):
    quorum = Quorum(quorum_id=1, members=tuple(f"worker_{i:04d}:x" for i in range(size)), index=0, max_step=0,
                    healed=False)
    membership = SimpleNamespace(quorum=quorum, process_group=FakeProcessGroup(peers, allreduce=allreduce),
                                 gossip_timeout=timeout, name="worker_0000")
    return ElasticTransport(8, membership), membership.process_group


@pytest.mark.timeout(20)
def test_two_hung_peers_cost_one_deadline_not_one_per_operation():
    transport, pg = _transport({1: "hung", 2: "hung", 3: "ok"}, timeout=2.5)
    pending = transport.post(torch.ones(8), {1: 0.25, 2: 0.25, 3: 0.25}, round_index=0)
    start = time.monotonic()
    received, completed = transport.complete(pending)
    elapsed = time.monotonic() - start
    # 2 peers x (send + receive) waited one after the other with fresh timeouts would take 4 x 2.5 s (two of them
    # 5 s); one deadline is 2.5 s, and 1.5 s more is for a loaded machine's scheduling.
    assert elapsed < 4.0, elapsed
    assert completed == [3] and len(received) == 1 and torch.all(received[0][1] == 3.0)
    assert transport.failed_exchanges == 2 and transport.failed_collectives == 0
    assert all(waited <= 2.5 for work in pg.works for waited in work.waited)


def test_a_dead_peer_fails_at_once_and_is_counted_once():
    transport, _ = _transport({1: "dead"})
    pending = transport.post(torch.ones(8), {1: 0.5}, round_index=2)
    received, completed = transport.complete(pending)
    assert received == [] and completed == []
    assert transport.failed_exchanges == 1 and transport.failed_collectives == 0
    assert "Connection closed" in str(transport.take_error()) and transport.take_error() is None


@pytest.mark.parametrize("round_exchange", [True, False])
def test_a_failed_all_reduce_is_counted_once_as_an_exchange_or_as_a_collective(round_exchange):
    transport, _ = _transport({}, allreduce="dead")
    with pytest.raises(ElasticCollectiveError, match="all-reduce over 4 workers failed"):
        transport.all_reduce_mean(torch.ones(8), round_exchange=round_exchange)
    assert (transport.failed_exchanges, transport.failed_collectives) == ((1, 0) if round_exchange else (0, 1))


def test_a_successful_all_reduce_divides_by_the_quorum_size_and_counts_ring_bytes():
    transport, _ = _transport({}, size=4)
    tensor = transport.all_reduce_mean(torch.ones(8))
    assert torch.allclose(tensor, torch.full((8,), 0.5))  # the fake sums to 2, the mean divides by 4
    assert transport.counters.bytes_sent == 2 * 3 * 8 * 4 // 4 and transport.failed_collectives == 0


@pytest.mark.timeout(20)
def test_a_hung_all_reduce_waits_at_most_the_gossip_timeout():
    transport, _ = _transport({}, allreduce="hung", timeout=0.3)
    start = time.monotonic()
    with pytest.raises(ElasticCollectiveError):
        transport.all_reduce_mean(torch.ones(8))
    assert time.monotonic() - start < 5.0  # without the gossip timeout it waits 30 s; the rest is for a loaded machine
