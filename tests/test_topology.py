"""Topologies: weights every rank agrees on, doubly stochastic W, spectral gaps, defaults, errors."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from gasloc_lightning.algorithm import stability
from gasloc_lightning.topology import (
    TOPOLOGIES,
    BandwidthAwareTopology,
    CustomTopology,
    ExponentialTopology,
    OnePeerTopology,
    RingTopology,
    Topology,
    TopologyError,
    TwoPeerTopology,
    build_topology,
    torus_shape,
)
from gasloc_lightning.topology.matchings import stream_seed

NAMED = ["one_peer", "two_peer", "ring", "torus", "exponential", "complete", "local"]
SIZES = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16]


def valid_sizes(name: str, sizes: list[int] = SIZES) -> list[int]:
    out = []
    for n in sizes:
        try:
            build_topology(name).check_world_size(n)
        except ValueError:
            continue
        out.append(n)
    return out


CASES = [(name, n) for name in NAMED for n in valid_sizes(name)]


def views(name: str, n: int, round_index: int, seed: int = 7) -> list[dict[int, float]]:
    """Each rank's weights from its own topology object, as separate processes would compute them."""
    return [build_topology(name, seed=seed).mixing_weights(rank, n, round_index) for rank in range(n)]


def custom_ring_of_16() -> CustomTopology:
    return CustomTopology([(i, (i + 1) % 16, 0.25) for i in range(16)], world_size=16)


@pytest.mark.parametrize(("name", "n"), CASES)
def test_every_rank_computes_the_same_symmetric_weights(name, n):
    for t in range(4):
        weights = views(name, n, t)
        for i, peers in enumerate(weights):
            assert i not in peers
            assert all(0.0 < w <= 1.0 for w in peers.values())
            assert sum(peers.values()) <= 1.0 + 1e-12
            for j, w in peers.items():
                assert 0 <= j < n
                assert weights[j].get(i) == pytest.approx(w, abs=1e-15), f"w_{i}{j} != w_{j}{i} in round {t}"


@pytest.mark.parametrize(("name", "n"), CASES)
def test_mixing_matrix_is_symmetric_doubly_stochastic_and_matches_the_weights(name, n):
    topology = build_topology(name, seed=3)
    for t in range(3):
        W = topology.mixing_matrix(n, t)
        assert W.dtype == torch.float64 and W.shape == (n, n)
        torch.testing.assert_close(W, W.T, rtol=0, atol=1e-15)
        torch.testing.assert_close(W.sum(dim=1), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
        assert W.min() >= 0.0
        for i, peers in enumerate(topology.mixing_weights(i, n, t) for i in range(n)):
            expected = {j: float(W[i, j]) for j in range(n) if j != i and W[i, j] != 0}
            assert peers == pytest.approx(expected)
        torch.testing.assert_close(topology.mixing_matrix(n, t, sparse=True).to_dense(), W)


@pytest.mark.parametrize("name", ["one_peer", "two_peer"])
def test_random_schedules_are_seeded_and_vary(name):
    n = 16
    same = [views(name, n, t, seed=1) for t in range(6)]
    assert same == [views(name, n, t, seed=1) for t in range(6)]
    assert len({str(v) for v in same}) > 1, "the graph should change from round to round"
    assert views(name, n, 0, seed=1) != views(name, n, 0, seed=2)


FIXTURE = Path(__file__).parent / "fixtures" / "matchings.json"
# The schedules pinned by the fixture: (topology, its arguments), each drawn for n = 8 and 16.
PINNED = {
    "one_peer": ("one_peer", {"seed": 0}),
    "two_peer": ("two_peer", {"seed": 0}),
    "bandwidth_aware_concentrated": ("bandwidth_aware", {"slow_link_rate": 0.25, "schedule": "concentrated"}),
    "bandwidth_aware_spread": ("bandwidth_aware", {"slow_link_rate": 0.25, "schedule": "spread"}),
}
PINNED_ROUNDS = 6


def _pinned_rounds(key: str, n: int) -> list[list[list[int]]]:
    """Every rank's sorted peers in the first rounds (4 clusters of n / 4 ranks for bandwidth_aware)."""
    name, arguments = PINNED[key]
    if name == "bandwidth_aware":
        topology = BandwidthAwareTopology.from_clusters([n // 4] * 4, seed=0, **arguments)
    else:
        topology = build_topology(name, **arguments)
    return [[sorted(topology.mixing_weights(rank, n, t)) for rank in range(n)] for t in range(PINNED_ROUNDS)]


def _draw_fixture() -> dict:
    rounds = {key: {str(n): _pinned_rounds(key, n) for n in (8, 16)} for key in PINNED}
    return {"about": "peers of every rank in rounds 0..5; regenerate only on purpose: "
                     "python tests/test_topology.py --regenerate-matchings", "rounds": rounds}


@pytest.mark.parametrize("key", sorted(PINNED))
@pytest.mark.parametrize("n", [8, 16])
def test_schedule_is_pinned_by_the_golden_fixture(key, n):
    """Changing how matchings are drawn (a torch upgrade, a refactor) breaks resumed and mixed-version
    runs."""
    expected = json.loads(FIXTURE.read_text())["rounds"][key][str(n)]
    assert _pinned_rounds(key, n) == expected


def test_round_seeds_follow_the_documented_integer_formula():
    """SplitMix64 folded over (stream id, seed, n, t): an independent re-implementation agrees."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    state = 0
    for part in (1, 7, 16, 3):  # one_peer is stream 1
        state = mix(state ^ part)
    assert stream_seed("one_peer", 7, 16, 3) == state
    order = torch.randperm(16, generator=torch.Generator().manual_seed(state)).tolist()
    pairs = list(zip(order[0::2], order[1::2]))
    partners = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    drawn = [next(iter(OnePeerTopology(seed=7).mixing_weights(i, 16, 3))) for i in range(16)]
    assert drawn == [partners[i] for i in range(16)]
    with pytest.raises(ValueError, match="stream must be one of"):
        stream_seed("one-peer", 7, 16, 3)


def test_one_peer_matchings_are_uniform():
    topology = OnePeerTopology(seed=0)
    # rank 0 meets each of the three others with probability 1/3
    counts = Counter(next(iter(topology.mixing_weights(0, 4, t))) for t in range(600))
    assert set(counts) == {1, 2, 3}
    assert all(150 <= c <= 250 for c in counts.values())


@pytest.mark.parametrize("n", [3, 5, 9])
def test_one_peer_odd_world_size_leaves_exactly_one_rank_out(n):
    topology = OnePeerTopology(seed=5)
    sitting_out = []
    for t in range(30):
        out = [rank for rank in range(n) if topology.mixing_weights(rank, n, t) == {}]
        assert len(out) == 1
        sitting_out += out
    assert len(set(sitting_out)) > 1


def test_coinciding_edges_add_up():
    assert RingTopology().mixing_weights(0, 2, 0) == {1: 0.5}
    assert build_topology("torus").mixing_weights(0, 4, 0) == {2: 0.25, 1: 0.25}
    assert build_topology("torus").mixing_weights(0, 6, 0) == {3: 0.25, 2: 0.125, 1: 0.125}


def test_torus_shape_is_most_square():
    assert torus_shape(12) == (3, 4)
    assert torus_shape(16) == (4, 4)
    assert torus_shape(6) == (2, 3)
    assert torus_shape(7) is None


@pytest.mark.parametrize(
    ("name", "n", "match"),
    [("two_peer", 2, "two_peer.*2"), ("exponential", 6, "exponential.*6"), ("torus", 7, "torus.*7.*ring"),
     ("torus", 2, "torus"), ("ring", 0, "world_size")],
)
def test_impossible_world_sizes_are_refused(name, n, match):
    topology = build_topology(name)
    with pytest.raises(TopologyError, match=match):
        topology.check_world_size(n)
    with pytest.raises(ValueError):
        topology.mixing_matrix(n, 0)


def test_build_topology():
    assert set(TOPOLOGIES) == set(NAMED) | {"custom", "bandwidth_aware"}
    assert isinstance(build_topology("One_Peer", seed=4), OnePeerTopology)
    assert build_topology("one_peer", seed=4).seed == 4
    instance = TwoPeerTopology(seed=9)
    assert build_topology(instance) is instance
    with pytest.raises(ValueError, match="valid names.*one_peer"):
        build_topology("star")
    with pytest.raises(ValueError, match="CustomTopology"):
        build_topology("custom")
    with pytest.raises(ValueError, match="BandwidthAwareTopology"):
        build_topology("bandwidth_aware")
    with pytest.raises(TypeError):
        build_topology(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        OnePeerTopology(seed="0")  # type: ignore[arg-type]


def test_flags():
    assert build_topology("complete").uses_all_reduce
    assert not any(build_topology(name).uses_all_reduce for name in NAMED if name != "complete")
    time_varying = {name for name in NAMED if build_topology(name).time_varying}
    assert time_varying == {"one_peer", "two_peer", "exponential"}


def test_custom_topology_accepts_both_spellings():
    as_list = CustomTopology([(0, 1, 0.5), (1, 2, 0.25), (2, 1, 0.25)])
    as_map = CustomTopology({(0, 1): 0.5, (2, 1): 0.25})
    torch.testing.assert_close(as_list.mixing_matrix(3, 0), as_map.mixing_matrix(3, 5))
    assert as_list.edges == {(0, 1): 0.5, (1, 2): 0.25}
    assert as_list.mixing_weights(1, 3, 0) == {0: 0.5, 2: 0.25}


@pytest.mark.parametrize(
    ("edges", "kwargs", "match"),
    [
        ([(0, 1, 0.5), (1, 0, 0.25)], {}, r"edge \(1, 0\) given twice"),
        ([(0, 1, 0.0)], {}, r"edge \(0, 1\).*weight"),
        ([(0, 1, -0.1)], {}, r"edge \(0, 1\).*weight"),
        ([(0, 0, 0.5)], {}, r"edge \(0, 0\)"),
        ([(0, 1, 0.75), (1, 2, 0.5)], {}, r"rank 1 .* > 1"),
        ([(0, 1, 0.5), (1, 5, 0.25)], {"world_size": 4}, r"edge \(1, 5\).*world_size 4"),
        ([(0, 1)], {}, "each edge"),
    ],
)
def test_custom_topology_validation(edges, kwargs, match):
    with pytest.raises(TopologyError, match=match):
        CustomTopology(edges, **kwargs)


def test_custom_topology_world_size_checks():
    path = CustomTopology([(0, 1, 0.5), (1, 2, 0.25)])
    path.check_world_size(3)
    with pytest.raises(TopologyError, match="not connected.*3"):
        CustomTopology([(0, 1, 0.5), (2, 3, 0.5)]).check_world_size(4)
    with pytest.raises(TopologyError, match=r"edge \(1, 2\).*world_size 2"):
        path.check_world_size(2)
    with pytest.raises(TopologyError, match="not connected"):
        path.check_world_size(4)
    with pytest.raises(TopologyError, match="built for world_size 16"):
        custom_ring_of_16().check_world_size(8)


def test_spectral_gaps():
    assert 1.0 - RingTopology().spectral_gap(16) == pytest.approx(0.9619, abs=1e-4)  # oracle 7
    assert custom_ring_of_16().spectral_gap(16) == pytest.approx(RingTopology().spectral_gap(16))
    assert build_topology("complete").spectral_gap(8) == pytest.approx(1.0)
    assert build_topology("local").spectral_gap(8) == 0.0
    for n in (4, 16, 64):
        assert ExponentialTopology().spectral_gap(n) == pytest.approx(1.0 / math.log2(n))
    assert build_topology("torus").spectral_gap(16) == pytest.approx(0.25)


class Sampled(Topology):
    """A user-defined time-varying topology: gets the generic, sampled spectral gap."""

    name = "sampled"
    time_varying = True

    def __init__(self, inner: Topology) -> None:
        super().__init__(seed=inner.seed)
        self.inner = inner

    def mixing_weights(self, rank, world_size, round_index):
        return self.inner.mixing_weights(rank, world_size, round_index)


class Alternating(Topology):
    """A user-defined periodic schedule whose two graphs do not commute: rates are simulated."""

    name = "alternating"
    time_varying = True

    def schedule_period(self, world_size):
        return 2

    def mixing_weights(self, rank, world_size, round_index):
        graph = RingTopology() if round_index % 2 == 0 else OnePeerTopology(seed=0)
        return graph.mixing_weights(rank, world_size, 0)


def test_non_commuting_periodic_schedule_is_simulated():
    topology = Alternating()
    expected = stability.consensus_rate_simulated(lambda t: topology.mixing_matrix(8, t), 8, 0.5)
    assert topology.consensus_rate(8, 0.5) == pytest.approx(expected, rel=1e-12)
    assert expected < 1.0
    assert 0.0 < topology.spectral_gap(8) < 1.0
    assert topology.is_positive_semidefinite(8)


@pytest.mark.parametrize("name", ["one_peer", "two_peer"])
@pytest.mark.parametrize("n", [5, 8])
def test_exact_random_graph_gaps_match_sampled_estimates(name, n):
    exact = build_topology(name).spectral_gap(n)
    assert 0.0 < exact <= 1.0
    assert Sampled(build_topology(name)).spectral_gap(n) == pytest.approx(exact, abs=0.06)


def test_hypercube_rate_matches_the_generic_periodic_computation():
    topology = ExponentialTopology()
    matrices = [topology.mixing_matrix(16, t) for t in range(4)]
    for gamma in (0.0, 0.5, 0.9):
        for form in stability.UPDATE_FORMS:
            expected = stability.consensus_rate_periodic(matrices, gamma, form)
            assert topology.consensus_rate(16, gamma, form) == pytest.approx(expected, abs=1e-9)


# The table (docs/user_guide.md) of default outer momenta (anchored form, no overlap): independent of the code.
DOCUMENTED_DEFAULTS = {"one_peer": 0.9, "two_peer": 0.9, "ring": 0.9, "torus": 0.9, "exponential": 0.9,
                       "complete": 0.9, "local": 0.0}


def simulated_disagreement(
    topology: Topology, n: int, gamma: float, rounds: int, overlap: bool = False
) -> float:
    """||theta_T - mean|| / ||theta_0 - mean|| after ``rounds`` rounds of the anchored outer step with no
    gradients, written out from ALGORITHM.md rather than taken from stability.py:
    u = theta + gamma (theta - x); theta+ = W u (with overlap: u + (W(t-1) - I) p(t-1), p = theta+);
    x+ = (theta+ + gamma x) / (1 + gamma)."""
    theta = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theta -= theta.mean(dim=0)
    anchor, in_flight, start = theta.clone(), torch.zeros_like(theta), theta.norm()
    for t in range(rounds):
        u = theta + gamma * (theta - anchor)
        W = topology.mixing_matrix(n, t)
        if overlap:
            theta = u + in_flight
            in_flight = W @ theta - theta  # posted now, folded in next round
        else:
            theta = W @ u
        anchor = (theta + gamma * anchor) / (1.0 + gamma)
    return float((theta - theta.mean(dim=0)).norm() / start)


@pytest.mark.parametrize(("name", "n"), [case for case in CASES if case[1] in (2, 3, 4, 8, 16)])
def test_default_momentum_is_the_documented_one_and_contracts(name, n):
    topology = build_topology(name)
    gamma = topology.default_outer_momentum(n)
    assert gamma == DOCUMENTED_DEFAULTS[name]
    if name == "local":
        assert topology.max_stable_momentum(n) is None
        return
    # 300 rounds at the slowest documented rate (ring, n = 16: 0.93) shrink the disagreement by 1e-9.
    assert simulated_disagreement(topology, n, gamma, rounds=300) < 1e-4
    assert topology.is_positive_semidefinite(n)


def test_exponential_defaults_and_limits():
    """docs/user_guide.md: 0.9 up to n = 16, 0.7 from n = 32 on; the schedule's limits 0.848 (n = 32), 0.786 (n = 64)."""
    topology = ExponentialTopology()
    assert [topology.default_outer_momentum(n) for n in (16, 32, 64, 1024)] == [0.9, 0.7, 0.7, 0.7]
    assert simulated_disagreement(topology, 64, 0.7, rounds=300) < 1e-3
    assert simulated_disagreement(topology, 64, 0.82, rounds=300) > 1.0  # above the limit: it grows
    assert topology.max_stable_momentum(16) == pytest.approx(0.999)
    assert topology.max_stable_momentum(32) == pytest.approx(0.848, abs=0.01)
    assert topology.max_stable_momentum(64) == pytest.approx(0.786, abs=0.01)


def test_complete_graph_is_exact_consensus():
    topology = build_topology("complete")
    for form in stability.UPDATE_FORMS:
        assert topology.consensus_rate(8, 0.9, form) == 0.0
    assert topology.max_stable_momentum(8) == pytest.approx(0.999)


def test_unstable_default_falls_back_inside_the_stability_region():
    # lambda_min(W) = -1/2: post_mix is stable only for gamma < 1/2.
    topology = CustomTopology([(0, 1, 0.75)])
    assert not topology.is_positive_semidefinite(2)
    assert topology.max_stable_momentum(2, "post_mix") == pytest.approx(0.5, abs=2e-3)
    gamma = topology.default_outer_momentum(2, "post_mix")
    assert gamma == pytest.approx(0.45, abs=2e-3)
    assert topology.consensus_rate(2, gamma, "post_mix") < 1.0
    assert topology.default_outer_momentum(2) == 0.9


def test_rate_arguments_are_validated():
    topology = RingTopology()
    with pytest.raises(ValueError, match="outer_momentum"):
        topology.consensus_rate(8, 1.0)
    with pytest.raises(ValueError, match="form"):
        topology.consensus_rate(8, 0.5, "nesterov")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two_peer"):
        TwoPeerTopology().consensus_rate(2, 0.5)


def test_sparse_mixing_simulates_like_dense():
    """Large n simulates with sparse W; both must give the same dynamics."""
    topology = OnePeerTopology(seed=2)
    dense = stability.disagreement_trajectory(lambda t: topology.mixing_matrix(72, t), 72, 0.9, rounds=40)
    sparse = stability.disagreement_trajectory(
        lambda t: topology.mixing_matrix(72, t, sparse=True), 72, 0.9, rounds=40
    )
    torch.testing.assert_close(sparse, dense, rtol=1e-10, atol=0)


class OffByOne(Topology):
    name = "off_by_one"
    time_varying = False

    def mixing_weights(self, rank, world_size, round_index):
        return {rank + 1: 0.5}


def test_mixing_matrix_refuses_peers_outside_the_world():
    with pytest.raises(TopologyError, match="off_by_one.*outside world_size 4"):
        OffByOne().mixing_matrix(4, 0)


def test_world_size_one_has_no_peers():
    for name in NAMED:
        topology = build_topology(name)
        assert topology.mixing_weights(0, 1, 0) == {}
        torch.testing.assert_close(topology.mixing_matrix(1, 0), torch.ones(1, 1, dtype=torch.float64))


# ------------------------------------------------------------------ overlap (one-round-delayed gossip)
OVERLAP_CASES = [(name, n) for name in NAMED if name != "local" for n in valid_sizes(name, [2, 4, 8, 16])]


@pytest.mark.parametrize(("name", "n"), OVERLAP_CASES)
def test_default_overlap_momentum_is_documented_and_contracts(name, n):
    """stability.py's table: with overlap every named topology is stable up to 0.999 for n <= 16 (the
    exponential's exception is n = 64), so the default stays DiLoCo's 0.9; a direct simulation agrees."""
    topology = build_topology(name)
    assert topology.default_outer_momentum(n, overlap=True) == 0.9
    assert simulated_disagreement(topology, n, 0.9, rounds=400, overlap=True) < 1e-3
    if not topology.time_varying:  # at gamma = 0 a mode lambda contracts by lambda, as without overlap
        assert topology.consensus_rate(n, 0.0, overlap=True) == pytest.approx(topology.consensus_rate(n, 0.0),
                                                                               abs=1e-9)


@pytest.mark.parametrize(
    ("name", "n", "beta"),
    [(name, n, 0.5) for name, n in OVERLAP_CASES] + [(name, n, 0.25) for name, n in OVERLAP_CASES if n == 16],
)
def test_damped_overlap_default_momentum_is_stable_everywhere(name, n, beta):
    topology = build_topology(name)
    gamma = topology.default_outer_momentum(n, overlap=True, delayed_weight=beta)
    assert gamma == 0.9
    assert topology.consensus_rate(n, gamma, overlap=True, delayed_weight=beta) < 1.0


def test_local_topology_with_overlap():
    assert build_topology("local").consensus_rate(8, 0.5, overlap=True) == 1.0
    assert build_topology("local").default_outer_momentum(8, overlap=True) == 0.0


# ------------------------------------------------------------------ bandwidth-aware matchings
TWO_NODES = [[900.0 if (i < 4) == (j < 4) else 25.0 for j in range(8)] for i in range(8)]  # NVLink, IB


def partners(topology: Topology, n: int, round_index: int) -> list[int | None]:
    return [next(iter(topology.mixing_weights(rank, n, round_index)), None) for rank in range(n)]


@pytest.mark.parametrize("sizes", [[4, 4], [3, 3, 2], [5, 2], [3, 3, 3], [1, 1, 6], [2, 2, 2, 2], [7]])
def test_bandwidth_aware_matchings_are_symmetric_doubly_stochastic_matchings(sizes):
    n = sum(sizes)
    topology = BandwidthAwareTopology.from_clusters(sizes, slow_link_rate=0.2, seed=1)
    for t in range(40):
        W = topology.mixing_matrix(n, t)
        torch.testing.assert_close(W, W.T, rtol=0, atol=0)
        torch.testing.assert_close(W.sum(dim=1), torch.ones(n, dtype=torch.float64), rtol=0, atol=0)
        assert set(W.flatten().tolist()) <= {0.0, 0.5, 1.0}
        peers = partners(topology, n, t)
        assert all(p is None or peers[p] == i for i, p in enumerate(peers))
        sitting_out = peers.count(None)
        if topology.is_cross_round(t):
            assert sitting_out == n % 2
        else:  # fast rounds use no slow link; each odd cluster leaves one member out
            assert not any(p is not None and topology.is_slow_link(i, p) for i, p in enumerate(peers))
            assert sitting_out == sum(size % 2 for size in sizes)
    assert topology.is_positive_semidefinite(n)


def test_bandwidth_aware_peers_agree_across_ranks_without_coordination():
    """Every rank builds its own object from the same arguments and finds the same matching.

    (Across processes too: the draw is seeded by a string, hashed with sha512 whatever
    PYTHONHASHSEED is; the pinned schedule below holds in every process that runs it.)
    """
    n, rounds = 8, 50
    mine = [partners(BandwidthAwareTopology(bandwidth=TWO_NODES, seed=7), n, t) for t in range(rounds)]
    per_rank = [BandwidthAwareTopology(clusters=["a"] * 4 + ["b"] * 4, seed=7) for _ in range(n)]
    for t in range(rounds):
        assert [next(iter(per_rank[r].mixing_weights(r, n, t)), None) for r in range(n)] == mine[t]
    assert len({str(m) for m in mine}) > 5, "the matching should change from round to round"
    other_seed = BandwidthAwareTopology(bandwidth=TWO_NODES, seed=8)
    assert mine != [partners(other_seed, n, t) for t in range(rounds)]


def test_bandwidth_aware_concentrated_rounds_cross_at_the_set_rate():
    topology = BandwidthAwareTopology.from_clusters([4, 4], slow_link_rate=0.2, seed=0)
    crossings = [topology.is_cross_round(t) for t in range(2000)]
    assert sum(crossings) / len(crossings) == pytest.approx(0.2, abs=0.03)
    for t in range(20):
        peers = partners(topology, 8, t)
        assert any(topology.is_slow_link(i, p) for i, p in enumerate(peers)) == crossings[t]


@pytest.mark.parametrize("schedule", ["concentrated", "spread"])
@pytest.mark.parametrize(
    ("sizes", "rate"), [([4, 4], 0.2), ([3, 3, 2], 0.1), ([5, 2], 0.25), ([3, 3, 3], 0.2), ([4, 4], 1.0)]
)
def test_bandwidth_aware_uses_slow_links_at_the_expected_rate(sizes, rate, schedule):
    n, rounds = sum(sizes), 2000
    topology = BandwidthAwareTopology.from_clusters(sizes, slow_link_rate=rate, seed=11, schedule=schedule)
    expected = topology.expected_slow_link_rate(n)
    assert expected == pytest.approx(rate)
    def slow_share(t: int) -> float:
        peers = partners(topology, n, t)
        return sum(p is not None and topology.is_slow_link(i, p) for i, p in enumerate(peers)) / n

    per_round = torch.tensor([slow_share(t) for t in range(rounds)], dtype=torch.float64)
    sigma = max(float(per_round.std()), 1e-12) / rounds**0.5
    assert abs(float(per_round.mean()) - expected) <= 3 * sigma + 1e-12


@pytest.mark.parametrize("sizes", [[4, 4], [3, 3, 2], [5, 2], [1, 1, 1, 1, 1, 1]])
def test_bandwidth_aware_is_connected_in_expectation_with_its_exact_gap(sizes):
    n = sum(sizes)
    topology = BandwidthAwareTopology.from_clusters(sizes, slow_link_rate=0.2, seed=2)
    gap = topology.spectral_gap(n)
    assert 0.0 < gap < 1.0
    # W^T W = W for a matching: the gap is 1 - lambda_2(E[W]); compare with E[W] over 2000 rounds.
    mean_W = sum(topology.mixing_matrix(n, t) for t in range(2000)) / 2000
    sampled = 1.0 - float(stability.disagreement_eigenvalues(mean_W).max())
    assert sampled == pytest.approx(gap, abs=0.02)
    if min(sizes) > 1:  # singletons: see test_bandwidth_aware_singletons_lower_the_default
        assert topology.default_outer_momentum(n) == 0.9 and topology.consensus_rate(n, 0.9) < 1.0


@pytest.mark.slow
def test_bandwidth_aware_singletons_lower_the_default():
    """Singletons idle through every fast round while momentum keeps pushing them apart:
    gamma = 0.9 is unstable there, and the default falls back inside the region."""
    topology = BandwidthAwareTopology.from_clusters([1] * 6, slow_link_rate=0.2, seed=2)
    assert topology.consensus_rate(6, 0.9) > 1.0
    gamma = topology.default_outer_momentum(6)
    # The sampled schedule sets it: about 0.69-0.72 over seeds 0-4.
    assert 0.6 <= gamma <= 0.75 and topology.consensus_rate(6, gamma) < 1.0


@pytest.mark.parametrize(("sizes", "rate"), [([4, 4], 0.25), ([4, 4], 0.3), ([3, 3, 2], 0.2), ([4, 2, 2], 0.5),
                                             ([5, 2], 4 / 7), ([1, 1, 6], 0.5)])
def test_bandwidth_aware_spread_rounds_hold_floor_or_ceil_cross_pairs(sizes, rate):
    """Every spread round is a matching with floor(c) or ceil(c) pairs across (c = rate n / 2), the rest inside."""
    n = sum(sizes)
    topology = BandwidthAwareTopology.from_clusters(sizes, slow_link_rate=rate, seed=3, schedule="spread")
    c = rate * n / 2
    counts = []
    for t in range(300):
        W = topology.mixing_matrix(n, t)
        torch.testing.assert_close(W, W.T, rtol=0, atol=0)
        torch.testing.assert_close(W.sum(dim=1), torch.ones(n, dtype=torch.float64), rtol=0, atol=0)
        peers = partners(topology, n, t)
        assert all(p is None or peers[p] == i for i, p in enumerate(peers))
        across = sum(p is not None and topology.is_slow_link(i, p) for i, p in enumerate(peers)) // 2
        assert across in {math.floor(c + 1e-9), math.ceil(c - 1e-9)}
        assert topology.is_cross_round(t) == (across > 0)
        # inside each cluster, everyone left over pairs up but for one member of an odd remainder
        for members in topology.clusters:
            idle = [r for r in members if peers[r] is None]
            assert len(idle) <= 1
        counts.append(across)
    assert sum(counts) / len(counts) == pytest.approx(c, abs=0.1)
    gap = topology.spectral_gap(n)
    assert 0.0 < gap < 1.0  # connected in expectation


def test_bandwidth_aware_spread_with_overlap_is_stable():
    topology = BandwidthAwareTopology.from_clusters([4, 4], slow_link_rate=0.25, schedule="spread")
    assert topology.expected_slow_link_rate(8) == 0.25 and topology.cross_round_probability == 1.0
    assert topology.consensus_rate(8, 0.9, overlap=True) < 1.0


def test_bandwidth_aware_two_clusters_exact_values():
    """Two equal clusters: cross rounds pair everyone across, so q = slow_link_rate and the gap is q."""
    topology = BandwidthAwareTopology.from_clusters([4, 4], slow_link_rate=0.2)
    assert topology.cross_round_probability == pytest.approx(0.2)
    assert topology.spectral_gap(8) == pytest.approx(0.2)  # the cluster-mean mode contracts by 1 - q
    assert topology.clusters == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert repr(topology) == (
        "BandwidthAwareTopology(cluster_sizes=[4, 4], slow_link_rate=0.2, schedule='concentrated', seed=0)"
    )


def test_bandwidth_matrix_clusters():
    assert BandwidthAwareTopology(bandwidth=TWO_NODES).clusters == ((0, 1, 2, 3), (4, 5, 6, 7))
    # Links within 2x of each other are one tier: a uniform network has no slow link.
    uniform = BandwidthAwareTopology(bandwidth=[[0, 100, 90], [100, 0, 110], [90, 110, 0]])
    assert uniform.clusters == ((0, 1, 2),) and uniform.expected_slow_link_rate(3) == 0.0
    assert uniform.spectral_gap(3) == pytest.approx(OnePeerTopology().spectral_gap(3))
    labelled = BandwidthAwareTopology(clusters=["host-b", "host-a", "host-b", "host-a"])
    assert labelled.clusters == ((0, 2), (1, 3)) and labelled.is_slow_link(0, 1)
    assert "bandwidth_aware" in TOPOLOGIES and TOPOLOGIES["bandwidth_aware"] is BandwidthAwareTopology


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bandwidth": [[0, 10], [20, 0]]}, "symmetric"),
        ({"bandwidth": [[0, 0], [0, 0]]}, "> 0"),
        ({"bandwidth": [[0, -1], [-1, 0]]}, "> 0"),
        ({"bandwidth": [[0, float("nan")], [float("nan"), 0]]}, "> 0"),
        ({"bandwidth": [[0, 1, 1], [1, 0, 1]]}, "square"),
        ({"bandwidth": [[0, 9, 9], [9, 0, 1], [9, 1, 0]]}, "do not form clusters"),
        ({}, "exactly one"),
        ({"bandwidth": TWO_NODES, "clusters": [0] * 8}, "exactly one"),
        ({"clusters": []}, "clusters"),
        ({"clusters": [0, 0, 1, 1], "slow_link_rate": 0.0}, "slow_link_rate"),
        ({"clusters": [0, 0, 1, 1], "slow_link_rate": -0.1}, "slow_link_rate"),
        ({"clusters": [0, 0, 1, 1], "slow_link_rate": 1.5}, "slow_link_rate"),
        ({"clusters": [0, 0, 1, 1], "slow_link_rate": float("nan")}, "slow_link_rate"),
        ({"clusters": [0, 0, 0, 0, 0, 0, 1, 1], "slow_link_rate": 0.9}, "at most 0.5"),
        ({"clusters": [0, 1], "seed": "0"}, "seed"),
        ({"clusters": [0, 0, 1, 1], "schedule": "bursty"}, "schedule must be one of"),
        ({"clusters": [0, 0, 0, 0, 0, 0, 1, 1], "slow_link_rate": 0.6, "schedule": "spread"}, "at most 0.5"),
    ],
)
def test_bandwidth_aware_validation(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        BandwidthAwareTopology(**kwargs)


def test_bandwidth_aware_world_size_and_sizes_are_checked():
    topology = BandwidthAwareTopology.from_clusters([4, 4])
    for wrong in (4, 9):
        with pytest.raises(TopologyError, match="built for world_size 8"):
            topology.check_world_size(wrong)
        with pytest.raises(TopologyError, match="built for world_size 8"):
            topology.mixing_weights(0, wrong, 0)
        with pytest.raises(TopologyError, match="built for world_size 8"):
            topology.consensus_rate(wrong, 0.5)
        with pytest.raises(TopologyError, match="built for world_size 8"):
            topology.expected_slow_link_rate(wrong)
    for sizes in ([], [4, 0], [2.5], "44"):
        with pytest.raises(TopologyError, match="sizes"):
            BandwidthAwareTopology.from_clusters(sizes)  # type: ignore[arg-type]
    single = BandwidthAwareTopology.from_clusters([1])
    assert single.mixing_weights(0, 1, 0) == {} and single.spectral_gap(1) == 1.0


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate-matchings"]:
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(_draw_fixture(), separators=(",", ":")) + "\n")


def test_bandwidth_aware_clusters_scale_with_the_network():
    """A preset's clusters scaled to the run's workers, as the network scales its own (topology=bandwidth_aware
    with network=two_clusters at sim.workers=64 pairs 32 + 32 ranks, not the preset's 4 + 4)."""
    from gasloc_lightning.network import scaled_sizes

    for sizes, n in (([4, 4], 64), ([4, 2, 2], 16), ([2, 2, 2, 2], 10)):
        topology = BandwidthAwareTopology.from_clusters(sizes, scale_to=n)
        assert list(topology.cluster_sizes) == scaled_sizes(sizes, n)
        assert sum(topology.cluster_sizes) == n
    assert list(BandwidthAwareTopology.from_clusters([4, 4], scale_to=None).cluster_sizes) == [4, 4]
    with pytest.raises(TopologyError, match="cannot hold"):
        BandwidthAwareTopology.from_clusters([4, 2, 2], scale_to=2)
