"""``gasloc-sim`` runs for the benchmark scripts: one run, one configuration over seeds, tuning on a seed.

Each run is a ``gasloc-sim`` process (the installed console script next to this interpreter) writing to
its own folder; what comes back is read from its ``summary.json`` and metrics CSV: the final consensus
validation loss, goodput, bytes, and the trace of (step, val/loss, simulated time) of every validation.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

Trace = list[tuple[int, float, float | None]]


# ``ValueError: ...``, ``omegaconf.errors.ValidationError: ...``, ``TopologyError('...')`` or a bare ``AssertionError``
_RAISED = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception)(?:[(:]|$)")
_HYDRA_CONTEXT = ("full_key:", "object_type=", "reference_type=")  # what Hydra appends after the error
_HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"  # Hydra's advice line, not the error
RUN_TIMEOUT_S = 3 * 3600.0  # far above any run here (256 workers x 90 steps: about 6 min); a hung run is killed


class SimRunError(RuntimeError):
    """A ``gasloc-sim`` run exited non-zero; the message ends with its last lines of output."""

    @property
    def reason(self) -> str:
        """The error the run raised, as one line: the last line that names an exception (Hydra follows it with
        the config key), else the last line that is not Hydra's context, else ``""``."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        raised = [line for line in lines if _RAISED.match(line)]
        told = [line for line in lines if not line.startswith(_HYDRA_CONTEXT)]
        return (raised or told or [""])[-1]


def run_sim(overrides: list[str], out: Path, experiment: str = "demo") -> dict:
    """One ``gasloc-sim experiment=<experiment> <overrides>`` run in ``out``; its summary and trace."""
    command = [str(Path(sys.executable).parent / "gasloc-sim"), f"experiment={experiment}", "data.val_batches=2",
               "sim.progress_every=0", *overrides, f"output_dir={out}"]
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=RUN_TIMEOUT_S)  # on timeout the child is killed before this raises
    except subprocess.TimeoutExpired as error:
        raise SimRunError(f"gasloc-sim killed: {' '.join(command)}\n"
                          f"TimeoutError: no result after {error.timeout:.0f} s") from None
    if result.returncode != 0:
        lines = [line for line in result.stdout.splitlines() if line.strip() and not line.startswith(_HYDRA_HINT)]
        raise SimRunError(f"gasloc-sim exited {result.returncode}: {' '.join(command)}\n" + "\n".join(lines[-15:]))
    record = json.loads((out / "summary.json").read_text())
    also = record["sim"].get("sim_time_max_also") or {}
    return {"overrides": overrides, "val_loss": record["final"]["val_loss"], "goodput": record["sim"]["goodput"],
            "wall_time_s": record["wall_time_s"], "bytes_sent": record["bytes_sent"],
            "outer_momentum": record["strategy"].get("outer_momentum"), "trace": validation_trace(out, record),
            "also_traces": {name: validation_trace(out, record, f"val/sim_time/{name}") for name in also}}


def validation_trace(out: Path, record: dict, clock: str = "val/sim_time") -> Trace:
    """(step, val/loss, simulated time or None) of every validation of a finished sim run; ``clock``: the
    column of the time (``val/sim_time/<preset>``: on a network of ``sim.also_networks``)."""
    points = []
    with open(out / record["metrics_csv"], newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("val/loss"):
                sim_time = float(row[clock]) if row.get(clock) else None
                points.append((int(row["step"]) + 1, float(row["val/loss"]), sim_time))
    return points


def time_to_reach(trace: Trace, target: float) -> float | None:
    """Simulated time of the first validation at or below ``target`` (None: never)."""
    for _, loss, sim_time in trace:
        if loss <= target:
            return sim_time
    return None


def seeded(overrides: list[str], out: Path, seeds: tuple[int, ...], experiment: str = "demo", *,
           runner: Callable[..., dict] | None = None) -> dict:
    """One configuration on every seed: the mean and sample sd of the final loss, and each seed's run
    (with its trace under ``traces``). ``runner``: what runs one (default :func:`run_sim`; a script that records
    each run to resume from passes its own)."""
    runner = runner or run_sim
    return summarized(overrides, {seed: runner([*overrides, f"seed={seed}"], out / f"seed{seed}", experiment)
                                  for seed in seeds})


def summarized(overrides: list[str], runs: dict[int, dict]) -> dict:
    """:func:`seeded`'s record of one configuration's runs, by seed (the first seed's bytes and momentum)."""
    if not runs:
        raise ValueError("summarized needs at least one run")
    seeds = list(runs)
    losses = [run["val_loss"] for run in runs.values()]
    return {"overrides": overrides, "val_loss": statistics.mean(losses),
            "val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
            "goodput": statistics.mean(run["goodput"] for run in runs.values()),
            "wall_time_s": statistics.mean(run["wall_time_s"] for run in runs.values()),
            "bytes_sent": runs[seeds[0]]["bytes_sent"], "outer_momentum": runs[seeds[0]]["outer_momentum"],
            "seeds": {str(seed): {k: v for k, v in run.items() if k != "trace"} for seed, run in runs.items()},
            "traces": {str(seed): run["trace"] for seed, run in runs.items()}}


def tuned_on(grid: dict[str, list[str]], base: list[str], out: Path, seed: int,
             experiment: str = "demo", *, runner: Callable[..., dict] | None = None) -> tuple[str, dict[str, float]]:
    """The grid point (label) with the lowest final loss on ``seed``, the tuning seed, and every point's loss
    (``runner``: as :func:`seeded`'s)."""
    runner = runner or run_sim
    losses = {label: runner([*base, *extra, f"seed={seed}"], out / slug(f"tune_{label}"), experiment)["val_loss"]
              for label, extra in grid.items()}
    return min(losses, key=losses.get), losses


def slug(label: str) -> str:
    """``label`` as a folder name Hydra's override grammar accepts in ``output_dir=`` (no ``=`` or ``,``)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def describe(name: str, run: dict) -> str:
    sd = "" if run["val_loss_sd"] is None else f" +- {run['val_loss_sd']:.4f}"
    return f"{name}: val_loss {run['val_loss']:.4f}{sd} over seeds {sorted(run['seeds'], key=int)}"
