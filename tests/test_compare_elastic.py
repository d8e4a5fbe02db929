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


def test_a_restarted_workers_series_has_every_incarnations_rows_in_order(tmp_path):
    from gasloc_lightning.app.compare_elastic import read_worker_series, worker_csvs

    def write(folder, steps):
        folder.mkdir(parents=True, exist_ok=True)
        rows = "".join(f"{step},{3.0 - step / 100}\n" for step in steps)
        (folder / "metrics.csv").write_text("step,train/loss\n" + rows)

    worker = tmp_path / "worker_2"
    write(worker / "csv", range(0, 40, 10))  # the first process, killed at 40
    write(worker / "csv" / "incarnation_10", [90])  # numbered, not sorted as text: 10 after 3
    write(worker / "csv" / "incarnation_3", [50, 60])  # the restart
    series = read_worker_series(*worker_csvs(worker))
    assert [step for step, _ in series.train_loss] == [0, 10, 20, 30, 50, 60, 90]


def test_each_later_process_of_a_worker_slot_logs_its_own_csv(tmp_path, monkeypatch):
    """Lightning's CSVLogger deletes the metrics.csv in its folder: a restart writing to the first process's folder
    would erase that process's rows from gasloc-compare's plots."""
    from hydra import compose, initialize_config_dir

    import gasloc_lightning.app.elastic as elastic_app
    from gasloc_lightning.app.config import config_dir
    from gasloc_lightning.app.elastic_worker import load_worker_config

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("elastic/app", overrides=["elastic.workers=1", "elastic.min_workers=1",
                                                 "elastic.lighthouse=127.0.0.1:1", f"output_dir={tmp_path}",
                                                 "elastic.worker_start=exec"])  # a command line to read
    run = elastic_app.ElasticRun(cfg)
    record = run._write_worker_config(0)
    commands = []
    monkeypatch.setattr(elastic_app, "_start_process",
                        lambda command, log, env: commands.append(command) or type("P", (), {"pid": 1})())
    run._spawn(record, founder=True)
    run._spawn(record, held=True)
    assert not any(arg.startswith("logger.csv.version") for arg in commands[0]), "the first keeps csv/metrics.csv"
    overrides = [arg for arg in commands[1][commands[1].index(str(record.config_path)) + 1:]]
    assert "logger.csv.version=incarnation_2" in overrides
    assert load_worker_config(record.config_path, overrides).logger.csv.version == "incarnation_2"
