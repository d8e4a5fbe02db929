"""``gasloc-train``: the Hydra app that trains one configuration (or a sweep of them with ``-m``).

Usage::

    gasloc-train                      # gasloc, one_peer, tiny GPT, stdlib corpus, 2 CPU workers
    gasloc-train experiment=demo strategy=diloco
    gasloc-train -m experiment=demo strategy=gasloc,diloco,ddp   # one job per strategy
    python -m gasloc_lightning.train --cfg job          # print the composed config

Each job: check the config, build every part from its ``_target_``, print the budget
(tokens, rounds = steps / H, workers), fit (validating every ``trainer.val_check_interval`` steps
and once more after the last step, on the final model: :class:`FinalValidation`), and leave
``summary.json`` and ``metrics.csv`` in its folder (see :mod:`gasloc_lightning.app.summary`).
Workers are spawned, not re-executed ("popen"): under Hydra the popen launcher rebuilds each
child's command from the parent's command line, so with ``-m`` every child would start the whole
sweep again. Everything the spawn pickles to the children is a module-level class built by Hydra.
After each job the process group is destroyed and the environment (MASTER_PORT, ...) restored, so
the next job of a sweep starts clean.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig
from typing_extensions import override

from gasloc_lightning.app.config import check_choices, config_dir
from gasloc_lightning.app.run_tensorboard import WorkerTensorBoard, place_rank_zero_tensorboard
from gasloc_lightning.app.summary import SUMMARY_FILE, count_rounds, describe_strategy
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    """What a run will consume: the numbers every strategy of a fair comparison shares.

    Args:
        workers: n, worker processes over all nodes.
        steps: optimizer steps per worker.
        batch_size: B, sequences per worker per step.
        block_size: T, tokens per sequence.
        inner_steps: H, steps per communication round (1 for DDP).
    """

    workers: int
    steps: int
    batch_size: int
    block_size: int
    inner_steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size * self.workers

    @property
    def tokens(self) -> int:
        return self.tokens_per_step * self.steps

    @property
    def rounds(self) -> int:
        return count_rounds(self.steps, self.inner_steps)

    def describe(self) -> str:
        return (
            f"tokens={self.tokens:,} (B={self.batch_size} x T={self.block_size} x workers={self.workers} "
            f"x steps={self.steps}) rounds={self.rounds} (steps / H, H={self.inner_steps}) "
            f"workers={self.workers}"
        )


def check_budget(trainer_cfg: DictConfig) -> None:
    """Refuse budgets the comparison cannot use: no optimizer steps at all."""
    max_steps = trainer_cfg.max_steps
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(
            f"trainer.max_steps={max_steps!r}: the budget is counted in optimizer steps per worker and "
            "must be >= 1 (a budget of zero steps trains nothing)"
        )


class FinalValidation(Callback):
    """Validates after the last optimizer step, whatever ``val_check_interval``, on the final model.

    Lightning validates every ``val_check_interval`` steps; a budget that is not a multiple of it
    (``gasloc-train trainer.max_steps=20`` with the default interval of 50) would end without a
    validation, and the run record would have no final loss. At the last step this callback:

    1. finishes the round in progress (the shorter final round, or an overlapped exchange still in
       flight), which the strategy would otherwise run only at the end of fit, after validation:
       the outer step moves the replicas' average, so the validated model would not be the final one;
    2. sets ``trainer.should_stop``: Lightning then validates once after this step (its early-stopping
       path), which is a no-op change when the interval already lands on the last step.

    Every rank reaches the last step together (same ``max_steps``), so the round stays aligned.
    """

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.max_steps < 1 or trainer.global_step < trainer.max_steps:
            return
        if isinstance(trainer.strategy, LocalStepsStrategy) and trainer.strategy.finish_pending_round():
            log.info("final round run at step=%d before the final validation", trainer.global_step)
        trainer.should_stop = True


@contextmanager
def isolated_job() -> Iterator[None]:
    """Restores os.environ and torch's thread count and destroys any process group after a job."""
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)


def _check_launcher(cfg: DictConfig) -> None:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun and cfg.strategy.get("start_method") == "popen":
        raise ValueError(
            "strategy.start_method=popen cannot run under gasloc-train -m: Lightning's popen launcher "
            "re-executes the parent's command line, so every worker would start the whole sweep again; "
            "use strategy.start_method=spawn"
        )


def _instantiate_group(nodes: DictConfig | None) -> list[Any]:
    """One object per non-null node of a dict group (callbacks, logger)."""
    if not nodes:
        return []
    return [hydra.utils.instantiate(node, _convert_="all") for node in nodes.values() if node is not None]


def build(cfg: DictConfig) -> tuple[pl.Trainer, pl.LightningModule, pl.LightningDataModule]:
    """Instantiate trainer (with strategy, callbacks, loggers), model and data from a composed config."""
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data, _convert_="all")
    model = hydra.utils.instantiate(cfg.model, _convert_="all")
    strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=[*_instantiate_group(cfg.callbacks), FinalValidation()],
        logger=_instantiate_group(cfg.logger) or False,
        _convert_="all",
    )
    placed = place_rank_zero_tensorboard(cfg, processes=trainer.num_devices * trainer.num_nodes)
    if placed is not None:  # one TensorBoard run per worker: rank 0's is worker_0, the others' their own
        trainer.loggers = _instantiate_group(placed.logger)
        trainer.callbacks.append(WorkerTensorBoard(cfg.output_dir))
    return trainer, model, datamodule


def budget_of(trainer: pl.Trainer, datamodule: Any) -> Budget:
    """The budget of a built run (the strategy has resolved its world size by now)."""
    return Budget(
        workers=trainer.num_devices * trainer.num_nodes,
        steps=trainer.max_steps,
        batch_size=datamodule.batch_size,
        block_size=datamodule.block_size,
        inner_steps=describe_strategy(trainer.strategy)["inner_steps"] or 1,
    )


def train(cfg: DictConfig) -> float | None:
    """Run one job of a composed config; returns the final consensus validation loss (for sweepers).

    Args:
        cfg: the composed config (``conf/train.yaml`` and its groups).
    """
    check_choices(cfg)
    check_budget(cfg.trainer)
    _check_launcher(cfg)
    with isolated_job():
        trainer, model, datamodule = build(cfg)
        strategy = describe_strategy(trainer.strategy)
        log.info(
            "budget strategy=%s topology=%s outer_lr=%s outer_momentum=%s %s",
            strategy["name"], strategy["topology"], strategy["outer_lr"], strategy["outer_momentum"],
            budget_of(trainer, datamodule).describe(),
        )
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    val_loss = trainer.callback_metrics.get("val/loss")
    log.info("finished val_loss=%s summary=%s", None if val_loss is None else f"{float(val_loss):.4f}",
             os.path.join(cfg.output_dir, SUMMARY_FILE))
    return None if val_loss is None else float(val_loss)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Console entry point ``gasloc-train``."""
    return train(cfg)


if __name__ == "__main__":
    main()
