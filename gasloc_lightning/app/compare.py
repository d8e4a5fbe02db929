"""``gasloc-compare RUN_DIR...``: a table and plots of finished runs, side by side.

Reads every run under the given folders (a run is a folder with ``summary.json``, see
:mod:`gasloc_lightning.app.summary`; a multirun folder holds one per job), refuses two runs of the
same configuration, and writes into ``--out``:

- ``comparison.md``: strategy, topology, H, rounds, tokens, final validation loss and
  perplexity of the consensus model, bytes sent per worker and wall time, plus the
  byte-unigram entropy of the validation split (the loss of the best context-free model);
- ``val_loss_vs_tokens.png``, ``val_loss_vs_bytes.png`` and, when the runs log a
  ``sim_time`` metric, ``val_loss_vs_sim_time.png`` (matplotlib, drawn without pyplot: no backend is changed).

Given one elastic run folder (``gasloc-elastic``, ``gasloc-netlab``), it compares that run's workers instead
(:mod:`gasloc_lightning.app.compare_elastic`).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gasloc_lightning.app.compare_elastic import compare_elastic, is_elastic_run
from gasloc_lightning.app.summary import SUMMARY_FILE, load_summary

log = logging.getLogger(__name__)

STRATEGY_ORDER = ("gasloc", "diloco", "ddp", "local")
TABLE_FILE = "comparison.md"


class DuplicateRunError(ValueError):
    """Two runs share one configuration, so the table could not tell them apart."""


@dataclass
class Curve:
    """Validation loss of one run at each validation, with the x-axes it can be plotted against."""

    val_loss: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    bytes_sent: list[float | None] = field(default_factory=list)
    sim_time: list[float | None] = field(default_factory=list)


@dataclass
class Comparison:
    """What ``compare`` produced: the runs (in table order), the markdown table and the files written."""

    runs: list[dict[str, Any]]
    table: str
    table_path: Path
    plots: list[Path]


# ------------------------------------------------------------------ finding and checking runs
def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Folders holding a ``summary.json``: each path itself, or every one below it (a multirun folder).

    A run reached twice (a folder and its parent both given) is listed once.
    """
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"run folder does not exist: {path}")
        if (path / SUMMARY_FILE).is_file():
            runs = [path]
        else:
            runs = sorted((p.parent for p in path.rglob(SUMMARY_FILE)), key=_natural_key)
        if not runs:
            raise FileNotFoundError(f"no finished run under {path} (no {SUMMARY_FILE}; did the run end?)")
        found.extend(run for run in runs if run.resolve() not in {f.resolve() for f in found})
    return found


def identity(run: dict[str, Any]) -> dict[str, Any]:
    """The configuration that makes a run: everything but its outcome and where it was written."""
    keys = ("strategy", "world_size", "model", "optimizer", "schedule", "data", "seed")
    essentials = {key: run.get(key) for key in keys}
    essentials["max_steps"] = run.get("budget", {}).get("max_steps")
    return essentials


def check_unique(runs: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`DuplicateRunError` naming both runs if two share a configuration."""
    seen: dict[str, dict[str, Any]] = {}
    for run in runs:
        key = json.dumps(identity(run), sort_keys=True)
        if key in seen:
            first = seen[key]
            raise DuplicateRunError(
                f"runs {first['run_dir']} and {run['run_dir']} have the same configuration "
                f"({label(run)}, {run['world_size']} workers, seed {run.get('seed')}): the comparison "
                "would show the same row twice; pass only one of them"
            )
        seen[key] = run


def _order(run: dict[str, Any]) -> tuple[int, list[Any]]:
    name = run["strategy"]["name"]
    rank = STRATEGY_ORDER.index(name) if name in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return rank, _natural_key(Path(run["run_dir"]))


def is_gossip(strategy: dict[str, Any]) -> bool:
    """GASLoC with H = 1, eta = 1, gamma = 0 is plain gossip (adapt-then-combine, ``strategy=gossip``)."""
    return (strategy["name"] == "gasloc" and strategy.get("inner_steps") == 1 and strategy.get("outer_lr") == 1.0
            and strategy.get("outer_momentum") == 0.0)


def label(run: dict[str, Any]) -> str:
    """Short legend text: strategy, and its graph and H where they apply."""
    strategy = run["strategy"]
    if is_gossip(strategy):
        return f"gossip ({strategy['topology']})"
    if strategy["name"] == "gasloc":
        return f"gasloc ({strategy['topology']}, H={strategy['inner_steps']})"
    if strategy["name"] in ("diloco", "local"):
        return f"{strategy['name']} (H={strategy['inner_steps']})"
    return strategy["name"]


# ------------------------------------------------------------------ curves
def _float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def _sim_time_column(columns: Sequence[str]) -> str | None:
    return next((c for c in columns if c == "sim_time" or c.endswith("/sim_time")), None)


def read_curve(run: dict[str, Any]) -> Curve | None:
    """Validation rows of the run's ``metrics.csv``; columns logged at other steps are carried forward."""
    if not run.get("metrics_csv"):
        return None
    path = Path(run["run_dir"]) / run["metrics_csv"]
    if not path.is_file():
        log.warning("metrics file missing run=%s path=%s", run["run_dir"], path)
        return None
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        rows = sorted(enumerate(reader), key=lambda item: (int(item[1]["step"]), item[0]))
        sim_column = _sim_time_column(reader.fieldnames or [])
    tokens_per_step = run["budget"].get("tokens_per_step") or 0
    curve, last = Curve(), {"bytes": None, "sim": None}
    for _, row in rows:
        if row.get("comm/bytes_sent"):
            last["bytes"] = _float(row["comm/bytes_sent"])
        if sim_column and row.get(sim_column):
            last["sim"] = _float(row[sim_column])
        loss = _float(row.get("val/loss"))
        if loss is None:
            continue
        curve.val_loss.append(loss)
        tokens = _float(row.get("progress/tokens"))
        # Lightning writes the row of optimizer step k (1-based) with step = k - 1.
        curve.tokens.append(tokens if tokens is not None else (int(row["step"]) + 1) * tokens_per_step)
        sent = _float(row.get("progress/bytes_sent"))
        curve.bytes_sent.append(sent if sent is not None else last["bytes"])
        curve.sim_time.append(last["sim"])
    return curve


# ------------------------------------------------------------------ table
def _si(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}".rstrip()


def _number(value: float | None, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _entropies(runs: Sequence[dict[str, Any]]) -> set[float | None]:
    values = (run.get("unigram_entropy_val") for run in runs)
    return {None if value is None else round(value, 6) for value in values}


def markdown_table(runs: Sequence[dict[str, Any]], root: Path) -> str:
    """The comparison table in markdown, one row per run, and the unigram-entropy reference below it."""
    shared_entropy = len(_entropies(runs)) == 1
    header = ["run", "strategy", "topology", "H", "workers", "rounds", "tokens", "val loss", "val ppl",
              "bytes sent / worker", "wall time"]
    if not shared_entropy:
        header.append("unigram entropy")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        strategy, budget, final = run["strategy"], run["budget"], run["final"]
        cells = [
            os.path.relpath(run["run_dir"], root), "gossip" if is_gossip(strategy) else strategy["name"],
            str(strategy["topology"]),
            str(strategy["inner_steps"]), str(run["world_size"]), str(budget["rounds"]),
            f"{budget['tokens']:,}",
            _number(final["val_loss"], 4), _number(final["val_ppl"], 2), _si(run.get("bytes_sent"), "B"),
            f"{run['wall_time_s']:.1f} s",
        ]
        if not shared_entropy:
            cells.append(_number(run.get("unigram_entropy_val"), 4))
        lines.append("| " + " | ".join(cells) + " |")
    entropy = next(iter(_entropies(runs)))
    if shared_entropy and entropy is not None:
        lines += ["", f"Byte-unigram entropy of the validation split: {entropy:.4f} nats/byte "
                  "(the loss of the best model that ignores context; a trained model should be below it)."]
    lines += ["", "Validation loss (nats/byte) and perplexity are those of the consensus (average) model "
              "at the last validation; bytes are counted per worker over the whole run."]
    return "\n".join(lines)


# ------------------------------------------------------------------ plots
def _plot(runs: Sequence[dict[str, Any]], curves: Sequence[Curve], axis: str, xlabel: str, path: Path,
          log_x: bool = False) -> Path | None:
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (e.g. a notebook's) is left alone

    figure = Figure(figsize=(9, 4.5))
    ax = figure.subplots()
    palette = matplotlib.colormaps["tab20"]
    colors: dict[str, Any] = {}  # one colour and one legend entry per configuration; seeds share them
    drawn = 0
    for run, curve in zip(runs, curves):
        points = [(x, y) for x, y in zip(getattr(curve, axis), curve.val_loss)
                  if x is not None and (x > 0 or not log_x)]
        if points:
            name = label(run)
            first = name not in colors
            colors.setdefault(name, palette(len(colors) % palette.N))
            ax.plot(*zip(*points), marker="o", markersize=3, color=colors[name], alpha=0.85,
                    label=name if first else None)
            drawn += 1
    if not drawn:
        return None
    entropies = _entropies(runs)
    if len(entropies) == 1 and None not in entropies:
        ax.axhline(next(iter(entropies)), color="grey", linestyle="--", linewidth=1,
                   label="byte-unigram entropy (val)")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss of the consensus model (nats/byte)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_curves(runs: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Validation loss against tokens, bytes sent per worker and (when logged) simulated time."""
    curves = [read_curve(run) or Curve() for run in runs]
    specs = [("tokens", "tokens seen (summed over workers)", "val_loss_vs_tokens.png", False),
             ("bytes_sent", "bytes sent per worker (log scale)", "val_loss_vs_bytes.png", True)]
    if any(t is not None for curve in curves for t in curve.sim_time):
        specs.append(("sim_time", "simulated time (s)", "val_loss_vs_sim_time.png", False))
    written = [_plot(runs, curves, axis, xlabel, out_dir / name, log_x)
               for axis, xlabel, name, log_x in specs]
    return [path for path in written if path is not None]


# ------------------------------------------------------------------ the command
def compare(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, plots: bool = True) -> Comparison:
    """Compare the runs under ``paths``; write the table and plots into ``out_dir``.

    Args:
        paths: run folders or multirun folders.
        out_dir: where ``comparison.md`` and the PNGs go (created if needed).
        plots: whether to draw the PNGs.
    """
    runs = sorted((load_summary(path) for path in find_runs(paths)), key=_order)
    check_unique(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(os.path.commonpath([run["run_dir"] for run in runs]))
    root = root if len(runs) > 1 else root.parent
    table = markdown_table(runs, root)
    if plots and importlib.util.find_spec("matplotlib") is None:  # a base dependency; absent after --no-deps
        print("gasloc-compare: matplotlib is not installed, so no plots were drawn (pip install matplotlib)",
              file=sys.stderr)
        plots = False
    written = plot_curves(runs, out) if plots else []
    figures = "".join(f"\n![{p.stem}]({p.name})" for p in written)
    table_path = out / TABLE_FILE
    table_path.write_text(f"# Comparison of {len(runs)} runs under {root}\n\n{table}\n{figures}\n")
    return Comparison(runs=runs, table=table, table_path=table_path, plots=written)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gasloc-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders or multirun folders")
    parser.add_argument("--out", help="output folder (default: RUN_DIR if one is given, else ./comparison)")
    parser.add_argument("--no-plots", action="store_true", help="write the table only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``gasloc-compare``."""
    args = _parser().parse_args(argv)
    out = args.out or (args.run_dirs[0] if len(args.run_dirs) == 1 else "comparison")
    if len(args.run_dirs) == 1 and is_elastic_run(args.run_dirs[0]):  # its workers side by side
        table, table_path, plots = compare_elastic(args.run_dirs[0], out, plots=not args.no_plots)
        print(f"{table}\n\ntable: {table_path}")
        for path in plots:
            print(f"plot:  {path}")
        return 0
    try:
        result = compare(args.run_dirs, out, plots=not args.no_plots)
    except (FileNotFoundError, ValueError) as error:  # DuplicateRunError is a ValueError
        print(f"gasloc-compare: error: {error}", file=sys.stderr)
        return 2
    print(result.table)
    print(f"\ntable: {result.table_path}")
    for path in result.plots:
        print(f"plot:  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
