"""Is the (eta, gamma) grid of ``benchmarks/multicloud.py`` wide enough? Runs extra grid points on the tuning
seed at one size and says, per scenario and method, whether any would have beaten the recorded choice.

The recorded choices (``docs/multicloud/multicloud_n<W>.json``) sit at eta = 0.7, gamma = 0.5: the smallest
effective outer step, eta / (1 - gamma), of both grids. The extra points go below it. Plain DiLoCo's chosen
point is rerun on the tuning seed to give the target (and to check the record reproduces); nothing in the
record is changed. Output: ``grid_probe_n<W>.json`` next to the record.

    python benchmarks/multicloud_grid_probe.py --workers 64 --out docs/multicloud
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import multicloud as mc

EXTRA = mc._outer_grid(((0.5, 0.5), (0.7, 0.3)))  # effective outer steps 1.0 (the grids' smallest: 1.4)
PROBED = ("diloco", "streaming_diloco", "gasloc_one_peer", "gasloc_bw_spread", "gasloc_streamed")


def _key(score: dict) -> tuple[float, float]:
    return (score["time_to_target"] or math.inf, score["val_loss"])


def probe(workers: int, out: Path, scenarios: tuple[str, ...]) -> dict:
    record = json.loads((out / f"multicloud_n{workers}.json").read_text())["scenarios"]
    result: dict = {"workers": workers, "extra_points": list(EXTRA), "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        clock_only = tuple(s for s in mc.CLOCK_ONLY if s in scenarios)
        shared = mc.SharedRuns(clock_only, Path(tmp))
        for name in scenarios:
            rec = record[name]
            runs = shared if name in clock_only else mc.SharedRuns((name,), Path(tmp))
            scenario = mc.Scenario(name, workers, rec["target_step"], rec["inner_steps"], runs)
            seed = rec["tuning_seed"]
            chosen_label = rec["tuning"]["diloco"]["label"]
            reference = scenario.run("diloco", tuple(rec["tuning"]["diloco"]["overrides"]), seed, chosen_label)
            target = scenario.target(reference)
            diloco = {label: scenario.target(scenario.run("diloco", extra, seed, label))[0]
                      for label, extra in EXTRA.items()}
            rows = {"diloco": {"chosen": chosen_label, "recorded_loss": rec["tuning"]["diloco"]["losses"][chosen_label],
                               "rerun_loss": target[0], "extra_losses": diloco,
                               "beaten_by": [l for l, v in diloco.items() if v < target[0]]}}
            print(name, "diloco", rows["diloco"], flush=True)
            for method in PROBED[1:]:
                tuning = rec["tuning"].get(method)
                if tuning is None or "error" in tuning:
                    continue
                best = tuning["scores"][tuning["label"]]
                scores = {label: scenario.score(scenario.run(method, extra, seed, label), target)
                          for label, extra in EXTRA.items()}
                rows[method] = {"chosen": tuning["label"], "chosen_score": best, "extra_scores": scores,
                                "beaten_by": [l for l, s in scores.items() if _key(s) < _key(best)]}
                print(name, method, "chosen", tuning["label"], _key(best), {l: _key(s) for l, s in scores.items()},
                      flush=True)
            result["scenarios"][name] = rows
            (out / f"grid_probe_n{workers}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--scenarios", nargs="+", default=list(mc.SCENARIOS), choices=mc.SCENARIOS)
    parser.add_argument("--out", type=Path, default=Path("docs/multicloud"))
    args = parser.parse_args(argv)
    probe(args.workers, args.out, tuple(args.scenarios))


if __name__ == "__main__":
    main()
