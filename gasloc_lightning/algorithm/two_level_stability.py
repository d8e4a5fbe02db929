"""Stability of the two-level round (:mod:`gasloc_lightning.algorithm.two_level`) on quadratics.

The linear system. Every worker minimises a quadratic whose Hessian it shares with the others along an
eigendirection; H inner steps of gradient descent then map a round start theta to
``thetaH = s theta + (1 - s) c_i``, with the contraction ``s = (1 - lr a)^H`` in [0, 1] (s = 1: no
gradient, pure consensus; s = 0: each worker reaches its own minimum). The constant terms only move the
fixed point, so stability is the spectral radius of the homogeneous part. On a mode of the region
mixing W_R with eigenvalue lambda (lambda = 1: the mean over regions; a one-peer matching has 0 and 1),
one period of K rounds maps the region state (phi, b, x) (point after the last crossing = theta, the
region's momentum, the cross anchor) linearly::

    K times:   Delta = (1 - s) theta;  b = gamma_r b + Delta;  theta = theta - eta_r (Delta + gamma_r b)
    crossing:  z = phi + eta_g (theta - phi);  u = z + gamma_g (z - x)
               phi' = lambda u;  x' = z + (phi' - u) / (1 + gamma_g);  b' = b

With the delayed crossing (``cross_overlap``, beta) the state gains the correction c that has landed and is
not yet applied, and the crossing becomes::

               p = u + c;  phi' = p;  x' = z + c / (1 + gamma_g);  c' = beta (lambda - 1) p;  b' = b

:func:`period_matrices` builds that 3 x 3 (delayed: 4 x 4) matrix for every (s, lambda); :func:`two_level_rate` returns
the largest per-round rate ``rho(M)^(1 / K)`` over s in [0, 1) and the given lambdas, plus the consensus
modes (s = 1, lambda < 1). The invariant mode (s = 1, lambda = 1: no gradient, the mean) is excluded.
A rate < 1 means the round converges on every such quadratic; it tends to 1 as s -> 1 (flat directions),
so the rate itself says little, only whether it stays below 1.

Inside a region the members are identical after the first round (the exact average), so the region
state is the whole state. Random region graphs switch between matchings whose modes differ: there,
at s = 1 the region momentum is never mixed and decays as gamma_r^K, so the consensus part is the
anchored GASLoC's on the regions' graph at gamma_g, which the topologies' own check covers
(``TwoLevelTopology.check_rule`` runs both).

Measured (per-round rates; lambda in {0, 1/2, 1}, s in [0, 0.99] and s = 1; ``docs/algorithm.md`` section 8a):

================================  =====  =====  =====  =====  =====
(eta_r, gamma_r, eta_g, gamma_g)  K = 1  K = 2  K = 5  K = 10 K = 20
================================  =====  =====  =====  =====  =====
0.7, 0.9, 1.0, 0.5 (default)      0.946  0.955  0.969  0.976  0.976
0.7, 0.9, 1.0, 0.0 (hier.)        0.945  0.945  0.945  0.945  0.966
0.7, 0.9, 0.7, 0.9                1.040  1.023  0.999  0.990  0.982
0.7, 0.9, 1.0, 0.9                1.040  1.026  1.002  1.002  0.989
================================  =====  =====  =====  =====  =====

So gamma 0.9 at both levels is unstable for small K (at K = 1 it is two Nesterov momenta in series on
every round), and the defaults (DiLoCo's 0.7 / 0.9 inside, HALoS's 0.5 across, eta_g = 1) are stable
for every K tried. ``max_stable_cross_momentum`` gives the limit for a given rule.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gasloc_lightning.algorithm.two_level import TwoLevelRule

_DTYPE = torch.float64
#: lambdas of the region mixing checked by default: a matching's 0 and 1, and 1/2 (a PSD graph's middle).
DEFAULT_EIGENVALUES = (0.0, 0.5, 1.0)


def period_matrices(rule: TwoLevelRule, contractions: Tensor, eigenvalue: float) -> Tensor:
    """(S, 3, 3) float64: one period's map of (phi, b, x) for every contraction s, at mixing eigenvalue lambda;
    (S, 4, 4) of (phi, b, x, c) with the delayed crossing (``rule.cross_overlap``)."""
    s = contractions.to(_DTYPE).reshape(-1, 1)  # (S, 1)
    eta_r, gamma_r, eta_g, gamma_g = rule.region_lr, rule.region_momentum, rule.cross_lr, rule.cross_momentum
    size = 4 if rule.cross_overlap else 3
    basis = torch.eye(size, dtype=_DTYPE)  # rows of each state variable, as functions of the period's start: (S, size)
    phi, b, x = (basis[k].expand(s.shape[0], size) for k in range(3))
    theta = phi
    for _ in range(rule.cross_every):
        delta = (1 - s) * theta
        if gamma_r > 0:
            b = gamma_r * b + delta
            theta = theta - eta_r * (delta + gamma_r * b)
        else:  # no momentum: b is never read, so it is no state of the round (its mode would read as 1)
            theta = theta - eta_r * delta
            b = torch.zeros_like(b)
    z = phi + eta_g * (theta - phi)
    u = z + gamma_g * (z - x)
    if rule.cross_overlap:
        p = u + basis[3].expand(s.shape[0], size)  # u + c
        new_x = z + (p - u) / (1 + gamma_g)
        correction = rule.cross_delayed_weight * (eigenvalue - 1.0) * p
        return torch.stack([p, b, new_x, correction], dim=1)  # (S, 4, 4)
    new_phi = eigenvalue * u
    new_x = z + (new_phi - u) / (1 + gamma_g)
    return torch.stack([new_phi, b, new_x], dim=1)  # (S, 3, 3)


def two_level_rate(rule: TwoLevelRule, *, eigenvalues: tuple[float, ...] = DEFAULT_EIGENVALUES,
                   samples: int = 100, flattest: float = 0.99) -> float:
    """The largest per-round spectral rate of the two-level round over s in [0, ``flattest``] and the given
    lambdas, and over the consensus modes (s = 1, lambda < 1); < 1 is stable.

    The rate of a direction tends to 1 as s -> 1 whatever the rule, so the flattest directions are left out
    (``flattest``); the instabilities found sit at s of 0.85 to 0.95.

    Args:
        rule: the two levels' hyperparameters.
        eigenvalues: lambdas of the region mixing, each in [0, 1].
        samples: values of s, evenly spaced in [0, ``flattest``].
        flattest: the largest s with gradients.
    """
    if any(not 0.0 <= lam <= 1.0 for lam in eigenvalues):
        raise ValueError(f"eigenvalues must lie in [0, 1], got {eigenvalues}")
    if not 0.0 < flattest < 1.0:
        raise ValueError(f"flattest must lie in (0, 1), got {flattest}")
    contractions = torch.linspace(0.0, flattest, samples + 1, dtype=_DTYPE)
    worst = 0.0
    for lam in eigenvalues:
        s = contractions if lam == 1.0 else torch.cat([contractions, torch.ones(1, dtype=_DTYPE)])
        radius = torch.linalg.eigvals(period_matrices(rule, s, lam)).abs().amax(dim=-1)
        worst = max(worst, float(radius.max()))
    return worst ** (1.0 / rule.cross_every)


def max_stable_cross_momentum(rule: TwoLevelRule, *, eigenvalues: tuple[float, ...] = DEFAULT_EIGENVALUES,
                              resolution: float = 1e-3) -> float:
    """The largest gamma_g (to ``resolution``) with a rate < 1, the rule's other values kept (0.0: none above it).

    The stable set is an interval [0, limit) in every case measured; a bisection assumes it.
    """
    def stable(gamma: float) -> bool:
        candidate = dataclasses.replace(rule, cross_momentum=gamma)
        return two_level_rate(candidate, eigenvalues=eigenvalues) < 1.0

    low, high = 0.0, 0.999
    if stable(high):
        return high
    if not stable(low):
        return 0.0
    while high - low > resolution:
        middle = (low + high) / 2
        low, high = (middle, high) if stable(middle) else (low, middle)
    return low
