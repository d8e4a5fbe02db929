"""Two-level mixing (topology/regions.py) against float64 oracles on quadratics: the matrices' properties,
the two reductions (one region: DiLoCo; one worker per region: GASLoC on the regions' graph), the mean,
identical region members, region validation, and the stability of the schedule."""

from __future__ import annotations

import pytest
import torch

from gasloc_lightning.algorithm import stability
from gasloc_lightning.topology.base import TopologyError
from gasloc_lightning.topology.fixed import CompleteTopology, RingTopology
from gasloc_lightning.topology.random_graphs import OnePeerTopology
from gasloc_lightning.topology.regions import Regions, TwoLevelTopology

F64 = torch.float64
LAYOUTS = [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 2, 3], ["a", "a", "a", "b", "b", "b", "b", "b"],
           [0, 0, 0, 0, 1, 1, 1, 1], [2, 0, 1, 1, 0, 2, 2, 0]]


class Quadratics:
    """Worker i minimises (1/2)(theta - c_i)^T A_i (theta - c_i) with H steps of gradient descent (float64)."""

    def __init__(self, workers: int, dim: int = 6, shared_hessian: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        def spd():  # noqa: E306
            q = torch.randn(dim, dim, generator=g, dtype=F64)
            return q @ q.T / dim + 0.2 * torch.eye(dim, dtype=F64)
        shared = spd()
        self.hessians = torch.stack([shared if shared_hessian else spd() for _ in range(workers)])  # (n, d, d)
        self.centres = torch.randn(workers, dim, generator=g, dtype=F64)  # (n, d)

    def local(self, theta: torch.Tensor, steps: int = 5, lr: float = 0.1) -> torch.Tensor:
        """thetaH of every worker from its own theta (n, d)."""
        for _ in range(steps):
            theta = theta - lr * torch.einsum("nij,nj->ni", self.hessians, theta - self.centres)
        return theta


def outer_round(theta, anchor, theta_h, W, eta, gamma):
    """The anchored outer step on stacked workers (docs/algorithm.md section 1), float64."""
    z = theta + eta * (theta_h - theta)
    u = z + gamma * (z - anchor)
    new_theta = W @ u
    return new_theta, z + (new_theta - u) / (1 + gamma)


def run(quadratics, matrices, eta=0.7, gamma=0.9, start=None):
    n, d = quadratics.centres.shape
    theta = (torch.zeros(d, dtype=F64) if start is None else start).expand(n, d).clone()
    anchor, trajectory = theta.clone(), []
    for W in matrices:
        theta, anchor = outer_round(theta, anchor, quadratics.local(theta), W, eta, gamma)
        trajectory.append((theta.clone(), anchor.clone()))
    return trajectory


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("region_topology", [OnePeerTopology(seed=3), RingTopology(), CompleteTopology()],
                         ids=lambda t: t.name)
def test_every_round_is_symmetric_doubly_stochastic_and_positive_semidefinite(layout, region_topology):
    topology = TwoLevelTopology(layout, cross_every=2, region_topology=region_topology)
    n = len(layout)
    B = topology.regions.average_matrix()
    assert torch.allclose(B @ B, B, atol=1e-15)  # a projection
    for t in range(8):
        W = topology.mixing_matrix(n, t)
        assert torch.equal(W, W.T)
        assert bool((W >= 0).all())
        assert torch.allclose(W.sum(dim=0), torch.ones(n, dtype=F64), atol=1e-14)
        assert float(torch.linalg.eigvalsh(W).min()) >= -1e-12
        C = topology.cross_matrix(t)
        assert torch.allclose(W, B @ C @ B, atol=1e-15)
        assert topology.is_cross_round(t) == (t % 2 == 1)
        if not topology.is_cross_round(t):
            assert torch.equal(W, B) and torch.equal(C, torch.eye(n, dtype=F64))
        weights = topology.mixing_weights(0, n, t)  # what a pairwise engine would apply: the same row
        assert weights == {j: float(W[0, j]) for j in range(1, n) if W[0, j] != 0}


def test_rank_l_of_one_region_pairs_with_rank_l_of_the_other():
    regions = Regions(["x", "y", "x", "y", "y", "x", "y"])  # x: ranks 0 2 5, y: 1 3 4 6
    assert regions.names == ("x", "y") and regions.members == ((0, 2, 5), (1, 3, 4, 6))
    assert [regions.region_of(r) for r in range(7)] == [0, 1, 0, 1, 1, 0, 1]
    assert [regions.local_index(r) for r in range(7)] == [0, 0, 1, 1, 2, 2, 3]
    topology = TwoLevelTopology(regions, cross_every=1, region_topology=CompleteTopology())
    assert topology.cross_peers(2, 0) == {3: 0.5} and topology.cross_peers(5, 0) == {4: 0.5}
    assert topology.cross_peers(6, 0) == {}  # the larger region's extra rank keeps its weight
    assert TwoLevelTopology(regions, cross_every=3).cross_peers(2, 0) == {}  # a region round


@pytest.mark.parametrize("gamma", [0.0, 0.9])
@pytest.mark.parametrize("n", [4, 8])
def test_one_region_is_diloco(n, gamma):
    """One region: W = (1/n) 1 1^T in every round, region or cross: DiLoCo's Nesterov SGD on the mean Delta."""
    topology = TwoLevelTopology([7] * n, cross_every=3)
    quadratics = Quadratics(n, seed=n)
    for t in range(6):
        assert torch.allclose(topology.mixing_matrix(n, t), torch.full((n, n), 1 / n, dtype=F64), atol=1e-15)
    trajectory = run(quadratics, [topology.mixing_matrix(n, t) for t in range(30)], gamma=gamma)
    reference = torch.nn.Parameter(torch.zeros(quadratics.centres.shape[1], dtype=F64))
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=gamma, nesterov=gamma > 0)
    for theta, _ in trajectory:
        theta_h = quadratics.local(reference.detach().expand(n, -1))
        reference.grad = reference.detach() - theta_h.mean(dim=0)
        sgd.step()
        scale = float(reference.detach().abs().max())
        assert float((theta - reference.detach()).abs().max()) <= 1e-12 * scale  # every replica is DiLoCo's point


@pytest.mark.parametrize("cross_every", [1, 3])
@pytest.mark.parametrize("region_topology", [OnePeerTopology(seed=5), RingTopology()], ids=lambda t: t.name)
@pytest.mark.parametrize("n", [4, 8])
def test_one_worker_per_region_is_gasloc_on_the_regions_graph(n, region_topology, cross_every):
    """B = I, so B C B = C: the cross rounds are the region topology's own W, the others exchange nothing."""
    topology = TwoLevelTopology(list(range(n)), cross_every=cross_every, region_topology=region_topology)
    identity = torch.eye(n, dtype=F64)
    assert torch.equal(topology.regions.average_matrix(), identity)
    matrices = []
    for t in range(12):
        W = topology.mixing_matrix(n, t)
        expected = region_topology.mixing_matrix(n, t // cross_every) if (t + 1) % cross_every == 0 else identity
        assert torch.equal(W, expected)
        matrices.append(expected)
    quadratics = Quadratics(n, seed=1)
    for (a, x), (b, y) in zip(run(quadratics, [topology.mixing_matrix(n, t) for t in range(12)]),
                              run(quadratics, matrices)):
        assert torch.equal(a, b) and torch.equal(x, y)


@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 2, 2, 2, 0, 1]], ids=str)
def test_under_any_mix_of_rounds_the_mean_follows_diloco(layout):
    """Shared Hessian: each worker's thetaH is affine in its theta with the same slope, so the mean of the
    replicas follows DiLoCo's trajectory exactly, whatever the disagreement; any order of region and cross rounds."""
    n = len(layout)
    regions = Regions(layout)
    B = regions.average_matrix()
    quadratics = Quadratics(n, shared_hessian=True, seed=2)
    g = torch.Generator().manual_seed(7)
    matrices = []
    for t in range(40):  # a random mix: region rounds and cross rounds of random region matchings
        if bool(torch.rand((), generator=g) < 0.4):
            matrices.append(B @ regions.lift(OnePeerTopology(seed=t).mixing_matrix(regions.num_regions, t)) @ B)
        else:
            matrices.append(B)
    start = torch.randn(quadratics.centres.shape[1], generator=g, dtype=F64)
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    spread = 0.0
    for theta, _ in run(quadratics, matrices, start=start):
        reference.grad = reference.detach() - quadratics.local(reference.detach().expand(n, -1)).mean(dim=0)
        sgd.step()
        scale = float(reference.detach().abs().max())
        assert float((theta.mean(dim=0) - reference.detach()).abs().max()) <= 1e-12 * scale
        spread = max(spread, float((theta - theta.mean(dim=0)).abs().max()))
    assert spread > 1e-3  # the replicas did disagree: the test is not DiLoCo in disguise


def test_with_any_hessians_the_mean_takes_diloco_s_outer_step():
    """Different Hessians: the mean of the replicas takes DiLoCo's outer step on the workers' own Delta_i."""
    regions = Regions([0, 0, 0, 0, 1, 1, 1, 1])
    topology = TwoLevelTopology(regions, cross_every=2)
    quadratics = Quadratics(8, seed=3)
    theta = torch.zeros(8, 6, dtype=F64)
    anchor = theta.clone()
    for t in range(12):
        theta_h = quadratics.local(theta)
        z_mean = (theta + 0.7 * (theta_h - theta)).mean(dim=0)
        expected = z_mean + 0.9 * (z_mean - anchor.mean(dim=0))
        theta, anchor = outer_round(theta, anchor, theta_h, topology.mixing_matrix(8, t), 0.7, 0.9)
        assert torch.allclose(theta.mean(dim=0), expected, rtol=0, atol=1e-12)
        assert torch.allclose(anchor.mean(dim=0), z_mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], ["p", "q", "p", "r", "q", "p", "r", "r"]],
                         ids=str)
def test_after_a_region_round_the_members_of_a_region_are_identical(layout):
    n = len(layout)
    topology = TwoLevelTopology(layout, cross_every=3)
    quadratics = Quadratics(n, seed=4)
    trajectory = run(quadratics, [topology.mixing_matrix(n, t) for t in range(10)])  # ends on a region round
    for theta, anchor in trajectory:  # every round ends with B: region and cross rounds alike
        for members in topology.regions.members:
            for state in (theta, anchor):
                rows = state[list(members)]
                assert float((rows - rows[0]).abs().max()) <= 1e-14 * float(rows.abs().max())
    different = trajectory[-1][0]
    assert float((different - different.mean(dim=0)).abs().max()) > 1e-3  # regions themselves still differ


def cross_region_disagreement(cross_every, gamma, mix_anchor, rounds=200):
    """No gradients (eta = 1, thetaH = theta): two regions of 2, fully averaged at every crossing; returns the
    final disagreement of (theta, x), the initial one being 1. ``mix_anchor``: cross rounds set x' = W z (the fix)."""
    topology = TwoLevelTopology([0, 0, 1, 1], cross_every=cross_every, region_topology=CompleteTopology())
    theta = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]], dtype=F64)
    anchor = theta.clone()
    for t in range(rounds):
        W = topology.mixing_matrix(4, t)
        u = theta + gamma * (theta - anchor)  # z = theta
        z, theta = theta, W @ u
        anchor = W @ z if (mix_anchor and topology.is_cross_round(t)) else z + (theta - u) / (1 + gamma)
    return max(float((state - state.mean()).abs().max()) for state in (theta, anchor))  # theta alone is 0 after one


def test_rare_crossings_with_full_momentum_are_unstable_and_the_stability_check_sees_it():
    """Between crossings each region runs DiLoCo's momentum alone; the anchors' disagreement survives a crossing
    (x' keeps gamma / (1 + gamma) of it) and grows in the next K - 1 rounds. At gamma = 0.9 that diverges from
    K = 5 on: the stability machinery gives the limits, and mixing the anchors at crossings (x' = W z) fixes it."""
    assert cross_region_disagreement(1, 0.9, mix_anchor=False) < 1e-12
    assert cross_region_disagreement(5, 0.9, mix_anchor=False) > 100  # grows: 132 after 200 rounds (1.029 per round)
    assert cross_region_disagreement(10, 0.9, mix_anchor=True) < 1e-12  # each mode: lambda * M(1)
    rates = {K: TwoLevelTopology([0, 0, 0, 0, 1, 1, 1, 1], cross_every=K, region_topology=CompleteTopology())
             .consensus_rate(8, 0.9) for K in (1, 2, 5, 10)}
    assert rates[1] == 0.0 and rates[2] == 0.0
    assert rates[5] == pytest.approx(1.0293, abs=1e-4) and rates[10] == pytest.approx(1.0928, abs=1e-4)
    limit = TwoLevelTopology([0, 0, 0, 0, 1, 1, 1, 1], cross_every=5,
                             region_topology=CompleteTopology()).max_stable_momentum(8)
    assert limit == pytest.approx(0.848, abs=2e-3)
    # the same rate from the per-mode matrices: the cross-region mode sees lambda = 1 for K - 1 rounds, then 0
    product = stability.mode_matrix(0.0, 0.9) @ torch.linalg.matrix_power(stability.mode_matrix(1.0, 0.9), 4)
    assert float(torch.linalg.eigvals(product).abs().max()) ** (1 / 5) == pytest.approx(rates[5], abs=1e-9)


def test_regions_from_sizes_and_bandwidth():
    assert Regions.from_sizes([3, 1]).members == ((0, 1, 2), (3,))
    fast, slow = 100.0, 1.0
    bandwidth = [[0, fast, slow, slow], [fast, 0, slow, slow], [slow, slow, 0, fast], [slow, slow, fast, 0]]
    assert Regions.from_bandwidth(bandwidth).members == ((0, 1), (2, 3))


@pytest.mark.parametrize("assignment", [[], "aabb", None, [0, None], [0, 1.5], [True, False], [0, ""], [[0], [1]]])
def test_bad_region_assignments_are_refused_by_name(assignment):
    with pytest.raises(TopologyError, match="regions"):
        Regions(assignment)


def test_bad_two_level_arguments_are_refused_by_name():
    with pytest.raises(TopologyError, match="cross_every"):
        TwoLevelTopology([0, 1], cross_every=0)
    with pytest.raises(TopologyError, match="region_topology"):
        TwoLevelTopology([0, 1], region_topology=3)  # a name ("ring") or a Topology
    with pytest.raises(TopologyError, match="world_size 3"):
        TwoLevelTopology([0, 0, 1, 1]).mixing_matrix(3, 0)
    with pytest.raises(TopologyError, match="sizes"):
        Regions.from_sizes([2, 0])
    with pytest.raises(TopologyError, match="rank"):
        Regions([0, 1]).region_of(2)
    with pytest.raises(TopologyError, match="region_matrix"):
        Regions([0, 1]).lift(torch.tensor([[0.5, 0.6], [0.5, 0.4]], dtype=F64))
