"""GossipTransport: point-to-point exchange of flat points with this round's peers, and the all-reduce mean.

With :mod:`~gasloc_lightning.comm.encoded_mean` (the quantized mean's phases, and its asynchronous form), the
only module that talks to a process group (elastic: ``comm/elastic_transport.py``). It knows nothing about the
outer step."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.algorithm.sparse_mean import SparseMessages, all_gather_bytes
from gasloc_lightning.comm.encoded_mean import AsyncEncodedMean, EncodedAllReduce, PendingEncodedMean, dedicated_group

log = logging.getLogger(__name__)



_POLL_S = 2e-4  # host polling period of an NCCL exchange


class GossipTimeoutError(RuntimeError):
    """A peer did not complete its part of an exchange before the deadline."""


@dataclass
class PendingExchange:
    """An exchange posted with :meth:`GossipTransport.post`, to be finished by ``complete``."""

    round_index: int
    peers: dict[int, float]
    works: list = field(default_factory=list)
    received: list[tuple[float, Tensor]] = field(default_factory=list)
    # Simulated clocks sent with the payload (float64, so both ends compute the same times).
    peer_clocks: dict[int, Tensor] = field(default_factory=dict)
    # time.monotonic() by which every peer's send and receive must be done (elastic: one deadline per exchange).
    deadline: float | None = None

    def peer_clock_values(self) -> dict[int, float]:
        return {peer: float(clock.item()) for peer, clock in self.peer_clocks.items()}


@dataclass
class TrafficCounters:
    """Bytes this worker moved, counted where they are sent (all-reduce: the ring algorithm's volume)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges: int = 0

    def state_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "exchanges": self.exchanges}

    def load_state_dict(self, state: Mapping) -> None:
        self.bytes_sent, self.bytes_received = int(state["bytes_sent"]), int(state["bytes_received"])
        self.exchanges = int(state["exchanges"])


# _RECV_FIRST: gloo posts a batch's operations one by one. When both ends of a pair post their send
# first, each side's data waits for the other's receive, and the two directions go one after the
# other: on a shaped link (gasloc-netlab) a lone pair's exchange took 0.78 s send-first, 0.44 s with
# the receive posted first (docs/netlab.md). NCCL groups a batch, so the order costs nothing there.


def ring_all_reduce_bytes(num_bytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``num_bytes``: 2 (n - 1) / n of it."""
    return 0 if world_size <= 1 else math.ceil(2 * (world_size - 1) * num_bytes / world_size)


class GossipTransport:
    """Point-to-point exchange of flat float32 points with this round's peers.

    Receive buffers are allocated once per peer slot and reused. Messages larger than
    ``bucket_cap_mb`` go out as several contiguous slices of the same buffer (no copies).
    A worker waits only for its own peers: there is no barrier in the gossip path.

    Args:
        numel: elements of one message.
        device: where buffers live (CUDA for NCCL, CPU for gloo).
        timeout: deadline in seconds for one exchange to complete.
        bucket_cap_mb: largest single send, in MiB.
        group: process group (default: the world).
        dtype: dtype of the messages (and of the receive buffers).
    """

    def __init__(
        self,
        numel: int,
        device: torch.device,
        timeout: float,
        bucket_cap_mb: float = 64.0,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.numel, self.device, self.timeout, self.group = numel, device, float(timeout), group
        self.dtype = dtype
        self._bucket_numel = max(1, int(bucket_cap_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
        self._receive_buffers: list[Tensor] = []
        self._encoded: dict[tuple[str, int, int], EncodedAllReduce] = {}  # by (codec, numel, world)
        self.counters = TrafficCounters()
        self._async_encoded: AsyncEncodedMean | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def receive_buffer(self, slot: int) -> Tensor:
        while len(self._receive_buffers) <= slot:
            self._receive_buffers.append(torch.empty(self.numel, dtype=self.dtype, device=self.device))
        return self._receive_buffers[slot]

    def _buckets(self, flat: Tensor) -> list[Tensor]:
        return list(flat.split(self._bucket_numel))

    def post(
        self, message: Tensor | Sequence[Tensor], peers: Mapping[int, float], round_index: int,
        clock: float | None = None,
    ) -> PendingExchange:
        """Start sending ``message`` (and this worker's simulated ``clock``, if any) to every peer and
        receiving theirs; returns at once. ``message`` may also be one tensor per peer, in sorted peer order
        (error feedback sends each peer its own difference)."""
        pending = PendingExchange(round_index=round_index, peers=dict(peers))
        if not peers:
            return pending
        messages = [message] * len(peers) if isinstance(message, Tensor) else list(message)
        if len(messages) != len(peers):
            raise ValueError(f"{len(messages)} messages for {len(peers)} peers")
        ops = [] if clock is None else self._clock_ops(clock, peers, pending)
        for slot, (peer, outgoing) in enumerate(zip(sorted(peers), messages)):
            incoming = self.receive_buffer(slot)[: outgoing.numel()]  # a fragment fills the front of the buffer
            for send, recv in zip(self._buckets(outgoing), self._buckets(incoming)):  # receive posted first: _RECV_FIRST
                ops.append(dist.P2POp(dist.irecv, recv, peer, group=self.group))
                ops.append(dist.P2POp(dist.isend, send, peer, group=self.group))
            pending.received.append((peers[peer], incoming))
        pending.works = dist.batch_isend_irecv(ops)
        num_bytes = sum(m.numel() * m.element_size() for m in messages)
        self.counters.bytes_sent += num_bytes
        self.counters.bytes_received += num_bytes
        self.counters.exchanges += 1
        return pending

    def _clock_ops(self, clock: float, peers: Mapping[int, float], pending: PendingExchange) -> list:
        outgoing = torch.tensor([clock], dtype=torch.float64, device=self.device)
        ops = []
        for peer in sorted(peers):
            pending.peer_clocks[peer] = torch.empty(1, dtype=torch.float64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, pending.peer_clocks[peer], peer, group=self.group))
            ops.append(dist.P2POp(dist.isend, outgoing, peer, group=self.group))
        return ops

    def complete(self, pending: PendingExchange) -> list[tuple[float, Tensor]]:
        """Wait (at most ``timeout`` seconds) for this worker's own peers; returns ``(w_ij, u_j)`` pairs.

        On gloo, ``work.wait(timeout)`` blocks the host until the deadline. On NCCL it only orders the
        current CUDA stream after the work, so a dead peer would never raise: there the host polls
        ``work.is_completed()`` until the deadline instead. A timed-out NCCL exchange leaves its
        communicator unusable, so the error is final for the process (as any NCCL timeout).
        """
        end = time.monotonic() + self.timeout
        for work in pending.works:
            try:
                completed = self._wait(work, end)
            except RuntimeError as error:
                raise self._timeout_error(pending, error) from error
            if completed is False:
                raise self._timeout_error(pending, None)
        pending.works = []
        return pending.received

    def _wait(self, work: dist.Work, end: float) -> bool:
        if self.device.type != "cuda":
            return work.wait(timedelta(seconds=max(0.0, end - time.monotonic())))
        while not work.is_completed():
            if time.monotonic() > end:
                return False
            time.sleep(_POLL_S)
        work.wait()
        return True

    def _timeout_error(self, pending: PendingExchange, cause: Exception | None) -> GossipTimeoutError:
        peers = sorted(pending.peers)
        detail = f": {cause}" if cause else ""
        return GossipTimeoutError(
            f"gossip round {pending.round_index}: rank {self.rank} did not complete its exchange with "
            f"peer(s) {peers} within gossip_timeout={self.timeout:g}s (a peer stalled or died){detail}"
        )

    def all_reduce_mean(self, tensor: Tensor) -> Tensor:
        """In-place mean over every worker (the complete graph); counted as a ring all-reduce."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        tensor.div_(self.world_size)
        volume = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.counters.bytes_sent += volume
        self.counters.bytes_received += volume
        self.counters.exchanges += 1
        return tensor

    def post_all_reduce_mean(self, tensor: Tensor) -> Any:
        """Start an in-place all-reduce mean of ``tensor`` (overlapped with compute); finish it with
        :meth:`wait_all_reduce_mean`. Counted as a ring all-reduce."""
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        volume = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.counters.bytes_sent += volume
        self.counters.bytes_received += volume
        self.counters.exchanges += 1
        return work

    def wait_all_reduce_mean(self, work: Any, tensor: Tensor) -> Tensor:
        """Wait (at most ``timeout`` seconds, host-side) for a posted all-reduce mean; ``tensor`` then holds it."""
        end = time.monotonic() + self.timeout
        try:
            completed = self._wait(work, end)
        except RuntimeError as error:
            raise GossipTimeoutError(f"rank {self.rank}: an all-reduce did not complete within "
                                     f"gossip_timeout={self.timeout:g}s: {error}") from error
        if completed is False:
            raise GossipTimeoutError(f"rank {self.rank}: an all-reduce did not complete within "
                                     f"gossip_timeout={self.timeout:g}s")
        return tensor.div_(self.world_size)

    def all_reduce_mean_encoded(self, tensor: Tensor, message_codec: str) -> Tensor:
        """In-place mean over every worker, sent encoded by ``message_codec`` (a quantized all-reduce), blocking.

        The chunks of :class:`~gasloc_lightning.algorithm.round.EncodedMean` travel by an all-to-all (each
        worker receives every worker's encoding of the chunk it owns), and the encoded means by an
        all-gather: 2 (n - 1) / n of the encoded vector per worker, as a ring all-reduce of it. The
        asynchronous form (the same bits) is :class:`~gasloc_lightning.comm.encoded_mean.AsyncEncodedMean`.
        """
        key = (message_codec, tensor.numel(), self.world_size)  # one set of buffers per size: fragments differ
        if key not in self._encoded:
            self._encoded[key] = EncodedAllReduce(message_codec, tensor.numel(), self.world_size, tensor.device)
        exchange = self._encoded[key]
        exchange.encode(tensor)
        exchange.exchange(self.group)
        exchange.decode(tensor)
        self.counters.bytes_sent += exchange.volume
        self.counters.bytes_received += exchange.volume
        self.counters.exchanges += 1
        return tensor

    def all_gather_sparse_mean(self, wire: Tensor, messages: SparseMessages, out: Tensor) -> Tensor:
        """The mean of every worker's (sparse) wire into ``out``, blocking: an all-gather of the n wires, each
        worker decoding all n and summing them in rank order (the bits the simulator computes from the same
        wires). Counted as a ring all-gather: (n - 1) wires sent (and received) per worker."""
        gathered = messages.new_wires(self.world_size)  # (n, W), row j from rank j
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(gathered.view(-1), wire.view(-1), group=self.group)
        volume = all_gather_bytes(wire.numel(), self.world_size)
        self.counters.bytes_sent += volume
        self.counters.bytes_received += volume
        self.counters.exchanges += 1
        return messages.mean(gathered, out)

    def open_encoded_means(self, rank_lists: Sequence[Sequence[int]], rank: int) -> None:
        """Make :meth:`post_all_reduce_mean_encoded` possible: a process group of its own for the quantized means
        that run under compute (see :mod:`~gasloc_lightning.comm.encoded_mean` for why). A collective of the
        whole world: ``rank_lists`` holds every group like this transport's (one list per shard), the same on
        every rank; ``rank`` is this process's global rank."""
        if self._async_encoded is None:
            group = dedicated_group(rank_lists, rank, timeout=self.timeout)
            self._async_encoded = AsyncEncodedMean(group, timeout=self.timeout, device=self.device)

    def post_all_reduce_mean_encoded(self, tensor: Tensor, message_codec: str) -> PendingEncodedMean:
        """Start the quantized mean of ``tensor`` (the same bits as :meth:`all_reduce_mean_encoded`) and return at
        once; ``tensor`` is read now and holds the mean after :meth:`wait_all_reduce_mean_encoded`."""
        if self._async_encoded is None:
            raise RuntimeError("post_all_reduce_mean_encoded before open_encoded_means")
        pending = self._async_encoded.post(tensor, message_codec)
        self.counters.bytes_sent += pending.volume
        self.counters.bytes_received += pending.volume
        self.counters.exchanges += 1
        return pending

    def wait_all_reduce_mean_encoded(self, pending: PendingEncodedMean) -> Tensor:
        """Wait (at most ``timeout`` seconds, host-side) for a posted quantized mean; returns its tensor."""
        try:
            return self._async_encoded.wait(pending)
        except (RuntimeError, TimeoutError) as error:
            raise GossipTimeoutError(f"rank {self.rank}: a quantized all-reduce did not complete within "
                                     f"gossip_timeout={self.timeout:g}s: {error}") from error

    def close(self) -> None:
        """Let the quantized means' worker thread end (its process group goes with the world's)."""
        if self._async_encoded is not None:
            self._async_encoded.close()
            self._async_encoded = None
