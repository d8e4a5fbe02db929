"""The run record: what every training job writes so that ``gasloc-compare`` can read it.

A finished job's folder holds

- ``summary.json`` (written by rank 0 at the end of fit, format below),
- ``metrics.csv`` of Lightning's CSV logger (path in ``summary["metrics_csv"]``), where every
  validation row also carries ``progress/tokens`` (summed over the workers that trained on them), ``progress/bytes_sent`` (mean
  per worker) and ``progress/wall_time_s`` at that step, so curves need no interpolation,
- ``.hydra/`` (the composed config) when the job ran through the Hydra app.

``summary.json`` keys: ``format``, ``strategy`` (see :func:`describe_strategy`), ``world_size``,
``model`` (GPT shape), ``parameters``, ``optimizer``, ``schedule``, ``data`` (source, B, T and
content fingerprint), ``budget`` (max_steps, steps, tokens_per_step, tokens, rounds), ``final``
(consensus val loss/ppl at the last validation, its step, mean local val loss), ``bytes_sent``
and ``bytes_received`` (mean per worker), ``unigram_entropy_val`` (nats per byte),
``wall_time_s`` (fit start to end on rank 0), ``seed``, ``metrics_csv``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from gasloc_lightning.strategies.baselines import is_dense_ddp, traffic_bytes_sent
from gasloc_lightning.strategies.diloco import DiLoCoStrategy
from gasloc_lightning.strategies.gasloc import GASLoCStrategy, LocalStepsStrategy
from gasloc_lightning.strategies.two_level import TwoLevelStrategy

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
SUMMARY_FORMAT = 1


def describe_strategy(strategy: Any) -> dict[str, Any]:
    """Name, topology and round hyperparameters of a strategy, as the run record and the budget show them.

    ``local`` is GASLoC on the empty graph; DiLoCo and DDP communicate over the complete graph
    (an all-reduce), DDP every step (H = 1).
    """
    if isinstance(strategy, GASLoCStrategy):
        name = "local" if strategy.topology.name == "local" else "gasloc"
        return _local_steps(name, strategy.topology.name, strategy, strategy.outer_form)
    if isinstance(strategy, DiLoCoStrategy):
        return _local_steps("diloco", "complete", strategy, "nesterov")
    if isinstance(strategy, TwoLevelStrategy):
        name = "hierarchical_diloco" if strategy.cross_mean else "two_level"
        return _local_steps(name, strategy.topology.name, strategy, "two_level")
    if is_dense_ddp(strategy):
        return {"name": "ddp", "topology": "complete", "inner_steps": 1,
                "outer_lr": None, "outer_momentum": None, "outer_form": None}
    return {"name": type(strategy).__name__, "topology": None, "inner_steps": None,
            "outer_lr": None, "outer_momentum": None, "outer_form": None}


def _local_steps(name: str, topology: str, strategy: Any, form: str) -> dict[str, Any]:
    try:
        momentum = strategy.outer_momentum
    except RuntimeError:  # GASLoC resolves gamma when the world size is known
        momentum = None
    # With per-rank H_i a round lasts as long as the largest H_i.
    length = getattr(strategy, "round_length", strategy.inner_steps)
    return {"name": name, "topology": topology, "inner_steps": length if isinstance(length, int) else None,
            "outer_lr": strategy.outer_lr, "outer_momentum": momentum, "outer_form": form}


def count_rounds(max_steps: int, inner_steps: int) -> int:
    """Communication rounds in ``max_steps`` steps: one every H steps, plus a final shorter one if needed."""
    return math.ceil(max_steps / inner_steps)


class RunSummary(Callback):
    """Writes ``summary.json`` (rank 0, end of fit) and logs progress columns at every validation.

    Args:
        output_dir: the job's folder; ``summary.json`` goes there.
        seed: the run's seed, recorded (it is part of a run's identity for ``gasloc-compare``).
    """

    def __init__(self, output_dir: str, seed: int | None = None) -> None:
        self.output_dir = str(output_dir)
        self.seed = seed
        self._start: float | None = None
        self._last_validation_step: int | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def _elapsed(self) -> float:
        return 0.0 if self._start is None else time.perf_counter() - self._start

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._last_validation_step = trainer.global_step
        metrics = {
            "progress/tokens": float(_tokens(trainer, pl_module)),
            "progress/wall_time_s": self._elapsed(),
        }
        sent = traffic_bytes_sent(trainer)
        if sent is not None:
            metrics["progress/bytes_sent"] = float(sent)
        # Every rank reaches this hook: the mean over workers is one small all-reduce.
        tensors = {k: torch.tensor(v, dtype=torch.float64, device=pl_module.device)
                   for k, v in metrics.items()}
        pl_module.log_dict(tensors, on_step=False, on_epoch=True, sync_dist=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Collective first (every rank), then rank 0 writes.
        sent, received = self._mean_traffic(trainer)
        if not trainer.is_global_zero:
            return
        record = self._record(trainer, pl_module, sent, received)
        path = Path(self.output_dir) / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        log.info("run summary written path=%s val_loss=%s", path, record["final"]["val_loss"])

    def _mean_traffic(self, trainer: pl.Trainer) -> tuple[float | None, float | None]:
        sent = traffic_bytes_sent(trainer)
        if sent is None:
            return None, None
        strategy = trainer.strategy
        received = strategy.bytes_received if isinstance(strategy, LocalStepsStrategy) else sent
        both = torch.tensor([float(sent), float(received)], dtype=torch.float64, device=strategy.root_device)
        both = strategy.reduce(both, reduce_op="mean") if trainer.world_size > 1 else both
        return float(both[0]), float(both[1])

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, sent: Any, received: Any
    ) -> dict[str, Any]:
        strategy = describe_strategy(trainer.strategy)
        steps = trainer.global_step
        tokens = _tokens(trainer, pl_module)
        return {
            "format": SUMMARY_FORMAT,
            "strategy": strategy,
            "world_size": trainer.world_size,
            "model": dict(pl_module.hparams.get("model", {})),
            "parameters": sum(p.numel() for p in {id(p): p for p in pl_module.parameters()}.values()),
            "optimizer": _optimizer(trainer),
            "schedule": {k: pl_module.hparams.get(k) for k in ("warmup_steps", "max_steps", "min_lr_ratio")},
            "data": _data(trainer),
            "budget": {
                "max_steps": trainer.max_steps,
                "steps": steps,
                "tokens_per_step": tokens // steps if steps else None,
                "tokens": tokens,
                "rounds": getattr(trainer.strategy, "round_index", steps),
            },
            "final": self._final_metrics(trainer),
            "bytes_sent": sent,
            "bytes_received": received,
            "unigram_entropy_val": _unigram_entropy(trainer),
            "wall_time_s": round(self._elapsed(), 3),
            "seed": self.seed,
            "metrics_csv": _metrics_csv(trainer, self.output_dir),
        }

    def _final_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        metrics = trainer.callback_metrics
        value = lambda name: float(metrics[name]) if name in metrics else None  # noqa: E731
        return {
            "val_loss": value("val/loss"),
            "val_ppl": value("val/ppl"),
            "val_loss_local": value("val/loss_local"),
            "step": self._last_validation_step,
        }


def _tokens(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """Tokens seen by all workers: every worker takes the same steps on equally sized batches."""
    per_worker = getattr(pl_module, "tokens_seen", None)
    if per_worker is not None:
        return int(per_worker) * trainer.world_size
    datamodule = trainer.datamodule
    per_step = datamodule.tokens_per_step(trainer.world_size) if hasattr(datamodule, "tokens_per_step") else 0
    return per_step * trainer.global_step


def _optimizer(trainer: pl.Trainer) -> dict[str, Any] | None:
    if not trainer.optimizers:
        return None
    optimizer = trainer.optimizers[0]
    record: dict[str, Any] = {"name": type(optimizer).__name__}
    for key, value in optimizer.defaults.items():
        if isinstance(value, (int, float, str, bool, tuple, list)):
            record[key] = list(value) if isinstance(value, tuple) else value
    return record


def _data(trainer: pl.Trainer) -> dict[str, Any] | None:
    datamodule = trainer.datamodule
    if datamodule is None:
        return None
    hparams = dict(datamodule.hparams)
    keys = ("source", "block_size", "batch_size", "val_fraction", "val_batches")
    record = {k: hparams.get(k) for k in keys}
    fingerprint = getattr(datamodule, "fingerprint", None)
    record["sha256"] = fingerprint.get("sha256") if isinstance(fingerprint, dict) else None
    return record


def _unigram_entropy(trainer: pl.Trainer) -> float | None:
    datamodule = trainer.datamodule
    if datamodule is None or not hasattr(datamodule, "unigram_entropy"):
        return None
    return datamodule.unigram_entropy("val")


def _metrics_csv(trainer: pl.Trainer, output_dir: str) -> str | None:
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            path = Path(logger.log_dir) / "metrics.csv"
            return os.path.relpath(path, output_dir)
    return None


def load_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run's ``summary.json``, with ``run_dir`` added (absolute)."""
    run_dir = Path(run_dir).resolve()
    record = json.loads((run_dir / SUMMARY_FILE).read_text())
    if record.get("format") != SUMMARY_FORMAT:
        raise ValueError(
            f"{run_dir / SUMMARY_FILE} has format {record.get('format')!r}, expected {SUMMARY_FORMAT}"
        )
    record["run_dir"] = str(run_dir)
    return record
