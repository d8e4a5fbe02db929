"""One TensorBoard for a run of many workers (``logger=tensorboard``).

Each worker's ``TensorBoardLogger`` writes ``<output_dir>/tensorboard/worker_<W>`` (not its own folder), and the
launcher writes its own series to ``<output_dir>/tensorboard/launcher``: the quorum size, the live workers, the
failed exchanges and the bytes per second of its live status, each chaos or fault event (a count, and its text) and,
in the lab (``gasloc-netlab``), each link's measured throughput (``launcher/link_<a>_to_<b>_mbit_s``).
``tensorboard --logdir <output_dir>/tensorboard`` then shows every worker and the launcher side by side.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gasloc_lightning.app.live_status import RunStatus

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
