"""Workers that come and go: elastic GASLoC and elastic DiLoCo against the static strategy restarted from
its last checkpoint, under the same failure schedules.

Setup (defaults): 8 CPU workers, the tiny GPT on the embedded stdlib corpus (``experiment=demo``),
H = 50, 450 steps (9 rounds), validation every round. Schedules, in optimizer steps:

- ``none``: no failure;
- ``kill30``: the last worker is killed at 30% of the run, for good;
- ``rolling``: one worker is down at any time: worker 1 dies mid-round 0, and each failed worker
  is restarted 2 rounds later, when the next one dies;
- ``rejoin3``: every 3 rounds a worker is killed mid-round and restarted one round later.

Methods:

- ``gasloc``: ``gasloc-elastic`` with one_peer over the live quorum (torchft lighthouse);
- ``diloco``: ``gasloc-elastic elastic.method=diloco`` (the quorum's all-reduce);
- ``static``: ``gasloc-train`` (8 forked ranks, GASLoC one_peer) with a per-rank checkpoint every
  round. A kill is a real SIGKILL of that rank; the job then fails, and is started again from its
  last checkpoint with all 8 workers (a replacement takes the dead worker's place at once, which
  favours the baseline). Its restarts resume exactly, so its final model is the no-failure one.

Reported for each: the final consensus validation loss at equal steps, the last validated loss at
equal wall time (the earliest finish among the methods of that schedule), the wall time, goodput
(worker-steps kept over worker-steps computed) and wall time lost per failure (against the same
method's no-failure run).

- elastic goodput: a killed worker loses the steps of its unfinished round (its own step mod H);
  a rejoining worker takes a peer's state and recomputes nothing.
- static goodput: every rank loses the steps since the last checkpoint.

    python benchmarks/churn.py                                    # every method and schedule (~40 min)
    python benchmarks/churn.py --schedules none kill30 --methods gasloc static
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback

from gasloc_lightning.app.config import config_dir
from gasloc_lightning.app.elastic import free_port, run_elastic
from gasloc_lightning.utils.progress import ScriptProgress
from gasloc_lightning.app.summary import SUMMARY_FILE
from gasloc_lightning.app.train import train

SCHEDULES = ("none", "kill30", "rolling", "rejoin3")
METHODS = ("gasloc", "diloco", "static")


# ------------------------------------------------------------------ schedules
def schedule(name: str, workers: int, steps: int, inner_steps: int) -> list[tuple[str, int, int]]:
    """The (action, worker, step) events of a schedule, in firing order (worker 0 is never touched)."""
    half = inner_steps // 2
    if name == "none":
        return []
    if name == "kill30":
        return [("kill", workers - 1, int(0.3 * steps))]
    if name == "rolling":
        events, worker, step = [], 1, half
        while step < steps:
            events.append(("kill", worker, step))
            if step + 2 * inner_steps < steps:
                events.append(("restart", worker, step + 2 * inner_steps))  # before the next kill of that step
            worker, step = worker % (workers - 1) + 1, step + 2 * inner_steps
        return events
    if name == "rejoin3":
        events, worker = [], 1
        for start in range(3 * inner_steps, steps, 3 * inner_steps):
            events.append(("kill", worker, start + half))
            if start + half + inner_steps < steps:
                events.append(("restart", worker, start + half + inner_steps))
            worker = worker % (workers - 1) + 1
        return events
    raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")


def failures(events: list[tuple[str, int, int]]) -> int:
    return sum(action == "kill" for action, _, _ in events)


# ------------------------------------------------------------------ helpers
def common_overrides(args: argparse.Namespace, output_dir: Path) -> list[str]:
    return [
        "experiment=demo", f"inner_steps={args.inner_steps}", f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.inner_steps}", f"trainer.devices={args.workers}",
        "trainer.enable_progress_bar=false", "callbacks.lr_monitor=null", "strategy=gasloc", "topology=one_peer",
        f"seed={args.seed}", f"output_dir={output_dir}", f"cache_dir={args.cache_dir}",
    ]


def compose_app(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def validation_trace(run_dir: Path) -> list[tuple[float, int, float]]:
    """(seconds since fit start, step, val/loss) of every validation in a run's metrics.csv."""
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    points = []
    with open(run_dir / summary["metrics_csv"], newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("val/loss") and row.get("progress/wall_time_s"):
                points.append((float(row["progress/wall_time_s"]), int(row["step"]) + 1, float(row["val/loss"])))
    return points


def loss_at(trace: list[tuple[float, int, float]], seconds: float) -> float | None:
    """The last validated loss at or before ``seconds`` of wall time (None: no validation yet)."""
    reached = [loss for at, _, loss in trace if at <= seconds]
    return reached[-1] if reached else None


# ------------------------------------------------------------------ elastic methods
def run_elastic_method(method: str, events: list[tuple[str, int, int]], args, output_dir: Path) -> dict[str, Any]:
    chaos = ",".join(f"{action}:{worker}@{step}" for action, worker, step in events)
    overrides = [
        *common_overrides(args, output_dir), f"elastic.workers={args.workers}", f"elastic.method={method}",
        f"elastic.min_workers={args.min_workers}", f"elastic.chaos=[{chaos}]", "elastic.heartbeat_timeout_ms=2000",
        "elastic.gossip_timeout=10", "elastic.quorum_timeout=120", "elastic.timeout_s=1800",
    ]
    started = time.monotonic()
    summary = run_elastic(compose_app("elastic/app", overrides))
    wall = time.monotonic() - started
    rows = summary["workers"]
    # Finished: reached the end with a final validation (a restart that arrives as the run ends exits with none).
    finished = [row for row in rows if row["finished"]]
    computed = sum(row["applied_steps"] for row in rows)
    lost = 0
    for row in rows:  # each incarnation that did not finish lost the steps of its unfinished round
        ends = row["exit_steps"] if not row["finished"] else row["exit_steps"][:-1]
        lost += sum(step % args.inner_steps for step in ends)
    reference = output_dir / "worker_0"  # never touched by a schedule
    fit_wall = json.loads((reference / SUMMARY_FILE).read_text())["wall_time_s"]
    offset = wall - fit_wall  # the launch, imports and first quorum before worker 0's fit started
    trace = [(at + offset, step, loss) for at, step, loss in validation_trace(reference)]
    losses = {row["val_loss"] for row in finished}
    return {
        "final_val_loss": sum(losses) / len(losses), "consensus": len(losses) == 1, "wall_s": wall,
        "finished_workers": len(finished), "computed": computed, "kept": computed - lost, "trace": trace,
    }


# ------------------------------------------------------------------ static baseline
class KillRankAt(Callback):
    """SIGKILLs rank ``rank`` after optimizer step ``step``: the machine under that worker dies."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _latest_checkpoint(folder: Path) -> tuple[Path | None, int]:
    done = [(int(path.name.split("step=")[1].split(".")[0]), path) for path in folder.glob("*step=*.ckpt")
            if (path / "meta.json").is_file()]
    if not done:
        return None, 0
    step, path = max(done)
    return path, step


def run_static(events: list[tuple[str, int, int]], args, output_dir: Path) -> dict[str, Any]:
    kills = [(worker, step) for action, worker, step in events if action == "kill"]
    checkpoints = output_dir / "checkpoints"
    computed, elapsed, trace, attempt = 0, 0.0, [], 0
    while True:
        attempt += 1
        resume, resumed_step = _latest_checkpoint(checkpoints)
        run_dir = output_dir / f"attempt_{attempt}"
        overrides = [
            *common_overrides(args, run_dir), "strategy.start_method=fork", "strategy.gossip_timeout=30",
            "trainer.enable_checkpointing=true", "+callbacks.checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpoint",
            f"+callbacks.checkpoint.dirpath={checkpoints}", f"+callbacks.checkpoint.every_n_train_steps={args.inner_steps}",
            "+callbacks.checkpoint.save_top_k=-1",
        ]
        if resume is not None:
            overrides.append(f"ckpt_path='{resume}'")  # quoted: the name holds '='
        pending = [(worker, step) for worker, step in kills if step > resumed_step]
        if pending:
            worker, step = pending[0]
            overrides += ["+callbacks.kill._target_=__main__.KillRankAt", f"+callbacks.kill.rank={worker}",
                          f"+callbacks.kill.step={step}"]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        started = time.monotonic()
        try:
            val_loss = train(compose_app("train", overrides))
        except Exception as error:  # the killed rank ends the job: restart from the last checkpoint
            if not pending:
                raise
            elapsed += time.monotonic() - started
            computed += args.workers * (pending[0][1] - resumed_step)
            kills.remove(pending[0])
            print(f"  static: job failed at step {pending[0][1]} ({type(error).__name__}); restarting", flush=True)
            continue
        wall = time.monotonic() - started
        offset = elapsed + wall - json.loads((run_dir / SUMMARY_FILE).read_text())["wall_time_s"]
        trace += [(at + offset, step, loss) for at, step, loss in validation_trace(run_dir)]
        elapsed += wall
        computed += args.workers * (args.steps - resumed_step)
        return {"final_val_loss": val_loss, "consensus": True, "wall_s": elapsed, "finished_workers": args.workers,
                "computed": computed, "kept": args.workers * args.steps, "trace": trace, "attempts": attempt}


# ------------------------------------------------------------------ report
def report(results: dict[str, dict[str, dict[str, Any]]], events_of: dict[str, list]) -> str:
    lines = ["| schedule | method | final val loss (equal steps) | vs no churn | val loss at equal wall time | "
             "wall s | goodput | s lost per failure |", "|---|---|---|---|---|---|---|---|"]
    for name, by_method in results.items():
        equal_wall = min(result["wall_s"] for result in by_method.values())
        for method, result in by_method.items():
            base = results.get("none", {}).get(method)
            ratio = f"{result['final_val_loss'] / base['final_val_loss'] - 1:+.2%}" if base else "-"
            count = failures(events_of[name])
            lost = f"{(result['wall_s'] - base['wall_s']) / count:.1f}" if base and count else "-"
            at_wall = loss_at(result["trace"], equal_wall)
            lines.append(
                f"| {name} | {method} | {result['final_val_loss']:.4f} | {ratio} | "
                f"{'-' if at_wall is None else f'{at_wall:.4f}'} (at {equal_wall:.0f} s) | {result['wall_s']:.0f} | "
                f"{result['kept'] / result['computed']:.3f} | {lost} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--min-workers", type=int, default=6, help="smallest quorum (the start-up race stays above it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, default=Path("outputs/churn"))
    parser.add_argument("--fresh", action="store_true", help="ignore the results already in --out")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/gasloc-lightning").expanduser())
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the static baseline forks its workers from this process
    results: dict[str, dict[str, dict[str, Any]]] = {}
    record = args.out / "results.json"
    if record.is_file() and not args.fresh:  # go on where an interrupted run stopped
        results = json.loads(record.read_text())["results"]
    events_of = {name: schedule(name, args.workers, args.steps, args.inner_steps) for name in args.schedules}
    kept = sum(method in results.get(name, {}) for name in args.schedules for method in args.methods)
    progress = ScriptProgress(total=len(args.schedules) * len(args.methods), recorded=kept)
    for name in args.schedules:
        events = events_of[name]
        print(f"schedule {name}: {[f'{a}:{w}@{s}' for a, w, s in events]}", flush=True)
        for method in args.methods:
            if method in results.get(name, {}):
                print(f"  {method}: kept from {record}", flush=True)
                continue
            output_dir = (args.out / f"{name}_{method}").resolve()
            print(progress.start(f"schedule {name}, {method} (recorded in {record} when it ends)"), flush=True)
            if method == "static":
                result = run_static(events, args, output_dir)
            else:
                result = run_elastic_method(method, events, args, output_dir)
            results.setdefault(name, {})[method] = result
            progress.done()
            print(f"  {method}: val loss {result['final_val_loss']:.4f}, wall {result['wall_s']:.0f} s, "
                  f"goodput {result['kept'] / result['computed']:.3f}", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(
                {"settings": {k: str(v) for k, v in vars(args).items()}, "events": events_of, "results": results},
                indent=1))
    table = report(results, events_of)
    print(table)
    (args.out / "churn.md").write_text(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
