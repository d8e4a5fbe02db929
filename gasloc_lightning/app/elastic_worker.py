"""One elastic worker: ``python -m gasloc_lightning.app.elastic_worker WORKER_CONFIG.yaml [KEY=VALUE ...]``.

``gasloc-elastic`` writes each worker's fully resolved config (the gasloc-train tree with an elastic
strategy node, ``trainer.devices=1`` and this worker's data shard) and starts this module on it. On
another machine, start it the same way on a copy of that file, with ``KEY=VALUE`` overrides (OmegaConf
dot-list) for what differs there, e.g. ``strategy.worker_id=3 data.rank=3 strategy.lighthouse=node0:29510``
(see ``docs/elastic.md``).

Besides the usual ``summary.json`` and ``metrics.csv``, the worker keeps ``progress.json`` in its
folder (rewritten atomically at every step): what the launcher watches to run a chaos schedule and to
print the quorum size. Its final ``state`` is ``done`` (trained to the end), ``left`` (SIGTERM: it left
the run; after a clean leave its own replica is checkpointed in ``checkpoints/left``, which
``ckpt_path`` resumes), ``ended`` (it woke or started after the others had committed the end-of-fit
average and left: exit 0 without a final model, which ``gasloc-elastic`` reports as ``stopped``),
``refused`` (surplus past ``max_workers``) or ``failed``. A worker that trained to the end saves its model in
``checkpoints/final`` (weights only; ``gasloc-export`` reads it).

The run's secret comes from the environment (``GASLOC_ELASTIC_SECRET``), never from the config file.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "warn")  # before torchft is imported

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from typing_extensions import override

from gasloc_lightning.app.train import build
from gasloc_lightning.data import ByteDataModule
from gasloc_lightning.comm.membership import RunEndedError, SurplusWorkerError
from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy, ElasticLeave
from gasloc_lightning.strategies.launcher import exit_with_parent
from gasloc_lightning.utils.records import write_json_atomically

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
LEAVE_CHECKPOINT = "checkpoints/left"  # inside the worker's folder: its replica after a clean leave
FINAL_CHECKPOINT = "checkpoints/final"  # its model at the end of the run (weights only: what gasloc-export reads)
# Set by the launcher for a warm restart: the worker builds everything, then waits for this file to exist
# before it joins (so a scheduled restart is not delayed by the seconds of importing torch).
HOLD_FILE_ENV = "GASLOC_ELASTIC_HOLD_FILE"


def write_progress(output_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Replace ``progress.json`` atomically (the launcher may read it at any moment)."""
    write_json_atomically(Path(output_dir) / PROGRESS_FILE, record)


def read_progress(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The worker's last record; ``None`` when there is none, it is torn, or it is not a JSON object."""
    try:
        record = json.loads((Path(output_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class SharedValidationData(ByteDataModule):
    """Trains on shard ``rank`` of ``world_size`` (the worker's own, across restarts), but validates every worker
    on the same batches (those of a single-worker run), so the workers' losses compare directly."""

    @override
    def val_dataloader(self) -> Any:
        reference = ByteDataModule(**self.hparams, rank=0, world_size=1)
        reference.prepare_data()
        return reference.val_dataloader()


class ElasticProgress(Callback):
    """Writes this worker's step, round, quorum and counters to ``progress.json`` after every step."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.applied = 0  # steps this process computed (a joiner's global step starts at the quorum's)
        self.first_step: int | None = None
        self.checkpoint: str | None = None  # where this worker's replica was saved when it left

    def record(self, trainer: pl.Trainer, state: str, **extra: Any) -> dict[str, Any]:
        strategy = trainer.strategy
        elastic = isinstance(strategy, ElasticGASLoCStrategy)
        return {
            "pid": os.getpid(), "state": state, "time": time.time(), "step": trainer.global_step,
            "applied": self.applied, "first_step": self.first_step,
            "round": getattr(strategy, "round_index", None),
            "quorum_size": strategy.quorum_size if elastic else None,
            "members": strategy.quorum.names if elastic and strategy.quorum_size else [],
            "membership_changes": strategy.membership_changes if elastic else 0,
            "lineage_merges": strategy.lineage_merges if elastic else 0,
            "failed_exchanges": strategy.failed_exchanges if elastic else 0,
            "failed_collectives": strategy.failed_collectives if elastic else 0,
            "refused_members": strategy.refused_members if elastic else 0,
            "unauthentic_messages": strategy.unauthentic_messages if elastic else 0,
            "healed_rounds": strategy.healed_rounds if elastic else [],
            **_live_fields(trainer),  # for the launcher's live status line (gasloc_lightning.app.live_status)
            **extra,
        }

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_progress(self.output_dir, self.record(trainer, "starting"))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.applied += 1
        if self.first_step is None:
            self.first_step = trainer.global_step - 1
        if getattr(trainer.strategy, "left", False) and self.checkpoint is None:
            # Right after the round that it committed as it left, inside the loop (as ModelCheckpoint saves):
            # the fit then stops, and a resume continues from this very batch.
            self.checkpoint = save_leave_checkpoint(trainer, self.output_dir)
        write_progress(self.output_dir, self.record(trainer, "running"))


def _live_fields(trainer: pl.Trainer) -> dict[str, Any]:
    """Traffic counters and the last consensus figures (None until measured)."""
    strategy, val_loss = trainer.strategy, trainer.callback_metrics.get("val/loss")
    return {"bytes_sent": getattr(strategy, "bytes_sent", None),
            "bytes_received": getattr(strategy, "bytes_received", None),
            "consensus_distance": getattr(strategy, "consensus_distance", None),
            "val_loss": None if val_loss is None else float(val_loss)}


def model_checksum(trainer: pl.Trainer) -> float | None:
    """Sum of the exchanged tensors in float64: equal on workers that ended on the same consensus."""
    strategy = trainer.strategy
    if not isinstance(strategy, ElasticGASLoCStrategy):
        return None
    return float(strategy.layout.read().double().sum())


_MISSING = object()


def load_worker_config(config_path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """A worker config file with ``KEY=VALUE`` overrides merged in (each key must exist in the file)."""
    cfg = OmegaConf.load(config_path)
    for entry in overrides:
        key, sep, _ = entry.partition("=")
        if not sep or not key:
            raise ValueError(f"worker override {entry!r}: expected KEY=VALUE, e.g. strategy.worker_id=3")
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            raise ValueError(f"worker override {entry!r}: {key} is not a key of {config_path}")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def run_worker(config_path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> int:
    """Train one worker from its resolved config (and ``KEY=VALUE`` overrides); returns the process exit code
    (0 when it trained to the end or left after SIGTERM)."""
    cfg = load_worker_config(config_path, overrides)
    output_dir = str(cfg.output_dir)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    progress = ElasticProgress(output_dir)
    starting = {"pid": os.getpid(), "state": "starting", "step": 0, "applied": 0, "quorum_size": None}
    held = bool(os.environ.get(HOLD_FILE_ENV))  # a held spare: the running incarnation owns progress.json
    if not held:
        write_progress(output_dir, {**starting, "time": time.time()})
    try:
        trainer, model, datamodule = build(cfg)
        trainer.callbacks.append(progress)
        _wait_for_release()
        if held:
            write_progress(output_dir, {**starting, "time": time.time()})
        log.info("fit starts worker_dir=%s ckpt_path=%s", output_dir, cfg.get("ckpt_path"))
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except ElasticLeave as leave:
        log.warning("left without finishing the round: %s", leave)
        return _ended(output_dir, progress, "left", 0, error=str(leave))
    except RunEndedError as error:
        log.warning("%s: leaving", error)
        return _ended(output_dir, progress, "ended", 0, error=str(error))
    except SurplusWorkerError as error:
        log.error("%s", error)
        return _ended(output_dir, progress, "refused", 3, error=str(error))
    except BaseException as error:
        log.exception("worker failed")
        return _ended(output_dir, progress, "failed", 1, error=f"{type(error).__name__}: {error}")
    val_loss = trainer.callback_metrics.get("val/loss")
    extra = {"val_loss": None if val_loss is None else float(val_loss), "model_checksum": model_checksum(trainer)}
    left = getattr(trainer.strategy, "left", False)
    if left:  # it left at a batch's start (SIGTERM between two rounds): nothing was saved inside the loop
        extra["checkpoint"] = progress.checkpoint or save_leave_checkpoint(trainer, output_dir)
    else:  # the run's model: what gasloc-export reads, and what merges the models of a run that split
        path = Path(output_dir) / FINAL_CHECKPOINT
        trainer.save_checkpoint(path, weights_only=True)
        extra["final_checkpoint"] = str(path)
    write_progress(output_dir, progress.record(trainer, "left" if left else "done", **extra))
    return 0


def _ended(output_dir: str, progress: ElasticProgress, state: str, code: int, error: str) -> int:
    write_progress(output_dir, {"pid": os.getpid(), "state": state, "time": time.time(), "error": error,
                                "applied": progress.applied, "first_step": progress.first_step})
    return code


def save_leave_checkpoint(trainer: pl.Trainer, output_dir: str) -> str:
    """This worker's own replica and state after a clean leave (a per-rank checkpoint ``ckpt_path`` resumes)."""
    path = Path(output_dir) / LEAVE_CHECKPOINT
    trainer.save_checkpoint(path, weights_only=False)  # the whole state: optimizer, loops, callbacks
    log.info("saved the leave checkpoint path=%s step=%d", path, trainer.global_step)
    return str(path)


def _wait_for_release() -> None:
    """A held worker says it is ready (``<hold file>.ready``; not progress.json, which the running incarnation
    of the same slot owns), then waits for its hold file."""
    hold = os.environ.get(HOLD_FILE_ENV)
    if not hold:
        return
    ready_file(hold).touch()
    while not os.path.exists(hold):
        time.sleep(0.05)


def ready_file(hold_file: str | os.PathLike) -> Path:
    """The file a held worker creates once it has built everything and waits for ``hold_file``."""
    return Path(f"{hold_file}.ready")


def _quiet_torchft() -> None:
    """torchft logs a warning at every reconfiguration and an access line per state transfer."""
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*frombuffer.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchft.*")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or "=" in argv[0]:
        raise SystemExit("usage: python -m gasloc_lightning.app.elastic_worker WORKER_CONFIG.yaml [KEY=VALUE ...]")
    exit_with_parent()  # started by gasloc-elastic: never outlive it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _quiet_torchft()
    code = run_worker(argv[0], argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torchft's server threads must not keep a finished worker alive


if __name__ == "__main__":
    main()
