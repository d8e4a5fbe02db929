"""Message compression: final validation loss against bytes sent, per codec, GASLoC and DiLoCo side by side.

Every run goes through ``gasloc-sim`` (one process, n stacked replicas). It uses the strategies' own
round module: the same outer step, codec, error feedback and byte count as the multi-process
strategies (``tests/test_sim_equivalence.py``). Each method keeps its strategy's tuned defaults
(``conf/strategy/gasloc.yaml``, ``conf/strategy/diloco.yaml``); nothing is retuned per codec.

Methods (``strategy.message_codec``; wire bytes against float32 with 128-element blocks: bfloat16
0.5, int8 and fp8 0.258, int4 0.133, int2 0.070):

- ``gasloc-one_peer-<codec>``: random matchings, every codec, no error feedback. Error feedback
  keeps one public copy per edge, and a random edge recurs only about once in n - 1 rounds.
- ``gasloc-ring-<codec>[-ef]``: a fixed ring, float32, int8, int4 and int2, each lossy codec with
  and without ``strategy.error_feedback`` (CHOCO per-edge copies).
- ``diloco-<codec>``: a quantized all-reduce of the pseudo-gradients, every codec but int2 (refused:
  no zero level).

Presets: ``experiment=demo`` (4 workers, 100 steps, H = 5: 20 rounds) with the full grid, and
``experiment=paper_h50`` (8 workers, 300 steps, H = 50: 6 rounds) with the codecs of
``REDUCED_GRID`` unless ``--full-grid`` is given: the full grid there does not fit the time budget
on 2 cores (see ``--dry-run``).

Each preset and method (error feedback apart) is one Hydra multirun over its codecs and ``--seeds``
(default 1 2 3; seed 0 is for tuning) into ``OUT/<preset>/<method>/<job>``, ``--jobs`` launches at a
time, each simulator on one torch thread. Then the script prints per preset and cell: the final
validation loss (mean, std, min-max over seeds), its ratio to the same method's float32 loss, the
paired difference to float32 on each seed, the bytes sent per worker and their ratio to float32's,
the last consensus distance, and the issue's targets as hits or misses. It writes ``results.json``
(every run), ``compression.md`` (the tables) and ``loss_vs_bytes.png`` to ``--out``.

    python benchmarks/compression.py --dry-run          # the commands and the estimated time
    python benchmarks/compression.py                    # both presets, seeds 1-3 (36 min on a shared 2-core box)
    python benchmarks/compression.py --report-only --out outputs/compression
    python benchmarks/compression.py --quick            # a smoke run: 4 steps, one seed (~2 min)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from gasloc_lightning.app.config import config_dir

PRESETS = ("demo", "paper_h50")
ALL_CODECS = ("float32", "bfloat16", "int8", "fp8", "int4", "int2")
RING_CODECS = ("float32", "int8", "int4", "int2")
# int2 has no zero level: DiLoCo refuses it (a biased mean of pseudo-gradients) since 885f104. The demo run
# of docs/compression.md measured it before; --report-only still lists such runs, marked.
DILOCO_CODECS = ("float32", "bfloat16", "int8", "fp8", "int4")
FAMILIES = ("gasloc-one_peer", "gasloc-ring", "diloco")
# paper_h50 is three times the demo's steps on twice its workers: its full grid (19 cells x 3 seeds)
# would take about 80 min of the 2-core machine alone. Kept: the float32 references and the codecs the
# targets name (int8 everywhere, int4 with and without error feedback, DiLoCo's int4).
REDUCED_GRID = {
    "paper_h50": {"one_peer": ("float32", "int8", "int4"), "ring": ("float32", "int8", "int4"),
                  "ring_ef": ("int4",), "diloco": ("float32", "int8", "int4")},
}
QUICK = ["trainer.max_steps=4", "trainer.val_check_interval=2", "inner_steps=2", "data.val_batches=1"]
COMMON = ["sim.threads=1", "sim.progress_every=0"]  # one thread each: 2 threads oversubscribe a shared 2-core box
RESULTS_FILE, REPORT_FILE, PLOT_FILE = "results.json", "compression.md", "loss_vs_bytes.png"


# ------------------------------------------------------------------ what runs
@dataclass(frozen=True)
class Cell:
    """One method and codec on one preset; its runs differ only by seed.

    Args:
        preset: the experiment preset (demo, paper_h50).
        method: ``gasloc`` or ``diloco``.
        codec: ``strategy.message_codec``.
        topology: GASLoC's graph (one_peer, ring); None for DiLoCo's all-reduce.
        error_feedback: ``strategy.error_feedback`` (GASLoC on the ring, lossy codecs only).
    """

    preset: str
    method: str
    codec: str
    topology: str | None = None
    error_feedback: bool = False

    @property
    def family(self) -> str:
        """The method a codec is compared within (its float32 run is the reference)."""
        return self.method if self.topology is None else f"{self.method}-{self.topology}"

    @property
    def name(self) -> str:
        return f"{self.family}-{self.codec}" + ("-ef" if self.error_feedback else "")

    def overrides(self) -> list[str]:
        graph = [f"topology={self.topology}"] if self.topology else []
        feedback = ["strategy.error_feedback=true"] if self.error_feedback else []
        return [f"experiment={self.preset}", f"strategy={self.method}", *graph,
                f"strategy.message_codec={self.codec}", *feedback]


def preset_cells(preset: str, full_grid: bool) -> list[Cell]:
    """The cells of one preset: the full grid, or the preset's reduced one (``REDUCED_GRID``)."""
    grid = {"one_peer": ALL_CODECS, "ring": RING_CODECS, "ring_ef": RING_CODECS[1:], "diloco": DILOCO_CODECS}
    if not full_grid:
        grid.update(REDUCED_GRID.get(preset, {}))
    return [*(Cell(preset, "gasloc", c, "one_peer") for c in grid["one_peer"]),
            *(Cell(preset, "gasloc", c, "ring") for c in grid["ring"]),
            *(Cell(preset, "gasloc", c, "ring", error_feedback=True) for c in grid["ring_ef"]),
            *(Cell(preset, "diloco", c) for c in grid["diloco"])]


def compose_cell(cell: Cell, extra: Sequence[str] = ()) -> DictConfig:
    """The composed ``gasloc-train`` config of a cell: ``gasloc-sim``'s tree without the ``sim`` node,
    whose ``sim.workers`` defaults to ``trainer.devices`` (``extra``: overrides outside ``sim``)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=[*cell.overrides(), *extra])


# ------------------------------------------------------------------ time
@dataclass(frozen=True)
class CostModel:
    """Wall seconds on the shared 2-core machine, for the estimate printed before running.

    Measured with one torch thread per simulator while other jobs kept the machine loaded (load
    average 5): ``experiment=paper_h50`` (1.23M tokens) took 91 s of which about 10 s start-up;
    the demo (0.41M tokens) about 35 s. Two launches at once are assumed to run 1.6 times as many
    jobs per minute as one. The run behind docs/compression.md took 35.7 min against 43.8 estimated
    (paper_h50 launches 9 % slower than estimated, the demo's 25 % faster). Each launch prints its
    measured time next to this estimate, to recalibrate.

    Args:
        tokens_per_s: tokens (all replicas) one simulator trains per second.
        launch_s: one ``gasloc-sim -m``: imports and composing the configs.
        job_s: one job's build (model, data shards) and summary.
        parallel_speedup: jobs per minute with ``--jobs 2`` against one at a time.
    """

    tokens_per_s: float = 15_500.0
    launch_s: float = 8.0
    job_s: float = 3.0
    parallel_speedup: float = 1.6

    def launch(self, tokens: int, jobs: int) -> float:
        """One launch of ``jobs`` runs of ``tokens`` tokens each."""
        return self.launch_s + jobs * (self.job_s + tokens / self.tokens_per_s)

    def total(self, seconds: Sequence[float], parallel: int) -> float:
        return sum(seconds) / (self.parallel_speedup if parallel > 1 else 1.0)


# ------------------------------------------------------------------ launching
@dataclass
class Launch:
    """One ``gasloc-sim -m``: the codecs of one method on one preset, times the seeds (jobs run in one
    process, so the imports, about half a minute on a loaded machine, are paid once per launch)."""

    cells: list[Cell]
    directory: Path
    extra: list[str]
    seeds: list[int]
    tokens: int
    estimate_s: float
    process: subprocess.Popen | None = field(default=None, repr=False)
    started: float | None = None
    seconds: float | None = None
    returncode: int | None = None

    @property
    def name(self) -> str:
        return f"{self.cells[0].preset} {self.directory.name} ({' '.join(c.codec for c in self.cells)})"

    @property
    def jobs(self) -> int:
        return len(self.cells) * len(self.seeds)

    def command(self) -> list[str]:
        simulator = str(Path(sys.executable).parent / "gasloc-sim")
        first = [o for o in self.cells[0].overrides() if not o.startswith("strategy.message_codec=")]
        codecs = "strategy.message_codec=" + ",".join(cell.codec for cell in self.cells)
        return [simulator, "-m", *first, codecs, *self.extra, "seed=" + ",".join(map(str, self.seeds)),
                f"hydra.sweep.dir={self.directory}"]

    @property
    def finished(self) -> bool:
        """Whether the folder already holds one finished run per job (a rerun skips the launch)."""
        return self.directory.is_dir() and len(list(self.directory.rglob("summary.json"))) >= self.jobs

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        with (self.directory / "launch.log").open("w") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started = time.perf_counter()

    def poll(self) -> bool:
        """Whether the launch has ended (and then its exit status and time are set)."""
        if self.process is None or self.process.poll() is None:
            return False
        self.returncode, self.seconds = self.process.returncode, time.perf_counter() - self.started
        return True

    def stop(self) -> None:
        """Terminate the simulator if it still runs (it runs its jobs in-process: no children)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def plan(args: argparse.Namespace, cost: CostModel) -> list[Launch]:
    """One launch per preset and method (error feedback apart), the longest first so that ``--jobs``
    launches at a time end close together."""
    extra = COMMON + (QUICK if args.quick else [])
    launches = []
    for preset in args.presets:
        cells = preset_cells(preset, args.full_grid or args.quick)
        cfg = compose_cell(cells[0], QUICK if args.quick else [])
        tokens = cfg.trainer.max_steps * cfg.trainer.devices * cfg.data.batch_size * cfg.data.block_size
        groups: dict[str, list[Cell]] = {}
        for cell in cells:
            groups.setdefault(cell.family + ("-ef" if cell.error_feedback else ""), []).append(cell)
        for folder, group in groups.items():
            jobs = len(group) * len(args.seeds)
            launches.append(Launch(group, args.out / preset / folder, extra, list(args.seeds), tokens,
                                   cost.launch(tokens, jobs)))
    return sorted(launches, key=lambda launch: -launch.estimate_s)


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_all's finally, which stops the simulators


def run_all(launches: Sequence[Launch], parallel: int) -> int:
    """Run the launches ``parallel`` at a time; stop every simulator on an error, Ctrl-C or SIGTERM."""
    pending = [launch for launch in launches if not launch.finished]
    for launch in launches:
        if launch not in pending:
            print(f"{launch.name}: already finished in {launch.directory}, skipped")
    running: list[Launch] = []
    failed = 0
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                launch = pending.pop(0)
                launch.start()
                running.append(launch)
            time.sleep(1.0)
            for launch in [launch for launch in running if launch.poll()]:
                running.remove(launch)
                failed += launch.returncode != 0
                status = "ok" if launch.returncode == 0 else f"FAILED (exit {launch.returncode}), see " \
                                                            f"{launch.directory / 'launch.log'}"
                print(f"{launch.name}: {launch.jobs} jobs in "
                      f"{_minutes(launch.seconds)} (estimated {_minutes(launch.estimate_s)}): {status}", flush=True)
    finally:
        for launch in running:
            launch.stop()
        signal.signal(signal.SIGTERM, previous)
    return failed


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def print_plan(launches: Sequence[Launch], args: argparse.Namespace, cost: CostModel) -> None:
    for launch in launches:
        print(f"{launch.name}: {launch.jobs} jobs x {launch.tokens:,} tokens, "
              f"about {_minutes(launch.estimate_s)}")
        print("  $ " + " ".join(launch.command()))
    print()
    for preset in args.presets:
        if preset in REDUCED_GRID and not (args.full_grid or args.quick):
            kept = "; ".join(f"{k}: {' '.join(v)}" for k, v in REDUCED_GRID[preset].items())
            print(f"{preset}: REDUCED grid for time ({kept}); --full-grid runs every codec")
        mine = [launch for launch in launches if launch.cells[0].preset == preset]
        print(f"{preset}: {sum(len(l.cells) for l in mine)} cells x {len(args.seeds)} seeds, about "
              f"{_minutes(cost.total([l.estimate_s for l in mine], args.jobs))} with --jobs {args.jobs}")
    total = cost.total([launch.estimate_s for launch in launches], args.jobs)
    print(f"in all: {len(launches)} launches, {sum(l.jobs for l in launches)} runs, about {_minutes(total)} "
          f"on the shared 2-core machine with --jobs {args.jobs}")


# ------------------------------------------------------------------ reading runs
def _job_config(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())


def load_runs(launch: Launch) -> dict[Cell, list[dict[str, Any]]]:
    """Every finished run of a launch by cell (read from the job's own config): seed, final loss, bytes."""
    runs: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in launch.cells}
    first = launch.cells[0]
    for path in sorted(launch.directory.rglob("summary.json")) if launch.directory.is_dir() else []:
        summary, strategy = json.loads(path.read_text()), _job_config(path.parent)["strategy"]
        if bool(strategy.get("error_feedback", False)) != first.error_feedback:
            raise ValueError(f"{path.parent}: error feedback {strategy.get('error_feedback')} in {launch.name}")
        # a codec outside today's grid (run by an earlier version of the script) is kept, and marked
        cell = Cell(first.preset, first.method, strategy["message_codec"], first.topology, first.error_feedback)
        runs.setdefault(cell, []).append(_run_row(cell, summary, path.parent))
    return runs


def _run_row(cell: Cell, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    loss = summary["final"]["val_loss"]
    return {
        "preset": cell.preset, "cell": cell.name, "family": cell.family, "method": cell.method,
        "topology": cell.topology or "complete", "codec": cell.codec, "error_feedback": cell.error_feedback,
        "seed": summary["seed"], "val_loss": loss if loss is not None and math.isfinite(loss) else None,
        "bytes_sent_per_worker": summary["bytes_sent"], "rounds": summary["budget"]["rounds"],
        "steps": summary["budget"]["steps"], "tokens": summary["budget"]["tokens"],
        "workers": summary["world_size"], "outer_lr": summary["strategy"]["outer_lr"],
        "outer_momentum": summary["strategy"]["outer_momentum"], "wall_time_s": summary["wall_time_s"],
        "consensus_distance": _last_consensus_distance(run_dir / summary["metrics_csv"]),
        "run_dir": "/".join(run_dir.parts[-3:]),  # <preset>/<method>/<job> under --out
    }


def _last_consensus_distance(metrics_csv: Path) -> list[float] | None:
    """(round, (1/n) sum_i ||theta_i - mean||^2) of the last measurement (every ``consensus_every`` rounds)."""
    last = None
    with metrics_csv.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("comm/consensus_distance"):
                last = [float(row["comm/round"]), float(row["comm/consensus_distance"])]
    return last


@dataclass
class Row:
    """One cell's runs over seeds."""

    cell: Cell
    runs: list[dict[str, Any]]

    @property
    def losses(self) -> list[float]:
        return [run["val_loss"] for run in self.runs if run["val_loss"] is not None]

    @property
    def diverged(self) -> int:
        return sum(run["val_loss"] is None for run in self.runs)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses) if self.losses else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0

    @property
    def bytes(self) -> float:
        values = [run["bytes_sent_per_worker"] for run in self.runs]
        return statistics.fmean(values) if values else math.nan


def load_rows(launches: Sequence[Launch]) -> list[Row]:
    by_cell = {cell: runs for launch in launches for cell, runs in load_runs(launch).items()}
    presets = list(dict.fromkeys(cell.preset for cell in by_cell))

    def order(cell: Cell) -> tuple:  # the tables' order, not the launches'
        return (presets.index(cell.preset), FAMILIES.index(cell.family), cell.error_feedback,
                ALL_CODECS.index(cell.codec))

    return [Row(cell, by_cell[cell]) for cell in sorted(by_cell, key=order)]


def reference(rows: Sequence[Row], row: Row) -> Row | None:
    """The float32 run of the same preset and method (the ring's without error feedback)."""
    return next((r for r in rows if r.cell.preset == row.cell.preset and r.cell.family == row.cell.family
                 and r.cell.codec == "float32" and r.losses), None)


# ------------------------------------------------------------------ report
def _ratio(value: float, base: float | None) -> float:
    return value / base if base and not math.isnan(value) else math.nan


def paired_gaps(row: Row, base: Row | None) -> list[float]:
    """The loss minus float32's on the same seed (the same start and batches), seed by seed."""
    if base is None:
        return []
    reference = {run["seed"]: run["val_loss"] for run in base.runs}
    return [run["val_loss"] - reference[run["seed"]] for run in row.runs
            if run["val_loss"] is not None and reference.get(run["seed"]) is not None]


def _paired(row: Row, base: Row | None) -> str:
    gaps = paired_gaps(row, base)
    return f"{min(gaps):+.4f}, {max(gaps):+.4f}" if gaps else "n/a"


def _consensus(row: Row) -> str:
    """The mean over seeds of the last consensus distance ("n/a": DiLoCo, or fewer rounds than consensus_every)."""
    measured = [run["consensus_distance"] for run in row.runs if run["consensus_distance"] is not None]
    if row.cell.method == "diloco" or not measured:
        return "n/a"
    return f"{statistics.fmean(m[1] for m in measured):.2e} ({measured[0][0]:.0f})"


def preset_table(preset: str, rows: Sequence[Row]) -> list[str]:
    header = ["method", "codec", "error feedback", "seeds", "final val loss (mean +- std)", "min - max",
              "loss / float32", "minus float32, per seed (min, max)", "MB sent per worker", "bytes / float32",
              "consensus distance (round)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    grid = set(preset_cells(preset, full_grid=True))
    for row in (r for r in rows if r.cell.preset == preset and r.runs):
        base = reference(rows, row)
        spread = f"{min(row.losses):.4f} - {max(row.losses):.4f}" if row.losses else "n/a"
        seeds = f"{len(row.losses)}" + (f" (+{row.diverged} diverged)" if row.diverged else "")
        lines.append("| " + " | ".join([
            row.cell.family, row.cell.codec + ("" if row.cell in grid else " *"),
            "yes" if row.cell.error_feedback else "no", seeds,
            f"{row.mean:.4f} +- {row.std:.4f}", spread, f"{_ratio(row.mean, base and base.mean):.4f}",
            _paired(row, base), f"{row.bytes / 1e6:.3f}", f"{_ratio(row.bytes, base and base.bytes):.3f}",
            _consensus(row)]) + " |")
    return lines


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: cells of a family and codecs whose loss and bytes must stay within bounds."""

    label: str
    family: str
    codecs: tuple[str, ...]
    error_feedback: bool | None  # None: either
    max_loss_ratio: float
    max_bytes_ratio: float | None


TARGETS = (
    Target("GASLoC int8: loss within 0.5% of float32 at <= 0.27x its bytes", "gasloc", ("int8",), None, 1.005, 0.27),
    Target("GASLoC 4-bit with error feedback: within 1% at <= 0.14x", "gasloc-ring", ("int4",), True, 1.01, 0.14),
    Target("DiLoCo 4-bit: within 1% of float32", "diloco", ("int4",), None, 1.01, None),
)


def target_lines(rows: Sequence[Row]) -> list[str]:
    lines = ["| target | preset | cell | loss / float32 | bytes / float32 | verdict |", "|---|---|---|---|---|---|"]
    for target in TARGETS:
        for row in rows:
            cell = row.cell
            if not (cell.family.startswith(target.family) and cell.codec in target.codecs and row.runs
                    and target.error_feedback in (None, cell.error_feedback)):
                continue
            base = reference(rows, row)
            loss, nbytes = _ratio(row.mean, base and base.mean), _ratio(row.bytes, base and base.bytes)
            hit = loss <= target.max_loss_ratio and (target.max_bytes_ratio is None or nbytes <= target.max_bytes_ratio)
            lines.append(f"| {target.label} | {cell.preset} | {cell.name} | {loss:.4f} | {nbytes:.3f} | "
                         f"{'HIT' if hit else 'MISS'} |")
    return lines


def report(rows: Sequence[Row], presets: Sequence[str], seeds: Sequence[int]) -> str:
    lines = ["# Compression: final validation loss against bytes sent", "",
             f"Seeds {' '.join(map(str, seeds))}; loss / float32 and bytes / float32 against the same method's "
             "float32 cell (the ring's without error feedback).", ""]
    for preset in presets:
        runs = [run for row in rows if row.cell.preset == preset for run in row.runs]
        if not runs:
            lines += [f"## {preset}", "", "no finished runs", ""]
            continue
        budget = f"{runs[0]['workers']} workers x {runs[0]['steps']} steps = {runs[0]['tokens']:,} tokens per run"
        lines += [f"## {preset}", "", f"{len(runs)} runs; {budget}", "", *preset_table(preset, rows), ""]
        if any(row.cell.preset == preset and row.cell not in preset_cells(preset, True) for row in rows):
            lines += ["\\* not in the script's grid any more: the package refuses it now (see DILOCO_CODECS)", ""]
        missing = [row.cell.name for row in rows if row.cell.preset == preset and not row.runs]
        if missing:
            lines += [f"Not run or failed: {', '.join(missing)}", ""]
    lines += ["## Targets", "", *target_lines(rows)]
    return "\n".join(lines)


# ------------------------------------------------------------------ plot
_MARKERS = {"float32": "o", "bfloat16": "s", "int8": "^", "fp8": "v", "int4": "D", "int2": "X"}
# (family, error feedback, colour, line style, label), by panel
_PANELS = {
    "GASLoC": (("gasloc-one_peer", False, "tab:blue", "-", "one_peer"), ("gasloc-ring", False, "tab:orange", "-",
               "ring"), ("gasloc-ring", True, "tab:red", "--", "ring + error feedback")),
    "DiLoCo": (("diloco", False, "tab:green", "-", "all-reduce"),),
}


def _series(rows: Sequence[Row], preset: str, family: str, feedback: bool) -> list[Row]:
    series = sorted((r for r in rows if r.cell.preset == preset and r.cell.family == family and r.losses
                     and r.cell.error_feedback == feedback), key=lambda r: r.bytes)
    if feedback and series:  # error feedback starts from the ring's float32 point
        series.append(next((r for r in rows if r.cell.preset == preset and r.cell.name == f"{family}-float32"
                            and r.losses), series[-1]))
    return series


def plot(rows: Sequence[Row], presets: Sequence[str], path: Path) -> None:
    """Mean final loss against bytes per worker (log x): a row per preset, GASLoC and DiLoCo side by side;
    colour: method, marker: codec. Error bars: the std over seeds of the loss minus float32's on the same
    seed (the seeds' own spread, which every codec shares, is in the tables)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    figure = Figure(figsize=(12, 4.5 * len(presets)))
    for k, preset in enumerate(presets):
        for m, (title, methods) in enumerate(_PANELS.items()):
            axes = figure.add_subplot(len(presets), 2, 2 * k + m + 1)
            for family, feedback, colour, style, label in methods:
                series = _series(rows, preset, family, feedback)
                axes.plot([r.bytes for r in series], [r.mean for r in series], style, color=colour, alpha=0.6,
                          label=label)
                for r in series:
                    gaps = paired_gaps(r, reference(rows, r))
                    spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
                    axes.errorbar(r.bytes, r.mean, yerr=spread, color=colour, marker=_MARKERS[r.cell.codec], ms=7,
                                  capsize=2)
            axes.set(xscale="log", xlabel="bytes sent per worker", ylabel="final val loss (mean over seeds)",
                     title=f"{title}, {preset}")
            axes.ticklabel_format(axis="y", useOffset=False)
            axes.xaxis.set_minor_formatter(NullFormatter())
            axes.grid(True, which="both", alpha=0.3)
            codecs = [Line2D([], [], color="grey", marker=c, ls="", label=n) for n, c in _MARKERS.items()]
            axes.legend(handles=[*axes.get_legend_handles_labels()[0], *codecs], fontsize=7)
    figure.suptitle("error bars: std over seeds of (loss - float32's loss on the same seed)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# ------------------------------------------------------------------ the command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compression.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="reported seeds (default 1 2 3)")
    parser.add_argument("--out", type=Path, default=Path("outputs", "compression"), help="default outputs/compression")
    parser.add_argument("--jobs", type=int, default=2, help="launches at once, one torch thread each (default 2)")
    parser.add_argument("--full-grid", action="store_true", help="every codec on every preset (paper_h50: ~80 min)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and the estimated time only")
    parser.add_argument("--report-only", action="store_true", help="the tables and plot of finished runs in --out")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, H = 2, one seed, full grid")
    return parser


def write_outputs(rows: Sequence[Row], args: argparse.Namespace) -> str:
    text = report(rows, args.presets, args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / REPORT_FILE).write_text(text + "\n")
    runs = [run for row in rows for run in row.runs]
    (args.out / RESULTS_FILE).write_text(json.dumps({"seeds": args.seeds, "runs": runs}, indent=1) + "\n")
    if runs:
        plot(rows, args.presets, args.out / PLOT_FILE)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.seeds = args.seeds[:1]
    args.out = args.out.resolve()
    cost = CostModel()
    launches = plan(args, cost)
    if args.report_only:
        print(write_outputs(load_rows(launches), args))
        return 0
    print_plan(launches, args, cost)
    if args.dry_run:
        return 0
    start = time.perf_counter()
    failed = run_all(launches, args.jobs)
    print(f"\nall launches in {_minutes(time.perf_counter() - start)}\n")
    print(write_outputs(load_rows(launches), args) + f"\n\nreport: {args.out / REPORT_FILE}, "
          f"runs: {args.out / RESULTS_FILE}, plot: {args.out / PLOT_FILE}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
