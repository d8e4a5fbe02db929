"""The network clock checked against the lab: a round's communication, predicted and measured.

For a preset with n ranks, each rank sits in its cluster's site and the same bytes cross the shaped links:

- DiLoCo's round, one all-reduce of the message: predicted by the model's ``all_reduce_time`` (the cheaper of a
  ring and a hierarchical all-reduce) and, next to it, its ``ring_all_reduce_time``;
- GASLoC's round, one gossip exchange with the round's peers: predicted by ``pairwise_time`` with the model's
  ``concurrent_flows``, the slowest pair.

The lab's links run at ``bandwidth_scale`` of the model's, so the prediction is the model's time for
``nbytes / bandwidth_scale`` bytes. The lab has no latency (no ``netem`` here): the model's latency share
(its time for 0 bytes) is reported apart, and ``predicted_bw`` is the prediction without it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gasloc_lightning.netlab.lab import Lab
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.network.clock import round_pairs
from gasloc_lightning.strategies.launcher import terminate

_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ClockRow:
    """One pattern on one preset: the model's seconds (with and without latency) and the lab's (median)."""

    preset: str
    pattern: str
    nbytes: int
    predicted: float
    predicted_bw: float
    predicted_ring_bw: float | None
    measured: float
    repeats: list[float]

    @property
    def error(self) -> float:
        """measured / predicted_bw - 1."""
        return self.measured / self.predicted_bw - 1.0


def busiest_round(network: NetworkModel, topology: object, rounds: int = 20) -> tuple[int, list[tuple[int, int]]]:
    """The round among the first ``rounds`` whose exchanges cross sites the most (ties: the earliest)."""
    best = max(range(rounds), key=lambda t: (sum(network.cluster_of(i) != network.cluster_of(j)
                                                 for i, j in round_pairs(topology, network.world_size, t)), -t))
    return best, round_pairs(topology, network.world_size, best)


def without_latency(network: NetworkModel) -> NetworkModel:
    """``network`` with every latency 0 (the lab's links have none): same clusters, bandwidths and sharing."""
    k, n = network.num_clusters, network.world_size
    members = [[r for r in range(n) if network.cluster_of(r) == c] for c in range(k)]
    gbps = [[_gbps(network, members[a], members[b]) for b in range(k)] for a in range(k)]
    uplinks = {"uplinks": True} if getattr(network, "uplinks", False) else {}  # many_sites: flows share uplinks
    return NetworkModel(bandwidth_gbps=gbps, latency_s=[[0.0] * k for _ in range(k)],
                        clusters=[network.cluster_of(r) for r in range(n)], **uplinks)


def _gbps(network: NetworkModel, a: list[int], b: list[int]) -> float:
    pair = (a[0], b[0]) if a != b else ((a[0], a[1]) if len(a) > 1 else None)
    return 1.0 if pair is None else network.link(*pair)[0] * 8 / 1e9  # a lone rank's own entry is never used


def predict_allreduce(network: NetworkModel, nbytes: int, scale: float) -> tuple[float, float, float]:
    """(model, model without latency, ring without latency) seconds of one all-reduce on the lab's links."""
    bare = without_latency(network)
    return (network.all_reduce_time(nbytes / scale), bare.all_reduce_time(nbytes / scale),
            bare.ring_all_reduce_time(nbytes / scale))


def predict_gossip(network: NetworkModel, pairs: list[tuple[int, int]], nbytes: int, scale: float) -> tuple[float, float]:
    """(model, model without latency) seconds of one gossip round of ``pairs`` (its slowest exchange)."""
    def slowest(model: NetworkModel) -> float:
        flows = model.concurrent_flows(pairs)
        return max(model.pairwise_time(i, j, nbytes / scale, flows[(i, j)]) for i, j in pairs)

    return slowest(network), slowest(without_latency(network))


def measure(lab: Lab, *, pattern: str, nbytes: int, pairs: list[tuple[int, int]], repeats: int,
            folder: Path, timeout_s: float = 300.0) -> list[float]:
    """Run the probe's ``pattern`` on every rank of ``lab.plan`` (one rank per worker of the plan); its seconds.

    Args:
        lab: the built lab (its ``wrap`` places each rank in its site).
        pattern: one of the probe's ``PATTERNS``.
        nbytes: bytes of one message, >= 1.
        pairs: the gossip round's pairs (unused by ``allreduce``).
        repeats: timed repeats, >= 1.
        folder: where the ranks' logs and results go.
        timeout_s: the whole measurement's limit, > 0 (start-up included).

    Raises:
        TimeoutError: the ranks ran past ``timeout_s``.
        RuntimeError: a rank failed.

    Every process it starts is stopped by pid before it returns or raises, whatever happens.
    """
    _check_measure(nbytes=nbytes, repeats=repeats, timeout_s=timeout_s)
    folder.mkdir(parents=True, exist_ok=True)
    plan, world = lab.plan, len(lab.plan.worker_sites)
    deadline = time.monotonic() + timeout_s
    port_file, out = folder / f"{pattern}.port", folder / f"{pattern}.json"
    port_file.unlink(missing_ok=True)
    common = ["--world", str(world), "--bytes", str(nbytes), "--pattern", pattern, "--repeats", str(repeats),
              "--pairs", ",".join(f"{i}-{j}" for i, j in pairs), "--timeout", str(timeout_s)]
    processes: list[subprocess.Popen] = []
    try:
        processes.append(_start(lab, 0, [*common, "--port-file", str(port_file), "--out", str(out)], folder))
        port = _wait_for_port(port_file, processes[0], min(deadline, time.monotonic() + _START_TIMEOUT_S))
        for rank in range(1, world):
            master = f"{plan.address_of_worker(0)}:{port}"
            processes.append(_start(lab, rank, [*common, "--master", master], folder))
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = [p.poll() for p in processes]
        if None in codes:
            raise TimeoutError(f"clock probe {pattern}: ranks {[r for r, c in enumerate(codes) if c is None]} still "
                               f"ran after {timeout_s:g}s: stopped (see {folder}/rank_*.log)")
        if codes != [0] * world:
            raise RuntimeError(f"clock probe {pattern}: exit codes {codes} (see {folder}/rank_*.log)")
        return json.loads(out.read_text())["seconds"]
    finally:
        terminate(processes, 5.0)


def _check_measure(*, nbytes: int, repeats: int, timeout_s: float) -> None:
    for name, value in (("nbytes", nbytes), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")


def _start(lab: Lab, rank: int, args: list[str], folder: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "gasloc_lightning.netlab.probe", "--rank", str(rank),
               "--bind", lab.plan.address_of_worker(rank), *args]
    with open(folder / f"rank_{rank}.log", "ab") as log_file:
        return subprocess.Popen(lab.wrap(command, lab.plan.worker_sites[rank]), stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_port(port_file: Path, rank0: subprocess.Popen, deadline: float) -> int:
    waited_from = time.monotonic()
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if rank0.poll() is not None:
            raise RuntimeError(f"clock probe rank 0 exited with {rank0.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"clock probe rank 0 did not listen within {deadline - waited_from:.0f}s: stopped (see "
                       f"{port_file.parent}/rank_0.log)")


def median(values: list[float]) -> float:
    return statistics.median(values)
