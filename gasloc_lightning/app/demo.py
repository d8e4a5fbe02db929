"""``gasloc-demo`` (``make demo``): gasloc, diloco and ddp side by side on a CPU, then the comparison.

It runs ``gasloc-train -m experiment=demo strategy=gasloc,diloco,ddp`` as a subprocess (4
spawned CPU workers per strategy, the tiny GPT on the embedded stdlib corpus; the token
arithmetic is in ``conf/experiment/demo.yaml``), then ``gasloc-compare`` on the sweep folder,
and closes with the acceptance check: every strategy's final validation loss must be below the
byte-unigram entropy of the validation split.

Extra arguments are Hydra overrides passed to the sweep, e.g. ``gasloc-demo trainer.max_steps=200``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from gasloc_lightning.app.compare import Comparison, compare

DEFAULT_STRATEGIES = "gasloc,diloco,ddp"


def sweep_command(out_dir: Path, strategies: str, overrides: Sequence[str]) -> list[str]:
    """The ``gasloc-train -m`` command line of the demo sweep."""
    return [
        sys.executable, "-m", "gasloc_lightning.train", "-m", "experiment=demo", f"strategy={strategies}",
        f"hydra.sweep.dir={out_dir}", *overrides,
    ]


def acceptance(result: Comparison) -> list[str]:
    """One line per run: its final validation loss against the unigram entropy, PASS or FAIL."""
    lines = []
    for run in result.runs:
        loss, entropy = run["final"]["val_loss"], run["unigram_entropy_val"]
        passed = loss is not None and entropy is not None and loss < entropy
        shown = "n/a" if loss is None else f"{loss:.4f}"
        lines.append(f"  {'PASS' if passed else 'FAIL'}  {run['strategy']['name']:<8} final val loss {shown} "
                     f"{'<' if passed else '>='} unigram entropy {entropy:.4f} nats/byte")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gasloc-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="sweep folder (default: outputs/demo/<date_time>)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help=f"comma-separated (default {DEFAULT_STRATEGIES})")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    return parser


def _report(result: Comparison, out_dir: Path, seconds: float) -> bool:
    """Print the table, where everything is, and the closing summary; returns whether every run passed."""
    print("\n" + result.table + "\n")
    print(f"table: {result.table_path}")
    for path in result.plots:
        print(f"plot:  {path}")
    jobs = ", ".join(f"{Path(run['run_dir']).name} ({run['strategy']['name']})" for run in result.runs)
    print(f"logs:  {out_dir}/<job>/ for jobs {jobs}: train.log, {result.runs[0].get('metrics_csv')}, "
          "summary.json, .hydra/")
    first = result.runs[0]
    budget = first["budget"]
    print(f"\ngasloc-demo: {len(result.runs)} strategies x {first['world_size']} workers, "
          f"{budget['tokens']:,} tokens and {budget['steps']} steps each, done in {seconds:.0f} s")
    checks = acceptance(result)
    print("\n".join(checks))
    passed = all(line.startswith("  PASS") for line in checks)
    verdict = "every strategy learned more than byte frequencies." if passed else "FAILED the check."
    print(f"gasloc-demo: {verdict}")
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``gasloc-demo``; returns 0 when every strategy passes the acceptance check."""
    args = _parser().parse_args(argv)
    out_dir = (args.out or Path("outputs", "demo", datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))).resolve()
    command = sweep_command(out_dir, args.strategies, args.overrides)
    print(f"gasloc-demo: training {args.strategies} (experiment=demo) into {out_dir}", flush=True)
    print(f"  $ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(command).returncode
    if returncode != 0:
        print(f"gasloc-demo: the training sweep failed (exit code {returncode}); logs under {out_dir}",
              file=sys.stderr)
        return returncode
    result = compare([out_dir], out_dir)
    return 0 if _report(result, out_dir, time.perf_counter() - start) else 1


if __name__ == "__main__":
    sys.exit(main())
