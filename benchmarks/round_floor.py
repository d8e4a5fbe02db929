"""How fast can one gossip round be here? The fused round, its memory-stream floor and a pipelined round,
each against the raw transfer of the same bytes.

``make bench`` (``overhead.py``) times the strategy's round at about 2x a raw ``batch_isend_irecv``
of the same float32 vector on this 2-core machine. This script asks what is left to gain, on bare
tensors (no Lightning), in two gloo processes with one torch thread each, alternated after barriers:

- ``raw``: the transfer alone (one isend + one irecv of N float32 with the peer);
- ``fused``: the exact round as the strategy runs it from 2^20 elements (``algorithm/fused.py``):
  ``fused_message``, the transfer, the received finite check, ``fused_pair_finish``;
- ``floor`` (derived, not run): the transfer plus the memory streams no exact float32 round can
  avoid, at ``fused``'s cost per stream. The message must read thetaH, theta and x and write u (4
  streams); the finish must read u, u_j and x and write the new point, the new round start and the
  anchor (6): 10 model-size streams, against 11 in ``fused`` (which also reads u_j once to check it
  is finite). Copies are no stand-in: one eager ``copy_`` stream costs more than an inductor one;
- ``pipelined C``: the fused round in C chunks, each chunk's send posted as soon as its message is
  built and each chunk finished as soon as it lands, so compute could hide under the transfer.

Usage: ``.venv/bin/python benchmarks/round_floor.py [--numel 10800000] [--chunks 2 4 8] [--repeats 8]``.
The ratios are the median over repeats; the first repeat warms up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gasloc_lightning.algorithm import fused
from gasloc_lightning.algorithm.outer import all_finite

ETA, GAMMA, WEIGHT = 0.7, 0.5, 0.5
FLOOR_STREAMS, FUSED_STREAMS = 10, 11


def _exchange(send: torch.Tensor, receive: torch.Tensor, peer: int) -> list[dist.Work]:
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)])


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class Round:
    """One worker's vectors (point, round start, anchor, receive buffer) and the round variants on them."""

    def __init__(self, numel: int, rank: int):
        generator = torch.Generator().manual_seed(rank)
        self.point, self.round_start, self.anchor = (torch.randn(numel, generator=generator) for _ in range(3))
        self.received, self.scratch = torch.empty(numel), torch.empty(numel)
        self.peer = 1 - rank

    def raw(self) -> None:
        _wait(_exchange(self.scratch, self.received, self.peer))

    def fused(self) -> None:
        fused.fused_message(self.point, self.round_start, self.anchor, ETA, GAMMA, compiled=True)
        _wait(_exchange(self.point, self.received, self.peer))
        all_finite(self.received)
        fused.fused_pair_finish(self.point, self.received, WEIGHT, self.round_start, self.anchor, GAMMA,
                                compiled=True)

    def pipelined(self, chunks: int) -> Callable[[], None]:
        def run() -> None:
            pieces = [vector.chunk(chunks) for vector in (self.point, self.received, self.round_start, self.anchor)]
            works = []
            for point, received, round_start, anchor in zip(*pieces):
                fused.fused_message(point, round_start, anchor, ETA, GAMMA, compiled=True)
                works.append(_exchange(point, received, self.peer))
            for (point, received, round_start, anchor), chunk_works in zip(zip(*pieces), works):
                _wait(chunk_works)
                all_finite(received)
                fused.fused_pair_finish(point, received, WEIGHT, round_start, anchor, GAMMA, compiled=True)
        return run


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fused.warm_up()
        round_ = Round(args.numel, rank)
        variants = {"raw": round_.raw, "fused": round_.fused}
        variants |= {f"pipelined {c}": round_.pipelined(c) for c in args.chunks}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats + 1):
            for name, variant in variants.items():
                dist.barrier()
                start = time.perf_counter()
                variant()
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            _report(times, args.numel)
    finally:
        dist.destroy_process_group()


def _report(times: dict[str, list[float]], numel: int) -> None:
    median = {name: statistics.median(values[1:]) for name, values in times.items()}
    passes = median["fused"] - median["raw"]
    median = {"raw": median["raw"], "fused": median["fused"],
              "floor": median["raw"] + passes * FLOOR_STREAMS / FUSED_STREAMS,
              **{name: value for name, value in median.items() if name.startswith("pipelined")}}
    print(f"one round on {numel * 4 / 1e6:.1f} MB of float32, 2 gloo workers x 1 thread, median of "
          f"{len(next(iter(times.values()))) - 1} repeats")
    print(f"  {'variant':14s} {'ms':>8s} {'/ raw':>7s}")
    for name, seconds in median.items():
        print(f"  {name:14s} {seconds * 1e3:8.1f} {seconds / median['raw']:7.2f}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=10_800_000, help="float32 elements (the small GPT's 10.8M)")
    parser.add_argument("--chunks", type=int, nargs="*", default=[2, 4, 8], help="chunk counts to pipeline")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    if args.numel < 2**20 or args.repeats < 1 or any(c < 2 for c in args.chunks):
        parser.error("--numel must be >= 2**20, --repeats >= 1 and every --chunks value >= 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(_free_port(), args), nprocs=2)  # joins both; an error in one stops the other


if __name__ == "__main__":
    main()
