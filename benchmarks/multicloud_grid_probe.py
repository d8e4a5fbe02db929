"""Is the outer-step grid of ``benchmarks/multicloud.py`` wide enough? Runs points beyond it on the tuning seed
and says, per scenario and method, whether any beats the recorded choice by the rule that made the choice
(plain DiLoCo: loss at the target step; the others: time to the target, then final loss).

:data:`EXTRA_OUTER` lies below both grids' smallest effective outer step eta / (1 - gamma) (1.4): 1.0. A method
with a codec choice (``gasloc_compressed``) keeps its chosen codec at the extra points.

Plain DiLoCo's recorded choice is rerun on the tuning seed and must reproduce its recorded loss at the target
step (within :data:`multicloud._REFERENCE_RTOL`, else the probe stops): that loss is the target the extra points
are timed against, as the recorded scores were. If one of DiLoCo's own extra points beats its choice, the target
itself would move: ``target_moves`` says so, and the other rows then answer only against the recorded target.
The record is not changed. Output: ``grid_probe_n<W>.json`` next to the record, replaced whole by each run
(it names the methods asked for; a method missing from a scenario was not tuned in its record).

    python benchmarks/multicloud_grid_probe.py --workers 64 --out docs/multicloud
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import multicloud as mc
from sim_runs import SimRunError

EXTRA_OUTER = ((0.5, 0.5), (0.7, 0.3))
PROBED = ("diloco", "streaming_diloco", "gasloc_one_peer", "gasloc_bw_spread", "gasloc_compressed", "gasloc_streamed")
_CODEC = "strategy.message_codec="


def extra_points(chosen_overrides: tuple[str, ...] | list[str]) -> dict[str, tuple[str, ...]]:
    """The extra (eta, gamma) points, each with the chosen codec when the choice named one."""
    codec = [o for o in chosen_overrides if o.startswith(_CODEC)]
    prefix = "".join(f"{o[len(_CODEC):]}," for o in codec)
    return {f"{prefix}eta={eta},gamma={gamma}": (*codec, f"strategy.outer_lr={eta}", f"strategy.outer_momentum={gamma}")
            for eta, gamma in EXTRA_OUTER}


def recorded(out: Path, workers: int, scenarios: tuple[str, ...]) -> dict[str, dict]:
    """Each scenario's record at ``workers``, which must have been tuned there (not ``--tuned-from``)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    for name in scenarios:
        mc.scenario_overrides(name)  # validates the name
    path = out / f"multicloud_n{workers}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run benchmarks/multicloud.py --workers {workers} first")
    record = json.loads(path.read_text())["scenarios"]
    missing = [name for name in scenarios if name not in record]
    if missing:
        raise ValueError(f"{path} has no record of {missing}")
    elsewhere = {name: record[name]["tuned_at_workers"] for name in scenarios
                 if record[name].get("tuned_at_workers", workers) != workers}
    if elsewhere:
        raise ValueError(f"{path}: {elsewhere} were tuned at another worker count (--tuned-from); probe that size")
    return {name: record[name] for name in scenarios}


def _probe_diloco(scenario: mc.Scenario, rec: dict) -> tuple[dict, tuple[float, float]]:
    seed, tuning = rec["tuning_seed"], rec["tuning"]["diloco"]
    target = scenario.target(scenario.run("diloco", tuple(tuning["overrides"]), seed, tuning["label"]))
    recorded_loss = tuning["losses"][tuning["label"]]
    if not math.isclose(target[0], recorded_loss, rel_tol=mc._REFERENCE_RTOL):
        raise ValueError(f"{scenario.name}: plain DiLoCo's {tuning['label']} on seed {seed} gave {target[0]} at the "
                         f"target step, the record {recorded_loss}: the record is not reproduced, probe refused")
    losses = {label: scenario.target(scenario.run("diloco", extra, seed, label))[0]
              for label, extra in extra_points(tuning["overrides"]).items()}
    beaten_by = [label for label, loss in losses.items() if loss < recorded_loss]
    return {"chosen": tuning["label"], "recorded_loss": recorded_loss, "rerun_loss": target[0],
            "extra_losses": losses, "beaten_by": beaten_by}, target


def _probe_method(scenario: mc.Scenario, method: str, tuning: dict, seed: int, target: tuple[float, float]) -> dict:
    best = tuning["scores"][tuning["label"]]
    try:
        scores = {label: scenario.score(scenario.run(method, extra, seed, label), target)
                  for label, extra in extra_points(tuning["overrides"]).items()}
    except SimRunError as error:
        return {"chosen": tuning["label"], "error": error.reason}
    return {"chosen": tuning["label"], "chosen_score": best, "extra_scores": scores,
            "beaten_by": [label for label, score in scores.items()
                          if mc.tuning_key(score) < mc.tuning_key(best)]}


def probe(workers: int, out: Path, scenarios: tuple[str, ...], methods: tuple[str, ...] = PROBED) -> dict:
    """Runs the extra points of ``methods`` (those each scenario's record tuned) and writes the probe record."""
    unknown = sorted(set(methods) - set(PROBED))
    if unknown or "diloco" not in methods:
        raise ValueError(f"methods must be among {list(PROBED)} and include diloco (its choice sets the target), "
                         f"got {list(methods)}")
    records = recorded(out, workers, scenarios)
    result: dict = {"workers": workers, "extra_outer": [list(point) for point in EXTRA_OUTER],
                    "methods": [m for m in PROBED if m in methods], "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        clock_only = tuple(s for s in mc.CLOCK_ONLY if s in scenarios)
        shared = mc.SharedRuns(clock_only, Path(tmp))
        for name, rec in records.items():
            runs = shared if name in clock_only else mc.SharedRuns((name,), Path(tmp))
            scenario = mc.Scenario(name, workers, rec["target_step"], rec["inner_steps"], runs)
            diloco, target = _probe_diloco(scenario, rec)
            rows = {"diloco": diloco}
            print(name, "diloco", rows["diloco"], flush=True)
            for method in (m for m in PROBED[1:] if m in methods):
                tuning = rec["tuning"].get(method)
                if tuning is None or "error" in tuning:  # not run, or the scenario cannot run it
                    continue
                rows[method] = _probe_method(scenario, method, tuning, rec["tuning_seed"], target)
                print(name, method, rows[method].get("beaten_by", rows[method].get("error")), flush=True)
            result["scenarios"][name] = {"tuning_seed": rec["tuning_seed"], "target_step": rec["target_step"],
                                         "inner_steps": rec["inner_steps"],
                                         "target_moves": bool(rows["diloco"]["beaten_by"]),
                                         "target_loss": target[0], "methods": rows}
            mc._write(out / f"grid_probe_n{workers}.json", result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--scenarios", nargs="+", default=list(mc.SCENARIOS), choices=mc.SCENARIOS)
    parser.add_argument("--methods", nargs="+", default=list(PROBED), choices=PROBED)
    parser.add_argument("--out", type=Path, default=Path("docs/multicloud"))
    args = parser.parse_args(argv)
    try:
        probe(args.workers, args.out, tuple(args.scenarios), tuple(args.methods))
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    except SimRunError as error:  # the scenarios probed before it are in the output already
        parser.exit(1, f"{parser.prog}: a run failed: {error.reason}\n")


if __name__ == "__main__":
    main()
