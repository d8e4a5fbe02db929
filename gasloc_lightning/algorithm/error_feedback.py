"""Error feedback for a stream of compressed messages, and the mean of the workers' compressed messages.

A lossy codec E (decoded by D) drops part of every message. Error feedback (Seide et al. 2014, Stich et
al. 2018; with top-k, SparseLoCo, arXiv 2508.15706) keeps what was dropped, the residual e_i, and adds it
to worker i's next message Delta_i before encoding:

    a_i = decay e_i + Delta_i,      m_i = D(E(a_i)),      e_i' = a_i - m_i

With ``decay`` = 1 nothing is lost, only delayed: over any number of rounds,
``sum_t m_i(t) + e_i(T) = sum_t Delta_i(t)`` (up to float32 rounding of the two additions), so the
mean of what the workers send plus the mean of their residuals is the mean of their true messages.
SparseLoCo decays the residual (``decay`` = 0.95 there); then that identity holds with the decayed terms
and the dropped part is partly forgotten.

This module is the per-worker arithmetic only, on flat float32 tensors; the engines move the wires.
For a sparse codec (``topk``) the mean of the n messages is an all-gather of the encodings, each worker
decoding all n and adding them in worker order (:func:`mean_of_wires`), so every worker holds the same
bits; a quantized all-reduce (``EncodedMean``) would re-encode the mean and drop most of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gasloc_lightning.algorithm.codecs import MessageCodec


class ErrorFeedback:
    """One worker's (or n stacked workers') residual e for messages of ``numel`` elements through ``codec``.

    Args:
        codec: a lossy codec (e.g. ``build_codec("topk-0.01-int4")``).
        numel: P, the elements of one message.
        rows: n for stacked workers (messages ``(n, P)``); None for one worker (``(P,)``).
        decay: beta in (0, 1], the factor on the residual before it is added (1: exact error feedback).
        device: where the residual lives.
    """

    def __init__(self, codec: MessageCodec, numel: int, *, rows: int | None = None, decay: float = 1.0,
                 device: torch.device | str | None = None) -> None:
        if codec.lossless:
            raise ValueError(f"codec must be lossy (error feedback has nothing to keep), got {codec.name!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"numel must be an int >= 1, got {numel!r}")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"rows must be None or an int >= 1, got {rows!r}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay (beta) must lie in (0, 1], got {decay!r}")
        self.codec = codec
        self.decay = float(decay)
        shape = (numel,) if rows is None else (rows, numel)
        self._residual = torch.zeros(shape, dtype=torch.float32, device=device)

    @property
    def residual(self) -> Tensor:
        """e: what the codec has not delivered yet (read-only use; the next :meth:`encode` updates it)."""
        return self._residual

    def new_wire(self) -> Tensor:
        """A wire buffer for one :meth:`encode` (one row per stacked worker)."""
        return self.codec.new_wire(self._residual.shape[-1], *self._residual.shape[:-1],
                                   device=self._residual.device)

    @torch.no_grad()
    def encode(self, message: Tensor, wire: Tensor, decoded: Tensor | None = None) -> Tensor:
        """Encode ``decay e + message`` into ``wire``; e becomes what that encoding dropped.

        Args:
            message: Delta, float32 shaped like the residual (not modified).
            wire: the uint8 wire, from :meth:`new_wire`.
            decoded: optional float32 buffer like ``message`` for m = D(wire) (allocated when None).

        Returns:
            m, the decoded message: exactly what every peer decodes from ``wire``.
        """
        if message.shape != self._residual.shape or message.dtype != torch.float32:
            raise ValueError(f"message must be float32 of shape {tuple(self._residual.shape)}, got "
                             f"{message.dtype} {tuple(message.shape)}")
        accumulated = self._residual
        if self.decay != 1.0:
            accumulated.mul_(self.decay)
        accumulated.add_(message)  # a = beta e + Delta, in the residual's own buffer
        decoded = torch.empty_like(accumulated) if decoded is None else decoded
        self.codec.encode(accumulated, wire, decoded=decoded)
        accumulated.sub_(decoded)  # e' = a - m
        return decoded

    def state_dict(self) -> dict:
        return {"residual": self._residual.clone(), "codec": self.codec.name, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        if state["residual"].shape != self._residual.shape:
            raise ValueError(f"the residual has shape {tuple(state['residual'].shape)}, this one needs "
                             f"{tuple(self._residual.shape)}: the checkpoint belongs to another model")
        if state.get("codec") != self.codec.name:
            raise ValueError(f"the residual was kept for codec {state.get('codec')!r}, this one uses "
                             f"{self.codec.name!r}")
        self._residual.copy_(state["residual"])


@torch.no_grad()
def mean_of_wires(codec: MessageCodec, wires: Tensor, out: Tensor) -> Tensor:
    """The mean of n workers' decoded messages, from their wires ``(n, W)`` in worker order, into ``out`` (P,).

    The sum runs in worker order, so every worker that gathered the same wires gets the same bits.
    """
    if wires.dim() != 2 or wires.shape[0] < 1:
        raise ValueError(f"wires must be (n, wire bytes) with n >= 1, got shape {tuple(wires.shape)}")
    scratch = torch.empty_like(out)
    out.zero_()
    for wire in wires:
        out.add_(codec.decode(wire, scratch))
    return out.div_(wires.shape[0])
