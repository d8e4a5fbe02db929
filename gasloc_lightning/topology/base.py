"""The Topology base class: mixing weights W(t), spectral gap, stability queries (gamma limits, consensus rate)."""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Callable, Hashable
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from gasloc_lightning.algorithm import stability
from gasloc_lightning.algorithm.stability import UpdateForm



_DTYPE = torch.float64
# Rounds sampled to estimate E[W^T W] (spectral gap) of a random schedule.
_GAP_SAMPLE_ROUNDS = 256
# Rounds of a random schedule whose W are checked for positive semidefiniteness.
_PSD_SAMPLE_ROUNDS = 32
_PSD_TOL = 1e-12
# Largest n simulated with dense W; sparse W is cheaper to build and apply beyond.
_DENSE_SIMULATION_MAX = 64
_DEFAULT_MOMENTUM = 0.9
# Default gamma of the hypercube for n >= 32 (stable for every n: its limit decreases to 0.707).
_HYPERCUBE_CAP = 0.7

_T = TypeVar("_T")


class TopologyError(ValueError):
    """A topology that cannot be built, or cannot serve the requested world size."""


class Topology(abc.ABC):
    """A (possibly time-varying) gossip graph with symmetric mixing weights w_ij.

    Subclasses implement :meth:`mixing_weights`; everything else (the mixing matrix W, its
    spectral gap, the consensus rate for a given outer momentum gamma, the default gamma) is
    derived from it. Expensive queries are cached per instance.

    Args:
        seed: shared seed of the random schedules; every rank must use the same one.
    """

    name: ClassVar[str]
    time_varying: ClassVar[bool]  # the graph changes from round to round
    uses_all_reduce: ClassVar[bool] = False  # the transport does an all-reduce mean instead

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TopologyError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        self._cache: dict[Hashable, object] = {}

    @property
    def seed(self) -> int:
        """The shared seed of the schedule."""
        return self._seed

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self._seed})"

    @abc.abstractmethod
    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        """Peers of ``rank`` in round t and their symmetric weights w_ij (self excluded).

        Args:
            rank: i, in [0, world_size).
            world_size: n.
            round_index: t, the outer round.

        Returns:
            ``{j: w_ij}``; ``{}`` when the rank sits out this round.
        """

    def check_world_size(self, world_size: int) -> None:
        """Raise :class:`TopologyError` (a ``ValueError``) if this graph cannot have n ranks."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise TopologyError(f"world_size must be a positive int, got {world_size!r}")

    def schedule_period(self, world_size: int) -> int | None:
        """Rounds after which the schedule repeats: 1 for a fixed graph, None for a random one."""
        return None if self.time_varying else 1

    def mixing_matrix(self, world_size: int, round_index: int, sparse: bool = False) -> Tensor:
        """W = I - L of round t, built from every rank's :meth:`mixing_weights`.

        Args:
            world_size: n.
            round_index: t.
            sparse: return a sparse COO tensor (cheaper to build and apply for large n).

        Returns:
            (n, n) float64 tensor with off-diagonal w_ij and diagonal 1 - sum_j w_ij.
        """
        self.check_world_size(world_size)
        rows, columns, weights = [], [], []
        for rank in range(world_size):
            peers = self.mixing_weights(rank, world_size, round_index)
            rows += [rank] * (len(peers) + 1)
            columns += [rank, *peers]
            weights += [1.0 - sum(peers.values()), *peers.values()]
        # Row i holds rank i's own view, so rows sum to 1 and W = W^T iff all views agree.
        if min(columns) < 0 or max(columns) >= world_size:
            raise TopologyError(f"topology {self.name!r} named a peer outside world_size {world_size}")
        values = torch.tensor(weights, dtype=_DTYPE)
        if sparse:
            indices = torch.tensor([rows, columns])  # (2, nnz)
            shape = (world_size, world_size)
            return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False).coalesce()
        flat = torch.tensor([row * world_size + column for row, column in zip(rows, columns)])
        matrix = torch.zeros(world_size * world_size, dtype=_DTYPE).index_add_(0, flat, values)
        return matrix.view(world_size, world_size)

    def spectral_gap(self, world_size: int) -> float:
        """Spectral gap of the schedule.

        Fixed W: 1 - rho(W on the disagreement space). Time-varying: 1 - lambda_2(E[W^T W]),
        the expected per-round contraction of the squared disagreement, with E taken over one
        period (hypercube) or over 256 seeded rounds (random schedules).
        """
        self.check_world_size(world_size)
        return self._memo(("gap", world_size), lambda: self._spectral_gap(world_size))

    def _spectral_gap(self, world_size: int) -> float:
        if world_size == 1:
            return 1.0
        period = self.schedule_period(world_size)
        if period == 1:
            eigenvalues = stability.disagreement_eigenvalues(self.mixing_matrix(world_size, 0))
            return 1.0 - float(eigenvalues.abs().max())
        modes = self._mode_eigenvalues(world_size)
        if modes is not None:  # commuting W: E[W^T W] has eigenvalue mean_k lambda_k^2 per mode
            return 1.0 - float(modes.square().mean(dim=1).max())
        matrices = [self.mixing_matrix(world_size, t) for t in range(period or _GAP_SAMPLE_ROUNDS)]
        gram = torch.stack([m.T @ m for m in matrices]).mean(dim=0)
        return 1.0 - float(stability.disagreement_eigenvalues(gram).max())

    def consensus_rate(
        self,
        world_size: int,
        outer_momentum: float,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        """Asymptotic per-round contraction of the disagreement with no gradients.

        Exact from eigenvalues for fixed and periodic schedules; a seeded float64 simulation
        for random ones (see :mod:`gasloc_lightning.algorithm.stability`). The outer step is stable for
        this (topology, n, gamma, form, overlap) iff the rate is < 1.

        Args:
            world_size: n.
            outer_momentum: gamma in [0, 1).
            form: ``"anchored"`` (default) or ``"post_mix"``.
            overlap: the exchange of round t is folded in one round late (the strategy's
                ``overlap=True``); see :mod:`gasloc_lightning.algorithm.stability`.
            delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only;
                1 is the plain delayed exchange).
        """
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
        stability.check_delayed_weight(delayed_weight)
        self.check_world_size(world_size)
        key = ("rate", world_size, float(outer_momentum), form) + _overlap_key(overlap, delayed_weight)
        return self._memo(
            key, lambda: self._consensus_rate(world_size, outer_momentum, form, overlap, delayed_weight)
        )

    def _consensus_rate(
        self, world_size: int, gamma: float, form: UpdateForm, overlap: bool = False, beta: float = 1.0
    ) -> float:
        modes = self._mode_eigenvalues(world_size)
        if modes is not None:
            return stability.consensus_rate_modes(modes, gamma, form, overlap, delayed_weight=beta)
        sparse = world_size > _DENSE_SIMULATION_MAX
        return stability.consensus_rate_simulated(
            lambda t: self.mixing_matrix(world_size, t, sparse=sparse), world_size, gamma, form,
            overlap=overlap, delayed_weight=beta,
        )

    def _mode_eigenvalues(self, world_size: int) -> Tensor | None:
        """(n - 1, period) eigenvalues of each round's W per common eigenvector.

        None for a random schedule, or a periodic one whose W do not commute: those are simulated.
        """

        def compute() -> Tensor | None:
            period = self.schedule_period(world_size)
            if period is None:
                return None
            matrices = [self.mixing_matrix(world_size, t) for t in range(period)]
            try:
                return stability.periodic_mode_eigenvalues(matrices)
            except stability.NonCommutingError:
                return None

        return self._memo(("modes", world_size), compute)

    def max_stable_momentum(
        self,
        world_size: int,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float | None:
        """Largest gamma in [0, 0.999] with consensus rate < 1 (within 1e-3), None if none is.

        Args:
            world_size: n.
            form: ``"anchored"`` or ``"post_mix"``.
            overlap: the one-round-delayed exchange.
            delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).
        """
        stability.check_form(form)
        key = ("max_gamma", world_size, form) + _overlap_key(overlap, delayed_weight)
        return self._memo(key, lambda: self._max_stable_momentum(world_size, form, overlap, delayed_weight))

    def _max_stable_momentum(
        self, world_size: int, form: UpdateForm, overlap: bool, beta: float
    ) -> float | None:
        if self._mode_eigenvalues(world_size) is None:
            # A simulated schedule: one simulation serves a whole grid of gammas, and the grid's
            # passes share the rounds' matrices (built once, dropped afterwards).
            sparse = world_size > _DENSE_SIMULATION_MAX
            matrices: dict[int, Tensor] = {}

            def sample(t: int) -> Tensor:
                if t not in matrices:
                    matrices[t] = self.mixing_matrix(world_size, t, sparse=sparse)
                return matrices[t]

            return stability.max_stable_momentum_grid(
                lambda gammas: stability.consensus_rates_simulated(
                    sample, world_size, gammas, form, overlap=overlap, delayed_weight=beta
                )
            )
        return stability.max_stable_momentum(
            lambda gamma: self.consensus_rate(world_size, gamma, form, overlap, delayed_weight=beta)
        )

    def is_positive_semidefinite(self, world_size: int) -> bool:
        """Whether lambda_min(W) >= -1e-12 in every round (a sample of 32 for random schedules)."""
        self.check_world_size(world_size)
        rounds = self.schedule_period(world_size) or _PSD_SAMPLE_ROUNDS
        return all(
            float(torch.linalg.eigvalsh(self.mixing_matrix(world_size, t)).min()) >= -_PSD_TOL
            for t in range(rounds)
        )

    def default_outer_momentum(
        self,
        world_size: int,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        """A gamma inside the stability region: 0.9 if stable, else 0.9 x the largest stable gamma.

        0.0 when no gamma is stable (then the strategy refuses the configuration).

        Args:
            world_size: n.
            form: ``"anchored"`` or ``"post_mix"``.
            overlap: the one-round-delayed exchange.
            delayed_weight: beta in (0, 1], the factor on the delayed correction (overlap only).
        """
        delayed = {"overlap": overlap, "delayed_weight": delayed_weight}
        if self.consensus_rate(world_size, _DEFAULT_MOMENTUM, form, **delayed) < 1.0:
            return _DEFAULT_MOMENTUM
        limit = self.max_stable_momentum(world_size, form, **delayed)
        return 0.0 if limit is None else math.floor(_DEFAULT_MOMENTUM * limit * 1000.0) / 1000.0

    def check_momentum(self, world_size: int, gamma: float, form: UpdateForm = "anchored", overlap: bool = False,
                       *, delayed_weight: float = 1.0) -> None:
        """Refuse a gamma whose consensus rate is not below 1 with ``world_size`` workers (``ValueError`` naming the
        largest stable gamma)."""
        delayed = {"overlap": overlap, "delayed_weight": delayed_weight}
        rate = self.consensus_rate(world_size, gamma, form, **delayed)
        if rate >= 1.0:
            limit = self.max_stable_momentum(world_size, form, **delayed)
            advice = "no gamma is stable" if limit is None else f"the largest stable gamma is about {limit:.3f}"
            raise ValueError(
                f"outer_momentum (gamma) = {gamma} is unstable for topology {self.name!r} with {world_size} workers, "
                f"outer_form={form!r}, overlap={overlap} (consensus rate {rate:.4f} >= 1): {advice}"
            )

    def resolve_momentum(self, world_size: int, requested: float | None, form: UpdateForm = "anchored",
                         overlap: bool = False, *, delayed_weight: float = 1.0) -> float:
        """gamma for ``world_size`` workers: ``requested``, or :meth:`default_outer_momentum`; refused when it does
        not contract (:meth:`check_momentum`). The one check every engine makes (strategies and simulator).

        Raises:
            TopologyError: the topology cannot have ``world_size`` workers.
            ValueError: gamma is unstable.
        """
        if world_size <= 1:
            return 0.0 if requested is None else float(requested)
        self.check_world_size(world_size)
        delayed = {"overlap": overlap, "delayed_weight": delayed_weight}
        gamma = self.default_outer_momentum(world_size, form, **delayed) if requested is None else float(requested)
        if self.name != "local" and not self.uses_all_reduce:
            self.check_momentum(world_size, gamma, form, **delayed)
        return gamma

    def _memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]  # type: ignore[return-value]


def _overlap_key(overlap: bool, delayed_weight: float) -> tuple[Hashable, ...]:
    # Cache key suffix; empty without overlap (beta only matters with it).
    return (True, float(delayed_weight)) if overlap else ()


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0
