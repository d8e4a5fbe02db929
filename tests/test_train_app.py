"""The training app end to end: every experiment for a few steps, the console script, and a multirun sweep."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from app_utils import CONF, EXPERIMENTS, IN_PROCESS, QUICK, compose_config, finished_sweep, run_app, shared_cache_dir
from gasloc_lightning.app.summary import SUMMARY_FILE
from gasloc_lightning.app import train as train_module
from gasloc_lightning.app.train import build, isolated_job, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def quick_overrides(experiment: str) -> tuple[list[str], int]:
    """IN_PROCESS (QUICK with forked ranks), except that network scenarios keep their 8 workers (their network
    model has 8) and keep inner_steps=auto where they set it."""
    if not experiment.startswith("scenario_"):
        return IN_PROCESS, 2
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text()
    steps = ["strategy.fastest_inner_steps=2"] if "inner_steps: auto" in text else ["inner_steps=2"]
    quick = [o for o in IN_PROCESS if not o.startswith(("trainer.devices=", "inner_steps="))]
    return [*quick, *steps, "trainer.devices=8"], 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_a_few_steps(experiment, tmp_path, tmp_path_factory, fresh_port):
    fresh_port()
    overrides, workers = quick_overrides(experiment)
    cfg = compose_config([f"experiment={experiment}", *overrides], output_dir=tmp_path,
                         cache_dir=shared_cache_dir(tmp_path_factory))
    val_loss = train(cfg)
    summary = _summary(tmp_path)
    assert math.isfinite(val_loss) and summary["final"]["val_loss"] == pytest.approx(val_loss)
    assert summary["final"]["step"] == summary["budget"]["steps"] == 4
    assert summary["world_size"] == workers
    assert summary["budget"]["tokens"] == 4 * 4 * 64 * workers  # steps x B x T x workers
    assert summary["budget"]["rounds"] == 2  # 4 steps / H=2
    assert (tmp_path / summary["metrics_csv"]).is_file()


def _validation_steps(run_dir: Path, summary: dict) -> list[int]:
    """Optimizer steps (1-based) of the rows of metrics.csv that carry a validation loss."""
    with open(run_dir / summary["metrics_csv"], newline="") as handle:
        return sorted({int(row["step"]) + 1 for row in csv.DictReader(handle) if row.get("val/loss")})


@pytest.mark.timeout(300)
def test_a_short_run_validates_the_final_model(tmp_path, tmp_path_factory, fresh_port):
    """max_steps=5 with val_check_interval=2 and H=3: validations at 2, 4 and after the last step, on the
    model fit returns (the final, shorter round runs before that validation, not after it)."""
    overrides = [*IN_PROCESS, "trainer.max_steps=5", "trainer.val_check_interval=2", "inner_steps=3"]
    cfg = compose_config(overrides, output_dir=tmp_path, cache_dir=shared_cache_dir(tmp_path_factory))
    with isolated_job():
        trainer, model, datamodule = build(cfg)
        trainer.fit(model, datamodule=datamodule)
        summary = _summary(tmp_path)
        validated_at = _validation_steps(tmp_path, summary)  # before validate() rewrites metrics.csv
        fresh_port()
        [again] = trainer.validate(model, datamodule=datamodule, verbose=False)
    assert summary["final"]["step"] == summary["budget"]["steps"] == 5
    assert summary["budget"]["rounds"] == 2  # one at step 3, the shorter final one at step 5
    assert validated_at == [2, 4, 5]
    assert summary["final"]["val_loss"] == pytest.approx(again["val/loss"], rel=1e-6)


@pytest.mark.timeout(300)
def test_console_script_trains_and_prints_the_budget(tmp_path, tmp_path_factory):
    script = shutil.which("gasloc-train", path=str(Path(__import__("sys").executable).parent))
    assert script, "gasloc-train is not installed: pip install -e ."
    run_dir = tmp_path / "run"
    cache_dir = shared_cache_dir(tmp_path_factory)
    args = ["strategy=local", *QUICK, f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"]
    result = run_app(args, cwd=tmp_path, executable=[script])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "budget strategy=local" in log and "tokens=2,048 " in log and "rounds=2" in log
    summary = _summary(run_dir)
    assert summary["strategy"]["name"] == "local" and summary["bytes_sent"] == 0
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_popen_launcher_is_refused_under_multirun(tmp_path, monkeypatch):
    """In process: the config a ``-m`` job gets (hydra.mode=MULTIRUN in the Hydra config the app reads). The
    sweep below proves that a real ``-m`` run reaches train() with that config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    overrides = ["strategy.start_method=popen", *QUICK, f"output_dir={tmp_path / 'job'}", "hydra.mode=MULTIRUN"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    # Were the refusal gone, Lightning's popen launcher would re-run this pytest's command line in every rank.
    monkeypatch.setattr(train_module, "build", lambda cfg: pytest.fail("a refused job was built"))
    HydraConfig.instance().set_config(cfg)
    try:
        with pytest.raises(ValueError, match="start_method=popen cannot run under gasloc-train -m"):
            train(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert not (tmp_path / "job").exists()


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("sweep")  # the worker that runs the sweep for test_compare.py
def test_multirun_of_two_jobs_leaves_exactly_two_run_folders(tmp_path_factory):
    sweep_dir = finished_sweep(tmp_path_factory)
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    assert [_summary(p)["strategy"]["name"] for p in jobs] == ["diloco", "ddp"]
    # Nothing else was created: no child re-ran the app into outputs/ or multirun/.
    assert sorted(p.name for p in sweep_dir.parent.iterdir()) == ["sweep"]
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_file()) == ["multirun.yaml"]


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("sweep")
def test_a_multi_process_run_logs_one_tensorboard_run_per_worker(tmp_path_factory):
    """logger=tensorboard: each of the 2 ranks (workers) of a job writes its own run, with its own train loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = finished_sweep(tmp_path_factory) / "0"  # diloco: each worker trains its own replica
    board = job / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["worker_0", "worker_1"]
    losses = {}
    for worker in (0, 1):
        accumulator = EventAccumulator(str(board / f"worker_{worker}"))
        accumulator.Reload()
        losses[worker] = {event.step: event.value for event in accumulator.Scalars("train/loss")}
        assert sorted(losses[worker]) == [0, 1, 2, 3], (worker, losses[worker])  # log_every_n_steps=1, 4 steps
    assert losses[0] != losses[1]  # each worker's own batches and replica, not rank 0's values twice


@pytest.mark.timeout(300)
def test_ckpt_path_resumes_a_run_to_the_same_final_model(tmp_path, tmp_path_factory, fresh_port):
    """ckpt_path=DIR continues from a per-rank checkpoint: the resumed run ends where the unbroken one does."""
    cache = shared_cache_dir(tmp_path_factory)
    quick = [o for o in QUICK if not o.startswith("trainer.max_steps=")]
    checkpoint = ["trainer.enable_checkpointing=true",
                  "+callbacks.checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                  f"+callbacks.checkpoint.dirpath={tmp_path / 'ckpt'}", "+callbacks.checkpoint.every_n_train_steps=2",
                  "+callbacks.checkpoint.save_top_k=-1", "strategy.start_method=fork", "trainer.max_steps=6"]
    whole = train(compose_config([*quick, *checkpoint], output_dir=tmp_path / "whole", cache_dir=cache))
    step_4 = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert (step_4 / "meta.json").is_file()
    fresh_port()
    # Another model seed: a run that ignored ckpt_path would start afresh from other weights.
    resumed = train(compose_config([*quick, "strategy.start_method=fork", "trainer.max_steps=6", "seed=1", "data.seed=0",
                                    f"ckpt_path='{step_4}'"], output_dir=tmp_path / "resumed", cache_dir=cache))
    assert resumed == whole
    summary = _summary(tmp_path / "resumed")
    assert summary["final"]["step"] == 6 and _validation_steps(tmp_path / "resumed", summary) == [6]
