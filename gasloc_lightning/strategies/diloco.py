"""DiLoCo (Douillard et al., arXiv 2311.08105) on the same round machinery as GASLoC.

Every H steps all workers all-reduce their pseudo-gradients Delta_i = theta - thetaH_i, and an
outer ``torch.optim.SGD(lr=eta, momentum=gamma, nesterov=True)`` steps the shared round-start
point theta with the mean Delta. It is written independently of GASLoC's gossip form (real
torch optimizer, pseudo-gradient all-reduce), so the two can check each other: GASLoC on the
complete graph must follow the same trajectory.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from gasloc_lightning.algorithm.outer import validate_outer_hyperparameters
from gasloc_lightning.algorithm.round import DiLoCoRound, check_codec, codec_bytes_per_element
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
        **kwargs: Any,
    ) -> None:
        validate_outer_hyperparameters(outer_lr, outer_momentum, "anchored")
        check_codec(message_codec)
        super().__init__(inner_steps=inner_steps, **kwargs)
        self._outer_lr = float(outer_lr)
        self._outer_momentum = float(outer_momentum)
        self._message_codec = message_codec
        self._round: DiLoCoRound | None = None

    @property
    def outer_lr(self) -> float:
        return self._outer_lr

    @property
    def outer_momentum(self) -> float:
        return self._outer_momentum

    @property
    def message_codec(self) -> str:
        return self._message_codec

    @override
    def _init_outer_state(self) -> None:
        params, _ = self.layout.split(self.layout.read())
        self._round = DiLoCoRound(params, outer_lr=self._outer_lr, outer_momentum=self._outer_momentum)

    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        assert self._round is not None and self._transport is not None
        message = self.layout.read()  # thetaH | buffers
        self._guard_local_point(message, self._round.round_start.detach())
        params, buffers = self.layout.split(message)
        self._round.pseudo_gradient(params)  # params now hold Delta_i
        if self.world_size > 1 and self._message_codec == "float32":
            self._transport.all_reduce_mean(message)  # mean Delta | mean buffers
            self._clock_all_reduce()
        elif self.world_size > 1:
            self._transport.all_reduce_mean_encoded(params, self._message_codec)
            if buffers.numel():
                self._transport.all_reduce_mean(buffers)
            self._clock_all_reduce(codec_bytes_per_element(self._message_codec, params.numel()))
        params.copy_(self._round.step(params))
        self.layout.scatter(message)

    @override
    def _on_replicas_averaged(self) -> None:
        if self._round is not None:
            params, _ = self.layout.split(self.layout.read())
            self._round.reset(params)

    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        state = super().strategy_state_dict()
        if self._round is not None:
            state["outer"] = self._round.state_dict()
        return state

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_strategy_state_dict(state)
        if self._round is not None and state.get("outer") is not None:
            self._round.load_state_dict(state["outer"])

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register_variants(strategy_registry, cls, "diloco", "DiLoCo (local steps + all-reduced outer Nesterov)")
