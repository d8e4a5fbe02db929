"""Network model and simulated clock: hand-computed costs, clock rules, determinism, bad configs."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gasloc_lightning.network import NetworkModel, SimulatedClock, Throttle, round_pairs
from gasloc_lightning.topology import OnePeerTopology, TwoPeerTopology

N = 4e9  # the default modelled message: 1e9 parameters x 4 bytes (fp32)
INTRA = 100 / 8 * 1e9  # 100 Gbit/s = 12.5e9 bytes/s
INTER = 1 / 8 * 1e9  # 1 Gbit/s = 1.25e8 bytes/s


def two_clusters(**overrides) -> NetworkModel:
    """Two data centres of 4 workers: 100 Gbit/s and 1 ms inside, 1 Gbit/s and 30 ms between."""
    kwargs = dict(sizes=[4, 4], intra_gbps=100, intra_latency_s=1e-3, inter_gbps=1, inter_latency_s=0.03)
    return NetworkModel.clusters(**{**kwargs, **overrides})


def clocks_of(network: NetworkModel) -> list[SimulatedClock]:
    return [SimulatedClock(network, rank=r) for r in range(network.world_size)]


def post_all(clocks: list[SimulatedClock]) -> list[float]:
    """Every rank posts its exchange; each gets back the clock it sends with its payload."""
    return [c.post_exchange() for c in clocks]


def complete_all(clocks: list[SimulatedClock], pairs: list[tuple[int, int]], posted: list[float]) -> None:
    """Every rank completes with the posted clocks of its peers (as n processes would receive them)."""
    for rank, clock in enumerate(clocks):
        peers = {j if i == rank else i: posted[j if i == rank else i] for i, j in pairs if rank in (i, j)}
        clock.complete_exchange(peer_clocks=peers, pairs=pairs)


def gossip_round(clocks: list[SimulatedClock], pairs: list[tuple[int, int]]) -> None:
    """A blocking exchange round."""
    complete_all(clocks, pairs, post_all(clocks))


# ---------------------------------------------------------------------- units and compute
def test_units_message_bytes_and_step_time():
    network = NetworkModel.uniform(world_size=3, bandwidth_gbps=100, latency_s=1e-3, speeds=[1, 2, 0.5])
    assert network.link(0, 2) == (INTRA, 1e-3)
    assert network.message_bytes() == N
    assert network.message_bytes(element_size=2) == N / 2  # bf16 messages
    # step_time_s / speed: 0.5 / 1, 0.5 / 2, 0.5 / 0.5
    assert [network.step_time(r) for r in range(3)] == [0.5, 0.25, 1.0]
    assert [network.cluster_of(r) for r in range(3)] == [0, 0, 0]


def test_clusters_by_blocks_or_assignment():
    blocks = two_clusters()
    assigned = NetworkModel.clusters(
        assignment=[0, 1, 0, 1], intra_gbps=100, intra_latency_s=0.0, inter_gbps=1, inter_latency_s=0.03
    )
    assert [blocks.cluster_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert assigned.link(0, 2) == (INTRA, 0.0)
    assert assigned.link(0, 1) == (INTER, 0.03)


def test_auto_inner_steps_are_proportional_to_speed():
    network = NetworkModel.uniform(world_size=4, bandwidth_gbps=10, latency_s=0.0, speeds=[1, 1, 0.5, 0.25])
    assert network.auto_inner_steps(20) == [20, 20, 10, 5]
    assert network.auto_inner_steps(2) == [2, 2, 1, 1]  # at least one step each


# ---------------------------------------------------------------------- costs
def test_pairwise_time_has_latency_plus_transfer():
    network = two_clusters()
    # inside a cluster: 1 ms + 4e9 B / 12.5e9 B/s = 0.001 + 0.32
    assert network.pairwise_time(0, 1, N) == pytest.approx(0.321)
    # across: 30 ms + 4e9 B / 1.25e8 B/s = 0.03 + 32
    assert network.pairwise_time(0, 4, N) == pytest.approx(32.03)


def test_ring_all_reduce_on_two_clusters():
    # 2 (8 - 1) = 14 steps of 4e9 / 8 = 5e8 B; the slowest ring link is the inter-cluster one:
    # 14 x (0.03 + 5e8 / 1.25e8) = 14 x 4.03 = 56.42
    assert two_clusters().ring_all_reduce_time(N) == pytest.approx(56.42)


def test_hierarchical_all_reduce_on_two_clusters():
    # inside, each way: (4 - 1) steps of 4e9 / 4 = 1e9 B: 3 x (0.001 + 1e9 / 12.5e9) = 3 x 0.081 = 0.243
    # across: ring over 2 clusters, 2 (2 - 1) = 2 steps of 4e9 / 2 = 2e9 B: 2 x (0.03 + 16) = 32.06
    # total: 0.243 (reduce-scatter) + 32.06 + 0.243 (all-gather) = 32.546
    network = two_clusters()
    assert network.hierarchical_all_reduce_time(N) == pytest.approx(32.546)
    assert network.all_reduce_time(N) == pytest.approx(32.546)


def test_all_reduce_takes_the_cheaper_algorithm():
    # Two clusters of 2, every link 8 Gbit/s = 1e9 B/s, no latency:
    # ring: 2 (4 - 1) = 6 steps of 1e9 B = 6 s
    # hierarchical: 1 step of 2e9 B each way inside (2 x 2 s) + 2 steps of 2e9 B across (4 s) = 8 s
    network = NetworkModel.clusters(sizes=[2, 2], intra_gbps=8, intra_latency_s=0.0, inter_gbps=8, inter_latency_s=0.0)
    assert network.ring_all_reduce_time(N) == pytest.approx(6.0)
    assert network.hierarchical_all_reduce_time(N) == pytest.approx(8.0)
    assert network.all_reduce_time(N) == pytest.approx(6.0)
    # One cluster: both are the same ring, 2 x 3 steps of 1e9 B / 12.5e9 B/s = 0.48 s.
    uniform = NetworkModel.uniform(world_size=4, bandwidth_gbps=100, latency_s=0.0)
    assert uniform.ring_all_reduce_time(N) == pytest.approx(0.48)
    assert uniform.hierarchical_all_reduce_time(N) == pytest.approx(0.48)
    assert uniform.ring_all_reduce_time(N, ranks=[2]) == 0.0


def test_matrix_links_are_dedicated():
    bandwidth = [[0, 8, 80], [8, 0, 8], [80, 8, 0]]  # diagonal unused
    latency = [[0, 0.1, 0.0], [0.1, 0, 0.1], [0.0, 0.1, 0]]
    network = NetworkModel.from_matrix(bandwidth_gbps=bandwidth, latency_s=latency)
    assert network.link(2, 0) == (1e10, 0.0)
    assert network.shared_link_flows([(0, 1), (1, 2)]) == {(0, 1): 1, (1, 2): 1}
    # ring 0-1-2: 4 steps over the slowest link, 0.1 + (4e9 / 3) / 1e9
    assert network.ring_all_reduce_time(N) == pytest.approx(4 * (0.1 + 4 / 3))


# ---------------------------------------------------------------------- the clock
def test_shared_inter_cluster_link_halves_bandwidth():
    network = two_clusters()
    pairs = [(0, 4), (5, 1), (2, 3), (6, 7)]  # two exchanges cross the one inter-cluster link
    assert network.shared_link_flows(pairs) == {(0, 1): 2}
    assert network.concurrent_flows(pairs) == {(0, 4): 2, (1, 5): 2, (2, 3): 1, (6, 7): 1}
    clocks = clocks_of(network)
    gossip_round(clocks, pairs)
    # across: 0.03 + 4e9 B / (1.25e8 B/s / 2) = 64.03; inside: 0.321
    assert [c.time for c in clocks] == pytest.approx([64.03, 64.03, 0.321, 0.321, 64.03, 64.03, 0.321, 0.321])


def test_two_peers_share_a_nic_and_finish_at_the_later_exchange():
    network = NetworkModel.uniform(world_size=4, bandwidth_gbps=100, latency_s=0.0)
    pairs = [(0, 1), (1, 2), (2, 3), (0, 3)]  # a ring: every rank sends two messages at once
    clock = SimulatedClock(network, rank=1)
    # each exchange: 4e9 B / (12.5e9 B/s / 2) = 0.64 s, starting when both ends are ready
    end = clock.exchange(peer_clocks={0: 1.0, 2: 3.0}, pairs=pairs)
    assert end == pytest.approx(max(1.0 + 0.64, 3.0 + 0.64))


def test_straggler_doubles_compute_and_makes_its_peer_wait():
    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=100, latency_s=0.0, speeds=[1.0, 0.5])
    fast, slow = clocks_of(network)
    assert fast.advance_compute(10) == pytest.approx(5.0)  # 10 x 0.5 s
    assert slow.advance_compute(10) == pytest.approx(10.0)  # 10 x 0.5 s / 0.5
    gossip_round([fast, slow], [(0, 1)])
    # both start at max(5, 10) = 10 and take 4e9 / 12.5e9 = 0.32 s
    assert fast.time == slow.time == pytest.approx(10.32)
    assert fast.time - fast.compute_time == pytest.approx(5.32)  # 5 s waiting + 0.32 s sending


def test_overlap_hides_communication_under_compute():
    for inter_gbps, expected in ((100, 50.0), (1, 25.0 + 32.03)):
        network = NetworkModel.clusters(
            sizes=[1, 1], intra_gbps=100, intra_latency_s=0.0, inter_gbps=inter_gbps, inter_latency_s=0.03
        )
        clocks = clocks_of(network)
        for c in clocks:
            c.advance_compute(50)  # 50 x 0.5 s = 25 s, then post the exchange
        posted = post_all(clocks)
        for c in clocks:
            assert c.pending
            c.advance_compute(50)  # the next round computes while the exchange runs
        complete_all(clocks, [(0, 1)], posted)
        # fast link: max(50, 25 + 0.03 + 0.32) = 50; slow: max(50, 25 + 0.03 + 32) = 57.03
        assert [c.time for c in clocks] == pytest.approx([expected, expected])


def test_all_reduce_starts_at_the_largest_clock():
    network = two_clusters(speeds=[1, 1, 1, 1, 1, 1, 1, 0.5])
    clocks = clocks_of(network)
    for c, steps in zip(clocks, network.auto_inner_steps(50)):
        c.advance_compute(steps)  # 25 s everywhere, the straggler took 25 steps at 1 s
    largest = max(c.time for c in clocks)
    ends = [c.all_reduce(max_clock=largest) for c in clocks]
    assert ends == [ends[0]] * 8
    assert ends[0] == pytest.approx(25.0 + 32.546)


def test_ddp_step_waits_for_the_slowest_worker_then_all_reduces():
    network = NetworkModel.uniform(world_size=4, bandwidth_gbps=100, latency_s=0.0, speeds=[1, 1, 1, 0.5])
    clock = SimulatedClock(network, rank=0)
    # slowest step 0.5 / 0.5 = 1 s, then a ring all-reduce of 6 x (1e9 / 12.5e9) = 0.48 s
    assert clock.ddp_step() == pytest.approx(1.48)
    assert clock.ddp_step(nbytes=N / 2) == pytest.approx(1.48 + 1.24)  # bf16 gradients
    assert clock.compute_time == pytest.approx(1.0)


def simulate_one_peer(rounds: int = 20) -> list[list[float]]:
    network = NetworkModel.clusters(
        sizes=[2, 3, 3], intra_gbps=[100, 25, 10], intra_latency_s=1e-4,
        inter_gbps=[[0, 10, 1], [10, 0, 2], [1, 2, 0]],
        inter_latency_s=[[0, 0.01, 0.05], [0.01, 0, 0.08], [0.05, 0.08, 0]],
        speeds=[1, 1, 1, 0.7, 1, 0.5, 1, 1],
    )  # fmt: skip
    topology, clocks, history = OnePeerTopology(seed=3), clocks_of(network), []
    steps = network.auto_inner_steps(20)
    for t in range(rounds):
        for c, h in zip(clocks, steps):
            c.advance_compute(h)
        pairs = round_pairs(topology, network.world_size, t)
        gossip_round(clocks, pairs)
        history.append([c.time for c in clocks])
        for i, j in pairs:  # both ends of an exchange agree on when it ended
            assert clocks[i].time == clocks[j].time
    return history


def test_clock_is_deterministic_across_runs():
    assert simulate_one_peer() == simulate_one_peer()


def test_clock_state_dict_resumes_exactly():
    network = two_clusters(speeds=[1, 0.5, 1, 1, 1, 1, 1, 1])
    clock = SimulatedClock(network, rank=1)
    clock.advance_compute(7)
    clock.post_exchange()
    clock.advance_compute(3)
    resumed = SimulatedClock(network, rank=1)
    resumed.load_state_dict(clock.state_dict())
    for c in (clock, resumed):
        c.complete_exchange(peer_clocks={0: 2.0}, pairs=[(0, 1)])
        c.advance_compute(5)
    assert resumed.state_dict() == clock.state_dict()
    with pytest.raises(ValueError, match="rank"):
        SimulatedClock(network, rank=0).load_state_dict(clock.state_dict())


def test_round_pairs_are_the_topology_edges():
    pairs = round_pairs(OnePeerTopology(seed=1), 8, 0)
    assert len(pairs) == 4 and sorted(r for p in pairs for r in p) == list(range(8))
    degrees = [sum(r in p for p in round_pairs(TwoPeerTopology(seed=1), 6, 2)) for r in range(6)]
    assert degrees == [2] * 6


def test_clock_misuse_is_an_error():
    network = two_clusters()
    clock = SimulatedClock(network, rank=0)
    with pytest.raises(ValueError, match="no exchange is pending"):
        clock.complete_exchange(peer_clocks={}, pairs=[])
    clock.post_exchange()
    with pytest.raises(ValueError, match="already pending"):
        clock.post_exchange()
    with pytest.raises(ValueError, match="pairs has no exchange"):
        clock.complete_exchange(peer_clocks={4: 0.0}, pairs=[(0, 5)])
    with pytest.raises(ValueError, match="steps"):
        clock.advance_compute(-1)
    with pytest.raises(ValueError, match="rank"):
        SimulatedClock(network, rank=8)


def test_sitting_out_leaves_the_clock_alone():
    clock = SimulatedClock(two_clusters(), rank=7)
    clock.advance_compute(2)
    assert clock.exchange(peer_clocks={}, pairs=[(0, 1)]) == 1.0


# ---------------------------------------------------------------------- bad configs
def uniform(**overrides) -> NetworkModel:
    return NetworkModel.uniform(**{**dict(world_size=4, bandwidth_gbps=10, latency_s=0.01), **overrides})


BAD_CONFIGS = {
    "bandwidth zero": (lambda: uniform(bandwidth_gbps=0), "bandwidth_gbps"),
    "bandwidth negative": (lambda: two_clusters(inter_gbps=-1), r"bandwidth_gbps\[0\]\[1\]"),
    "latency negative": (lambda: uniform(latency_s=-0.1), "latency_s"),
    "speed zero": (lambda: uniform(speeds=[1, 0, 1, 1]), r"speeds\[1\]"),
    "speeds too few": (lambda: uniform(speeds=[1, 1]), "speeds"),
    "matrix wrong size": (
        lambda: NetworkModel.from_matrix(bandwidth_gbps=[[0, 1], [1, 0]], latency_s=[[0, 0, 0], [0, 0, 0]]),
        "latency_s must be a 2 x 2",
    ),
    "matrix ragged": (
        lambda: NetworkModel.from_matrix(bandwidth_gbps=[[0, 1], [1]], latency_s=[[0, 0], [0, 0]]),
        "bandwidth_gbps must be a 2 x 2",
    ),
    "matrix asymmetric": (
        lambda: NetworkModel.from_matrix(bandwidth_gbps=[[0, 1], [2, 0]], latency_s=[[0, 0], [0, 0]]),
        "bandwidth_gbps must be symmetric",
    ),
    "inter table wrong size": (lambda: two_clusters(inter_gbps=[[1, 1, 1]] * 3), "inter_gbps"),
    "cluster sizes vs world_size": (lambda: two_clusters(world_size=6), "world_size=6"),
    "cluster size zero": (lambda: two_clusters(sizes=[4, 0]), r"sizes\[1\]"),
    "sizes and assignment": (lambda: two_clusters(assignment=[0, 1]), "exactly one of sizes"),
    "assignment with a gap": (lambda: two_clusters(sizes=None, assignment=[0, 2]), "assignment"),
    "step time zero": (lambda: uniform(step_time_s=0), "step_time_s"),
    "model parameters": (lambda: uniform(model_parameters=1.5e9), "model_parameters"),
    "world size zero": (lambda: uniform(world_size=0), "world_size"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_network_config_fails_at_construction(case):
    build, message = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        build()


def test_world_size_mismatch_is_caught_before_training():
    with pytest.raises(ValueError, match="describes 8 workers but the run has world_size=4"):
        two_clusters().check_world_size(4)


def test_built_from_a_yaml_node():
    node = OmegaConf.create(
        {
            "_target_": "gasloc_lightning.network.NetworkModel.clusters",
            "sizes": [4, 4],
            "intra_gbps": 100,
            "intra_latency_s": 1e-3,
            "inter_gbps": 1,
            "inter_latency_s": 0.03,
            "speeds": [1, 1, 1, 1, 1, 1, 1, 0.5],
        }
    )
    network = instantiate(node)
    assert network.all_reduce_time(N) == pytest.approx(32.546)
    assert network.step_time(7) == 1.0


def test_throttle_sleeps_scale_times_the_time_off_compute():
    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=8.0, latency_s=0.5, model_parameters=250_000_000,
                                   bytes_per_parameter=4, step_time_s=1.0, throttle=0.01)  # 1 GB: 1 s + 0.5 s
    clock, slept = SimulatedClock(network, rank=0), []
    throttle = Throttle(clock, network.throttle, sleep=slept.append)
    clock.advance_compute(2)
    assert throttle() == 0.0 and slept == []  # compute is never slept
    clock.exchange(peer_clocks={1: 2.0}, pairs=[(0, 1)])
    assert clock.time == pytest.approx(3.5)
    assert throttle() == pytest.approx(0.015) and slept == [pytest.approx(0.015)]
    # Overlapped: posted, then 1 s of compute hides 1 of its 1.5 s; only 0.5 s is slept for.
    clock.post_exchange()
    clock.advance_compute(1)
    clock.complete_exchange(peer_clocks={1: 3.5}, pairs=[(0, 1)])
    assert throttle() == pytest.approx(0.005) and throttle.slept == pytest.approx(0.02)
    clock.advance_compute(1)
    assert throttle() == 0.0 and len(slept) == 2


def test_throttle_off_never_sleeps_and_must_not_be_negative():
    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=1.0, latency_s=0.1)
    clock = SimulatedClock(network, rank=0)
    throttle = Throttle(clock, network.throttle, sleep=lambda s: pytest.fail("slept"))
    clock.exchange(peer_clocks={1: 0.0}, pairs=[(0, 1)])
    assert network.throttle == 0.0 and throttle() == 0.0
    with pytest.raises(ValueError, match="throttle"):
        NetworkModel.uniform(world_size=2, bandwidth_gbps=1.0, latency_s=0.1, throttle=-1.0)
