"""Random graphs redrawn every round: one_peer (a perfect matching) and two_peer (a ring over a permutation)."""

from __future__ import annotations


from torch import Tensor


from gasloc_lightning.topology.base import Topology, TopologyError
from gasloc_lightning.topology.matchings import _matching_partners, _ring_neighbours, _matching_matrix

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


