"""The communication round on stacked points: GASLoC's gossip (and the local baseline) and DiLoCo.

Each class does, for every live worker at once, what the multi-process strategy does on one rank
(``strategies/gasloc.py`` ``_communicate`` and ``strategies/diloco.py``), with the same math modules:
the outer step is :class:`~gasloc_lightning.algorithm.outer.OuterState` on ``(n, P)`` tensors (its
updates are elementwise), mixing is :func:`~gasloc_lightning.algorithm.outer.mix` row by row with the
topology's weights over the live set, bfloat16 messages and overlap go through
:func:`~gasloc_lightning.comm.exchange.gossip_correction`, and every worker keeps its own
:class:`~gasloc_lightning.network.SimulatedClock`, advanced as the strategy advances it (post with
the own clock, complete with the peers' clocks at post and the round's pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.outer import OuterState, mix
from gasloc_lightning.comm.exchange import MESSAGE_DTYPES, gossip_correction, wire_message
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.network import NetworkModel, SimulatedClock
from gasloc_lightning.topology import Topology


class WorkerClocks:
    """One :class:`SimulatedClock` per worker (none without a network model)."""

    def __init__(self, network: NetworkModel | None, workers: int) -> None:
        self.network = network
        self.clocks = [] if network is None else [SimulatedClock(network, rank=i) for i in range(workers)]
        self._posted: dict[int, float] = {}
        self._pending: tuple[dict[int, dict[int, float]], list[tuple[int, int]], int] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.clocks)

    def times(self) -> list[float]:
        return [clock.time for clock in self.clocks]

    def advance_compute(self, workers: Sequence[int]) -> None:
        if not self.enabled:
            return
        for i in workers:
            self.clocks[i].advance_compute(1)

    def post(self, live: Sequence[int], peers: dict[int, dict[int, float]], pairs: list[tuple[int, int]],
             nbytes: int) -> None:
        """Every live worker posts its exchange now (its clock goes with the payload)."""
        if not self.enabled:
            return
        self._posted = {i: self.clocks[i].post_exchange() for i in live}
        self._pending = (peers, pairs, nbytes)

    def complete(self) -> None:
        """Finish the posted exchanges: each worker waits for its peers' clocks at post plus the transfer."""
        if not self.enabled or self._pending is None:
            return
        peers, pairs, nbytes = self._pending
        for i in self._posted:
            peer_clocks = {j: self._posted[j] for j in peers.get(i, {})}
            self.clocks[i].complete_exchange(peer_clocks=peer_clocks, pairs=pairs, nbytes=nbytes)
        self._pending = None

    def all_reduce(self, live: Sequence[int]) -> None:
        if not self.enabled:
            return
        latest = max(self.clocks[i].time for i in live)
        for i in live:
            self.clocks[i].all_reduce(max_clock=latest)

    def join(self, worker: int, source: int) -> None:
        """A joining worker starts at its source peer's time."""
        if self.enabled:
            self.clocks[worker].follow(self.clocks[source].time)


def round_peers(topology: Topology, live: Sequence[int], round_index: int) -> dict[int, dict[int, float]]:
    """``{worker: {peer: w_ij}}`` of round t: the topology's graph over the live workers, in worker ids."""
    m = len(live)
    if m <= 1:
        return {i: {} for i in live}
    return {live[k]: {live[j]: w for j, w in topology.mixing_weights(k, m, round_index).items()}
            for k in range(m)}


def _pairs(peers: dict[int, dict[int, float]]) -> list[tuple[int, int]]:
    return sorted({(min(i, j), max(i, j)) for i, row in peers.items() for j in row})


class GossipRounds:
    """GASLoC's round (and the local baseline: the ``local`` topology) on the stacked points.

    Args:
        initial: (n, P) float32 starting points (every row equal).
        topology: the gossip graph; its weights are taken over the live workers of each round.
        outer_lr, outer_momentum, outer_form: eta, gamma and the form of the outer step.
        overlap: fold each exchange in one round late (see :mod:`gasloc_lightning.comm.exchange`).
        delayed_weight: beta, the scale of the late correction (overlap only).
        message_dtype: ``"float32"`` or ``"bfloat16"`` on the wire.
        clocks: the workers' simulated clocks.
    """

    def __init__(
        self,
        *,
        initial: Tensor,
        topology: Topology,
        outer_lr: float,
        outer_momentum: float,
        outer_form: str = "anchored",
        overlap: bool = False,
        delayed_weight: float = 1.0,
        message_dtype: str = "float32",
        clocks: WorkerClocks,
    ) -> None:
        if message_dtype not in MESSAGE_DTYPES:
            raise ValueError(f"message_dtype must be one of {sorted(MESSAGE_DTYPES)}, got {message_dtype!r}")
        if not 0.0 < delayed_weight <= 1.0:
            raise ValueError(f"delayed_weight (beta) must lie in (0, 1], got {delayed_weight!r}")
        if topology.uses_all_reduce and (overlap or message_dtype != "float32"):
            raise ValueError("overlap and bfloat16 messages apply to point-to-point gossip, not topology='complete'")
        self.topology, self.clocks = topology, clocks
        self.outer = OuterState(initial, outer_lr, outer_momentum, outer_form)
        self.wire_dtype = MESSAGE_DTYPES[message_dtype]
        self.overlap = bool(overlap)
        self._scale = float(delayed_weight) if overlap else 1.0
        workers, numel = initial.shape
        self.bytes_sent = torch.zeros(workers, dtype=torch.float64)
        self._by_correction = self.overlap or self.wire_dtype != torch.float32
        self._correction = torch.zeros_like(self.outer.round_start) if self._by_correction else None
        self._ready = torch.zeros(workers, dtype=torch.bool)  # row i holds a correction not yet applied
        self._points = torch.empty_like(self.outer.round_start) if self.overlap else None

    @torch.no_grad()
    def communicate(self, flat: Tensor, round_index: int, live: Sequence[int]) -> None:
        """End round t: ``flat`` holds thetaH_i (rows of live workers) and receives theta_i'."""
        outer = self.outer
        outer.message(flat)  # u_i (z_i for post_mix), every row
        mixed = outer.mixed_destination()
        if self.topology.uses_all_reduce:
            self._all_reduce(flat, mixed, live)
        else:
            peers = round_peers(self.topology, live, round_index)
            if self._by_correction:
                self._mix_by_correction(flat, mixed, peers, live)
            else:
                self._post(peers, live)
                for i in live:
                    mix(flat[i], [(w, flat[j]) for j, w in sorted(peers[i].items())], out=mixed[i])
                self.clocks.complete()
        flat.copy_(outer.finish(flat, mixed))

    def _post(self, peers: dict[int, dict[int, float]], live: Sequence[int]) -> None:
        nbytes = self.outer.round_start.shape[1] * self.wire_dtype.itemsize
        for i in live:
            self.bytes_sent[i] += nbytes * len(peers[i])
        network = self.clocks.network
        wire_bytes = network.message_bytes(element_size=self.wire_dtype.itemsize) if network is not None else 0
        self.clocks.post(live, peers, _pairs(peers), wire_bytes)

    def _all_reduce(self, flat: Tensor, mixed: Tensor, live: Sequence[int]) -> None:
        index = torch.as_tensor(list(live))
        mean = flat.index_select(0, index).sum(dim=0).div_(len(live))  # as the all-reduce: a sum, then / n
        flat[index] = mean
        mixed[index] = mean
        self.bytes_sent[index] += ring_all_reduce_bytes(flat.shape[1] * 4, len(live))
        self.clocks.all_reduce(live)

    def _mix_by_correction(self, flat: Tensor, mixed: Tensor, peers: dict[int, dict[int, float]],
                           live: Sequence[int]) -> None:
        """theta' = u + C (bfloat16 messages), or with overlap p = u + beta C(t-1), posted as the next message."""
        correction = self._correction
        if self.overlap:
            self.clocks.complete()  # the previous round's exchange ends (in simulated time) now
            points = self._points
            for i in live:
                if self._ready[i]:
                    torch.add(correction[i], flat[i], out=points[i])  # p = C(t-1) + u
                else:
                    points[i].copy_(flat[i])
            self._ready.zero_()
            sent = points
        else:
            sent = flat
        self._post(peers, live)
        wire = wire_message(sent, self.wire_dtype)
        for i in live:
            received = [(w, wire[j]) for j, w in sorted(peers[i].items())]
            if received:
                gossip_correction(wire[i], received, self._scale, out=correction[i])
            if self.overlap:
                self._ready[i] = bool(received)
                mixed[i].copy_(sent[i])
            elif received:
                torch.add(flat[i], correction[i], out=mixed[i])
            else:
                mixed[i].copy_(flat[i])
        if not self.overlap:
            self.clocks.complete()

    @torch.no_grad()
    def flush(self, flat: Tensor) -> None:
        """End of training: fold in the last delayed correction (overlap), as the strategy does."""
        if not self.overlap:
            return
        self.clocks.complete()
        rows = self._ready.nonzero().flatten()
        flat[rows] += self._correction[rows]
        self.outer.round_start[rows] += self._correction[rows]
        self._ready.zero_()

    @torch.no_grad()
    def join(self, worker: int, source: int) -> None:
        """A joining worker takes its source peer's outer state (round start and anchor)."""
        for buffer in (self.outer.round_start, self.outer.anchor):
            buffer[worker].copy_(buffer[source])
        self.bytes_sent[worker] += self.outer.round_start.shape[1] * 4 * 2  # the state it was sent


class DiLoCoRounds:
    """DiLoCo's round on the stacked points: the mean pseudo-gradient of the live workers steps one
    shared round start with ``torch.optim.SGD(lr=eta, momentum=gamma, nesterov=gamma > 0)``.

    Args:
        initial: (n, P) float32 starting points (every row equal).
        outer_lr, outer_momentum: eta and gamma.
        clocks: the workers' simulated clocks.
    """

    def __init__(self, *, initial: Tensor, outer_lr: float, outer_momentum: float, clocks: WorkerClocks) -> None:
        self.round_start = torch.nn.Parameter(initial[0].clone())
        self.optimizer = torch.optim.SGD([self.round_start], lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)
        self.clocks = clocks
        self.bytes_sent = torch.zeros(initial.shape[0], dtype=torch.float64)

    @torch.no_grad()
    def communicate(self, flat: Tensor, round_index: int, live: Sequence[int]) -> None:
        index = torch.as_tensor(list(live))
        delta = torch.sub(self.round_start, flat.index_select(0, index))  # (m, P) pseudo-gradients
        self.round_start.grad = delta.sum(dim=0).div_(len(live))
        self.optimizer.step()
        self.round_start.grad = None
        flat[index] = self.round_start.detach()
        self.bytes_sent[index] += ring_all_reduce_bytes(flat.shape[1] * 4, len(live))
        self.clocks.all_reduce(live)

    def flush(self, flat: Tensor) -> None:
        """Nothing is in flight with an all-reduce."""

    def join(self, worker: int, source: int) -> None:
        """The round start is shared: a joining worker needs only the live point (copied by the caller)."""
