"""``gasloc-compare`` over one elastic run folder (stand-in files, as ``gasloc-elastic`` writes them): the
per-worker table and the loss, quorum and failure plots."""

from __future__ import annotations

import json

import pytest

from gasloc_lightning.app.compare import main


def _elastic_run(root):
    rows = [{"worker": 0, "status": "finished", "exit_code": 0, "incarnations": 1, "applied_steps": 20,
             "final_step": 20, "val_loss": 2.5, "failed_exchanges": 0, "failed_collectives": 0},
            {"worker": 1, "status": "killed", "exit_code": -9, "incarnations": 1, "applied_steps": 9,
             "final_step": None, "val_loss": None, "failed_exchanges": 2, "failed_collectives": 0}]
    history = [{"time_s": 1.0, "step": 1, "quorum_size": 2}, {"time_s": 5.0, "step": 11, "quorum_size": 1}]
    (root / "elastic_summary.json").write_text(json.dumps({"chaos": ["kill:1@10"], "workers": rows,
                                                           "quorum_history": history}))
    for worker, steps in ((0, 20), (1, 9)):
        folder = root / f"worker_{worker}" / "csv"
        folder.mkdir(parents=True)
        lines = ["step,train/loss,val/loss,comm/failed_exchanges"]
        lines += [f"{s},{5 - s * 0.1},,{worker * (s // 5)}" for s in range(steps)]
        lines.append(f"{steps - 1},,{4 - steps * 0.05},")
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_an_elastic_run_folder_gives_the_per_worker_table_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _elastic_run(tmp_path)
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "workers.md").read_text()
    assert "| 0 | finished | 0 | 1 | 20 | 20 | 2.5000 | 0 | 0 |" in table
    assert "| 1 | killed | -9 | 1 | 9 | - | - | 2 | 0 |" in table and "chaos: kill:1@10" in table
    for name in ("loss_vs_step.png", "quorum_vs_time.png", "failed_exchanges.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    assert "table: " in capsys.readouterr().out
