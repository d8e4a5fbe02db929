"""The paper's claims at small scale (evidence issue): run the presets over seeds, one table per claim.

Claims, each on 8 workers with the tiny GPT on the embedded stdlib corpus (CPU-sized presets
``conf/experiment/paper_*.yaml``; ``--scale gpu`` applies their documented GPU-sized override):

(a) ``paper_h1``, H = 1: GASLoC against plain gossip on the same graph (ring, one_peer,
    exponential) and DDP. Reference: the best gossip baseline (lowest mean loss).
(b) ``paper_h10`` and ``paper_h50``, equal tokens: GASLoC (one_peer, two_peer, ring, complete)
    against DiLoCo and DDP. Reference: DiLoCo at the same H.

What each method does on worker i (every method: the same inner AdamW, lr schedule, gradient
clipping, data shard, steps and tokens; validation evaluates the average of the replicas):

- gasloc: H AdamW steps from theta_i to thetaH_i; z_i = theta_i + eta (thetaH_i - theta_i);
  u_i = z_i + gamma (z_i - x_i); theta_i' = u_i - sum_j w_ij (u_i - u_j) with this round's peers;
  x_i' = (theta_i' + gamma x_i) / (1 + gamma).
- gossip (``strategy=gossip``): one AdamW step, then theta_i' = thetaH_i - sum_j w_ij (thetaH_i -
  thetaH_j): adapt-then-combine, i.e. gasloc with H = 1, eta = 1, gamma = 0 on the same code path.
- diloco: H AdamW steps; Delta = mean_i (theta - thetaH_i) by all-reduce; theta' = one step of
  SGD(lr=eta, momentum=gamma, nesterov=True) on Delta (eta 0.7, gamma 0.9).
- ddp: gradients all-reduced (mean) every step, then one AdamW step; the replicas stay equal.

NoLoCo (arXiv 2506.10911) is not a baseline here: its outer step keeps a per-worker momentum
that is not gossiped and adds a separate pull towards the peer's weights with its own
coefficient, so it is no setting of (H, eta, gamma, W) of this package's round and would need a
third outer form with its own stability analysis.

Every configuration runs for ``--seeds`` (default 1 2 3; seed 0 is for tuning), one Hydra
multirun per method, into ``OUT/<claim>/<method>/<job>``. Then ``gasloc-compare`` (the
library function) writes ``OUT/<claim>/comparison.md`` and plots, and this script prints per
claim: final validation loss (mean, std and min-max over seeds) and its ratio to the reference.

    python benchmarks/paper_claims.py --dry-run        # commands, runs, budgets, estimated time
    python benchmarks/paper_claims.py                  # seeds 1-3: about an hour on 2 cores
    python benchmarks/paper_claims.py --tune           # the tuning sweeps on seed 0 (hours) -> OUT/tune/tuned.json
    python benchmarks/paper_claims.py --tuned OUT/tune/tuned.json   # the claims with the tuned values
    python benchmarks/paper_claims.py --report-only --out OUT       # the tables of finished runs again
    python benchmarks/paper_claims.py --quick --seeds 1 2          # a smoke run: a few steps, 4 workers
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.app.compare import compare, find_runs
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.app.summary import load_summary
from gasloc_lightning.topology import build_topology
from gasloc_lightning.app.train import Budget

# A few steps on 4 forked workers (two_peer needs 3, exponential a power of two): a smoke run.
QUICK = [
    "trainer.devices=4", "trainer.max_steps=4", "trainer.val_check_interval=2", "inner_steps=2",
    "data.batch_size=4", "data.val_batches=1", "callbacks.lr_monitor=null",
]
# The presets' GPU-sized override (each preset's comment shows the same line).
_GPU_COMMON = ["trainer=gpu", "model=small", "trainer.devices=8"]
_GPU_TAIL = ["data.batch_size=32", "data.val_batches=32", "model.warmup_steps=200", "model.optimizer.lr=1.0e-3"]
GPU_OVERRIDES = {
    "paper_h1": [*_GPU_COMMON, "trainer.max_steps=3000", "trainer.val_check_interval=250", *_GPU_TAIL],
    "paper_h10": [*_GPU_COMMON, "trainer.max_steps=5000", "trainer.val_check_interval=500", *_GPU_TAIL],
    "paper_h50": [*_GPU_COMMON, "trainer.max_steps=5000", "trainer.val_check_interval=500", *_GPU_TAIL],
}
OUTER_SWEEP, INNER_SWEEP = "tune_outer", "tune_inner"
TUNED_FILE = "tuned.json"


# ------------------------------------------------------------------ what runs
@dataclass(frozen=True)
class Cell:
    """One method of a claim: its runs differ only by seed.

    Args:
        method: the strategy preset (gasloc, gossip, diloco, ddp).
        experiment: the budget preset (paper_h1, paper_h10, paper_h50).
        topology: the graph of gasloc and gossip; None for the all-reduce methods.
    """

    method: str
    experiment: str
    topology: str | None = None

    @property
    def name(self) -> str:
        parts = [self.method, self.topology or ""]
        if self.method in ("gasloc", "diloco"):  # the methods whose H the preset sets
            parts.append(self.experiment.removeprefix("paper_"))
        return "-".join(part for part in parts if part)

    @property
    def tuning_sweep(self) -> str:
        return OUTER_SWEEP if self.method in ("gasloc", "diloco") else INNER_SWEEP

    def overrides(self) -> list[str]:
        topology = [f"topology={self.topology}"] if self.topology else []
        return [f"experiment={self.experiment}", f"strategy={self.method}", *topology]


@dataclass(frozen=True)
class Group:
    """Rows of one table block and the method they are measured against (its best cell)."""

    label: str
    cells: tuple[Cell, ...]
    reference: str


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    groups: tuple[Group, ...]

    @property
    def cells(self) -> tuple[Cell, ...]:
        """Every cell once (ddp serves both H blocks of claim b)."""
        return tuple(dict.fromkeys(cell for group in self.groups for cell in group.cells))

    def quick(self) -> Claim:
        """The first block only, and the first cell of each method in it."""
        group = self.groups[0]
        firsts: list[Cell] = []
        for cell in group.cells:
            if cell.method not in {first.method for first in firsts}:
                firsts.append(cell)
        return replace(self, groups=(replace(group, cells=tuple(firsts)),))


def _claim_b_group(experiment: str) -> Group:
    gasloc = tuple(Cell("gasloc", experiment, t) for t in ("one_peer", "two_peer", "ring", "complete"))
    label = f"H={experiment.removeprefix('paper_h')}"
    return Group(label, (*gasloc, Cell("diloco", experiment), Cell("ddp", "paper_h10")), reference="diloco")


_H1_GRAPHS = ("ring", "one_peer", "exponential")
CLAIMS = (
    Claim("a", "H = 1: GASLoC vs gossip (adapt-then-combine) on the same graph vs DDP", (
        Group("H=1", (*(Cell("gasloc", "paper_h1", t) for t in _H1_GRAPHS),
                      *(Cell("gossip", "paper_h1", t) for t in _H1_GRAPHS), Cell("ddp", "paper_h1")),
              reference="gossip"),
    )),
    Claim("b", "H in {10, 50}, equal tokens: GASLoC vs DiLoCo vs DDP",
          (_claim_b_group("paper_h10"), _claim_b_group("paper_h50"))),
)


def compose_cell(cell: Cell, extra: Sequence[str] = ()) -> DictConfig:
    """The composed ``gasloc-train`` config of a cell (plus ``extra`` overrides)."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=[*cell.overrides(), *extra])


def cell_budget(cfg: DictConfig) -> Budget:
    """Workers, steps, B, T and H of a composed cell (H = 1 for ddp and gossip)."""
    return Budget(
        workers=cfg.trainer.devices * cfg.trainer.num_nodes, steps=cfg.trainer.max_steps,
        batch_size=cfg.data.batch_size, block_size=cfg.data.block_size,
        inner_steps=int(cfg.strategy.get("inner_steps", 1)),
    )


# ------------------------------------------------------------------ tuning grids
def sweep_grid(sweep: str) -> dict[str, list[str]]:
    """``hydra.sweeper.params`` of ``conf/sweep/<sweep>.yaml``: key -> its values as override strings."""
    params = OmegaConf.load(config_dir() / "sweep" / f"{sweep}.yaml").hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return {o.key_or_group: list(o.sweep_string_iterator()) if o.is_sweep_override()
            else [o.get_value_element_as_str()] for o in parsed}


def stable_momenta(topology: str | None, world_size: int, gammas: Sequence[float]) -> list[float]:
    """The gammas strictly below the topology's largest stable one (all of them for an all-reduce)."""
    if topology is None:
        return list(gammas)
    limit = build_topology(topology).max_stable_momentum(world_size)
    return [gamma for gamma in gammas if limit is not None and gamma < limit]


def tuning_overrides(cell: Cell, world_size: int) -> list[str]:
    """The sweep of a cell's tuning, its gammas restricted to the stability region."""
    extra = [f"sweep={cell.tuning_sweep}", "seed=0"]
    if cell.tuning_sweep == OUTER_SWEEP:
        gammas = [float(g) for g in sweep_grid(OUTER_SWEEP)["strategy.outer_momentum"]]
        kept = stable_momenta(cell.topology, world_size, gammas)
        extra.append("strategy.outer_momentum=" + ",".join(str(g) for g in kept))
    return extra


def grid_size(cell: Cell, world_size: int) -> int:
    """Jobs of a cell's tuning sweep (seed 0 only)."""
    grid = {k: v for k, v in sweep_grid(cell.tuning_sweep).items() if k != "seed"}
    if cell.tuning_sweep == OUTER_SWEEP:
        gammas = [float(g) for g in grid["strategy.outer_momentum"]]
        grid["strategy.outer_momentum"] = stable_momenta(cell.topology, world_size, gammas)
    return math.prod(len(values) for values in grid.values())


# ------------------------------------------------------------------ time
@dataclass(frozen=True)
class CostModel:
    """Seconds on the 2-core CPU machine, for the estimate printed before running.

    step_s comes from the demo (docs/user_guide.md): 4 workers x 100 steps of the tiny GPT at 4,096 tokens per
    step trained in 12-16 s. The presets also take 4,096 tokens per step, on 8 workers: the same
    compute plus each process's fixed per-step cost (hooks, a metrics row), hence 0.18 s, not 0.14.
    job_start_s and launch_s come from this script's smoke run (``--quick --seeds 1 2``: 4 forked
    workers, about 1.3 s a job; about 8 s from the command to its first job), on a loaded machine.
    Each launch prints its measured time next to this estimate, to recalibrate.

    Args:
        step_s: one optimizer step of all workers, per 4,096 tokens.
        exchange_s: one gossip round or all-reduce of the 0.12M-parameter model, all workers in lockstep.
        validation_s: one validation (val_batches=8 per worker, on the average of the replicas).
        job_start_s: one job: build model and data, fork 8 workers, connect them, write the summary.
        launch_s: one ``gasloc-train -m``: imports, and composing every job's config.
    """

    step_s: float = 0.18
    exchange_s: float = 0.03
    validation_s: float = 1.0
    job_start_s: float = 3.0
    launch_s: float = 9.0

    def job(self, budget: Budget, method: str, validations: int) -> float:
        exchanges = budget.steps if method == "ddp" else budget.rounds
        compute = budget.steps * self.step_s * budget.tokens_per_step / 4096
        return self.job_start_s + compute + exchanges * self.exchange_s + validations * self.validation_s


# ------------------------------------------------------------------ launching
@dataclass
class Launch:
    """One ``gasloc-train -m``: a cell's jobs (its seeds, or its tuning grid)."""

    claim: str
    cell: Cell
    directory: Path
    overrides: list[str]
    jobs: int
    budget: Budget
    estimate_s: float | None
    returncode: int | None = None
    seconds: float | None = None
    log: Path | None = field(default=None)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gasloc_lightning.train", "-m", *self.overrides,
                f"hydra.sweep.dir={self.directory}"]


def scale_overrides(cell: Cell, args: argparse.Namespace) -> list[str]:
    """Overrides every job of a cell gets: scale, start method, quick mode."""
    extra = ["trainer.enable_progress_bar=false"]
    if args.scale == "gpu":
        extra += GPU_OVERRIDES[cell.experiment]
    else:  # fork: spawn re-imports torch and Lightning in each of 8 workers (~25 s a job on 2 cores)
        extra.append(f"strategy.start_method={args.start_method}")
    return extra + (QUICK if args.quick else [])


def plan(claims: Sequence[Claim], args: argparse.Namespace, tuned: dict[str, Any], cost: CostModel) -> list[Launch]:
    """Every launch of the claims' runs (``args.tune``: of the tuning sweeps), with its estimate."""
    launches = []
    for claim in claims:
        for cell in claim.cells:
            extra = scale_overrides(cell, args)
            cfg = compose_cell(cell, extra)
            budget = cell_budget(cfg)
            if args.tune:
                extra += tuning_overrides(cell, budget.workers)
                jobs, directory = grid_size(cell, budget.workers), args.out / "tune" / claim.key / cell.name
            else:
                extra += ["sweep=paper_seeds", "seed=" + ",".join(map(str, args.seeds))]
                extra += tuned_for(cell, tuned)
                jobs, directory = len(args.seeds), args.out / claim.key / cell.name
            validations = budget.steps // cfg.trainer.val_check_interval
            estimate = None if args.scale == "gpu" else (
                cost.launch_s + jobs * cost.job(budget, cell.method, validations))
            launches.append(Launch(claim.key, cell, directory, [*cell.overrides(), *extra], jobs, budget, estimate))
    return launches


def finished(launch: Launch) -> bool:
    """Whether the launch's folder already holds one finished run per job (a rerun skips it)."""
    return launch.directory.is_dir() and len(list(launch.directory.rglob("summary.json"))) >= launch.jobs


def run(launch: Launch) -> None:
    """Run one launch; its output goes to ``launch.log`` in its folder."""
    launch.directory.mkdir(parents=True, exist_ok=True)
    launch.log = launch.directory / "launch.log"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    start = time.perf_counter()
    with launch.log.open("w") as log:
        launch.returncode = subprocess.run(launch.command(), stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    launch.seconds = time.perf_counter() - start


# ------------------------------------------------------------------ reading runs
def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def load_cell_runs(directory: Path) -> list[dict[str, Any]]:
    """Every finished run under a cell's folder (none if it did not run)."""
    if not directory.is_dir() or not list(directory.rglob("summary.json")):
        return []
    return [load_summary(path) for path in find_runs([directory])]


@dataclass
class Row:
    """One method's runs over seeds."""

    cell: Cell
    runs: list[dict[str, Any]]

    @property
    def losses(self) -> list[float]:
        return [run["final"]["val_loss"] for run in self.runs if run["final"]["val_loss"] is not None]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses) if self.losses else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0

    @property
    def inner_steps(self) -> str:
        values = {run["strategy"]["inner_steps"] for run in self.runs}
        return ",".join(map(str, sorted(values))) if values else "?"


def _reference(rows: Sequence[Row], method: str) -> Row | None:
    candidates = [row for row in rows if row.cell.method == method and row.losses]
    return min(candidates, key=lambda row: row.mean, default=None)


def group_table(group: Group, rows: Sequence[Row]) -> list[str]:
    """Markdown lines of one block: each method's loss over seeds and its ratio to the reference."""
    reference = _reference(rows, group.reference)
    same_graph = group.reference == "gossip"
    header = ["method", "graph", "H", "seeds", "final val loss (mean)", "std", "min - max",
              f"ratio to {reference.cell.name if reference else group.reference}"]
    header += ["ratio to gossip, same graph"] if same_graph else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ratio = row.mean / reference.mean if reference and row.losses else math.nan
        cells = [row.cell.method, row.cell.topology or "complete", row.inner_steps, str(len(row.losses)),
                 f"{row.mean:.4f}", f"{row.std:.4f}",
                 f"{min(row.losses):.4f} - {max(row.losses):.4f}" if row.losses else "n/a", f"{ratio:.3f}"]
        if same_graph:
            peer = next((r for r in rows if r.cell.method == "gossip" and r.cell.topology == row.cell.topology
                         and r.losses), None)
            cells.append(f"{row.mean / peer.mean:.3f}" if peer and row.losses and row.cell.topology else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _budget_line(rows: Sequence[Row]) -> str:
    runs = [run for row in rows for run in row.runs]
    if not runs:
        return "no finished runs"
    budgets = {(r["world_size"], r["budget"]["steps"], r["budget"]["tokens"]) for r in runs}
    (workers, steps, tokens), *others = sorted(budgets)
    line = f"{len(runs)} runs; per run {workers} workers x {steps} steps = {tokens:,} tokens"
    return line + ("" if not others else f" (WARNING: budgets differ: {sorted(budgets)})")


def claim_report(claim: Claim, out: Path) -> str:
    """The claim's tables (one block per H), its run count and budget; writes comparison.md and plots."""
    rows = {cell: Row(cell, load_cell_runs(out / claim.key / cell.name)) for cell in claim.cells}
    lines = [f"## Claim ({claim.key}): {claim.title}", "", _budget_line(list(rows.values())), ""]
    for group in claim.groups:
        ran = [rows[cell] for cell in group.cells if rows[cell].runs]
        lines += [f"### {group.label}", "", *group_table(group, ran), ""]
    missing = [cell.name for cell, row in rows.items() if not row.runs]
    if missing:
        lines += [f"Not run or failed: {', '.join(missing)}", ""]
    done = [out / claim.key / cell.name for cell, row in rows.items() if row.runs]
    if done:
        try:
            result = compare(done, out / claim.key)
            lines.append(f"Per-run table and plots: {result.table_path}")
        except ValueError as error:  # tuned gasloc at eta=1, gamma=0 is the same run as gossip
            lines.append(f"gasloc-compare refused these runs: {error}")
    return "\n".join(lines)


# ------------------------------------------------------------------ tuning results
def tuned_for(cell: Cell, tuned: dict[str, Any]) -> list[str]:
    """A cell's tuned overrides: its own, else those tuned for the same method and H on another graph."""
    if cell.name in tuned:
        return tuned[cell.name]["overrides"]
    siblings = [name for name in tuned if name == replace(cell, topology=tuned[name].get("topology")).name]
    return tuned[siblings[0]]["overrides"] if siblings else []


def _job_overrides(run_dir: Path, keys: Sequence[str]) -> list[str]:
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    return [o for o in overrides if o.split("=", 1)[0] in keys]


def select_tuned(launches: Sequence[Launch]) -> dict[str, Any]:
    """Per cell, the tuning job with the lowest final validation loss on seed 0 and its overrides."""
    chosen = {}
    for launch in launches:
        runs = [run for run in load_cell_runs(launch.directory) if run["final"]["val_loss"] is not None]
        if not runs:
            continue
        best = min(runs, key=lambda run: run["final"]["val_loss"])
        keys = [k for k in sweep_grid(launch.cell.tuning_sweep) if k != "seed"]
        chosen[launch.cell.name] = {
            "overrides": _job_overrides(Path(best["run_dir"]), keys), "val_loss": best["final"]["val_loss"],
            "sweep": launch.cell.tuning_sweep, "jobs": len(runs), "seed": 0, "topology": launch.cell.topology,
        }
    return chosen


# ------------------------------------------------------------------ the command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paper_claims.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", nargs="+", default=[c.key for c in CLAIMS], choices=[c.key for c in CLAIMS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="reported seeds (default 1 2 3)")
    parser.add_argument("--out", type=Path, help="output folder (default outputs/paper_claims/<date_time>)")
    parser.add_argument("--scale", choices=("cpu", "gpu"), default="cpu", help="the presets' budgets (default cpu)")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork",
                        help="CPU workers (default fork: 8 spawned workers take ~25 s to start on 2 cores)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 workers, 4 steps, fewer methods")
    parser.add_argument("--tune", action="store_true", help="run the tuning sweeps on seed 0, write tuned.json")
    parser.add_argument("--tuned", type=Path, help="a tuned.json: each method's tuned overrides")
    parser.add_argument("--cells", nargs="+", default=None,
                        help="only these cells (e.g. gasloc-one_peer-h50 diloco-h50); default: every cell")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and the estimate only")
    parser.add_argument("--report-only", action="store_true", help="print the tables of finished runs in --out")
    return parser


def print_plan(launches: Sequence[Launch], args: argparse.Namespace) -> None:
    """Each launch's command and budget, then the run count and the estimated time per claim and in all."""
    for launch in launches:
        b = launch.budget
        print(f"[{launch.claim}] {launch.cell.name}: {launch.jobs} jobs x {b.workers} workers x {b.steps} steps "
              f"(H={b.inner_steps}, {b.tokens:,} tokens per job)")
        print("  $ " + " ".join(launch.command()))
    kind = "tuning jobs on seed 0" if args.tune else f"runs (seeds {' '.join(map(str, args.seeds))})"
    print()
    for claim in dict.fromkeys(launch.claim for launch in launches):
        mine = [launch for launch in launches if launch.claim == claim]
        print(f"claim ({claim}): {len(mine)} launches, {sum(l.jobs for l in mine)} {kind}, "
              f"{_estimate(mine)}")
    print(f"in all: {len(launches)} launches, {sum(l.jobs for l in launches)} {kind}, {_estimate(launches)}")


def _estimate(launches: Sequence[Launch]) -> str:
    estimates = [launch.estimate_s for launch in launches]
    if None in estimates:
        return "no time estimate at --scale gpu (the cost model is the 2-core CPU machine's)"
    return f"about {_minutes(sum(estimates))} on a 2-core CPU machine"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out = (args.out or Path("outputs", "paper_claims", datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))).resolve()
    claims = [claim.quick() if args.quick else claim for claim in CLAIMS if claim.key in args.claims]
    if args.report_only:
        print("\n\n".join(claim_report(claim, args.out) for claim in claims))
        return 0
    tuned = json.loads(args.tuned.read_text())["cells"] if args.tuned else {}
    launches = plan(claims, args, tuned, CostModel())
    if args.cells:
        launches = [launch for launch in launches if launch.cell.name in args.cells]
    print_plan(launches, args)
    if args.dry_run:
        return 0
    failed = 0
    for launch in launches:
        if finished(launch):
            print(f"[{launch.claim}] {launch.cell.name}: already finished in {launch.directory}, skipped", flush=True)
            continue
        run(launch)
        failed += launch.returncode != 0
        status = "ok" if launch.returncode == 0 else f"FAILED (exit {launch.returncode}), see {launch.log}"
        estimate = "" if launch.estimate_s is None else f" (estimated {_minutes(launch.estimate_s)})"
        print(f"[{launch.claim}] {launch.cell.name}: {launch.jobs} jobs in {_minutes(launch.seconds)}{estimate}: "
              f"{status}", flush=True)
    if args.tune:
        path = args.out / "tune" / TUNED_FILE
        chosen = select_tuned(launches)
        path.write_text(json.dumps({"cells": chosen}, indent=2, sort_keys=True) + "\n")
        for name, choice in chosen.items():
            print(f"  {name}: {' '.join(choice['overrides'])} "
                  f"(val loss {choice['val_loss']:.4f}, {choice['jobs']} jobs)")
        print(f"tuned values: {path}  (then: --tuned {path})")
        return 1 if failed else 0
    report = "\n\n".join(claim_report(claim, args.out) for claim in claims)
    (args.out / "paper_claims.md").write_text(report + "\n")
    print("\n" + report + f"\n\nreport: {args.out / 'paper_claims.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
