"""DiLoCo (Douillard et al., arXiv 2311.08105) on the same round machinery as GASLoC.

Every H steps all workers all-reduce their pseudo-gradients Delta_i = theta - thetaH_i, and an
outer ``torch.optim.SGD(lr=eta, momentum=gamma, nesterov=True)`` steps the shared round-start
point theta with the mean Delta. It is written independently of GASLoC's gossip form (real
torch optimizer, pseudo-gradient all-reduce), so the two can check each other: GASLoC on the
complete graph must follow the same trajectory.

**Streaming DiLoCo** (Douillard et al., arXiv 2501.18512; torchft 0.2.0's ``DiLoCo`` with several
``model_fragments``): with ``fragments=F`` the parameters are split into F contiguous fragments, each
with its own outer optimizer, and fragment f syncs once per round, after step floor((f+1) H / F)
(:class:`~gasloc_lightning.algorithm.fragments.FragmentPoints`). Its pseudo-gradient leaves
``fragment_sync_delay`` steps before its outer step lands, the all-reduce running meanwhile under
compute; the live fragment then becomes ``lerp(global, live, fragment_update_alpha)``
(:class:`~gasloc_lightning.algorithm.streaming.StreamingDiLoCoOuter`). ``overlap=True`` takes the
delay of one step (Streaming DiLoCo's usual setting). With a lossy ``message_codec`` the quantized all-reduce
overlaps the same way, as torchft's does: posted where the fragment leaves, waited on where it lands
(:class:`~gasloc_lightning.comm.encoded_mean.AsyncEncodedMean`).

**Sparse messages with error feedback** (``error_feedback=True``, usually with a top-k ``message_codec``):
each worker sends E(beta e + Delta) and keeps what the codec dropped in its residual e; the mean is an
all-gather of the n wires (:mod:`~gasloc_lightning.algorithm.sparse_mean`). With ``outer_momentum=0`` and
``error_feedback_decay=0.95`` this is SparseLoCo (arXiv 2508.15706): ``strategy=sparseloco``. Streamed rounds
are refused with it (not wired yet).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from gasloc_lightning.algorithm.outer import validate_outer_hyperparameters
from gasloc_lightning.algorithm.fragments import FragmentPoints, resolve_points
from gasloc_lightning.algorithm.round import DiLoCoRound, check_codec, codec_bytes_per_element
from gasloc_lightning.algorithm.sparse_mean import SparseMessages, all_gather_element_size, check_sparse_mean
from gasloc_lightning.algorithm.streaming import StreamingDiLoCoOuter
from gasloc_lightning.comm.encoded_mean import PendingEncodedMean
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy, _register_variants


class DiLoCoStrategy(LocalStepsStrategy):
    """DiLoCo: H local steps, then an all-reduce of pseudo-gradients and an outer Nesterov SGD step.

    On failure: the all-reduce is bounded by the process group's ``collective_timeout``.

    Args:
        inner_steps: H, optimizer steps per round.
        outer_lr: eta of the outer SGD (DiLoCo: 0.7).
        outer_momentum: gamma, Nesterov momentum of the outer SGD (DiLoCo: 0.9); 0 disables momentum.
        message_codec: how pseudo-gradients go on the wire: ``"float32"`` (an exact all-reduce) or a lossy codec
            (``"bfloat16"``, ``"int8"``, ``"fp8"``, ``"int4"``, ``"int2"``): a quantized all-reduce, as torchft's
            (:class:`~gasloc_lightning.algorithm.round.EncodedMean`); every worker gets the same mean.
        fragments: F, fragments synced in turn (Streaming DiLoCo); 1: plain DiLoCo.
        fragment_sync_delay: tau, inner steps between a fragment's pseudo-gradient leaving and its outer step
            landing, its all-reduce (float32 or quantized) running under them; at most the gap between two
            fragments minus one.
        fragment_update_alpha: alpha in [0, 1], the live share when a fragment lands (0: take the global value).
        overlap: ``fragment_sync_delay=1``: each all-reduce runs under one step of compute (leave
            ``fragment_sync_delay`` 0; set it instead for a longer delay).
        error_feedback: each worker keeps the residual its codec dropped and adds it to its next message; the
            mean is then an all-gather of the workers' wires (needed by a sparse ``message_codec`` such as
            ``"topk-0.01-int2"``; not with streamed rounds).
        error_feedback_decay: beta in (0, 1], the factor on the residual before it is added (SparseLoCo: 0.95).
        **kwargs: the remaining arguments of :class:`~gasloc_lightning.strategies.gasloc.LocalStepsStrategy`.
    """

    strategy_name = "diloco"

    def __init__(
        self,
        *,
        inner_steps: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        message_codec: str = "float32",
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        overlap: bool = False,
        error_feedback: bool = False,
        error_feedback_decay: float = 1.0,
        **kwargs: Any,
    ) -> None:
        validate_outer_hyperparameters(outer_lr, outer_momentum, "anchored")
        check_codec(message_codec, allow_sparse=True)
        streamed = fragments != 1 or bool(fragment_sync_delay) or bool(fragment_update_alpha) or bool(overlap)
        gathered = check_sparse_mean(message_codec, error_feedback=error_feedback,
                                     error_feedback_decay=error_feedback_decay, streamed=streamed)
        if message_codec == "int2" and not gathered:
            raise ValueError("message_codec='int2' has no zero level (0 decodes to +scale/2): a quantized mean of "
                             "pseudo-gradients would move every parameter that did not move. Use int4 or int8.")
        for name, value in (("fragments", fragments), ("fragment_sync_delay", fragment_sync_delay)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "fragments"):
                raise ValueError(f"{name} must be an int >= {int(name == 'fragments')}, got {value!r}")
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha (alpha) must lie in [0, 1], got {fragment_update_alpha!r}")
        if overlap and fragment_sync_delay:
            raise ValueError("overlap=True chooses fragment_sync_delay itself: leave fragment_sync_delay at 0")
        super().__init__(inner_steps=inner_steps, **kwargs)
        self._outer_lr = float(outer_lr)
        self._outer_momentum = float(outer_momentum)
        self._message_codec = message_codec
        self._fragments, self._fragment_sync_delay = fragments, fragment_sync_delay
        self._fragment_update_alpha, self._overlap = float(fragment_update_alpha), bool(overlap)
        self._error_feedback, self._error_feedback_decay = gathered, float(error_feedback_decay)
        self._round: DiLoCoRound | None = None
        self._sparse: SparseMessages | None = None
        self._streaming: StreamingDiLoCoOuter | None = None
        self._points: FragmentPoints | None = None
        self._in_flight: dict[int, tuple[Tensor, Any, float | None]] = {}  # fragment: (Delta, work, clock end)

    @property
    def outer_lr(self) -> float:
        return self._outer_lr

    @property
    def outer_momentum(self) -> float:
        return self._outer_momentum

    @property
    def message_codec(self) -> str:
        return self._message_codec

    @property
    def error_feedback(self) -> bool:
        return self._error_feedback

    @property
    def error_feedback_decay(self) -> float:
        return self._error_feedback_decay

    @property
    def streamed(self) -> bool:
        """Whether rounds are streamed by fragments (Streaming DiLoCo) rather than one all-reduce at the end."""
        return self._fragments > 1 or self._fragment_sync_delay > 0 or self._overlap or self._fragment_update_alpha > 0

    @property
    def fragment_points(self) -> FragmentPoints | None:
        """When each fragment leaves and lands (resolved once the round length is known)."""
        return self._points

    @override
    def check_configuration(self, world_size: int) -> None:
        super().check_configuration(world_size)
        if not self.streamed:
            return
        if self.ranks_per_worker > 1 and not self.sharded:
            raise ValueError("fragments, fragment_sync_delay, fragment_update_alpha and overlap with ranks_per_worker > 1 "
                             "and intra_worker='ddp' are not supported yet (the fragment all-reduce would run under the "
                             "worker's DDP all-reduces): use ranks_per_worker=1, or intra_worker='fsdp'")
        if len({self._schedule.inner_steps(rank) for rank in range(world_size)}) > 1:
            raise ValueError("fragments, fragment_sync_delay, fragment_update_alpha and overlap need one inner_steps "
                             "for every worker (streamed rounds stay aligned)")
        steps = self._schedule.round_length
        self._points = resolve_points(steps, self._fragments, self._fragment_sync_delay, self._overlap)
        if self._overlap and self._points.fragment_sync_delay == 0:
            rank_zero_warn(f"overlap=True is not applied: inner_steps={steps} and fragments={self._fragments} leave "
                           "no step between two fragments (fragment_sync_delay 0), so each all-reduce is waited on "
                           "where it leaves and nothing overlaps. Use inner_steps >= 2 x fragments to overlap "
                           "communication with compute.")

    @override
    def _init_outer_state(self) -> None:
        params, _ = self.layout.split(self.layout.read())
        self._in_flight = {}
        if not self.streamed:
            self._round = DiLoCoRound(params, outer_lr=self._outer_lr, outer_momentum=self._outer_momentum)
            if self._error_feedback:
                self._sparse = SparseMessages(self._message_codec, params.numel(), decay=self._error_feedback_decay,
                                              device=params.device)
        else:  # the fragments' outer states replace the whole model's
            if self._points is None:
                self.check_configuration(self.world_size)
            bounds = self.layout.fragment_bounds(self._fragments)  # a sharded worker: of its shard
            if self._message_codec != "float32" and self.world_size > 1:
                self._transport.open_encoded_means(self._exchange_rank_lists(), self.global_rank)
            self._streaming = StreamingDiLoCoOuter(params, bounds=bounds, outer_lr=self._outer_lr,
                                                   outer_momentum=self._outer_momentum,
                                                   fragment_update_alpha=self._fragment_update_alpha)

    def _exchange_rank_lists(self) -> list[list[int]]:
        """Every group like the transport's: the world, or (sharded workers) the ranks holding each shard."""
        shards = self.ranks_per_worker if self.sharded else 1
        return [list(range(shard, self.world_size, shards)) for shard in range(shards)]

    @override
    @torch.no_grad()
    def _after_inner_step(self, step_in_round: int) -> None:
        if self._streaming is None:
            return
        leaving = self._points.leaving(step_in_round)
        if leaving is not None:
            self._post_fragment(leaving)
        landing = self._points.landing(step_in_round)
        if landing is not None:
            self._land_fragment(landing)

    def _post_fragment(self, fragment: int) -> None:
        """Fragment f's pseudo-gradient leaves: its all-reduce (float32 or quantized) runs under the next steps."""
        params, _ = self.layout.split(self.layout.read())
        delta = self._streaming.prepare(fragment, params)
        share = delta.numel() / params.numel()
        end, work = None, None
        quantized = self._message_codec != "float32"
        if self._round_clock is not None:
            size = codec_bytes_per_element(self._message_codec, delta.numel()) if quantized else None
            end = self._round_clock.on_all_reduce_posted(element_size=size, fraction=share)
        if self.world_size > 1:
            if quantized:  # as torchft's quantized all-reduce: a handle waited on where the fragment lands
                work = self._transport.post_all_reduce_mean_encoded(delta, self._message_codec)
            else:
                work = self._transport.post_all_reduce_mean(delta)
        self._in_flight[fragment] = (delta, work, end)

    def _wait_mean(self, work: Any, delta: Tensor) -> None:
        if isinstance(work, PendingEncodedMean):
            self._transport.wait_all_reduce_mean_encoded(work)
        else:
            self._transport.wait_all_reduce_mean(work, delta)

    def _land_fragment(self, fragment: int) -> None:
        """Fragment f's outer step lands: wait for its mean, step, mix into the live fragment."""
        delta, work, end = self._in_flight.pop(fragment)
        if work is not None:
            self._wait_mean(work, delta)
        if end is not None:
            self._round_clock.wait_until(end)
        live = self.layout.read()
        params, _ = self.layout.split(live)
        if not (torch.isfinite(delta).all() and torch.isfinite(params).all()):
            raise FloatingPointError(f"{self._where()}: fragment {fragment} is not finite (streamed rounds have no "
                                     "skip_round recovery yet; lower the learning rate)")
        self._streaming.perform(fragment, delta, params)
        self.layout.scatter(live)

    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        assert self._transport is not None
        if self._streaming is not None:  # the fragments synced during the round; buffers are averaged now
            _, buffers = self.layout.split(self.layout.read())
            if self.world_size > 1 and buffers.numel():
                self._transport.all_reduce_mean(buffers)
            self.layout.scatter_buffers(buffers)
            return
        message = self.layout.read()  # thetaH | buffers
        self._guard_local_point(message, self._round.round_start.detach())
        params, buffers = self.layout.split(message)
        self._round.pseudo_gradient(params)  # params now hold Delta_i
        if self._sparse is not None:
            self._sparse_mean(params, buffers)
        elif self.world_size > 1 and self._message_codec == "float32":
            self._transport.all_reduce_mean(message)  # mean Delta | mean buffers
            self._clock_all_reduce()
        elif self.world_size > 1:
            self._transport.all_reduce_mean_encoded(params, self._message_codec)
            if buffers.numel():
                self._transport.all_reduce_mean(buffers)
            self._clock_all_reduce(codec_bytes_per_element(self._message_codec, params.numel()))
        params.copy_(self._round.step(params))
        self.layout.scatter(message)

    def _sparse_mean(self, params: Tensor, buffers: Tensor) -> None:
        """params (Delta_i) into the mean of every worker's error-feedback wire (an all-gather); buffers averaged."""
        wire = self._sparse.new_wires(1)[0]
        self._sparse.encode(params, wire)
        if self.world_size > 1:
            self._transport.all_gather_sparse_mean(wire, self._sparse, params)
            if buffers.numel():
                self._transport.all_reduce_mean(buffers)
        else:
            self._sparse.mean(wire[None], params)
        n = self.num_workers  # the all-gather runs between workers (a sharded worker's ranks: one per shard)
        self._clock_all_reduce(all_gather_element_size(self._sparse.wire_bytes, params.numel(), n))

    @override
    def _flush_exchanges(self) -> None:
        """End of training: a fragment that left lands now (its all-reduce is waited for)."""
        for fragment in sorted(self._in_flight):
            self._land_fragment(fragment)

    @override
    def teardown(self) -> None:
        if self._transport is not None:
            self._transport.close()
        super().teardown()

    @override
    def _on_replicas_averaged(self) -> None:
        if self._round is not None:
            params, _ = self.layout.split(self.layout.read())
            self._round.reset(params)
        if self._streaming is not None:
            params, _ = self.layout.split(self.layout.read())
            self._streaming.reset(params)

    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        state = super().strategy_state_dict()
        if self._round is not None:
            state["outer"] = self._round.state_dict()
        if self._sparse is not None:
            state["error_feedback"] = self._sparse.state_dict()
        if self._streaming is not None:
            self._flush_waits()
            state["streaming"] = {"outer": self._streaming.state_dict(),
                                  "in_flight": {f: (d.clone(), end) for f, (d, _, end) in self._in_flight.items()}}
        return state

    def _flush_waits(self) -> None:
        """Finish every all-reduce in flight (its mean stays pending until its fragment lands)."""
        for fragment, (delta, work, end) in list(self._in_flight.items()):
            if work is not None:
                self._wait_mean(work, delta)
                self._in_flight[fragment] = (delta, None, end)

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_strategy_state_dict(state)
        if self._round is not None and state.get("outer") is not None:
            self._round.load_state_dict(state["outer"])
        if self._sparse is not None:
            if state.get("error_feedback") is None:
                raise ValueError("the checkpoint has no error-feedback residual (error_feedback was off)")
            self._sparse.load_state_dict(state["error_feedback"])
        if self._streaming is not None and state.get("streaming") is not None:
            self._streaming.load_state_dict(state["streaming"]["outer"])
            self._in_flight = {int(f): (d.to(self.root_device), None, end)
                               for f, (d, end) in state["streaming"]["in_flight"].items()}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register_variants(strategy_registry, cls, "diloco", "DiLoCo (local steps + all-reduced outer Nesterov)")
