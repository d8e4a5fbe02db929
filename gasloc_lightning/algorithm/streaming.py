"""Streaming DiLoCo on flat float32 tensors, as torchft 0.2.0 defines it: pure math, no process group.

Streaming DiLoCo (https://arxiv.org/abs/2501.18512) splits the parameters into F fragments and
synchronises one fragment at a time; plain DiLoCo is the one-fragment case. The rules below are those of
torchft 0.2.0's ``torchft/local_sgd.py`` (``DiLoCo`` and ``_StreamingDiLoCoFragment``), with the symbols
inner_steps (H), fragments (F), fragment_sync_delay (tau), fragment_update_alpha (alpha), outer_lr (eta)
and outer_momentum (mu). Let t = 1, 2, ... count the inner optimizer steps done, h = H / F, and c the
number of fragment syncs committed so far (torchft's ``Manager.current_step()``).

**Schedule** (:class:`~gasloc_lightning.algorithm.fragments.FragmentPoints`, which the engines share;
``DiLoCo._step_post_hook`` and ``DiLoCo._current_fragment``).
After inner step t, fragment f = c mod F is *prepared* when (t + tau) mod h == 0 and *performed* when
t mod h == 0 (with tau = 0 both happen after the same step, prepare first). torchft counts t since the
last perform and resets it there whether or not the sync commits, so the timing never drifts; only a
failed commit (c unchanged) makes the same fragment go again. With every sync committed, fragment f
is performed after steps (f + 1) h + k H: fragment 0 first, the others staggered by h, so fragment f's
first sync covers (f + 1) h inner steps and every later one H.

**Prepare** (``_StreamingDiLoCoFragment.prepare_sync``, ``_save_grads``; ``Manager.allreduce``).
Worker i sends its pseudo-gradient, the backup ("original parameters") minus its live parameters:

    Delta_i^f = thetabar^f - theta_i^f(t_prepare)
    Delta^f   = (1 / n) sum_i Delta_i^f          (SUM all-reduce, then divided by num_participants)

**Perform** (``_StreamingDiLoCoFragment.perform_sync``: ``_save_local_parameters``,
``restore_parameters``, ``_set_grads``, the outer optimizer's ``step``, ``save_parameters``,
``_merge_parameters``). One outer ``torch.optim.SGD(lr=eta, momentum=mu, nesterov=True)`` per fragment,
its momentum buffer v^f kept per fragment (v^f = Delta^f on its first step). (torchft also takes one
outer optimizer for every fragment; built over the whole model, it also steps the other fragments with
the inner gradients left in their ``.grad`` at each sync: not reproduced here.)

    v^f        <- mu v^f + Delta^f
    thetabar^f <- thetabar^f - eta (Delta^f + mu v^f)                        (new backup = global)
    theta_i^f  <- lerp(thetabar^f, theta_i^f(t_perform), alpha)
               =  thetabar^f + alpha (theta_i^f(t_perform) - thetabar^f)

The live fragment keeps training during the tau steps between prepare and perform; those steps are not
in Delta^f, and they survive only through the alpha mix (alpha = 0 discards them: the fragment becomes
the global parameters). The backup is the outer-updated global value, never the mixed one, so the
alpha share of the local progress enters the next pseudo-gradient. If the commit fails, torchft has
already written the backup into the live fragment and skips the outer step
(:meth:`StreamingDiLoCoOuter.restore`); the same fragment goes again h steps later.

Not reproduced here: torchft keeps the backup on ``backup_device`` (CPU, pinned when an accelerator
exists) in the parameters' dtype, where this module keeps float32 next to the tensors it is given; and
``should_quantize`` (an fp8 all-reduce, ``torchft.collectives.allreduce_quantized``, used only when
triton is importable; otherwise torchft silently sends float32). The mean is the caller's: a transport's
all-reduce in a multi-process strategy, a mean over rows in a simulator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.round import DiLoCoRound

__all__ = ["StreamingDiLoCoOuter", "fragment_bounds"]


def fragment_bounds(sizes: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Split a flat vector made of tensors of ``sizes`` elements into F contiguous, non-empty fragments.

    Every cut lies on a tensor boundary, the k-th at the boundary nearest to k / F of the total (the
    earlier one on a tie), so fragments hold near-equal element counts.

    Args:
        sizes: element count of each tensor, in the order they lie in the flat vector.
        fragments: F, at most ``len(sizes)``.

    Returns:
        ``[(start, end), ...]``: element offsets of each fragment, covering the vector in order.
    """
    _check_count("fragments", fragments, minimum=1)
    if not sizes or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(f"sizes must be a non-empty list of positive element counts, got {list(sizes)!r}")
    if fragments > len(sizes):
        raise ValueError(f"fragments (F) must be <= the number of tensors {len(sizes)}, got {fragments}")
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    cuts = [0]
    for k in range(1, fragments):
        # Leave at least one tensor for each later fragment, and take at least one after the last cut.
        candidates = range(cuts[-1] + 1, len(sizes) - (fragments - k) + 1)
        target = offsets[-1] * k / fragments
        cuts.append(min(candidates, key=lambda index: abs(offsets[index] - target)))
    cuts.append(len(sizes))
    return [(offsets[low], offsets[high]) for low, high in zip(cuts, cuts[1:])]


class StreamingDiLoCoOuter:
    """Streaming DiLoCo's outer state: per fragment the backup thetabar^f and its outer Nesterov SGD.

    Works on one worker's flat live parameters ``(P,)`` (a strategy) or on n workers stacked as ``(n, P)``
    (a simulator): the backup is shared, every row is mixed with it, :meth:`prepare` returns one
    pseudo-gradient per row and the caller averages the rows.

    Args:
        initial: the starting flat parameters ``(P,)`` (copied to float32); the same on every worker.
        bounds: ``(start, end)`` of each fragment in the flat vector: contiguous, in order, covering it
            (see :func:`fragment_bounds`).
        outer_lr: eta of every fragment's outer SGD.
        outer_momentum: mu in [0, 1), its Nesterov momentum (0: plain SGD).
        fragment_update_alpha: alpha in [0, 1], the live share in the mix after an outer step.
    """

    def __init__(self, initial: Tensor, *, bounds: Sequence[tuple[int, int]], outer_lr: float,
                 outer_momentum: float, fragment_update_alpha: float = 0.0) -> None:
        if initial.dim() != 1:
            raise ValueError(f"initial must be a flat parameter vector (P,), "
                             f"got shape {tuple(initial.shape)}")
        _check_bounds(bounds, initial.numel())
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha (alpha) must lie in [0, 1], "
                             f"got {fragment_update_alpha!r}")
        self.bounds = [(int(start), int(end)) for start, end in bounds]
        self.fragment_update_alpha = float(fragment_update_alpha)
        # One DiLoCo round per fragment: its own backup and momentum, as torchft's one outer optimizer each.
        self._rounds = [DiLoCoRound(initial[start:end], outer_lr=outer_lr, outer_momentum=outer_momentum)
                        for start, end in self.bounds]

    @property
    def fragments(self) -> int:
        return len(self.bounds)

    def backup(self, fragment: int) -> Tensor:
        """The global parameters thetabar^f of ``fragment`` (a view: do not modify)."""
        return self._rounds[self._check_fragment(fragment)].round_start.detach()

    @torch.no_grad()
    def prepare(self, fragment: int, live: Tensor) -> Tensor:
        """Delta_i^f = thetabar^f - theta_i^f: a new tensor ``(size,)``, or ``(n, size)`` for stacked rows.

        The caller averages it over the workers (``(n, size)``: over dim 0) and keeps the mean for
        :meth:`perform`, ``fragment_sync_delay`` steps later. ``live`` is not modified.
        """
        start, end = self.bounds[self._check_fragment(fragment)]
        piece = self._piece(live, start, end)
        return self._rounds[fragment].pseudo_gradient(piece, out=torch.empty_like(piece))

    @torch.no_grad()
    def perform(self, fragment: int, mean_pseudo_gradient: Tensor, live: Tensor) -> None:
        """Outer step of ``fragment`` with the workers' mean Delta^f, then the alpha mix into ``live``.

        ``mean_pseudo_gradient`` is not modified; ``live`` holds the parameters after the current inner
        step (the ``fragment_sync_delay`` steps since :meth:`prepare` included).
        """
        start, end = self.bounds[self._check_fragment(fragment)]
        piece = self._piece(live, start, end)
        if mean_pseudo_gradient.shape != (end - start,):
            raise ValueError(f"mean_pseudo_gradient of fragment {fragment} must have shape ({end - start},), "
                             f"got {tuple(mean_pseudo_gradient.shape)}")
        updated = self._rounds[fragment].step(mean_pseudo_gradient)
        # torchft: p.lerp_(local, alpha) with p the outer-updated global value.
        piece.copy_(torch.lerp(updated, piece, self.fragment_update_alpha))

    @torch.no_grad()
    def reset(self, point: Tensor) -> None:
        """Every backup takes ``point`` (P,) (the replicas were averaged outside a sync); momenta are kept."""
        for (start, end), outer_round in zip(self.bounds, self._rounds):
            outer_round.reset(point[start:end])

    @torch.no_grad()
    def restore(self, fragment: int, live: Tensor) -> None:
        """A sync that did not commit: the live fragment goes back to its backup (no outer step)."""
        start, end = self.bounds[self._check_fragment(fragment)]
        self._piece(live, start, end).copy_(self._rounds[fragment].round_start)

    def state_dict(self) -> dict:
        return {
            "bounds": list(self.bounds),
            "fragment_update_alpha": self.fragment_update_alpha,
            "fragments": [outer_round.state_dict() for outer_round in self._rounds],
        }

    def load_state_dict(self, state: dict) -> None:
        if [tuple(bound) for bound in state["bounds"]] != self.bounds:
            raise ValueError(f"outer state has fragment bounds {state['bounds']}, this one {self.bounds}: "
                             f"the checkpoint belongs to another model or fragment split")
        for outer_round, fragment_state in zip(self._rounds, state["fragments"]):
            outer_round.load_state_dict(fragment_state)

    def _check_fragment(self, fragment: int) -> int:
        if isinstance(fragment, bool) or not isinstance(fragment, int) or not 0 <= fragment < self.fragments:
            raise ValueError(f"fragment must be an int in [0, {self.fragments}), got {fragment!r}")
        return fragment

    def _piece(self, live: Tensor, start: int, end: int) -> Tensor:
        if live.dim() not in (1, 2) or live.shape[-1] != self.bounds[-1][1]:
            raise ValueError(f"live must be (P,) or (n, P) with P = {self.bounds[-1][1]}, "
                             f"got shape {tuple(live.shape)}")
        return live[..., start:end]


def _check_count(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_bounds(bounds: Sequence[tuple[int, int]], numel: int) -> None:
    expected = 0
    for start, end in bounds:
        if start != expected or not end > start:
            break
        expected = end
    else:
        if bounds and expected == numel:
            return
    raise ValueError(f"bounds must be contiguous, non-empty (start, end) pairs covering [0, {numel}) in "
                     f"order, got {list(bounds)!r}")
