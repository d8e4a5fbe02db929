"""Time until torchft's lighthouse listens: the ``torchft_lighthouse`` console script (imports torch first) against
the program ``gasloc-elastic`` runs (``gasloc_lightning/app/torchft_lighthouse.py``: the Rust extension alone).

Not a timed test: both are started alternately, ``--repeats`` times each, and the ratio of their medians is printed
(a ratio measured in one run holds on a shared machine; the absolute times show its load). CPU seconds come from
the child's own accounting (``os.wait4``), so they do not count other jobs.

Usage::

    .venv/bin/python benchmarks/lighthouse_start.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gasloc_lightning.app.elastic import free_port
from gasloc_lightning.app.torchft_lighthouse import lighthouse_program


def _listening_after(program: list[str]) -> tuple[float, float]:
    """(seconds until the port accepts, CPU seconds the process used by then) for one start."""
    port = free_port()
    start = time.monotonic()
    process = subprocess.Popen([*program, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() - start > 300:
                raise RuntimeError(f"{program[-1]} did not listen (exit {process.returncode})")
            time.sleep(0.01)
        elapsed = time.monotonic() - start
    finally:
        if process.returncode is None:  # not reaped yet
            process.send_signal(signal.SIGKILL)
    _, _, usage = os.wait4(process.pid, 0)
    return elapsed, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    script = [str(Path(sys.executable).parent / "torchft_lighthouse")]
    programs = {"console script": script, "gasloc program": lighthouse_program()}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in programs}
    for _ in range(args.repeats):
        for name, program in programs.items():
            results[name].append(_listening_after(program))
    for name, runs in results.items():
        print(f"{name:15s} listens after {statistics.median(r[0] for r in runs):6.2f} s (median of {len(runs)}), "
              f"CPU {statistics.median(r[1] for r in runs):5.2f} s")
    wall = [statistics.median(r[0] for r in runs) for runs in results.values()]
    cpu = [statistics.median(r[1] for r in runs) for runs in results.values()]
    print(f"ratio console script / gasloc program: wall {wall[0] / wall[1]:.0f}x, CPU {cpu[0] / max(cpu[1], 1e-3):.0f}x; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
