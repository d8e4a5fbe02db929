"""Speed of ``gasloc-sim`` against the multi-process runs, side by side, as ratios.

Three measurements, each with its target:

1. At 8 workers: worker-steps per second of ``gasloc-train`` (8 processes) and of ``gasloc-sim``
   (one process) on the same config; target: the simulator at least 5x.
2. At 256 workers: the simulator's seconds per step, projected to 1,000 steps; target: at most 30 min.
3. ``--churn``: down workers cost no compute. The same simulated run with no worker down and with 20% of
   them down in every round (a replayed membership, ``sim.live_by_round``: no joins, so only the compute
   differs), alternated ``--churn-repeats`` times, the training loop timed in this process on one torch
   thread (wall and CPU time), and its floating-point operations counted once (deterministic: what the
   compute saving is when the machine's load makes times noisy); target: the 20%-down run at least 1.2x
   faster (ideal for the training steps: 1 / 0.8 = 1.25x; the final validation costs the same in both).

Usage::

    python benchmarks/sim_speed.py --out benchmarks/results/sim_speed.json [--steps 20] [--big-steps 10]
    python benchmarks/sim_speed.py --churn [--churn-workers 64] [--churn-steps 20]

Each run is a subprocess of the real console scripts (``summary.json``'s ``wall_time_s`` is the
training loop: the multi-process fit on rank 0, the simulator's loop); total wall times including
start-up are reported too. No thresholds are asserted: the numbers are for the reader.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
COMMON = ["experiment=demo", "strategy=gasloc", "trainer.enable_progress_bar=false", "callbacks.lr_monitor=null"]


def _run(script: str, overrides: list[str], out: Path) -> dict:
    command = [str(BIN / script), *COMMON, *overrides, f"output_dir={out}"]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    total = time.perf_counter() - start
    record = json.loads((out / "summary.json").read_text())
    steps, workers = record["budget"]["steps"], record["world_size"]
    return {"script": script, "workers": workers, "steps": steps, "loop_s": record["wall_time_s"], "total_s": total,
            "worker_steps_per_s": workers * steps / record["wall_time_s"], "val_loss": record["final"]["val_loss"]}


def measure(steps: int, big_steps: int, big_workers: int) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
        runs["train_8"] = _run("gasloc-train", [*base, "trainer.devices=8"], Path(tmp) / "train8")
        runs["sim_8"] = _run("gasloc-sim", [*base, "sim.workers=8"], Path(tmp) / "sim8")
        big = [f"trainer.max_steps={big_steps}", f"trainer.val_check_interval={big_steps}", "data.val_batches=1"]
        runs["sim_big"] = _run("gasloc-sim", [*big, f"sim.workers={big_workers}"], Path(tmp) / "simbig")
    per_step = runs["sim_big"]["loop_s"] / big_steps
    return {
        "runs": runs,
        "ratio_sim_over_train_at_8": runs["sim_8"]["worker_steps_per_s"] / runs["train_8"]["worker_steps_per_s"],
        "ratio_total_sim_over_train_at_8": runs["train_8"]["total_s"] / runs["sim_8"]["total_s"],
        "target_ratio_at_8": 5.0,
        f"projected_minutes_{big_workers}x1000": per_step * 1000 / 60,
        "target_minutes": 30.0,
        "ratio_target_over_projected": 30.0 / (per_step * 1000 / 60),
    }


def _timed_loop(overrides: list[str], count_flops: bool = False) -> dict:
    """Build a simulated run in this process and time its training loop only: wall and this process's CPU time
    (one torch thread, so that no OpenMP thread spins on a shared machine); or, with ``count_flops``, count the
    loop's floating-point operations instead (torch's FlopCounterMode: deterministic, blind to the load)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hydra import compose, initialize_config_dir

    from gasloc_lightning.app import sim as sim_app
    from gasloc_lightning.app.config import config_dir

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=[*COMMON, *overrides])
    simulator, parts = sim_app.build(cfg)
    if count_flops:
        with FlopCounterMode(display=False) as counter:
            simulator.train()
        return {"loop_flops": counter.get_total_flops()}
    wall, cpu = time.perf_counter(), time.process_time()
    final = simulator.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"loop_wall_s": wall, "loop_cpu_s": cpu, "val_loss": final.get("val/loss"),
            "goodput": 1.0 if parts["churn"] is None else parts["churn"].goodput()}


def measure_churn(workers: int, steps: int, batch_size: int, repeats: int, down_fraction: float = 0.2) -> dict:
    """The simulator with no worker down and with ``down_fraction`` of them down every round, alternately
    ``repeats`` times each (a shared machine's load drifts): the training loop's wall and CPU time, medians."""
    live = list(range(workers - round(down_fraction * workers)))
    runs: dict[str, list[dict]] = {"none_down": [], "down": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "data.val_batches=1",
                f"data.batch_size={batch_size}", f"sim.workers={workers}", "sim.progress_every=0", "sim.min_live=1",
                "sim.threads=1", f"output_dir={tmp}", f"hydra.run.dir={tmp}"]
        replay = f"sim.live_by_round=[[{','.join(map(str, live))}]]"
        for _ in range(repeats):
            runs["none_down"].append(_timed_loop(base))
            runs["down"].append(_timed_loop([*base, replay]))
            print(runs["none_down"][-1], runs["down"][-1], flush=True)
        flops = {"none_down": _timed_loop(base, count_flops=True)["loop_flops"],
                 "down": _timed_loop([*base, replay], count_flops=True)["loop_flops"]}

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    return {"workers": workers, "steps": steps, "batch_size": batch_size, "repeats": repeats, "threads": 1,
            "down_fraction": 1 - len(live) / workers, "runs": runs,
            "speedup_loop_wall": median("none_down", "loop_wall_s") / median("down", "loop_wall_s"),
            "speedup_loop_cpu": median("none_down", "loop_cpu_s") / median("down", "loop_cpu_s"),
            "loop_flops": flops, "flops_ratio": flops["none_down"] / flops["down"],
            "target_speedup": 1.2, "ideal_speedup": workers / len(live)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of the 8-worker runs")
    parser.add_argument("--big-steps", type=int, default=10, help="steps of the large simulated run")
    parser.add_argument("--big-workers", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--churn", action="store_true", help="measure only the cost of down workers (3. above)")
    parser.add_argument("--churn-workers", type=int, default=64)
    parser.add_argument("--churn-steps", type=int, default=20)
    parser.add_argument("--churn-batch-size", type=int, default=4, help="sequences per worker-step")
    parser.add_argument("--churn-repeats", type=int, default=2, help="runs of each, alternating")
    args = parser.parse_args()
    if args.churn:
        result = measure_churn(args.churn_workers, args.churn_steps, args.churn_batch_size, args.churn_repeats)
    else:
        result = measure(args.steps, args.big_steps, args.big_workers)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
