"""The communication round on stacked points: GASLoC's gossip (and the local baseline) and DiLoCo.

Each class does, for every live worker at once, what the multi-process strategy does on one rank,
with the strategies' own round (:mod:`gasloc_lightning.algorithm.round`) on ``(n, P)`` rows: the
outer step, codec and overlap act on every row at once, mixing and corrections row by row with the
topology's weights over the live set; the wire of worker j is row j of the stacked wire. Every
worker keeps its own :class:`~gasloc_lightning.network.SimulatedClock`, advanced as the strategy
advances it (post with the own clock, complete with the peers' clocks at post and the round's pairs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.round import DiLoCoRound, EncodedMean, GossipRound, check_codec, codec_bytes_per_element
from gasloc_lightning.algorithm.fragments import FragmentPoints
from gasloc_lightning.algorithm.sparse_mean import (SparseMessages, all_gather_bytes, all_gather_element_size,
                                                    check_sparse_mean)
from gasloc_lightning.algorithm.streaming import StreamingDiLoCoOuter
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.network import NetworkModel, SimulatedClock
from gasloc_lightning.topology import Topology


class _NetworkClocks:
    """One :class:`SimulatedClock` per worker under one network model."""

    def __init__(self, network: NetworkModel, workers: int) -> None:
        self.network = network
        # "elastic": the simulator's churn honours the network's preemption (a static strategy's clock refuses it)
        self.clocks = [SimulatedClock(network, rank=i, membership="elastic") for i in range(workers)]
        self._posted: dict[int, float] = {}
        self._pending: tuple[dict[int, dict[int, float]], list[tuple[int, int]], int] | None = None

    def times(self) -> list[float]:
        return [clock.time for clock in self.clocks]

    def advance_compute(self, workers: Sequence[int]) -> None:
        for i in workers:
            self.clocks[i].advance_compute(1)

    def post(self, live: Sequence[int], peers: dict[int, dict[int, float]], pairs: list[tuple[int, int]],
             element_size: float) -> None:
        self._posted = {i: self.clocks[i].post_exchange() for i in live}
        self._pending = (peers, pairs, self.network.message_bytes(element_size=element_size))

    def complete(self) -> None:
        if self._pending is None:
            return
        peers, pairs, nbytes = self._pending
        for i in self._posted:
            peer_clocks = {j: self._posted[j] for j in peers.get(i, {})}
            self.clocks[i].complete_exchange(peer_clocks=peer_clocks, pairs=pairs, nbytes=nbytes)
        self._pending = None

    def all_reduce(self, live: Sequence[int], element_size: float | None) -> None:
        latest = max(self.clocks[i].time for i in live)
        nbytes = None if element_size is None else self.network.message_bytes(element_size=element_size)
        for i in live:
            self.clocks[i].all_reduce(max_clock=latest, nbytes=nbytes, ranks=live)  # the live ring only

    def all_reduce_posted(self, live: Sequence[int], element_size: float | None, fraction: float) -> float:
        latest = max(self.clocks[i].time for i in live)
        nbytes = self.network.message_bytes(element_size=element_size) * fraction
        return latest + self.network.all_reduce_time(nbytes, ranks=live)

    def wait_until(self, live: Sequence[int], end: float) -> None:
        for i in live:
            self.clocks[i].follow(end)

    def join(self, worker: int, source: int, state_fraction: float) -> None:
        nbytes = self.network.message_bytes() * state_fraction
        transfer = self.network.pairwise_time(source, worker, nbytes) if source != worker else 0.0
        self.clocks[worker].follow(self.clocks[source].time + transfer)


class WorkerClocks:
    """The workers' simulated clocks: one :class:`SimulatedClock` per worker under the run's network (none
    without a network model) and, alongside, under every network of ``also``.

    The networks of ``also`` time the same run on other networks: the training is the run's own, so this is
    exact only where the network does not change the training (no preemption, no topology or H_i taken from
    the network; ``gasloc-sim`` checks it for ``sim.also_networks``). One run then answers "how long on each of
    these networks".

    Args:
        network: the run's network model, or None (no clock).
        workers: n.
        also: ``{name: network model}`` timed alongside (needs ``network``).
    """

    def __init__(self, network: NetworkModel | None, workers: int,
                 also: Mapping[str, NetworkModel] | None = None) -> None:
        also = dict(also or {})
        if also and network is None:
            raise ValueError(f"networks timed alongside ({sorted(also)}) need the run's own network (network=...)")
        self._boards = [] if network is None else [_NetworkClocks(model, workers) for model in (network, *also.values())]
        self.also_names = list(also)

    @property
    def enabled(self) -> bool:
        return bool(self._boards)

    @property
    def clocks(self) -> list[SimulatedClock]:
        """Every worker's clock under the run's network."""
        return self._boards[0].clocks if self.enabled else []

    def times(self) -> list[float]:
        """Every worker's simulated time under the run's network."""
        return self._boards[0].times() if self.enabled else []

    def times_also(self) -> dict[str, list[float]]:
        """Every worker's simulated time under each network timed alongside."""
        return {name: board.times() for name, board in zip(self.also_names, self._boards[1:])}

    def advance_compute(self, workers: Sequence[int]) -> None:
        for board in self._boards:
            board.advance_compute(workers)

    def post(self, live: Sequence[int], peers: dict[int, dict[int, float]], pairs: list[tuple[int, int]],
             element_size: float) -> None:
        """Every live worker posts its exchange now (its clock goes with the payload); ``element_size``: bytes
        per modelled parameter on the wire."""
        for board in self._boards:
            board.post(live, peers, pairs, element_size)

    def complete(self) -> None:
        """Finish the posted exchanges: each worker waits for its peers' clocks at post plus the transfer."""
        for board in self._boards:
            board.complete()

    def all_reduce(self, live: Sequence[int], element_size: float | None = None) -> None:
        """An all-reduce over the live workers; ``element_size``: bytes per element on the wire (quantized)."""
        for board in self._boards:
            board.all_reduce(live, element_size)

    def all_reduce_posted(self, live: Sequence[int], element_size: float | None, fraction: float) -> tuple[float, ...]:
        """An all-reduce of ``fraction`` of the model posted now by the live workers: when it ends, under each
        network (``element_size``: bytes per element when quantized; None: the network's). Give it back to
        :meth:`wait_until`."""
        return tuple(board.all_reduce_posted(live, element_size, fraction) for board in self._boards)

    def wait_until(self, live: Sequence[int], end: tuple[float, ...]) -> None:
        for board, at in zip(self._boards, end):
            board.wait_until(live, at)

    def join(self, worker: int, source: int, state_fraction: float = 0.0) -> None:
        """A joining worker starts when its source peer's state has reached it: the source's time plus the
        transfer of ``state_fraction`` modelled models (float32) over their link; the source goes on (it serves
        the state in the background, as torchft's transport does)."""
        for board in self._boards:
            board.join(worker, source, state_fraction)


def round_peers(topology: Topology, live: Sequence[int], round_index: int) -> dict[int, dict[int, float]]:
    """``{worker: {peer: w_ij}}`` of round t: the topology's graph over the live workers, in worker ids."""
    m = len(live)
    if m <= 1:
        return {i: {} for i in live}
    return {live[k]: {live[j]: w for j, w in topology.mixing_weights(k, m, round_index).items()}
            for k in range(m)}


def _index(live: Sequence[int], like: Tensor) -> Tensor:
    """The live workers' ids as an index on ``like``'s device."""
    return torch.as_tensor(list(live), device=like.device)


def _pairs(peers: dict[int, dict[int, float]]) -> list[tuple[int, int]]:
    return sorted({(min(i, j), max(i, j)) for i, row in peers.items() for j in row})


class GossipRounds:
    """GASLoC's round (and the local baseline: the ``local`` topology) on the stacked points.

    The arithmetic is :class:`~gasloc_lightning.algorithm.round.GossipRound`'s, on ``(n, P)`` rows; this
    class moves the wires between rows and keeps the clocks and byte counters.

    Args:
        initial: (n, P) float32 starting points (every row equal).
        topology: the gossip graph; its weights are taken over the live workers of each round.
        outer_lr, outer_momentum, outer_form: eta, gamma and the form of the outer step.
        overlap: fold each exchange in one round late.
        delayed_weight: beta, the scale of the late correction (overlap only).
        message_codec: how messages go on the wire (see :mod:`gasloc_lightning.algorithm.codecs`).
        error_feedback: per-edge public copies (see :class:`~gasloc_lightning.algorithm.round.EdgeCopies`).
        consensus_step: s, the factor on every correction (None: 1, or 0.05 for a top-k codec).
        clocks: the workers' simulated clocks.
        points: fragment gossip: when each fragment leaves and lands; None: whole-model rounds.
        bounds: the fragments' element ranges (with ``points``).
        fragment_update_alpha: alpha, the live share when a fragment lands.
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
        message_codec: str = "float32",
        error_feedback: bool = False,
        consensus_step: float | None = None,
        clocks: WorkerClocks,
        points: FragmentPoints | None = None,
        bounds: Sequence[tuple[int, int]] | None = None,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        check_codec(message_codec, allow_sparse=True)  # a sparse codec without error feedback: GossipRound refuses
        if topology.uses_all_reduce and (overlap or message_codec != "float32"):
            raise ValueError("overlap and lossy codecs apply to point-to-point gossip, not topology='complete'")
        workers = initial.shape[0]
        if error_feedback and workers > 1 and topology.schedule_period(workers) is None:
            raise ValueError(f"error_feedback needs edges that repeat; topology {topology.name!r} draws random "
                             "partners (use ring, torus or exponential)")
        self.topology, self.clocks = topology, clocks
        self.round = GossipRound(initial, initial.shape[1], outer_lr=outer_lr, outer_momentum=outer_momentum,
                                 outer_form=outer_form, message_codec=message_codec, overlap=overlap,
                                 delayed_weight=delayed_weight, error_feedback=error_feedback,
                                 consensus_step=consensus_step)
        self.outer = self.round.outer
        self.overlap = self.round.overlap
        self.bytes_sent = torch.zeros(initial.shape[0], dtype=torch.float64)
        self.rejected = 0  # messages refused as non-finite
        self.points, self.alpha = points, float(fragment_update_alpha)
        self.slices = [slice(lo, hi) for lo, hi in bounds] if points is not None else []
        self.fragments = [GossipRound(initial[:, part].clone(), part.stop - part.start, outer_lr=outer_lr,
                                      outer_momentum=outer_momentum, outer_form=outer_form,
                                      message_codec=message_codec, error_feedback=error_feedback,
                                      consensus_step=consensus_step)
                          for part in self.slices]
        self._sent = [torch.empty_like(initial[:, part]) for part in self.slices]
        self._fragment_in_flight: dict[int, tuple] = {}
        self._rounds_done = 0  # the current round's index (what the strategy's peers() use)

    @torch.no_grad()
    def after_step(self, flat: Tensor, step_in_round: int, live: Sequence[int]) -> bool:
        """Fragment gossip: the fragment leaving or landing after this step; returns whether ``flat`` changed."""
        if self.points is None:
            return False
        leaving, landing = self.points.leaving(step_in_round), self.points.landing(step_in_round)
        if leaving is not None:
            self._post_fragment(flat, leaving, live)
        if landing is not None:
            self._land_fragment(flat, landing)
        return landing is not None

    def _post_fragment(self, flat: Tensor, fragment: int, live: Sequence[int]) -> None:
        part, round_ = self.slices[fragment], self.fragments[fragment]
        u = self._sent[fragment].copy_(flat[:, part])
        index = _index(live, flat)
        if not bool(torch.isfinite(u.index_select(0, index)).all()):
            raise FloatingPointError(f"fragment {fragment} of a live worker is not finite")
        round_.begin(u)
        share = u.shape[1] / flat.shape[1]
        if self.topology.uses_all_reduce:
            mean = u.index_select(0, index).sum(dim=0).div_(len(live))
            u[index] = mean
            round_.mixed[index] = mean
            self.bytes_sent[list(live)] += ring_all_reduce_bytes(u.shape[1] * 4, len(live))
            end = self.clocks.all_reduce_posted(live, None, share)
            self._fragment_in_flight[fragment] = ("all_reduce", list(live), end)
            return
        peers = round_peers(self.topology, live, self._rounds_done)
        self._post(peers, live, round_, share)
        wires = {}
        for i in live:
            targets = sorted(peers[i])
            wires.update({(i, j): wire for j, wire in zip(targets, round_.messages(targets, row=i))})
        self._fragment_in_flight[fragment] = ("gossip", list(live), (wires, peers))

    def _land_fragment(self, flat: Tensor, fragment: int) -> None:
        part, round_, u = self.slices[fragment], self.fragments[fragment], self._sent[fragment]
        kind, live, extra = self._fragment_in_flight.pop(fragment)
        if kind == "all_reduce":
            self.clocks.wait_until(live, extra)
        else:
            wires, peers = extra
            for i in live:
                self._receive(u, wires, peers, i, round_)
                if round_.by_correction:
                    round_.apply_correction(u, row=i)
            self.clocks.complete()
        round_.finish(u)
        index = _index(live, flat)
        flat[index, part] = torch.lerp(u.index_select(0, index), flat[index, part], self.alpha)

    @torch.no_grad()
    def communicate(self, flat: Tensor, round_index: int, live: Sequence[int]) -> None:
        """End round t: ``flat`` holds thetaH_i (rows of live workers) and receives theta_i'."""
        self._rounds_done = round_index + 1
        if self.points is not None:
            return  # every fragment landed during the round
        round_ = self.round
        if self.overlap:
            self.clocks.complete()  # the previous round's exchange ends (in simulated time) now
            self._complete_in_flight()
        round_.begin(flat)
        if self.topology.uses_all_reduce:
            self._all_reduce(flat, live)
        else:
            peers = round_peers(self.topology, live, round_index)
            self._post(peers, live)
            wires = {}  # (sender, receiver): what travels on that edge
            for i in live:
                targets = sorted(peers[i])
                wires.update({(i, j): wire for j, wire in zip(targets, round_.messages(targets, row=i))})
            if self.overlap:
                self._in_flight = (wires, peers, list(live))
                for i in live:
                    round_.hold(flat, row=i)
            else:
                for i in live:
                    self._receive(flat, wires, peers, i)
                    if round_.by_correction:
                        round_.apply_correction(flat, row=i)
                self.clocks.complete()
        round_.finish(flat)

    _in_flight: tuple[dict[tuple[int, int], Tensor], dict[int, dict[int, float]], list[int]] | None = None

    def _receive(self, flat: Tensor | None, wires: dict[tuple[int, int], Tensor],
                 peers: dict[int, dict[int, float]], i: int, round_: GossipRound | None = None) -> None:
        round_ = round_ or self.round
        senders = sorted(peers[i])
        received = [(peers[i][j], wires[(j, i)]) for j in senders]
        if round_.by_correction:
            self.rejected += len(round_.correct(received, row=i, peers=senders))
        else:
            self.rejected += len(round_.mix(flat, received, row=i))

    def _complete_in_flight(self) -> None:
        if self._in_flight is None:
            return
        wire, peers, live = self._in_flight
        self._in_flight = None
        for i in live:
            self._receive(None, wire, peers, i)  # by correction: the point is not read

    def _post(self, peers: dict[int, dict[int, float]], live: Sequence[int], round_: GossipRound | None = None,
              share: float = 1.0) -> None:
        round_ = round_ or self.round
        for i in live:
            self.bytes_sent[i] += round_.wire_bytes * len(peers[i])
        self.clocks.post(live, peers, _pairs(peers), round_.bytes_per_element * share)

    def _all_reduce(self, flat: Tensor, live: Sequence[int]) -> None:
        index = _index(live, flat)
        mean = flat.index_select(0, index).sum(dim=0).div_(len(live))  # as the all-reduce: a sum, then / n
        flat[index] = mean
        self.round.mixed[index] = mean
        self.bytes_sent[list(live)] += ring_all_reduce_bytes(flat.shape[1] * 4, len(live))
        self.clocks.all_reduce(live)

    @torch.no_grad()
    def flush(self, flat: Tensor) -> None:
        """End of training: fold in the last delayed correction (overlap), as the strategy does, or land a
        fragment still in flight."""
        for fragment in sorted(self._fragment_in_flight):
            self._land_fragment(flat, fragment)
        if not self.overlap:
            return
        self.clocks.complete()
        self._complete_in_flight()
        self.round.flush(flat)

    @torch.no_grad()
    def restore_round_start(self, flat: Tensor, worker: int) -> None:
        """A discarded round: ``worker``'s point goes back to its round start."""
        flat[worker].copy_(self.outer.round_start[worker])

    #: Model-sized float32 tensors of the outer state a joiner receives (round start and anchor).
    outer_state_copies = 2

    @torch.no_grad()
    def join(self, worker: int, source: int, state_bytes: float) -> None:
        """A joining worker takes its source peer's outer state (round start and anchor); the source sends
        ``state_bytes`` (the whole state the elastic mode transfers: see :meth:`Simulator.join_state_bytes`)."""
        self.round.join(worker, source)
        self.bytes_sent[source] += state_bytes


class DiLoCoRounds:
    """DiLoCo's round on the stacked points: the mean pseudo-gradient of the live workers steps one
    shared round start (:class:`~gasloc_lightning.algorithm.round.DiLoCoRound`); streamed by fragments
    (:class:`~gasloc_lightning.algorithm.streaming.StreamingDiLoCoOuter`) when ``points`` is given.

    Args:
        initial: (n, P) float32 starting points (every row equal).
        outer_lr, outer_momentum: eta and gamma.
        message_codec: ``"float32"`` (exact mean) or a lossy codec: the mean a quantized all-reduce computes.
        clocks: the workers' simulated clocks.
        points: when each fragment leaves and lands (Streaming DiLoCo); None: one all-reduce per round.
        bounds: the fragments' element ranges (with ``points``).
        fragment_update_alpha: alpha, the live share when a fragment lands.
        error_feedback: every worker keeps its residual; the mean is the all-gather of the workers' wires
            (:mod:`~gasloc_lightning.algorithm.sparse_mean`; a sparse codec needs it: SparseLoCo).
        error_feedback_decay: beta, the factor on the residual.
    """

    def __init__(self, *, initial: Tensor, outer_lr: float, outer_momentum: float, clocks: WorkerClocks,
                 message_codec: str = "float32", points: FragmentPoints | None = None,
                 bounds: Sequence[tuple[int, int]] | None = None, fragment_update_alpha: float = 0.0,
                 error_feedback: bool = False, error_feedback_decay: float = 1.0) -> None:
        self.round = DiLoCoRound(initial[0], outer_lr=outer_lr, outer_momentum=outer_momentum)
        self.message_codec = check_codec(message_codec, allow_sparse=True)
        gathered = check_sparse_mean(message_codec, error_feedback=error_feedback,
                                     error_feedback_decay=error_feedback_decay, streamed=points is not None)
        if message_codec == "int2" and not gathered:
            raise ValueError("message_codec='int2' has no zero level: use int4 or int8 for DiLoCo")
        self.sparse = SparseMessages(message_codec, initial.shape[1], rows=initial.shape[0],
                                     decay=error_feedback_decay, device=initial.device) if gathered else None
        self._means: dict[int, EncodedMean] = {}  # by (live count, size)
        self.clocks = clocks
        self.points = points
        self.streaming = None if points is None else StreamingDiLoCoOuter(
            initial[0], bounds=bounds, outer_lr=outer_lr, outer_momentum=outer_momentum,
            fragment_update_alpha=fragment_update_alpha)
        self._in_flight: dict[int, tuple[Tensor, list[int], tuple[float, ...]]] = {}
        self.bytes_sent = torch.zeros(initial.shape[0], dtype=torch.float64)

    @property
    def round_start(self) -> Tensor:
        return self.round.round_start

    def _mean(self, delta: Tensor, live: Sequence[int]) -> Tensor:
        """The live workers' mean of ``delta`` (m, size), as the strategy's (quantized) all-reduce computes it."""
        m, size = delta.shape
        if self.sparse is not None:  # as the strategy: every worker's wire, all-gathered, decoded in worker order
            wires = self.sparse.encode_rows(delta, live)
            self.bytes_sent[list(live)] += all_gather_bytes(self.sparse.wire_bytes, m)
            return self.sparse.mean(wires, torch.empty(size, device=delta.device))
        if self.message_codec == "float32" or m == 1:
            self.bytes_sent[list(live)] += ring_all_reduce_bytes(size * 4, m)
            return delta.sum(dim=0).div_(m)
        encoded = self._means.setdefault((m, size), EncodedMean(self.message_codec, size, m))
        self.bytes_sent[list(live)] += 2 * (m - 1) * encoded.chunk_wire
        return encoded.mean(delta)

    @torch.no_grad()
    def after_step(self, flat: Tensor, step_in_round: int, live: Sequence[int]) -> bool:
        """Streamed rounds: the fragment leaving or landing after this step; returns whether ``flat`` changed."""
        if self.points is None:
            return False
        leaving, landing = self.points.leaving(step_in_round), self.points.landing(step_in_round)
        if leaving is not None:
            index = _index(live, flat)
            delta = self.streaming.prepare(leaving, flat.index_select(0, index))  # (m, size)
            quantized = self.message_codec != "float32"
            size = codec_bytes_per_element(self.message_codec, delta.shape[1]) if quantized else None
            # Posted now, waited on where the fragment lands (:meth:`_land`), float32 or encoded alike: the
            # engines post the quantized mean asynchronously as torchft does, so it hides under the compute
            # between the two points as the float32 all-reduce does.
            end = self.clocks.all_reduce_posted(live, size, delta.shape[1] / flat.shape[1])
            self._in_flight[leaving] = (self._mean(delta, live), list(live), end)
        if landing is not None:
            self._land(flat, landing)
        return landing is not None

    def _land(self, flat: Tensor, fragment: int) -> None:
        mean, live, end = self._in_flight.pop(fragment)
        self.clocks.wait_until(live, end)
        index = _index(live, flat)
        rows = flat.index_select(0, index)
        if not (torch.isfinite(mean).all() and torch.isfinite(rows).all()):
            raise FloatingPointError(f"fragment {fragment} is not finite (streamed rounds cannot discard a round)")
        self.streaming.perform(fragment, mean, rows)
        flat[index] = rows

    @torch.no_grad()
    def communicate(self, flat: Tensor, round_index: int, live: Sequence[int]) -> None:
        if self.streaming is not None:
            return  # every fragment landed during the round
        index = _index(live, flat)
        delta = self.round.pseudo_gradient(flat.index_select(0, index))  # (m, P) pseudo-gradients
        mean = self._mean(delta, live)
        flat[index] = self.round.step(mean)
        if self.sparse is not None:
            size = all_gather_element_size(self.sparse.wire_bytes, flat.shape[1], len(live))
        else:
            quantized = self.message_codec != "float32"
            size = codec_bytes_per_element(self.message_codec, flat.shape[1]) if quantized else None
        self.clocks.all_reduce(live, element_size=size)

    def flush(self, flat: Tensor) -> None:
        """End of training: a fragment that left lands now."""
        for fragment in sorted(self._in_flight):
            self._land(flat, fragment)

    @torch.no_grad()
    def restore_round_start(self, flat: Tensor, worker: int) -> None:
        """A discarded round: ``worker``'s point goes back to the shared round start."""
        flat[worker].copy_(self.round.round_start)

    #: Model-sized float32 tensors of the outer state a joiner receives: the elastic mode's DiLoCo is GASLoC over
    #: the complete graph, whose outer state (round start and anchor) goes to a joiner (here it is shared: nothing
    #: to copy, but the bytes are what the elastic mode sends).
    outer_state_copies = 2

    def join(self, worker: int, source: int, state_bytes: float) -> None:
        """The round start is shared: a joining worker needs only the live point (copied by the caller); the source
        sends ``state_bytes``. A joiner's error-feedback residual starts empty (its old one is stale)."""
        self.bytes_sent[source] += state_bytes
        if self.sparse is not None:
            self.sparse.reset(worker)
