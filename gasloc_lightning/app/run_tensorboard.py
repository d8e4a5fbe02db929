"""One TensorBoard for a run of many workers (``logger=tensorboard``).

Each worker's ``TensorBoardLogger`` writes ``<output_dir>/tensorboard/worker_<W>`` (not its own folder), and the
launcher writes its own series to ``<output_dir>/tensorboard/launcher``: the quorum size, the live workers, the
failed exchanges and the bytes per second of its live status, each chaos or fault event (a count, and its text) and,
in the lab (``gasloc-netlab``), each link's measured throughput (``launcher/link_<a>_to_<b>_mbit_s``).
``tensorboard --logdir <output_dir>/tensorboard`` then shows every worker and the launcher side by side.

A multi-process ``gasloc-train`` run (``trainer.devices=2``, and ``gasloc-netlab``'s train mode) is one Lightning
run whose loggers write from rank 0 only; but in GASLoC/DiLoCo each worker trains its own replica, so its train loss
is its own. There rank 0's logger writes ``worker_0`` (:func:`place_rank_zero_tensorboard`) and the first rank of
every other worker writes the same logged values, at the same steps, to ``worker_<W>`` (:class:`WorkerTensorBoard`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig
from typing_extensions import override

from gasloc_lightning.app.live_status import RunStatus
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy

TENSORBOARD_DIR = "tensorboard"
LAUNCHER_RUN = "launcher"
_TARGET = "TensorBoardLogger"


def tensorboard_nodes(cfg: DictConfig) -> list[str]:
    """The keys of ``cfg.logger`` that are a TensorBoard logger."""
    loggers = cfg.get("logger") or {}
    return [key for key, node in loggers.items() if node and str(node.get("_target_", "")).endswith(_TARGET)]


def place_worker_tensorboard(worker_cfg: DictConfig, *, run_dir: str | Path, worker: int) -> None:
    """Point worker ``worker``'s TensorBoard logger(s) at the run's one TensorBoard folder, as run ``worker_<W>``."""
    for key in tensorboard_nodes(worker_cfg):
        node = worker_cfg.logger[key]
        node.save_dir, node.name, node.version = str(run_dir), TENSORBOARD_DIR, f"worker_{worker}"


def place_rank_zero_tensorboard(cfg: DictConfig, *, processes: int) -> DictConfig | None:
    """For a run of ``processes`` > 1 with a TensorBoard logger: a copy of ``cfg`` whose logger writes ``worker_0``.

    ``None`` when nothing moves (one process, or no TensorBoard logger): a one-process run keeps its one run in
    ``<output_dir>/tensorboard``, and ``gasloc-elastic`` places each worker's logger itself.
    """
    if processes < 2 or not tensorboard_nodes(cfg):
        return None
    placed = cfg.copy()
    place_worker_tensorboard(placed, run_dir=cfg.output_dir, worker=0)
    return placed


class _WorkerSeries(Logger):
    """A logger that writes on whatever rank it lives (Lightning's TensorBoardLogger writes on rank 0 only)."""

    def __init__(self, log_dir: Path, *, flush_s: float) -> None:
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter  # only runs that ask for TensorBoard import it

        self._dir = log_dir
        self._writer: Any = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_s)

    @property
    @override
    def name(self) -> str:
        return TENSORBOARD_DIR

    @property
    @override
    def version(self) -> str:
        return self._dir.name

    @property
    @override
    def log_dir(self) -> str:
        return str(self._dir)

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Rank 0's logger records the run's hyper-parameters (the same on every rank)."""

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), step)

    @override
    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    @override
    def finalize(self, status: str) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WorkerTensorBoard(Callback):
    """Gives each worker of a multi-process run but rank 0's its own TensorBoard run, ``worker_<W>``.

    At setup (in the rank's own process, once the world is known) the first rank of every worker other than
    worker 0 adds a logger to the trainer that writes to ``<run_dir>/tensorboard/worker_<W>``: Lightning passes it
    the same values, at the same steps, as rank 0's TensorBoardLogger (``self.log`` values are each rank's own
    unless synced). Its event file is flushed at each of Lightning's logger saves and every ``flush_s`` seconds,
    and closed when the fit ends, also on an exception. A worker of ``ranks_per_worker`` > 1 ranks logs once, from
    its first rank. Nothing listens on the network.

    Args:
        run_dir: the run's output folder (``output_dir``).
        flush_s: the most seconds a logged value waits in memory before it reaches the event file (> 0).
    """

    def __init__(self, run_dir: str | Path, *, flush_s: float = 5.0) -> None:
        if not flush_s > 0:
            raise ValueError(f"flush_s must be > 0, got {flush_s!r}")
        self.run_dir = Path(run_dir)
        self.flush_s = flush_s
        self._series: _WorkerSeries | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, LocalStepsStrategy):
            worker, leader = strategy.worker_index, strategy.is_worker_leader
        else:  # DDP and the other baselines: a worker is a rank
            worker, leader = trainer.global_rank, True
        if trainer.world_size < 2 or trainer.global_rank == 0 or not leader or self._series is not None:
            return
        self._series = _WorkerSeries(self.run_dir / TENSORBOARD_DIR / f"worker_{worker}", flush_s=self.flush_s)
        trainer.loggers = [*trainer.loggers, self._series]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._series is not None:
            self._series.close()


class LauncherSeries:
    """The launcher's own TensorBoard run; every method is a no-op when the run logs no TensorBoard.

    Args:
        log_dir: the launcher's run folder (``None``: log nothing).
        flush_s: the most seconds a logged value waits in memory before it reaches the event file (> 0;
            TensorBoard's own default, 120 s, would keep a live run's launcher series minutes behind its status
            line: :meth:`for_run` takes ``elastic.status_every_s``).
    """

    def __init__(self, log_dir: str | Path | None, *, flush_s: float = 5.0) -> None:
        if not flush_s > 0:
            raise ValueError(f"flush_s must be > 0, got {flush_s!r}")
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_s = flush_s
        self._writer: Any = None
        self._events = 0
        self._last_step: int | None = None

    @classmethod
    def for_run(cls, cfg: DictConfig) -> LauncherSeries:
        """Logs to ``<output_dir>/tensorboard/launcher`` when ``cfg`` has a TensorBoard logger, else nothing."""
        wanted = bool(tensorboard_nodes(cfg))
        every_s = (cfg.get("elastic") or {}).get("status_every_s") or 5.0
        return cls(Path(cfg.output_dir) / TENSORBOARD_DIR / LAUNCHER_RUN if wanted else None, flush_s=float(every_s))

    def _write(self) -> Any:
        if self._writer is None and self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # only runs that ask for TensorBoard import it

            # SummaryWriter checks its flush period against a float clock: a fraction of a second is fine
            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_s)
        return self._writer

    def status(self, status: RunStatus) -> None:
        """Log a live status as scalars at the furthest step (once per step)."""
        writer = self._write()
        if writer is None or status.furthest_step == self._last_step:
            return
        self._last_step = step = status.furthest_step
        values = {"quorum_size": status.quorum_size, "live_workers": status.live_workers,
                  "failed_exchanges": status.failed_exchanges, "bytes_in_per_s": status.bytes_in_per_s,
                  "bytes_out_per_s": status.bytes_out_per_s}
        for name, value in values.items():
            if value is not None:
                writer.add_scalar(f"launcher/{name}", float(value), step)

    def links(self, mbit_per_s: Mapping[tuple[int, int], float], step: int) -> None:
        """Each lab link's measured throughput (site a to site b, Mbit/s) at ``step``."""
        writer = self._write()
        if writer is None:
            return
        for (a, b), rate in sorted(mbit_per_s.items()):
            writer.add_scalar(f"launcher/link_{a}_to_{b}_mbit_s", float(rate), step)

    def event(self, text: str, step: int) -> None:
        """A chaos or fault event: its running count as a scalar and its text."""
        writer = self._write()
        if writer is None:
            return
        self._events += 1
        writer.add_scalar("launcher/events", float(self._events), step)
        writer.add_text("launcher/event", text, step)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
