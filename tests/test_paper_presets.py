"""The evidence presets and their driver, without training: strategy=gossip, conf/experiment/paper_*,
conf/sweep/{paper_seeds,tune_outer,tune_inner} and benchmarks/paper_claims.py."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from app_utils import CONF, compose_config
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.app.compare import DuplicateRunError, check_unique
from gasloc_lightning.algorithm.outer import OuterState, mix
from gasloc_lightning.topology import build_topology


def _load_paper_claims():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "paper_claims.py"
    spec = importlib.util.spec_from_file_location("paper_claims", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper_claims"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


pc = _load_paper_claims()
OUTER_GRID = [0.5, 0.7, 1.0], [0.0, 0.3, 0.5, 0.7, 0.8, 0.9]


def _preset_text(experiment: str) -> str:
    return (CONF / "experiment" / f"{experiment}.yaml").read_text()


# ------------------------------------------------------------------ the gossip baseline
def test_gossip_preset_is_gasloc_with_H_1_eta_1_gamma_0(tmp_path):
    cfg = compose_config(["strategy=gossip", "topology=ring", "inner_steps=7", "overlap=true"], output_dir=tmp_path)
    assert (cfg.strategy.inner_steps, cfg.strategy.outer_lr, cfg.strategy.outer_momentum) == (1, 1.0, 0.0)
    assert cfg.strategy.overlap is False  # synchronous, whatever a scenario preset sets
    strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, GASLoCStrategy) and strategy.topology.name == "ring"
    strategy.check_configuration(8)
    assert strategy.outer_momentum == 0.0


def test_gossip_round_is_exactly_adapt_then_combine():
    """With eta = 1 and gamma = 0 the sent point is the local step's end and the new point its pairwise mean."""
    torch.manual_seed(0)
    theta = [torch.randn(64) for _ in range(2)]
    outer = [OuterState(t, outer_lr=1.0, outer_momentum=0.0) for t in theta]
    for _ in range(3):  # the anchor of earlier rounds never enters
        local_end = [t + 0.1 * torch.randn(64) for t in theta]
        sent = [state.message(end.clone()) for state, end in zip(outer, local_end)]
        assert all(torch.equal(s, end) for s, end in zip(sent, local_end))
        theta = []
        for i, state in enumerate(outer):
            mixed = mix(sent[i], [(0.5, sent[1 - i])], out=state.mixed_destination())
            theta.append(state.finish(sent[i], mixed).clone())
        for point in theta:  # pairwise gossip, w = 1/2 (to rounding)
            torch.testing.assert_close(point, (local_end[0] + local_end[1]) / 2)


# ------------------------------------------------------------------ the experiment presets
@pytest.fixture(scope="module")
def composed_cell(tmp_path_factory):
    """pc.compose_cell, once per (cell, extra overrides) for the tests of this module, which only read the config."""
    output_dir = tmp_path_factory.mktemp("cells")
    configs = {}

    def composed(cell, extra=()):
        key = (tuple(cell.overrides()), tuple(extra))
        if key not in configs:
            configs[key] = pc.compose_cell(cell, [*extra, f"output_dir={output_dir}"])
        return configs[key]

    return composed


@pytest.mark.parametrize("claim", pc.CLAIMS, ids=lambda c: c.key)
def test_every_method_of_a_claim_composes_and_is_stable_on_8_workers(claim, composed_cell):
    for cell in claim.cells:
        cfg = composed_cell(cell)
        assert cfg.trainer.devices == 8 and cfg.strategy._target_.endswith(
            {"ddp": "DDPStrategy", "diloco": "DiLoCoStrategy"}.get(cell.method, "GASLoCStrategy"))
        if cell.method != "ddp":
            hydra.utils.instantiate(cfg.strategy, _convert_="all").check_configuration(8)


@pytest.mark.parametrize("scale", ("cpu", "gpu"))
@pytest.mark.parametrize("claim", pc.CLAIMS, ids=lambda c: c.key)
def test_methods_of_a_claim_get_equal_tokens_in_whole_rounds(claim, scale, composed_cell):
    budgets = {}
    for cell in claim.cells:
        extra = pc.GPU_OVERRIDES[cell.experiment] if scale == "gpu" else []
        cfg = composed_cell(cell, extra)
        budget = pc.cell_budget(cfg)
        assert budget.steps % budget.inner_steps == 0 and budget.steps % cfg.trainer.val_check_interval == 0
        assert cfg.trainer.accelerator == scale
        budgets[cell.name] = budget
        # The preset states the budget it runs: its token arithmetic names this number.
        assert f"{budget.tokens:,} tokens per run" in _preset_text(cell.experiment)
    assert len({(b.tokens, b.workers, b.steps) for b in budgets.values()}) == 1, budgets
    assert {b.inner_steps for name, b in budgets.items() if name.startswith(("gasloc", "diloco"))} == (
        {1} if claim.key == "a" else {10, 50})


@pytest.mark.parametrize("experiment", sorted(pc.GPU_OVERRIDES))
def test_each_preset_documents_the_gpu_override_the_driver_applies(experiment):
    assert "   " + " ".join(pc.GPU_OVERRIDES[experiment]) + "\n" in _preset_text(experiment)


def test_claim_b_presets_differ_only_in_H(tmp_path):
    configs = [OmegaConf.to_container(compose_config([f"experiment={e}", "strategy=gasloc"], output_dir=tmp_path),
                                      resolve=True) for e in ("paper_h10", "paper_h50")]
    for cfg, H in zip(configs, (10, 50)):
        assert cfg.pop("inner_steps") == cfg["strategy"].pop("inner_steps") == H
    assert configs[0] == configs[1]


# ------------------------------------------------------------------ the tuning sweeps
def test_tuning_grids_are_the_stated_ones():
    outer = pc.sweep_grid("tune_outer")
    assert [float(v) for v in outer["strategy.outer_lr"]] == OUTER_GRID[0]
    assert [float(v) for v in outer["strategy.outer_momentum"]] == OUTER_GRID[1]
    inner = pc.sweep_grid("tune_inner")
    assert [float(v) for v in inner["model.optimizer.lr"]] == [1e-3, 2e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2]
    assert [json.loads(v) for v in inner["model.optimizer.betas"]] == [[0.8, 0.95], [0.9, 0.95], [0.95, 0.95]]
    assert outer["seed"] == inner["seed"] == ["0"]  # tune on seed 0
    assert [int(s) for s in pc.sweep_grid("paper_seeds")["seed"]] == [1, 2, 3]  # report seeds 1-3


@pytest.mark.parametrize("claim", pc.CLAIMS, ids=lambda c: c.key)
def test_every_method_gets_the_same_tuning_budget_at_8_workers(claim):
    assert {cell.name: pc.grid_size(cell, 8) for cell in claim.cells} == {cell.name: 18 for cell in claim.cells}


@pytest.mark.parametrize("topology", ("one_peer", "two_peer", "ring", "exponential"))
@pytest.mark.parametrize("world_size", (8, 32, 64))
def test_outer_sweep_keeps_only_stable_momenta(topology, world_size):
    graph = build_topology(topology)
    limit = graph.max_stable_momentum(world_size)
    kept = pc.stable_momenta(topology, world_size, OUTER_GRID[1])
    assert kept == [gamma for gamma in OUTER_GRID[1] if gamma < limit]
    assert graph.consensus_rate(world_size, kept[-1]) < 1  # the largest gamma the sweep keeps is stable
    cell = pc.Cell("gasloc", "paper_h50", topology)
    assert f"strategy.outer_momentum={','.join(map(str, kept))}" in pc.tuning_overrides(cell, world_size)
    assert pc.grid_size(cell, world_size) == 3 * len(kept)


def test_the_hypercube_loses_the_large_momenta_at_scale():
    assert pc.stable_momenta("exponential", 32, OUTER_GRID[1]) == [0.0, 0.3, 0.5, 0.7, 0.8]
    assert pc.stable_momenta("exponential", 64, OUTER_GRID[1]) == [0.0, 0.3, 0.5, 0.7]
    assert pc.stable_momenta(None, 64, OUTER_GRID[1]) == OUTER_GRID[1]  # diloco: an all-reduce


# ------------------------------------------------------------------ the driver
def test_the_seed_tells_runs_of_one_configuration_apart():
    runs = [_summary("ddp", None, 2.0, seed, "/r/" + str(seed)) for seed in (1, 2)]
    check_unique(runs)
    with pytest.raises(DuplicateRunError):
        check_unique([*runs, _summary("ddp", None, 2.0, 1, "/r/again")])


def test_dry_run_prints_every_command_and_fits_in_about_an_hour(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pc.subprocess, "run", lambda *a, **k: pytest.fail("a dry run launched a job"))
    assert pc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    cells = [cell for claim in pc.CLAIMS for cell in claim.cells]
    assert len(cells) == 18 and out.count("  $ ") == 18
    for cell in cells:
        assert f"hydra.sweep.dir={tmp_path / ('a' if cell.experiment == 'paper_h1' else 'b') / cell.name}" in out
    assert "in all: 18 launches, 54 runs (seeds 1 2 3)" in out
    minutes = int(re.search(r"in all: .*about (\d+) min", out).group(1))
    assert 40 <= minutes <= 70
    assert not list(tmp_path.iterdir())


def _summary(method: str, topology: str | None, loss: float, seed: int, run_dir: str) -> dict:
    eta, gamma, H = {"gasloc": (0.7, 0.9, 1), "gossip": (1.0, 0.0, 1)}.get(method, (None, None, 1))
    strategy = {"name": "gasloc" if method == "gossip" else method, "topology": topology or "complete",
                "inner_steps": H, "outer_lr": eta, "outer_momentum": gamma, "outer_form": None}
    return {
        "format": 1, "strategy": strategy, "world_size": 8, "model": {}, "optimizer": {}, "schedule": {},
        "data": {}, "budget": {"max_steps": 200, "steps": 200, "tokens_per_step": 4096, "tokens": 819_200,
                                "rounds": 200},
        "final": {"val_loss": loss, "val_ppl": math.exp(loss), "val_loss_local": None, "step": 200},
        "bytes_sent": 1.0, "bytes_received": 1.0, "unigram_entropy_val": 3.0, "wall_time_s": 1.0, "seed": seed,
        "metrics_csv": None, "run_dir": run_dir,
    }


def test_report_gives_mean_spread_and_ratio_to_the_best_gossip_baseline(tmp_path):
    losses = {"gasloc-ring-h1": [1.9, 2.0, 2.1], "gossip-ring": [2.4, 2.5, 2.6], "gossip-one_peer": [2.2] * 3}
    claim = pc.CLAIMS[0]
    for cell in claim.cells:
        for job, (seed, loss) in enumerate(zip((1, 2, 3), losses.get(cell.name, []))):
            run_dir = tmp_path / "a" / cell.name / str(job)
            run_dir.mkdir(parents=True)
            record = _summary(cell.method, cell.topology, loss, seed, str(run_dir))
            (run_dir / "summary.json").write_text(json.dumps(record))
    report = pc.claim_report(claim, tmp_path)
    assert "9 runs; per run 8 workers x 200 steps = 819,200 tokens" in report
    assert "ratio to gossip-one_peer" in report
    assert "| gasloc | ring | 1 | 3 | 2.0000 | 0.1000 | 1.9000 - 2.1000 | 0.909 | 0.800 |" in report
    assert "| gossip | ring | 1 | 3 | 2.5000 | 0.1000 | 2.4000 - 2.6000 | 1.136 | 1.000 |" in report
    assert "Not run or failed: gasloc-one_peer-h1, gasloc-exponential-h1, gossip-exponential, ddp" in report
    assert (tmp_path / "a" / "comparison.md").is_file()


def test_tuning_picks_the_best_job_on_seed_0_and_the_claims_run_with_it(tmp_path, capsys):
    cell = pc.Cell("gossip", "paper_h1", "ring")
    directory = tmp_path / "tune" / "a" / cell.name
    for job, (lr, loss) in enumerate(((1e-3, 2.5), (6e-3, 2.1), (2.4e-2, 2.3))):
        run_dir = directory / str(job)
        (run_dir / ".hydra").mkdir(parents=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text(
            f"- seed=0\n- experiment=paper_h1\n- model.optimizer.lr={lr}\n- model.optimizer.betas=[0.9,0.95]\n")
        (run_dir / "summary.json").write_text(json.dumps(_summary("gossip", "ring", loss, 0, str(run_dir))))
    launch = pc.Launch("a", cell, directory, [], 3, None, None)
    chosen = pc.select_tuned([launch])
    assert chosen == {cell.name: {"overrides": ["model.optimizer.lr=0.006", "model.optimizer.betas=[0.9,0.95]"],
                                  "val_loss": 2.1, "sweep": "tune_inner", "jobs": 3, "seed": 0, "topology": "ring"}}
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"cells": chosen}))
    assert pc.main(["--dry-run", "--claims", "a", "--tuned", str(tuned), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    tuned_values = "seed=1,2,3 model.optimizer.lr=0.006 model.optimizer.betas=[0.9,0.95]"
    # Tuned on the ring, applied to gossip on every graph at the same H; other methods keep their presets.
    for graph in ("ring", "one_peer", "exponential"):
        command = next(line for line in lines if f"strategy=gossip topology={graph} " in line)
        assert command.split(" hydra.sweep.dir=")[0].endswith(tuned_values)
    gasloc = next(line for line in lines if "strategy=gasloc topology=ring " in line)
    assert gasloc.split(" hydra.sweep.dir=")[0].endswith("seed=1,2,3")


def test_cells_option_keeps_only_the_named_cells(tmp_path, capsys):
    names = ["gasloc-one_peer-h50", "diloco-h50"]
    assert pc.main(["--dry-run", "--tune", "--cells", *names, "--out", str(tmp_path)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("$")]
    assert len(commands) == 2
    assert "strategy=gasloc topology=one_peer" in commands[0] and "experiment=paper_h50" in commands[0]
    assert "strategy=diloco" in commands[1] and "sweep=tune_outer" in commands[1]
