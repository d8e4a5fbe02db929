"""Uneven workers and links: per-rank H_i, bfloat16 messages, overlapped gossip (real gloo, forked workers)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from dist_utils import RecordParameters, TinyRegressor, flat_parameters, load_ranks
from gasloc_lightning import GASLoCCallback, GASLoCStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def run(tmp_path, strategy, model=None, devices=2, max_steps=9, perturb=0.0):
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False, limit_val_batches=0, default_root_dir=tmp_path,
               callbacks=[RecordParameters(str(tmp_path), perturb)]).fit(model or TinyRegressor())
    return load_ranks(tmp_path, devices)


def gossip_only(**kwargs):
    """Inner lr 0, eta 1, gamma 0: only the exchange moves the replicas."""
    return GASLoCStrategy(outer_lr=1.0, outer_momentum=0.0, start_method="fork", gossip_timeout=60.0, **kwargs)


def test_per_rank_inner_steps_keep_rounds_aligned(tmp_path, fresh_port):
    records = run(tmp_path, GASLoCStrategy(inner_steps=[3, 1], start_method="fork", gossip_timeout=60.0))
    assert [r["rounds_at_fit_end"] for r in records] == [3, 3]  # round length max(H_i) = 3 on both
    history, rounds = records[1]["history"], records[1]["rounds"]
    moved = [not torch.equal(history[k], history[k - 1]) for k in range(1, len(history))]
    # rank 1 (H_1 = 1) applies only the first step of each round; the third step of a round moves by the exchange
    assert moved == [True, False, True] * 3
    assert rounds == records[0]["rounds"]


def test_inner_steps_per_rank_must_match_the_world_size():
    with pytest.raises(ValueError, match="inner_steps has 3 values"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=GASLoCStrategy(inner_steps=[1, 2, 3]), logger=False)


def test_bfloat16_messages_halve_the_bytes_and_keep_the_mean(tmp_path, fresh_port):
    model = TinyRegressor(inner_lr=0.0, optimizer="sgd")
    records = run(tmp_path, gossip_only(inner_steps=3, message_dtype="bfloat16", consensus_every=0),
                  model=model, devices=4, perturb=0.5)
    history = torch.stack([r["history"] for r in records])  # (ranks, records, P)
    mean = history.mean(0)
    assert ((mean - mean[0]).norm(dim=1) <= 1e-6 * mean[0].norm()).all()
    spread = ((history - mean) ** 2).sum(dim=(0, 2))
    assert spread[-1] < 0.5 * spread[0]
    for record in records:
        assert record["bytes_sent"] == 3 * record["exchanged_numel"] * 2  # 3 rounds, one peer, 2 bytes each
    # the end-of-fit consensus is averaged in float32, not in the wire's bfloat16
    consensus = torch.stack([r["final"] for r in records]).mean(0)
    assert all(torch.allclose(r["after_fit"], consensus, rtol=0, atol=1e-6) for r in records)


def test_complete_topology_refuses_overlap_and_bfloat16():
    for kwargs in ({"overlap": True}, {"message_dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="point-to-point gossip"):
            pl.Trainer(accelerator="cpu", devices=2, logger=False,
                       strategy=GASLoCStrategy(topology="complete", **kwargs))


def test_ranks_per_worker_behave_as_one_worker(tmp_path, fresh_port):
    """4 ranks, 2 per worker: DDP inside a worker (identical replicas), gossip between the 2 workers."""
    strategy = GASLoCStrategy(inner_steps=3, ranks_per_worker=2, start_method="fork", gossip_timeout=60.0)
    records = run(tmp_path, strategy, devices=4)
    history = torch.stack([r["history"] for r in records])  # (ranks, records, P)
    assert torch.equal(history[0], history[1]) and torch.equal(history[2], history[3])
    assert not torch.allclose(history[0, 2], history[2, 2])  # mid-round: the two workers differ
    assert torch.allclose(history[0, 3], history[2, 3], atol=1e-6)  # after the pairwise round: averaged
    assert records[0]["bytes_sent"] > 0 and records[1]["bytes_sent"] == 0  # only the leader exchanges


def test_overlapped_final_flush_reaches_every_rank_of_a_worker(tmp_path, fresh_port):
    # Before: only the worker's first rank folded in the last delayed exchange; its second rank ended apart.
    strategy = GASLoCStrategy(inner_steps=3, ranks_per_worker=2, overlap=True, start_method="fork",
                              gossip_timeout=60.0)
    pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=9, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False, limit_val_batches=0, default_root_dir=tmp_path,
               callbacks=[RecordParameters(str(tmp_path)), GASLoCCallback(average_at_end=False)]).fit(TinyRegressor())
    records = load_ranks(tmp_path, 4)
    assert torch.equal(records[0]["after_fit"], records[1]["after_fit"])
    assert torch.equal(records[2]["after_fit"], records[3]["after_fit"])
    assert not torch.equal(records[0]["after_fit"], records[0]["final"])  # the flush did move the leader


def test_ranks_of_one_worker_share_their_inner_steps_and_ddp_arguments_need_a_worker():
    with pytest.raises(ValueError, match="equal on the ranks of one worker"):
        pl.Trainer(accelerator="cpu", devices=4, logger=False,
                   strategy=GASLoCStrategy(inner_steps=[2, 3, 4, 4], ranks_per_worker=2))
    with pytest.raises(ValueError, match="worker_ddp_kwargs applies inside a worker"):
        GASLoCStrategy(worker_ddp_kwargs={"find_unused_parameters": True})


def test_ranks_must_divide_into_workers():
    with pytest.raises(ValueError, match="not divisible by ranks_per_worker=2"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=GASLoCStrategy(ranks_per_worker=2), logger=False)


from gasloc_lightning.network import NetworkModel, SimulatedClock, round_pairs  # noqa: E402
from gasloc_lightning.topology import BandwidthAwareTopology, build_topology  # noqa: E402


def two_clusters(speeds=None) -> NetworkModel:
    return NetworkModel.clusters(sizes=[2, 2], intra_gbps=100.0, intra_latency_s=1e-5, inter_gbps=1.0,
                                 inter_latency_s=0.03, speeds=speeds, model_parameters=10_000_000)


def simulate_gossip(network, topology, inner_steps, rounds, overlap=False):
    """Every worker's clock, simulated locally: the oracle for what the ranks log."""
    n = network.world_size
    clocks = [SimulatedClock(network, rank=r) for r in range(n)]
    posted: list[dict[int, float]] | None = None
    previous_pairs = None
    for t in range(rounds):
        for r, clock in enumerate(clocks):
            clock.advance_compute(inner_steps[r])
        pairs = round_pairs(topology, n, t)
        if overlap and posted is not None:
            for r, clock in enumerate(clocks):
                clock.complete_exchange(peer_clocks=posted[r], pairs=previous_pairs)
        sent = [clock.post_exchange() for clock in clocks]
        posted = [{j: sent[j] for j in topology.mixing_weights(r, n, t)} for r in range(n)]
        if not overlap:
            for r, clock in enumerate(clocks):
                clock.complete_exchange(peer_clocks=posted[r], pairs=pairs)
        previous_pairs = pairs
    if overlap:  # end of training: the last exchange is folded in
        for r, clock in enumerate(clocks):
            clock.complete_exchange(peer_clocks=posted[r], pairs=previous_pairs)
    return [clock.time for clock in clocks]


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_simulated_clock_matches_the_local_oracle(tmp_path, fresh_port, overlap):
    network = two_clusters(speeds=[1.0, 1.0, 1.0, 0.5])
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0, network=network,
                              overlap=overlap, outer_momentum=0.5, seed=3)
    records = run(tmp_path, strategy, devices=4)
    expected = simulate_gossip(network, build_topology("one_peer", seed=3), [3, 3, 3, 3], 3, overlap)
    for rank, record in enumerate(records):
        assert record["sim_time_at_fit_end"] == pytest.approx(expected[rank], rel=1e-12)
    without_straggler = simulate_gossip(two_clusters(), build_topology("one_peer", seed=3), [3, 3, 3, 3], 3, overlap)
    assert max(expected) > max(without_straggler)  # the straggler's slower steps cost simulated time


def test_overlap_hides_communication_in_simulated_time():
    network = two_clusters()
    topology = build_topology("one_peer", seed=3)
    blocking = simulate_gossip(network, topology, [3] * 4, 6, overlap=False)
    overlapped = simulate_gossip(network, topology, [3] * 4, 6, overlap=True)
    assert max(overlapped) < max(blocking)


def test_auto_inner_steps_follow_the_speeds(tmp_path, fresh_port):
    network = two_clusters(speeds=[1.0, 1.0, 0.5, 0.5])
    strategy = GASLoCStrategy(inner_steps="auto", fastest_inner_steps=4, start_method="fork",
                              gossip_timeout=60.0, network=network)
    records = run(tmp_path, strategy, devices=4, max_steps=8)
    assert [r["rounds_at_fit_end"] for r in records] == [2, 2, 2, 2]
    # equal simulated compute per round: 4 steps at speed 1 == 2 steps at speed 0.5
    steps = network.step_time(0) * 4
    assert all(r["sim_time_at_fit_end"] >= 2 * steps for r in records)


def test_diloco_clock_is_the_max_plus_an_all_reduce(tmp_path, fresh_port):
    from gasloc_lightning import DiLoCoStrategy

    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=10.0, latency_s=0.001, speeds=[1.0, 0.5],
                                   model_parameters=10_000_000)
    records = run(tmp_path, DiLoCoStrategy(inner_steps=3, start_method="fork", network=network), devices=2)
    per_round = 3 * network.step_time(1) + network.all_reduce_time(network.message_bytes())
    for record in records:
        assert record["sim_time_at_fit_end"] == pytest.approx(3 * per_round, rel=1e-12)


def test_throttle_sleeps_for_the_modelled_time_off_compute(tmp_path, fresh_port):
    """DiLoCo, 3 rounds of 3 steps: rank 1 (speed 1) waits for rank 0 (speed 0.5), then both all-reduce."""
    from gasloc_lightning import DiLoCoStrategy

    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=10.0, latency_s=0.001, speeds=[0.5, 1.0],
                                   model_parameters=1_000_000, throttle=1e-3)
    records = run(tmp_path, DiLoCoStrategy(inner_steps=3, start_method="fork", network=network), devices=2)
    for rank, record in enumerate(records):
        off_compute = record["sim_time_at_fit_end"] - 9 * network.step_time(rank)
        assert off_compute > 0
        assert record["throttled_seconds"] == pytest.approx(1e-3 * off_compute, rel=1e-9)
    assert records[1]["throttled_seconds"] > records[0]["throttled_seconds"]  # the fast one also waits


def test_network_of_the_wrong_size_fails_before_training():
    with pytest.raises(ValueError, match="world"):
        pl.Trainer(accelerator="cpu", devices=2, logger=False,
                   strategy=GASLoCStrategy(network=two_clusters()))
    with pytest.raises(ValueError, match="inner_steps='auto' needs a network"):
        GASLoCStrategy(inner_steps="auto")


def test_ddp_gets_a_simulated_clock_through_the_callback(tmp_path, fresh_port):
    from lightning.pytorch.strategies import DDPStrategy

    from gasloc_lightning import SimulatedClockCallback
    from gasloc_lightning.strategies.baselines import CpuThreads  # one thread per forked worker: no OpenMP hang after fork

    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=10.0, latency_s=0.001, speeds=[1.0, 0.5],
                                   model_parameters=10_000_000)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="fork"), max_steps=5,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[SimulatedClockCallback(network), CpuThreads()])
    trainer.fit(TinyRegressor())
    per_step = network.step_time(1) + network.all_reduce_time(network.message_bytes())
    assert float(trainer.callback_metrics["sim_time"]) == pytest.approx(5 * per_step, rel=1e-6)


def delayed_gossip_reference(theta, anchor, matrices, gamma):
    """The overlapped round stacked over workers, with no gradients (z = theta), in float64.

    theta+ = u + (W(t-1) - I) p(t-1) with u = theta + gamma (theta - x); the point sent, p(t), is
    theta+ itself (the delayed correction included); x+ = (theta+ + gamma x) / (1 + gamma).
    """
    x, in_flight, trajectory = anchor.expand_as(theta).clone(), torch.zeros_like(theta), []
    for W in matrices:
        theta_next = theta + gamma * (theta - x) + in_flight
        x = (theta_next + gamma * x) / (1 + gamma)
        in_flight = W @ theta_next - theta_next
        theta = theta_next
        trajectory.append(theta)
    return torch.stack(trajectory)  # (rounds, ranks, P)


def test_overlapped_gossip_is_the_delayed_rule_and_keeps_the_mean(tmp_path, fresh_port):
    model = TinyRegressor(inner_lr=0.0, optimizer="sgd")
    strategy = GASLoCStrategy(outer_lr=1.0, outer_momentum=0.5, overlap=True, inner_steps=2, consensus_every=0,
                              start_method="fork", gossip_timeout=60.0)
    records = run(tmp_path, strategy, model=model, devices=4, max_steps=16, perturb=0.5)
    history = torch.stack([r["history"] for r in records])  # (ranks, steps + 1, P)
    matrices = [build_topology("one_peer").mixing_matrix(4, t) for t in range(8)]
    # x(0) is the common start before RecordParameters perturbs each replica: a momentum kick in round 0.
    start = flat_parameters(TinyRegressor())
    expected = delayed_gossip_reference(history[:, 0], start, matrices, gamma=0.5)
    torch.testing.assert_close(history[:, 2::2].transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    # The delayed terms cancel in the mean: it moves exactly as with no exchange at all (W = I).
    alone = delayed_gossip_reference(history[:, 0], start, [torch.eye(4, dtype=torch.float64)] * 8, gamma=0.5)
    torch.testing.assert_close(history[:, 2::2].mean(0), alone.mean(1), atol=1e-5, rtol=1e-5)
    spread = ((history - history.mean(0)) ** 2).sum(dim=(0, 2))
    assert spread[-1] < 0.05 * spread[0]


def test_overlap_is_refused_where_its_delayed_form_cannot_contract():
    # Two clusters of 4 with bandwidth-aware peers: the delayed form's largest stable gamma is about 0.93
    # (estimated by simulating the seeded schedule).
    topology = BandwidthAwareTopology.from_clusters([4, 4])
    limit = topology.max_stable_momentum(8, "anchored", overlap=True, delayed_weight=1.0)
    assert 0.8 < limit < 0.99
    with pytest.raises(ValueError, match="unstable"):
        pl.Trainer(accelerator="cpu", devices=8, logger=False,
                   strategy=GASLoCStrategy(topology=topology, overlap=True, outer_momentum=0.99))
