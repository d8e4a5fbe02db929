"""Consensus stability: mode matrices, exact and simulated rates, ALGORITHM.md oracles 5-7."""

from __future__ import annotations

import statistics

import pytest
import torch

from gasloc_lightning.algorithm import stability
from gasloc_lightning.algorithm.stability import (
    SWITCHING_SAFE_MOMENTUM,
    consensus_rate_fixed,
    consensus_rate_periodic,
    consensus_rate_simulated,
    disagreement_eigenvalues,
    disagreement_trajectory,
    max_stable_momentum,
    mode_matrix,
    periodic_mode_eigenvalues,
)
from gasloc_lightning.topology import ExponentialTopology, OnePeerTopology, RingTopology, build_topology

RING_16 = RingTopology().mixing_matrix(16, 0)


def rounds_to(trajectory: torch.Tensor, level: float = 1e-6) -> int:
    below = (trajectory < level).nonzero()
    return int(below[0]) if len(below) else len(trajectory)


def fixed(matrix: torch.Tensor):
    return lambda t: matrix


def schedule(name: str, n: int, seed: int = 0):
    topology = build_topology(name, seed=seed)
    return lambda t: topology.mixing_matrix(n, t)


def stacked_round(theta, x, W, gamma, form):
    """One round written exactly as ALGORITHM.md states it (z = theta: no gradients)."""
    if form == "anchored":
        u = theta + gamma * (theta - x)
        theta_next = W @ u
        return theta_next, theta + (theta_next - u) / (1 + gamma)
    x_next = W @ theta
    return x_next + gamma * (x_next - x), x_next


@pytest.mark.parametrize("form", stability.UPDATE_FORMS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9])
def test_mode_matrix_is_the_stacked_round_on_an_eigenvector(form, gamma):
    eigenvalues, vectors = torch.linalg.eigh(RING_16)
    theta, x = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    theta_next, x_next = stacked_round(theta, x, RING_16, gamma, form)
    for lam, v in zip(eigenvalues, vectors.T):
        M = mode_matrix(float(lam), gamma, form)
        assert M.shape == (2, 2) and M.dtype == torch.float64
        expected = M @ torch.stack([v @ theta, v @ x])
        torch.testing.assert_close(torch.stack([v @ theta_next, v @ x_next]), expected)


def test_mode_matrix_values():
    torch.testing.assert_close(
        mode_matrix(0.5, 0.5), torch.tensor([[0.75, -0.25], [0.5, 1 / 6]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        mode_matrix(0.5, 0.5, "post_mix"), torch.tensor([[0.75, -0.5], [0.5, 0.0]], dtype=torch.float64)
    )


def test_disagreement_eigenvalues_drop_only_the_consensus_direction():
    assert disagreement_eigenvalues(RING_16).max() == pytest.approx(0.9619397662556434)
    two_rings = torch.block_diag(RingTopology().mixing_matrix(4, 0), RingTopology().mixing_matrix(4, 0))
    assert (disagreement_eigenvalues(two_rings) > 1 - 1e-12).sum() == 1
    assert consensus_rate_fixed(two_rings, 0.5) == 1.0
    assert consensus_rate_fixed(two_rings, 0.0, "post_mix") == 1.0
    with pytest.raises(ValueError, match="symmetric"):
        disagreement_eigenvalues(torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64))
    with pytest.raises(ValueError, match="doubly stochastic"):
        disagreement_eigenvalues(torch.eye(3, dtype=torch.float64) * 0.5)


@pytest.mark.parametrize("form", stability.UPDATE_FORMS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9])
def test_exact_fixed_rate_matches_simulation(form, gamma):
    exact = consensus_rate_fixed(RING_16, gamma, form)
    simulated = consensus_rate_simulated(fixed(RING_16), 16, gamma, form, rounds=300, seeds=(0, 1))
    assert simulated == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize(("n", "gamma"), [(16, 0.9), (64, 0.75), (64, 0.82)])
def test_exact_periodic_rate_matches_simulation(n, gamma):
    topology = ExponentialTopology()
    period = [topology.mixing_matrix(n, t) for t in range(topology.schedule_period(n))]
    exact = consensus_rate_periodic(period, gamma)
    simulated = consensus_rate_simulated(schedule("exponential", n), n, gamma, rounds=240, seeds=(0,))
    assert simulated == pytest.approx(exact, rel=0.01)


def test_periodic_schedule_must_commute():
    torch.testing.assert_close(periodic_mode_eigenvalues([RING_16])[:, 0], disagreement_eigenvalues(RING_16))
    ring = RingTopology().mixing_matrix(4, 0)
    partial = torch.eye(4, dtype=torch.float64)
    partial[:2, :2] = torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    assert not torch.allclose(ring @ partial, partial @ ring)
    with pytest.raises(ValueError, match="commute"):
        periodic_mode_eigenvalues([ring, partial])


def test_complete_graph_has_rate_zero():
    W = torch.full((8, 8), 1 / 8, dtype=torch.float64)
    for form in stability.UPDATE_FORMS:
        assert consensus_rate_fixed(W, 0.9, form) == 0.0
    assert consensus_rate_fixed(torch.ones(1, 1, dtype=torch.float64), 0.9) == 0.0


def test_post_mix_fixed_graph_condition():
    """post_mix on a fixed W is stable iff lambda_min(W) > -1/(1 + 2 gamma)."""
    W = torch.tensor([[0.25, 0.75], [0.75, 0.25]], dtype=torch.float64)  # lambda = 1, -1/2
    assert consensus_rate_fixed(W, 0.45, "post_mix") < 1.0
    assert consensus_rate_fixed(W, 0.55, "post_mix") > 1.0
    limit = max_stable_momentum(lambda g: consensus_rate_fixed(W, g, "post_mix"))
    assert limit == pytest.approx(0.5, abs=1e-3)


def test_max_stable_momentum_bisection():
    assert max_stable_momentum(lambda g: g / 0.6) == pytest.approx(0.6, abs=1e-3)
    assert max_stable_momentum(lambda g: g / 0.6) < 0.6
    assert max_stable_momentum(lambda g: 0.5) == 0.999
    assert max_stable_momentum(lambda g: 1.0) is None


def test_simulated_rate_is_deterministic_and_validated():
    sample = schedule("one_peer", 16, seed=2)
    assert consensus_rate_simulated(sample, 16, 0.9) == consensus_rate_simulated(sample, 16, 0.9)
    with pytest.raises(ValueError, match="form"):
        consensus_rate_simulated(sample, 16, 0.9, form="heavy_ball")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outer_momentum"):
        consensus_rate_simulated(sample, 16, -0.1)
    with pytest.raises(ValueError, match="rounds"):
        consensus_rate_simulated(sample, 16, 0.5, rounds=2)


@pytest.mark.parametrize(("n", "median_rounds"), [(16, 93), (64, 118)])
def test_oracle_5_one_peer_anchored_converges_post_mix_blows_up(n, median_rounds):
    reached = []
    for seed in range(5):
        trajectory = disagreement_trajectory(schedule("one_peer", n, seed), n, 0.9, rounds=200, seed=seed)
        reached.append(rounds_to(trajectory))
    assert max(reached) < 200  # ALGORITHM.md: within 600 rounds
    assert statistics.median(reached) == pytest.approx(median_rounds, rel=0.2)
    post_mix = disagreement_trajectory(schedule("one_peer", n), n, 0.9, "post_mix", rounds=600)
    assert post_mix[-1] > 1e3


def test_oracle_5_one_peer_anchored_rate():
    assert OnePeerTopology().consensus_rate(16, 0.95) < 1.0
    assert OnePeerTopology().consensus_rate(16, 0.9, "post_mix") > 1.0


def test_oracle_6_hypercube():
    topology = ExponentialTopology()
    assert topology.consensus_rate(64, 0.75) < 1.0 < topology.consensus_rate(64, 0.82)
    assert topology.consensus_rate(16, 0.9) < 1.0
    assert disagreement_trajectory(schedule("exponential", 64), 64, 0.75, rounds=600)[-1] < 1e-4
    assert disagreement_trajectory(schedule("exponential", 64), 64, 0.82, rounds=600)[-1] > 1e3
    assert disagreement_trajectory(schedule("exponential", 16), 16, 0.9, rounds=600)[-1] < 1e-6
    # gamma = 0: exact consensus after log2 n rounds
    assert disagreement_trajectory(schedule("exponential", 16), 16, 0.0, rounds=4)[-1] < 1e-14


def test_oracle_7_ring_of_16():
    assert rounds_to(disagreement_trajectory(fixed(RING_16), 16, 0.9, rounds=200)) < 200
    plain = disagreement_trajectory(fixed(RING_16), 16, 0.0, "post_mix", rounds=400)
    assert float(plain[-1] / plain[-2]) == pytest.approx(0.9619, abs=1e-4)
    assert consensus_rate_fixed(RING_16, 0.0, "post_mix") == pytest.approx(0.9619, abs=1e-4)
    assert ring_post_mix_rounds(0.674) == pytest.approx(73, rel=0.15)
    assert ring_post_mix_rounds(0.0) == pytest.approx(339, rel=0.15)


def ring_post_mix_rounds(gamma: float) -> float:
    """Mean over 3 seeds of the rounds post_mix needs to reach 1e-6 on the ring of 16."""
    runs = [disagreement_trajectory(fixed(RING_16), 16, gamma, "post_mix", 400, seed) for seed in range(3)]
    return statistics.mean(rounds_to(run) for run in runs)


def test_switching_safe_momentum_holds_on_mixed_non_commuting_schedules():
    """gamma = 0.44 contracts when fixed, random and hypercube PSD graphs alternate arbitrarily."""
    n = 16
    names = ("one_peer", "two_peer", "ring", "torus", "exponential")
    graphs = [build_topology(name, seed=1) for name in names]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(len(graphs), (400,), generator=generator).tolist()
    mixed = lambda t: graphs[picks[t]].mixing_matrix(n, t)  # noqa: E731
    assert SWITCHING_SAFE_MOMENTUM == 0.44
    assert consensus_rate_simulated(mixed, n, SWITCHING_SAFE_MOMENTUM, rounds=100, seeds=(0, 1, 2, 3)) < 1.0


# ------------------------------------------------------------------ overlap (one-round-delayed gossip)
def overlapped_round(theta, x, previous, W_previous, gamma, form, beta=1.0):
    """One overlapped round per worker, written as the strategy does it (z = theta: no gradients).

    ``previous`` is the point each worker sent last round and W_previous that round's matrix; the
    exchange posted then completes now, with peers' old points. The point sent this round is the
    one the worker moves to, the delayed correction included (theta+, or x+ for post_mix).
    Returns (theta+, x+, the point sent this round).
    """
    n = len(theta)

    def delayed(i):
        return sum(W_previous[i, j] * (previous[j] - previous[i]) for j in range(n) if j != i)

    if form == "anchored":
        u = theta + gamma * (theta - x)
        theta_next = torch.stack([u[i] + beta * delayed(i) for i in range(n)])
        return theta_next, (theta_next + gamma * x) / (1 + gamma), theta_next
    x_next = torch.stack([theta[i] + beta * delayed(i) for i in range(n)])
    return x_next + gamma * (x_next - x), x_next, x_next


def random_mixing_matrix(n: int, generator: torch.Generator) -> torch.Tensor:
    """A random symmetric doubly stochastic W: a random convex mix of three random matchings."""
    weights = torch.rand(3, generator=generator, dtype=torch.float64)
    W = torch.zeros(n, n, dtype=torch.float64)
    for weight in weights / weights.sum():
        order = torch.randperm(n, generator=generator)
        matching = torch.eye(n, dtype=torch.float64)
        for a, b in order[: n - n % 2].view(-1, 2).tolist():
            matching[[a, b, a, b], [a, b, b, a]] = 0.5
        W += weight * matching
    return W


@pytest.mark.parametrize("form", stability.UPDATE_FORMS)
@pytest.mark.parametrize(("gamma", "beta"), [(0.0, 1.0), (0.9, 1.0), (0.5, 0.5)])
def test_overlap_mode_matrix_is_the_stacked_round_on_an_eigenvector(form, gamma, beta):
    eigenvalues, vectors = torch.linalg.eigh(RING_16)
    theta, x, previous = torch.randn(3, 16, 2, dtype=torch.float64).unbind()
    theta_next, x_next, sent = overlapped_round(theta, x, previous, RING_16, gamma, form, beta)
    for lam, v in zip(eigenvalues, vectors.T):
        M = mode_matrix(float(lam), gamma, form, overlap=True, delayed_weight=beta)
        assert M.shape == (3, 3) and M.dtype == torch.float64
        expected = M @ torch.stack([v @ theta, v @ x, v @ previous])
        torch.testing.assert_close(torch.stack([v @ theta_next, v @ x_next, v @ sent]), expected)


@pytest.mark.parametrize("form", stability.UPDATE_FORMS)
@pytest.mark.parametrize(("gamma", "beta"), [(0.3, 1.0), (0.9, 1.0), (0.0, 0.5), (0.5, 0.5), (0.9, 0.5)])
def test_overlap_exact_rate_matches_the_stacked_simulation_on_a_ring_of_16(form, gamma, beta):
    exact = consensus_rate_fixed(RING_16, gamma, form, overlap=True, delayed_weight=beta)
    simulated = consensus_rate_simulated(
        fixed(RING_16), 16, gamma, form, rounds=300, seeds=(0, 1), overlap=True, delayed_weight=beta
    )
    assert simulated == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize("form", stability.UPDATE_FORMS)
def test_overlap_simulation_is_the_per_worker_update_and_keeps_the_mean(form):
    """Random W every round: the delayed term never moves the mean, and the simulator is that update."""
    n, gamma, beta, rounds = 8, 0.9, 0.5, 12
    generator = torch.Generator().manual_seed(3)
    matrices = [random_mixing_matrix(n, generator) for _ in range(rounds)]
    start = torch.randn(n, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    start -= start.mean(dim=0)  # what disagreement_trajectory starts from (seed 0, mean removed)
    theta = start + torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)  # a mean it must keep
    x, previous, W_previous = theta.clone(), torch.zeros_like(theta), torch.eye(n, dtype=torch.float64)
    ratios = [1.0]
    for W in matrices:
        u = theta + gamma * (theta - x) if form == "anchored" else theta
        mean_x = x.mean(dim=0)
        theta, x, previous = overlapped_round(theta, x, previous, W_previous, gamma, form, beta)
        W_previous = W
        # Oracle 2 holds unchanged: the delayed term is antisymmetric per pair.
        if form == "anchored":
            torch.testing.assert_close(theta.mean(dim=0), u.mean(dim=0), rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(x.mean(dim=0), u.mean(dim=0), rtol=0, atol=1e-12)
            torch.testing.assert_close(
                theta.mean(dim=0), u.mean(dim=0) + gamma * (u.mean(dim=0) - mean_x), rtol=0, atol=1e-12
            )
        ratios.append(float((theta - theta.mean(dim=0)).norm() / start.norm()))
    simulated = disagreement_trajectory(
        lambda t: matrices[t], n, gamma, form, rounds, overlap=True, delayed_weight=beta
    )
    torch.testing.assert_close(simulated, torch.tensor(ratios, dtype=torch.float64), rtol=1e-10, atol=0)


def test_overlap_false_is_unchanged():
    """Golden values of the overlap-free path: it must not move. The random schedules' values were
    recomputed once when matchings moved to the torch.Generator stream (one draw per matching).

    To 1e-12 relative, not bit for bit: eigensolvers and matrix products round differently on
    different CPUs (the ring's rate moves in its last digit from one machine to another)."""
    golden = pytest.approx
    assert OnePeerTopology(seed=3).consensus_rate(16, 0.9) == golden(0.8685360162357443, rel=1e-12)
    assert build_topology("two_peer", seed=3).consensus_rate(8, 0.44, "post_mix") == golden(
        0.5585266397396806, rel=1e-12
    )
    assert RingTopology().consensus_rate(16, 0.9) == golden(0.930454614492335, rel=1e-12)
    assert ExponentialTopology().consensus_rate(32, 0.9) == golden(1.0292956604086427, rel=1e-12)
    trajectory = disagreement_trajectory(schedule("one_peer", 16, seed=3), 16, 0.9, rounds=50)
    assert float(trajectory[-1]) == golden(0.001856811878754767, rel=1e-9)
    sample = schedule("one_peer", 16, seed=3)
    short = {"rounds": 30, "seeds": (0,)}
    assert consensus_rate_simulated(sample, 16, 0.9, **short) == consensus_rate_simulated(
        sample, 16, 0.9, **short, overlap=False
    )
    for form in stability.UPDATE_FORMS:
        assert consensus_rate_fixed(RING_16, 0.5, form) == consensus_rate_fixed(RING_16, 0.5, form, False)


def test_complete_graph_with_overlap_is_a_stale_average():
    """DiLoCo with a one-round-stale average: at gamma = 0 the replicas agree after two rounds."""
    W = torch.full((8, 8), 1 / 8, dtype=torch.float64)
    assert consensus_rate_fixed(W, 0.0, overlap=True) == pytest.approx(0.0, abs=1e-12)
    trajectory = disagreement_trajectory(fixed(W), 8, 0.0, rounds=4, overlap=True)
    torch.testing.assert_close(trajectory, torch.tensor([1, 1, 0, 0, 0.0], dtype=torch.float64))
    # Halving the delayed correction: the mode matrix [[1, -b], [1, -b]] has eigenvalues 0 and 1 - b.
    assert consensus_rate_fixed(W, 0.0, overlap=True, delayed_weight=0.5) == pytest.approx(0.5)
    complete = build_topology("complete")
    assert 0.6 < complete.consensus_rate(8, 0.9, overlap=True) < 0.7
    assert complete.consensus_rate(8, 0.9) == 0.0


def test_sending_the_corrected_point_is_what_keeps_overlap_stable():
    """The same delayed correction, but each worker sends u instead of the point it moved to:
    a lambda = 0 mode then follows d(t+1) = d(t) - d(t-1) at gamma = 0 and never contracts."""
    W = torch.full((4, 4), 1 / 4, dtype=torch.float64)
    theta = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sent_u = stale = theta - theta.mean(dim=0)
    ours = torch.stack([theta, theta, torch.zeros_like(theta)])  # (theta, x, previous), nothing in flight
    for _ in range(12):
        sent_u, stale = sent_u + (W @ stale - stale), sent_u  # theta+ = u + (W - I) u(t-1), sent: u
        ours = torch.stack(overlapped_round(*ours, W, 0.0, "anchored"))
    assert sent_u.norm() > 0.5 * (theta - theta.mean(dim=0)).norm()  # a rotation by 60 degrees per round
    assert (ours[0] - ours[0].mean(dim=0)).norm() < 1e-12


@pytest.mark.parametrize(("gamma", "beta"), [(0.5, 1.0), (0.7, 0.5)])
def test_overlap_hypercube_rate_is_exact(gamma, beta):
    topology = ExponentialTopology()
    exact = topology.consensus_rate(16, gamma, overlap=True, delayed_weight=beta)
    simulated = consensus_rate_simulated(
        schedule("exponential", 16), 16, gamma, rounds=240, seeds=(0, 1), overlap=True, delayed_weight=beta
    )
    assert simulated == pytest.approx(exact, rel=0.01)


def test_overlap_rates_of_many_gammas_at_once():
    sample, gammas, short = schedule("two_peer", 8, seed=1), [0.0, 0.5, 0.9], {"rounds": 60, "seeds": (0, 1)}
    delayed = {"overlap": True, "delayed_weight": 0.5}
    together = stability.consensus_rates_simulated(sample, 8, gammas, **short, **delayed)
    alone = [consensus_rate_simulated(sample, 8, g, **short, **delayed) for g in gammas]
    assert together == pytest.approx(alone, rel=1e-9)
    plain = stability.consensus_rates_simulated(sample, 8, gammas, **short)
    assert plain == pytest.approx([consensus_rate_simulated(sample, 8, g, **short) for g in gammas], rel=1e-9)


def test_max_stable_momentum_grid():
    calls = []

    def rates(gammas):
        calls.append(len(gammas))
        return [g / 0.6 for g in gammas]

    limit = stability.max_stable_momentum_grid(rates)
    assert limit == pytest.approx(0.6, abs=1e-3) and limit < 0.6
    assert len(calls) == 2
    assert stability.max_stable_momentum_grid(lambda gs: [0.5] * len(gs)) == 0.999
    assert stability.max_stable_momentum_grid(lambda gs: [1.0] * len(gs)) is None


def test_overlap_arguments_are_validated():
    with pytest.raises(ValueError, match="delayed_weight"):
        mode_matrix(0.5, 0.5, overlap=True, delayed_weight=0.0)
    with pytest.raises(ValueError, match="delayed_weight"):
        consensus_rate_fixed(RING_16, 0.5, overlap=True, delayed_weight=1.5)
    with pytest.raises(ValueError, match="delayed_weight"):
        RingTopology().consensus_rate(16, 0.5, overlap=True, delayed_weight=-1.0)
    with pytest.raises(ValueError, match="outer_momentum"):
        consensus_rate_simulated(fixed(RING_16), 16, 1.0, overlap=True)
