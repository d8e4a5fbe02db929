"""What the horizon does to the ratios (issue 31): the same runs cut at a short horizon and whole.

``benchmarks/multicloud.py`` with ``--inner-steps-grid`` runs every method at each H on the tuning seed. This script
reads those recorded runs back (it runs nothing) and, for one H (default 10, which validates every 10 steps), gives
each method's time to plain DiLoCo's loss twice:

- **whole**: the record's horizon (the target: DiLoCo's loss at ``target_step``, 2/3 of the runs' steps);
- **short**: the traces cut at ``--short-steps`` (default 90, the horizon of the earlier tables; the target:
  DiLoCo's loss at 2/3 of it, as those tables set it).

Each as a ratio to plain DiLoCo's time and to the fastest DiLoCo-family member's (plain, streaming, hierarchical,
SparseLoCo) on that scenario's clock. One seed (the tuning seed), each method at its recorded grid point of that H:
a probe of the horizon's effect, not a tuned result.

Usage::

    python benchmarks/multicloud_horizon.py --out docs/multicloud/regions --workers 64 --short-steps 90
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from multicloud import CLOCK_ONLY, DILOCO_FAMILY, Scenario, SharedRuns, loss_at
from sim_runs import time_to_reach


class RecordedRuns(SharedRuns):
    """The runs recorded in ``folder``, read back by the names and overrides ``multicloud.py`` gave them; a run that is
    not there raises ``KeyError`` (nothing is run)."""

    def _run_sim(self, overrides: list[str], name: str) -> dict:
        run = self.recorded(overrides, name)
        if run is None:
            raise KeyError(name)
        return run


def _cut(trace: list, steps: int) -> list:
    return [point for point in trace if point[0] <= steps]


def horizon(out: Path, workers: int, short_steps: int, inner_steps: int = 10) -> dict[str, dict[str, dict]]:
    """``{scenario: {method: {"label", "whole": ratio, "short": ratio, "whole_family", "short_family"}}}`` from the
    record ``<out>/multicloud_n<workers>.json`` and its runs (module docstring); a ratio is None where the target was
    never reached. Methods without a recorded run at H = ``inner_steps`` on the tuning seed are left out."""
    record = json.loads((out / f"multicloud_n{workers}.json").read_text())
    names = list(record["scenarios"])
    runs = RecordedRuns(tuple(name for name in names if name in CLOCK_ONLY), out / "runs" / f"n{workers}")
    table: dict[str, dict[str, dict]] = {}
    for name, scenario in record["scenarios"].items():
        if inner_steps not in scenario.get("inner_steps_grid", []):
            raise ValueError(f"{name}: the record's H grid {scenario.get('inner_steps_grid')} has no H = {inner_steps}")
        methods = tuple(method for method in scenario["tuning"] if method != "gasloc_best")
        setup = Scenario(name, workers, scenario["target_step"], scenario["inner_steps"], runs, methods,
                         tuple(scenario["inner_steps_grid"]), batch_size=scenario.get("batch_size"))
        if short_steps > setup.steps:
            raise ValueError(f"--short-steps {short_steps} is beyond the runs' {setup.steps} steps")
        traces = {}
        for method in methods:
            chosen = scenario["tuning"][method]
            rest = [part for part in chosen.get("label", "").split(",") if not part.startswith("H=")]
            label = ",".join([f"H={inner_steps}", *rest])
            grid = setup.grid(method)
            if label not in grid:
                continue
            try:
                traces[method] = (label, setup.run(method, grid[label], scenario["tuning_seed"], label)["trace"])
            except KeyError:  # not recorded (a cut grid, or a run that failed): left out
                continue
        if "diloco" not in traces:
            continue
        diloco = traces["diloco"][1]
        targets = {"whole": loss_at(diloco, scenario["target_step"]), "short": loss_at(diloco, 2 * short_steps // 3)}
        rows: dict[str, dict] = {}
        for method, (label, trace) in traces.items():
            row: dict = {"label": label}
            for horizon_name, (loss, reference) in targets.items():
                seen = trace if horizon_name == "whole" else _cut(trace, short_steps)
                reached = time_to_reach(seen, loss)
                row[horizon_name] = None if reached is None else reached / reference
                row[f"{horizon_name}_time"] = reached
            rows[method] = row
        for horizon_name in targets:
            family = [rows[m][f"{horizon_name}_time"] for m in DILOCO_FAMILY if m in rows
                      and rows[m][f"{horizon_name}_time"] is not None]
            best = min(family, default=None)
            for row in rows.values():
                own = row.pop(f"{horizon_name}_time")
                row[f"{horizon_name}_family"] = None if own is None or best is None else own / best
        table[name] = rows
    return table


def _cell(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


def markdown(table: dict[str, dict[str, dict]], short_steps: int, whole_steps: int) -> str:
    lines = []
    for name, rows in table.items():
        lines += [f"### {name}: {short_steps} steps against {whole_steps}", "",
                  f"| method | grid point | / DiLoCo, {short_steps} steps | / DiLoCo, {whole_steps} steps "
                  f"| / best family, {short_steps} | / best family, {whole_steps} |", "|---|---|---|---|---|---|"]
        for method, row in rows.items():
            lines.append(f"| {method} | {row['label']} | {_cell(row['short'])} | {_cell(row['whole'])} | "
                         f"{_cell(row['short_family'])} | {_cell(row['whole_family'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="multicloud.py's --out (its record and runs)")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--short-steps", type=int, default=90)
    parser.add_argument("--inner-steps", type=int, default=10, help="the H whose runs are compared")
    args = parser.parse_args(argv)
    if args.short_steps < 2 * args.inner_steps:
        parser.error("--short-steps must cover at least two rounds of --inner-steps")
    table = horizon(args.out, args.workers, args.short_steps, args.inner_steps)
    record = json.loads((args.out / f"multicloud_n{args.workers}.json").read_text())
    whole = next(iter(record["scenarios"].values()))["steps"]
    print(markdown(table, args.short_steps, whole))


if __name__ == "__main__":
    main()
