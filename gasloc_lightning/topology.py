"""Communication graphs of GASLoC: who gossips with whom in round t, and with which weights.

A topology is a pure function of (rank, world size n, round t, shared seed): every rank
computes the same graph without communicating, and no process group (or GPU) is needed to
build or query one. Mixing with the round's symmetric weights w_ij = w_ji > 0 is
``(W v)_i = v_i - sum_j w_ij (v_i - v_j)``, so W = I - L is symmetric and doubly stochastic
(ALGORITHM.md, "Notation" and "Topologies").

Named topologies (``build_topology(name)``; ``custom`` and ``bandwidth_aware`` need their
edges or network, so build their class and pass the object):

===============  ==========================================================  ============
name             graph of round t                                            n
===============  ==========================================================  ============
one_peer         uniformly random perfect matching, w = 1/2; odd n: one      any
                 rank sits out
two_peer         ring over a fresh random permutation, w = 1/4               >= 3
ring             fixed ring, w = 1/4 per edge                                any
torus            fixed 2-D torus r x c (most square), w = 1/8 per edge       composite
exponential      hypercube dimension exchange i <-> i XOR 2^(t mod log2 n),  power of two
                 w = 1/2
complete         w = 1/n to everyone: an all-reduce mean (exactly DiLoCo)    any
custom           fixed user-given weighted edges (``CustomTopology``)        as given
bandwidth_aware  random matching, w = 1/2, mostly inside clusters of fast    as given
                 links, across at a set rate (``BandwidthAwareTopology``)
local            no communication at all (a baseline)                        any
===============  ==========================================================  ============

Edges that coincide (ring with n = 2, torus with r = 2 or c = 2) have their weights summed,
so the row sums and the spectrum stay those of the general case; every named graph is
positive semidefinite. World size 1 is accepted by every topology and means no peers.

Default outer momentum gamma (``default_outer_momentum``) for the default anchored form, with
the consensus rate it gives (per-round contraction of the disagreement, no gradients; < 1 is
stable) at n = 16 / 64:

===============  ==============  =============  =============================================
topology         gamma           rate 16 / 64   why
===============  ==============  =============  =============================================
one_peer         0.9             0.873 / 0.892  DiLoCo's value. ALGORITHM.md measured the
two_peer         0.9             0.744 / 0.767  anchored form stable for every gamma <= 0.95
ring             0.9             0.930 / 0.986  on one_peer (n = 8..1024), two_peer and ring
torus            0.9             0.822 / 0.913  (n <= 64); torus: exact rates as listed.
complete         0.9             0 / 0          Exactly DiLoCo's outer Nesterov step.
exponential      0.9 (n <= 16)   0.949 / -      Stable for any gamma < 1 up to n = 16, but
                 0.7 (n >= 32)   - / 0.949      only up to 0.848 (n = 32), 0.786 (n = 64),
                                                falling to 0.707: ALGORITHM.md caps gamma at
                                                0.7 there.
custom           0.9 if stable                  else 0.9 x its largest stable gamma.
bandwidth_aware  0.9             0.852 / 0.884  Two clusters of 8 / 32, slow_link_rate 0.2.
                                                Singleton clusters idle through every fast
                                                round and lower it (0.664 for 6 singletons).
local            0.0             1 / 1          Nothing keeps the replicas together anyway.
===============  ==============  =============  =============================================

Whenever 0.9 is not stable (any topology, e.g. the post_mix form on a random graph), the
default becomes 0.9 x the largest stable gamma, rounded down to 3 decimals, which keeps a
margin inside the stability region.

With ``overlap=True`` (the exchange folded in one round late, see
:mod:`gasloc_lightning.stability`) the same rule keeps 0.9 for every named topology at
n = 2 .. 16 (its rate rises a little, e.g. one_peer at n = 16 from 0.873 to 0.910); the
hypercube of 64 and bandwidth_aware with two clusters of 4 (largest stable gamma 0.875) get
0.9 x their limit.
"""

from __future__ import annotations

import abc
import itertools
import math
import numbers
import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from gasloc_lightning import stability
from gasloc_lightning.stability import UpdateForm

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
        for random ones (see :mod:`gasloc_lightning.stability`). The outer step is stable for
        this (topology, n, gamma, form, overlap) iff the rate is < 1.

        Args:
            world_size: n.
            outer_momentum: gamma in [0, 1).
            form: ``"anchored"`` (default) or ``"post_mix"``.
            overlap: the exchange of round t is folded in one round late (the strategy's
                ``overlap=True``); see :mod:`gasloc_lightning.stability`.
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
        if overlap and self._mode_eigenvalues(world_size) is None:
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
                    sample, world_size, gammas, form, overlap=True, delayed_weight=beta
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

    def _memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]  # type: ignore[return-value]


def _overlap_key(overlap: bool, delayed_weight: float) -> tuple[Hashable, ...]:
    # Cache key suffix; empty without overlap (beta only matters with it).
    return (True, float(delayed_weight)) if overlap else ()


def _add_edge(weights: dict[int, float], peer: int, weight: float) -> None:
    # Coinciding edges (ring of 2, torus with a side of 2) add up, keeping row sums as usual.
    weights[peer] = weights.get(peer, 0.0) + weight


@lru_cache(maxsize=16)
def _shuffled_ranks(tag: str, seed: int, world_size: int, round_index: int) -> tuple[int, ...]:
    # A string seed is hashed with sha512, so every process draws the same permutation
    # without communicating (and independently of PYTHONHASHSEED).
    ranks = list(range(world_size))
    random.Random(f"gasloc:{tag}:{seed}:{world_size}:{round_index}").shuffle(ranks)
    return tuple(ranks)


@lru_cache(maxsize=16)
def _matching_partners(seed: int, world_size: int, round_index: int) -> tuple[int, ...]:
    """partner[i] of a uniformly random perfect matching; partner[i] == i for the odd one out."""
    order = _shuffled_ranks("one_peer", seed, world_size, round_index)
    partners = list(range(world_size))
    for a, b in zip(order[0::2], order[1::2]):
        partners[a], partners[b] = b, a
    return tuple(partners)


@lru_cache(maxsize=16)
def _ring_neighbours(seed: int, world_size: int, round_index: int) -> tuple[tuple[int, int], ...]:
    """(previous, next) of each rank on a ring over a random permutation."""
    order = _shuffled_ranks("two_peer", seed, world_size, round_index)
    neighbours = [(0, 0)] * world_size
    for position, rank in enumerate(order):
        neighbours[rank] = (order[position - 1], order[(position + 1) % world_size])
    return tuple(neighbours)


def _matching_matrix(partners: Sequence[int], sparse: bool) -> Tensor:
    """W = (I + P) / 2 of a matching (P its involution; the odd one out keeps 1 on the diagonal).

    Entry for entry what Topology.mixing_matrix builds from the weights, only faster.
    """
    world_size = len(partners)
    if not sparse:
        identity = _identity(world_size)
        return 0.5 * (identity + identity[list(partners)])  # row i of P is e_partner(i)
    ranks = torch.arange(world_size)
    indices = torch.stack([torch.cat([ranks, ranks]), torch.cat([ranks, torch.tensor(partners)])])  # (2, 2n)
    values = torch.full((2 * world_size,), 0.5, dtype=_DTYPE)  # the odd one out's two halves add up
    shape = (world_size, world_size)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False).coalesce()


@lru_cache(maxsize=4)
def _identity(world_size: int) -> Tensor:
    return torch.eye(world_size, dtype=_DTYPE)


class OnePeerTopology(Topology):
    """A uniformly random perfect matching each round, w = 1/2 (pairwise averaging).

    The matching of round t is drawn from (seed, n, t) alone, identically on every rank. With
    odd n one uniformly chosen rank sits out the round (no peers).
    """

    name = "one_peer"
    time_varying = True

    def schedule_period(self, world_size: int) -> int | None:
        # With n <= 2 there is a single matching: the schedule is fixed and its rate exact.
        return 1 if world_size <= 2 else None

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        partner = _matching_partners(self.seed, world_size, round_index)[rank]
        return {} if partner == rank else {partner: 0.5}

    def mixing_matrix(self, world_size: int, round_index: int, sparse: bool = False) -> Tensor:
        self.check_world_size(world_size)
        return _matching_matrix(_matching_partners(self.seed, world_size, round_index), sparse)

    def _spectral_gap(self, world_size: int) -> float:
        # Exact: E[W^T W] = E[W] = a I + b 11^T by symmetry; each pair meets with probability
        # 1/(n - 1) (even n) or 1/n (odd n), and W^T W = W for pairwise averaging.
        if world_size == 1:
            return 1.0
        meet = 1.0 / (world_size - 1 if world_size % 2 == 0 else world_size)
        return 0.5 * world_size * meet


class TwoPeerTopology(Topology):
    """A ring over a fresh random permutation of the ranks each round, w = 1/4 per edge."""

    name = "two_peer"
    time_varying = True

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if world_size == 2:
            raise TopologyError("topology 'two_peer' needs world_size >= 3 (got 2); use 'one_peer'")

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        if world_size == 1:
            return {}
        previous, following = _ring_neighbours(self.seed, world_size, round_index)[rank]
        return {previous: 0.25, following: 0.25}

    def _spectral_gap(self, world_size: int) -> float:
        # Exact: E[W^T W] = a I + b 11^T by symmetry, with (W^T W)_ii = 1/4 + 2/16 every round.
        if world_size == 1:
            return 1.0
        return 1.0 - (3.0 / 8.0 - 5.0 / (8.0 * (world_size - 1)))


class RingTopology(Topology):
    """A fixed ring i - (i + 1) mod n, w = 1/4 per edge (W = I/2 + (P + P^T)/4 is PSD).

    With n = 2 both edges join the same pair and add up to w = 1/2 (W = all 1/2).
    """

    name = "ring"
    time_varying = False

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        weights: dict[int, float] = {}
        if world_size > 1:
            _add_edge(weights, (rank - 1) % world_size, 0.25)
            _add_edge(weights, (rank + 1) % world_size, 0.25)
        return weights


def torus_shape(world_size: int) -> tuple[int, int] | None:
    """Most square factorization n = rows x columns with 2 <= rows <= columns, or None."""
    for rows in range(math.isqrt(world_size), 1, -1):
        if world_size % rows == 0:
            return rows, world_size // rows
    return None


class TorusTopology(Topology):
    """A fixed 2-D torus over the most square factorization n = r x c, w = 1/8 per edge.

    Rank i sits at (i // c, i % c) and mixes with its four grid neighbours (wrapping around),
    so W = I - (L_rows + L_columns) / 8 is PSD. A side of 2 makes two edges coincide; their
    weights add up. Needs a composite n (a prime n has no grid: use ``ring``).
    """

    name = "torus"
    time_varying = False

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if world_size > 1 and torus_shape(world_size) is None:
            raise TopologyError(
                f"topology 'torus' needs a world_size with a factorization r x c, r, c >= 2; "
                f"{world_size} has none (use 'ring')"
            )

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        shape = torus_shape(world_size)
        if shape is None:
            return {}
        rows, columns = shape
        row, column = divmod(rank, columns)
        weights: dict[int, float] = {}
        for step in (-1, 1):
            _add_edge(weights, ((row + step) % rows) * columns + column, 0.125)
            _add_edge(weights, row * columns + (column + step) % columns, 0.125)
        return weights


class ExponentialTopology(Topology):
    """Hypercube dimension exchange: in round t, i <-> i XOR 2^(t mod log2 n), w = 1/2.

    Periodic with period log2 n; at gamma = 0 it reaches exact consensus in log2 n rounds.
    Power-of-two n only. Its consensus rate is exact: every W_k = (I + P_k) / 2 is diagonal in
    the Walsh-Hadamard basis, with eigenvalue 1 - bit_k(s) on Walsh vector s.
    """

    name = "exponential"
    time_varying = True

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if world_size & (world_size - 1):
            raise TopologyError(
                f"topology 'exponential' needs a power-of-two world_size, got {world_size} "
                "(use 'one_peer' or 'two_peer')"
            )

    def schedule_period(self, world_size: int) -> int:
        return max(1, world_size.bit_length() - 1)

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        if world_size == 1:
            return {}
        return {rank ^ (1 << (round_index % self.schedule_period(world_size))): 0.5}

    def _mode_eigenvalues(self, world_size: int) -> Tensor | None:
        def compute() -> Tensor:
            walsh = torch.arange(1, world_size)  # Walsh vectors s != 0 span the disagreement space
            bits = (walsh[:, None] >> torch.arange(world_size.bit_length() - 1)) & 1  # (n - 1, log2 n)
            return (1 - bits).to(_DTYPE)

        return self._memo(("modes", world_size), compute)

    def default_outer_momentum(
        self,
        world_size: int,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        # ALGORITHM.md: cap gamma at 0.7 from n = 32 on, where the limit falls towards 0.707.
        # (Measured without overlap; with it the general rule applies.)
        if not overlap and world_size > 16 and self.consensus_rate(world_size, _HYPERCUBE_CAP, form) < 1.0:
            return _HYPERCUBE_CAP
        return super().default_outer_momentum(world_size, form, overlap, delayed_weight=delayed_weight)


class CompleteTopology(Topology):
    """Everyone with everyone, w_ij = 1/n: W = 11^T / n, realised as an all-reduce mean.

    The outer step is then exactly DiLoCo's outer Nesterov step and the replicas agree after
    every round: the consensus rate is 0 for any gamma. With overlap it is DiLoCo with a
    one-round-stale average, whose rate is computed exactly like any fixed graph's (every
    disagreement eigenvalue is 0): 1 at gamma = 0 (it oscillates with period 6) and > 1 above
    for the plain delayed exchange (delayed_weight = 1).
    """

    name = "complete"
    time_varying = False
    uses_all_reduce = True

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        return {peer: 1.0 / world_size for peer in range(world_size) if peer != rank}

    def mixing_matrix(self, world_size: int, round_index: int, sparse: bool = False) -> Tensor:
        self.check_world_size(world_size)
        matrix = torch.full((world_size, world_size), 1.0 / world_size, dtype=_DTYPE)
        return matrix.to_sparse() if sparse else matrix

    def consensus_rate(
        self,
        world_size: int,
        outer_momentum: float,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        if overlap:
            return super().consensus_rate(
                world_size, outer_momentum, form, overlap, delayed_weight=delayed_weight
            )
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
        stability.check_delayed_weight(delayed_weight)
        self.check_world_size(world_size)
        return 0.0


class LocalTopology(Topology):
    """No communication ever: each worker trains alone (a baseline). W = I.

    Its consensus rate is 1 (nothing brings the replicas together); the strategy skips the
    stability check for it.
    """

    name = "local"
    time_varying = False

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        return {}

    def spectral_gap(self, world_size: int) -> float:
        self.check_world_size(world_size)
        return 0.0

    def consensus_rate(
        self,
        world_size: int,
        outer_momentum: float,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
        stability.check_delayed_weight(delayed_weight)
        self.check_world_size(world_size)
        return 1.0

    def max_stable_momentum(
        self,
        world_size: int,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float | None:
        return None

    def default_outer_momentum(
        self,
        world_size: int,
        form: UpdateForm = "anchored",
        overlap: bool = False,
        *,
        delayed_weight: float = 1.0,
    ) -> float:
        return 0.0


EdgeSpec = Mapping[tuple[int, int], float] | Iterable[tuple[int, int, float]]


def _edge_items(edges: EdgeSpec) -> Iterable[tuple[object, object, object]]:
    if isinstance(edges, Mapping):
        return ((*pair, weight) for pair, weight in edges.items())
    return (tuple(edge) for edge in edges)


def _is_index(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _parse_edges(edges: EdgeSpec) -> dict[tuple[int, int], float]:
    """{(i, j) with i < j: w_ij}, validating each edge."""
    parsed: dict[tuple[int, int], float] = {}
    for edge in _edge_items(edges):
        if len(edge) != 3:
            raise TopologyError(f"each edge must be (i, j, w_ij), got {edge!r}")
        i, j, weight = edge
        if not (_is_index(i) and _is_index(j)) or i == j:
            raise TopologyError(f"edge ({i!r}, {j!r}) must join two distinct non-negative int ranks")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0.0 < weight <= 1.0:
            raise TopologyError(f"edge ({i}, {j}) needs a weight w_ij in (0, 1], got {weight!r}")
        i, j = int(i), int(j)
        key = (min(i, j), max(i, j))
        if key in parsed and not math.isclose(parsed[key], weight, rel_tol=1e-12):
            raise TopologyError(
                f"edge ({i}, {j}) given twice with different weights {parsed[key]} and {weight}; "
                "weights must be symmetric (w_ij == w_ji)"
            )
        parsed[key] = float(weight)
    return parsed


class CustomTopology(Topology):
    """A fixed user-given graph with symmetric weights w_ij.

    An edge given once holds in both directions. The weights must be > 0 with
    sum_j w_ij <= 1 for every i, so that W is doubly stochastic with a non-negative diagonal;
    the graph must be connected over the world size it serves. Stability for a given gamma is
    checked by the strategy through :meth:`consensus_rate`.

    Args:
        edges: ``{(i, j): w_ij}`` or an iterable of ``(i, j, w_ij)``.
        world_size: n this graph is for; None to accept any n that covers its ranks.
        seed: unused (the graph is fixed); kept for a uniform constructor.
    """

    name = "custom"
    time_varying = False

    def __init__(self, edges: EdgeSpec, world_size: int | None = None, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._edges = _parse_edges(edges)
        self._adjacency: dict[int, dict[int, float]] = {}
        for (i, j), weight in self._edges.items():
            self._adjacency.setdefault(i, {})[j] = weight
            self._adjacency.setdefault(j, {})[i] = weight
        for node, peers in sorted(self._adjacency.items()):
            if sum(peers.values()) > 1.0 + 1e-12:
                raise TopologyError(
                    f"rank {node} has sum_j w_ij = {sum(peers.values()):.6g} > 1 over edges "
                    f"{sorted(peers.items())}; W would have a negative diagonal"
                )
        if world_size is not None:
            Topology.check_world_size(self, world_size)
            self._check_ranks(world_size)
        self._world_size = world_size

    def __repr__(self) -> str:
        return f"CustomTopology(edges={len(self._edges)}, world_size={self._world_size})"

    @property
    def edges(self) -> dict[tuple[int, int], float]:
        """The undirected edges ``{(i, j) with i < j: w_ij}``."""
        return dict(self._edges)

    def _check_ranks(self, world_size: int) -> None:
        for i, j in self._edges:
            if j >= world_size:
                raise TopologyError(f"edge ({i}, {j}) names rank {j}, outside world_size {world_size}")

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if self._world_size is not None and world_size != self._world_size:
            raise TopologyError(
                f"topology 'custom' was built for world_size {self._world_size}, got {world_size}"
            )
        self._check_ranks(world_size)
        unreached = self._memo(("unreached", world_size), lambda: self._unreached(world_size))
        if unreached:
            raise TopologyError(
                f"topology 'custom' is not connected over world_size {world_size}: ranks "
                f"{unreached[:8]}{'...' if len(unreached) > 8 else ''} cannot reach rank 0"
            )

    def _unreached(self, world_size: int) -> list[int]:
        seen, frontier = {0}, [0]
        while frontier:
            for peer in self._adjacency.get(frontier.pop(), {}):
                if peer not in seen:
                    seen.add(peer)
                    frontier.append(peer)
        return [rank for rank in range(world_size) if rank not in seen]

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        return dict(self._adjacency.get(rank, {}))


# Links within this factor of each other are not told apart when clusters come from bandwidths.
_SLOW_LINK_RATIO = 2.0
# Cluster orders enumerated exactly for the expected mixing matrix; beyond, a seeded sample.
_EXACT_ORDERS_MAX = 5040
_SAMPLED_ORDERS = 4096


def _clusters_from_bandwidth(bandwidth: object) -> list[int]:
    """Cluster index of every rank: connected components of the fast links (see BandwidthAwareTopology)."""
    try:
        if not isinstance(bandwidth, Tensor):  # nested sequences of any kind (e.g. Hydra's ListConfig)
            bandwidth = [[float(value) for value in row] for row in bandwidth]  # type: ignore[attr-defined]
        matrix = torch.as_tensor(bandwidth, dtype=_DTYPE)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TopologyError(f"bandwidth must be an n x n matrix of numbers: {error}") from None
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise TopologyError(f"bandwidth must be a square n x n matrix, got shape {tuple(matrix.shape)}")
    off_diagonal = ~torch.eye(len(matrix), dtype=torch.bool)
    values = matrix[off_diagonal]
    if not bool((values > 0.0).all()):  # also refuses NaN
        raise TopologyError("bandwidth must be > 0 for every link i != j (the diagonal is ignored)")
    if not torch.allclose(matrix[off_diagonal], matrix.T[off_diagonal], rtol=1e-9, atol=0.0):
        raise TopologyError("bandwidth must be symmetric (links are full duplex); pass e.g. min(B, B^T)")
    fast = matrix >= _fast_threshold(sorted(set(values.tolist())))
    labels = _components(fast)
    for i, j in off_diagonal.nonzero().tolist():
        if labels[i] == labels[j] and not fast[i, j]:
            raise TopologyError(
                f"the fast links do not form clusters: ranks {i} and {j} are joined by fast links but "
                f"their own link is slow ({float(matrix[i, j]):.6g}); pass clusters= explicitly"
            )
    return labels


def _fast_threshold(distinct: list[float]) -> float:
    # Split at the largest ratio between consecutive distinct bandwidths, if it is a real gap.
    if len(distinct) < 2:
        return -math.inf
    ratios = [high / low for low, high in zip(distinct, distinct[1:])]
    split = max(range(len(ratios)), key=ratios.__getitem__)
    return distinct[split + 1] if ratios[split] >= _SLOW_LINK_RATIO else -math.inf


def _components(adjacency: Tensor) -> list[int]:
    labels = [-1] * len(adjacency)
    for start in range(len(adjacency)):
        if labels[start] >= 0:
            continue
        label, frontier = max(labels) + 1, [start]
        labels[start] = label
        while frontier:
            for peer in adjacency[frontier.pop()].nonzero().flatten().tolist():
                if labels[peer] < 0:
                    labels[peer] = label
                    frontier.append(peer)
    return labels


def _group_ranks(clusters: Iterable[Hashable]) -> tuple[tuple[int, ...], ...]:
    """Ranks of each cluster label, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for rank, label in enumerate(clusters):
        groups.setdefault(label, []).append(rank)
    return tuple(tuple(ranks) for ranks in groups.values())


def _cross_pairs(sizes: Sequence[int]) -> int:
    # Antipodal pairing of an even number m of ranks in cluster blocks pairs two ranks of one
    # cluster only inside a cluster larger than m / 2 (there is at most one), s - m/2 times.
    half = sum(sizes) // 2
    return half - sum(max(0, size - half) for size in sizes)


@lru_cache(maxsize=16)
def _bandwidth_aware_partners(
    members: tuple[tuple[int, ...], ...], cross_probability: float, seed: int, round_index: int
) -> tuple[tuple[int, ...], bool]:
    """(partner of every rank, whether the round pairs across clusters); partner[i] == i: sits out."""
    world_size = sum(map(len, members))
    # A string seed is hashed with sha512: every process draws the same round on its own.
    rng = random.Random(f"gasloc:bandwidth_aware:{seed}:{world_size}:{round_index}")
    cross = rng.random() < cross_probability
    groups = [list(group) for group in members]
    for group in groups:
        rng.shuffle(group)
    if cross:
        if world_size % 2:  # one uniformly chosen rank sits out, the others pair up
            sitter = rng.randrange(world_size)
            groups = [[rank for rank in group if rank != sitter] for group in groups]
        rng.shuffle(groups)
        sequence = [rank for group in groups for rank in group]
        half = len(sequence) // 2
        pairs = list(zip(sequence[:half], sequence[half:]))
    else:  # the last rank of an odd cluster sits out: a slow link would make the round slow
        pairs = _pairs_inside(groups)
    return _partners_of(pairs, world_size), cross


def _pairs_inside(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Consecutive ranks of each (shuffled) cluster paired up; the last of an odd one sits out."""
    return [(group[k], group[k + 1]) for group in groups for k in range(0, len(group) - 1, 2)]


def _partners_of(pairs: Iterable[tuple[int, int]], world_size: int) -> tuple[int, ...]:
    """The partner of every rank (itself when it sits out)."""
    partners = list(range(world_size))
    for a, b in pairs:
        partners[a], partners[b] = b, a
    return tuple(partners)


@lru_cache(maxsize=16)
def _spread_partners(
    members: tuple[tuple[int, ...], ...], cross_pairs: float, seed: int, round_index: int
) -> tuple[tuple[int, ...], bool]:
    """A "spread" round: about ``cross_pairs`` pairs across clusters, every other pair inside one.

    k = floor(c) or ceil(c) cross pairs (E[k] = c). Each joins a random unmatched rank of the cluster
    with the most unmatched ranks (ties broken at random) with a random unmatched rank of another
    cluster: largest-first keeps k reachable up to the most cross pairs the sizes allow. The rest
    pair up inside their clusters; an odd remainder leaves one member out.
    """
    world_size = sum(map(len, members))
    rng = random.Random(f"gasloc:bandwidth_aware:spread:{seed}:{world_size}:{round_index}")
    whole = math.floor(cross_pairs)
    k = whole + (rng.random() < cross_pairs - whole)
    groups = [list(group) for group in members]
    for group in groups:
        rng.shuffle(group)
    pairs = []
    for _ in range(k):
        order = sorted(range(len(groups)), key=lambda c: (-len(groups[c]), rng.random()))
        largest, others = order[0], [rank for c in order[1:] for rank in groups[c]]
        if not groups[largest] or not others:
            break
        partner = rng.choice(others)
        groups[next(c for c in order[1:] if partner in groups[c])].remove(partner)
        pairs.append((groups[largest].pop(), partner))
    return _partners_of(pairs + _pairs_inside(groups), world_size), k > 0


class BandwidthAwareTopology(Topology):
    """Random perfect matchings that favour fast links (issue 4, "uneven networks"), w = 1/2.

    The ranks fall into clusters with fast links inside and slow links across (machines of a
    data centre, data centres). Each round is a random perfect matching with pairwise
    averaging, drawn from (seed, n, t) alone, identically on every rank:

    - with probability q (a *cross round*): a random matching that pairs across clusters as
      much as possible. The clusters are laid out in a random order as contiguous blocks (each
      shuffled) and position p is paired with p + m/2 (m ranks taking part). Only a cluster
      larger than m/2 pairs inside itself, so when none is, every pair is across. Odd n: one
      uniformly chosen rank sits out first.
    - otherwise (a *fast round*): a uniformly random matching inside every cluster. An odd
      cluster leaves one random member out rather than pairing it across a slow link, which
      would make the whole (synchronous) round as slow as a cross round.

    A cross round concentrates the slow traffic: a target rate of slow-link use is met with
    as few slow rounds as possible. q = ``slow_link_rate`` / c, with c the share of workers
    a cross round pairs across clusters (``expected_slow_link_rate`` gives the exact rate).

    ``schedule="spread"`` instead puts a few pairs across clusters in every round: c =
    ``slow_link_rate`` x n / 2 pairs on average (floor(c) or ceil(c), drawn so that the mean is
    c), every other pair inside a cluster. That suits a *shared* inter-cluster link: four pairs
    crossing at once take four times as long as one, so a steady load of one crossing pair per
    round, hidden under the next round's compute with ``overlap=True``, beats a burst. Its
    spectral gap is estimated from E[W] over 4096 rounds of its own schedule.

    Each W is symmetric and doubly stochastic (a matching, w = 1/2), and so positive
    semidefinite; E[W] is connected for any q > 0: fast rounds connect each cluster, and for
    any split of the clusters into two groups some block order pairs across it. Its spectral
    gap is exact: W^T W = W for a matching, so E[W^T W] = E[W], computed from the exact
    probability that two ranks meet (the block orders are enumerated, or for more than 8
    clusters averaged over 4096 seeded orders). The consensus rate is simulated (as for
    ``one_peer``).

    Clusters from a bandwidth matrix: a link is slow when its bandwidth is below the largest
    ratio gap between the distinct bandwidths (if that gap is at least 2x; otherwise all links
    count as fast). Clusters are the connected components of the fast links, and a slow link
    inside a component is an error. With a single cluster there is no slow link and every
    round is a fast round: one_peer's uniform matchings.

    Args:
        bandwidth: symmetric n x n link bandwidths, > 0 off the diagonal (any unit, e.g.
            Gbit/s; the diagonal is ignored). Exactly one of ``bandwidth`` and ``clusters``.
        clusters: the cluster label of every rank (e.g. ``[0, 0, 0, 0, 1, 1, 1, 1]`` or host
            names); fast links inside a cluster, slow ones across.
        slow_link_rate: target probability, in (0, 1], that a worker's peer in a round is
            across a slow link (averaged over workers), at most c (see above).
        schedule: ``"concentrated"`` (few rounds, all pairs across) or ``"spread"`` (a few pairs
            across in every round).
        seed: shared seed of the schedule; every rank must use the same one.
    """

    name = "bandwidth_aware"
    time_varying = True

    def __init__(
        self,
        *,
        bandwidth: Sequence[Sequence[float]] | Tensor | None = None,
        clusters: Sequence[Hashable] | None = None,
        slow_link_rate: float = 0.2,
        schedule: str = "concentrated",
        seed: int = 0,
    ) -> None:
        super().__init__(seed=seed)
        if schedule not in BANDWIDTH_AWARE_SCHEDULES:
            raise TopologyError(f"schedule must be one of {BANDWIDTH_AWARE_SCHEDULES}, got {schedule!r}")
        self._schedule = schedule
        if (bandwidth is None) == (clusters is None):
            raise TopologyError("BandwidthAwareTopology needs exactly one of bandwidth= and clusters=")
        if isinstance(slow_link_rate, bool) or not isinstance(slow_link_rate, numbers.Real) or not (
            0.0 < slow_link_rate <= 1.0
        ):
            raise TopologyError(f"slow_link_rate must lie in (0, 1], got {slow_link_rate!r}")
        if clusters is not None and (isinstance(clusters, str) or len(clusters) == 0):
            raise TopologyError(f"clusters must be a non-empty sequence of cluster labels, got {clusters!r}")
        labels = _clusters_from_bandwidth(bandwidth) if clusters is None else list(clusters)
        self._members = _group_ranks(labels)
        self._cluster_of = [0] * len(labels)  # cluster index of every rank
        for index, group in enumerate(self._members):
            for rank in group:
                self._cluster_of[rank] = index
        self._world_size = len(labels)
        self._slow_link_rate = float(slow_link_rate)
        most = self._cross_share()
        if len(self._members) > 1 and slow_link_rate > most + 1e-12:
            raise TopologyError(
                f"slow_link_rate {slow_link_rate} is more than clusters of sizes {self.cluster_sizes} "
                f"allow: a round pairs at most {most:.4g} of the workers across clusters"
            )
        self._cross_probability = min(1.0, slow_link_rate / most) if len(self._members) > 1 else 0.0

    @classmethod
    def from_clusters(
        cls, sizes: Sequence[int], slow_link_rate: float = 0.2, seed: int = 0, schedule: str = "concentrated"
    ) -> BandwidthAwareTopology:
        """Clusters of the given sizes over consecutive ranks (node-major, as torchrun numbers them).

        Args:
            sizes: ranks per cluster, e.g. ``[8, 8]`` for two machines of 8 GPUs.
            slow_link_rate: see the class.
            seed: see the class.
            schedule: see the class.
        """
        valid = not isinstance(sizes, (str, numbers.Number)) and len(sizes) > 0
        if not valid or not all(_is_index(size) and size > 0 for size in sizes):
            raise TopologyError(f"sizes must be a non-empty list of positive ints, got {sizes!r}")
        labels = [index for index, size in enumerate(sizes) for _ in range(size)]
        return cls(clusters=labels, slow_link_rate=slow_link_rate, schedule=schedule, seed=seed)

    def __repr__(self) -> str:
        return (
            f"BandwidthAwareTopology(cluster_sizes={list(self.cluster_sizes)}, "
            f"slow_link_rate={self._slow_link_rate}, schedule={self._schedule!r}, seed={self.seed})"
        )

    @property
    def clusters(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every cluster."""
        return self._members

    @property
    def cluster_sizes(self) -> tuple[int, ...]:
        return tuple(map(len, self._members))

    @property
    def slow_link_rate(self) -> float:
        """The target slow-link rate this topology was built with."""
        return self._slow_link_rate

    @property
    def schedule(self) -> str:
        return self._schedule

    @property
    def cross_round_probability(self) -> float:
        """q: the probability that a round pairs across clusters (uses slow links)."""
        if self._schedule == "spread" and len(self._members) > 1:
            return min(1.0, self._spread_cross_pairs())
        return self._cross_probability

    def is_slow_link(self, i: int, j: int) -> bool:
        """Whether ranks i and j are in different clusters."""
        return self._cluster_of[i] != self._cluster_of[j]

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if world_size != self._world_size:
            raise TopologyError(
                f"topology 'bandwidth_aware' was built for world_size {self._world_size} (the size of its "
                f"bandwidth matrix or cluster list), got {world_size}"
            )

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        self.check_world_size(world_size)
        partner = self._round(round_index)[0][rank]
        return {} if partner == rank else {partner: 0.5}

    def mixing_matrix(self, world_size: int, round_index: int, sparse: bool = False) -> Tensor:
        self.check_world_size(world_size)
        return _matching_matrix(self._round(round_index)[0], sparse)

    def is_cross_round(self, round_index: int) -> bool:
        """Whether round t is a cross round (pairs across clusters; it may be slow)."""
        return self._round(round_index)[1]

    def _round(self, round_index: int) -> tuple[tuple[int, ...], bool]:
        if self._schedule == "spread":
            return _spread_partners(self._members, self._spread_cross_pairs(), self.seed, round_index)
        return _bandwidth_aware_partners(self._members, self._cross_probability, self.seed, round_index)

    def _spread_cross_pairs(self) -> float:
        """c: the mean number of pairs across clusters in a spread round."""
        return self._slow_link_rate * self._world_size / 2.0 if len(self._members) > 1 else 0.0

    def expected_slow_link_rate(self, world_size: int) -> float:
        """Exact probability that a worker's peer in a round is across a slow link, averaged over workers.

        Concentrated: q times the share of workers a cross round pairs across (fast rounds use no
        slow link). Spread: 2 c / n, which is ``slow_link_rate``.
        """
        self.check_world_size(world_size)
        if len(self._members) == 1:
            return 0.0
        if self._schedule == "spread":
            return 2.0 * self._spread_cross_pairs() / world_size
        return self._cross_probability * self._cross_share()

    def _cross_share(self) -> float:
        # Largest share of the n workers one round can pair across clusters (concentrated: in
        # expectation over the sitter of an odd n; spread: every pair with the largest cluster).
        sizes, n = self.cluster_sizes, self._world_size
        if self._schedule == "spread":
            return 2.0 * min(n // 2, n - max(sizes)) / n
        if n % 2 == 0:
            return 2.0 * _cross_pairs(sizes) / n
        return sum(
            size / n * 2.0 * _cross_pairs([s - (c == sitter) for c, s in enumerate(sizes)]) / n
            for sitter, size in enumerate(sizes)
        )

    def _spectral_gap(self, world_size: int) -> float:
        if world_size == 1:
            return 1.0
        if self._schedule == "spread":
            expected = sum(self.mixing_matrix(world_size, t) for t in range(_SAMPLED_ORDERS)) / _SAMPLED_ORDERS
            return 1.0 - float(stability.disagreement_eigenvalues(expected).max())
        q = self._cross_probability
        meet = q * self._cross_meetings() + (1.0 - q) * self._fast_meetings()  # (n, n) P(i and j pair up)
        expected = torch.eye(world_size, dtype=_DTYPE) - 0.5 * (torch.diag(meet.sum(dim=1)) - meet)  # E[W]
        return 1.0 - float(stability.disagreement_eigenvalues(expected).max())

    def _fast_meetings(self) -> Tensor:
        """(n, n) probability that ranks i != j meet in a fast round."""
        meet = torch.zeros(self._world_size, self._world_size, dtype=_DTYPE)
        for group in self._members:
            if len(group) > 1:
                index = torch.tensor(group)
                chance = 1.0 / (len(group) - 1 if len(group) % 2 == 0 else len(group))
                meet[index[:, None], index[None, :]] = chance
        return meet.fill_diagonal_(0.0)

    def _cross_meetings(self) -> Tensor:
        """(n, n) probability that ranks i != j meet in a cross round."""
        sizes, n = self.cluster_sizes, self._world_size
        if n % 2 == 0:
            per_cluster = _cluster_meetings(sizes)  # (k, k)
        else:  # condition on the sitter's cluster c; i, j take part with probability (s_c - 1) / s_c each
            per_cluster = torch.zeros(len(sizes), len(sizes), dtype=_DTYPE)
            for c, size in enumerate(sizes):
                present = torch.ones(len(sizes), dtype=_DTYPE)
                present[c] = (size - 1) / size
                both = torch.outer(present, present)
                both[c, c] = (size - 2) / size if size > 1 else 0.0
                reduced = [s - (a == c) for a, s in enumerate(sizes)]
                per_cluster += size / n * both * _cluster_meetings(reduced)
        labels = torch.tensor(self._cluster_of)
        return per_cluster[labels[:, None], labels[None, :]].fill_diagonal_(0.0)


def _cluster_meetings(sizes: Sequence[int]) -> Tensor:
    """(k, k) probability that a given rank of cluster a meets a given rank of cluster b (even total).

    Averages the antipodal pairing over the orders of the cluster blocks: exactly over all
    (k' - 1)! cyclic orders of the k' non-empty clusters (the pairing is rotation invariant),
    or over a seeded sample of orders when there are too many.
    """
    k = len(sizes)
    present = [c for c in range(k) if sizes[c] > 0]
    counts = torch.zeros(k, k, dtype=_DTYPE)
    if len(present) == 0:
        return counts
    orders = _block_orders(present)
    for order in orders:
        blocks = torch.tensor([c for c in order for _ in range(sizes[c])])  # (m,)
        half = len(blocks) // 2
        pair_index = blocks[:half] * k + blocks[half:]
        counts += torch.bincount(pair_index, minlength=k * k).view(k, k).to(_DTYPE)
    # Off the diagonal: expected pairs across a and b; on it, twice the expected pairs inside a.
    counts = (counts + counts.T) / len(orders)
    sizes_t = torch.tensor(sizes, dtype=_DTYPE)
    possible = torch.outer(sizes_t, sizes_t) - torch.diag(sizes_t)  # s_a s_b, or s_a (s_a - 1) on it
    return torch.where(possible > 0, counts / possible.clamp(min=1.0), 0.0)


def _block_orders(present: list[int]) -> list[tuple[int, ...]]:
    # The antipodal pairing is rotation invariant: fixing the first block leaves the cyclic orders.
    first, rest = present[0], present[1:]
    if math.factorial(len(rest)) <= _EXACT_ORDERS_MAX:
        return [(first, *order) for order in itertools.permutations(rest)]
    rng = random.Random("gasloc:bandwidth_aware:block_orders")
    return [(first, *rng.sample(rest, len(rest))) for _ in range(_SAMPLED_ORDERS)]


BANDWIDTH_AWARE_SCHEDULES: tuple[str, ...] = ("concentrated", "spread")

TOPOLOGIES: dict[str, type[Topology]] = {
    cls.name: cls
    for cls in (
        OnePeerTopology,
        TwoPeerTopology,
        RingTopology,
        TorusTopology,
        ExponentialTopology,
        CompleteTopology,
        CustomTopology,
        LocalTopology,
        BandwidthAwareTopology,
    )
}


def build_topology(spec: str | Topology, seed: int = 0) -> Topology:
    """A topology from its name (case-insensitive) or a :class:`Topology`, passed through.

    Args:
        spec: one of :data:`TOPOLOGIES` (except ``custom`` and ``bandwidth_aware``, which need
            their edges or network: build a :class:`CustomTopology` or
            :class:`BandwidthAwareTopology` and pass it) or a Topology instance.
        seed: shared seed of the random schedules (ignored for an instance).
    """
    if isinstance(spec, Topology):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"topology must be a name or a Topology, got {type(spec).__name__}")
    name = spec.strip().lower().replace("-", "_")
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {spec!r}; valid names: {sorted(TOPOLOGIES)}")
    if TOPOLOGIES[name] is CustomTopology:
        raise TopologyError("topology 'custom' needs its edges: pass CustomTopology(edges=...), not a name")
    if TOPOLOGIES[name] is BandwidthAwareTopology:
        raise TopologyError(
            "topology 'bandwidth_aware' needs its network: pass BandwidthAwareTopology(bandwidth=... or "
            "clusters=...) or BandwidthAwareTopology.from_clusters(sizes), not a name"
        )
    return TOPOLOGIES[name](seed=seed)
