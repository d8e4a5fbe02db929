"""Fixed graphs: ring, torus, exponential (hypercube), complete, local and custom edges."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from gasloc_lightning.algorithm import stability
from gasloc_lightning.algorithm.stability import UpdateForm

from gasloc_lightning.topology.base import _is_index, Topology, TopologyError, _DTYPE, _HYPERCUBE_CAP
from gasloc_lightning.topology.matchings import _add_edge

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
