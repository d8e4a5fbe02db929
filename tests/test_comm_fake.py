"""The transport and the exchange against a fake communicator: slicing, counters, deadlines, corrections.

The fake stands in for ``torch.distributed`` inside :mod:`gasloc_lightning.comm.transport`: every
``irecv`` is answered from a table of what each peer "sent", and a peer can be made to never answer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import gasloc_lightning.comm.transport as transport_module
from gasloc_lightning.comm.transport import GossipTimeoutError, GossipTransport


class FakeWork:
    def __init__(self, completes: bool):
        self.completes = completes

    def wait(self, timeout=None):
        return self.completes

    def is_completed(self):
        return self.completes


class FakeDist:
    """``isend`` records what was sent; ``irecv`` copies the peer's next slice of its message."""

    def __init__(self, rank: int, world_size: int, peer_messages: dict[int, torch.Tensor], silent=()):
        self.rank, self.world_size = rank, world_size
        self.peer_messages = peer_messages
        self.silent = set(silent)
        self.sent: dict[int, list[torch.Tensor]] = {}
        self._offsets: dict[int, int] = {}
        self.isend, self.irecv = "isend", "irecv"
        self.ReduceOp = SimpleNamespace(SUM="sum")

    def P2POp(self, op, tensor, peer, group=None):
        return SimpleNamespace(op=op, tensor=tensor, peer=peer)

    def batch_isend_irecv(self, ops):
        works = []
        for op in ops:
            if op.op == "isend":
                self.sent.setdefault(op.peer, []).append(op.tensor.clone())
            elif op.tensor.dtype == torch.float64:  # a simulated clock travels with the payload
                op.tensor.fill_(100.0 + op.peer)
            else:
                start = self._offsets.get(op.peer, 0)
                source = self.peer_messages[op.peer].flatten()
                op.tensor.copy_(source[start : start + op.tensor.numel()])
                self._offsets[op.peer] = start + op.tensor.numel()
            works.append(FakeWork(op.peer not in self.silent))
        return works

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world_size

    def all_reduce(self, tensor, op=None, group=None):
        tensor.mul_(self.world_size)  # every replica equal: the sum is n times the tensor


@pytest.fixture
def fake(monkeypatch):
    def install(**kwargs) -> FakeDist:
        fake_dist = FakeDist(**kwargs)
        monkeypatch.setattr(transport_module, "dist", fake_dist)
        return fake_dist

    return install


def test_messages_go_out_in_slices_and_come_back_whole(fake):
    numel = 3 * 2**18 + 5  # three full 1 MiB slices of float32 and a short one
    peer_message = torch.arange(numel, dtype=torch.float32)
    communicator = fake(rank=0, world_size=2, peer_messages={1: peer_message})
    transport = GossipTransport(numel, torch.device("cpu"), timeout=1.0, bucket_cap_mb=1.0)
    message = torch.randn(numel)
    pending = transport.post(message, {1: 0.5}, round_index=7, clock=3.0)
    [(weight, received)] = transport.complete(pending)
    assert weight == 0.5 and torch.equal(received, peer_message)
    slices = [t for t in communicator.sent[1] if t.dtype == torch.float32]
    assert [s.numel() for s in slices] == [2**18, 2**18, 2**18, 5]
    assert torch.equal(torch.cat(slices), message)
    assert pending.peer_clock_values() == {1: 101.0}
    assert transport.counters.bytes_sent == transport.counters.bytes_received == numel * 4
    assert transport.counters.exchanges == 1


def test_a_peer_that_never_answers_raises_with_round_rank_and_peer(fake):
    fake(rank=2, world_size=4, peer_messages={1: torch.ones(8), 3: torch.ones(8)}, silent={3})
    transport = GossipTransport(8, torch.device("cpu"), timeout=0.5)
    pending = transport.post(torch.zeros(8), {1: 0.25, 3: 0.25}, round_index=4)
    with pytest.raises(GossipTimeoutError, match=r"gossip round 4: rank 2 .* peer\(s\) \[1, 3\] within gossip_timeout=0.5s"):
        transport.complete(pending)


def test_all_reduce_mean_counts_a_ring_all_reduce(fake):
    fake(rank=0, world_size=4, peer_messages={})
    transport = GossipTransport(6, torch.device("cpu"), timeout=1.0)
    tensor = torch.full((6,), 2.0)
    transport.all_reduce_mean(tensor)
    assert torch.equal(tensor, torch.full((6,), 2.0))
    assert transport.counters.bytes_sent == 2 * 3 * 24 // 4  # 2 (n - 1) / n of 24 bytes
