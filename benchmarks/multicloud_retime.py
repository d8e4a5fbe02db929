"""The tuning-seed choices of the clock-only scenarios under the issue-35 clock rules, from the record, without
rerunning what those rules cannot change (for ``multicloud.py --given``).

On the tuning seed (0) of two_clusters, cloud_mix, many_sites and jitter, the new rules change a run's clock
in two ways only:

- every validation is stamped when the consensus all-reduce over all n workers ends: its time, a constant c
  of the scenario (nothing is waited on, no worker is away), is added to every stamp of every method;
- Streaming DiLoCo's quantized mean is now posted and waited on where its fragment lands: its clock changes.

Jitter's noise on seed 0 is the draw the record used (its seed was pinned to 0), and the training (the losses)
does not depend on the clock. So for plain DiLoCo and every GASLoC form, each time to the target on seed 0 is
the recorded one plus c, and their order (hence each form's chosen point and GASLoC's best form) is the
recorded order: those are given here, with the reason, and not rerun. Streaming DiLoCo is retuned by runs
(its codec too). Plain DiLoCo's choice is by its loss at the target step, which no clock changes.

Usage::

    python benchmarks/multicloud_retime.py --workers 64 --record docs/multicloud/before_issue35/multicloud_n64.json \\
        --out docs/multicloud/given_n64.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir

from gasloc_lightning.app import sim as _sim_app  # noqa: F401  (registers the sim app's schema)
from gasloc_lightning.app.config import config_dir

CLOCK_ONLY = ("two_clusters", "cloud_mix", "many_sites", "jitter")
GIVEN_FORMS = ("gasloc_one_peer", "gasloc_compressed", "gasloc_streamed")


def consensus_time(scenario: str, workers: int) -> float:
    """c: the full-model float32 all-reduce over all ``workers`` on the scenario's network."""
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=["experiment=demo", f"sim.workers={workers}", f"network={scenario}"])
    network = hydra.utils.instantiate(cfg.network, _convert_="all")
    return network.all_reduce_time(network.message_bytes())


def retimed(scenario: dict, shift: float, reason: str) -> dict[str, dict]:
    """The given choices of one scenario's record: plain DiLoCo (its seed-0 target, time + ``shift``) and the
    GASLoC forms (every seed-0 time to the target + ``shift``, ratios to the shifted target)."""
    diloco = scenario["tuning"]["diloco"]
    target_loss = diloco["losses"][diloco["label"]]
    # plain DiLoCo's clock does not depend on the training seed, nor (pinned noise) did jitter's draw: any seed's
    target_time = next(iter(scenario["results"]["diloco"]["seeds"].values()))["diloco_time"] + shift
    given = {"diloco": {"label": diloco["label"], "overrides": diloco["overrides"], "losses": diloco["losses"],
                        "target": [target_loss, target_time], "given": reason}}
    for form in GIVEN_FORMS:
        entry = scenario["tuning"][form]
        scores = {}
        for label, score in entry["scores"].items():
            reached = None if score["time_to_target"] is None else score["time_to_target"] + shift
            scores[label] = {**score, "time_to_target": reached, "ratio": None if reached is None else reached / target_time}
        given[form] = {"label": entry["label"], "overrides": entry["overrides"], "scores": scores, "given": reason}
    return given


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--record", type=Path, required=True, help="the record made under the previous rules")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    scenarios = json.loads(args.record.read_text())["scenarios"]
    given = {}
    for name in CLOCK_ONLY:
        shift = consensus_time(name, args.workers)
        reason = (f"from {args.record.name}, every seed-0 time + {shift:.3f} s (the consensus all-reduce): the new "
                  "rules move no other part of this method's clock on seed 0")
        given[name] = retimed(scenarios[name], shift, reason)
        print(f"{name}: c = {shift:.3f} s")
    args.out.write_text(json.dumps(given, indent=2) + "\n")


if __name__ == "__main__":
    main()
