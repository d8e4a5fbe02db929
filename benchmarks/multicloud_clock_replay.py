"""Replay the simulated clocks of recorded ``multicloud.py`` runs without training them: under the rules they
were recorded with (which must give back every recorded time: the check), then under the issue-35 rules and
other noise draws.

Why this is exact where it is used: a run's clock depends on its steps, rounds, pairs, message sizes, live sets
and the network's noise, never on the parameters' values; and the loss of a validation does not depend on the
clock. So where the training is the recorded one (no churn: the clock-only scenarios), the first validation
that reached the target is the recorded one, found again as the validation whose replayed old stamp equals the
recorded time; its new time is the new stamp of that validation. Under churn the training itself changes
(the churn draw follows the seed, and the consensus is over other workers): rerun, not replayed.

The replay builds the run with ``gasloc-sim``'s own builder and clocks (:mod:`gasloc_lightning.sim`); only the
inner steps' arithmetic (the clock still advances) and the validation's loss are skipped.

- ``old`` rules: a validation stamped at the latest live clock; Streaming DiLoCo's quantized mean blocking at
  its post; jitter's noise pinned to seed 0 (as recorded).
- ``new`` rules: the engine's (stamped when the consensus all-reduce ends; the quantized mean waited on where
  the fragment lands); jitter's noise draw given.

Usage::

    python benchmarks/multicloud_clock_replay.py --record docs/multicloud/before_issue35/multicloud_n64.json \\
        --draws 3 --out docs/multicloud/replay_n64.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
from hydra import compose, initialize_config_dir

from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.sim import DiLoCoRounds

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multicloud as mc  # noqa: E402

CLOCK_ONLY = ("jitter", "two_clusters", "cloud_mix", "many_sites")
PINNED_DRAW_STRIDE = 100  # the extra noise draws of seed s: s + 100, s + 200, ...


class _NoBatches:
    """Stands in for the workers' data (set up for every worker, the costly part of a build): a replay draws no
    batch; a joiner's sampler restart changes no clock."""

    batch_size = 1

    def __init__(self, *args, **kwargs) -> None:
        pass

    def restart(self, worker: int) -> None:
        pass


def _old_after_step(rounds: DiLoCoRounds):
    """The previous rule: the quantized mean blocks at its post (nothing hides under compute)."""
    after_step = rounds.after_step

    def blocking(flat, step_in_round, live):
        before = set(rounds._in_flight)
        changed = after_step(flat, step_in_round, live)
        for fragment in set(rounds._in_flight) - before:
            if rounds.message_codec != "float32":
                rounds.clocks.wait_until(live, rounds._in_flight[fragment][2])
        return changed

    return blocking


def replay(overrides: list[str], rules: str, draw: int | None, tmp: Path,
           churn: bool = False) -> dict[str, list[tuple[int, float]]]:
    """``{network: [(step, stamp)]}`` of every validation of the run of ``overrides`` under ``rules``: jitter the
    run's network, the other clock-only scenarios alongside, ``draw`` its noise seed; with ``churn``, the
    preemption scenario alone, ``draw`` its churn seed (the old rules validated after the boundary's churn)."""
    others = [] if churn else [name for name in CLOCK_ONLY if name != "jitter"]
    network = ["network=preemption", f"network.preemption.seed={draw}"] if churn else \
        ["network=jitter", f"network.compute_jitter.seed={draw}", f"sim.also_networks=[{','.join(others)}]"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=["experiment=demo", "data.val_batches=2", "sim.progress_every=0",
                                            *overrides, *network, f"output_dir={tmp}"])
    with mock.patch.object(sim_app, "ShardedBatches", _NoBatches):  # no data: no step is computed
        simulator, _ = sim_app.build(cfg)
    names = ["preemption"] if churn else ["jitter", *others]
    stamps: dict[str, list[tuple[int, float]]] = {name: [] for name in names}

    def inner_step(step: int, step_in_round: int) -> None:  # the clock's part of Simulator._inner_step
        applied = set(simulator.replicas.applies(step_in_round))
        simulator.clocks.advance_compute([i for i in simulator._live if i in applied])

    def validate() -> dict:
        if rules == "old":
            boards = [simulator.clocks.times(), *simulator.clocks.times_also().values()]
            at = [max(times[i] for i in simulator._live) for times in boards]
        else:
            at = list(simulator.validation_stamps().values())
        for name, stamp in zip(names, at):
            stamps[name].append((simulator.step, stamp))
        return {}

    if churn:  # a joiner pulls the inner optimizer's state, which exists once a step ran: run one, off the clock
        x = torch.zeros(simulator.workers, 1, 8, dtype=torch.long)
        simulator.replicas.train_step(x, x.clone(), 0)
    simulator._inner_step = inner_step
    simulator.validate = validate
    if rules == "old" and isinstance(simulator.rounds, DiLoCoRounds):
        simulator.rounds.after_step = _old_after_step(simulator.rounds)
    if rules == "old":  # the boundary's churn before its validation
        end_round, apply_churn = simulator._end_round, simulator._apply_churn
        simulator._end_round = lambda: (end_round(), apply_churn())
        simulator._apply_churn = lambda: None
    with torch.no_grad():
        simulator.train()
    boards = simulator.clocks._boards  # each network's consensus all-reduce over all n: what the new rule adds
    stamps["consensus_s"] = {name: board.network.all_reduce_time(board.network.message_bytes())
                             for name, board in zip(names, boards)}
    return stamps


def _reached_step(old: list[tuple[int, float]], recorded: float | None) -> int | None:
    """The validation whose old stamp is the recorded time to the target (None: never reached)."""
    if recorded is None:
        return None
    steps = [step for step, stamp in old if math.isclose(stamp, recorded, rel_tol=1e-9, abs_tol=1e-6)]
    if len(steps) != 1:
        raise ValueError(f"no single validation replays the recorded time {recorded}: {old}")
    return steps[0]


def _overrides(scenario: mc.Scenario, method: str, extra: tuple[str, ...], seed: int) -> list[str]:
    """The run's overrides as the record ran it (Streaming DiLoCo with int4 fixed; no overlap under churn)."""
    spec = mc.METHODS[method]
    inner = f"inner_steps={spec.inner_steps or scenario.inner_steps}"
    fixed = [o for o in spec.overrides if not (scenario.name == "preemption" and o == "overlap=true")]
    codec = ["strategy.message_codec=int4"] if method == "streaming_diloco" else []
    return [*scenario.base, inner, *fixed, *codec, *extra, f"seed={seed}"]


GROUPS = {"clock": CLOCK_ONLY, "preemption": ("preemption",)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--draws", type=int, default=3, help="jitter's noise draws per held-out seed: the seed's "
                                                             "own, then pinned ones (s + 100, s + 200, ...)")
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="only these of the record's seeds")
    parser.add_argument("--own-draw-only", action="store_true", help="held-out seeds: their own noise draw only")
    parser.add_argument("--retune", nargs="*", default=["streaming_diloco"],
                        help="methods whose every tuning-seed grid point is replayed (the others: their target only, "
                             "for plain DiLoCo; their seed-0 order is the recorded one, see multicloud_retime.py)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--markdown", nargs="*", type=Path, default=None,
                        help="only print the tables of these replay files (default: --out)")
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    if args.markdown is not None:
        merged = {"runs": {}}
        for path in args.markdown or [args.out]:
            merged["runs"].update(json.loads(path.read_text())["runs"])
        print(markdown(merged, record))
        return
    workers, scenarios = record["workers"], record["scenarios"]
    result = json.loads(args.out.read_text()) if args.out.is_file() else {"workers": workers, "runs": {}}
    tmp = Path("/tmp") / "multicloud_clock_replay"
    for group in args.groups:
        names, churn = GROUPS[group], group == "preemption"
        first = scenarios[names[0]]
        scenario = mc.Scenario(names[0], workers, first["target_step"], first["inner_steps"], None)
        tuning_seed = first["tuning_seed"]
        methods = [m for m in (args.methods or first["tuning"]) if m in first["tuning"] and m in mc.METHODS
                   and "error" not in first["tuning"][m]]
        for seed in [tuning_seed, *first["held_out_seeds"]]:
            if args.seeds is not None and seed not in args.seeds:
                continue
            for method in methods:
                entries = []  # (label, scenario, recorded time to the target, or "target")
                for name in names:
                    tuning = scenarios[name]["tuning"][method]
                    if seed == tuning_seed:
                        if method == "diloco":
                            entries.append((tuning["label"], name, "target"))
                        elif method in args.retune:
                            entries += [(label, name, score["time_to_target"])
                                        for label, score in tuning.get("scores", {}).items()]
                    else:
                        chosen = scenarios[name]["results"][method]["seeds"][str(seed)]
                        entries.append((tuning["label"], name,
                                        "target" if method == "diloco" else chosen["time_to_target"]))
                for label in dict.fromkeys(label for label, _, _ in entries):
                    key = f"{group}|{method}|{label}|{seed}"
                    if key in result["runs"]:
                        continue
                    extra = tuple(_legacy_grid(method)[label]) if mc.METHODS[method].grid else ()
                    overrides = _overrides(scenario, method, extra, seed)
                    # draws: the recorded one (0, pinned) and the seed's own; under churn only the recorded one (the
                    # churn draw changes the training: rerun, not replayed)
                    draws = [0] if churn or seed == tuning_seed else [seed] if args.own_draw_only else [0, seed]
                    new = {str(draw): replay(overrides, "new", draw, tmp, churn) for draw in draws}
                    if churn or method == "streaming_diloco" or "0" not in new:
                        old = replay(overrides, "old", 0, tmp, churn)
                    else:  # the new rules add only the consensus all-reduce to this method's stamps (no churn)
                        c = new["0"]["consensus_s"]
                        old = {name: [(step, stamp - c[name]) for step, stamp in new["0"][name]] for name in names}
                    run = {"overrides": overrides, "old": old, "new": new, "recorded": {}, "reached_step": {}}
                    for entry_label, name, recorded in entries:
                        if entry_label != label:
                            continue
                        if recorded == "target":
                            step = first["target_step"]
                            seeds = scenarios[name]["results"]["diloco"]["seeds"]
                            run["recorded"][name] = seeds[str(seed)]["diloco_time"] if str(seed) in seeds else None
                            replayed = dict(old[name])[step]
                            if run["recorded"][name] is not None and not math.isclose(replayed, run["recorded"][name],
                                                                                      rel_tol=1e-9, abs_tol=1e-6):
                                raise ValueError(f"{key} {name}: replayed {replayed}, recorded {run['recorded'][name]}")
                        else:
                            step = _reached_step(old[name], recorded)
                            run["recorded"][name] = recorded
                        run["reached_step"][name] = step
                    result["runs"][key] = run
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
                    print(f"{key}: replayed, reached {run['reached_step']}", flush=True)
    print(summary(result))


def _legacy_grid(method: str) -> dict[str, tuple[str, ...]]:
    """The grid of ``method`` as the record ran it (Streaming DiLoCo: int4 fixed, the outer grid only)."""
    if method == "streaming_diloco":
        return mc._DILOCO_OUTER
    return mc.METHODS[method].grid


def ratios(result: dict, record: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{scenario: {method: {"seed/draw": new ratio to plain DiLoCo's time, or None (never)}}}`` of the
    held-out seeds, with ``"old seed"`` the recorded ratio alongside."""
    out: dict = {}
    runs = result["runs"]
    for group, names in GROUPS.items():
        for name in names:
            scenario = record["scenarios"][name]
            for key, run in runs.items():
                kgroup, method, label, seed = key.split("|")
                if kgroup != group or name not in run["reached_step"] or seed == str(scenario["tuning_seed"]):
                    continue
                reference = runs.get(f"{group}|diloco|{scenario['tuning']['diloco']['label']}|{seed}")
                if reference is None:
                    continue
                row = out.setdefault(name, {}).setdefault(method, {})
                row[f"old {seed}"] = scenario["results"][method]["ratios"][scenario["held_out_seeds"].index(int(seed))]
                step = run["reached_step"][name]
                for draw, stamps in run["new"].items():
                    if draw in reference["new"]:
                        target = dict(reference["new"][draw][name])[reference["reached_step"][name]]
                        row[f"{seed}/{draw}"] = None if step is None else dict(stamps[name])[step] / target
    return out


def _cell(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


def markdown(result: dict, record: dict) -> str:
    """One table per scenario: each method's recorded ratios (seeds 1, 2) and the replayed ones under the new
    rules, per (seed, noise draw), with their mean (None if any draw never reached the target)."""
    lines = []
    for name, methods in ratios(result, record).items():
        columns = sorted({c for row in methods.values() for c in row if not c.startswith("old")})
        lines += [f"#### {name}, n = {record['workers']} (replayed clocks)", "",
                  "| method | before (seeds 1, 2) | now, per seed/draw (" + ", ".join(columns) + ") | now, mean |",
                  "|---|---|---|---|"]
        for method, row in methods.items():
            old = ", ".join(_cell(v) for v in record["scenarios"][name]["results"][method]["ratios"][:2])
            recorded = record["scenarios"][name]["results"].get(method, {})
            seeds = record["scenarios"][name]["held_out_seeds"]

            def cell(column: str) -> str:
                if column in row:
                    return _cell(row[column])
                seed = int(column.split("/")[0])  # not replayed: never if it never reached (the training decides)
                return "never" if recorded.get("ratios", [0] * len(seeds))[seeds.index(seed)] is None else "not replayed"

            cells = [cell(c) for c in columns]
            values = [row.get(c) for c in columns]
            mean = "never" if "never" in cells else "n/a" if "not replayed" in cells else _cell(statistics.mean(values))
            lines.append(f"| {method} | {old} | {', '.join(cells)} | {mean} |")
        lines.append("")
    return "\n".join(lines)


def summary(result: dict) -> str:
    return f"{len(result['runs'])} runs replayed"


if __name__ == "__main__":
    main()
