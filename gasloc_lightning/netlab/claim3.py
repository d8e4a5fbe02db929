"""Claim 3 on real links: wall-clock time to plain DiLoCo's final loss, 8 workers in two sites behind one link.

``python -m gasloc_lightning.netlab.claim3 --seeds 0 1 2 --out DIR`` (as root) runs, per seed, ``gasloc-netlab
netlab.mode=train`` (the static strategies, one process per rank in its site of ``two_clusters``) for each
method of :data:`METHODS`, then reads each run's ``metrics.csv``: the target is DiLoCo's final validation loss of
the same seed, and a method's time is ``progress/wall_time_s`` (from the fit's start: process start-up is left
out) at its first validation at or below it. DiLoCo runs ``--steps``, the others 1.5x as many.
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from gasloc_lightning.utils.progress import ScriptProgress
from gasloc_lightning.utils.records import write_json_atomically
from gasloc_lightning.strategies.launcher import terminate

RECORD_FILE = "run.json"  # in a run's folder once it ended: its command and curve (what a rerun reads back)
RUN_TIMEOUT_S = 1800  # each run's own limit (netlab.timeout_s): it stops its ranks and removes its lab
CHILD_GRACE_S = 120.0  # after SIGTERM: the ranks' grace, then the lab's removal

BASE = ["experiment=demo", "network=two_clusters", "netlab.mode=train", "trainer.devices=8",
        "trainer.enable_progress_bar=false", "trainer.val_check_interval=10", "data.val_batches=4"]
METHODS = {  # name: (folder, overrides)
    "diloco": ("diloco", ["strategy=diloco"]),
    "gasloc spread+overlap+bf16": ("gasloc", [
        "strategy=gasloc", "topology=bandwidth_aware", "topology.sizes=[4,4]", "topology.schedule=spread",
        "overlap=true", "strategy.message_codec=bfloat16", "strategy.outer_momentum=0.7"]),
    "gasloc one_peer+overlap": ("gasloc_one_peer", [
        "strategy=gasloc", "topology=one_peer", "overlap=true", "strategy.outer_momentum=0.7"]),
    "streaming diloco (F=4, overlap, int4)": ("streaming", [
        "strategy=diloco", "strategy.fragments=4", "strategy.overlap=true", "strategy.message_codec=int4"]),
    # issue 31: the two levels, the lab's sites as the regions (each region mean inside a site, crossings on the link)
    "two-level gasloc (K=4, delayed, int4)": ("two_level", [
        "strategy=two_level", "topology=two_level", "topology.cross_every=4", "topology.cross_overlap=true",
        "topology.cross_codec=int4"]),
    "hierarchical diloco (K=4, int4)": ("hierarchical", [
        "strategy=two_level", "topology=hierarchical", "topology.cross_every=4", "topology.cross_codec=int4"]),
}


def curve(metrics_csv: Path) -> list[tuple[int, float, float]]:
    """(step, wall seconds, validation loss) at every validation of a run's ``metrics.csv``."""
    wall: dict[int, float] = {}
    losses: list[tuple[int, float]] = []
    with open(metrics_csv) as handle:
        for row in csv.DictReader(handle):
            step = int(float(row["step"]))
            if row.get("progress/wall_time_s"):
                wall[step] = float(row["progress/wall_time_s"])
            if row.get("val/loss"):
                losses.append((step, float(row["val/loss"])))
    points = []
    for step, loss in losses:
        known = [s for s in wall if s <= step]
        if known:
            points.append((step, wall[max(known)], loss))
    return points


def time_to(points: list[tuple[int, float, float]], target: float) -> float | None:
    return next((seconds for _, seconds, loss in points if loss <= target + 1e-9), None)


def run_folder(out: Path, name: str, seed: int) -> Path:
    return out / f"seed{seed}" / METHODS[name][0]


def run_command(name: str, seed: int, steps: int, scale: float, out: Path) -> list[str]:
    """The ``gasloc-netlab`` command of method ``name`` for ``seed``."""
    folder = run_folder(out, name, seed)
    return [sys.executable, "-m", "gasloc_lightning.app.netlab", *BASE, *METHODS[name][1], f"seed={seed}",
            f"trainer.max_steps={steps}", f"netlab.bandwidth_scale={scale}", f"output_dir={folder}",
            f"hydra.run.dir={folder}"]


def recorded(folder: Path, command: list[str], reuse: bool = False) -> list[tuple[int, float, float]] | None:
    """The curve a finished run recorded in ``folder`` with the same command (its arguments; the interpreter's path
    may differ) or, with ``reuse``, of any ``metrics.csv`` there; None: the run is still to do."""
    path = folder / RECORD_FILE
    if reuse and not path.is_file() and (folder / "csv" / "metrics.csv").exists():
        return curve(folder / "csv" / "metrics.csv")
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if _normalized(record.get("command") or []) != _normalized(command[1:]):
        return None
    return [tuple(point) for point in record["curve"]]


_PATH_KEYS = ("output_dir=", "hydra.run.dir=")


def _normalized(arguments: list[str]) -> list[str]:
    """A command's arguments with its folders resolved: ``--out runs`` and ``--out ./runs`` (or an absolute path
    to the same folder) name the same runs."""
    return [next((key + str(Path(arg[len(key):]).resolve()) for key in _PATH_KEYS if arg.startswith(key)), arg)
            for arg in arguments]


def run_method(name: str, seed: int, steps: int, scale: float, out: Path, reuse: bool = False,
               progress: ScriptProgress | None = None) -> list[tuple[int, float, float]]:
    """Run ``name`` for ``seed`` unless its folder recorded that run already (or, with ``reuse``, holds any
    ``metrics.csv``); its curve."""
    folder = run_folder(out, name, seed)
    command = run_command(name, seed, steps, scale, out)
    kept = recorded(folder, command, reuse)
    if kept is not None:
        print(f"seed {seed} {name}: recorded in {folder}", flush=True)
        return kept
    folder.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        print(progress.start(f"seed {seed} {name} in {folder}"), flush=True)
    with open(folder / "netlab.log", "w") as log_file:
        code = _run_to_the_end(command, log_file)
    if code != 0:
        raise RuntimeError(f"{name} seed {seed} failed ({code}); see {folder}/netlab.log")
    points = curve(folder / "csv" / "metrics.csv")
    write_json_atomically(folder / RECORD_FILE, {"command": command[1:], "curve": points}, indent=1)
    if progress is not None:
        progress.done()
    return points


def planned_progress(seeds: list[int], methods: list[str], steps: int, scale: float, out: Path,
                     reuse: bool = False) -> ScriptProgress:
    """Every run of the session (DiLoCo, the reference, once per seed), and how many are recorded already."""
    runs = [(name, seed, steps if name == "diloco" else int(1.5 * steps))
            for seed in seeds for name in ["diloco", *(m for m in methods if m != "diloco")]]
    kept = sum(recorded(run_folder(out, name, seed), run_command(name, seed, n, scale, out), reuse) is not None
               for name, seed, n in runs)
    return ScriptProgress(total=len(runs), recorded=kept)


def _run_to_the_end(command: list[str], log_file: Any) -> int:
    """Run one ``gasloc-netlab`` (it stops itself after ``RUN_TIMEOUT_S``); on Ctrl-C or SIGTERM here, give it
    ``CHILD_GRACE_S`` to stop its ranks and remove its lab before it is killed."""
    process = subprocess.Popen([*command, f"netlab.timeout_s={RUN_TIMEOUT_S}"], stdout=log_file,
                               stderr=subprocess.STDOUT)
    try:
        return process.wait()
    except BaseException:
        terminate([process], grace_s=CHILD_GRACE_S)
        raise


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through _run_to_the_end, which stops the lab first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="DiLoCo's steps (the others run 1.5x)")
    parser.add_argument("--scale", type=float, default=0.002, help="netlab.bandwidth_scale (0.002: 2 Mbit/s)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reuse", action="store_true",
                        help="also read runs under --out that left a metrics.csv but no run.json record (runs "
                             "recorded in run.json are always read back)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    progress = planned_progress(args.seeds, args.methods, args.steps, args.scale, args.out, args.reuse)
    results = []
    for seed in args.seeds:
        reference = run_method("diloco", seed, args.steps, args.scale, args.out, args.reuse, progress)
        target = reference[-1][2]
        diloco_s = time_to(reference, target)  # its first validation at its final loss (losses are not monotone)
        for name in args.methods:
            points = reference if name == "diloco" else run_method(
                name, seed, int(1.5 * args.steps), args.scale, args.out, args.reuse, progress)
            seconds = time_to(points, target)
            results.append({"seed": seed, "method": name, "target": target, "seconds": seconds,
                            "ratio": None if seconds is None else seconds / diloco_s, "final_loss": points[-1][2],
                            "final_s": points[-1][1]})
            print(json.dumps(results[-1]), flush=True)
            (args.out / "claim3.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
