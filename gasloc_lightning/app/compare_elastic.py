"""``gasloc-compare <elastic or netlab run folder>``: the workers of one elastic run, side by side.

An elastic run folder (``gasloc-elastic`` or ``gasloc-netlab``'s elastic mode) holds ``elastic_summary.json`` and
one ``worker_<W>`` folder per worker, each with its own ``csv/metrics.csv`` (and ``csv/incarnation_<k>/metrics.csv``
for each process the launcher started again in that slot). This writes into ``out_dir``:

- ``workers.md``: per worker, its status, exit code, incarnations, applied and final steps, final consensus
  validation loss and failed exchanges and collectives (from ``elastic_summary.json``);
- ``loss_vs_step.png``: each worker's training loss (and validation loss, dots) against its step;
- ``quorum_vs_time.png``: the quorum size against the launcher's seconds (``quorum_history``);
- ``failed_exchanges.png``: each worker's failed exchanges (cumulative) against its step.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gasloc_lightning.utils.records import dash

ELASTIC_SUMMARY = "elastic_summary.json"  # the launcher's (gasloc_lightning.app.elastic.ELASTIC_SUMMARY_FILE)
WORKERS_TABLE = "workers.md"
CSV_INCARNATION_PREFIX = "incarnation_"  # worker_<W>/csv/incarnation_<k>: the CSV log of the worker's k-th process


@dataclass
class WorkerSeries:
    """One worker's logged series, each a list of (step, value)."""

    train_loss: list[tuple[int, float]] = field(default_factory=list)
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    failed_exchanges: list[tuple[int, float]] = field(default_factory=list)


def is_elastic_run(path: str | Path) -> bool:
    return (Path(path) / ELASTIC_SUMMARY).is_file()


def worker_csvs(worker_dir: Path) -> list[Path]:
    """A worker's ``metrics.csv`` files, its first process's then each later one's (``csv/incarnation_<k>``: a
    restart or a released spare; Lightning's CSVLogger would have deleted the earlier file), in order."""
    later = sorted(worker_dir.glob(f"csv/{CSV_INCARNATION_PREFIX}*/metrics.csv"),
                   key=lambda path: int(path.parent.name.removeprefix(CSV_INCARNATION_PREFIX) or 0))
    return [path for path in (worker_dir / "csv" / "metrics.csv", *later) if path.is_file()]


def read_worker_series(*metrics_csvs: Path) -> WorkerSeries:
    """The series of one worker's ``metrics.csv`` files, in order (empty when it wrote none)."""
    series = WorkerSeries()
    for metrics_csv in metrics_csvs:
        if metrics_csv.is_file():
            _read_into(series, metrics_csv)
    return series


def _read_into(series: WorkerSeries, metrics_csv: Path) -> None:
    with metrics_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = row.get("step")
            if not step:
                continue
            for column, values in (("train/loss", series.train_loss), ("val/loss", series.val_loss),
                                   ("comm/failed_exchanges", series.failed_exchanges)):
                if row.get(column):
                    values.append((int(float(step)), float(row[column])))


def workers_table(summary: dict[str, Any]) -> str:
    """The per-worker markdown table of an elastic run's summary."""
    lines = ["| worker | status | exit | incarnations | applied steps | final step | val loss | failed exchanges "
             "| failed collectives |", "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["workers"]:
        loss = "-" if row.get("val_loss") is None else f"{row['val_loss']:.4f}"
        lines.append(f"| {row['worker']} | {row['status']} | {dash(row.get('exit_code'))} "
                     f"| {dash(row.get('incarnations'))} | {dash(row.get('applied_steps'))} "
                     f"| {dash(row.get('final_step'))} | {loss} | {dash(row.get('failed_exchanges'))} "
                     f"| {dash(row.get('failed_collectives'))} |")
    return "\n".join(lines)


def compare_elastic(run_dir: str | Path, out_dir: str | Path, plots: bool = True) -> tuple[str, Path, list[Path]]:
    """Write the per-worker table (and plots) of the elastic run in ``run_dir`` into ``out_dir``.

    Returns:
        the table, its path, and the plots written.
    """
    run, out = Path(run_dir), Path(out_dir)
    summary = json.loads((run / ELASTIC_SUMMARY).read_text())
    out.mkdir(parents=True, exist_ok=True)
    table = workers_table(summary)
    series = {row["worker"]: read_worker_series(*worker_csvs(run / f"worker_{row['worker']}"))
              for row in summary["workers"]}
    written = _plots(series, summary.get("quorum_history") or [], out) if plots else []
    figures = "".join(f"\n![{p.stem}]({p.name})" for p in written)
    path = out / WORKERS_TABLE
    chaos = ", ".join(summary.get("chaos") or []) or "none"
    path.write_text(f"# Workers of the elastic run {run}\n\nchaos: {chaos}\n\n{table}\n{figures}\n")
    return table, path, written


def _plots(series: dict[int, WorkerSeries], quorum: list[dict[str, Any]], out: Path) -> list[Path]:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone

    def figure(name: str, xlabel: str, ylabel: str, draw: Any) -> Path:
        fig = Figure(figsize=(8, 4))
        ax = fig.subplots()
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        return out / name

    def losses(ax: Any) -> None:
        for worker, s in series.items():
            if s.train_loss:
                line, = ax.plot(*zip(*s.train_loss), linewidth=1, alpha=0.8, label=f"worker {worker}")
                if s.val_loss:
                    ax.plot(*zip(*s.val_loss), "o", color=line.get_color(), markersize=4)

    def quorum_sizes(ax: Any) -> None:
        if quorum:
            ax.step([q["time_s"] for q in quorum], [q["quorum_size"] for q in quorum], where="post")

    def failures(ax: Any) -> None:
        for worker, s in series.items():
            if s.failed_exchanges:
                ax.plot(*zip(*s.failed_exchanges), linewidth=1, label=f"worker {worker}")

    return [figure("loss_vs_step.png", "step", "loss (line: train; dots: consensus validation)", losses),
            figure("quorum_vs_time.png", "launcher time (s)", "quorum size", quorum_sizes),
            figure("failed_exchanges.png", "step", "failed exchanges (cumulative)", failures)]
