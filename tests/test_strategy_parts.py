"""Unit tests of the strategy's collaborators, through their public interfaces (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gasloc_lightning.comm.flat import FlatLayout
from gasloc_lightning.strategies.consensus import ConsensusSwap
from gasloc_lightning.strategies.guards import NonFiniteGuard
from gasloc_lightning.strategies.schedule import RoundSchedule
from gasloc_lightning.strategies.worker_groups import WorkerGroups


class MaskedNet(nn.Module):
    """Tied weights, a frozen layer, an additive -inf causal mask, a non-persistent cache, BatchNorm."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.full((3, 3), float("-inf")).triu(1))
        self.register_buffer("cache", torch.ones(2), persistent=False)


# ------------------------------------------------------------------ FlatLayout
def test_layout_exchanges_trainable_parameters_once_and_only_persistent_finite_float_buffers():
    net = MaskedNet()
    layout = FlatLayout(net)
    assert [id(p) for p in layout.parameters] == [id(net.embed.weight), id(net.norm.weight), id(net.norm.bias)]
    assert [id(b) for b in layout.buffers] == [id(net.norm.running_mean), id(net.norm.running_var)]
    assert layout.numel == 20 + 4 + 4 + 4 + 4  # tied weight once; no frozen, mask, cache or num_batches_tracked


def test_bound_layout_is_the_live_model_and_keeps_the_parameter_objects():
    net = MaskedNet()
    before = {name: t.detach().clone() for name, t in net.state_dict().items()}
    weight = net.embed.weight
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    layout = FlatLayout(net)
    assert layout.bound and net.embed.weight is weight and net.head.weight is weight
    for name, tensor in net.state_dict().items():  # binding moved no value
        assert torch.equal(tensor, before[name]), name
    live = layout.read()
    params, buffers = layout.split(live)
    params[:20].fill_(2.0)  # writing the flat vector writes the model, tied copy included
    assert torch.equal(net.head.weight, torch.full((5, 4), 2.0))
    weight.grad = torch.ones_like(weight)
    optimizer.step()  # the optimizer still steps the same objects, and the flat vector sees it
    assert torch.equal(layout.read()[:20], torch.full((20,), 1.5))
    assert layout.is_live(live) and not layout.is_live(live.clone())


def test_unbound_layout_gathers_and_scatters_with_casts():
    net = nn.Sequential(nn.Linear(3, 2)).to(torch.bfloat16)
    layout = FlatLayout(net)
    assert not layout.bound
    flat = layout.read()
    assert flat.dtype == torch.float32 and torch.equal(flat[:6], net[0].weight.float().flatten())
    layout.scatter(torch.arange(8, dtype=torch.float32))
    assert net[0].weight.dtype == torch.bfloat16 and net[0].bias.tolist() == [6.0, 7.0]


def test_signature_digest_tells_architectures_apart():
    assert FlatLayout(nn.Linear(3, 2)).signature_digest() == FlatLayout(nn.Linear(3, 2)).signature_digest()
    assert FlatLayout(nn.Linear(3, 2)).signature_digest() != FlatLayout(nn.Linear(2, 3)).signature_digest()


# ------------------------------------------------------------------ RoundSchedule
def test_schedule_counts_rounds_and_lets_short_workers_compute_without_applying():
    schedule = RoundSchedule([2, 3])
    schedule.resolve(world_size=2, ranks_per_worker=1)
    applied = {0: 0, 1: 0}
    ends = []
    for step in range(6):
        for rank in applied:
            applied[rank] += schedule.applies_step(rank)
        if schedule.count_step():
            ends.append(step)
            schedule.finish_round()
    assert schedule.round_length == 3 and ends == [2, 5] and applied == {0: 4, 1: 6}
    assert schedule.state_dict() == {"round_index": 2, "steps_in_round": 0}


def test_schedule_refuses_bad_inner_steps():
    with pytest.raises(ValueError, match="inner_steps"):
        RoundSchedule(0)
    with pytest.raises(ValueError, match="needs a network"):
        RoundSchedule("auto")
    with pytest.raises(ValueError, match="one H_i per rank"):
        RoundSchedule([1, 2, 3]).resolve(world_size=2, ranks_per_worker=1)
    with pytest.raises(ValueError, match="equal on the ranks of one worker"):
        RoundSchedule([2, 3, 4, 4]).resolve(world_size=4, ranks_per_worker=2)


# ------------------------------------------------------------------ NonFiniteGuard
def test_guard_skips_then_raises_after_max_consecutive_rounds():
    guard = NonFiniteGuard("skip_round", max_skipped_rounds=2)
    bad = torch.tensor([1.0, float("nan")])
    assert guard.local_point_is_usable(torch.ones(2), "r0") is True
    assert guard.local_point_is_usable(bad, "r0") is False
    assert guard.local_point_is_usable(bad, "r0") is False
    with pytest.raises(FloatingPointError, match="3 consecutive rounds"):
        guard.local_point_is_usable(bad, "r0")
    assert guard.skipped_rounds == 3
    with pytest.raises(FloatingPointError, match="on_nonfinite='raise'"):
        NonFiniteGuard("raise").local_point_is_usable(bad, "r0")


def test_guard_drops_non_finite_messages_and_counts_them():
    guard = NonFiniteGuard()
    received = [(0.25, torch.ones(2)), (0.25, torch.tensor([float("inf"), 0.0]))]
    assert [w for w, _ in guard.accept(received, [1, 2], "r0")] == [0.25]
    assert guard.rejected_exchanges == 1
    restored = NonFiniteGuard()
    restored.load_state_dict(guard.state_dict())
    assert restored.rejected_exchanges == 1


# ------------------------------------------------------------------ ConsensusSwap
def test_consensus_swap_shows_the_mean_and_restores_the_replica():
    net = nn.Linear(2, 1)
    layout = FlatLayout(net)
    replica = layout.read().clone()
    other = replica + 2.0  # a second replica, as the collective would see it
    drained = []
    swap = ConsensusSwap(layout, replica_mean=lambda flat: (flat + other) / 2, drain=lambda: drained.append(1))
    swap.swap_in()
    assert drained and swap.swapped_in and torch.allclose(layout.read(), replica + 1.0)
    swap.show_local()
    assert torch.equal(layout.read(), replica)
    swap.show_consensus()
    assert torch.allclose(layout.read(), replica + 1.0)
    swap.restore()
    assert not swap.swapped_in and torch.equal(layout.read(), replica)
    swap.make_permanent()
    assert not swap.swapped_in and torch.allclose(layout.read(), replica + 1.0)


# ------------------------------------------------------------------ WorkerGroups
def test_worker_groups_map_ranks_to_workers_and_leaders():
    groups = WorkerGroups(ranks_per_worker=2)
    assert [groups.worker_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [groups.is_leader(r) for r in range(4)] == [True, False, True, False]
    assert groups.num_workers(4) == 2
    with pytest.raises(ValueError, match="not divisible"):
        groups.check_world_size(3)
    with pytest.raises(ValueError, match="ranks_per_worker"):
        WorkerGroups(0)
