"""``gasloc-compare`` on real run output: table, plots, the DDP baseline's traffic, refusal of duplicates."""

from __future__ import annotations

import csv
import json
import re
import shutil

import pytest

from app_utils import finished_sweep
from gasloc_lightning.strategies.baselines import gradient_bytes
from gasloc_lightning.app.compare import DuplicateRunError, compare, main, read_curve
from gasloc_lightning.app.demo import acceptance, sweep_command
from gasloc_lightning.models import GPT, GPTConfig
from gasloc_lightning.app.summary import load_summary
from gasloc_lightning.comm.transport import ring_all_reduce_bytes

# xdist: one worker runs every test that reads the session's sweep, so the sweep runs once.
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("sweep")]


@pytest.fixture
def sweep(tmp_path_factory):
    return finished_sweep(tmp_path_factory)


def test_table_and_plots_from_a_sweep(sweep, tmp_path):
    result = compare([sweep], tmp_path)
    assert [run["strategy"]["name"] for run in result.runs] == ["diloco", "ddp"]
    rows = [line for line in result.table.splitlines() if line.startswith("| ") and "strategy" not in line]
    assert len(rows) == 2
    assert "| diloco | complete | 2 | 2 | 2 | 2,048 |" in rows[0]
    assert "Byte-unigram entropy of the validation split" in result.table
    assert {p.name for p in result.plots} == {"val_loss_vs_tokens.png", "val_loss_vs_bytes.png"}
    assert all(p.stat().st_size > 1000 for p in result.plots)
    assert result.table_path.read_text().count("![") == 2


def test_ddp_traffic_is_a_ring_all_reduce_of_the_gradients_per_step(sweep):
    ddp = load_summary(sweep / "1")
    gradient = gradient_bytes(GPT(GPTConfig(**ddp["model"])))
    expected = ring_all_reduce_bytes(gradient, ddp["world_size"]) * ddp["budget"]["steps"]
    assert ddp["bytes_sent"] == expected
    curve = read_curve(ddp)
    assert curve.tokens == [1024.0, 2048.0]  # validations at steps 2 and 4
    assert curve.bytes_sent == [expected / 2, expected]


def test_cli_prints_the_table_and_the_plot_paths(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| ddp |" in out and f"plot:  {tmp_path / 'val_loss_vs_bytes.png'}" in out


def test_duplicate_configurations_are_refused_naming_both_runs(sweep, tmp_path, capsys):
    copy = tmp_path / "copy_of_job_1"
    shutil.copytree(sweep / "1", copy)
    job, again = re.escape(str(sweep / "1")), re.escape(str(copy))
    # Both runs, in compare's order of the runs (which follows their paths, so either may come first).
    with pytest.raises(DuplicateRunError, match=f"runs ({job} and {again}|{again} and {job}) have"):
        compare([sweep, copy], tmp_path / "out")
    assert main([str(sweep), str(copy), "--out", str(tmp_path / "out")]) == 2
    assert "same configuration" in capsys.readouterr().err


def test_sim_time_gets_a_plot_when_logged_and_tokens_follow_the_step_column(sweep, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sweep / "0", run)
    metrics = run / load_summary(run)["metrics_csv"]
    with metrics.open(newline="") as file:
        rows = list(csv.DictReader(file))
    with metrics.open("w", newline="") as file:
        columns = [c for c in rows[0] if c != "progress/tokens"]  # tokens then come from the step column
        writer = csv.DictWriter(file, fieldnames=[*columns, "sim/sim_time"], extrasaction="ignore")
        writer.writeheader()
        # Simulated seconds on training rows only (row k is optimizer step k + 1); validation rows carry none.
        writer.writerows({**row, "sim/sim_time": "" if row["val/loss"] else str(0.5 * (int(row["step"]) + 1))}
                         for row in rows)
    result = compare([run], tmp_path / "out")
    assert "val_loss_vs_sim_time.png" in {p.name for p in result.plots}
    curve = read_curve(load_summary(run))
    assert curve.sim_time == [1.0, 2.0]
    assert curve.tokens == [1024, 2048]


def test_demo_acceptance_holds_each_final_loss_against_the_unigram_entropy(sweep, tmp_path):
    result = compare([sweep], tmp_path)
    # Four steps are not enough to beat byte frequencies: the check must say so.
    assert [line.split()[:2] for line in acceptance(result)] == [["FAIL", "diloco"], ["FAIL", "ddp"]]
    command = sweep_command(tmp_path, "gasloc,diloco,ddp", ["trainer.max_steps=10"])
    assert command[-4:] == ["experiment=demo", "strategy=gasloc,diloco,ddp", f"hydra.sweep.dir={tmp_path}",
                            "trainer.max_steps=10"]


def test_a_folder_without_runs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished run under"):
        compare([tmp_path], tmp_path / "out")
    (tmp_path / "summary.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        compare([tmp_path], tmp_path / "out")


def test_gasloc_with_H_1_eta_1_gamma_0_is_labelled_gossip():
    from gasloc_lightning.app.compare import label

    gossip = {"name": "gasloc", "topology": "ring", "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
    assert label({"strategy": gossip}) == "gossip (ring)"
    for change in ({"inner_steps": 2}, {"outer_lr": 0.7}, {"outer_momentum": 0.5}):
        assert label({"strategy": {**gossip, **change}}).startswith("gasloc (ring")
