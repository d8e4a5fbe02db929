"""Consensus stability of the GASLoC outer step (ALGORITHM.md, "Stability check").

With no gradients the inner phase leaves every worker where it started (thetaH = theta, so
z = theta) and one round of the outer step is a linear map on the stacked state (theta, x) of
the n workers, driven by the round's mixing matrix W (symmetric, doubly stochastic):

- ``"anchored"`` (the default form)::

      u      = z + gamma (z - x)
      theta+ = W u
      x+     = (theta+ + gamma x) / (1 + gamma)     # = z + (theta+ - u) / (1 + gamma)

- ``"post_mix"``::

      x+     = W z
      theta+ = x+ + gamma (x+ - x)

With ``overlap=True`` the exchange posted in round t completes in round t + 1 (it runs while
round t + 1 computes), so the peers' points are folded in one round late, scaled by the
delayed weight beta (``delayed_weight``, default 1). The point each worker sends is the one it
moves to, the correction just folded in::

    anchored:  theta(t+1) = u(t) + beta (W(t-1) - I) p(t-1),  p(t) = theta(t+1)
               x(t+1)     = (theta(t+1) + gamma x(t)) / (1 + gamma)
    post_mix:  x(t+1)     = z(t) + beta (W(t-1) - I) p(t-1),  p(t) = x(t+1)
               theta(t+1) = x(t+1) + gamma (x(t+1) - x(t))

with nothing in flight in round 0. The delayed term is antisymmetric per pair, so the mean
still follows DiLoCo's outer step exactly; the state gains the point sent last round.

Mixing never moves the mean over workers, so what matters is the disagreement
``sqrt(sum_i ||theta_i - mean(theta)||^2)``. Its asymptotic per-round contraction (the
consensus rate) must be < 1 for the replicas to agree; the strategy refuses a configuration
whose rate is >= 1.

How the rate is computed:

- fixed W: exactly, one 2x2 mode matrix per eigenvalue lambda of W on the disagreement space,
  3x3 on (theta, x, u_prev) with overlap (``consensus_rate_fixed``);
- a periodic schedule of commuting W (the hypercube): exactly, the product of the mode
  matrices over one period for each common eigenvector (``consensus_rate_periodic``);
- random schedules: a seeded float64 simulation in which many gammas share the rounds
  (``consensus_rates_simulated``; ``consensus_rate_simulated`` is its one-gamma case), and
  ``max_stable_momentum_grid`` searches the limit with two of them (``max_stable_momentum``
  is its one-gamma-at-a-time case).

Stability of the overlapped exchange (anchored form, no gradients; measured with
``Topology.max_stable_momentum(n, overlap=True, delayed_weight=beta)``; 0.999 is the top of the
search):

============  =====================  ====================================
topology      largest stable gamma,  rate at gamma = 0.9, n = 16:
              beta = 1, n = 4 .. 64  beta = 1 / 1/2 / 1/4 (no overlap)
============  =====================  ====================================
one_peer      0.999                  0.910 / 0.919 / 0.932 (0.873)
two_peer      0.999                  0.852 / 0.899 / 0.924 (0.744)
ring          0.999                  0.939 / 0.944 / 0.946 (0.930)
exponential   0.999, n = 64: 0.791   0.880 / 0.913 / 0.932 (0.949)
complete      0.999                  0.653 / 0.814 / 0.884 (0)
============  =====================  ====================================

bandwidth_aware with two clusters of 4 is the exception found so far: about 0.93 with overlap (seed 0;
the estimate moves by a few hundredths with the seed of the schedule).
At gamma = 0 a mode lambda of a fixed W has the mode matrix [[1, beta (lambda - 1)], [1,
beta (lambda - 1)]] on (theta, p): eigenvalues 0 and 1 - beta (1 - lambda), so beta = 1
contracts exactly as fast as the synchronous exchange and a smaller beta only slows it down.

Why the point sent must include the correction: had each worker sent u (the point before the
delayed term), a correction already applied would be measured again in the next exchange. A
mode with lambda = 0 (every pairwise average, the complete graph, each hypercube round) then
follows d(t+1) = d(t) - d(t-1) at gamma = 0, a rotation by 60 degrees per round that never
contracts, and momentum makes it grow; only damping beta to 1/4 or so kept it stable, at a
large cost in consensus speed. ``tests/test_stability.py`` keeps that counterexample.

The two-level round (DiLoCo inside regions, an outer step across them every K rounds) has its own
linear system, with gradients, in :mod:`gasloc_lightning.algorithm.two_level_stability`; the anchored
form on the two-level W_t that this module would rate diverges for rare crossings (docs/algorithm.md 8b).

Everything here is pure float64 math on CPU tensors; no process group is involved.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

UpdateForm = Literal["anchored", "post_mix"]
UPDATE_FORMS: tuple[str, ...] = ("anchored", "post_mix")

# 0.44 is the largest gamma that ALGORITHM.md ("Stability check") reports as certified for ANY
# switching sequence of positive semidefinite W, i.e. for schedules whose rate cannot be
# computed exactly (user-supplied time-varying topologies); the strategy warns once above it.
# Such a certificate is a quadratic Lyapunov function common to the mode matrices M(lambda) of
# every lambda in [0, 1]: the stacked map is A0 (x) I + A1 (x) W, so the condition splits per
# eigenvalue of W even when successive W do not commute. It is not re-derived here; the tests
# check it on mixed, non-commuting schedules.
SWITCHING_SAFE_MOMENTUM: float = 0.44

# Eigenvalues within this distance of 0 or 1 are treated as exactly 0 or 1 (see
# consensus_rate_modes); float64 eigensolvers are accurate to a few 1e-16 here.
_EIGENVALUE_TOL = 1e-12
# With overlap, a mode rate this close to 1 is marginal (see consensus_rate_modes).
_MARGINAL_TOL = 1e-9
_DTYPE = torch.float64


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # The rate computations run thousands of tiny products ((n, n) by thin (n, d), batches of
    # 2x2). Threads buy nothing at that size, and when the cores are shared (several ranks on
    # a node checking stability at setup) their spin-waiting made products ~1000x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class NonCommutingError(ValueError):
    """The mixing matrices of a periodic schedule share no eigenbasis: no exact rate exists."""


def check_form(form: str) -> None:
    """Raise ``ValueError`` unless ``form`` is one of :data:`UPDATE_FORMS`."""
    if form not in UPDATE_FORMS:
        raise ValueError(f"form must be one of {list(UPDATE_FORMS)}, got {form!r}")


def check_outer_momentum(outer_momentum: float) -> None:
    """Raise ``ValueError`` unless the outer momentum gamma lies in [0, 1)."""
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum (gamma) must lie in [0, 1), got {outer_momentum!r}")


def check_delayed_weight(delayed_weight: float) -> None:
    """Raise ``ValueError`` unless the delayed weight beta lies in (0, 1]."""
    if not 0.0 < delayed_weight <= 1.0:
        raise ValueError(f"delayed_weight (beta) must lie in (0, 1], got {delayed_weight!r}")


def _check_rate_arguments(outer_momentum: float, form: str, delayed_weight: float) -> None:
    check_form(form)
    check_outer_momentum(outer_momentum)
    check_delayed_weight(delayed_weight)


def mode_matrix(
    eigenvalue: float,
    outer_momentum: float,
    form: UpdateForm = "anchored",
    overlap: bool = False,
    *,
    delayed_weight: float = 1.0,
) -> Tensor:
    """The map of one round on one eigen-mode of a symmetric W.

    Args:
        eigenvalue: an eigenvalue lambda of the mixing matrix W (with overlap: of W(t-1), the
            matrix whose exchange completes in this round).
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        overlap: the one-round-delayed exchange (see the module docstring).
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        Without overlap a (2, 2) float64 tensor M with ``(theta+, x+) = M (theta, x)`` for the
        mode's coefficients; with overlap a (3, 3) one with
        ``(theta+, x+, p+) = M (theta, x, p)``, p the point sent last round (u, or z = theta
        for post_mix).
    """
    _check_rate_arguments(outer_momentum, form, delayed_weight)
    eigenvalues = torch.tensor([eigenvalue], dtype=_DTYPE)
    if overlap:
        return _overlap_mode_matrices(eigenvalues, outer_momentum, form, delayed_weight)[0]
    return _mode_matrices(eigenvalues, outer_momentum, form)[0]


def _mode_matrices(eigenvalues: Tensor, gamma: float, form: str) -> Tensor:
    lam = eigenvalues.to(_DTYPE)  # (m,)
    out = torch.zeros(*lam.shape, 2, 2, dtype=_DTYPE)  # (m, 2, 2)
    out[..., 0, 0] = lam * (1.0 + gamma)
    out[..., 1, 0] = lam
    if form == "anchored":
        out[..., 0, 1] = -gamma * lam
        out[..., 1, 1] = gamma * (1.0 - lam) / (1.0 + gamma)
    else:
        out[..., 0, 1] = -gamma
    return out


def _overlap_mode_matrices(eigenvalues: Tensor, gamma: float, form: str, beta: float) -> Tensor:
    # Rows: theta+, x+, p+ over columns theta, x, p (p: the point sent last round, c = beta (lambda - 1)).
    delayed = beta * (eigenvalues.to(_DTYPE) - 1.0)  # (m,)
    out = torch.zeros(*delayed.shape, 3, 3, dtype=_DTYPE)  # (m, 3, 3)
    out[..., 1, 0] = 1.0
    if form == "anchored":  # theta+ = u + c p, x+ = theta + c p / (1 + gamma), p+ = theta+
        out[..., 0, 0] = 1.0 + gamma
        out[..., 0, 1] = -gamma
        out[..., 0, 2] = delayed
        out[..., 1, 2] = delayed / (1.0 + gamma)
        out[..., 2, :] = out[..., 0, :]
    else:  # x+ = theta + c p, theta+ = (1 + gamma) x+ - gamma x, p+ = x+
        out[..., 0, 0] = 1.0 + gamma
        out[..., 0, 1] = -gamma
        out[..., 0, 2] = (1.0 + gamma) * delayed
        out[..., 1, 2] = delayed
        out[..., 2, :] = out[..., 1, :]
    return out


def _check_mixing_matrix(matrix: Tensor) -> Tensor:
    matrix = torch.as_tensor(matrix, dtype=_DTYPE)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"mixing matrix W must be square, got shape {tuple(matrix.shape)}")
    if not torch.allclose(matrix, matrix.T, atol=1e-10, rtol=0.0):
        raise ValueError("mixing matrix W must be symmetric (w_ij == w_ji)")
    if not torch.allclose(matrix.sum(dim=1), torch.ones(len(matrix), dtype=_DTYPE), atol=1e-10, rtol=0.0):
        raise ValueError("mixing matrix W must be doubly stochastic (rows summing to 1)")
    return matrix


def _disagreement_basis(world_size: int) -> Tensor:
    """Orthonormal basis (n, n - 1) of the vectors orthogonal to all-ones (a Householder reflection)."""
    ones = torch.full((world_size,), world_size**-0.5, dtype=_DTYPE)
    v = ones.clone()
    v[0] -= 1.0
    reflection = torch.eye(world_size, dtype=_DTYPE) - 2.0 * torch.outer(v, v) / v.dot(v)
    return reflection[:, 1:]  # the reflection maps e_0 to all-ones; its other columns span the rest


def disagreement_eigenvalues(matrix: Tensor) -> Tensor:
    """Eigenvalues of a symmetric, doubly stochastic W on the disagreement space.

    The all-ones eigenvector (consensus) is projected out exactly, so a disconnected graph keeps
    its extra eigenvalues 1.

    Args:
        matrix: W, shape (n, n).

    Returns:
        The n - 1 eigenvalues, ascending, float64.
    """
    matrix = _check_mixing_matrix(matrix)
    if len(matrix) == 1:
        return torch.zeros(0, dtype=_DTYPE)
    basis = _disagreement_basis(len(matrix))
    return torch.linalg.eigvalsh(basis.T @ matrix @ basis)


def _first_primes(count: int) -> list[int]:
    primes: list[int] = []
    candidate = 2
    while len(primes) < count:
        if all(candidate % p for p in primes):
            primes.append(candidate)
        candidate += 1
    return primes


def periodic_mode_eigenvalues(matrices: Sequence[Tensor]) -> Tensor:
    """Per common eigenvector, the eigenvalue of each W_k of a commuting periodic schedule.

    Commuting symmetric matrices share an orthonormal eigenbasis; it is found from a generic
    linear combination and checked to diagonalize every W_k.

    Args:
        matrices: W_0, ..., W_{T-1}, each (n, n), symmetric, doubly stochastic, commuting.

    Returns:
        A (n - 1, T) float64 table: row = a common eigenvector on the disagreement space,
        column k = its eigenvalue under W_k.

    Raises:
        NonCommutingError: (a ``ValueError``) if the matrices are not a commuting family.
    """
    if not matrices:
        raise ValueError("matrices must hold at least one mixing matrix")
    checked = [_check_mixing_matrix(m) for m in matrices]
    n = len(checked[0])
    if any(m.shape != (n, n) for m in checked):
        raise ValueError("all mixing matrices of a schedule must have the same shape")
    if n == 1:
        return torch.zeros(0, len(checked), dtype=_DTYPE)
    basis = _disagreement_basis(n)
    reduced = torch.stack([basis.T @ m @ basis for m in checked])  # (T, n-1, n-1)
    # Square roots of distinct primes are linearly independent over the rationals, so distinct
    # eigenvalue tuples (0/1 for the hypercube) get distinct eigenvalues in the combination.
    coefficients = torch.tensor([math.sqrt(p) for p in _first_primes(len(checked))], dtype=_DTYPE)
    _, vectors = torch.linalg.eigh(torch.einsum("t,tij->ij", coefficients, reduced))
    diagonalized = vectors.T @ reduced @ vectors  # (T, n-1, n-1)
    table = torch.diagonal(diagonalized, dim1=1, dim2=2)  # (T, n-1)
    off_diagonal = diagonalized - torch.diag_embed(table)
    if off_diagonal.abs().max() > 1e-8:
        raise NonCommutingError("the mixing matrices do not commute; use consensus_rate_simulated instead")
    return table.T.contiguous()


def consensus_rate_modes(
    mode_eigenvalues: Tensor,
    outer_momentum: float,
    form: UpdateForm = "anchored",
    overlap: bool = False,
    *,
    delayed_weight: float = 1.0,
) -> float:
    """Consensus rate from the eigenvalues each mode sees over one period.

    For each mode the rate is rho(M_{T-1} ... M_0)^(1/T), the spectral radius of the product of
    its mode matrices over the period. With overlap, round t folds in W(t-1), so its matrix takes
    the previous column; the product is then a cyclic shift of the same factors, with the same
    spectral radius. Some cases are set exactly rather than left to rounding:

    - a mode with lambda = 1 in every round never contracts (a disconnected graph): rate 1;
    - in the anchored form without overlap, a mode with lambda = 0 in every round has
      theta+ = 0 each round, so its theta disagreement is gone after one round (only its hidden
      anchor x decays): rate 0. This is why the complete graph has rate 0 at any gamma. With
      overlap it does not vanish (a one-round-stale average), and is computed like any other;
    - with overlap, a rate within 1e-9 of 1 is set to 1: such modes (e.g. lambda = 0 at
      gamma = 0 and beta = 1, which oscillates with period 6) do not contract.

    Args:
        mode_eigenvalues: (modes, T) table, or (modes,) for a fixed W (T = 1).
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        overlap: the one-round-delayed exchange (3x3 mode matrices on (theta, x, u_prev)).
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        The largest per-round rate over the modes; 0.0 when there is no mode (n = 1).
    """
    _check_rate_arguments(outer_momentum, form, delayed_weight)
    table = torch.as_tensor(mode_eigenvalues, dtype=_DTYPE)
    table = table[:, None] if table.ndim == 1 else table  # (m, T)
    if table.shape[0] == 0:
        return 0.0
    with _one_thread():
        return _max_mode_rate(table, outer_momentum, form, overlap, delayed_weight)


def _snapped(table: Tensor) -> Tensor:
    # Snap rounding noise: a near-0 product raised to 1/T would otherwise read as a real rate.
    table = torch.where(table.abs() <= _EIGENVALUE_TOL, 0.0, table)
    return torch.where((table - 1.0).abs() <= _EIGENVALUE_TOL, 1.0, table)


def _max_mode_rate(table: Tensor, gamma: float, form: str, overlap: bool, beta: float) -> float:
    table = _snapped(table)  # (m, T)
    size = 3 if overlap else 2
    product = torch.eye(size, dtype=_DTYPE).expand(table.shape[0], size, size)  # (m, s, s)
    for column in table.T:
        if overlap:
            product = _overlap_mode_matrices(column, gamma, form, beta) @ product
        else:
            product = _mode_matrices(column, gamma, form) @ product
    rates = torch.linalg.eigvals(product).abs().amax(dim=-1) ** (1.0 / table.shape[1])  # (m,)
    never_contracts = (table == 1.0).all(dim=1)
    if overlap:
        rates[never_contracts | ((rates - 1.0).abs() <= _MARGINAL_TOL)] = 1.0
    else:
        rates[never_contracts] = 1.0
        if form == "anchored":
            rates[(table == 0.0).all(dim=1)] = 0.0
    return float(rates.max())


def consensus_rate_fixed(
    matrix: Tensor,
    outer_momentum: float,
    form: UpdateForm = "anchored",
    overlap: bool = False,
    *,
    delayed_weight: float = 1.0,
) -> float:
    """Exact asymptotic per-round contraction of the disagreement for a fixed symmetric W.

    Args:
        matrix: W, (n, n), symmetric and doubly stochastic.
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        overlap: the one-round-delayed exchange.
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        max over the eigenvalues lambda of W on the disagreement space of rho(M(lambda)).
        1.0 for a disconnected graph.
    """
    return consensus_rate_modes(
        disagreement_eigenvalues(matrix), outer_momentum, form, overlap, delayed_weight=delayed_weight
    )


def consensus_rate_periodic(
    matrices: Sequence[Tensor],
    outer_momentum: float,
    form: UpdateForm = "anchored",
    overlap: bool = False,
    *,
    delayed_weight: float = 1.0,
) -> float:
    """Exact consensus rate of a periodic schedule of commuting W (e.g. the hypercube).

    Args:
        matrices: one period W_0, ..., W_{T-1}; round t uses W_{t mod T}.
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        overlap: the one-round-delayed exchange.
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        max over common eigenvectors of rho(M_{T-1} ... M_0)^(1/T).
    """
    return consensus_rate_modes(
        periodic_mode_eigenvalues(matrices), outer_momentum, form, overlap, delayed_weight=delayed_weight
    )


def _step(
    theta: Tensor, anchor: Tensor, matrix: Tensor, gamma: float | Tensor, form: str
) -> tuple[Tensor, Tensor]:
    # anchor is x: the anchor (anchored form) or the previous mixed point W z (post_mix).
    if form == "anchored":
        sent = theta + gamma * (theta - anchor)  # u, (n, d)
        mixed = matrix @ sent
        return mixed, (mixed + gamma * anchor) / (1.0 + gamma)
    mixed = matrix @ theta  # x+, (n, d)
    return mixed + gamma * (mixed - anchor), mixed


def _overlap_step(
    state: tuple[Tensor, ...], matrix: Tensor, gamma: float | Tensor, form: str, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    # in_flight = beta (W(t-1) - I) p(t-1): the exchange posted last round, folded in now; the
    # point sent this round, p(t), already includes it.
    theta, anchor, in_flight = state
    if form == "anchored":
        theta_next = theta + gamma * (theta - anchor) + in_flight  # u + in_flight
        anchor_next = (theta_next + gamma * anchor) / (1.0 + gamma)
        sent = theta_next
    else:
        anchor_next = theta + in_flight  # z + in_flight
        theta_next = anchor_next + gamma * (anchor_next - anchor)
        sent = anchor_next
    return theta_next, anchor_next, beta * (matrix @ sent - sent)


class _StackedSparse:
    """Sparse W of several runs, applied run by run (sparse tensors do not batch)."""

    def __init__(self, matrices: list[Tensor]) -> None:
        self.matrices = matrices

    def __matmul__(self, states: Tensor) -> Tensor:
        return torch.stack([matrix @ state for matrix, state in zip(self.matrices, states)])


def _log_disagreements(
    sample_matrix: Callable[[int], Tensor],
    world_size: int,
    gammas: Tensor,
    form: str,
    rounds: int,
    runs: Sequence[tuple[int, int]],
    columns: int,
    overlap: bool,
    beta: float,
) -> Tensor:
    """(runs, G, rounds + 1) log-disagreements of G gammas and several runs at once.

    A run is (seed of its initial point, its first round). States are (runs, n, G d): column
    block g belongs to gamma g, so one batched product with the runs' W of a round serves every
    gamma, and each (run, gamma) is renormalized on its own every round: the states stay O(1)
    and the logs carry the scale, so nothing under- or overflows. Entry t is
    log(||theta_t - mean|| / ||theta_0 - mean||); -inf once the disagreement vanishes exactly.
    """
    count = len(gammas)
    starts = []
    for seed, _ in runs:
        start = torch.randn(world_size, columns, generator=torch.Generator().manual_seed(seed), dtype=_DTYPE)
        starts.append(start - start.mean(dim=0))
    theta = torch.stack(starts).repeat(1, 1, count)  # (R, n, G d)
    gamma = gammas.to(_DTYPE).repeat_interleave(columns)  # (G d,)
    # zero initial momentum: x(0) = theta(0); with overlap nothing is in flight in round 0
    state = (theta, theta.clone(), torch.zeros_like(theta)) if overlap else (theta, theta.clone())
    log_scale = -torch.stack(starts).square().sum(dim=(1, 2)).log()[:, None].expand(-1, count) / 2  # (R, G)
    logs = torch.full((len(runs), count, rounds + 1), -math.inf, dtype=_DTYPE)
    logs[..., 0] = 0.0
    for t in range(rounds):
        matrices = [sample_matrix(first + t) for _, first in runs]
        stacked = _StackedSparse(matrices) if matrices[0].is_sparse else torch.stack(matrices)  # (R, n, n)
        if overlap:
            state = _overlap_step(state, stacked, gamma, form, beta)
        else:
            state = _step(*state, stacked, gamma, form)
        # The mean evolves on its own (W is doubly stochastic); dropping it every round keeps its
        # rounding errors from growing against the renormalized disagreement.
        for part in state:
            part -= part.mean(dim=1, keepdim=True)
        blocks = [part.view(len(runs), world_size, count, columns) for part in state]  # (R, n, G, d) views
        squares = torch.stack([block.square().sum(dim=(1, 3)) for block in blocks])  # (parts, R, G)
        logs[..., t + 1] = 0.5 * squares[0].log() + log_scale  # log 0 = -inf: exact consensus
        total = squares.sum(dim=0).sqrt()  # (R, G)
        if not bool((total > 0.0).any()):
            break
        scale = torch.where(total > 0.0, total, 1.0)
        for block in blocks:
            block /= scale[:, None, :, None]
        log_scale = log_scale + scale.log()
    return logs


def _fitted_rates(logs: Tensor, burn_in: int) -> Tensor:
    """(G,) exp of the least-squares slope of each row's log-disagreement over rounds burn_in..end;
    0 for a row that reached exact consensus."""
    values = logs[:, burn_in:]  # (G, T)
    rounds = torch.arange(burn_in, logs.shape[1], dtype=_DTYPE)
    weight = values.isfinite().to(_DTYPE)
    count = weight.sum(dim=1).clamp(min=1.0)
    values = torch.where(values.isfinite(), values, 0.0)
    t_centred = rounds - (weight * rounds).sum(dim=1, keepdim=True) / count[:, None]
    v_centred = values - (weight * values).sum(dim=1, keepdim=True) / count[:, None]
    numerator = (weight * t_centred * v_centred).sum(dim=1)
    denominator = (weight * t_centred.square()).sum(dim=1)
    rates = torch.where(denominator > 0.0, (numerator / denominator.clamp(min=1e-300)).exp(), 0.0)
    return torch.where(logs[:, -1] == -math.inf, 0.0, rates)


def disagreement_trajectory(
    sample_matrix: Callable[[int], Tensor],
    world_size: int,
    outer_momentum: float,
    form: UpdateForm = "anchored",
    rounds: int = 300,
    seed: int = 0,
    columns: int = 4,
    first_round: int = 0,
    *,
    overlap: bool = False,
    delayed_weight: float = 1.0,
) -> Tensor:
    """Simulate consensus (no gradients) and return the relative disagreement per round.

    Args:
        sample_matrix: round index -> W of that round, (n, n) float64.
        world_size: n.
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        rounds: number of rounds to run.
        seed: seeds the random initial disagreement (standard normal, mean removed).
        columns: d, the number of independent coordinates per worker.
        first_round: round index of the first round (shifts a random schedule).
        overlap: the one-round-delayed exchange (nothing in flight in the first round).
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        (rounds + 1,) float64: ||theta_t - mean|| / ||theta_0 - mean||. The run renormalizes
        every round and tracks logs, so only these final ratios can underflow to 0 or overflow.
    """
    _check_rate_arguments(outer_momentum, form, delayed_weight)
    gammas = torch.tensor([outer_momentum], dtype=_DTYPE)
    with _one_thread():
        logs = _log_disagreements(
            sample_matrix, world_size, gammas, form, rounds, [(seed, first_round)], columns, overlap,
            delayed_weight,
        )  # (1, 1, rounds + 1)
    return logs[0, 0].exp()


def consensus_rate_simulated(
    sample_matrix: Callable[[int], Tensor],
    world_size: int,
    outer_momentum: float,
    form: UpdateForm = "anchored",
    rounds: int = 300,
    seeds: Sequence[int] = (0, 1, 2, 3),
    columns: int = 4,
    *,
    overlap: bool = False,
    delayed_weight: float = 1.0,
) -> float:
    """Estimate the consensus rate of a random schedule by a seeded float64 simulation.

    Each seed runs ``rounds`` rounds from its own random initial disagreement, on its own
    stretch of the schedule (seed s uses rounds s * rounds, ..., (s + 1) * rounds - 1), and
    fits the geometric-mean contraction over the last two thirds. The result is the max over
    seeds, so it errs towards calling a schedule unstable. Deterministic for given inputs.

    Args:
        sample_matrix: round index -> W of that round, (n, n) float64, doubly stochastic.
        world_size: n.
        outer_momentum: gamma in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        rounds: rounds per seed (at least 3).
        seeds: initial-disagreement seeds.
        columns: d, independent coordinates per worker.
        overlap: the one-round-delayed exchange.
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        The estimated per-round rate; 0.0 when n = 1 or the disagreement vanishes exactly.
    """
    return consensus_rates_simulated(
        sample_matrix, world_size, [outer_momentum], form, rounds, seeds, columns,
        overlap=overlap, delayed_weight=delayed_weight,
    )[0]


def _check_simulation(rounds: int, seeds: Sequence[int]) -> None:
    if rounds < 3 or not seeds:
        raise ValueError(f"need rounds >= 3 and at least one seed, got rounds={rounds}, seeds={seeds!r}")


def consensus_rates_simulated(
    sample_matrix: Callable[[int], Tensor],
    world_size: int,
    outer_momenta: Sequence[float],
    form: UpdateForm = "anchored",
    rounds: int = 300,
    seeds: Sequence[int] = (0, 1, 2, 3),
    columns: int = 4,
    *,
    overlap: bool = False,
    delayed_weight: float = 1.0,
) -> list[float]:
    """:func:`consensus_rate_simulated` for many gammas at once, on the same rounds and seeds.

    Each round's W is built once and applied to the states of every gamma, so a whole grid of
    gammas costs about as much as one. Every simulated rate is computed here (the one-gamma
    function calls this one).

    Args:
        sample_matrix: round index -> W of that round, (n, n) float64, doubly stochastic.
        world_size: n.
        outer_momenta: the gammas, each in [0, 1).
        form: ``"anchored"`` or ``"post_mix"``.
        rounds: rounds per seed (at least 3).
        seeds: initial-disagreement seeds.
        columns: d, independent coordinates per worker (and per gamma).
        overlap: the one-round-delayed exchange.
        delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).

    Returns:
        The estimated per-round rate of every gamma, in order.
    """
    for outer_momentum in outer_momenta:
        _check_rate_arguments(outer_momentum, form, delayed_weight)
    _check_simulation(rounds, seeds)
    if world_size == 1 or not outer_momenta:
        return [0.0] * len(outer_momenta)
    gammas = torch.tensor(list(outer_momenta), dtype=_DTYPE)
    runs = [(seed, index * rounds) for index, seed in enumerate(seeds)]
    with _one_thread():
        logs = _log_disagreements(
            sample_matrix, world_size, gammas, form, rounds, runs, columns, overlap, delayed_weight
        )  # (R, G, rounds + 1)
    rates = _fitted_rates(logs.flatten(0, 1), burn_in=rounds // 3).view(len(runs), len(gammas))
    return rates.amax(dim=0).tolist()


def max_stable_momentum(
    rate_fn: Callable[[float], float], lo: float = 0.0, hi: float = 0.999, tol: float = 1e-3
) -> float | None:
    """:func:`max_stable_momentum_grid` for a rate function of one gamma at a time.

    Assumes stability is lost once, as gamma grows (true of every schedule we measured).

    Args:
        rate_fn: gamma -> consensus rate.
        lo: lower end of the search.
        hi: upper end of the search.
        tol: width of the final bracket.

    Returns:
        A stable gamma within ``tol`` of the boundary (``hi`` when all of [lo, hi] is stable),
        or None when even ``lo`` is unstable.
    """
    return max_stable_momentum_grid(lambda gammas: [rate_fn(gamma) for gamma in gammas], lo, hi, tol)


def max_stable_momentum_grid(
    rates_fn: Callable[[list[float]], Sequence[float]],
    lo: float = 0.0,
    hi: float = 0.999,
    tol: float = 1e-3,
    points: int = 33,
) -> float | None:
    """Search for the largest gamma with consensus rate < 1, many gammas per call of ``rates_fn``.

    Evaluates ``points`` gammas across [lo, hi], keeps the bracket between the last stable one
    before the first unstable one and that unstable one, and refines it the same way until it
    is narrower than ``tol`` (two calls of ``rates_fn`` for the defaults). It assumes that
    stability is lost once as gamma grows (true of every schedule we measured).

    Args:
        rates_fn: list of gammas -> their consensus rates (e.g. :func:`consensus_rates_simulated`).
        lo: lower end of the search.
        hi: upper end of the search.
        tol: width of the final bracket.
        points: gammas per call (at least 3).

    Returns:
        A stable gamma within ``tol`` of the boundary (``hi`` when every gamma of the first grid
        is stable), or None when ``lo`` is unstable.
    """
    if points < 3:
        raise ValueError(f"points must be >= 3, got {points}")
    grid = torch.linspace(lo, hi, points, dtype=_DTYPE).tolist()
    rates = list(rates_fn(grid))
    while True:
        unstable = next((index for index, rate in enumerate(rates) if rate >= 1.0), None)
        if unstable == 0:
            return None
        if unstable is None:
            return grid[-1]
        lo, hi = grid[unstable - 1], grid[unstable]
        if hi - lo <= tol:
            return lo
        inside = torch.linspace(lo, hi, points, dtype=_DTYPE)[1:-1].tolist()
        grid, rates = [lo, *inside, hi], [0.0, *rates_fn(inside), math.inf]
