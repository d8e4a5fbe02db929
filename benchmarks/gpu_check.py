"""GPU check: codecs, the gossip round and the strategies' NCCL path on one CUDA device.

Not a test: every part runs in its own try/except, prints what it measured and adds it to one JSON
summary (written after every part, so a run cut short still leaves what it had). Without a GPU the
CUDA-only steps say so and are skipped; parts 2 and 3 then run on CPU on smaller vectors, and part 4
runs its code path on CPU with gloo, so the script can be debugged on a machine without a GPU.

1. Versions: torch, CUDA, NCCL, the GPU.
2. Codecs (:mod:`gasloc_lightning.algorithm.codecs`) on a float32 randn vector: the round-trip error
   relative to each block's absmax (against the documented bound), whether CUDA writes the same wire
   bytes as CPU for a 1M-element slice, and encode + decode time against a device-to-device copy of
   the float32 vector.
3. One round of two simulated workers (:class:`~gasloc_lightning.algorithm.round.GossipRound`, wires
   passed by reference) per codec, timed against one copy of the wire bytes (a stand-in for the
   transfer), and the pair's sum checked against the exact float32 round.
4. (a) A 2-rank NCCL process group on the single GPU with one ``batch_isend_irecv``; (b) Lightning
   on the GPU with ``GASLoCStrategy`` (``message_codec`` int8, then float32) and ``DiLoCoStrategy`` over
   NCCL at world size 1 (one GPU: one worker, so no bytes go out; this checks set-up, layout and rounds
   on CUDA).

Usage (repository root)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out gpu_check.json
    .venv/bin/python benchmarks/gpu_check.py --numel 4194304 --out /tmp/gpu_check.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gasloc_lightning.algorithm.codecs import CODECS, build_codec
from gasloc_lightning.algorithm.round import GossipRound

# max |x - decode(encode(x))| / block absmax, from the table in codecs.py's docstring
# (bfloat16's 2^-8 |x| and fp8's 2^-4 |x| are bounded by the absmax too).
ERROR_BOUNDS = {"float32": 0.0, "bfloat16": 2.0 ** -8, "int8": 1 / 254, "fp8": 2.0 ** -4 + 2.0 ** -10 / 448,
                "int4": 1 / 14, "int2": 1 / 3}
BLOCK = 128
ROUND_CODECS = ("float32", "bfloat16", "int8", "fp8", "int4", "int2")
SLICE_NUMEL = 1 << 20
WARMUP, REPEATS = 3, 10
SUBPROCESS_TIMEOUT_S = 120


# ---------------------------------------------------------------- helpers
def header(title: str) -> None:
    print(f"\n{'=' * 78}\n{title}\n{'=' * 78}", flush=True)


def failure(error: BaseException) -> dict[str, str]:
    """An exception as data: its type, message and the last frames."""
    return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}


def median_seconds(function: Callable[[], Any], device: torch.device,
                   before: Callable[[], Any] | None = None) -> float:
    """Median of REPEATS calls after WARMUP, by CUDA events on a GPU, by the wall clock on CPU.

    ``before`` runs untimed ahead of each call (e.g. to evict the cache).
    """
    for _ in range(WARMUP):
        function()
    times = []
    for _ in range(REPEATS):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            function()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_subprocess(target: Callable, *args: Any) -> dict[str, Any]:
    """Run ``target(queue, *args)`` in a spawned process; its first queued dict, or why none came."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(queue, *args))
    process.start()
    try:
        return queue.get(timeout=SUBPROCESS_TIMEOUT_S)
    except Exception:  # queue.Empty: it hung or died without reporting
        return {"ok": False,
                "error": f"no result within {SUBPROCESS_TIMEOUT_S} s (exit code {process.exitcode})"}
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


# ---------------------------------------------------------------- 1. versions
def versions() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
    try:
        import lightning
        info["lightning"] = lightning.__version__
    except ImportError as error:
        info["lightning"] = str(error)
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
    for key, value in info.items():
        print(f"  {key:16s} {value}")
    return info


# ---------------------------------------------------------------- 2. codecs
def block_error(x: torch.Tensor, decoded: torch.Tensor) -> float:
    """max over blocks of max |x - decoded| / absmax (a zero block counts 0)."""
    full = x.numel() // BLOCK * BLOCK
    blocks = x[:full].view(-1, BLOCK)
    error = (decoded[:full].view(-1, BLOCK) - blocks).abs_().amax(dim=1)
    absmax = blocks.abs().amax(dim=1)
    return float((error / absmax.clamp_min(torch.finfo(torch.float32).tiny)).max())


def same_bytes_as_cpu(name: str, x: torch.Tensor) -> bool | None:
    """Whether encoding the first SLICE_NUMEL elements on x's device gives CPU's wire bytes."""
    if x.device.type == "cpu":
        return None
    codec = build_codec(name)
    part = x[:SLICE_NUMEL].contiguous()
    wire_device = codec.new_wire(part.numel(), device=x.device)
    wire_cpu = codec.new_wire(part.numel(), device="cpu")
    codec.encode(part, wire_device)
    codec.encode(part.cpu(), wire_cpu)
    return bool(torch.equal(wire_device.cpu(), wire_cpu))


def check_codec(name: str, x: torch.Tensor, copy_s: float) -> dict[str, Any]:
    codec = build_codec(name)
    wire = codec.new_wire(x.numel(), device=x.device)
    out = torch.empty_like(x)
    codec.encode(x, wire)
    codec.decode(wire, out)
    error = block_error(x, out)
    encode_s = median_seconds(lambda: codec.encode(x, wire), x.device)
    decode_s = median_seconds(lambda: codec.decode(wire, out), x.device)
    both_s = median_seconds(lambda: (codec.encode(x, wire), codec.decode(wire, out)), x.device)
    return {"wire_bytes": wire.numel(), "wire_ratio": wire.numel() / (4 * x.numel()),
            "max_error_over_block_absmax": error, "bound": ERROR_BOUNDS[name],
            "within_bound": error <= ERROR_BOUNDS[name] * (1 + 1e-5) + 1e-7,
            "same_bytes_as_cpu_1M": same_bytes_as_cpu(name, x),
            "encode_ms": encode_s * 1e3, "decode_ms": decode_s * 1e3, "encode_decode_ms": both_s * 1e3,
            "encode_decode_over_copy": both_s / copy_s}


def codecs_part(device: torch.device, numel: int) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(numel, device=device, generator=generator)
    copy_target = torch.empty_like(x)
    copy_s = median_seconds(lambda: copy_target.copy_(x), device)
    print(f"  {numel:,} float32 elements on {device}; copy_ {copy_s * 1e3:.3f} ms "
          f"({2 * 4 * numel / copy_s / 1e9:.0f} GB/s read+write)")
    result: dict[str, Any] = {"numel": numel, "device": str(device), "copy_ms": copy_s * 1e3}
    print(f"  {'codec':9s} {'err/absmax':>11s} {'bound':>9s} {'ok':>3s} {'=cpu':>5s} "
          f"{'enc ms':>8s} {'dec ms':>8s} {'enc+dec':>8s} {'/copy':>7s}")
    for name in CODECS:
        try:
            row = check_codec(name, x, copy_s)
            print(f"  {name:9s} {row['max_error_over_block_absmax']:11.3e} {row['bound']:9.3e} "
                  f"{'yes' if row['within_bound'] else 'NO':>3s} {str(row['same_bytes_as_cpu_1M']):>5s} "
                  f"{row['encode_ms']:8.3f} {row['decode_ms']:8.3f} {row['encode_decode_ms']:8.3f} "
                  f"{row['encode_decode_over_copy']:6.2f}x")
        except Exception as error:  # one codec failing must not hide the others
            row = failure(error)
            print(f"  {name:9s} FAILED {row['error']}")
        result[name] = row
    return result


# ---------------------------------------------------------------- 3. the round
class Pair:
    """Two workers A and B, each its own GossipRound, exchanging wires by reference (weight 1/2)."""

    def __init__(self, codec: str, start: torch.Tensor, local_ends: tuple[torch.Tensor, torch.Tensor]):
        numel = start.numel()
        self.rounds = [GossipRound(start, numel, outer_lr=0.7, outer_momentum=0.5, message_codec=codec)
                       for _ in range(2)]
        self.points = [end.clone() for end in local_ends]

    def round(self) -> None:
        wires = [r.begin(p) for r, p in zip(self.rounds, self.points)]
        for me, (round_, point) in enumerate(zip(self.rounds, self.points)):
            received = [(0.5, wires[1 - me])]
            if round_.by_correction:
                round_.correct(received)
                round_.apply_correction(point)
            else:
                round_.mix(point, received)
        for round_, point in zip(self.rounds, self.points):
            round_.finish(point)

    def total(self) -> torch.Tensor:
        return self.points[0] + self.points[1]


def round_part(device: torch.device, numel: int) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(1)
    start = torch.randn(numel, device=device, generator=generator)
    ends = tuple(start + 0.01 * torch.randn(numel, device=device, generator=generator) for _ in range(2))
    exact = Pair("float32", start, ends)
    exact.round()
    exact_total = exact.total()
    del exact
    result: dict[str, Any] = {"numel": numel, "device": str(device)}
    print(f"  two workers, {numel:,} elements each, on {device}; outer_lr 0.7, outer_momentum 0.5")
    print(f"  {'codec':9s} {'pair ms':>8s} {'wire MB':>8s} {'copy ms':>8s} {'pair/copy':>9s} "
          f"{'worker/copy':>11s} {'sum rel err':>11s} {'ok':>3s}")
    for codec in ROUND_CODECS:
        try:
            row = time_round(codec, start, ends, exact_total)
            print(f"  {codec:9s} {row['pair_round_ms']:8.3f} {row['wire_bytes'] / 1e6:8.1f} "
                  f"{row['wire_copy_ms']:8.3f} {row['pair_over_wire_copy']:8.2f}x "
                  f"{row['worker_over_wire_copy']:10.2f}x "
                  f"{row['sum_relative_error']:11.2e} {'yes' if row['mean_preserved'] else 'NO':>3s}")
        except Exception as error:
            row = failure(error)
            print(f"  {codec:9s} FAILED {row['error']}")
        result[codec] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def time_round(codec: str, start: torch.Tensor, ends: tuple, exact_total: torch.Tensor) -> dict[str, Any]:
    pair = Pair(codec, start, ends)
    pair.round()
    difference = (pair.total() - exact_total).abs_().max()
    relative = float(difference / exact_total.abs().max())
    pair_s = median_seconds(pair.round, start.device)  # later rounds: same work, the values do not matter
    wire_bytes = pair.rounds[0].wire_bytes
    source = torch.empty(wire_bytes, dtype=torch.uint8, device=start.device)
    target = torch.empty_like(source)
    # A small wire fits in the GPU's L2 (60 MB on an H200) and a copy repeated from there is faster than any
    # transfer; the round streams the whole point anyway, so the copy starts from a cold cache too.
    evict = torch.empty(1 << 28, dtype=torch.uint8, device=start.device) if start.device.type == "cuda" else None
    copy_s = median_seconds(lambda: target.copy_(source), start.device,
                            before=None if evict is None else evict.zero_)
    return {"pair_round_ms": pair_s * 1e3, "wire_bytes": wire_bytes, "wire_copy_ms": copy_s * 1e3,
            "pair_over_wire_copy": pair_s / copy_s, "worker_over_wire_copy": pair_s / 2 / copy_s,
            "sum_relative_error": relative, "mean_preserved": relative <= 1e-4}


# ---------------------------------------------------------------- 4a. two ranks on one GPU
def _two_rank_worker(rank: int, port: int, backend: str, errors: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_DEBUG="WARN")
    try:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        send = torch.full((SLICE_NUMEL,), float(rank + 1), device=device)
        receive = torch.empty_like(send)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 1 - rank),
                                           dist.P2POp(dist.irecv, receive, 1 - rank)])
        for request in requests:
            request.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if not torch.all(receive == float(2 - rank)):
            raise RuntimeError(f"rank {rank} received wrong values")
        dist.destroy_process_group()
    except BaseException as error:
        errors.put({"rank": rank, **failure(error)})
        raise


def _two_ranks(queue: Any, backend: str) -> None:
    """In a spawned process: start two ranks, report success or their errors; stop them if they hang."""
    port = free_port()
    errors = mp.get_context("spawn").SimpleQueue()
    context = torch.multiprocessing.start_processes(_two_rank_worker, args=(port, backend, errors), nprocs=2,
                                                    join=False, start_method="spawn")
    began = time.perf_counter()
    deadline = began + SUBPROCESS_TIMEOUT_S - 30
    ok, message = False, None
    try:  # join returns False while any rank still runs (it wakes as each one exits)
        while not ok and time.perf_counter() < deadline:
            ok = context.join(timeout=max(1.0, deadline - time.perf_counter()))
        if not ok:
            message = f"the ranks did not finish within {SUBPROCESS_TIMEOUT_S - 30} s (hung): stopped"
    except Exception as error:  # ProcessRaisedException / ProcessExitedException
        message = f"{type(error).__name__}: {str(error)[-2000:]}"
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
    found = []
    while not errors.empty():
        found.append(errors.get())
    queue.put({"ok": bool(ok), "backend": backend, "seconds": time.perf_counter() - began,
               "launcher_error": message, "rank_errors": found})


def two_ranks_part(device: torch.device) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "gloo":
        print("  no GPU: the same 2-rank batch_isend_irecv on CPU with gloo (checks the script, not NCCL)")
    result = in_subprocess(_two_ranks, backend)
    print(f"  backend {backend}: {'SUCCESS' if result.get('ok') else 'FAILED'} "
          f"({result.get('seconds', float('nan')):.1f} s)")
    for error in result.get("rank_errors", []):
        print(f"  rank {error['rank']}: {error['error'][:600]}")
    if result.get("error"):
        print(f"  {result['error']}")
    return result


# ---------------------------------------------------------------- 4b. Lightning on the GPU
def _synthetic_bytes(samples: int, block_size: int) -> Any:
    """(x, y) pairs cut from a repeated sentence: learnable, in memory, no download."""
    from torch.utils.data import TensorDataset
    text = b"the quick brown fox jumps over the lazy dog; gossip mixes what local steps learn. " * 64
    stream = torch.tensor(list(text), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(stream) - block_size - 1, (samples,), generator=generator)
    windows = torch.stack([stream[s: s + block_size + 1] for s in starts.tolist()])
    return TensorDataset(windows[:, :-1], windows[:, 1:])


LIGHTNING_RUNS = ("gasloc_int8", "gasloc_float32", "diloco")


def _lightning_run(queue: Any, kind: str, accelerator: str, backend: str, max_steps: int) -> None:
    """In a spawned process: fit the tiny GPT for ``max_steps`` steps with one strategy, report figures."""
    try:
        queue.put(_fit(kind, accelerator, backend, max_steps))
    except BaseException as error:
        queue.put({"ok": False, **failure(error)})


def _fit(kind: str, accelerator: str, backend: str, max_steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import gasloc_lightning
    from gasloc_lightning.models.gpt import GPTConfig
    from gasloc_lightning.models.lm import LanguageModel

    seen: dict[str, Any] = {}

    class Observe(pl.Callback):
        def on_train_end(self, trainer, pl_module):  # the process group still exists here
            strategy = trainer.strategy
            seen["backend"] = dist.get_backend() if dist.is_initialized() else None
            seen["world_size"] = dist.get_world_size() if dist.is_initialized() else None
            seen["layout_device"] = str(strategy.layout.device)
            seen["layout_bound"] = strategy.layout.bound
            seen["layout_numel"] = strategy.layout.numel
            seen["live_flat_device"] = str(strategy.layout.read().device)
            seen["parameter_device"] = str(next(pl_module.parameters()).device)

    pl.seed_everything(0)
    if kind.startswith("gasloc_"):
        codec = kind.removeprefix("gasloc_")
        strategy = gasloc_lightning.GASLoCStrategy(inner_steps=10, message_codec=codec,
                                                   process_group_backend=backend, gossip_timeout=60.0)
    else:
        strategy = gasloc_lightning.DiLoCoStrategy(inner_steps=10, process_group_backend=backend,
                                                   gossip_timeout=60.0)
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = LanguageModel(model=config, warmup_steps=4, max_steps=max_steps)
    loader = DataLoader(_synthetic_bytes(16 * max_steps, config.block_size), batch_size=16, shuffle=False)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=max_steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[Observe()], default_root_dir=tempfile.mkdtemp(prefix="gpu_check_"))
    began = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - began
    loss = trainer.callback_metrics.get("train/loss")
    return {"ok": True, "strategy": type(strategy).__name__, "accelerator": accelerator,
            "requested_backend": backend, "fit_seconds": seconds, "global_step": trainer.global_step,
            "rounds": strategy.round_index, "final_loss": None if loss is None else float(loss),
            "bytes_sent": strategy.bytes_sent, "bytes_received": strategy.bytes_received,
            "launcher": type(strategy.launcher).__name__ if strategy.launcher else None, **seen}


def lightning_part(device: torch.device, max_steps: int) -> dict[str, Any]:
    accelerator, backend = ("gpu", "nccl") if device.type == "cuda" else ("cpu", "gloo")
    if device.type != "cuda":
        print("  no GPU: the same runs with accelerator='cpu' and gloo (checks the script, not CUDA/NCCL)")
    result = {}
    for kind in LIGHTNING_RUNS:
        row = in_subprocess(_lightning_run, kind, accelerator, backend, max_steps)
        if row.get("ok"):
            print(f"  {kind:14s} steps {row['global_step']} rounds {row['rounds']} "
                  f"final loss {row['final_loss']:.4f} bytes_sent {row['bytes_sent']} "
                  f"backend {row['backend']} (world {row['world_size']}) "
                  f"layout on {row['layout_device']} (bound {row['layout_bound']}) fit {row['fit_seconds']:.1f} s")
        else:
            print(f"  {kind:14s} FAILED {row.get('error')}\n{row.get('traceback', '')}")
        result[kind] = row
    return result


# ---------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--numel", type=int, default=None,
                        help="elements of the test vector (default 64M on a GPU, 4M on CPU)")
    parser.add_argument("--max-steps", type=int, default=40, help="Lightning steps per strategy (H = 10)")
    parser.add_argument("--parts", default="1234", help="which parts to run, e.g. 123")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    numel = args.numel or (1 << 26 if cuda else 1 << 22)
    if not cuda:
        print("NO GPU: CUDA-only steps are skipped; parts 2-3 run on CPU at "
              f"{numel:,} elements, part 4 on CPU with gloo.")
    summary: dict[str, Any] = {"device": str(device)}
    parts = [("1", "1. versions", versions),
             ("2", "2. codecs: round-trip error, bytes vs CPU, encode+decode vs copy",
              lambda: codecs_part(device, numel)),
             ("3", "3. GossipRound: two workers, one round vs one copy of the wire",
              lambda: round_part(device, numel)),
             ("4a", "4a. two NCCL ranks on one GPU: batch_isend_irecv", lambda: two_ranks_part(device)),
             ("4b", "4b. Lightning on the GPU: GASLoC (int8, float32) and DiLoCo over NCCL",
              lambda: lightning_part(device, args.max_steps))]
    for key, title, run in parts:
        if key[0] not in args.parts:
            continue
        header(title)
        began = time.perf_counter()
        try:
            summary[key] = run()
        except Exception as error:
            summary[key] = failure(error)
            print(f"  FAILED {error}\n{traceback.format_exc()}")
        print(f"  ({time.perf_counter() - began:.1f} s)", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(summary, indent=1, default=str))
    header("summary (JSON)")
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
