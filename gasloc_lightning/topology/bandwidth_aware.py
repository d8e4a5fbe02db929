"""Matchings that favour fast links: clusters of fast links, crossed at a set rate (concentrated or spread)."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Hashable, Iterable, Sequence
from functools import lru_cache

import torch
from torch import Tensor

from gasloc_lightning.algorithm import stability
from gasloc_lightning.network.model import scaled_sizes

from gasloc_lightning.topology.base import _is_index, Topology, TopologyError, _DTYPE
from gasloc_lightning.topology.matchings import RoundRandom, _matching_matrix

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
    rng = RoundRandom("bandwidth_aware", seed, world_size, round_index)
    cross = rng.uniform() < cross_probability
    groups = [rng.shuffled(group) for group in members]
    if cross:
        if world_size % 2:  # one uniformly chosen rank sits out, the others pair up
            sitter = rng.below(world_size)
            groups = [[rank for rank in group if rank != sitter] for group in groups]
        groups = rng.shuffled(groups)
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
    rng = RoundRandom("bandwidth_aware:spread", seed, world_size, round_index)
    whole = math.floor(cross_pairs)
    k = whole + (rng.uniform() < cross_pairs - whole)
    groups = [rng.shuffled(group) for group in members]
    pairs = []
    for _ in range(k):
        ties = rng.uniforms(len(groups))
        order = sorted(range(len(groups)), key=lambda c: (-len(groups[c]), ties[c]))
        largest, others = order[0], [rank for c in order[1:] for rank in groups[c]]
        if not groups[largest] or not others:
            break
        partner = others[rng.below(len(others))]
        groups[next(c for c in order[1:] if partner in groups[c])].remove(partner)
        pairs.append((groups[largest].pop(), partner))
    return _partners_of(pairs + _pairs_inside(groups), world_size), k > 0


class BandwidthAwareTopology(Topology):
    """Random perfect matchings that favour fast links (a network model's clusters), w = 1/2.

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
        cls, sizes: Sequence[int], slow_link_rate: float = 0.2, seed: int = 0, schedule: str = "concentrated",
        scale_to: int | None = None,
    ) -> BandwidthAwareTopology:
        """Clusters of the given sizes over consecutive ranks (node-major, as torchrun numbers them).

        Args:
            sizes: ranks per cluster, e.g. ``[8, 8]`` for two machines of 8 GPUs.
            slow_link_rate: see the class.
            seed: see the class.
            schedule: see the class.
            scale_to: the clusters scaled in proportion to this many ranks, as a network preset scales
                its own (:func:`gasloc_lightning.network.scaled_sizes`); None: ``sizes`` as given.
        """
        if sizes is None:
            raise TopologyError("bandwidth_aware needs clusters: give topology.sizes (ranks per cluster, e.g. [4, 4]) "
                                "or a clustered network (network=two_clusters, cloud_mix or many_sites)")
        valid = not isinstance(sizes, (str, numbers.Number)) and len(sizes) > 0
        if not valid or not all(_is_index(size) and size > 0 for size in sizes):
            raise TopologyError(f"sizes must be a non-empty list of positive ints, got {sizes!r}")
        if scale_to is not None:
            try:
                sizes = scaled_sizes(list(sizes), scale_to)
            except ValueError as error:
                raise TopologyError(str(error)) from None
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
    rng = RoundRandom("bandwidth_aware:block_orders", 0, len(present), 0)
    return [(first, *rng.shuffled(rest)) for _ in range(_SAMPLED_ORDERS)]


BANDWIDTH_AWARE_SCHEDULES: tuple[str, ...] = ("concentrated", "spread")

