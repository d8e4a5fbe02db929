"""Helpers for the experiment-app tests: composing configs, quick overrides, and one shared sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from gasloc_lightning.app.config import config_dir

CONF = config_dir()
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

# A few steps of the tiny model on 2 CPU workers, whatever the experiment asked for.
QUICK = [
    "trainer=cpu",
    "model=tiny",
    "data=stdlib",
    "trainer.devices=2",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "inner_steps=2",
    "data.batch_size=4",
    "data.val_batches=1",
    "callbacks.lr_monitor=null",
]

# QUICK for a run inside the test process: the ranks are forked from it instead of spawned (a spawned rank is a fresh
# interpreter that imports torch and Lightning again, about 7 CPU-seconds each). The default, spawn, stays covered
# where the app really starts: the console-script run and the session's sweep (test_train_app.py).
IN_PROCESS = [*QUICK, "strategy.start_method=fork"]

_cache: dict[str, Path] = {}


def compose_config(
    overrides: list[str], output_dir: Path | None = None, cache_dir: Path | None = None
) -> DictConfig:
    """The composed ``train`` config with ``overrides``, output_dir and cache_dir pointed at test folders."""
    extra = [f"output_dir={output_dir}"] if output_dir is not None else []
    extra += [f"cache_dir={cache_dir}"] if cache_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, *extra])


def shared_cache_dir(tmp_path_factory) -> Path:
    """One byte cache for the whole session (building it once is enough)."""
    if "cache" not in _cache:
        _cache["cache"] = tmp_path_factory.mktemp("byte_cache")
    return _cache["cache"]


def clean_env() -> dict[str, str]:
    """The environment for an app subprocess: no MASTER_PORT, so every job picks a free port itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    return env


def run_app(args: list[str], cwd: Path, timeout: float = 400, executable: list[str] | None = None):
    """Run ``python -m gasloc_lightning.train ARGS`` (or ``executable``) in ``cwd``; output captured."""
    command = (executable or [sys.executable, "-m", "gasloc_lightning.train"]) + args
    return subprocess.run(command, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def _sweep_root(tmp_path_factory) -> Path:
    """The sweep's working folder: one per test run, shared by the run's xdist workers.

    ``xdist_group("sweep")`` alone does not keep the sweep's readers on one worker: with pytest 9.2 and xdist 3.8 the
    group suffix xdist writes into ``item._nodeid`` is ignored (pytest keeps the id in ``item._id``), and each worker
    ran its own 50 s sweep. Workers of one run share the folder above their basetemp and the run's uid."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # not under xdist: this process is the only reader
        return tmp_path_factory.mktemp("sweep_cwd")
    return tmp_path_factory.getbasetemp().parent / f"sweep_cwd-{run}"


def finished_sweep(tmp_path_factory) -> Path:
    """A real 2-job x 2-worker sweep (diloco, ddp) with ``logger=tensorboard``, run once per test run; returns its
    folder.

    Under xdist the first worker that asks runs it under a file lock and the others wait on the lock and read it. A
    sweep that failed is not run again for the next test that asks: each gets the first failure at once (a
    timed-out sweep used to cost its 400 s once per test)."""
    from filelock import FileLock

    if "sweep" in _cache:
        return _cache["sweep"]
    root = _sweep_root(tmp_path_factory)
    failure, done = root.parent / f"{root.name}.failed", root.parent / f"{root.name}.done"
    with FileLock(str(root.parent / f"{root.name}.lock")):
        if failure.exists():
            raise AssertionError(failure.read_text())
        if not done.exists():
            _run_sweep(root, shared_cache_dir(tmp_path_factory), failure)
            done.touch()
    _cache["sweep"] = root / "sweep"
    return _cache["sweep"]


def _run_sweep(root: Path, cache_dir: Path, failure: Path) -> None:
    root.mkdir(exist_ok=True)
    args = ["-m", "experiment=demo", "strategy=diloco,ddp", *QUICK, "logger=tensorboard", f"cache_dir={cache_dir}",
            f"hydra.sweep.dir={root / 'sweep'}"]
    try:
        result = run_app(args, cwd=root)
    except subprocess.TimeoutExpired as error:
        failure.write_text(f"sweep timed out: {error}")
        raise
    if result.returncode != 0:
        failure.write_text(f"sweep failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        raise AssertionError(failure.read_text())
