"""Top-k 1% messages with error feedback against float32 messages, in training (issue 31's target: within 1%
of float32's loss at equal steps, n = 8, 3 seeds, at <= 0.05x the bytes).

Each pair of ``gasloc-sim`` runs (``experiment=demo``: tiny GPT on the stdlib corpus, 100 steps, H = 5, 20
rounds) differs only in its messages:

- ``diloco``: ``strategy=diloco`` (float32 all-reduce, outer lr 1.0, Nesterov 0.3) against
  ``strategy=sparseloco`` (top-k 1% at int2 with error feedback, beta 0.95, outer SGD lr 1.0 without momentum:
  SparseLoCo's rule, an all-gather of the sparse wires);
- ``gossip``: ``strategy=gasloc topology=ring`` (float32 exact mixing) against the same with
  ``message_codec=topk-0.01-int4 error_feedback=true`` (per-edge copies, the default damped consensus step 0.05).

Prints, per family and seed, both final consensus validation losses, the relative gap
``(topk - float32) / float32`` and the bytes ratio (every worker's bytes sent, summed), then the means.

    nice -n 10 python benchmarks/topk_probe.py            # 12 runs; about 45 min on a loaded 2-core box
    python benchmarks/topk_probe.py --families diloco --seeds 0 --sparseloco-outer-lr 2.0
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from sim_runs import run_sim

FAMILIES = {
    "diloco": (["strategy=diloco"], ["strategy=sparseloco"]),
    "gossip": (["strategy=gasloc", "topology=ring"],
               ["strategy=gasloc", "topology=ring", "strategy.message_codec=topk-0.01-int4",
                "strategy.error_feedback=true"]),
}
TARGET_GAP, TARGET_BYTES = 0.01, 0.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sparseloco-outer-lr", type=float, default=None,
                        help="eta of strategy=sparseloco (default: the config's)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    common = [f"sim.workers={args.workers}", f"trainer.devices={args.workers}", "sim.threads=1",
              "trainer.val_check_interval=50"]
    families = dict(FAMILIES)
    if args.sparseloco_outer_lr is not None:
        dense, sparse = families["diloco"]
        families["diloco"] = (dense, [*sparse, f"strategy.outer_lr={args.sparseloco_outer_lr}"])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            for seed in args.seeds:
                runs = [run_sim([*overrides, *common, f"seed={seed}"], Path(scratch) / f"{family}-{seed}-{kind}")
                        for kind, overrides in zip(("float32", "topk"), families[family])]
                dense, sparse = runs
                rows.append({"family": family, "seed": seed, "float32": dense["val_loss"], "topk": sparse["val_loss"],
                             "gap": (sparse["val_loss"] - dense["val_loss"]) / dense["val_loss"],
                             "bytes_ratio": sparse["bytes_sent"] / dense["bytes_sent"]})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\nn = {args.workers}, experiment=demo (100 steps, H = 5); target: gap <= {TARGET_GAP:.0%} at bytes "
          f"<= {TARGET_BYTES}x")
    print("| family | seed | float32 loss | top-k 1% + EF loss | gap | bytes ratio |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['family']} | {row['seed']} | {row['float32']:.4f} | {row['topk']:.4f} | {row['gap']:+.2%} | "
              f"{row['bytes_ratio']:.4f} |")
    for family in args.families:
        mine = [row for row in rows if row["family"] == family]
        gap = statistics.mean(row["gap"] for row in mine)
        ratio = statistics.mean(row["bytes_ratio"] for row in mine)
        met = gap <= TARGET_GAP and ratio <= TARGET_BYTES and all(row["gap"] <= TARGET_GAP for row in mine)
        print(f"{family}: mean gap {gap:+.2%}, mean bytes ratio {ratio:.4f}: {'met' if met else 'MISSED'}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
