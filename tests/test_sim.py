"""The single-process simulator: its rounds against the mixing matrices, churn, refusals and the app's run record."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from dist_utils import write_text_corpus
from gasloc_lightning.algorithm.outer import OuterState
from gasloc_lightning.app import compare as compare_app
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.sim import (ChurnSchedule, DiLoCoRounds, GossipRounds, WorkerClocks, check_memory,
                                  estimate_bytes, resolve_outer_momentum)
from gasloc_lightning.topology import build_topology

pytestmark = pytest.mark.timeout(300)


def _points(n: int = 6, p: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, p, generator=torch.Generator().manual_seed(seed))


def test_outer_state_acts_row_by_row_on_stacked_points():
    start, ends = _points(4, 10, 0), _points(4, 10, 1)
    stacked = OuterState(start, outer_lr=0.7, outer_momentum=0.5)
    u = stacked.message(ends.clone())
    for i in range(4):
        alone = OuterState(start[i], outer_lr=0.7, outer_momentum=0.5)
        torch.testing.assert_close(alone.message(ends[i].clone()), u[i], rtol=0, atol=0)


def test_plain_gossip_round_is_the_mixing_matrix():
    """eta 1, gamma 0: one round moves the stacked points to W(t) theta."""
    topology = build_topology("one_peer", seed=3)
    points = _points()
    rounds = GossipRounds(initial=points.clone(), topology=topology, outer_lr=1.0, outer_momentum=0.0,
                          clocks=WorkerClocks(None, 6))
    for t in range(3):
        expected = topology.mixing_matrix(6, t).float() @ points
        rounds.communicate(points, t, list(range(6)))
        torch.testing.assert_close(points, expected, rtol=1e-6, atol=1e-6)
    assert float(rounds.bytes_sent[0]) == 3 * 40 * 4  # one peer per round, float32


def test_bfloat16_round_keeps_each_rounding_residual_and_the_mean():
    """theta' = W m + (u - m) with m = bf16(u), so the mean is u's."""
    topology = build_topology("ring")
    points = _points()
    u = points.clone()
    rounds = GossipRounds(initial=points.clone(), topology=topology, outer_lr=1.0, outer_momentum=0.0,
                          message_codec="bfloat16", clocks=WorkerClocks(None, 6))
    rounds.communicate(points, 0, list(range(6)))
    m = u.bfloat16().float()
    torch.testing.assert_close(points, topology.mixing_matrix(6, 0).float() @ m + (u - m), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(points.mean(0), u.mean(0), rtol=0, atol=1e-6)


def test_overlap_folds_each_exchange_in_one_round_late():
    topology = build_topology("one_peer", seed=1)
    points = _points()
    rounds = GossipRounds(initial=points.clone(), topology=topology, outer_lr=1.0, outer_momentum=0.0,
                          overlap=True, clocks=WorkerClocks(None, 6))
    first = points.clone()
    rounds.communicate(points, 0, list(range(6)))
    torch.testing.assert_close(points, first)  # nothing to fold in yet
    rounds.communicate(points, 1, list(range(6)))
    expected = first + (topology.mixing_matrix(6, 0).float() @ first - first)  # p(1) = u(1) + C(0)
    torch.testing.assert_close(points, expected, rtol=1e-6, atol=1e-6)


def test_diloco_round_is_nesterov_sgd_on_the_mean_pseudo_gradient():
    start, ends = _points(1, 10, 0).expand(4, 10).clone(), _points(4, 10, 1)
    rounds = DiLoCoRounds(initial=start, outer_lr=0.7, outer_momentum=0.9, clocks=WorkerClocks(None, 4))
    flat = ends.clone()
    rounds.communicate(flat, 0, list(range(4)))
    delta = (start[0] - ends).mean(0)
    expected = start[0] - 0.7 * (delta + 0.9 * delta)  # first Nesterov step: b = delta
    for row in flat:
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=1e-6)


def test_clocks_advance_with_compute_and_wait_for_the_slower_peer():
    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=1.0, latency_s=0.0, speeds=[1.0, 0.5],
                                   model_parameters=1000, step_time_s=1.0)
    clocks = WorkerClocks(network, 2)
    rounds = GossipRounds(initial=_points(2, 4), topology=build_topology("one_peer"), outer_lr=1.0,
                          outer_momentum=0.0, clocks=clocks)
    clocks.advance_compute([0, 1])
    rounds.communicate(_points(2, 4), 0, [0, 1])
    transfer = network.pairwise_time(0, 1, network.message_bytes())
    assert clocks.times() == pytest.approx([2.0 + transfer, 2.0 + transfer])  # both wait for the slow one


def test_churn_schedule_is_seeded_keeps_the_quorum_and_joiners_copy_a_live_peer():
    schedule = ChurnSchedule(workers=32, rounds=60, down_fraction=0.2, mean_downtime_rounds=3, min_live=8, seed=4)
    again = ChurnSchedule(workers=32, rounds=60, down_fraction=0.2, mean_downtime_rounds=3, min_live=8, seed=4)
    assert [e.live for e in schedule.events] == [e.live for e in again.events]
    assert all(len(e.live) >= 8 for e in schedule.events)
    assert any(e.joins for e in schedule.events) and any(e.left for e in schedule.events)
    for previous, event in zip(schedule.events, schedule.events[1:]):
        for worker, source in event.joins.items():
            assert worker not in previous.live and source in previous.live and source not in event.left
    assert 0.6 < schedule.goodput() < 0.95


def test_churn_that_empties_the_quorum_is_refused():
    with pytest.raises(ValueError, match="quorum min_live=6"):
        ChurnSchedule(workers=8, rounds=100, down_fraction=0.5, min_live=6, seed=0)


def test_worker_count_without_a_valid_topology_or_stable_gamma_is_refused():
    with pytest.raises(ValueError, match="sim.workers=6 has no valid 'exponential' topology"):
        resolve_outer_momentum(build_topology("exponential"), 6, None, "anchored", False, 1.0)
    with pytest.raises(ValueError, match="unstable"):
        resolve_outer_momentum(build_topology("exponential"), 64, 0.9, "anchored", False, 1.0)
    assert resolve_outer_momentum(build_topology("one_peer"), 16, None, "anchored", False, 1.0) == 0.9


def test_a_run_that_does_not_fit_is_refused_with_the_estimate():
    estimated = estimate_bytes(workers=1024, parameters=86_000_000, batch_size=8, block_size=1024, n_layer=12,
                               n_embd=768, n_head=12, vocab_size=256)
    with pytest.raises(ValueError, match=r"needs about .* GiB \([\d,]+ bytes\)"):
        check_memory(estimated)


# ------------------------------------------------------------------ the app
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _compose(corpus: Path, tmp_path: Path, overrides: list[str]):
    quick = ["experiment=demo", "trainer.max_steps=4", "trainer.val_check_interval=2", "inner_steps=2",
             f"data.source={corpus}", "data.val_fraction=0.25", "data.batch_size=4", "data.val_batches=1",
             f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "sim.workers=4",
             "sim.progress_every=1"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=quick + overrides)


def test_app_writes_a_run_record_that_gasloc_compare_reads(corpus, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    runs = []
    for strategy in ("gasloc", "diloco"):
        cfg = _compose(corpus, tmp_path / strategy, [f"strategy={strategy}"])
        loss = sim_app.simulate(cfg)
        runs.append(tmp_path / strategy / "out")
        record = json.loads((runs[-1] / "summary.json").read_text())
        assert record["final"]["val_loss"] == pytest.approx(loss)
        assert record["strategy"]["name"] == strategy and record["strategy"]["engine"] == "sim"
        assert record["budget"]["rounds"] == 2 and record["world_size"] == 4
        with (runs[-1] / record["metrics_csv"]).open() as file:
            rows = list(csv.DictReader(file))
        assert [float(r["val/loss"]) for r in rows if r["val/loss"]][-1] == pytest.approx(loss)
    assert "round=2 step=4/4 alive=4/4" in caplog.text
    comparison = compare_app.compare(runs, tmp_path / "cmp", plots=False)
    assert len(comparison.runs) == 2 and "diloco" in comparison.table


def test_app_refuses_bad_input_before_any_step(corpus, tmp_path):
    with pytest.raises(ValueError, match="no valid 'exponential' topology"):
        sim_app.build(_compose(corpus, tmp_path, ["topology=exponential", "sim.workers=6"]))
    with pytest.raises(ValueError, match="bytes"):
        sim_app.build(_compose(corpus, tmp_path, ["sim.max_memory_gb=0.001"]))
    with pytest.raises(ValueError, match="quorum"):
        sim_app.build(_compose(corpus, tmp_path, ["sim.down_fraction=0.9", "sim.min_live=4"]))


def test_app_with_churn_logs_live_workers_and_goodput(corpus, tmp_path):
    cfg = _compose(corpus, tmp_path, ["sim.workers=8", "sim.down_fraction=0.3", "sim.mean_downtime_rounds=1",
                                      "sim.min_live=2", "sim.churn_seed=1", "trainer.max_steps=8",
                                      "trainer.val_check_interval=8", "inner_steps=1"])
    sim_app.simulate(cfg)
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["sim"]["goodput"] < 1.0
    every = 8 * 8 * cfg.data.batch_size * cfg.data.block_size  # 8 workers x 8 steps, had none been down
    assert record["budget"]["tokens"] == pytest.approx(record["sim"]["goodput"] * every)  # H = 1: a round is a step
    with (tmp_path / "out" / record["metrics_csv"]).open() as file:
        alive = {float(r["comm/workers_alive"]) for r in csv.DictReader(file) if r["comm/workers_alive"]}
    assert min(alive) < 8


def test_chunked_steps_match_one_pass_over_every_replica():
    """Chunks of 3 over 7 replicas (a ragged last chunk) give each replica the gradients and step of one pass."""
    from functools import partial

    from gasloc_lightning.models.gpt import GPT, GPTConfig
    from gasloc_lightning.sim.replicas import StackedReplicas

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    stacks = [StackedReplicas(module=model, workers=7, optimizer_factory=partial(torch.optim.AdamW, lr=1e-2),
                              gradient_clip_val=0.5, chunk_size=size) for size in (7, 3)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 256, (7, 2, 16), generator=generator)
        y = torch.randint(0, 256, (7, 2, 16), generator=generator)
        losses = [stack.step(x, y) for stack in stacks]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stacks[0].flat, stacks[1].flat, rtol=1e-5, atol=1e-6)
    assert not torch.equal(stacks[1].flat[0], stacks[1].flat[6])  # each replica took its own steps


def _poison_worker(simulator, worker: int, steps: set[int]) -> None:
    """After the chosen steps, ``worker``'s parameters and first moments go NaN (as a NaN loss would leave them)."""
    train_step = simulator.replicas.train_step

    def poisoned(x, y, step_in_round, rows=None):
        losses = train_step(x, y, step_in_round, rows=rows)
        if simulator.step in steps:
            simulator.replicas.flat[worker].fill_(float("nan"))
            for state in simulator.replicas.optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"][worker].fill_(float("nan"))
        return losses

    simulator.replicas.train_step = poisoned


@pytest.mark.parametrize("strategy", ["gasloc", "diloco"])
def test_a_non_finite_worker_discards_its_round_as_the_strategy_does(corpus, tmp_path, strategy):
    """skip_round (the default): the worker's point goes back to its round start, its optimizer state is
    repaired, it still takes part, and the run ends finite; raise stops at once; too many skips stop too."""
    simulator, _ = sim_app.build(_compose(corpus, tmp_path, [f"strategy={strategy}", "trainer.max_steps=6"]))
    _poison_worker(simulator, worker=1, steps={3})
    simulator.train()
    assert simulator.skipped_rounds == [0, 1, 0, 0]
    assert torch.isfinite(simulator.replicas.flat).all()
    assert all(torch.isfinite(value).all() for state in simulator.replicas.optimizer.state.values()
               for value in state.values())
    raising, _ = sim_app.build(_compose(corpus, tmp_path, [f"strategy={strategy}", "strategy.on_nonfinite=raise"]))
    _poison_worker(raising, worker=1, steps={1})
    with pytest.raises(FloatingPointError, match="on_nonfinite='raise'"):
        raising.train()
    stubborn, _ = sim_app.build(_compose(corpus, tmp_path, [f"strategy={strategy}", "strategy.max_skipped_rounds=1",
                                                            "trainer.max_steps=6"]))
    _poison_worker(stubborn, worker=2, steps={2, 4})
    with pytest.raises(FloatingPointError, match="consecutive rounds"):
        stubborn.train()


def test_each_validation_logs_the_spread_across_the_replicas_to_csv_and_tensorboard(corpus, tmp_path):
    """min <= median <= max of the replicas' own validation losses, and the consensus distance, at every
    validation (steps 2 and 4), in the CSV and, with logger=tensorboard, in the TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _compose(corpus, tmp_path, ["strategy=gasloc", "logger=tensorboard", "strategy.consensus_every=0"])
    sim_app.simulate(cfg)
    with (tmp_path / "out" / "csv" / "metrics.csv").open() as file:
        rows = [r for r in csv.DictReader(file) if r["val/loss"]]
    assert [int(r["step"]) for r in rows] == [1, 3]
    for row in rows:
        low, median, high = (float(row[f"spread/val_loss_{k}"]) for k in ("min", "median", "max"))
        assert low <= median <= high and high > low, row  # 4 replicas trained apart on their own shards
        assert float(row["comm/consensus_distance"]) > 0, row
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("spread/val_loss_max")] == [1, 3]
    assert [e.step for e in events.Scalars("comm/consensus_distance")] == [1, 3]


def test_a_refused_config_leaves_no_tensorboard_event_file(corpus, tmp_path):
    cfg = _compose(corpus, tmp_path, ["topology=exponential", "sim.workers=6", "logger=tensorboard"])
    board = sim_app.tensorboard_dir(cfg)
    assert board is not None
    with pytest.raises(ValueError, match="no valid 'exponential' topology"):
        sim_app.simulate(cfg)
    assert not list(tmp_path.rglob("events.out.tfevents.*")), "the refused run left an empty TensorBoard run"


def test_the_tables_and_the_launchers_tensorboard_rows_are_flushed_within_seconds(tmp_path):
    from gasloc_lightning.app.run_tensorboard import LauncherSeries
    from omegaconf import OmegaConf

    table = sim_app.MetricsTable(tmp_path / "sim")
    table(1, {"val/loss": 3.0})
    assert table._writer.flush_secs <= 10, "TensorBoard's default 120 s would lag a live run by minutes"
    table._writer.close()
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "elastic": {"status_every_s": 2.0},
                            "logger": {"tb": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger"}}})
    series = LauncherSeries.for_run(cfg)
    series.event("a", 1)
    assert series.flush_s == 2.0 and series._writer.flush_secs == 2.0
    series.close()
