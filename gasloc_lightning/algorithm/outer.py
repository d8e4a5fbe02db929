"""The outer step of GASLoC on flat float32 tensors: pure math, no process group.

One round for worker i (ALGORITHM.md, "anchored Nesterov" form):

    z_i      = theta_i + eta (thetaH_i - theta_i)            (outer_lr = eta)
    u_i      = z_i + gamma (z_i - x_i)                        (outer_momentum = gamma, anchor = x_i)
    theta_i' = u_i - sum_j w_ij (u_i - u_j)                   (gossip of u: done by the transport)
    x_i'     = z_i + (theta_i' - u_i) / (1 + gamma)  =  (theta_i' + gamma x_i) / (1 + gamma)

The second form of the anchor update needs no copy of z, so the outer state is two model-size
float32 buffers: the round-start point theta_i and the anchor x_i.

The optional "post_mix" form (fixed graphs only):

    x_i'     = sum_j W_ij z_j                                 (gossip of z)
    theta_i' = x_i' + gamma (x_i' - x_i)

Every update is written as a single `torch.lerp` so each costs one pass over memory.

Every update is also elementwise, so the same :class:`OuterState` serves one worker (a flat (P,)
point, the strategy) and n workers at once (stacked (n, P) points, row i for worker i, the
simulator in :mod:`gasloc_lightning.sim`); there, :func:`mix` is applied row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

OuterForm = Literal["anchored", "post_mix"]
OUTER_FORMS: tuple[str, ...] = ("anchored", "post_mix")


def all_finite(tensor: Tensor) -> bool:
    """Whether every entry is finite, in one read pass and no temporary (NaN and +-inf reach min or max).

    About 20x faster than ``isfinite(t).all()``, which materialises a boolean tensor of the same size.
    """
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def validate_outer_hyperparameters(outer_lr: float, outer_momentum: float, outer_form: str) -> None:
    """Raise ``ValueError`` naming the argument when eta, gamma or the form is out of range."""
    if not outer_lr > 0:
        raise ValueError(f"outer_lr (eta) must be > 0, got {outer_lr}")
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum (gamma) must be in [0, 1), got {outer_momentum}")
    if outer_form not in OUTER_FORMS:
        raise ValueError(f"outer_form must be one of {OUTER_FORMS}, got {outer_form!r}")


def mix(message: Tensor, received: Sequence[tuple[float, Tensor]], out: Tensor) -> Tensor:
    """Gossip mixing ``out = u - sum_j w_ij (u - u_j)`` of this worker's message with its peers'.

    Args:
        message: this worker's point u_i.
        received: ``(w_ij, u_j)`` for every peer j of this round.
        out: destination; may alias ``message`` (the update is elementwise).
    """
    if len(received) == 1:  # the common pairwise case: one fused pass
        weight, other = received[0]
        return torch.lerp(message, other, weight, out=out)
    self_weight = 1.0 - sum(weight for weight, _ in received)
    torch.mul(message, self_weight, out=out)
    for weight, other in received:
        out.add_(other, alpha=weight)
    return out


class OuterState:
    """Per-worker outer state of GASLoC: round-start point theta_i and anchor x_i, both float32.

    Args:
        initial: the flat starting parameters theta(0) (copied; x_i = theta(0) means zero momentum), or
            n workers' starting points stacked as (n, P).
        outer_lr: eta, the outer learning rate.
        outer_momentum: gamma in [0, 1).
        outer_form: ``"anchored"`` (default, stable on random graphs) or ``"post_mix"``.
    """

    def __init__(self, initial: Tensor, outer_lr: float, outer_momentum: float, outer_form: str = "anchored"):
        validate_outer_hyperparameters(outer_lr, outer_momentum, outer_form)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_form = outer_form
        self.round_start = initial.detach().to(torch.float32, copy=True).contiguous()
        self.anchor = self.round_start.clone()

    @property
    def num_bytes(self) -> int:
        return 2 * self.round_start.numel() * self.round_start.element_size()

    def message(self, local_end: Tensor) -> Tensor:
        """Turn thetaH_i (in ``local_end``, overwritten) into the point this worker sends.

        anchored: u_i; post_mix: z_i.
        """
        torch.lerp(self.round_start, local_end, self.outer_lr, out=local_end)  # z
        if self.outer_form == "anchored":
            torch.lerp(self.anchor, local_end, 1.0 + self.outer_momentum, out=local_end)  # u
        return local_end

    def mixed_destination(self) -> Tensor:
        """Buffer the transport should write the mixed point into (the old round start is no longer needed)."""
        return self.round_start

    def finish(self, message: Tensor, mixed: Tensor) -> Tensor:
        """Complete the round from the mixed point; returns the new round-start theta_i'.

        ``mixed`` must be :meth:`mixed_destination` holding ``sum_j W_ij message_j``.
        """
        gamma = self.outer_momentum
        if self.outer_form == "anchored":
            # mixed = theta'; x' = (theta' + gamma x) / (1 + gamma)
            torch.lerp(mixed, self.anchor, gamma / (1.0 + gamma), out=self.anchor)
            return self.round_start
        # post_mix: mixed = x'; theta' = x + (1 + gamma)(x' - x), written over the old anchor, then swap roles.
        torch.lerp(self.anchor, mixed, 1.0 + gamma, out=self.anchor)
        self.round_start, self.anchor = self.anchor, self.round_start
        return self.round_start

    def reset_round(self) -> Tensor:
        """The point to restore when a round is discarded: the unchanged round start."""
        return self.round_start

    def state_dict(self) -> dict:
        return {
            "round_start": self.round_start.clone(),
            "anchor": self.anchor.clone(),
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "outer_form": self.outer_form,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("round_start", "anchor"):
            if state[key].shape != self.round_start.shape:
                raise ValueError(
                    f"outer state {key!r} has {state[key].numel()} elements, this model needs "
                    f"{self.round_start.numel()}: the checkpoint belongs to another model"
                )
        self.round_start.copy_(state["round_start"])
        self.anchor.copy_(state["anchor"])
