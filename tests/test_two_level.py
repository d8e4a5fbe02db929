"""The two-level round (algorithm/two_level.py) against a float64 oracle on the 4-rank quadratics: its reductions
(one region: DiLoCo; one worker per region: GASLoC; hierarchical DiLoCo with K = 1: DiLoCo), the exact region
average, the mean over ranks, and its stability (algorithm/two_level_stability.py)."""

from __future__ import annotations

import pytest
import torch

from gasloc_lightning.algorithm.round import DiLoCoRound
from gasloc_lightning.algorithm.two_level import TwoLevelRound, TwoLevelRule
from gasloc_lightning.algorithm.two_level_stability import max_stable_cross_momentum, period_matrices, two_level_rate
from gasloc_lightning.topology.fixed import CompleteTopology, RingTopology
from gasloc_lightning.topology.random_graphs import OnePeerTopology
from gasloc_lightning.topology.regions import Regions, TwoLevelTopology
from test_regions import Quadratics, run

F64 = torch.float64


def cross_matrix(regions: Regions, rule: TwoLevelRule, region_topology, t: int) -> torch.Tensor:
    """W of the cross step of round t over ranks: the exact mean (hierarchical), or B C B (gossip)."""
    n = regions.world_size
    if rule.cross_mean:
        return torch.full((n, n), 1.0 / n, dtype=F64)
    B = regions.average_matrix()
    return B @ regions.lift(region_topology.mixing_matrix(regions.num_regions, t // rule.cross_every)) @ B


def oracle(quadratics: Quadratics, regions: Regions, rule: TwoLevelRule, region_topology, rounds: int,
           start: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The two-level rule written out on stacked float64 ranks (module docstring of algorithm/two_level.py); with
    ``rule.cross_overlap`` the delayed crossing (p = u + beta C, posted, its mix landing at the next crossing)."""
    n, d = quadratics.centres.shape
    theta = (torch.zeros(d, dtype=F64) if start is None else start).expand(n, d).clone()
    b, phi, x = torch.zeros_like(theta), theta.clone(), theta.clone()
    correction, posted, W_posted = torch.zeros_like(theta), None, None
    B, trajectory = regions.average_matrix(), []
    for t in range(rounds):
        mean_delta = B @ (theta - quadratics.local(theta))  # the exact region average
        if rule.region_momentum > 0:
            b = rule.region_momentum * b + mean_delta
            theta = theta - rule.region_lr * (mean_delta + rule.region_momentum * b)
        else:
            theta = theta - rule.region_lr * mean_delta
        if regions.num_regions > 1 and rule.is_cross_round(t):
            z = phi + rule.cross_lr * (theta - phi)
            u = z + rule.cross_momentum * (z - x)
            if rule.cross_overlap:
                if posted is not None:  # the last crossing's exchange lands now
                    correction = rule.cross_delayed_weight * (W_posted @ posted - posted)
                phi = u + correction
                posted, W_posted = phi.clone(), cross_matrix(regions, rule, region_topology, t)
            else:
                phi = cross_matrix(regions, rule, region_topology, t) @ u
            x = z + (phi - u) / (1 + rule.cross_momentum)
            theta = phi.clone()
        trajectory.append(theta.clone())
    return trajectory


def engine(quadratics: Quadratics, regions: Regions, rule: TwoLevelRule, region_topology, rounds: int,
           dtype=torch.float32) -> list[torch.Tensor]:
    """TwoLevelRound on stacked float32 rows, with the moves an engine makes (region means, cross mixing)."""
    n, d = quadratics.centres.shape
    round_ = TwoLevelRound(torch.zeros(n, d), rule=rule, num_regions=regions.num_regions)
    local = Quadratics(n, dim=d, seed=0)
    local.hessians, local.centres = quadratics.hessians.to(dtype), quadratics.centres.to(dtype)
    trajectory = []
    for t in range(rounds):
        delta = round_.pseudo_gradient(local.local(round_.region_start.detach().clone()))
        mean = torch.empty_like(delta)
        for members in regions.members:
            rows = list(members)
            mean[rows] = delta[rows].sum(dim=0).div_(len(rows))
        round_.region_step(mean)
        if round_.crosses(t):
            if round_.in_flight:  # the delayed crossing: the mix posted at the last crossing lands first
                round_.cross_destination.copy_(in_flight)
                round_.cross_land()
            u = round_.cross_message()
            mixed = cross_matrix(regions, rule, region_topology, t).to(dtype) @ u
            if rule.cross_overlap:
                in_flight = mixed
            else:
                round_.cross_destination.copy_(mixed)
            round_.cross_finish()
        trajectory.append(round_.region_start.detach().clone())
    return trajectory


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_one_region_is_diloco_bitwise(gamma):
    """One region has no cross step: every row takes DiLoCoRound's step, bit for bit (float32)."""
    n, d = 4, 6
    quadratics = Quadratics(n, dim=d, seed=11)
    hessians, centres = quadratics.hessians.float(), quadratics.centres.float()
    rule = TwoLevelRule(cross_every=2, region_lr=0.7, region_momentum=gamma, cross_lr=0.5, cross_momentum=0.9)
    two_level = TwoLevelRound(torch.zeros(n, d), rule=rule, num_regions=1)
    diloco = DiLoCoRound(torch.zeros(d), outer_lr=0.7, outer_momentum=gamma)

    def local(theta):
        for _ in range(5):
            theta = theta - 0.1 * torch.einsum("nij,nj->ni", hessians, theta - centres)
        return theta

    for t in range(20):
        assert not two_level.crosses(t)
        start = diloco.round_start.detach().expand(n, d)
        mean = diloco.pseudo_gradient(local(start.clone())).sum(dim=0).div_(n)
        expected = diloco.step(mean)
        delta = two_level.pseudo_gradient(local(two_level.region_start.detach().clone()))
        got = two_level.region_step(delta.sum(dim=0).div_(n).expand(n, d).contiguous())
        assert torch.equal(got, expected.expand(n, d))


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_the_oracle_with_one_region_is_torch_s_diloco(gamma):
    quadratics = Quadratics(4, seed=4)
    rule = TwoLevelRule(cross_every=3, region_lr=0.7, region_momentum=gamma)
    reference = torch.nn.Parameter(torch.zeros(6, dtype=F64))
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=gamma, nesterov=gamma > 0)
    for theta in oracle(quadratics, Regions([0] * 4), rule, OnePeerTopology(), 30):
        reference.grad = reference.detach() - quadratics.local(reference.detach().expand(4, -1)).mean(dim=0)
        sgd.step()
        assert float((theta - reference.detach()).abs().max()) <= 1e-12 * float(reference.detach().abs().max())


@pytest.mark.parametrize("cross_every", [1, 3])
@pytest.mark.parametrize("region_topology", [OnePeerTopology(seed=5), RingTopology()], ids=lambda t: t.name)
def test_one_worker_per_region_is_gasloc(region_topology, cross_every):
    """eta_r = 1, gamma_r = 0: a region of one takes its own thetaH, and the cross rounds are GASLoC's anchored
    round on the regions' graph with (eta_g, gamma_g), its inner phase the K rounds since the last crossing."""
    n, eta, gamma = 4, 0.7, 0.9
    quadratics = Quadratics(n, seed=6)
    rule = TwoLevelRule(cross_every=cross_every, region_lr=1.0, region_momentum=0.0, cross_lr=eta,
                        cross_momentum=gamma)
    got = oracle(quadratics, Regions(list(range(n))), rule, region_topology, 12)
    local_k = Quadratics(n, seed=6)
    local_k.local = lambda theta: quadratics.local(theta, steps=5 * cross_every)  # K rounds of H steps, unmixed
    gasloc = run(local_k, [region_topology.mixing_matrix(n, c) for c in range(12 // cross_every)], eta=eta, gamma=gamma)
    for crossing, (theta, _) in enumerate(gasloc):
        point = got[(crossing + 1) * cross_every - 1]
        assert float((point - theta).abs().max()) <= 1e-12 * float(theta.abs().max())
    engine_points = engine(quadratics, Regions(list(range(n))), rule, region_topology, 12)
    for point, expected in zip(engine_points, got):
        assert torch.allclose(point.double(), expected, rtol=0, atol=2e-5 * float(expected.abs().max()))


def test_hierarchical_diloco_with_one_period_is_diloco():
    """Exact means at both levels, K = 1, eta_g = 1, gamma_g = 0: the region steps are linear, so the mean of the
    regions' steps is DiLoCo's step even though each region keeps its own momentum."""
    quadratics, n = Quadratics(4, seed=8), 4
    rule = TwoLevelRule(cross_every=1, region_lr=0.7, region_momentum=0.9, cross_lr=1.0, cross_momentum=0.0,
                        cross_mean=True)
    reference = torch.nn.Parameter(torch.zeros(6, dtype=F64))
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    regions = Regions([0, 0, 1, 1])
    for theta in oracle(quadratics, regions, rule, CompleteTopology(), 30):
        reference.grad = reference.detach() - quadratics.local(reference.detach().expand(n, -1)).mean(dim=0)
        sgd.step()
        assert float((theta - reference.detach()).abs().max()) <= 1e-12 * float(reference.detach().abs().max())
    for theta, expected in zip(engine(quadratics, regions, rule, CompleteTopology(), 30),
                               oracle(quadratics, regions, rule, CompleteTopology(), 30)):
        assert torch.allclose(theta.double(), expected, rtol=0, atol=2e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1]], ids=str)
@pytest.mark.parametrize("cross_mean", [False, True], ids=["gossip", "mean"])
def test_the_module_follows_the_float64_oracle_and_regions_stay_exact(layout, cross_mean):
    """4-rank quadratics, DiLoCo's (0.7, 0.9) inside, (1, 0.5) across every 2 rounds: the float32 module follows the
    float64 oracle; the members of a region are bit-identical after every round (the exact region average)."""
    regions, quadratics = Regions(layout), Quadratics(4, seed=9)
    rule = TwoLevelRule(cross_every=2, cross_mean=cross_mean)
    topology = CompleteTopology() if cross_mean else OnePeerTopology(seed=2)
    expected = oracle(quadratics, regions, rule, topology, 24)
    got = engine(quadratics, regions, rule, topology, 24)
    for theta, reference in zip(got, expected):
        assert torch.allclose(theta.double(), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
        for members in regions.members:
            assert all(torch.equal(theta[i], theta[members[0]]) for i in members)
    assert float((expected[-2] - expected[-2].mean(dim=0)).abs().max()) > 1e-3  # regions differ between crossings


def test_the_cross_step_keeps_the_mean_over_ranks():
    """A gossip across regions is doubly stochastic over ranks: the ranks' mean of phi' is the mean of u, even with
    regions of different sizes."""
    regions = Regions([0, 0, 0, 1, 1, 2, 2, 2])
    round_ = TwoLevelRound(torch.zeros(8, 5), rule=TwoLevelRule(cross_every=1), num_regions=3)
    g = torch.Generator().manual_seed(0)
    region_points = torch.randn(3, 5, generator=g)
    round_.region_step(torch.stack([region_points[regions.region_of(i)] for i in range(8)]))
    u = round_.cross_message().clone()
    W = cross_matrix(regions, round_.rule, OnePeerTopology(seed=1), 0).float()
    round_.cross_destination.copy_(W @ u)
    phi = round_.cross_finish()
    assert torch.allclose(phi.mean(dim=0), u.mean(dim=0), atol=1e-6)
    assert not torch.allclose(phi, u)


# ------------------------------------------------------------------ the delayed crossing
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_one_worker_per_region_with_the_delayed_crossing_is_gasloc_with_overlap(beta):
    """eta_r = 1, gamma_r = 0, K = 1, one worker per region: the delayed crossing is GASLoC's overlap (p = u + beta
    C(t - 1), posted; docs/algorithm.md section 5), as the simulator's one-level GossipRounds runs it."""
    from gasloc_lightning.sim import GossipRounds, TwoLevelRounds, WorkerClocks

    n, eta, gamma = 4, 0.7, 0.5
    quadratics = Quadratics(n, seed=13)
    hessians, centres = quadratics.hessians.float(), quadratics.centres.float()
    region_topology = OnePeerTopology(seed=5)
    two_level = TwoLevelTopology(list(range(n)), cross_every=1, region_topology=region_topology, cross_lr=eta,
                                 cross_momentum=gamma, cross_overlap=True, cross_delayed_weight=beta)
    rule = two_level.rule(region_lr=1.0, region_momentum=0.0)
    crossing = TwoLevelRounds(initial=torch.zeros(n, 6), topology=two_level, rule=rule, clocks=WorkerClocks(None, n))
    gossip = GossipRounds(initial=torch.zeros(n, 6), topology=OnePeerTopology(seed=5), outer_lr=eta,
                          outer_momentum=gamma, overlap=True, delayed_weight=beta, clocks=WorkerClocks(None, n))

    def local(theta):
        for _ in range(5):
            theta = theta - 0.1 * torch.einsum("nij,nj->ni", hessians, theta - centres)
        return theta

    a, b = torch.zeros(n, 6), torch.zeros(n, 6)
    for t in range(12):
        a, b = local(a), local(b)
        crossing.communicate(a, t, list(range(n)))
        gossip.communicate(b, t, list(range(n)))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert float((a - a.mean(dim=0)).abs().max()) > 1e-3  # not a trivial consensus
    crossing.flush(a)
    gossip.flush(b)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # the last correction folded in


@pytest.mark.parametrize("cross_mean", [False, True], ids=["gossip", "mean"])
@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 0, 1]], ids=str)
def test_the_delayed_crossing_follows_its_float64_oracle_and_keeps_the_mean_of_the_waited_one(layout, cross_mean):
    """DiLoCo's (0.7, 0.9) inside, crossing every 2 rounds with beta 0.5: the float32 module follows the float64
    oracle of the delayed rule, which is not the waited one's trajectory."""
    regions, quadratics = Regions(layout), Quadratics(4, seed=9)
    rule = TwoLevelRule(cross_every=2, cross_momentum=0.0, cross_mean=cross_mean, cross_overlap=True,
                        cross_delayed_weight=0.5)
    topology = CompleteTopology() if cross_mean else OnePeerTopology(seed=2)
    expected = oracle(quadratics, regions, rule, topology, 24)
    got = engine(quadratics, regions, rule, topology, 24)
    for theta, reference in zip(got, expected):
        assert torch.allclose(theta.double(), reference, rtol=0, atol=1e-5 * float(reference.abs().max()))
    waited = oracle(quadratics, regions, TwoLevelRule(cross_every=2, cross_momentum=0.0, cross_mean=cross_mean),
                    topology, 24)
    assert float((expected[-1] - waited[-1]).abs().max()) > 1e-3  # the delay changes the trajectory


def test_the_delayed_crossing_adds_an_antisymmetric_correction_so_the_ranks_mean_is_unchanged():
    """At a crossing p = u + beta C with C = W p_prev - p_prev over ranks: sum C = 0 for a doubly stochastic W."""
    regions = Regions([0, 0, 0, 1, 1, 2, 2, 2])
    rule = TwoLevelRule(cross_every=1, cross_overlap=True, cross_delayed_weight=0.5)
    round_ = TwoLevelRound(torch.zeros(8, 5), rule=rule, num_regions=3)
    g = torch.Generator().manual_seed(0)
    W = cross_matrix(regions, rule, OnePeerTopology(seed=1), 0).float()
    for _ in range(2):
        region_points = torch.randn(3, 5, generator=g)
        round_.region_step(torch.stack([region_points[regions.region_of(i)] for i in range(8)]))
        if round_.in_flight:
            round_.cross_destination.copy_(W @ posted)
            round_.cross_land()
            assert torch.allclose(round_.correction.sum(dim=0), torch.zeros(5), atol=1e-6)
            assert float(round_.correction.abs().max()) > 1e-3
        u_before = round_.cross.message(round_.region_start.detach().clone())
        posted = round_.cross_message().clone()
        assert torch.allclose(posted.mean(dim=0), u_before.mean(dim=0), atol=1e-6)
        round_.cross_finish()
        assert torch.equal(round_.region_start.detach(), posted)  # nothing waits for the exchange
    with pytest.raises(RuntimeError, match="in flight"):
        round_.cross_message()
    with pytest.raises(RuntimeError, match="in flight"):
        round_.state_dict()


def test_the_delayed_crossing_s_period_matrix_is_what_the_oracle_measures_and_beta_1_diverges():
    """The 4 x 4 period map (phi, b, x, c): a one-dimensional quadratic grows at its spectral radius in the float64
    oracle. Region momentum 0.9 overshoots between crossings, so the full stale correction (beta = 1) diverges
    where beta = 0.5 converges (both with cross_momentum 0)."""
    unstable = TwoLevelRule(cross_every=2, cross_momentum=0.0, cross_overlap=True, cross_delayed_weight=1.0)
    assert two_level_rate(unstable) > 1.0
    assert two_level_rate(TwoLevelRule(cross_every=2, cross_momentum=0.0, cross_overlap=True)) < 1.0
    s = torch.linspace(0, 0.99, 100, dtype=F64)
    matrices = period_matrices(unstable, s, 0.0)
    assert matrices.shape == (100, 4, 4)
    radii = torch.linalg.eigvals(matrices).abs().amax(dim=-1)
    worst = int(radii.argmax())
    curvature = float(1 - s[worst] ** (1 / 5)) / 0.1
    quadratics = Quadratics(2, dim=1, shared_hessian=True)
    quadratics.hessians = torch.full((2, 1, 1), curvature, dtype=F64)
    quadratics.centres = torch.zeros(2, 1, dtype=F64)
    start = torch.tensor([[1.0], [-1.0]], dtype=F64)  # the difference mode of two regions: lambda 0 for a matching
    rule = TwoLevelRule(cross_every=2, cross_momentum=0.0, cross_overlap=True, cross_delayed_weight=1.0)
    trajectory = _oracle_from(quadratics, rule, start, 600)
    measured = (float(trajectory[-1].abs().max()) / float(trajectory[-201].abs().max())) ** (1 / 200)
    assert measured == pytest.approx(float(radii[worst]) ** 0.5, abs=3e-3) and measured > 1.0


def _oracle_from(quadratics, rule, start, rounds):
    """The delayed oracle for two regions of one worker each, paired at every crossing, from distinct starting rows
    (the difference mode)."""
    theta = start.clone()
    b, phi, x, correction, posted = torch.zeros_like(theta), theta.clone(), theta.clone(), torch.zeros_like(theta), None
    W = torch.full((2, 2), 0.5, dtype=F64)
    trajectory = []
    for t in range(rounds):
        delta = theta - quadratics.local(theta)  # one member per region: its own Delta is the region's mean
        b = rule.region_momentum * b + delta
        theta = theta - rule.region_lr * (delta + rule.region_momentum * b)
        if rule.is_cross_round(t):
            z = phi + rule.cross_lr * (theta - phi)
            u = z + rule.cross_momentum * (z - x)
            if posted is not None:
                correction = rule.cross_delayed_weight * (W @ posted - posted)
            phi = u + correction
            posted = phi.clone()
            x = z + (phi - u) / (1 + rule.cross_momentum)
            theta = phi.clone()
        trajectory.append(theta.clone())
    return trajectory


def test_stability_numbers():
    """The rates docs/algorithm.md quotes (per round, lambda in {0, 1/2, 1}, s in [0, 0.99] and s = 1)."""
    rate = lambda K, **kw: two_level_rate(TwoLevelRule(cross_every=K, **kw))  # noqa: E731
    assert rate(1) == pytest.approx(0.9458, abs=1e-4) and rate(10) == pytest.approx(0.9757, abs=1e-4)
    assert rate(1, cross_lr=0.7, cross_momentum=0.9) == pytest.approx(1.0403, abs=1e-4)  # 0.9 at both levels
    assert rate(10, cross_momentum=0.9) > 1.0 and rate(5, cross_momentum=0.0, cross_mean=True) < 0.95
    assert max_stable_cross_momentum(TwoLevelRule(cross_every=1)) == pytest.approx(0.792, abs=2e-3)


def test_the_spectral_rate_is_what_the_oracle_measures():
    """The period matrix is the rule's linear system: a one-dimensional quadratic with the worst contraction s grows
    (or shrinks) at its spectral radius in the float64 oracle."""
    rule = TwoLevelRule(cross_every=1, region_lr=0.7, region_momentum=0.9, cross_lr=0.7, cross_momentum=0.9)
    s = torch.linspace(0, 0.99, 100, dtype=F64)
    radii = torch.linalg.eigvals(period_matrices(rule, s, 1.0)).abs().amax(dim=-1)
    worst = int(radii.argmax())
    curvature = float(1 - s[worst] ** (1 / 5)) / 0.1  # (1 - 0.1 a)^5 = s
    quadratics = Quadratics(2, dim=1, shared_hessian=True)
    quadratics.hessians = torch.full((2, 1, 1), curvature, dtype=F64)
    quadratics.centres = torch.zeros(2, 1, dtype=F64)
    trajectory = oracle(quadratics, Regions([0, 1]), TwoLevelRule(cross_every=1, region_lr=0.7, region_momentum=0.9,
                        cross_lr=0.7, cross_momentum=0.9, cross_mean=True), CompleteTopology(), 400,
                        start=torch.ones(1, dtype=F64))
    measured = (float(trajectory[-1].abs().max()) / float(trajectory[-101].abs().max())) ** (1 / 100)
    assert measured == pytest.approx(float(radii[worst]), abs=2e-3) and measured > 1.0


def test_the_topology_checks_the_rule_and_refuses_one_level_engines():
    topology = TwoLevelTopology.from_network(sizes=[4, 4], scale_to=16, cross_every=5)
    assert topology.regions.sizes == (8, 8)
    assert topology.check_rule(topology.rule(region_lr=0.7, region_momentum=0.9)) < 1.0
    unstable = TwoLevelTopology([0, 0, 1, 1], cross_every=1, cross_lr=0.7, cross_momentum=0.9)
    with pytest.raises(ValueError, match="cross_momentum below 0.79"):
        unstable.check_rule(unstable.rule(region_lr=0.7, region_momentum=0.9))
    with pytest.raises(ValueError, match="two_level"):
        topology.resolve_momentum(16, 0.9)
    assert TwoLevelTopology.from_network(regions=["us", "eu", "us", "eu"]).regions.members == ((0, 2), (1, 3))
    assert TwoLevelTopology.from_network(sizes=[2, 2], region_topology="complete").rule(
        region_lr=0.7, region_momentum=0.9).cross_mean


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="cross_every"):
        TwoLevelRule(cross_every=0)
    with pytest.raises(ValueError, match="cross_lr / cross_momentum"):
        TwoLevelRule(cross_momentum=1.0)
    with pytest.raises(ValueError, match="region_lr / region_momentum"):
        TwoLevelRule(region_lr=0.0)
    with pytest.raises(ValueError, match="num_regions"):
        TwoLevelRound(torch.zeros(3), rule=TwoLevelRule(), num_regions=0)
    with pytest.raises(ValueError, match="regions"):
        TwoLevelTopology.from_network()


def test_the_one_level_strategies_refuse_the_two_level_topology_rather_than_run_the_sketch():
    """GASLoCStrategy and the elastic strategy would run section 8b's rule on W_t = B C B (divergent for rare
    crossings): both refuse topology two_level at their configuration check, naming what runs it."""
    from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy
    from gasloc_lightning.strategies.gasloc import GASLoCStrategy

    topology = TwoLevelTopology([0, 0, 1, 1], cross_every=2)
    with pytest.raises(ValueError, match="two_level.*gasloc-sim"):
        GASLoCStrategy(topology=topology, inner_steps=2).check_configuration(4)
    elastic = ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, min_workers=4, max_workers=4,
                                    topology=topology, inner_steps=2, secret="test-run-secret-16")
    with pytest.raises(ValueError, match="two_level.*ElasticTwoLevelStrategy"):
        elastic.check_configuration(1)


def test_the_two_level_strategy_takes_only_a_two_level_topology_and_checks_its_rule():
    from gasloc_lightning.strategies.two_level import TwoLevelStrategy

    with pytest.raises(ValueError, match="TwoLevelTopology"):
        TwoLevelStrategy(topology=OnePeerTopology())
    unstable = TwoLevelStrategy(topology=TwoLevelTopology([0, 0, 1, 1], cross_every=1, cross_lr=0.7,
                                                          cross_momentum=0.9))
    with pytest.raises(ValueError, match="cross_momentum below"):
        unstable.check_configuration(4)
    strategy = TwoLevelStrategy(topology=TwoLevelTopology([0, 0, 1, 1], region_topology="complete"), outer_lr=0.5)
    strategy.check_configuration(4)
    assert (strategy.outer_lr, strategy.outer_momentum, strategy.cross_mean) == (0.5, 0.9, True)
    with pytest.raises(Exception, match="world_size 8"):
        strategy.check_configuration(8)
    with pytest.raises(ValueError, match="gasloc-sim only"):  # its quantized mean is blocking in the strategy
        TwoLevelStrategy(topology=TwoLevelTopology([0, 0, 1, 1], region_topology="complete", cross_overlap=True,
                                                   cross_codec="int8"))
