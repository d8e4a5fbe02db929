"""One rank of the clock check: ``python -m gasloc_lightning.netlab.probe --rank R ...`` inside its site.

The ranks build a gloo group bound to their site's address (rank 0's site holds the store), then time one
communication pattern ``--repeats`` times between two barriers: ``allreduce`` (what DiLoCo does per round: one
all-reduce of the message) or ``gossip`` (GASLoC's round: each rank sends its message to, and receives one from,
each of its peers in ``--pairs``; the send posted first, as both engines' transports post it) or
``gossip_recv_first`` (the same with the receive posted first: with gloo, a pair whose two ends both post
the send first moves the two directions one after the other, about twice the time on a bandwidth-bound link). Rank 0 writes the seconds of every repeat to ``--out`` as JSON. The bytes are
zeros: only their number matters to the links.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from gasloc_lightning.comm.endpoints import Endpoint, gloo_options, listening_store

PATTERNS = ("allreduce", "gossip", "gossip_recv_first")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"0-4,1-5"`` as ``[(0, 4), (1, 5)]``."""
    return [tuple(int(r) for r in pair.split("-")) for pair in text.split(",") if pair]  # type: ignore[misc]


def _group(args: argparse.Namespace) -> ProcessGroupGloo:
    endpoint = Endpoint(bind=args.bind)
    timeout = timedelta(seconds=args.timeout)
    if args.rank == 0:
        store = listening_store(endpoint, timeout=args.timeout)
        with open(args.port_file, "w") as port_file:  # the others dial it (written after it listens)
            port_file.write(str(store.port))
    else:
        host, _, port = args.master.rpartition(":")
        store = TCPStore(host_name=host, port=int(port), is_master=False, timeout=timeout)
    return ProcessGroupGloo(store, args.rank, args.world, gloo_options(endpoint, timeout))


def _once(group: ProcessGroupGloo, args: argparse.Namespace, tensor: torch.Tensor, inbox: dict) -> float:
    group.barrier().wait()
    start = time.perf_counter()
    if args.pattern == "allreduce":
        group.allreduce([tensor]).wait()
    else:
        peers = [j if i == args.rank else i for i, j in parse_pairs(args.pairs) if args.rank in (i, j)]
        sends = [lambda peer=peer: group.send([tensor], peer, 0) for peer in peers]
        recvs = [lambda peer=peer: group.recv([inbox[peer]], peer, 0) for peer in peers]
        ordered = recvs + sends if args.pattern == "gossip_recv_first" else sends + recvs
        works = [post() for post in ordered]
        for work in works:
            work.wait()
    group.barrier().wait()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--bind", required=True, help="this rank's site address")
    parser.add_argument("--master", default="", help="HOST:PORT of rank 0's store (ranks > 0)")
    parser.add_argument("--port-file", default="", help="rank 0: where to write its store's port")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--pattern", choices=PATTERNS, required=True)
    parser.add_argument("--pairs", default="")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    group = _group(args)
    tensor = torch.zeros(max(1, args.bytes // 4))
    inbox = {peer: torch.empty_like(tensor) for pair in parse_pairs(args.pairs) for peer in pair}
    _once(group, argparse.Namespace(**{**vars(args), "pattern": "allreduce"}), torch.zeros(1), inbox)  # warm-up
    seconds = []
    for repeat in range(args.repeats):  # a line per repeat in the rank's log: a caller can wait on transfers running
        seconds.append(_once(group, args, tensor, inbox))
        print(f"repeat {repeat + 1}/{args.repeats} {seconds[-1]:.4f}s", flush=True)
    if args.rank == 0 and args.out:
        with open(args.out, "w") as out:
            json.dump({"pattern": args.pattern, "bytes": args.bytes, "seconds": seconds}, out)


if __name__ == "__main__":
    main()
