"""Two-level mixing: regions (docs/algorithm.md, "Two levels: regions").

Workers fall into r regions (data centres, clouds): fast links inside a region, slow links across. The
outer step is unchanged (it accepts any symmetric doubly stochastic W_t); the two levels are two kinds
of W_t:

- **Region round** (every round but the cross rounds): ``W_t = B``, the exact average inside each
  region, ``(B v)_i = mean of v_j over j in R(i)``. B is symmetric, doubly stochastic and a projection.
- **Cross round** (every ``cross_every``-th round, K): ``W_t = B C_t B``. C_t lifts a mixing between
  regions, ``W_R(t)`` (an r x r matrix from a :class:`Topology` on the regions; default ``one_peer``, a
  random matching of regions with w = 1/2), to the ranks: the rank with local index l in region A mixes
  with the rank of local index l in region A' with weight ``W_R[A, A']``, when A' has such a rank; the
  weight of a missing partner stays on the diagonal. So C_t is symmetric and doubly stochastic, and
  positive semidefinite when W_R(t) is (a matching is), and so is B C_t B.

After a region round every member of a region holds the same point, so in a cross round of regions of
m ranks each, rank l carries only the l-th 1/m of the region's point across (reduce-scatter inside, the
rank-to-rank exchange of shards, all-gather inside): the same result as the matrix B C B. Regions of
different sizes are allowed; the pairs are then the local indices both regions have, and the mean over
*ranks* is what is preserved (the mean over regions is not).

**The round that runs on these regions** is not the anchored form on W_t (the sketch above, kept for its
algebra: at gamma 0.9 it diverges from K = 5 on, see tests/test_regions.py) but the two-level round of
:mod:`gasloc_lightning.algorithm.two_level`: DiLoCo inside each region every round, and every K rounds an
anchored outer step of its own (``cross_lr``, ``cross_momentum``) across regions with this topology's
region mixing (or, with ``region_topology`` complete, the exact mean over all ranks: hierarchical DiLoCo).
:meth:`TwoLevelTopology.rule` and :meth:`TwoLevelTopology.check_rule` give it and its stability;
``resolve_momentum`` (what a one-level engine calls) refuses the topology.

Two reductions of the matrices: with one region, B = (1/n) 1 1^T and C = I, so every round is DiLoCo's all-reduce
mean; with one worker per region, B = I and B C B = C, so the cross rounds are GASLoC on the regions'
topology and the region rounds are rounds without exchange (W = I; with K = 1 there are none).

:class:`TwoLevelTopology` is a :class:`Topology`, so its consensus rate and stable momenta come from
the same machinery as every graph's (exact for a fixed region topology, whose W_t commute; simulated
for a random one). Its ``mixing_weights`` are the dense rows of W_t: correct for a pairwise engine, but
an engine should apply B as an all-reduce inside the region.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.codecs import build_codec
from gasloc_lightning.topology.bandwidth_aware import _clusters_from_bandwidth
from gasloc_lightning.algorithm.two_level import TwoLevelRule
from gasloc_lightning.algorithm.two_level_stability import max_stable_cross_momentum, two_level_rate
from gasloc_lightning.network.model import scaled_sizes
from gasloc_lightning.topology.base import _DTYPE, Topology, TopologyError, _is_index
from gasloc_lightning.topology.random_graphs import OnePeerTopology
from gasloc_lightning.topology.registry import build_topology

#: lambdas of the region mixing the two-level stability check covers (any PSD region graph lies in [0, 1]).
_CHECKED_EIGENVALUES = tuple(k / 10 for k in range(11))

_SYMMETRY_TOL = 1e-12


class Regions:
    """The region of every rank: labels (ints or names, e.g. host names) turned into region indices.

    Regions are numbered in order of first appearance; a region's members keep the order of their
    ranks, and a rank's *local index* is its position among them (rank l of region A pairs with rank l
    of region A' in a cross round).

    Args:
        assignment: the region label of every rank, e.g. ``[0, 0, 1, 1]`` or
            ``["gcp-a", "gcp-a", "aws-b", "aws-b"]``.
    """

    def __init__(self, assignment: Sequence[Hashable]) -> None:
        if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Sequence) or len(assignment) == 0:
            raise TopologyError(f"regions must be a non-empty list with the region of every rank, got {assignment!r}")
        for rank, label in enumerate(assignment):
            if isinstance(label, bool) or not isinstance(label, (int, str)) or label == "":
                raise TopologyError(f"regions[{rank}] must be a region index or a non-empty name, got {label!r}")
        groups: dict[Hashable, list[int]] = {}
        for rank, label in enumerate(assignment):
            groups.setdefault(label, []).append(rank)
        self._names = tuple(groups)
        self._members = tuple(tuple(ranks) for ranks in groups.values())
        self._region_of = [0] * len(assignment)
        self._local_index = [0] * len(assignment)
        for region, ranks in enumerate(self._members):
            for local, rank in enumerate(ranks):
                self._region_of[rank], self._local_index[rank] = region, local

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> Regions:
        """Regions of the given sizes over consecutive ranks (node-major, as torchrun numbers them)."""
        valid = not isinstance(sizes, (str, numbers.Number)) and isinstance(sizes, Sequence) and len(sizes) > 0
        if not valid or not all(_is_index(size) and size > 0 for size in sizes):
            raise TopologyError(f"sizes must be a non-empty list of positive ints, got {sizes!r}")
        return cls([region for region, size in enumerate(sizes) for _ in range(size)])

    @classmethod
    def from_bandwidth(cls, bandwidth: Sequence[Sequence[float]] | Tensor) -> Regions:
        """Regions as the clusters of fast links of an n x n bandwidth matrix (as ``bandwidth_aware`` finds them)."""
        return cls(_clusters_from_bandwidth(bandwidth))

    def __repr__(self) -> str:
        return f"Regions(names={list(self._names)}, sizes={list(self.sizes)})"

    @property
    def world_size(self) -> int:
        return len(self._region_of)

    @property
    def num_regions(self) -> int:
        """r."""
        return len(self._members)

    @property
    def names(self) -> tuple[Hashable, ...]:
        """The label of every region, by region index."""
        return self._names

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of every region, by region index."""
        return self._members

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(map(len, self._members))

    def region_of(self, rank: int) -> int:
        """R(i), the region index of ``rank``."""
        return self._region_of[self._check_rank(rank)]

    def local_index(self, rank: int) -> int:
        """The position of ``rank`` among its region's members."""
        return self._local_index[self._check_rank(rank)]

    def average_matrix(self) -> Tensor:
        """B (n, n) float64: the exact average inside every region."""
        matrix = torch.zeros(self.world_size, self.world_size, dtype=_DTYPE)
        for ranks in self._members:
            index = torch.tensor(ranks)
            matrix[index.unsqueeze(1), index] = 1.0 / len(ranks)
        return matrix

    def lift(self, region_matrix: Tensor) -> Tensor:
        """C (n, n) float64: the region-level mixing ``W_R`` (r, r) applied between ranks of equal local index.

        Args:
            region_matrix: symmetric, doubly stochastic, non-negative off the diagonal.
        """
        region_matrix = _check_region_matrix(region_matrix, self.num_regions)
        lifted = torch.eye(self.world_size, dtype=_DTYPE)
        for a, b in (region_matrix - torch.diag(region_matrix.diagonal())).nonzero().tolist():
            weight = float(region_matrix[a, b])
            for i, j in zip(self._members[a], self._members[b]):  # local indices both regions have
                lifted[i, j] += weight
                lifted[i, i] -= weight
        return lifted

    def _check_rank(self, rank: int) -> int:
        if not _is_index(rank) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank


class TwoLevelTopology(Topology):
    """Region rounds (W = B) every round and a cross round (W = B C B) every ``cross_every`` rounds.

    Round t is a cross round when ``(t + 1) % cross_every == 0`` (the K-th, 2K-th, ... round); its region
    mixing is ``region_topology``'s W_R at round ``t // cross_every`` on r regions, so a random region
    topology draws a fresh matching at every crossing.

    Args:
        regions: the region of every rank (a :class:`Regions`, or the labels it takes).
        cross_every: K >= 1, the rounds per cross round.
        region_topology: the mixing between regions (a :class:`Topology` on r ranks, or its name); default
            ``one_peer``. ``complete``: the cross step is the exact mean over all ranks (hierarchical DiLoCo).
        cross_lr, cross_momentum: eta_g and gamma_g of the two-level round's cross step (see :meth:`rule`).
        cross_overlap: the delayed crossing: each cross exchange is started at one crossing and applied at the
            next, under the K region rounds between them (``algorithm/two_level.py``).
        cross_delayed_weight: beta in (0, 1], the scale of the delayed correction. 1 diverges on quadratics
            whenever a region's own steps overshoot between crossings (DiLoCo's 0.9 momentum inside does);
            0.5, Streaming DiLoCo's mixing factor, is stable for every K measured with cross_momentum 0.
        cross_codec: how each rank's shard crosses (``float32``, ``bfloat16``, ``int8``, ``fp8``, ``int4``,
            ``int2``; :mod:`~gasloc_lightning.algorithm.codecs`): a lossy one mixes the decoded shards and keeps
            each rank's own rounding residual (the mean over ranks is kept). Hierarchical DiLoCo (``complete``)
            averages each shard's change since the last mean by a quantized all-reduce, DiLoCo's, among rank l
            of every region (not int2; delayed: gasloc-sim only, the strategy refuses it). Regions of equal
            sizes only; the all-gather inside a region stays float32.
        seed: the seed of the default region topology (a given topology keeps its own).
    """

    name = "two_level"
    time_varying = True

    def __init__(self, regions: Regions | Sequence[Hashable], *, cross_every: int = 1,
                 region_topology: Topology | str | None = None, cross_lr: float = 1.0,
                 cross_momentum: float = 0.5, cross_overlap: bool = False, cross_delayed_weight: float = 0.5,
                 cross_codec: str = "float32", seed: int = 0) -> None:
        super().__init__(seed=seed)
        if isinstance(region_topology, str):
            region_topology = build_topology(region_topology, seed=seed)
        self._regions = regions if isinstance(regions, Regions) else Regions(regions)
        if not _is_index(cross_every) or cross_every < 1:
            raise TopologyError(f"cross_every (K) must be an int >= 1, got {cross_every!r}")
        if region_topology is not None and not isinstance(region_topology, Topology):
            raise TopologyError(f"region_topology must be a Topology or None, got {type(region_topology).__name__}")
        if isinstance(region_topology, TwoLevelTopology):
            raise TopologyError("region_topology must mix the regions themselves, not be two-level again")
        self._cross_every = int(cross_every)
        self._region_topology = OnePeerTopology(seed=seed) if region_topology is None else region_topology
        self._region_topology.check_world_size(self._regions.num_regions)
        TwoLevelRule(cross_lr=cross_lr, cross_momentum=cross_momentum, cross_overlap=cross_overlap,
                     cross_delayed_weight=cross_delayed_weight)  # refused here, by name, when out of range
        self.cross_lr, self.cross_momentum = float(cross_lr), float(cross_momentum)
        self.cross_overlap, self.cross_delayed_weight = cross_overlap, float(cross_delayed_weight)
        try:
            sparse = build_codec(cross_codec).sparse
        except ValueError as error:
            raise TopologyError(f"cross_codec={cross_codec!r} is not a codec: {error}") from None
        if sparse:
            raise TopologyError(f"cross_codec={cross_codec!r} is sparse (top-k): the crossing takes dense codecs "
                                "(int8, int4, ...) for now")
        if cross_codec != "float32":
            if self._region_topology.uses_all_reduce and cross_codec == "int2":
                raise TopologyError(f"cross_codec={cross_codec!r}: int2 has no zero level, so a quantized mean moves "
                                    "every parameter that did not move; use int4 or int8 for hierarchical DiLoCo")
            if len(set(self._regions.sizes)) != 1:
                raise TopologyError(f"cross_codec={cross_codec!r} needs regions of equal sizes (rank l's shard "
                                    f"pairs with rank l's), got sizes {list(self._regions.sizes)}")
        self.cross_codec = cross_codec

    @classmethod
    def from_network(cls, *, sizes: Sequence[int] | None = None, scale_to: int | None = None,
                     regions: Sequence[Hashable] | None = None, bandwidth: Sequence[Sequence[float]] | None = None,
                     cross_every: int = 1, region_topology: Topology | str = "one_peer", cross_lr: float = 1.0,
                     cross_momentum: float = 0.5, cross_overlap: bool = False, cross_delayed_weight: float = 0.5,
                     cross_codec: str = "float32", seed: int = 0) -> TwoLevelTopology:
        """The regions from the user (``regions``: a label per rank, host names are fine), else a bandwidth matrix's
        clusters of fast links, else a clustered network's ``sizes`` (scaled to ``scale_to`` ranks as the network
        scales them). The other arguments are the class's.
        """
        if regions is not None:
            layout: Regions = Regions(list(regions))
        elif bandwidth is not None and not isinstance(bandwidth, numbers.Number):  # a uniform network's scalar: none
            layout = Regions.from_bandwidth(bandwidth)
        elif sizes is not None:
            try:
                layout = Regions.from_sizes(scaled_sizes(list(sizes), scale_to) if scale_to is not None else sizes)
            except ValueError as error:
                raise TopologyError(str(error)) from None
        else:
            raise TopologyError("two_level needs regions: give topology.regions (a region label per rank), "
                                "topology.bandwidth, or a clustered network (network=two_clusters, cloud_mix, many_sites)")
        return cls(layout, cross_every=cross_every, region_topology=region_topology, cross_lr=cross_lr,
                   cross_momentum=cross_momentum, cross_overlap=cross_overlap,
                   cross_delayed_weight=cross_delayed_weight, cross_codec=cross_codec, seed=seed)

    def rule(self, *, region_lr: float, region_momentum: float) -> TwoLevelRule:
        """The two-level round's hyperparameters: the region step's (the strategy's outer_lr / outer_momentum)
        and this topology's cross step."""
        return TwoLevelRule(cross_every=self._cross_every, region_lr=region_lr, region_momentum=region_momentum,
                            cross_lr=self.cross_lr, cross_momentum=self.cross_momentum,
                            cross_mean=self._region_topology.uses_all_reduce, cross_overlap=self.cross_overlap,
                            cross_delayed_weight=self.cross_delayed_weight)

    def check_rule(self, rule: TwoLevelRule) -> float:
        """Refuse a two-level rule that does not converge on quadratics; returns its per-round rate.

        Two checks: the period map's spectral radius for every region mixing eigenvalue in [0, 1]
        (:func:`~gasloc_lightning.algorithm.two_level_stability.two_level_rate`), and, for a gossip across more
        than two regions, the region topology's own consensus check at gamma_g (its matchings switch).
        """
        rate = two_level_rate(rule, eigenvalues=_CHECKED_EIGENVALUES)
        if rate >= 1.0:
            limit = max_stable_cross_momentum(rule, eigenvalues=_CHECKED_EIGENVALUES)
            delayed = f", delayed crossing with cross_delayed_weight {rule.cross_delayed_weight}" if rule.cross_overlap else ""
            fix = (f"lower cross_momentum below {limit:.3f} or the region momentum" if limit > 0 else
                   "no cross_momentum is stable here: lower cross_delayed_weight (0.5 is stable with cross_momentum 0 "
                   "for every K measured) or the region momentum")
            raise ValueError(f"the two-level round diverges on quadratics (rate {rate:.4f} per round) with region "
                             f"(outer_lr, outer_momentum) = ({rule.region_lr}, {rule.region_momentum}), cross_every "
                             f"{rule.cross_every}, cross (lr, momentum) = ({rule.cross_lr}, {rule.cross_momentum})"
                             f"{delayed}: {fix}")
        r = self._regions.num_regions
        if r > 1 and not rule.cross_mean:
            self._region_topology.resolve_momentum(r, rule.cross_momentum, overlap=rule.cross_overlap,
                                                   delayed_weight=rule.cross_delayed_weight)
        return rate

    def resolve_momentum(self, world_size: int, requested: float | None, form: str = "anchored",
                         overlap: bool = False, *, delayed_weight: float = 1.0) -> float:
        """Refused: a one-level engine would run the anchored form on W_t, which diverges for rare crossings."""
        raise ValueError("topology two_level runs the two-level round (algorithm/two_level.py), which gasloc-sim "
                         "runs; the multi-process and elastic strategies do not wire it yet")

    def __repr__(self) -> str:
        return (f"TwoLevelTopology(regions={self._regions!r}, cross_every={self._cross_every}, "
                f"region_topology={self._region_topology!r})")

    @property
    def regions(self) -> Regions:
        return self._regions

    @property
    def cross_every(self) -> int:
        """K."""
        return self._cross_every

    @property
    def region_topology(self) -> Topology:
        return self._region_topology

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if world_size != self._regions.world_size:
            raise TopologyError(f"topology 'two_level' was built for {self._regions.world_size} ranks (the length of "
                                f"its region list), got world_size {world_size}")

    def schedule_period(self, world_size: int) -> int | None:
        period = self._region_topology.schedule_period(self._regions.num_regions)
        return None if period is None else period * self._cross_every

    def is_cross_round(self, round_index: int) -> bool:
        """Whether round t mixes across regions (W = B C B) rather than only inside them (W = B)."""
        if not _is_index(round_index) or round_index < 0:
            raise TopologyError(f"round_index must be an int >= 0, got {round_index!r}")
        return (round_index + 1) % self._cross_every == 0

    def region_mixing_matrix(self, round_index: int) -> Tensor:
        """W_R (r, r) of cross round t: the region topology's matrix at round ``t // K``."""
        return self._region_topology.mixing_matrix(self._regions.num_regions, round_index // self._cross_every)

    def cross_matrix(self, round_index: int) -> Tensor:
        """C (n, n) of round t (the lifted W_R; I on a region round)."""
        if not self.is_cross_round(round_index):
            return torch.eye(self._regions.world_size, dtype=_DTYPE)
        return self._regions.lift(self.region_mixing_matrix(round_index))

    def cross_peers(self, rank: int, round_index: int) -> dict[int, float]:
        """The ranks ``rank`` exchanges with across regions in round t, with their weights in C ({}: none)."""
        row = self.cross_matrix(round_index)[self._regions._check_rank(rank)]
        return {j: float(row[j]) for j in row.nonzero().flatten().tolist() if j != rank}

    def mixing_matrix(self, world_size: int, round_index: int, sparse: bool = False) -> Tensor:
        self.check_world_size(world_size)
        average = self._regions.average_matrix()
        matrix = average
        if self.is_cross_round(round_index):
            matrix = average @ self.cross_matrix(round_index) @ average
            matrix = (matrix + matrix.T) / 2  # symmetric to the last bit (the product is, up to rounding)
        return matrix.to_sparse() if sparse else matrix

    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]:
        row = self.mixing_matrix(world_size, round_index)[self._regions._check_rank(rank)]
        return {j: float(row[j]) for j in row.nonzero().flatten().tolist() if j != rank}


def _check_region_matrix(matrix: Tensor, num_regions: int) -> Tensor:
    if not isinstance(matrix, Tensor) or tuple(matrix.shape) != (num_regions, num_regions):
        raise TopologyError(f"region_matrix must be a ({num_regions}, {num_regions}) tensor, got "
                            f"{getattr(matrix, 'shape', type(matrix).__name__)}")
    matrix = matrix.to(_DTYPE).to_dense() if matrix.is_sparse else matrix.to(_DTYPE)
    off_diagonal = matrix - torch.diag(matrix.diagonal())
    if not torch.allclose(matrix, matrix.T, rtol=0, atol=_SYMMETRY_TOL) or bool((off_diagonal < 0).any()):
        raise TopologyError("region_matrix must be symmetric with non-negative weights off the diagonal")
    if not torch.allclose(matrix.sum(dim=1), torch.ones(num_regions, dtype=_DTYPE), rtol=0, atol=_SYMMETRY_TOL):
        raise TopologyError("region_matrix must be doubly stochastic (rows summing to 1)")
    return matrix
