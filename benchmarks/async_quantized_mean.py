"""An exchange overlapped with compute on a real shaped link, against the same exchange waited on: seconds per round.

``python benchmarks/async_quantized_mean.py --seeds 0 --out DIR`` (as root: it builds a network lab) runs, per
seed and alternated, ``gasloc-netlab netlab.mode=train`` on ``two_clusters`` in two forms of ``--method``:

- ``diloco`` (default): one rank per site (2 ranks, one shaped link between them) and ``strategy=diloco
  strategy.fragments=4 strategy.message_codec=int4``;

  - ``overlap``: ``strategy.overlap=true``: each fragment's quantized mean is posted where it leaves and waited
    on one inner step later, where it lands (``comm/encoded_mean.py``);
  - ``blocking``: ``strategy.overlap=false``: the same mean waited on where it leaves (fragment_sync_delay 0),
    which is what ``overlap=true`` did before the mean was asynchronous;

- ``two_level``: two ranks per site (the sites are the regions) and ``strategy=two_level topology=two_level
  topology.cross_every=2``;

  - ``overlap``: ``topology.cross_overlap=true``: the delayed crossing, posted at one crossing and landed at the
    next (``comm/two_level.py``);
  - ``blocking``: ``topology.cross_overlap=false``: each crossing waited on where it happens.

A form's time per round is its fit's ``wall_time_s`` (``summary.json``: fit start to end on rank 0; process
start-up left out) over its rounds. H must leave room for the overlap (H >= 2 F, default H = 8). Prints one
JSON line per run and the ratio overlap / blocking per seed, and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gasloc_lightning.strategies.launcher import terminate

COMMON = ["experiment=demo", "network=two_clusters", "netlab.mode=train", "trainer.enable_progress_bar=false",
          "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "strategy.consensus_every=0"]
METHODS = {  # method: (its overrides, {form: the form's overrides})
    "diloco": ([*COMMON, "trainer.devices=2", "strategy=diloco", "strategy.fragments=4", "strategy.message_codec=int4"],
               {"overlap": ["strategy.overlap=true"], "blocking": ["strategy.overlap=false"]}),
    "two_level": ([*COMMON, "network.sizes=[2,2]", "trainer.devices=4", "strategy=two_level", "topology=two_level",
                   "topology.cross_every=2"],
                  {"overlap": ["topology.cross_overlap=true"], "blocking": ["topology.cross_overlap=false"]}),
}
FORMS = ("overlap", "blocking")
RUN_TIMEOUT_S = 900
CHILD_GRACE_S = 120.0


def run_form(form: str, seed: int, *, steps: int, inner_steps: int, scale: float, out: Path,
             method: str = "diloco") -> dict[str, Any]:
    """One ``gasloc-netlab`` run of ``method`` in ``form``; its seconds per round (from its ``summary.json``)."""
    folder = out / f"seed{seed}" / form
    folder.mkdir(parents=True, exist_ok=True)
    base, forms = METHODS[method]
    command = [sys.executable, "-m", "gasloc_lightning.app.netlab", *base, *forms[form], f"seed={seed}",
               f"inner_steps={inner_steps}", f"trainer.max_steps={steps}", f"netlab.bandwidth_scale={scale}",
               f"output_dir={folder}", f"hydra.run.dir={folder}", f"netlab.timeout_s={RUN_TIMEOUT_S}"]
    with open(folder / "netlab.log", "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            code = process.wait()
        except BaseException:  # Ctrl-C or SIGTERM here: the run stops its ranks and removes its lab first
            terminate([process], grace_s=CHILD_GRACE_S)
            raise
    if code != 0:
        raise RuntimeError(f"{form} seed {seed} failed ({code}); see {folder}/netlab.log")
    summary = json.loads((folder / "summary.json").read_text())
    rounds = summary["budget"]["rounds"]
    return {"seed": seed, "method": method, "form": form, "wall_time_s": summary["wall_time_s"], "rounds": rounds,
            "s_per_round": summary["wall_time_s"] / rounds, "bytes_sent": summary["bytes_sent"],
            "final_train_loss": _last_train_loss(folder / summary["metrics_csv"])}


def _last_train_loss(metrics_csv: Path) -> float | None:
    with open(metrics_csv) as handle:
        losses = [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    return losses[-1] if losses else None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=80, help="trainer.max_steps of every run")
    parser.add_argument("--inner-steps", type=int, default=8, help="H (diloco: >= 2 x 4 fragments, so tau is 1)")
    parser.add_argument("--scale", type=float, default=0.00025,
                        help="netlab.bandwidth_scale (two_clusters' 1 Gbit/s x 0.00025: 0.25 Mbit/s)")
    parser.add_argument("--method", choices=list(METHODS), default="diloco")
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    results = []
    for seed in args.seeds:
        order = args.forms if seed % 2 == 0 else args.forms[::-1]  # alternated
        runs = {form: run_form(form, seed, steps=args.steps, inner_steps=args.inner_steps, scale=args.scale,
                               out=args.out, method=args.method) for form in order}
        for form in args.forms:
            results.append(runs[form])
            print(json.dumps(runs[form]), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if len(runs) < 2:
            continue
        ratio = runs["overlap"]["s_per_round"] / runs["blocking"]["s_per_round"]
        results.append({"seed": seed, "ratio_overlap_over_blocking": ratio})
        print(f"seed {seed}: overlap {runs['overlap']['s_per_round']:.2f} s/round, blocking "
              f"{runs['blocking']['s_per_round']:.2f} s/round, ratio {ratio:.2f}x", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    ratios = [r["ratio_overlap_over_blocking"] for r in results if "ratio_overlap_over_blocking" in r]
    if ratios:
        print(f"median ratio overlap / blocking over {len(ratios)} seed(s): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
