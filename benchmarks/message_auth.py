"""What message authentication costs per round: keyed tags on gossip messages and all-reduce chunks.

Not a timed test: the compared things run alternated in one pair of gloo processes on this machine (loopback),
and the output is ratios (a ratio measured within one run holds on a noisy machine, an absolute time does not).

(a) The demo model (tiny GPT of ``experiment=demo``, 119,104 float32 elements): one GASLoC pair exchange
    (send and receive of the message with the peer, as ``ElasticTransport.post``/``complete``) and one DiLoCo
    all-reduce of 2 workers, each without tags and with tags (``MessageAuthenticator``, the transport's own code:
    leaf hashes once, a tag per peer sent after the message, the received message checked before use; the ring of
    ``comm/ring.py`` tagged per hop). The all-reduce without tags is gloo's own, as the transport runs it when
    every member is admitted and tags are off. The round is H = 5 inner steps of the demo model (B = 16, T = 64,
    measured here, one thread) plus its exchange: the per-round ratio puts the exchange in that round.
(b) A 1B-parameter message (4 GB of float32) exchanged by the pair, streamed in ``--chunk-mb`` chunks through
    one reused send buffer and one reused receive buffer per process (memory stays at a few chunks). With tags,
    the sender hashes each chunk while it is on the wire and the receiver hashes each chunk as it lands, so the
    tag costs what hashing does not overlap; the two tags are exchanged and checked at the end.
(c) The keyed hashes' throughput on one thread, and on the ``--threads`` hashing threads the transport uses.

Usage::

    .venv/bin/python benchmarks/message_auth.py               # demo model and the 4 GB message
    .venv/bin/python benchmarks/message_auth.py --quick       # demo model and a 256 MB message: a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gasloc_lightning.comm.message_auth import MessageAuthenticator, context, tag_bytes, tag_tensor
from gasloc_lightning.comm.ring import ring_all_reduce_sum

SECRET = b"benchmark-secret"
DEMO_NUMEL = 119_104  # FlatLayout(tiny GPT).numel
_TIMEOUT = timedelta(seconds=600)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(works: list) -> None:
    for work in works:
        work.wait(_TIMEOUT)


def _pair_exchange(pg, message: torch.Tensor, incoming: torch.Tensor, peer: int, auth: MessageAuthenticator | None,
                   round_index: int) -> None:
    """ElasticTransport's exchange with one peer: message out and in, then (with tags) the tags and the check."""
    works = [pg.recv([incoming], peer, 1000), pg.send([message], peer, 1000)]
    if auth is not None:
        tag_in = torch.zeros(32, dtype=torch.uint8)
        works.append(pg.recv([tag_in], peer, 1003))
        mine = tag_tensor(auth.seal(auth.leaves(message), context("gossip", 1, round_index, pg.rank(), peer)))
        works.append(pg.send([mine], peer, 1003))
    _wait(works)
    if auth is not None and not auth.verify(incoming, context("gossip", 1, round_index, peer, pg.rank()),
                                            tag_bytes(tag_in)):
        raise RuntimeError("tag check failed")


def _stream_exchange(pg, send: torch.Tensor, receive: torch.Tensor, total: int, peer: int,
                     auth: MessageAuthenticator | None) -> None:
    """A ``total``-element message each way, chunk by chunk through the same two buffers."""
    builders = (auth.builder(), auth.builder()) if auth is not None else None
    for _ in range(total // send.numel()):
        works = [pg.recv([receive], peer, 1000), pg.send([send], peer, 1000)]
        if builders is not None:
            builders[0].update(send)  # while the chunk is on the wire
        _wait(works)
        if builders is not None:
            builders[1].update(receive)
    if builders is not None:
        tag_in = torch.zeros(32, dtype=torch.uint8)
        _wait([pg.recv([tag_in], peer, 1003),
               pg.send([tag_tensor(builders[0].seal(context("gossip", pg.rank(), peer)))], peer, 1003)])
        if not hmac.compare_digest(builders[1].seal(context("gossip", peer, pg.rank())), tag_bytes(tag_in)):
            raise RuntimeError("tag check failed")


def _timed(pg, fn, repeats: int) -> float:
    """Median over ``repeats`` of the slower rank's time for ``fn`` (each after a barrier)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def _worker(rank: int, port: int, args: argparse.Namespace, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=_TIMEOUT)
    pg, peer = dist.distributed_c10d._get_default_group(), 1 - rank
    auth = MessageAuthenticator(SECRET, algorithm=args.algorithm, threads=args.threads)
    message, incoming = torch.randn(DEMO_NUMEL), torch.empty(DEMO_NUMEL)
    out: dict[str, float] = {}
    for name, fn in {
        "demo_gossip_plain": lambda: _pair_exchange(pg, message, incoming, peer, None, 0),
        "demo_gossip_tagged": lambda: _pair_exchange(pg, message, incoming, peer, auth, 0),
        "demo_allreduce_plain": lambda: dist.all_reduce(message.clone()),
        "demo_allreduce_tagged": lambda: ring_all_reduce_sum(
            pg, message.clone(), ring=(0, 1), rank=rank, deadline=time.monotonic() + 600, authenticator=auth,
            use=context("all-reduce", 1, 1)),
    }.items():
        _timed(pg, fn, 3)  # warm-up
        out[name] = _timed(pg, fn, args.repeats)
    chunk = args.chunk_mb * (1 << 20) // 4
    send, receive = torch.randn(chunk), torch.empty(chunk)
    total = args.message_elements // chunk * chunk
    for label, tagger in (("big_plain", None), ("big_tagged", auth)) * args.big_repeats:
        out.setdefault(label, 0.0)
        out[label] = max(out[label], 0.0) + _timed(pg, lambda: _stream_exchange(pg, send, receive, total, peer, tagger), 1)
    out["big_plain"] /= args.big_repeats
    out["big_tagged"] /= args.big_repeats
    out["big_bytes"] = total * 4
    if rank == 0:
        results.update(out)
    auth.close()
    dist.destroy_process_group()


def _inner_step_seconds(steps: int = 6) -> float:
    """One optimizer step of the demo model (B = 16, T = 64) on one thread: the median after a warm-up."""
    from gasloc_lightning.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (16, 65))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _hash_throughput(threads: int) -> dict[str, float]:
    data = torch.randn(64 << 18)  # 64 MiB
    view = memoryview(data.numpy()).cast("B")
    out = {}
    for algorithm in ("sha256", "blake2b"):
        key = b"k" * 32
        start = time.perf_counter()
        if algorithm == "sha256":
            hmac.digest(key, view, "sha256")
        else:
            hashlib.blake2b(view, key=key, digest_size=32).digest()
        out[f"{algorithm}_1_thread"] = len(view) / (time.perf_counter() - start) / 1e9
        auth = MessageAuthenticator(SECRET, algorithm=algorithm, threads=threads)
        auth.tag(data, b"warm-up")
        start = time.perf_counter()
        auth.tag(data, b"x")
        out[f"{algorithm}_{threads}_threads"] = len(view) / (time.perf_counter() - start) / 1e9
        auth.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 256 MB message instead of 4 GB")
    parser.add_argument("--algorithm", default="sha256", choices=("sha256", "blake2b"))
    parser.add_argument("--threads", type=int, default=None, help="hashing threads (default: the transport's)")
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    args.message_elements = (64 << 20) if args.quick else 1_000_000_000
    args.big_repeats = 1
    threads = args.threads or MessageAuthenticator(SECRET).threads
    print(f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} algorithm={args.algorithm} hashing_threads={threads}")
    hashing = _hash_throughput(threads)
    print("keyed hash throughput, GB/s: " + ", ".join(f"{k}={v:.2f}" for k, v in hashing.items()))
    step = _inner_step_seconds()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), args, results), nprocs=2, join=True)
        results = dict(results)
    round_plain = 5 * step
    print(f"demo model: {DEMO_NUMEL} float32 elements, inner step {step * 1e3:.1f} ms, H = 5")
    for kind in ("gossip", "allreduce"):
        plain, tagged = results[f"demo_{kind}_plain"], results[f"demo_{kind}_tagged"]
        print(f"  {kind:9s} exchange: plain {plain * 1e3:7.2f} ms, tagged {tagged * 1e3:7.2f} ms, "
              f"ratio {tagged / plain:5.2f}x; per round (H steps + exchange) "
              f"ratio {(round_plain + tagged) / (round_plain + plain):5.3f}x")
    size = results["big_bytes"] / 1e9
    plain, tagged = results["big_plain"], results["big_tagged"]
    print(f"{size:.2f} GB message (pair exchange, {args.chunk_mb} MB chunks): plain {plain:.2f} s "
          f"({size / plain:.2f} GB/s each way), tagged {tagged:.2f} s, ratio {tagged / plain:.2f}x")


if __name__ == "__main__":
    main()
