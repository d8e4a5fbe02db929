"""The outer step against float64 stacked references (ALGORITHM.md oracles 1-4)."""

from __future__ import annotations

import pytest
import torch

from gasloc_lightning.algorithm.outer import OuterState, mix



@pytest.fixture(autouse=True)
def _float64_by_default():
    """The oracles are float64; restored afterwards so other test modules keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def random_doubly_stochastic(n: int, generator: torch.Generator) -> torch.Tensor:
    """Symmetric W = I - L with random positive weights on a random matching plus a ring."""
    W = torch.eye(n, dtype=torch.float64)
    perm = torch.randperm(n, generator=generator)
    edges = [(int(perm[i]), int(perm[(i + 1) % n])) for i in range(n)]
    for i, j in edges:
        w = 0.05 + 0.2 * float(torch.rand((), generator=generator))
        W[i, j] += w
        W[j, i] += w
        W[i, i] -= w
        W[j, j] -= w
    return W


class PerWorker:
    """n workers running OuterState, exchanging messages only through ``mix`` (the per-worker code path)."""

    def __init__(self, theta0: torch.Tensor, n: int, eta: float, gamma: float, form: str):
        self.states = [OuterState(theta0.clone(), eta, gamma, form) for _ in range(n)]
        for s in self.states:  # the class keeps float32; the oracles are checked in float64
            s.round_start, s.anchor = theta0.clone(), theta0.clone()

    def round(self, theta_h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        n = len(self.states)
        messages = [s.message(theta_h[i].clone()) for i, s in enumerate(self.states)]
        out = []
        for i, s in enumerate(self.states):
            received = [(float(W[i, j]), messages[j]) for j in range(n) if j != i and W[i, j] != 0]
            mixed = s.mixed_destination()
            mix(messages[i], received, out=mixed) if received else mixed.copy_(messages[i])
            out.append(s.finish(messages[i], mixed).clone())
        return torch.stack(out)

    @property
    def anchors(self) -> torch.Tensor:
        return torch.stack([s.anchor for s in self.states])


def stacked_anchored(theta, x, theta_h, W, eta, gamma):
    z = theta + eta * (theta_h - theta)
    u = z + gamma * (z - x)
    new_theta = W @ u
    return new_theta, z + (new_theta - u) / (1 + gamma)


@pytest.mark.parametrize("gamma", [0.0, 0.9])
def test_complete_graph_is_diloco_nesterov_sgd(gamma):
    """Oracle 1: identical start, heterogeneous thetaH, all-reduce mean == SGD(eta, gamma, nesterov) on theta - mean(thetaH)."""
    g = torch.Generator().manual_seed(0)
    n, d, eta = 5, 7, 0.7
    theta0 = torch.randn(d, generator=g)
    workers = PerWorker(theta0, n, eta, gamma, "anchored")
    W = torch.full((n, n), 1.0 / n)
    reference = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([reference], lr=eta, momentum=gamma, nesterov=gamma > 0)
    theta = theta0.expand(n, d).clone()
    for _ in range(40):
        theta_h = theta + 0.3 * torch.randn(n, d, generator=g)
        reference.grad = reference.detach() - theta_h.mean(0)
        sgd.step()
        theta = workers.round(theta_h, W)
        scale = reference.detach().norm()
        assert torch.allclose(theta, reference.detach().expand(n, d), rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("form", ["anchored", "post_mix"])
def test_mean_follows_diloco_for_any_doubly_stochastic_w(form):
    """Oracle 2: mean(theta') = zbar + gamma (zbar - mean x), mean(x') = zbar (anchored form)."""
    g = torch.Generator().manual_seed(1)
    n, d, eta, gamma = 6, 5, 0.7, 0.9
    workers = PerWorker(torch.randn(d, generator=g), n, eta, gamma, form)
    theta = torch.stack([s.round_start for s in workers.states])
    for _ in range(30):
        x_mean = workers.anchors.mean(0)
        theta_h = theta + 0.5 * torch.randn(n, d, generator=g)
        zbar = (theta + eta * (theta_h - theta)).mean(0)
        theta = workers.round(theta_h, random_doubly_stochastic(n, g))
        assert torch.allclose(theta.mean(0), zbar + gamma * (zbar - x_mean), atol=1e-12)
        assert torch.allclose(workers.anchors.mean(0), zbar, atol=1e-12)


def test_mean_never_moves_with_zero_inner_lr_and_unit_eta():
    g = torch.Generator().manual_seed(2)
    n, d = 6, 4
    workers = PerWorker(torch.zeros(d), n, 1.0, 0.9, "anchored")
    for s in workers.states:
        s.round_start.copy_(torch.randn(d, generator=g))
        s.anchor.copy_(s.round_start)
    theta = torch.stack([s.round_start.clone() for s in workers.states])
    mean0 = theta.mean(0)
    for _ in range(50):
        theta = workers.round(theta.clone(), random_doubly_stochastic(n, g))
        assert torch.allclose(theta.mean(0), mean0, atol=1e-12)


def test_per_worker_code_equals_stacked_form_and_torch_buffer_write_up():
    """Oracle 3: messages-only per-worker code == stacked anchor form == SGD-buffer write-up."""
    g = torch.Generator().manual_seed(3)
    n, d, eta, gamma = 4, 6, 0.7, 0.9
    theta0 = torch.randn(d, generator=g)
    workers = PerWorker(theta0, n, eta, gamma, "anchored")
    theta, x = theta0.expand(n, d).clone(), theta0.expand(n, d).clone()
    # torch write-up: each worker's SGD(nesterov) on Delta gives u; the buffer is moved by the gossip correction.
    params = [torch.nn.Parameter(theta0.clone()) for _ in range(n)]
    sgds = [torch.optim.SGD([p], lr=eta, momentum=gamma, nesterov=True) for p in params]
    for _ in range(25):
        theta_h = theta + 0.4 * torch.randn(n, d, generator=g)
        W = random_doubly_stochastic(n, g)
        expected_theta, x = stacked_anchored(theta, x, theta_h, W, eta, gamma)
        got = workers.round(theta_h, W)
        u = []
        for i, (p, sgd) in enumerate(zip(params, sgds)):
            p.grad = p.detach() - theta_h[i]
            sgd.step()
            u.append(p.detach().clone())
        u = torch.stack(u)
        mixed = W @ u
        for i, (p, sgd) in enumerate(zip(params, sgds)):
            sgd.state[p]["momentum_buffer"].sub_((mixed[i] - u[i]) / (eta * (1 + gamma)))
            p.data.copy_(mixed[i])
        assert torch.allclose(got, expected_theta, atol=1e-12)
        assert torch.allclose(workers.anchors, x, atol=1e-12)
        assert torch.allclose(mixed, expected_theta, atol=1e-12)
        theta = expected_theta


def test_gamma_zero_both_forms_are_plain_gossip_and_pairwise_drop_is_exact():
    """Oracle 4: at gamma = 0 both forms mix z; pairwise averaging removes sum ||z_i - z_j||^2 / 2."""
    g = torch.Generator().manual_seed(4)
    n, d, eta = 6, 3, 0.8
    theta0 = torch.randn(d, generator=g)
    anchored = PerWorker(theta0, n, eta, 0.0, "anchored")
    post_mix = PerWorker(theta0, n, eta, 0.0, "post_mix")
    theta = theta0.expand(n, d).clone()
    for _ in range(10):
        theta_h = theta + torch.randn(n, d, generator=g)
        z = theta + eta * (theta_h - theta)
        perm = torch.randperm(n, generator=g).tolist()
        pairs = [(perm[k], perm[k + 1]) for k in range(0, n, 2)]
        W = torch.eye(n)
        for i, j in pairs:
            W[i, i] = W[j, j] = W[i, j] = W[j, i] = 0.5
        a, b = anchored.round(theta_h, W), post_mix.round(theta_h, W)
        assert torch.allclose(a, W @ z, atol=1e-12) and torch.allclose(b, W @ z, atol=1e-12)
        spread = lambda v: ((v - v.mean(0)) ** 2).sum()
        drop = sum(((z[i] - z[j]) ** 2).sum() / 2 for i, j in pairs)
        assert torch.allclose(spread(z) - spread(a), drop, atol=1e-12)
        theta = a


def test_outer_state_is_float32_and_round_trips():
    state = OuterState(torch.randn(10, dtype=torch.bfloat16), 0.7, 0.9)
    assert state.round_start.dtype == torch.float32 and state.anchor.dtype == torch.float32
    state.message(torch.randn(10, dtype=torch.float32))
    copy = OuterState(torch.zeros(10), 0.7, 0.9)
    copy.load_state_dict(state.state_dict())
    assert torch.equal(copy.anchor, state.anchor)
    with pytest.raises(ValueError, match="another model"):
        OuterState(torch.zeros(3), 0.7, 0.9).load_state_dict(state.state_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"outer_lr": 0.0}, "outer_lr"), ({"outer_momentum": 1.0}, "outer_momentum"), ({"outer_form": "x"}, "outer_form")],
)
def test_invalid_hyperparameters_name_the_argument(kwargs, match):
    args = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_form": "anchored", **kwargs}
    with pytest.raises(ValueError, match=match):
        OuterState(torch.zeros(2), **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_sees_nan_and_both_infinities(dtype):
    from gasloc_lightning.comm.flat import all_finite

    values = torch.randn(1000).to(dtype)
    assert all_finite(values) and all_finite(values[:0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = values.clone()
        poisoned[517] = bad
        assert not all_finite(poisoned)
