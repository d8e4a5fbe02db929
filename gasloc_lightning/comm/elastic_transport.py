"""ElasticTransport: :class:`~gasloc_lightning.comm.transport.GossipTransport`'s interface over torchft's process group.

Ranks are indices in the current quorum's sorted member list (:class:`~gasloc_lightning.comm.membership.Quorum`).
Unlike the static transport, an exchange that fails does not raise: a peer that died fails fast
("Connection closed by peer"), a hung one once the exchange's single deadline has passed
(``gossip_timeout`` from posting, whatever the number of peers, so a worker asks for the next quorum
at most that late), and either way this worker keeps its own point for that peer's share (the failed
peer is left out of the received list) and the failure is counted once, in :attr:`failed_exchanges`
(a round's exchange, DiLoCo's all-reduce included) or :attr:`failed_collectives` (the other
all-reduces: consensus evaluation, the end-of-fit average). The first error of a round is kept in
:attr:`error` for the membership to report after the round's collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gasloc_lightning.comm.membership import ElasticMembership
from gasloc_lightning.comm.transport import PendingExchange, TrafficCounters, ring_all_reduce_bytes

log = logging.getLogger(__name__)

# torchft's PGTransport uses tags 1, 2, 3+i on the same process group: ours stay clear of them.
_GOSSIP_TAG = 1000


class ElasticCollectiveError(RuntimeError):
    """An all-reduce over the quorum failed (a member died or hung)."""


class ElasticTransport:
    """Point-to-point exchanges and all-reduces over the live quorum; failures are counted, not raised.

    Args:
        numel: elements of one message.
        membership: the worker's membership (its process group is reconfigured at every quorum change).
        device: where buffers live (CPU: torchft's gloo group).
    """

    def __init__(self, numel: int, membership: ElasticMembership, device: torch.device | None = None) -> None:
        self.numel, self.membership = numel, membership
        self.device = torch.device("cpu") if device is None else device
        self.dtype = torch.float32
        self.timeout = membership.gossip_timeout
        self.counters = TrafficCounters()
        self.failed_exchanges = 0
        self.failed_collectives = 0
        self.error: Exception | None = None
        self._receive_buffers: list[Tensor] = []

    @property
    def rank(self) -> int:
        return self.membership.quorum.index

    @property
    def world_size(self) -> int:
        return self.membership.quorum.size

    def take_error(self) -> Exception | None:
        """The first failure since the last call (for the membership's commit), then forget it."""
        error, self.error = self.error, None
        return error

    def receive_buffer(self, slot: int) -> Tensor:
        while len(self._receive_buffers) <= slot:
            self._receive_buffers.append(torch.empty(self.numel, dtype=self.dtype, device=self.device))
        return self._receive_buffers[slot]

    def post(self, message: Tensor, peers: Mapping[int, float], round_index: int, clock: float | None = None
             ) -> PendingExchange:
        """Start sending ``message`` to every peer (quorum indices) and receiving theirs; returns at once."""
        if clock is not None:
            raise ValueError("ElasticTransport carries no simulated clock")
        pending = PendingExchange(round_index=round_index, peers=dict(peers), deadline=time.monotonic() + self.timeout)
        pg, quorum = self.membership.process_group, self.membership.quorum
        for slot, peer in enumerate(sorted(peers)):
            incoming = self.receive_buffer(slot)
            if not quorum.usable:
                pending.works.append((peer, [_FailedWork(RuntimeError(f"unusable quorum: {quorum.error}"))]))
                pending.received.append((peers[peer], incoming))
                continue
            try:  # every receive and send is posted before any wait (a triangle cannot deadlock); the receive
                # first, so both directions flow at once (see transport._RECV_FIRST)
                works = [pg.recv([incoming], peer, _GOSSIP_TAG), pg.send([message], peer, _GOSSIP_TAG)]
            except Exception as error:  # an unconfigured group raises AssertionError
                works = [_FailedWork(error)]
            pending.works.append((peer, works))
            pending.received.append((peers[peer], incoming))
        return pending

    def complete(self, pending: PendingExchange) -> tuple[list[tuple[float, Tensor]], list[int]]:
        """Wait for each peer; returns the ``(w_ij, u_j)`` pairs and the peers that completed.

        A failed peer is left out (this worker keeps its own point for its share) and counted.
        """
        received, completed = [], []
        for (peer, works), pair in zip(pending.works, pending.received):
            failure = self._wait_all(works, pending.deadline)
            if failure is None:
                received.append(pair)
                completed.append(peer)
                self._count_bytes(pair[1], 1)
                continue
            self.failed_exchanges += 1
            self.error = self.error or failure
            log.warning("exchange failed round=%d peer=%s worker=%s error=%s", pending.round_index,
                        self.membership.quorum.names[peer], self.membership.name, _first_line(failure))
        pending.works = []
        if completed:
            self.counters.exchanges += 1
        return received, completed

    @staticmethod
    def _wait_all(works: list[Any], deadline: float | None) -> Exception | None:
        failure = None
        for work in works:  # wait for every op even after a failure: none is left half posted
            try:
                if deadline is None:
                    work.wait()
                else:  # what is left of the exchange's one deadline (0 would mean gloo's own timeout)
                    work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception as error:
                failure = failure or error
        return failure

    def _count_bytes(self, tensor: Tensor, messages: int) -> None:
        num_bytes = tensor.numel() * tensor.element_size() * messages
        self.counters.bytes_sent += num_bytes
        self.counters.bytes_received += num_bytes

    def all_reduce_mean(self, tensor: Tensor, *, round_exchange: bool = False) -> Tensor:
        """In-place mean over the quorum; :class:`ElasticCollectiveError` if a member failed (``tensor`` is
        then undefined: callers restore it). A failure is counted once: in :attr:`failed_exchanges` when the
        all-reduce is a round's exchange (``round_exchange``, DiLoCo), else in :attr:`failed_collectives`."""
        size = self.world_size
        if size <= 1:
            return tensor
        from torch.distributed import AllreduceOptions, ReduceOp

        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        try:
            if not self.membership.quorum.usable:
                raise RuntimeError(f"unusable quorum: {self.membership.quorum.error}")
            self.membership.process_group.allreduce([tensor], options).wait(timedelta(seconds=self.timeout))
        except Exception as error:
            if round_exchange:
                self.failed_exchanges += 1
            else:
                self.failed_collectives += 1
            self.error = self.error or error
            raise ElasticCollectiveError(f"all-reduce over {size} workers failed: {_first_line(error)}") from error
        tensor.div_(size)
        volume = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), size)
        self.counters.bytes_sent += volume
        self.counters.bytes_received += volume
        self.counters.exchanges += 1
        return tensor


class _FailedWork:
    """A send or receive that could not even be posted."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self._error


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
