"""A smoke probe of the two-level round in gasloc-sim: does it train? Not a comparison of methods.

Runs DiLoCo, two-level GASLoC and hierarchical DiLoCo on the demo (tiny GPT, stdlib corpus) with n workers on
network=two_clusters, a few seeds, and prints each run's final consensus loss, simulated time and bytes per
worker at each level. Short runs on one budget say nothing about which method wins (issue 31's protocol does).

    python benchmarks/two_level_probe.py --workers 16 --steps 100 --seeds 0 1 --out /tmp/two_level_probe

``--map NETWORK [NETWORK ...]`` (e.g. ``two_clusters_10g two_clusters two_clusters_100m``, the cross-region
bandwidth sweep) instead validates every round and times each run on every one of those networks at once
(``sim.also_networks``: the clusters, hence the regions and the training, are the first one's): it prints each
method's time to plain DiLoCo's loss at 2/3 of the steps, as a ratio to the fastest DiLoCo-family method there
(plain, Streaming, hierarchical). A first look at the map of issue 31, not its protocol (no tuning, one budget).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from sim_runs import run_sim, time_to_reach

from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir

METHODS = {
    "diloco": ["strategy=diloco", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9"],
    # gamma_g = 0.5 (HALoS's), as measured in docs/algorithm.md 8a; the config's default is 0 since.
    "two_level": ["strategy=gasloc", "topology=two_level", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9",
                  "topology.cross_momentum=0.5"],
    "hierarchical": ["strategy=gasloc", "topology=hierarchical", "strategy.outer_lr=0.7",
                     "strategy.outer_momentum=0.9"],
    # Streaming DiLoCo as docs/multicloud.md runs it (4 fragments, overlap, int4 pseudo-gradients)
    "streaming_diloco": ["strategy=diloco", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9",
                         "strategy.fragments=4", "strategy.overlap=true", "strategy.message_codec=int4"],
    # the delayed crossing (beta 0.5, gamma_g 0: the stable defaults), int4 shards across
    "two_level_delayed": ["strategy=gasloc", "topology=two_level", "strategy.outer_lr=0.7",
                          "strategy.outer_momentum=0.9", "topology.cross_overlap=true", "topology.cross_codec=int4"],
    "hierarchical_delayed": ["strategy=gasloc", "topology=hierarchical", "strategy.outer_lr=0.7",
                             "strategy.outer_momentum=0.9", "topology.cross_overlap=true"],
    # the same in float32 across (the codec's share of the difference)
    "two_level_delayed_f32": ["strategy=gasloc", "topology=two_level", "strategy.outer_lr=0.7",
                              "strategy.outer_momentum=0.9", "topology.cross_overlap=true"],
    # hierarchical DiLoCo with torchft's quantized all-reduce across (int4 changes since the last mean, shard by
    # shard): the baseline with a lossy crossing, as two_level_delayed has one (waited on: not delayed)
    "hierarchical_int4": ["strategy=gasloc", "topology=hierarchical", "strategy.outer_lr=0.7",
                          "strategy.outer_momentum=0.9", "topology.cross_codec=int4"],
    # and delayed (beta 0.5): DiLoCoX's delayed compressed outer step across (gasloc-sim only)
    "hierarchical_delayed_int4": ["strategy=gasloc", "topology=hierarchical", "strategy.outer_lr=0.7",
                                  "strategy.outer_momentum=0.9", "topology.cross_codec=int4",
                                  "topology.cross_overlap=true"],
}
TWO_LEVEL = ("two_level", "hierarchical", "two_level_delayed", "hierarchical_delayed", "two_level_delayed_f32",
             "hierarchical_int4", "hierarchical_delayed_int4")


def run(method: str, seed: int, args: argparse.Namespace) -> dict:
    out = args.out / f"{method}_seed{seed}"
    overrides = ["experiment=demo", "network=two_clusters", f"sim.workers={args.workers}", f"seed={seed}",
                 f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
                 f"inner_steps={args.inner_steps}", "sim.progress_every=0", f"sim.threads={args.threads}",
                 f"output_dir={out}", *METHODS[method]]
    if method in TWO_LEVEL:
        overrides.append(f"topology.cross_every={args.cross_every}")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=overrides)
    loss = sim_app.simulate(cfg)
    record = json.loads((out / "summary.json").read_text())
    with (out / record["metrics_csv"]).open() as file:
        rows = list(csv.DictReader(file))
    last = [r for r in rows if r.get("comm/bytes_sent")][-1]
    return {"method": method, "seed": seed, "val_loss": loss, "sim_time_s": record["sim"]["sim_time_max"],
            "bytes_region": float(last.get("comm/bytes_region") or 0.0),
            "bytes_cross": float(last.get("comm/bytes_cross") or 0.0), "bytes_sent": float(last["comm/bytes_sent"])}


DILOCO_FAMILY = ("diloco", "streaming_diloco", "hierarchical", "hierarchical_delayed", "hierarchical_int4",
                 "hierarchical_delayed_int4")


def run_map(method: str, seed: int, args: argparse.Namespace) -> dict:
    """One run validated every round, timed on every network of ``--map``: ``{network: trace}`` and its final loss."""
    first, *others = args.map
    overrides = [f"network={first}", f"sim.workers={args.workers}", f"seed={seed}", f"trainer.max_steps={args.steps}",
                 f"trainer.val_check_interval={args.inner_steps}", f"inner_steps={args.inner_steps}",
                 f"sim.threads={args.threads}", *METHODS[method]]
    if others:
        overrides.append(f"sim.also_networks=[{','.join(others)}]")
    if method in TWO_LEVEL:
        overrides.append(f"topology.cross_every={args.cross_every}")
    run = run_sim(overrides, args.out / f"map_{method}_seed{seed}")
    return {"val_loss": run["val_loss"], "traces": {first: run["trace"], **run["also_traces"]}}


def print_map(runs: dict[str, dict], networks: list[str], steps: int) -> None:
    """Each method's time to plain DiLoCo's loss at 2/3 of the steps, over the fastest DiLoCo-family method's."""
    diloco = runs["diloco"]["traces"][networks[0]]
    target = max((p for p in diloco if p[0] <= 2 * steps // 3), key=lambda p: p[0])[1]
    print(f"target: plain DiLoCo's loss at step {2 * steps // 3}: {target:.4f}")
    print("method                final_loss  " + "  ".join(f"{n:>18}" for n in networks))
    times = {m: {n: time_to_reach(r["traces"][n], target) for n in networks} for m, r in runs.items()}
    best = {n: min((times[m][n] for m in times if m in DILOCO_FAMILY and times[m][n] is not None), default=None)
            for n in networks}
    for method, run in runs.items():
        cells = ["never" if times[method][n] is None else f"{times[method][n]:.0f}s {times[method][n] / best[n]:.2f}x"
                 for n in networks]
        print(f"{method:<21} {run['val_loss']:>10.4f}  " + "  ".join(f"{c:>18}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--cross-every", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["diloco", "two_level", "hierarchical"],
                        choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/two_level_probe"))
    parser.add_argument("--map", nargs="+", default=None, metavar="NETWORK",
                        help="validate every round and time each run on these network presets (see above)")
    args = parser.parse_args()
    if args.map:
        if "diloco" not in args.methods:
            parser.error("--map needs diloco among --methods: the target is its loss")
        for seed in args.seeds:
            print_map({method: run_map(method, seed, args) for method in args.methods}, args.map, args.steps)
        return
    print("method                seed  val_loss  sim_time_s  MB_region  MB_cross  (per worker, modelled 1B fp32 clock;"
          " bytes of the demo's tiny model)")
    for seed in args.seeds:
        for method in args.methods:
            r = run(method, seed, args)
            print(f"{r['method']:<21} {seed:>4}  {r['val_loss']:.4f}  {r['sim_time_s']:>10.1f}  "
                  f"{r['bytes_region'] / 1e6:>9.2f}  {r['bytes_cross'] / 1e6:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
