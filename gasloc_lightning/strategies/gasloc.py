"""``GASLoCStrategy``: the gossip round of GASLoC wired into Lightning.

The round machinery (local steps, checkpoints, evaluation on the consensus model, guards) is
:class:`~gasloc_lightning.strategies.local_steps.LocalStepsStrategy`; this module adds what is GASLoC's own:
the topology and its stability check, the outer step, and the exchange with this round's peers.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from gasloc_lightning.algorithm.outer import OuterState, validate_outer_hyperparameters
from gasloc_lightning.algorithm import fused as fused_kernels
from gasloc_lightning.algorithm.fragments import FragmentPoints
from gasloc_lightning.algorithm.round import GossipRound, all_finite, check_codec, resolve_consensus_step, wire_format
from gasloc_lightning.network import round_pairs
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy, _register_variants
from gasloc_lightning.algorithm.stability import SWITCHING_SAFE_MOMENTUM
from gasloc_lightning.topology import TOPOLOGIES, Topology, build_topology
from gasloc_lightning.comm.transport import PendingExchange

log = logging.getLogger(__name__)

__all__ = ["GASLoCStrategy", "LocalStepsStrategy"]


class GASLoCStrategy(LocalStepsStrategy):
    """GASLoC: H local steps, then a sparse randomized gossip round with DiLoCo's outer momentum folded in.

    Cagnasso, Belilovsky, Oyallon, "Unifying Local Communications and Local Updates for LLM
    Pretraining", arXiv 2606.11081. Each worker runs H steps of its own optimizer on its own
    data, forms z_i = theta_i + eta (thetaH_i - theta_i), sends u_i = z_i + gamma (z_i - x_i) to
    this round's peers, and moves to theta_i' = u_i - sum_j w_ij (u_i - u_j). On the complete
    graph this is exactly DiLoCo; on sparse graphs no global collective is needed.

    On failure: a peer that does not complete its exchange within ``gossip_timeout`` raises
    :class:`~gasloc_lightning.comm.transport.GossipTimeoutError` naming the round, this rank and the peer.

    Args:
        inner_steps: H, optimizer steps per round.
        outer_lr: eta, the outer learning rate (> 0).
        outer_momentum: gamma in [0, 1); ``None`` takes the topology's default (inside its stability region).
        outer_form: ``"anchored"`` (default; stable on random graphs) or ``"post_mix"`` (fixed graphs).
        topology: a name (``one_peer``, ``two_peer``, ``ring``, ``torus``, ``exponential``, ``complete``,
            ``local``) or a :class:`~gasloc_lightning.topology.Topology` object.
        seed: shared seed of the random graph schedule (every rank derives the same peers from it).
        overlap: post round t's exchange and start round t+1 at once; the peers' points are folded in
            one round late (see :mod:`gasloc_lightning.comm.exchange`). Costs one more model-size buffer.
        delayed_weight: beta in (0, 1], the scale of the one-round-late correction with overlap (1: the
            whole correction; smaller values damp it and slow consensus down).
        message_codec: how points go on the wire: ``"float32"``, ``"bfloat16"`` (half the bytes), ``"int8"`` or
            ``"fp8"`` (about a quarter, per-block scales included), ``"int4"``, ``"int2"`` (see
            :mod:`gasloc_lightning.algorithm.codecs`). Each worker mixes with its own *decoded* message, so the
            replicas' mean is preserved exactly; only their disagreement sees the rounding.
        message_dtype: the former name of ``message_codec`` (``"float32"`` or ``"bfloat16"``).
        error_feedback: with a lossy codec, send each peer the encoded difference between this worker's point
            and the public copy that peer holds of it (CHOCO-gossip per edge; two model copies per neighbour).
            Needs a topology whose edges repeat (``ring``, ``torus``, ``exponential``, a fixed custom graph).
            A sparse ``message_codec`` (top-k, e.g. ``"topk-0.01-int4"``) needs it.
        consensus_step: s in (0, 1], the factor on every correction (CHOCO's consensus step). None: 1, or 0.05
            for a top-k codec, whose per-edge copies diverge under the full step (benchmarks/topk_gossip.py,
            docs/algorithm.md).
        fragments: F, fragments of the model gossiped in turn (fragment gossip, as Streaming DiLoCo): fragment f
            runs its own round (outer state, message, mix) after step floor((f+1) H / F), so the peak traffic is
            1/F of a whole-model round. 1: the whole model at the round's end.
        fragment_sync_delay: tau, steps between a fragment's message leaving and its mix landing; the exchange
            runs under those steps of compute.
        fragment_update_alpha: alpha in [0, 1]: when a fragment lands the live fragment becomes
            ``lerp(theta', live, alpha)`` (0: the round's result; the tau steps in between are dropped).
        **kwargs: the arguments of :class:`LocalStepsStrategy` (timeouts, ``on_nonfinite``, ``cpu_threads``,
            ``start_method`` and Lightning's ``DDPStrategy`` arguments).
    """

    strategy_name = "gasloc"

    def __init__(
        self,
        *,
        inner_steps: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float | None = None,
        outer_form: Literal["anchored", "post_mix"] = "anchored",
        topology: str | Topology = "one_peer",
        seed: int = 0,
        overlap: bool = False,
        delayed_weight: float = 1.0,
        message_codec: str | None = None,
        message_dtype: Literal["float32", "bfloat16"] | None = None,
        error_feedback: bool = False,
        consensus_step: float | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if isinstance(topology, str) and topology.lower() not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {sorted(TOPOLOGIES)} or a Topology, got {topology!r}")
        validate_outer_hyperparameters(outer_lr, 0.0 if outer_momentum is None else outer_momentum, outer_form)
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        message_codec = _resolve_codec(message_codec, message_dtype)
        if error_feedback and message_codec == "float32":
            raise ValueError("error_feedback=True needs a lossy message_codec (int8, fp8, int4, int2 or bfloat16)")
        resolve_consensus_step(message_codec, consensus_step, error_feedback=error_feedback)  # refuse now, not at setup
        if not 0.0 < delayed_weight <= 1.0:
            raise ValueError(f"delayed_weight (beta) must lie in (0, 1], got {delayed_weight!r}")
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha (alpha) must lie in [0, 1], got {fragment_update_alpha!r}")
        streamed = fragments != 1 or fragment_sync_delay != 0 or fragment_update_alpha != 0.0
        if streamed and overlap:
            raise ValueError("overlap=True delays whole-model rounds; with fragments use fragment_sync_delay instead")
        super().__init__(inner_steps=inner_steps, **kwargs)
        self._fragments = FragmentGossip(fragments, fragment_sync_delay, fragment_update_alpha) if streamed else None
        self._overlap = bool(overlap)
        self._delayed_weight = float(delayed_weight)
        self._message_codec = message_codec
        self._error_feedback = bool(error_feedback)
        self._consensus_step = consensus_step
        self._round: GossipRound | None = None
        self._pending: PendingExchange | None = None  # an overlapped exchange in flight
        self._completed: PendingExchange | None = None  # the last finished exchange (its peers' clocks)
        self._topology = build_topology(topology, seed=seed)
        self._outer_lr = float(outer_lr)
        self._requested_momentum = outer_momentum
        self._outer_momentum: float | None = outer_momentum
        self._outer_form = outer_form
        self._seed = seed

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def outer_lr(self) -> float:
        return self._outer_lr

    @property
    def outer_momentum(self) -> float:
        """gamma; resolved from the topology's default once the world size is known."""
        if self._outer_momentum is None:
            raise RuntimeError("outer_momentum is resolved when the world size is known (Trainer construction)")
        return self._outer_momentum

    @property
    def outer_form(self) -> str:
        return self._outer_form

    @property
    def outer_state(self) -> OuterState | None:
        return None if self._round is None else self._round.outer

    @property
    def overlap(self) -> bool:
        """Whether each exchange overlaps the next round (folded in one round late)."""
        return self._overlap

    @property
    def message_codec(self) -> str:
        """How points go on the wire (see :mod:`gasloc_lightning.algorithm.codecs`)."""
        return self._message_codec

    @property
    def error_feedback(self) -> bool:
        return self._error_feedback

    @property
    def consensus_step(self) -> float | None:
        """s as given (None: the codec's default, see :func:`~gasloc_lightning.algorithm.round.resolve_consensus_step`)."""
        return self._consensus_step

    @property
    def fused_round(self) -> bool:
        """Whether rounds run as fused kernels (:mod:`gasloc_lightning.algorithm.fused`; set up with the round)."""
        return self._round is not None and self._round.fused

    @property
    @override
    def message_dtype(self) -> torch.dtype:
        """The dtype of the tensor on the wire (``torch.uint8`` for the quantized codecs)."""
        return wire_format(self._message_codec, 1)[1]

    @override
    def wire_format(self, numel: int) -> tuple[int, torch.dtype]:
        return wire_format(self._message_codec, numel)

    @override
    def check_configuration(self, world_size: int) -> None:
        """Resolve gamma for ``world_size`` and refuse unstable or impossible configurations."""
        super().check_configuration(world_size)
        world_size //= self.ranks_per_worker  # the graph connects workers
        if self._error_feedback and world_size > 1 and self._topology.schedule_period(world_size) is None:
            raise ValueError(
                f"error_feedback=True needs edges that repeat, and topology {self._topology.name!r} draws random "
                "partners: use ring, torus or exponential, or turn error_feedback off (see docs/algorithm.md)"
            )
        if self._fragments is not None:
            if len({self._schedule.inner_steps(rank) for rank in range(world_size * self.ranks_per_worker)}) > 1:
                raise ValueError("fragments need one inner_steps for every worker (streamed rounds stay aligned)")
            if self.ranks_per_worker > 1 and not self.sharded:  # a sharded worker streams each shard's fragments
                raise ValueError("fragments with ranks_per_worker > 1 and intra_worker='ddp' are not supported yet: "
                                 "use ranks_per_worker=1, or intra_worker='fsdp'")
            self._fragments.configure(self._schedule.round_length)
        if self._topology.uses_all_reduce and (self._overlap or self._message_codec != "float32"):
            raise ValueError(
                "overlap=True and message_codec other than 'float32' apply to point-to-point gossip; "
                "topology='complete' is an all-reduce (use a sparse topology, or DiLoCoStrategy)"
            )
        self._outer_momentum = self._topology.resolve_momentum(world_size, self._requested_momentum, self._outer_form,
                                                               **self._delayed_form())
        if world_size > 1 and self._topology.name != "local":
            self._warn_about_margins(world_size)

    def _delayed_form(self) -> dict[str, Any]:
        """Keyword arguments of the topology's stability queries for the delayed (overlapped) form."""
        return {"overlap": True, "delayed_weight": self._delayed_weight} if self._overlap else {}

    def _check_stability(self, world_size: int) -> None:
        """Refuse gamma if it does not contract with ``world_size`` workers; warn where the margin is thin."""
        self._topology.check_momentum(world_size, self._outer_momentum, self._outer_form, **self._delayed_form())
        self._warn_about_margins(world_size)

    def _warn_about_margins(self, world_size: int) -> None:
        gamma = self._outer_momentum
        if not type(self._topology).__module__.startswith("gasloc_lightning.topology.") and self._topology.time_varying:
            if gamma > SWITCHING_SAFE_MOMENTUM:
                rank_zero_warn(
                    f"a custom time-varying topology with outer_momentum {gamma} > {SWITCHING_SAFE_MOMENTUM} "
                    "(the bound certified for any switching sequence): stability was only checked by simulation"
                )
        if not self._topology.is_positive_semidefinite(world_size):
            rank_zero_warn(
                f"topology {self._topology.name!r} has mixing weights that are stable but not positive "
                "semidefinite; the stability margin is smaller than with PSD weights"
            )

    @override
    def _init_outer_state(self) -> None:
        if self._outer_momentum is None or self.num_workers <= 1:
            self.check_configuration(self.world_size)
        if self.num_workers <= 1:
            rank_zero_info("GASLoC with a single worker: local training with outer steps, no communication.")
        if self._fragments is not None:
            self._round = None
            self._build_fragments()
            return
        self._round = GossipRound(
            self.layout.read(), self.layout.num_parameter_elements, outer_lr=self._outer_lr,
            outer_momentum=self.outer_momentum, outer_form=self._outer_form, message_codec=self._message_codec,
            overlap=self._overlap, delayed_weight=self._delayed_weight, error_feedback=self._error_feedback,
            consensus_step=self._consensus_step,
            # fused kernels round differently in the last bits: the ranks of one worker must all run the same code
            fused=False if self.ranks_per_worker > 1 or self._topology.uses_all_reduce else None,
        )
        if self._round.fused:
            fused_kernels.warm_up(self.root_device)  # compile now, not while the first round's peers wait
        self._pending = self._completed = None

    def _build_fragments(self) -> None:
        if self._fragments.points is None:
            self.check_configuration(self.world_size)
        self._fragments.build(
            self.layout.read(), self.layout.fragment_bounds(self._fragments.count), self.layout.num_parameter_elements,
            outer_lr=self._outer_lr, outer_momentum=self.outer_momentum, outer_form=self._outer_form,
            message_codec=self._message_codec, error_feedback=self._error_feedback,
            consensus_step=self._consensus_step, fused=False if self._topology.uses_all_reduce else None,
        )
        if any(round_.fused for round_ in self._fragments.rounds):
            fused_kernels.warm_up(self.root_device)  # compile now, not while the first fragment's peers wait

    # ------------------------------------------------------------------ fragment gossip (streamed rounds)
    @override
    @torch.no_grad()
    def _after_inner_step(self, step_in_round: int) -> None:
        fragments = self._fragments
        if fragments is None:
            return
        leaving = fragments.points.leaving(step_in_round)
        if leaving is not None:
            self._post_fragment(leaving)
        landing = fragments.points.landing(step_in_round)
        if landing is not None:
            self._complete_fragment(landing)
            live = self.layout.read()
            fragments.land(landing, live)
            self.layout.scatter(live)

    def _post_fragment(self, fragment: int) -> None:
        """Fragment f leaves: its u (from the live fragment) goes to this round's peers, or into an all-reduce."""
        fragments = self._fragments
        u = fragments.sent[fragment].copy_(self.layout.read()[fragments.slices[fragment]])
        if not all_finite(u):
            raise FloatingPointError(f"{self._where()}: fragment {fragment} is not finite. Streamed rounds "
                                     "(fragments > 1 or fragment_sync_delay > 0) cannot discard a round, so "
                                     "on_nonfinite='skip_round' does not apply to them: lower the learning rate, or "
                                     "use fragments=1 to keep that recovery")
        round_ = fragments.rounds[fragment]
        share = u.numel() / self.layout.numel
        if self._topology.uses_all_reduce:
            round_.begin(u, send=False)
            end = None if self._round_clock is None else self._round_clock.on_all_reduce_posted(fraction=share)
            work = self._transport.post_all_reduce_mean(u) if self.world_size > 1 else None
            fragments.in_flight[fragment] = (work, end)
            return
        exchanging = self.world_size > 1
        round_.begin(u, send=exchanging)
        clock = self._round_clock.on_post() if self._round_clock is not None else None
        peers = self.peers()
        pending = None
        if exchanging:
            pending = self._transport.post(round_.messages(sorted(peers)), peers, self.round_index, clock)
        fragments.in_flight[fragment] = (pending, share)

    def _complete_fragment(self, fragment: int) -> None:
        """Finish fragment f's exchange and its round (into ``sent``); the live fragment takes it when it lands."""
        fragments = self._fragments
        if fragment not in fragments.in_flight:
            return  # completed early (before an evaluation or a checkpoint)
        round_, u = fragments.rounds[fragment], fragments.sent[fragment]
        handle, extra = fragments.in_flight.pop(fragment)
        if self._topology.uses_all_reduce:
            if handle is not None:
                self._transport.wait_all_reduce_mean(handle, u)
            if extra is not None:
                self._round_clock.wait_until(extra)
            round_.mixed.copy_(u[: round_.num_parameters])
        else:
            self._receive(round_, u, handle, fraction=extra)
        round_.finish(u)

    @override
    def _drain_exchanges(self) -> None:
        """Finish the exchanges in flight (if any): an overlapped one's correction is folded in next round, a
        fragment's result lands at its step."""
        if self._fragments is not None:
            for fragment in sorted(self._fragments.in_flight):
                self._complete_fragment(fragment)
            return
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self._completed = pending
        received = self._transport.complete(pending)
        self._reject(self._round.correct(received, peers=sorted(pending.peers)), pending)

    def _reject(self, rejected: list[int], pending: PendingExchange) -> None:
        """Count the messages the round refused as non-finite, by peer."""
        peers = sorted(pending.peers)
        for index in rejected:
            self._guard.reject(peers[index], self._where())

    @override
    @torch.no_grad()
    def _flush_exchanges(self) -> None:
        if self._fragments is not None:  # end of training: a fragment that left lands now
            for fragment in sorted(self._fragments.in_flight):
                self._complete_fragment(fragment)
                live = self.layout.read()
                self._fragments.land(fragment, live)
                self.layout.scatter(live)
            return
        if self._round is None or not self._round.by_correction:
            return
        self._drain_exchanges()
        self._complete_clock(self._completed)
        live = self.layout.read()
        self._round.flush(live)  # the last delayed term: theta += C for the live point and the round start
        if self.ranks_per_worker > 1:  # only the leader exchanged: its ranks take the result
            self.broadcast_in_worker(live, self._round.outer.round_start)
        self.layout.scatter(live)

    def peers(self, round_index: int | None = None) -> dict[int, float]:
        """This rank's peers and mixing weights w_ij in round t: the global ranks of the peer workers' leaders, or
        with sharded workers of the ranks holding this rank's shard in the peer workers.

        Defaults to the current round; empty for ranks that do not exchange (non-leaders, single worker).
        """
        if self.num_workers <= 1 or not self.exchanges_for_worker:
            return {}
        t = self.round_index if round_index is None else round_index
        weights = self._topology.mixing_weights(self.worker_index, self.num_workers, t)
        return {self._workers.peer_rank(peer, self.global_rank): weight for peer, weight in weights.items()}

    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        if self._fragments is not None:
            return  # every fragment landed during the round, the last one after its final step
        assert self._round is not None and self._transport is not None
        layout, round_ = self.layout, self._round
        self._drain_exchanges()  # an overlapped exchange reads the wire and yields the correction folded in now
        point = layout.read()  # thetaH | buffers (the live vector when bound)
        exchanging = self.exchanges_for_worker and self.world_size > 1 and not self._topology.uses_all_reduce
        if round_.fused:  # the fused message checks its own finiteness in the same pass
            wire = self._begin_fused(point, send=exchanging)
        else:
            self._guard_local_point(point, round_.outer.round_start)
            wire = round_.begin(point, send=exchanging)  # point: u (p with overlap)
        _, buffers = layout.split(point)
        if self._topology.uses_all_reduce and self.world_size > 1:
            self._transport.all_reduce_mean(point)  # replicas inside a worker are equal: a mean over workers
            round_.mixed.copy_(layout.split(point)[0])
            self._clock_all_reduce()
        elif not self.exchanges_for_worker:
            clock = self._clock_tensor()
            self.broadcast_in_worker(round_.mixed, buffers, clock)  # the leader exchanged for this worker
            if self._round_clock is not None:
                self._round_clock.follow(clock)
        else:
            self._exchange(point, wire)
        if self.is_worker_leader and not self._topology.uses_all_reduce:  # a no-op in a sharded worker
            self.broadcast_in_worker(round_.mixed, buffers, self._clock_tensor())
        round_.finish(point)
        layout.scatter(point)

    def _begin_fused(self, point: Tensor, send: bool) -> Tensor | None:
        """The fused message (u and its finite check in one pass); a non-finite point discards the round's local
        steps as the guard does (params from the round start, buffers as the round started) and begins again."""
        round_ = self._round
        wire = round_.begin(point, send=send)
        _, buffers = self.layout.split(point)
        if self._guard.record_local_point(round_.message_finite and all_finite(buffers), self._where()):
            return wire
        params, buffers = self.layout.split(point)
        params.copy_(round_.outer.round_start)
        buffers.copy_(self._round_start_buffers)
        self._zero_nonfinite_optimizer_state()
        return round_.begin(point, send=send)

    def _exchange(self, point: Tensor, wire: Tensor | None) -> None:
        """The leader's gossip: post the wire, then mix now, correct now, or (overlap) leave it in flight."""
        round_ = self._round
        if self._overlap and self._completed is not None:  # the previous round's exchange ends (in simulated time) now
            self._complete_clock(self._completed)
            self._completed = None
        clock = self._round_clock.on_post() if self._round_clock is not None else None
        peers = self.peers()
        pending = None
        if round_.copies is not None and self.world_size > 1:  # error feedback: each peer its own difference
            pending = self._transport.post(round_.messages(sorted(peers)), peers, self.round_index, clock)
        elif wire is not None:
            pending = self._transport.post(wire, peers, self.round_index, clock)
        if self._overlap:
            self._pending = pending
            round_.hold(point)
            return
        self._receive(round_, point, pending)

    def _receive(self, round_: GossipRound, point: Tensor, pending: PendingExchange | None,
                 fraction: float = 1.0) -> None:
        """Wait for the exchange, then mix (or correct) ``point`` (u) with what came back; None: a world of one
        sent nothing, and the point mixes with nobody."""
        received = [] if pending is None else self._transport.complete(pending)
        if round_.by_correction:
            rejected = [] if pending is None else round_.correct(received, peers=sorted(pending.peers))
            round_.apply_correction(point)
        else:
            rejected = round_.mix(point, received)
        if pending is not None:
            self._reject(rejected, pending)
            self._complete_clock(pending, round_, fraction=fraction)

    def _complete_clock(self, pending: PendingExchange | None, round_: GossipRound | None = None,
                        fraction: float = 1.0) -> None:
        """Advance the simulated clock to the end of a finished exchange (peers' clocks came with it) of
        ``fraction`` of the model."""
        if self._round_clock is None or pending is None:
            return
        k = self.ranks_per_worker
        peer_clocks = {peer // k: value for peer, value in pending.peer_clock_values().items()}
        pairs = round_pairs(self._topology, self.num_workers, pending.round_index)
        element_size = (round_ or self._round).bytes_per_element * fraction
        self._round_clock.on_exchange_completed(peer_clocks, pairs, element_size)

    @override
    def _on_replicas_averaged(self) -> None:
        live = self.layout.read()
        if self._round is not None:
            params, _ = self.layout.split(live)
            self._round.outer.round_start.copy_(params)
        if self._fragments is not None:
            for part, round_ in zip(self._fragments.slices, self._fragments.rounds):
                round_.outer.round_start.copy_(live[part][: round_.num_parameters])

    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        state = super().strategy_state_dict()
        if self._fragments is not None and self._fragments.rounds:
            self._drain_exchanges()
            state["fragments"] = {"rounds": [round_.state_dict() for round_ in self._fragments.rounds],
                                  "sent": [u.clone() for u in self._fragments.sent]}
        if self._round is None:
            state["outer"] = None
            return state
        self._drain_exchanges()
        round_state = self._round.state_dict()
        state["outer"] = round_state["outer"]
        if self._round.by_correction:
            completed = self._completed
            state["exchange"] = {
                "ready": round_state["ready"], "correction": round_state["correction"],
                "completed": None if completed is None else {
                    "round_index": completed.round_index, "peers": completed.peers,
                    "peer_clocks": completed.peer_clock_values()},
                "copies": round_state.get("copies"),
            }
        return state

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_strategy_state_dict(state)
        if self._fragments is not None and self._fragments.rounds and state.get("fragments") is not None:
            for round_, round_state in zip(self._fragments.rounds, state["fragments"]["rounds"], strict=True):
                round_.load_state_dict(round_state)
            for u, saved in zip(self._fragments.sent, state["fragments"]["sent"], strict=True):
                u.copy_(saved)
        if self._round is None or state.get("outer") is None:
            return
        exchange = state.get("exchange") or {}
        self._round.load_state_dict({"outer": state["outer"], "ready": exchange.get("ready", False),
                                     "correction": exchange.get("correction"), "copies": exchange.get("copies")})
        completed = exchange.get("completed")
        self._completed = None if completed is None else PendingExchange(
            round_index=completed["round_index"], peers=dict(completed["peers"]),
            peer_clocks={p: torch.tensor([c], dtype=torch.float64) for p, c in completed["peer_clocks"].items()},
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register_variants(strategy_registry, cls, "gasloc", "GASLoC (local steps + gossip + outer momentum)")


class FragmentGossip:
    """The fragments of a streamed GASLoC round: their slices of the point, their own rounds and what is in flight.

    Args:
        fragments: F >= 1.
        fragment_sync_delay: tau >= 0 (checked against the round length by :meth:`configure`).
        fragment_update_alpha: alpha in [0, 1].
    """

    def __init__(self, fragments: int, fragment_sync_delay: int, fragment_update_alpha: float) -> None:
        for name, value, minimum in (("fragments", fragments, 1), ("fragment_sync_delay", fragment_sync_delay, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.count, self.delay, self.alpha = fragments, fragment_sync_delay, float(fragment_update_alpha)
        self.points: FragmentPoints | None = None
        self.slices: list[slice] = []
        self.rounds: list[GossipRound] = []
        self.sent: list[Tensor] = []  # u (p) of each fragment while its exchange runs
        self.in_flight: dict[int, Any] = {}  # fragment: pending exchange, or the all-reduce's work

    def configure(self, inner_steps: int) -> None:
        self.points = FragmentPoints(inner_steps, self.count, self.delay)

    def build(self, point: Tensor, bounds: list[tuple[int, int]], num_parameters: int, **round_arguments: Any) -> None:
        """One round per fragment over the parameter ranges ``bounds`` (F of them, covering the parameters in
        order, see :meth:`~gasloc_lightning.comm.flat.FlatLayout.fragment_bounds`); the exchanged buffers ride with
        the last."""
        self.slices = [slice(start, end if k < self.count - 1 else point.numel())
                       for k, (start, end) in enumerate(bounds)]
        self.rounds = [GossipRound(point[part], min(part.stop, num_parameters) - part.start, **round_arguments)
                       for part in self.slices]
        self.sent = [torch.empty(part.stop - part.start, device=point.device) for part in self.slices]
        self.in_flight = {}

    def land(self, fragment: int, live: Tensor) -> None:
        """The fragment's round is done (its result in ``sent``): the live fragment takes it, alpha-mixed."""
        piece = live[self.slices[fragment]]
        piece.copy_(torch.lerp(self.sent[fragment], piece, self.alpha))


def _resolve_codec(message_codec: str | None, message_dtype: str | None) -> str:
    """``message_codec``, or its former name ``message_dtype``; both given must agree."""
    if message_dtype is not None and message_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"message_dtype must be 'float32' or 'bfloat16' (see message_codec), got {message_dtype!r}")
    if message_codec is not None and message_dtype is not None and message_codec != message_dtype:
        raise ValueError(f"message_codec={message_codec!r} and message_dtype={message_dtype!r} disagree: "
                         "pass message_codec only")
    return check_codec(message_codec or message_dtype or "float32", allow_sparse=True)
