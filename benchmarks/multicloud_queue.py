"""Run a list of ``multicloud.py`` configurations into its run record (``<out>/runs/n<workers>/``), in order, one
at a time: each run lands there as it ends, under the name and overrides ``multicloud.py`` gives it, so
``multicloud.py`` reads it back instead of running it. Used to put the runs that matter first when the time is
short (issue 35's reruns).

Usage::

    python benchmarks/multicloud_queue.py --workers 64 --out docs/multicloud \\
        preemption:diloco:eta=1.0,gamma=0.3:1 preemption:streaming_diloco:int4,eta=0.7,gamma=0.5:1 ...
    (scenario "clock": the clock-only scenarios run together, jitter first, as multicloud.py runs them)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multicloud as mc  # noqa: E402

TOGETHER = ("jitter", "two_clusters", "cloud_mix", "many_sites")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("docs/multicloud"))
    parser.add_argument("runs", nargs="+", help="scenario:method:label:seed (label 'chosen' names a held-out run "
                                                "whose grid point is the label after a '='-less prefix; see below)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.runs:
            scenario_name, method, label, seed = item.split(":")
            together = TOGETHER if scenario_name == "clock" else ()
            name = TOGETHER[0] if scenario_name == "clock" else scenario_name
            runs = mc.SharedRuns(together, args.out / "runs" / f"n{args.workers}", Path(tmp))
            scenario = mc.Scenario(name, args.workers, args.steps, args.inner_steps, runs, tuple(mc.METHODS))
            grid_label, _, as_label = label.partition("@")  # "int4,eta=0.7,gamma=0.5@chosen": held-out naming
            extra = mc.METHODS[method].grid[grid_label] if mc.METHODS[method].grid else ()
            print(f"{item}", flush=True)
            scenario.run(method, tuple(extra), int(seed), as_label or grid_label)


if __name__ == "__main__":
    main()
