"""What the dense DDP baseline needs to be compared with GASLoC: its traffic, its thread budget, and a clean exit.

``DenseDDPStrategy`` (the app's ``strategy=ddp``) is Lightning's ``DDPStrategy`` whose spawned workers
destroy their process group before they exit.

DDP all-reduces every gradient at every optimizer step. ``AllReduceTraffic`` counts that
traffic analytically, as the transport counts GASLoC's all-reduces: a ring all-reduce of
``num_bytes`` sends (and receives) ``2 (n - 1) / n * num_bytes`` per worker. It logs the count
under GASLoC's metric names (``comm/round``, ``comm/bytes_sent``, ``comm/bytes_received``), so
every strategy can be plotted against bytes. ``CpuThreads`` gives each local DDP process its
share of the cores, which GASLoC and DiLoCo do themselves (``cpu_threads="auto"``).

Both callbacks do nothing under a local-steps strategy (gasloc, diloco, local), so the app keeps
them in every run.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from gasloc_lightning.strategies.launcher import release_process_group
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy
from gasloc_lightning.comm.transport import ring_all_reduce_bytes

log = logging.getLogger(__name__)


class DenseDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy``, unchanged, except that its process group is destroyed before the interpreter's
    shutdown (see :func:`~gasloc_lightning.strategies.launcher.release_process_group`)."""

    @override
    def teardown(self) -> None:
        super().teardown()
        release_process_group()


def is_dense_ddp(strategy: Any) -> bool:
    """Lightning's DDP proper: a gradient all-reduce every step (not one of our local-steps subclasses)."""
    return isinstance(strategy, DDPStrategy) and not isinstance(strategy, LocalStepsStrategy)


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the gradients DDP reduces: every distinct trainable parameter, in its own dtype."""
    unique = {id(p): p for p in module.parameters() if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in unique.values())


class AllReduceTraffic(Callback):
    """Counts a DDP run's gradient all-reduce traffic per worker and logs it as GASLoC does.

    Per optimizer step every worker sends ``ring_all_reduce_bytes(gradient_bytes, n)``; with
    gradient accumulation DDP synchronises only on the step's last micro-batch, so the count
    follows ``trainer.global_step`` (also right after a resume). Each step counts as one round.
    """

    def __init__(self) -> None:
        self._bytes_per_step = 0
        self._active = False
        self._global_step = 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this worker sent so far (equal to the bytes it received)."""
        return self._global_step * self._bytes_per_step

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._active = is_dense_ddp(trainer.strategy)
        if self._active:
            self._bytes_per_step = ring_all_reduce_bytes(gradient_bytes(pl_module), trainer.world_size)
            log.info("dense all-reduce traffic bytes_per_step=%d world_size=%d",
                     self._bytes_per_step, trainer.world_size)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._active or trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        metrics = {
            "comm/round": float(self._global_step),
            "comm/bytes_sent": float(self.bytes_sent),
            "comm/bytes_received": float(self.bytes_sent),
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)


class CpuThreads(Callback):
    """Sets each DDP worker's torch thread count to its share of the machine's cores.

    Args:
        threads: ``"auto"`` (cores // local processes, at least 1) or a fixed int >= 1.
    """

    def __init__(self, threads: int | Literal["auto"] = "auto") -> None:
        is_count = isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1
        if not (threads == "auto" or is_count):
            raise ValueError(f"threads must be 'auto' or an int >= 1, got {threads!r}")
        self.threads = threads

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not is_dense_ddp(strategy) or strategy.root_device.type != "cpu":
            return
        threads = self.threads
        if threads == "auto":
            threads = max(1, (os.cpu_count() or 1) // max(1, strategy.num_processes))
        torch.set_num_threads(threads)


def traffic_bytes_sent(trainer: pl.Trainer) -> int | None:
    """This worker's bytes sent so far, from the strategy's transport or the DDP traffic callback."""
    if isinstance(trainer.strategy, LocalStepsStrategy):
        return trainer.strategy.bytes_sent
    for callback in trainer.callbacks:
        if isinstance(callback, AllReduceTraffic) and is_dense_ddp(trainer.strategy):
            return callback.bytes_sent
    return None
