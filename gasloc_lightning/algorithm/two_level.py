"""Two-level GASLoC and hierarchical DiLoCo: DiLoCo inside every region, an outer step across regions.

Workers fall into r regions (fast links inside, slow links across). Round t of worker i in region A
(m_A members), after its H inner steps from the region's round start theta_A to thetaH_i:

1. **Region step, every round** (DiLoCo inside the region; eta_r = ``region_lr``, gamma_r =
   ``region_momentum``)::

       Delta_A = theta_A - mean_{i in A} thetaH_i                 (the exact average: an all-reduce in A)
       b_A     = gamma_r b_A + Delta_A
       theta_A = theta_A - eta_r (Delta_A + gamma_r b_A)         (torch SGD, Nesterov; no momentum at gamma_r = 0)

2. **Cross step, every K-th round** (K = ``cross_every``; rounds t with (t + 1) % K == 0), after the
   region step: the region points are the workers of an anchored GASLoC (``docs/algorithm.md``) whose
   inner phase is the K region rounds since the last crossing (eta_g = ``cross_lr``, gamma_g =
   ``cross_momentum``; phi_A the region point after the last crossing, x_A its anchor)::

       z_A     = phi_A + eta_g (theta_A - phi_A)
       u_A     = z_A + gamma_g (z_A - x_A)
       phi_A'  = sum_B W_R[A, B] u_B                             (gossip between regions, or the exact mean)
       x_A'    = z_A + (phi_A' - u_A) / (1 + gamma_g)
       theta_A = phi_A'                                          (b_A is kept: each region's momentum is its own)

   **Delayed crossing** (``cross_overlap``; beta = ``cross_delayed_weight``): the cross exchange is started at one
   crossing and applied at the next, so it travels under the K region rounds between them (DiLoCoX's one-step
   delay; GASLoC's ``overlap`` (``docs/algorithm.md`` section 5) with the regions as workers)::

       p_A     = u_A + beta C_A                                  (C_A: the correction that arrived, 0 at first)
       theta_A = p_A;  x_A' = z_A + (p_A - u_A) / (1 + gamma_g)  (at once: nothing waits for the exchange)
       posted: p_A;  arrived by the next crossing: C_A = sum_B W_R[A, B] p_B - p_A

   The posted point includes the correction already applied, so a correction is never measured twice. C is
   antisymmetric pair by pair, so the mean over ranks follows the non-delayed rule's; the last correction is
   folded in at the end of training.

   W_R is the round's mixing between regions (``TwoLevelTopology``: one peer region, lifted rank to
   rank, so rank l of region A carries 1/m of the bytes to rank l of region A'); the exact mean over
   all ranks (``cross_mean``) gives **hierarchical DiLoCo**.

Reductions (tests/test_two_level.py): one region has no cross step, so it is DiLoCo (bitwise, against
:class:`~gasloc_lightning.algorithm.round.DiLoCoRound`); one worker per region with eta_r = 1,
gamma_r = 0 and K = 1 is today's GASLoC on the regions' graph with (eta_g, gamma_g) (K > 1: the same
with K H inner steps); hierarchical DiLoCo with K = 1, eta_g = 1, gamma_g = 0 is DiLoCo (the outer
SGD is linear, so the mean of the regions' steps is the step of the mean).

Why momentum at both levels does not diverge where the one-level sketch did (ALGORITHM.md, "Two
levels"): between crossings a region's disagreement with the others sees no mixing, and the anchored
form's momentum then keeps pushing it (rate 1.029 at K = 5, gamma 0.9). Here a region's momentum
b_A acts on the region's own averaged pseudo-gradient, which is zero without gradients, so it decays
as gamma_r^K instead; the cross level's momentum sees one step per K rounds. The linear system on
quadratics and its spectral radius are in :mod:`gasloc_lightning.algorithm.two_level_stability`.

Shapes: rows are *ranks*: ``(P,)`` on one rank (the multi-process engines keep their region's state,
identical on every member, as DiLoCo keeps its round start), or ``(n, P)`` stacked (the simulator).
Every update is elementwise, so a row computes exactly what a rank does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gasloc_lightning.algorithm.outer import OuterState, validate_outer_hyperparameters


@dataclass(frozen=True)
class TwoLevelRule:
    """The two levels' hyperparameters.

    Args:
        cross_every: K >= 1, region rounds per cross step.
        region_lr, region_momentum: eta_r and gamma_r of DiLoCo inside a region.
        cross_lr, cross_momentum: eta_g and gamma_g of the anchored outer step across regions.
        cross_mean: the cross step is the exact mean over all ranks (hierarchical DiLoCo) instead of a gossip.
        cross_overlap: start each cross exchange at one crossing and apply it at the next (the delayed crossing).
        cross_delayed_weight: beta in (0, 1], the scale of the delayed correction (``cross_overlap`` only).
    """

    cross_every: int = 1
    region_lr: float = 0.7
    region_momentum: float = 0.9
    cross_lr: float = 1.0
    cross_momentum: float = 0.5
    cross_mean: bool = False
    cross_overlap: bool = False
    cross_delayed_weight: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.cross_overlap, bool):
            raise ValueError(f"cross_overlap must be a bool, got {self.cross_overlap!r}")
        if not 0.0 < self.cross_delayed_weight <= 1.0:
            raise ValueError(f"cross_delayed_weight (beta) must be in (0, 1], got {self.cross_delayed_weight!r}")
        if isinstance(self.cross_every, bool) or not isinstance(self.cross_every, int) or self.cross_every < 1:
            raise ValueError(f"cross_every (K) must be an int >= 1, got {self.cross_every!r}")
        for level, lr, momentum in (("region", self.region_lr, self.region_momentum),
                                    ("cross", self.cross_lr, self.cross_momentum)):
            try:
                validate_outer_hyperparameters(lr, momentum, "anchored")
            except ValueError as error:
                raise ValueError(f"{level}_lr / {level}_momentum: {error}") from None

    def is_cross_round(self, round_index: int) -> bool:
        """Whether round t ends with a cross step: the K-th, 2K-th, ... round."""
        return (round_index + 1) % self.cross_every == 0


class TwoLevelRound:
    """The state and arithmetic of the two-level round for one rank ``(P,)`` or n stacked ranks ``(n, P)``.

    The engine moves the tensors: it averages :meth:`pseudo_gradient` inside each region (an all-reduce over
    the region's ranks) for :meth:`region_step`, and on a cross round mixes :meth:`cross_message` across
    regions into :attr:`cross_destination` before :meth:`cross_finish`. With ``rule.cross_overlap`` it calls
    :meth:`cross_finish` at once and mixes in the background: when the mix has landed in
    :attr:`cross_destination` (by the next crossing, before its :meth:`cross_message`), :meth:`cross_land`;
    at the end of training, :meth:`fold_correction`.

    Args:
        initial: the starting point(s), identical on every rank.
        rule: the two levels' hyperparameters.
        num_regions: r; one region has no cross step (it has nobody to exchange with), so it is DiLoCo.
    """

    def __init__(self, initial: Tensor, *, rule: TwoLevelRule, num_regions: int) -> None:
        if initial.dim() not in (1, 2):
            raise ValueError(f"initial must be one point (P,) or stacked rows (n, P), got shape {tuple(initial.shape)}")
        if isinstance(num_regions, bool) or not isinstance(num_regions, int) or num_regions < 1:
            raise ValueError(f"num_regions must be an int >= 1, got {num_regions!r}")
        self.rule, self.num_regions = rule, num_regions
        self.region_start = nn.Parameter(initial.detach().to(torch.float32, copy=True))
        self._region_sgd = torch.optim.SGD([self.region_start], lr=rule.region_lr, momentum=rule.region_momentum,
                                           nesterov=rule.region_momentum > 0)
        self.cross = OuterState(initial, rule.cross_lr, rule.cross_momentum, "anchored")  # phi and x
        self._message = torch.empty_like(self.cross.round_start)
        if rule.cross_overlap:  # p posted, the mix of the posted p that lands, and beta C not yet applied
            self._posted = torch.empty_like(self._message)
            # the last mix that landed (the start before any): what a quantized delayed mean measures changes from
            self._arrived = self.cross.round_start.clone()
            self.correction = torch.zeros_like(self._message)
        self.in_flight = False  # a posted cross exchange has not landed (cross_overlap)

    def crosses(self, round_index: int) -> bool:
        """Whether round t ends with a cross step (never with one region)."""
        return self.num_regions > 1 and self.rule.is_cross_round(round_index)

    @torch.no_grad()
    def pseudo_gradient(self, local_end: Tensor, out: Tensor | None = None) -> Tensor:
        """Delta_i = theta_A - thetaH_i (rows: every rank's), into ``out`` (default: over ``local_end``)."""
        return torch.sub(self.region_start, local_end, out=local_end if out is None else out)

    @torch.no_grad()
    def region_step(self, region_mean_pseudo_gradient: Tensor) -> Tensor:
        """The region's DiLoCo step with its members' mean Delta (rows: each rank's region's); returns theta_A."""
        self.region_start.grad = region_mean_pseudo_gradient
        self._region_sgd.step()
        self.region_start.grad = None
        return self.region_start.detach()

    @torch.no_grad()
    def cross_message(self) -> Tensor:
        """The point this rank's region sends across: u_A, or with ``cross_overlap`` p_A = u_A + beta C_A (a buffer
        the engine may read until the finish, or with ``cross_overlap`` until the exchange lands)."""
        u = self.cross.message(self._message.copy_(self.region_start))
        if not self.rule.cross_overlap:
            return u
        if self.in_flight:
            raise RuntimeError("cross_message() while the last cross exchange is in flight: cross_land() first")
        torch.add(u, self.correction, out=self._posted)
        self.correction.zero_()
        return self._posted

    @property
    def last_mix(self) -> Tensor:
        """The delayed crossing's last landed mix (the starting point before any), or without the delay phi, the
        region point after the last crossing: the same on every rank of a mean, the reference a quantized mean
        averages changes from (read before the engine writes :attr:`cross_destination`)."""
        return self._arrived if self.rule.cross_overlap else self.cross.round_start

    @property
    def cross_destination(self) -> Tensor:
        """Where the engine writes phi_A' = sum_B W_R[A, B] m_B of the messages m (rows: each rank's region's)."""
        return self._arrived if self.rule.cross_overlap else self.cross.mixed_destination()

    @torch.no_grad()
    def cross_finish(self) -> Tensor:
        """The anchor x_A' from the new region point: phi_A' (waited for), or with ``cross_overlap`` the posted p_A
        (the exchange then travels until :meth:`cross_land`). Momentum is kept. Returns the region point."""
        if self.rule.cross_overlap:
            self.cross.mixed_destination().copy_(self._posted)
            self.in_flight = True
        mixed = self.cross.finish(self._message, self.cross.mixed_destination())
        self.region_start.copy_(mixed)
        return self.region_start.detach()

    @torch.no_grad()
    def cross_land(self) -> None:
        """The posted exchange's mix is in :attr:`cross_destination`: beta C_A = beta (mix - p_A), applied by the next
        :meth:`cross_message` (or :meth:`fold_correction`)."""
        if not self.in_flight:
            raise RuntimeError("cross_land() with no cross exchange in flight")
        torch.sub(self._arrived, self._posted, out=self.correction).mul_(self.rule.cross_delayed_weight)
        self.in_flight = False

    @torch.no_grad()
    def fold_correction(self) -> Tensor:
        """End of training: the landed correction not yet applied goes into the region point. Returns it."""
        if self.in_flight:
            raise RuntimeError("fold_correction() while a cross exchange is in flight: cross_land() first")
        if self.rule.cross_overlap:
            self.region_start.add_(self.correction)
            self.correction.zero_()
        return self.region_start.detach()

    @torch.no_grad()
    def region_tensors(self) -> list[Tensor]:
        """Every tensor of this rank's two-level state, in a fixed order, as live references: the region point, b_A,
        phi_A and x_A (with ``cross_overlap`` also C_A and the last landed mix). All members of a region hold the
        same values; an engine whose members come and go copies them from one member to the others (the elastic
        mode after a heal). b_A is created at zero when it does not exist yet, which changes no step: SGD's first
        step from a zero buffer is its first step without one."""
        if self.rule.region_momentum > 0 and self.momentum_buffer is None:
            self._region_sgd.state[self.region_start]["momentum_buffer"] = torch.zeros_like(self.region_start)
        tensors = [self.region_start.data]
        if self.momentum_buffer is not None:
            tensors.append(self.momentum_buffer)
        tensors += [self.cross.round_start, self.cross.anchor]
        if self.rule.cross_overlap:
            tensors += [self.correction, self._arrived]
        return tensors

    @property
    def momentum_buffer(self) -> Tensor | None:
        """b_A (None before the first step or without momentum)."""
        return self._region_sgd.state[self.region_start].get("momentum_buffer")

    def state_dict(self) -> dict:
        """Taken between rounds with nothing in flight (an engine lands or folds the delayed exchange first)."""
        if self.in_flight:
            raise RuntimeError("state_dict() while a cross exchange is in flight: land it first")
        state = {"region_start": self.region_start.detach().clone(), "region_optimizer": self._region_sgd.state_dict(),
                 "cross": self.cross.state_dict()}
        if self.rule.cross_overlap:
            state["correction"] = self.correction.clone()
            state["last_mix"] = self._arrived.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["region_start"].shape != self.region_start.shape:
            raise ValueError("the two-level state belongs to another model (or another number of rows)")
        with torch.no_grad():
            self.region_start.copy_(state["region_start"])
        self._region_sgd.load_state_dict(state["region_optimizer"])
        for group in self._region_sgd.param_groups:  # the step is this rule's, whatever the saved groups say
            group.update(lr=self.rule.region_lr, momentum=self.rule.region_momentum, dampening=0.0,
                         nesterov=self.rule.region_momentum > 0, weight_decay=0.0)
        self.cross.load_state_dict(state["cross"])
        if self.rule.cross_overlap:  # saved without the delayed crossing: nothing was pending, a zero correction
            self.correction.copy_(state["correction"]) if "correction" in state else self.correction.zero_()
            # saved before the last mix was kept: the region point (gossip overwrites it before reading it; a delayed
            # quantized mean, gasloc-sim's only, measures its first changes from there, region by region)
            self._arrived.copy_(state["last_mix"] if "last_mix" in state else state["region_start"])
        self.in_flight = False
