"""Communication graphs of GASLoC: who gossips with whom in round t, and with which weights.

A topology is a pure function of (rank, world size n, round t, shared seed): every rank
computes the same graph without communicating, and no process group (or GPU) is needed to
build or query one. Mixing with the round's symmetric weights w_ij = w_ji > 0 is
``(W v)_i = v_i - sum_j w_ij (v_i - v_j)``, so W = I - L is symmetric and doubly stochastic
(ALGORITHM.md, "Notation" and "Topologies").

Named topologies (``build_topology(name)``):

=============  ==========================================================  ===================
name           graph of round t                                            n
=============  ==========================================================  ===================
one_peer       uniformly random perfect matching, w = 1/2; odd n: one      any
               rank sits out
two_peer       ring over a fresh random permutation, w = 1/4               >= 3
ring           fixed ring, w = 1/4 per edge                                any
torus          fixed 2-D torus r x c (most square), w = 1/8 per edge       composite
exponential    hypercube dimension exchange i <-> i XOR 2^(t mod log2 n),  power of two
               w = 1/2
complete       w = 1/n to everyone: an all-reduce mean (exactly DiLoCo)    any
custom         fixed user-given weighted edges (``CustomTopology``)        as given
local          no communication at all (a baseline)                        any
=============  ==========================================================  ===================

Edges that coincide (ring with n = 2, torus with r = 2 or c = 2) have their weights summed,
so the row sums and the spectrum stay those of the general case; every named graph is
positive semidefinite. World size 1 is accepted by every topology and means no peers.

Default outer momentum gamma (``default_outer_momentum``) for the default anchored form, with
the consensus rate it gives (per-round contraction of the disagreement, no gradients; < 1 is
stable) at n = 16 / 64:

===========  ==============  =============  =================================================
topology     gamma           rate 16 / 64   why
===========  ==============  =============  =================================================
one_peer     0.9             0.873 / 0.892  DiLoCo's value. ALGORITHM.md measured the
two_peer     0.9             0.744 / 0.767  anchored form stable for every gamma <= 0.95 on
ring         0.9             0.930 / 0.986  one_peer (n = 8..1024), two_peer and ring
torus        0.9             0.822 / 0.913  (n <= 64); torus: exact rates as listed.
complete     0.9             0 / 0          Exactly DiLoCo's outer Nesterov step.
exponential  0.9 (n <= 16)   0.949 / -      Stable for any gamma < 1 up to n = 16, but only
             0.7 (n >= 32)   - / 0.949      up to 0.848 (n = 32), 0.786 (n = 64), falling to
                                            0.707: ALGORITHM.md caps gamma at 0.7 there.
custom       0.9 if stable                  else 0.9 x its largest stable gamma.
local        0.0             1 / 1          Nothing keeps the replicas together anyway.
===========  ==============  =============  =================================================

Whenever 0.9 is not stable (any topology, e.g. the post_mix form on a random graph), the
default becomes 0.9 x the largest stable gamma, rounded down to 3 decimals, which keeps a
margin inside the stability region.
"""

from __future__ import annotations

import abc
import math
import numbers
import random
from collections.abc import Callable, Hashable, Iterable, Mapping
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
        self, world_size: int, outer_momentum: float, form: UpdateForm = "anchored"
    ) -> float:
        """Asymptotic per-round contraction of the disagreement with no gradients.

        Exact from eigenvalues for fixed and periodic schedules; a seeded float64 simulation
        for random ones (see :mod:`gasloc_lightning.stability`). The outer step is stable for
        this (topology, n, gamma, form) iff the rate is < 1.

        Args:
            world_size: n.
            outer_momentum: gamma in [0, 1).
            form: ``"anchored"`` (default) or ``"post_mix"``.
        """
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
        self.check_world_size(world_size)
        key = ("rate", world_size, float(outer_momentum), form)
        return self._memo(key, lambda: self._consensus_rate(world_size, outer_momentum, form))

    def _consensus_rate(self, world_size: int, gamma: float, form: UpdateForm) -> float:
        modes = self._mode_eigenvalues(world_size)
        if modes is not None:
            return stability.consensus_rate_modes(modes, gamma, form)
        sparse = world_size > _DENSE_SIMULATION_MAX
        return stability.consensus_rate_simulated(
            lambda t: self.mixing_matrix(world_size, t, sparse=sparse), world_size, gamma, form
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

    def max_stable_momentum(self, world_size: int, form: UpdateForm = "anchored") -> float | None:
        """Largest gamma in [0, 0.999] with consensus rate < 1 (within 1e-3), None if none is."""
        stability.check_form(form)
        return self._memo(
            ("max_gamma", world_size, form),
            lambda: stability.max_stable_momentum(lambda g: self.consensus_rate(world_size, g, form)),
        )

    def is_positive_semidefinite(self, world_size: int) -> bool:
        """Whether lambda_min(W) >= -1e-12 in every round (a sample of 32 for random schedules)."""
        self.check_world_size(world_size)
        rounds = self.schedule_period(world_size) or _PSD_SAMPLE_ROUNDS
        return all(
            float(torch.linalg.eigvalsh(self.mixing_matrix(world_size, t)).min()) >= -_PSD_TOL
            for t in range(rounds)
        )

    def default_outer_momentum(self, world_size: int, form: UpdateForm = "anchored") -> float:
        """A gamma inside the stability region: 0.9 if stable, else 0.9 x the largest stable gamma."""
        if self.consensus_rate(world_size, _DEFAULT_MOMENTUM, form) < 1.0:
            return _DEFAULT_MOMENTUM
        limit = self.max_stable_momentum(world_size, form)
        return 0.0 if limit is None else math.floor(_DEFAULT_MOMENTUM * limit * 1000.0) / 1000.0

    def _memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]  # type: ignore[return-value]


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


class OnePeerTopology(Topology):
    """A uniformly random perfect matching each round, w = 1/2 (pairwise averaging).

    The matching of round t is drawn from (seed, n, t) alone, identically on every rank. With
    odd n one uniformly chosen rank sits out the round (no peers).
    """

    name = "one_peer"
    time_varying = True

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        partner = _matching_partners(self.seed, world_size, round_index)[rank]
        return {} if partner == rank else {partner: 0.5}

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

    def default_outer_momentum(self, world_size: int, form: UpdateForm = "anchored") -> float:
        # ALGORITHM.md: cap gamma at 0.7 from n = 32 on, where the limit falls towards 0.707.
        if world_size > 16 and self.consensus_rate(world_size, _HYPERCUBE_CAP, form) < 1.0:
            return _HYPERCUBE_CAP
        return super().default_outer_momentum(world_size, form)


class CompleteTopology(Topology):
    """Everyone with everyone, w_ij = 1/n: W = 11^T / n, realised as an all-reduce mean.

    The outer step is then exactly DiLoCo's outer Nesterov step and the replicas agree after
    every round: the consensus rate is 0 for any gamma.
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
        self, world_size: int, outer_momentum: float, form: UpdateForm = "anchored"
    ) -> float:
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
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
        self, world_size: int, outer_momentum: float, form: UpdateForm = "anchored"
    ) -> float:
        stability.check_form(form)
        stability.check_outer_momentum(outer_momentum)
        self.check_world_size(world_size)
        return 1.0

    def max_stable_momentum(self, world_size: int, form: UpdateForm = "anchored") -> float | None:
        return None

    def default_outer_momentum(self, world_size: int, form: UpdateForm = "anchored") -> float:
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
    )
}


def build_topology(spec: str | Topology, seed: int = 0) -> Topology:
    """A topology from its name (case-insensitive) or a :class:`Topology`, passed through.

    Args:
        spec: one of :data:`TOPOLOGIES` (except ``custom``, which needs its edges: build a
            :class:`CustomTopology` and pass it) or a Topology instance.
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
    return TOPOLOGIES[name](seed=seed)
