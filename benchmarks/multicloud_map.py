"""Issue 31's map: where each method wins, as the cross-region bandwidth goes from compute-bound to communication-bound.

Reads a record of ``benchmarks/multicloud.py`` (it runs nothing) whose scenarios include the bandwidth sweep
(``two_clusters_10g two_clusters two_clusters_100m`` and ``many_sites_fast many_sites many_sites_slow``) and gives,
in every cell (a site layout at a cross-region bandwidth), each method's time to plain DiLoCo's loss over the fastest
DiLoCo-family method's (plain, streaming, hierarchical, SparseLoCo) on each held-out seed, and its final loss over
the best family member's at equal steps (equal tokens). Markdown tables on stdout, a figure in
``<out>/multicloud_map.png``.

Usage::

    python benchmarks/multicloud_map.py --out docs/multicloud/regions --workers 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from multicloud import DILOCO_FAMILY

# layout -> its cells, fastest cross-region links first: (scenario, what its links between sites are)
MAP_CELLS = {
    "two_clusters": (("two_clusters_10g", "10 Gbit/s"), ("two_clusters", "1 Gbit/s"),
                     ("two_clusters_100m", "100 Mbit/s")),
    "many_sites": (("many_sites_fast", "uplinks 100-10 Gbit/s"), ("many_sites", "10-1 Gbit/s"),
                   ("many_sites_slow", "1-0.1 Gbit/s")),
}


def cells(record: dict) -> list[tuple[str, str, str]]:
    """(layout, scenario, link label) of every map cell the record has, in map order."""
    return [(layout, scenario, label) for layout, row in MAP_CELLS.items() for scenario, label in row
            if scenario in record["scenarios"]]


def map_table(record: dict) -> dict[str, dict[str, dict]]:
    """``{scenario: {method: {"family_ratios": [per seed], "family_ratio_mean", "loss_ratio"}}}``: the time ratio to the
    fastest family member per held-out seed (None: never reached) and the mean final loss over the best family
    member's mean final loss."""
    table: dict[str, dict[str, dict]] = {}
    for _, scenario, _ in cells(record):
        results = record["scenarios"][scenario]["results"]
        family_losses = [results[m]["val_loss_mean"] for m in DILOCO_FAMILY if m in results]
        best_loss = min(family_losses) if family_losses else None
        table[scenario] = {method: {"family_ratios": result.get("family_ratios", []),
                                    "family_ratio_mean": result.get("family_ratio_mean"),
                                    "loss_ratio": None if best_loss is None else result["val_loss_mean"] / best_loss}
                           for method, result in results.items()}
    return table


def _cell(values: list[float | None], mean: float | None) -> str:
    seeds = " / ".join("never" if v is None else f"{v:.2f}" for v in values)
    return f"**{'never' if mean is None else f'{mean:.2f}'}** ({seeds})" if values else ""


def markdown(record: dict) -> str:
    table, where = map_table(record), cells(record)
    methods = list(dict.fromkeys(method for rows in table.values() for method in rows))
    header = "| method | " + " | ".join(f"{layout} {label}" for layout, _, label in where) + " |"
    rule = "|---|" + "---|" * len(where)
    any_scenario = record["scenarios"][where[0][1]] if where else {}
    seeds = ", ".join(map(str, any_scenario.get("held_out_seeds", [])))
    lines = [f"Time to plain DiLoCo's loss over the fastest DiLoCo-family method's, n = {record['workers']}: the mean "
             f"of the held-out seeds (each seed: {seeds}); < 1: faster than every family member.", "",
             header, rule]
    for method in methods:
        lines.append(f"| {method} | " + " | ".join(
            _cell(table[s].get(method, {}).get("family_ratios", []), table[s].get(method, {}).get("family_ratio_mean"))
            for _, s, _ in where) + " |")
    lines += ["", "Final validation loss at equal steps (equal tokens) over the best DiLoCo-family method's (mean of "
              "the held-out seeds):", "", header, rule]
    for method in methods:
        lines.append(f"| {method} | " + " | ".join(
            "" if table[s].get(method, {}).get("loss_ratio") is None else f"{table[s][method]['loss_ratio']:.4f}"
            for _, s, _ in where) + " |")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """One panel per site layout: x the cross-region links (fast to slow), y each method's ratio to the fastest family
    member (each held-out seed a marker, the mean a line; never reached: drawn above every ratio, as an x)."""
    from matplotlib.figure import Figure

    table, where = map_table(record), cells(record)
    layouts = list(dict.fromkeys(layout for layout, _, _ in where))
    measured = [r for rows in table.values() for row in rows.values() for r in row["family_ratios"] if r is not None]
    never_at = 1.3 * max(measured, default=2.0)
    figure = Figure(figsize=(5.5 * max(len(layouts), 1), 4.2))
    for axes, layout in zip(figure.subplots(1, len(layouts), squeeze=False)[0], layouts):
        row = [(scenario, label) for lay, scenario, label in where if lay == layout]
        methods = list(dict.fromkeys(m for scenario, _ in row for m in table[scenario]))
        for method in methods:
            means = [table[s].get(method, {}).get("family_ratio_mean") for s, _ in row]
            line = axes.plot([x for x, m in enumerate(means) if m is not None], [m for m in means if m is not None],
                             "-", label=method)[0]
            for x, (scenario, _) in enumerate(row):
                for ratio in table[scenario].get(method, {}).get("family_ratios", []):
                    axes.plot(x, never_at if ratio is None else ratio, "x" if ratio is None else "o",
                              color=line.get_color(), alpha=0.7)
        axes.axhline(1.0, color="grey", lw=0.8)
        axes.set_xticks(range(len(row)), [label for _, label in row], fontsize=8)
        axes.set(title=f"{layout}, n = {record['workers']}", yscale="log",
                 ylabel="time to DiLoCo's loss / fastest DiLoCo-family (x: never)")
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="multicloud.py's --out (its record)")
    parser.add_argument("--workers", type=int, required=True)
    args = parser.parse_args(argv)
    record = json.loads((args.out / f"multicloud_n{args.workers}.json").read_text())
    if not cells(record):
        parser.error(f"the record at n = {args.workers} has none of the map's scenarios "
                     f"({[s for row in MAP_CELLS.values() for s, _ in row]})")
    print(markdown(record))
    plot(record, args.out / "multicloud_map.png")
    print(f"\nfigure: {args.out / 'multicloud_map.png'}")


if __name__ == "__main__":
    main()
