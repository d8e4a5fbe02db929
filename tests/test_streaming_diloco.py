"""Streaming DiLoCo: the schedule, the outer step, and torchft 0.2.0's DiLoCo trajectory run by two engines.

Unit tests cover :class:`~gasloc_lightning.algorithm.fragments.FragmentPoints` (when each fragment leaves and
lands), :func:`fragment_bounds` and :class:`StreamingDiLoCoOuter` (``algorithm/streaming.py``).

The golden tests run torchft's own ``DiLoCo`` (several ``model_fragments``, ``fragment_sync_delay``,
``fragment_update_alpha``, one outer Nesterov SGD per fragment) with two replicas, each a thread with its
own ``TCPStore``, gloo group and ``Manager`` against an in-process lighthouse, and record every parameter
after every inner step. The same replicas, batches and inner optimizer then go through

- :class:`FragmentPoints` and :class:`StreamingDiLoCoOuter` in one process, the mean of the two
  pseudo-gradients taken directly, and
- :class:`~gasloc_lightning.DiLoCoStrategy` under Lightning's ``Trainer``, two forked ranks on a real gloo
  group (rank r is replica r),

and each trajectory must agree with torchft's to float32 noise. torchft's fragments are the parameter groups
that :func:`fragment_bounds` cuts, as the strategy's. Both replicas start from the same weights at step 0
with ``init_sync=False``, so no replica heals and no state crosses the network (the checkpoint transport
refuses to send or receive). Every listener, torchft's and the Lightning ranks', is bound to 127.0.0.1.

Not modelled: torchft picks the fragment to sync from its committed-sync counter (``Manager.current_step()
mod F``), so a sync whose commit fails is retried h = H / F steps later with the same fragment, shifting
the round robin. ``FragmentPoints`` is that schedule with every sync committed (asserted here: torchft
commits every sync of these runs); the engines here have no failed commit to retry.
"""

from __future__ import annotations

import gc
import io
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust side is chatty at INFO

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gasloc_lightning import DiLoCoStrategy  # noqa: E402
from gasloc_lightning.algorithm.fragments import (  # noqa: E402
    FragmentPoints,
    max_fragment_sync_delay,
    resolve_points,
)
from gasloc_lightning.algorithm.streaming import StreamingDiLoCoOuter, fragment_bounds  # noqa: E402
from net_utils import listening_sockets, non_loopback  # noqa: E402

WIDTH, BATCH, REPLICAS = 8, 4, 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
INNER_LR = 1e-2
TIMEOUT = timedelta(seconds=15)


# ------------------------------------------------------------------ the schedule
def _torchft_table(inner_steps: int, fragments: int, delay: int, steps: int) -> list[tuple[int | None, int | None]]:
    """(prepared, performed) fragment after each step, by the rule of torchft 0.2.0's ``DiLoCo._step_post_hook``,
    every sync committed: a counter of steps since the last perform, reset there; fragment = commits mod F."""
    every, local, committed, table = inner_steps // fragments, 0, 0, []
    for _ in range(steps):
        local += 1
        prepared = committed % fragments if local == every - delay else None
        performed = None
        if local == every:
            performed, local, committed = committed % fragments, 0, committed + 1
        table.append((prepared, performed))
    return table


def _points_table(points: FragmentPoints, steps: int) -> list[tuple[int | None, int | None]]:
    rounds = [(step - 1) % points.inner_steps + 1 for step in range(1, steps + 1)]  # step_in_round: 1..H
    return [(points.leaving(step), points.landing(step)) for step in rounds]


@pytest.mark.parametrize("inner_steps, fragments, delay", [(4, 2, 0), (4, 2, 1), (6, 3, 0), (6, 3, 1), (8, 2, 3),
                                                           (8, 4, 1), (5, 1, 4), (3, 3, 0)])
def test_points_are_torchft_schedule_when_fragments_divide_inner_steps(inner_steps, fragments, delay):
    points = FragmentPoints(inner_steps, fragments, delay)
    steps = 3 * inner_steps
    assert _points_table(points, steps) == _torchft_table(inner_steps, fragments, delay, steps)
    assert max_fragment_sync_delay(inner_steps, fragments) == inner_steps // fragments - 1  # torchft: tau < H / F


def test_points_leave_tau_steps_before_landing_round_robin_from_fragment_zero():
    points = FragmentPoints(inner_steps=4, fragments=2, fragment_sync_delay=1)
    assert (points.prepare_at, points.perform_at) == ([1, 3], [2, 4])
    assert _points_table(points, 4) == [(0, None), (None, 0), (1, None), (None, 1)]
    same_step = FragmentPoints(inner_steps=6, fragments=3)
    assert _points_table(same_step, 6) == [(None, None), (0, 0), (None, None), (1, 1), (None, None), (2, 2)]


def test_points_split_a_round_by_floor_when_fragments_do_not_divide_inner_steps():
    points = FragmentPoints(inner_steps=5, fragments=4)
    assert points.perform_at == points.prepare_at == [1, 2, 3, 5]
    assert max_fragment_sync_delay(5, 4) == 0  # fragments 0, 1, 2 land one step apart
    assert _points_table(points, 5) == [(0, 0), (1, 1), (2, 2), (None, None), (3, 3)]
    assert FragmentPoints(inner_steps=7, fragments=2, fragment_sync_delay=2).prepare_at == [1, 5]  # perform 3, 7
    assert max_fragment_sync_delay(7, 2) == 2


def test_overlap_hides_each_transfer_under_one_step_where_the_schedule_has_room():
    assert resolve_points(8, 2, overlap=True) == FragmentPoints(8, 2, 1)
    assert resolve_points(8, 1, overlap=True) == FragmentPoints(8, 1, 1)
    assert resolve_points(5, 4, overlap=True) == FragmentPoints(5, 4, 0)  # fragments land one step apart
    assert resolve_points(6, 3, 1) == FragmentPoints(6, 3, 1)
    with pytest.raises(ValueError, match="overlap=True chooses fragment_sync_delay itself"):
        resolve_points(8, 2, 1, overlap=True)


@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_overlap_without_room_is_not_silent(codec):
    """H 5, F 4: fragments land one step apart, tau is 0 and nothing can overlap: the strategy says so."""
    strategy = DiLoCoStrategy(inner_steps=5, fragments=4, overlap=True, message_codec=codec)
    with pytest.warns(UserWarning, match="overlap=True is not applied: inner_steps=5 and fragments=4"):
        strategy.check_configuration(1)
    assert strategy.fragment_points.fragment_sync_delay == 0
    roomy = DiLoCoStrategy(inner_steps=8, fragments=4, overlap=True, message_codec=codec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        roomy.check_configuration(1)
    assert roomy.fragment_points.fragment_sync_delay == 1


@pytest.mark.parametrize("arguments, match", [
    (dict(inner_steps=4, fragments=0), "fragments must be an int >= 1, got 0"),
    (dict(inner_steps=4, fragments=True), "fragments must be an int >= 1, got True"),
    (dict(inner_steps=0, fragments=1), "inner_steps must be an int >= 1, got 0"),
    (dict(inner_steps=4.0, fragments=2), "inner_steps must be an int >= 1, got 4.0"),
    (dict(inner_steps=4, fragments=5), r"fragments \(F=5\) must be <= inner_steps \(H=4\)"),
    (dict(inner_steps=4, fragments=2, fragment_sync_delay=-1), "fragment_sync_delay must be an int >= 0, got -1"),
    (dict(inner_steps=4, fragments=2, fragment_sync_delay=2), r"fragment_sync_delay \(tau=2\) must be <= 1"),
    (dict(inner_steps=5, fragments=4, fragment_sync_delay=1), r"fragment_sync_delay \(tau=1\) must be <= 0"),
])
def test_points_validate_their_arguments(arguments, match):
    with pytest.raises(ValueError, match=match):
        FragmentPoints(**arguments)


# ------------------------------------------------------------------ fragment bounds
def test_fragment_bounds_cut_on_tensor_boundaries_nearest_equal_shares():
    assert fragment_bounds([64, 8] * 4, 2) == [(0, 144), (144, 288)]
    assert fragment_bounds([10, 1, 1, 1, 10], 3) == [(0, 10), (10, 13), (13, 23)]
    assert fragment_bounds([100, 1, 1], 3) == [(0, 100), (100, 101), (101, 102)]  # never an empty fragment
    assert fragment_bounds([5], 1) == [(0, 5)]


@pytest.mark.parametrize("sizes, fragments, match", [
    ([4, 4], 3, r"fragments \(F\) must be <= the number of tensors 2"),
    ([4, 4], 0, "fragments must be an int >= 1"),
    ([], 1, "sizes must be a non-empty list"),
    ([4, 0], 1, "sizes must be a non-empty list of positive"),
])
def test_fragment_bounds_validate_their_arguments(sizes, fragments, match):
    with pytest.raises(ValueError, match=match):
        fragment_bounds(sizes, fragments)


# ------------------------------------------------------------------ the outer step
def _outer(alpha: float = 0.5, initial: Tensor | None = None) -> StreamingDiLoCoOuter:
    initial = torch.zeros(6) if initial is None else initial
    return StreamingDiLoCoOuter(initial, bounds=[(0, 3), (3, 6)], outer_lr=OUTER_LR,
                                outer_momentum=OUTER_MOMENTUM, fragment_update_alpha=alpha)


def test_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient_then_an_alpha_mix():
    outer = _outer(alpha=0.25)
    live = torch.tensor([[9.0] * 3 + [1.0] * 3, [9.0] * 3 + [3.0] * 3])  # two stacked workers
    pseudo_gradients = outer.prepare(1, live)
    assert torch.equal(pseudo_gradients, torch.tensor([[-1.0] * 3, [-3.0] * 3]))  # backup - live
    mean = pseudo_gradients.mean(0)  # -2
    outer.perform(1, mean, live)
    # v = -2; backup = 0 - 0.7 (-2 + 0.9 * -2) = 2.66; live = backup + 0.25 (live - backup)
    assert torch.allclose(outer.backup(1), torch.full((3,), 2.66))
    assert torch.allclose(live[:, 3:], torch.tensor([[2.245] * 3, [2.745] * 3]))
    assert torch.equal(live[:, :3], torch.full((2, 3), 9.0))  # the other fragment is untouched
    assert torch.equal(mean, torch.full((3,), -2.0))
    # Second step: v = 0.9 v + g = -1.8 - 1 = -2.8; backup -= 0.7 (g + 0.9 v) = 2.66 + 0.7 * 3.52
    outer.perform(1, torch.full((3,), -1.0), live)
    assert torch.allclose(outer.backup(1), torch.full((3,), 2.66 + 0.7 * 3.52))


def test_alpha_zero_makes_the_fragment_the_global_parameters_and_restore_discards_local_steps():
    outer = _outer(alpha=0.0)
    live = torch.arange(6.0)
    outer.perform(0, outer.prepare(0, live), live)
    assert torch.equal(live[:3], outer.backup(0)) and torch.equal(live[3:], torch.arange(3.0, 6.0))
    live += 1.0
    outer.restore(1, live)
    assert torch.equal(live[3:], torch.zeros(3))


def test_stacked_workers_compute_what_each_worker_computes_alone():
    torch.manual_seed(0)
    initial = torch.randn(6)
    stacked, alone = _outer(initial=initial), [_outer(initial=initial) for _ in range(2)]
    live = initial.repeat(2, 1)
    for step in range(6):
        live += 0.1 * torch.randn(2, 6)
        fragment = step % 2
        mean = stacked.prepare(fragment, live).mean(0)
        rows = [row.clone() for row in live]
        torch.testing.assert_close(sum(w.prepare(fragment, row) for w, row in zip(alone, rows)) / 2, mean)
        stacked.perform(fragment, mean, live)
        for worker, row in zip(alone, rows):
            worker.perform(fragment, mean, row)
        torch.testing.assert_close(torch.stack(rows), live, rtol=0, atol=0)


def test_state_dict_resumes_backups_and_momentum_through_a_weights_only_checkpoint():
    torch.manual_seed(1)
    original, live = _outer(initial=torch.randn(6)), torch.randn(6)
    for fragment in (0, 1):
        original.perform(fragment, original.prepare(fragment, live + 1.0), live)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = _outer(initial=torch.zeros(6))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed_live = live.clone()
    for fragment in (0, 1, 0):
        original.perform(fragment, original.prepare(fragment, live - 2.0), live)
        resumed.perform(fragment, resumed.prepare(fragment, resumed_live - 2.0), resumed_live)
    torch.testing.assert_close(resumed_live, live, rtol=0, atol=0)


def test_state_dict_of_another_split_is_refused():
    other = StreamingDiLoCoOuter(torch.zeros(6), bounds=[(0, 2), (2, 6)], outer_lr=OUTER_LR,
                                 outer_momentum=OUTER_MOMENTUM)
    with pytest.raises(ValueError, match="fragment bounds"):
        _outer().load_state_dict(other.state_dict())


@pytest.mark.parametrize("arguments, match", [
    (dict(bounds=[(0, 3), (4, 6)]), "bounds must be contiguous"),
    (dict(bounds=[(0, 3)]), "bounds must be contiguous"),
    (dict(bounds=[(0, 0), (0, 6)]), "bounds must be contiguous"),
    (dict(fragment_update_alpha=1.5), r"fragment_update_alpha \(alpha\) must lie in \[0, 1\]"),
    (dict(outer_momentum=1.0), "outer_momentum"),
    (dict(outer_lr=0.0), "outer_lr"),
])
def test_outer_validates_its_arguments(arguments, match):
    keywords = dict(bounds=[(0, 3), (3, 6)], outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM) | arguments
    with pytest.raises(ValueError, match=match):
        StreamingDiLoCoOuter(torch.zeros(6), **keywords)


def test_outer_validates_fragments_and_shapes():
    outer = _outer()
    with pytest.raises(ValueError, match="initial must be a flat parameter vector"):
        StreamingDiLoCoOuter(torch.zeros(2, 3), bounds=[(0, 3)], outer_lr=1.0, outer_momentum=0.0)
    with pytest.raises(ValueError, match=r"fragment must be an int in \[0, 2\)"):
        outer.prepare(2, torch.zeros(6))
    with pytest.raises(ValueError, match="live must be"):
        outer.prepare(0, torch.zeros(5))
    with pytest.raises(ValueError, match="mean_pseudo_gradient of fragment 0 must have shape"):
        outer.perform(0, torch.zeros(2, 3), torch.zeros(6))


# ------------------------------------------------------------------ the same problem for both engines
@dataclass(frozen=True)
class Config:
    inner_steps: int  # H
    fragments: int  # F
    delay: int  # tau
    alpha: float

    @property
    def steps(self) -> int:
        return 3 * self.inner_steps

    def __str__(self) -> str:
        return f"H{self.inner_steps}-F{self.fragments}-tau{self.delay}-alpha{self.alpha}"


# alpha = 0.25, not 0.5: lerp(a, b, 0.5) == lerp(b, a, 0.5) would hide which side is the local one.
CONFIGS = [Config(4, 2, 0, 0.0), Config(4, 2, 1, 0.0), Config(4, 2, 0, 0.25), Config(4, 2, 1, 0.25),
           Config(6, 3, 1, 0.25)]
CHECKED = Config(4, 2, 1, 0.25)


def _model() -> nn.Sequential:
    """The same weights every call, from a private generator: replica threads share torch's global RNG."""
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
              nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers)
    model.load_state_dict(_initial_weights())
    return model


def _initial_weights() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    bound = WIDTH ** -0.5  # nn.Linear's default init range
    weights = {}
    for index in range(0, 7, 2):  # the Linear layers
        weights[f"{index}.weight"] = (torch.rand(WIDTH, WIDTH, generator=generator) * 2 - 1) * bound
        weights[f"{index}.bias"] = (torch.rand(WIDTH, generator=generator) * 2 - 1) * bound
    return weights


def _inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.1)


def _bounds(model: nn.Module, fragments: int) -> list[tuple[int, int]]:
    """The strategy's split: contiguous runs of whole tensors, near-equal element counts."""
    return fragment_bounds([p.numel() for p in model.parameters()], fragments)


def _fragment_modules(model: nn.Module, fragments: int) -> list[nn.Module]:
    """torchft's ``model_fragments`` holding the tensors of :func:`_bounds` (not always whole layers)."""
    parameters, starts = list(model.parameters()), [0]
    for parameter in parameters:
        starts.append(starts[-1] + parameter.numel())
    return [nn.ParameterList([p for p, offset in zip(parameters, starts) if start <= offset < end])
            for start, end in _bounds(model, fragments)]


def _batches(replica: int, steps: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 + replica)
    inputs = torch.randn(steps, BATCH, WIDTH, generator=generator)  # (T, B, C)
    noise = 0.1 * torch.randn(steps, BATCH, WIDTH, generator=generator)
    return inputs, torch.sin(2.0 * inputs.flip(-1)) + noise


def _inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Tensor, targets: Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def _load_flat(model: nn.Module, vector: Tensor) -> None:
    for parameter, piece in zip(model.parameters(), vector.split([p.numel() for p in model.parameters()])):
        parameter.copy_(piece.view_as(parameter))


def test_torchft_fragments_hold_the_tensors_of_fragment_bounds():
    model = _model()
    # (8x8 weight, 8 bias) x 4 layers = 288 elements; F=3 cuts inside the third layer.
    assert _bounds(model, 2) == [(0, 144), (144, 288)]
    assert _bounds(model, 3) == [(0, 72), (72, 208), (208, 288)]
    for fragments in (1, 2, 3):
        pieces = _fragment_modules(model, fragments)
        held = [[id(p) for p in piece.parameters()] for piece in pieces]
        assert sum(held, []) == [id(p) for p in model.parameters()]  # each tensor once, in order
        assert [sum(p.numel() for p in piece.parameters()) for piece in pieces] == \
            [end - start for start, end in _bounds(model, fragments)]


# ------------------------------------------------------------------ our engine: one process
def _our_trajectories(config: Config, *, alpha: float | None = None, delay: int | None = None,
                      first_fragment: int = 0, stacked: bool = False) -> Tensor:
    """Both replicas through FragmentPoints + StreamingDiLoCoOuter: (replicas, steps, P).

    ``alpha``, ``delay`` and ``first_fragment`` override the config's rules (to show a wrong rule is seen).
    """
    models = [_model() for _ in range(REPLICAS)]
    optimizers = [_inner_optimizer(model) for model in models]
    batches = [_batches(replica, config.steps) for replica in range(REPLICAS)]
    points = FragmentPoints(config.inner_steps, config.fragments, config.delay if delay is None else delay)
    alpha = config.alpha if alpha is None else alpha
    outers = [StreamingDiLoCoOuter(_flat(models[0]), bounds=_bounds(models[0], config.fragments),
                                   outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                                   fragment_update_alpha=alpha)
              for _ in range(1 if stacked else REPLICAS)]
    pending, trajectory = {}, []
    for step in range(1, config.steps + 1):
        for model, optimizer, (inputs, targets) in zip(models, optimizers, batches):
            _inner_step(model, optimizer, inputs[step - 1], targets[step - 1])
        live = torch.stack([_flat(model) for model in models])  # (replicas, P)
        step_in_round = (step - 1) % config.inner_steps + 1
        if (fragment := points.leaving(step_in_round)) is not None:
            fragment = (fragment + first_fragment) % config.fragments
            pending[fragment] = _mean_pseudo_gradient(outers, fragment, live)
        if (fragment := points.landing(step_in_round)) is not None:
            fragment = (fragment + first_fragment) % config.fragments
            mean = pending.pop(fragment)
            for outer, rows in zip(outers, [live] if stacked else live):
                outer.perform(fragment, mean, rows)
            for model, row in zip(models, live):
                _load_flat(model, row)
        trajectory.append(live)
    return torch.stack(trajectory, dim=1)


def _mean_pseudo_gradient(outers: list[StreamingDiLoCoOuter], fragment: int, live: Tensor) -> Tensor:
    # As torchft's all-reduce: the SUM over the replicas, then divided by their number.
    if len(outers) == 1:
        return outers[0].prepare(fragment, live).sum(0) / REPLICAS
    return sum(outer.prepare(fragment, row) for outer, row in zip(outers, live)) / REPLICAS


# ------------------------------------------------------------------ torchft's engine: two replicas
@dataclass
class TorchftRun:
    trajectories: Tensor  # (replicas, steps, P)
    committed: list[int]  # manager.current_step() of each replica at the end
    opened: list[tuple[str, int]]  # the listeners each replica saw open after its first sync


@cache
def _torchft_run(config: Config) -> TorchftRun:
    """torchft's DiLoCo, two replicas in threads and the lighthouse in-process; all shut down after."""
    from torchft.coordination import LighthouseServer

    from gasloc_lightning.comm.endpoints import Endpoint, lighthouse_bind

    endpoint, baseline = Endpoint(), set(listening_sockets(os.getpid()))
    lighthouse = LighthouseServer(bind=lighthouse_bind(endpoint, 0), min_replicas=REPLICAS)
    try:
        # The lighthouse's address() names socket.gethostname(), not its bind: dial the endpoint.
        url = f"http://{endpoint.address(int(lighthouse.address().rpartition(':')[2]))}"
        results = _in_threads([lambda replica=replica: _torchft_replica(replica, config, endpoint, url,
                                                                        baseline)
                               for replica in range(REPLICAS)])
    finally:
        lighthouse.shutdown()
    _wait_released(baseline)
    # Here, not in a forked rank: freeing a torchft ManagerServer left in a reference cycle joins tokio's
    # threads, which a forked child does not have (it then waits forever).
    gc.collect()
    return TorchftRun(torch.stack([result[0] for result in results]), [result[1] for result in results],
                      [address for result in results for address in result[2]])


def _torchft_replica(replica: int, config: Config, endpoint, lighthouse_url: str,
                     baseline: set) -> tuple[Tensor, int, list]:
    from torchft.manager import Manager

    from gasloc_lightning.comm.endpoints import BoundProcessGroupGloo, bound_manager_server, listening_store

    store = listening_store(endpoint, timeout=TIMEOUT.total_seconds())
    group = BoundProcessGroupGloo(endpoint=endpoint, timeout=TIMEOUT)
    manager = None
    try:
        with bound_manager_server(endpoint):  # torchft binds its ManagerServer to '::' otherwise
            manager = Manager(
                pg=group, load_state_dict=None, state_dict=None, min_replica_size=REPLICAS,
                use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT,
                rank=0, world_size=1, store_addr=endpoint.advertised, store_port=store.port,
                lighthouse_addr=lighthouse_url, replica_id=f"replica_{replica}",
                hostname=endpoint.advertised_host, checkpoint_transport=_no_transport(), init_sync=False)
        trajectory, opened = _torchft_train(manager, replica, config, baseline)
        return trajectory, manager.current_step(), opened
    finally:
        if manager is not None:
            manager.shutdown(wait=True)
        group.close()
        del store


def _torchft_train(manager, replica: int, config: Config, baseline: set) -> tuple[Tensor, list]:
    from torchft.local_sgd import DiLoCo

    model = _model()
    inner = _inner_optimizer(model)
    fragments = _fragment_modules(model, config.fragments)
    # One outer optimizer per fragment: a single one over the whole model would also step the other
    # fragments with the inner gradients still in their .grad.
    outers = [torch.optim.SGD(piece.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
              for piece in fragments]
    inputs, targets = _batches(replica, config.steps)
    trajectory, opened = [], []
    with DiLoCo(manager, fragments, inner, outers, sync_every=config.inner_steps,
                backup_device=torch.device("cpu"), fragment_sync_delay=config.delay,
                fragment_update_alpha=config.alpha):
        for step in range(1, config.steps + 1):
            _inner_step(model, inner, inputs[step - 1], targets[step - 1])  # DiLoCo syncs in the post-hook
            trajectory.append(_flat(model).clone())
            if step == config.inner_steps // config.fragments:
                # Past the first sync every listener is up: lighthouse, and per replica manager, store, gloo.
                opened = sorted(set(listening_sockets(os.getpid())) - baseline)
    return torch.stack(trajectory), opened


def _no_transport():
    from torchft.checkpointing.transport import CheckpointTransport

    class NoTransport(CheckpointTransport):
        """Listens nowhere, sends and receives nothing (torchft's default HTTPTransport binds '::')."""

        def metadata(self) -> str:
            return ""

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            raise RuntimeError("no state transfer here: both replicas start from the same weights")

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            raise RuntimeError("no state transfer here: both replicas start from the same weights")

    return NoTransport()


def _in_threads(functions) -> list:
    """Each function in its own thread; their results, or the first error re-raised here."""
    results, errors = [None] * len(functions), []

    def run(index: int) -> None:
        try:
            results[index] = functions[index]()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(functions))]
    for thread in threads:
        thread.start()
    # A replica whose peer failed waits at most one quorum or collective timeout per sync.
    deadline = time.monotonic() + 6 * TIMEOUT.total_seconds()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError("a torchft replica did not finish")
    return results


def _wait_released(baseline: set, seconds: float = 10.0) -> None:
    # gloo closes its listener with the last reference to its backend.
    deadline = time.monotonic() + seconds
    while (left := set(listening_sockets(os.getpid())) - baseline) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not left, f"listeners left open after the run: {sorted(left)}"


# ------------------------------------------------------------------ the golden comparison
def torchft_test(function):
    """Marks of a test that runs torchft's DiLoCo on real gloo groups (threads of this process)."""
    for mark in (pytest.mark.distributed, pytest.mark.timeout(120),
                 pytest.mark.skipif(sys.platform != "linux", reason="reads listening sockets from /proc"),
                 pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning"),
                 pytest.mark.usefixtures("one_torch_thread")):
        function = mark(function)
    return function


@torchft_test
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_same_trajectory_as_torchft_diloco(config):
    pytest.importorskip("torchft")
    theirs = _torchft_run(config)
    syncs = config.steps // (config.inner_steps // config.fragments)
    assert theirs.committed == [syncs] * REPLICAS  # every sync committed, none retried, nobody healed
    # lighthouse + per replica: manager server, store, gloo device; all on loopback
    assert len(set(theirs.opened)) == 1 + 3 * REPLICAS and non_loopback(theirs.opened) == []
    assert not torch.equal(theirs.trajectories[0], theirs.trajectories[1])  # the replicas do differ
    if config.alpha == 0.0:  # torchft did sync: fragment 0 is the same global value on both after step h
        start, end = _bounds(_model(), config.fragments)[0]
        synced = theirs.trajectories[:, config.inner_steps // config.fragments - 1, start:end]
        assert torch.equal(synced[0], synced[1])
    for stacked in (False, True):
        ours = _our_trajectories(config, stacked=stacked)
        torch.testing.assert_close(ours, theirs.trajectories, rtol=1e-5, atol=1e-5)


@torchft_test
@pytest.mark.parametrize("wrong", [dict(alpha=0.0), dict(delay=0), dict(first_fragment=1)],
                         ids=["alpha", "delay", "first_fragment"])
def test_a_wrong_rule_leaves_torchft_trajectory(wrong):
    """The comparison can fail: each rule changed on its own moves the trajectory far beyond float32 noise."""
    pytest.importorskip("torchft")
    theirs = _torchft_run(CHECKED).trajectories
    assert (_our_trajectories(CHECKED, **wrong) - theirs).abs().max() > 1e-3


# ------------------------------------------------------------------ DiLoCoStrategy under Lightning: two ranks
class _GoldenRegressor(pl.LightningModule):
    """The golden model, inner optimizer and batches as a LightningModule: rank r sees replica r's batches."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.net = _model()
        self.steps = steps

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _inner_optimizer(self.net)

    def train_dataloader(self) -> DataLoader:
        inputs, targets = _batches(self.global_rank, self.steps)  # (T, B, C): batch t is inputs[t]
        return DataLoader(TensorDataset(inputs.flatten(0, 1), targets.flatten(0, 1)), batch_size=BATCH)


class _RecordSteps(Callback):
    """Each rank records its parameters after every optimizer step (the strategy's sync included) and saves
    them as training ends, before the end-of-fit averaging, with the sockets its process listens on."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.trajectory = out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        self.trajectory.append(_flat(pl_module.net).clone())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"trajectory": torch.stack(self.trajectory), "round_index": trainer.strategy.round_index,
                  "listening": listening_sockets(os.getpid())}
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")


def _strategy_trajectories(config: Config, out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """DiLoCoStrategy on two forked ranks; the rendezvous store listens on loopback only (held here)."""
    from gasloc_lightning.comm.endpoints import Endpoint, listening_store

    strategy = DiLoCoStrategy(inner_steps=config.inner_steps, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                              fragments=config.fragments, fragment_sync_delay=config.delay,
                              fragment_update_alpha=config.alpha, consensus_every=0, start_method="fork",
                              gossip_timeout=TIMEOUT.total_seconds())
    # A master TCPStore binds the wildcard and gloo the host name's address: every rank dials a store held
    # here instead (torch's agent-store rendezvous), and gloo listens on the loopback interface.
    baseline = set(listening_sockets(os.getpid()))
    store = listening_store(Endpoint(), timeout=TIMEOUT.total_seconds())
    gc.collect()
    gc.freeze()  # a forked rank never frees what it inherited (torchft objects would hang it: see _torchft_run)
    try:
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(store.port)),
                            ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("GLOO_SOCKET_IFNAME", "lo")):
            monkeypatch.setenv(name, value)
        trainer = pl.Trainer(accelerator="cpu", devices=REPLICAS, strategy=strategy, max_steps=config.steps,
                             limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=None, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, default_root_dir=out_dir,
                             callbacks=[_RecordSteps(out_dir)])
        trainer.fit(_GoldenRegressor(config.steps))
    finally:
        gc.unfreeze()
        _stop_ranks(strategy)
        del store
    _wait_released(baseline)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(REPLICAS)]


def _stop_ranks(strategy: DiLoCoStrategy) -> None:
    # A rank still alive here was left by a failed fit (e.g. the test's timeout): a forked rank handles
    # SIGTERM by setting a flag, so it is killed, and joined, so that none outlives the test.
    for process in getattr(strategy.launcher, "procs", []):
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


@torchft_test
@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
@pytest.mark.parametrize("config", [CHECKED, Config(6, 3, 1, 0.25)], ids=str)
def test_diloco_strategy_follows_torchft_diloco(config, tmp_path, monkeypatch):
    """Lightning's Trainer with DiLoCoStrategy (fragments, fragment_sync_delay, fragment_update_alpha) on two
    gloo ranks follows torchft's DiLoCo on two replicas, step by step, on both ranks."""
    pytest.importorskip("torchft")
    ranks = _strategy_trajectories(config, tmp_path, monkeypatch)
    ours = torch.stack([rank["trajectory"] for rank in ranks])  # (replicas, steps, P)
    theirs = _torchft_run(config).trajectories
    assert [rank["round_index"] for rank in ranks] == [config.steps // config.inner_steps] * REPLICAS
    assert all(rank["listening"] and non_loopback(rank["listening"]) == [] for rank in ranks)
    assert not torch.equal(ours[0], ours[1])  # each rank trained on its own batches
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
