"""Overhead of GASLoC on CPU workers: inner-step throughput, round time against the raw transfer, memory.

Not a timed test: it runs the compared things side by side, alternated, in one process tree and
prints ratios (a ratio measured within one run holds on a noisy machine, an absolute time does not).

(a) Inner-step throughput. One GASLoC worker of a world of 2 (forked, ``cpu_threads`` threads
    each) against a plain ``Trainer(strategy="auto")`` of world size 1 with the same torch threads.
    Throughput is optimizer steps per second over a window after warm-up, measured between
    consecutive ``on_train_batch_end`` calls (so it includes data, the loop and every callback).
    H is larger than the run, so no round falls in the window: this is the cost of the strategy
    between rounds. A control runs two independent world-size-1 trainers at the same time: the
    two GASLoC workers share the cores' caches and memory bandwidth, which that control shares
    too, so gasloc / control isolates the strategy from the contention.
(b) One round against the raw transfer of the same bytes. Inside each GASLoC launch, after the
    window, every rank alternately times ``strategy.end_round()`` and a ``batch_isend_irecv`` of
    one preallocated float32 buffer of ``strategy.layout.numel`` elements with the same peer
    (rank 1 - rank), each after a barrier; one trial is the slower rank's time. A last set of
    rounds is timed piece by piece (gather, outer step, transfer, mix, scatter).
Memory. Outer state, receive buffers and scratch vector of a worker, in model copies.

Usage::

    .venv/bin/python benchmarks/overhead.py                # small GPT (10.8M parameters), 5 repeats
    .venv/bin/python benchmarks/overhead.py --quick        # tiny GPT, 2 repeats: a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import resource
import shutil
import signal
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

import gasloc_lightning.strategy as strategy_module
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.models.gpt import GPTConfig
from gasloc_lightning.models.lm import LanguageModel
from gasloc_lightning.outer import OuterState
from gasloc_lightning.transport import FlatLayout, GossipTransport

TARGET_THROUGHPUT = 0.97  # (a) gasloc / auto, at least
TARGET_ROUND = 1.5  # (b) round / raw transfer, at most
TARGET_OUTER_COPIES = 2.0  # outer state, in model copies, at most (receive buffers come on top)
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration (shared by every run, so the compared runs differ only in the strategy)."""

    model: str
    batch_size: int
    block_size: int
    warmup: int
    steps: int
    repeats: int
    round_trials: int
    threads: int
    control: bool

    @property
    def max_steps(self) -> int:
        return self.warmup + self.steps + 1  # +1: the first interval ends at the first step's end


class RandomBytes(Dataset):
    """Synthetic next-byte batches: random bytes, no corpus and no cache to build."""

    def __init__(self, block_size: int, length: int = 1 << 20):
        self.block_size, self.length = block_size, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        chunk = torch.randint(256, (self.block_size + 1,), generator=generator)  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


# ---------------------------------------------------------------------------------------- callbacks
class StepTimer(Callback):
    """Writes this rank's wall and CPU time between consecutive train-batch ends (after warm-up) to a json file.

    CPU time counts every thread of the process; CPU / wall below 1 for a one-thread process means
    it waited for a core (other load on the machine), which the wall-clock ratio then includes.
    """

    def __init__(self, out_dir: str, warmup: int):
        self.out_dir, self.warmup = out_dir, warmup
        self._ends: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._ends.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._ends[self.warmup :]
        record = {
            "steps": len(window) - 1,
            "wall": window[-1][0] - window[0][0],
            "cpu": window[-1][1] - window[0][1],
            "threads": torch.get_num_threads(),
            "rounds_in_window": getattr(trainer.strategy, "round_index", 0),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        _write_json(Path(self.out_dir) / f"steps-{os.getpid()}.json", record)


class RoundTimer(Callback):
    """At train end, on every rank in the same order: round vs raw transfer, alternated, then a profiled round set."""

    def __init__(self, out_dir: str, trials: int):
        self.out_dir, self.trials = out_dir, trials

    @torch.no_grad()
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, GASLoCStrategy) and strategy.world_size == 2
        peer = 1 - strategy.global_rank
        send = torch.randn(strategy.layout.numel)  # preallocated and touched, like the library's buffers
        recv = torch.zeros_like(send)
        round_times, raw_times = [], []
        for trial in range(self.trials + 1):  # trial 0 warms up (the first round allocates its receive buffer)
            round_times.append(_after_barrier(strategy.end_round))
            raw_times.append(_after_barrier(lambda: _raw_exchange(send, recv, peer)))
        with _profiled_round() as pieces:
            for _ in range(self.trials):
                dist.barrier()
                strategy.end_round()
        record = {"round": round_times[1:], "raw": raw_times[1:], "pieces": pieces, "memory": _memory(strategy)}
        records: list[Any] = [None] * strategy.world_size
        dist.all_gather_object(records, record)
        if strategy.global_rank == 0:
            _write_json(Path(self.out_dir) / "rounds.json", {"ranks": records})


def _after_barrier(function: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _raw_exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


# The pieces of GASLoCStrategy._communicate, timed by wrapping the library's own functions for a while.
_PIECES = {
    "gather (params -> flat)": (FlatLayout, "gather"),
    "outer.message (2 lerps)": (OuterState, "message"),
    "transport.post": (GossipTransport, "post"),
    "transport.complete (wait)": (GossipTransport, "complete"),
    "mix (1 lerp)": (strategy_module, "mix"),
    "outer.finish (1 lerp)": (OuterState, "finish"),
    "scatter (flat -> params)": (FlatLayout, "scatter_parameters"),
    "scatter buffers": (FlatLayout, "scatter_buffers"),
}


@contextlib.contextmanager
def _profiled_round() -> Iterator[dict[str, list[float]]]:
    pieces: dict[str, list[float]] = {name: [] for name in _PIECES}
    pieces["whole round"] = []
    targets = {**_PIECES, "whole round": (GASLoCStrategy, "_communicate")}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}
    for name, (owner, attr) in targets.items():
        setattr(owner, attr, _timed(originals[name], pieces[name]))
    try:
        yield pieces
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])


def _timed(function: Callable, times: list[float]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = function(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return result

    return wrapper


def _memory(strategy: GASLoCStrategy) -> dict[str, int]:
    """Bytes of this worker's model and of the strategy's model-size buffers (private fields read, not changed)."""
    transport = getattr(strategy, "_transport", None)
    scratch = getattr(strategy, "_work", None)
    receive = getattr(transport, "_receive_buffers", [])
    return {
        "model_parameters": sum(p.numel() * p.element_size() for p in strategy.layout.parameters),
        "exchanged_fp32": strategy.layout.numel * 4,
        "outer_state": strategy.outer_state.num_bytes,
        "receive_buffers": sum(b.numel() * b.element_size() for b in receive),
        "receive_buffer_count": len(receive),
        "scratch": 0 if scratch is None else scratch.numel() * scratch.element_size(),
    }


# ---------------------------------------------------------------------------------------- runs
def _fit(settings: Settings, out_dir: str, strategy: Any, devices: int, callbacks: list[Callback]) -> None:
    torch.manual_seed(0)
    model = LanguageModel(model=GPTConfig.preset(settings.model))
    data = DataLoader(RandomBytes(settings.block_size), batch_size=settings.batch_size, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=settings.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=out_dir,
        callbacks=[StepTimer(out_dir, settings.warmup), *callbacks],
    )
    trainer.fit(model, train_dataloaders=data)


def _run_auto(settings: Settings, out_dir: str) -> None:
    torch.set_num_threads(settings.threads)
    _fit(settings, out_dir, "auto", 1, [])


def _run_gasloc(settings: Settings, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    strategy = GASLoCStrategy(
        inner_steps=settings.max_steps + 1,  # no round inside the timed window
        topology="one_peer",
        start_method="fork",  # each worker runs one torch thread, so forking is safe (and starts in ~1 s)
        cpu_threads=settings.threads,
        consensus_every=0,  # the consensus measurement is an extra all-reduce, not part of a round
        gossip_timeout=120.0,
    )
    _fit(settings, out_dir, strategy, 2, [RoundTimer(out_dir, settings.round_trials)])


def _in_children(*targets: Callable[[], None]) -> None:
    """Run each target in its own forked child (all at once) and wait; a hung child is killed with its workers."""
    context = mp.get_context("fork")
    children = [context.Process(target=_child_main, args=(target,)) for target in targets]
    for child in children:
        child.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for child in children:
        child.join(max(1.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the child's own group: it and the workers it forked
            child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"a benchmark run failed (exit code {child.exitcode}); see its output above")


def _child_main(target: Callable[[], None]) -> None:
    os.setpgid(0, 0)
    _quiet()
    target()


def _measure(kind: str, settings: Settings) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp(prefix=f"gasloc-bench-{kind}-")
    try:
        if kind == "auto":
            _in_children(lambda: _run_auto(settings, out_dir))
        elif kind == "auto_x2":
            dirs = [tempfile.mkdtemp(dir=out_dir) for _ in range(2)]
            _in_children(*(lambda d=d: _run_auto(settings, d) for d in dirs))
        else:
            _in_children(lambda: _run_gasloc(settings, out_dir))
        steps = [json.loads(p.read_text()) for p in sorted(Path(out_dir).rglob("steps-*.json"))]
        rounds_file = Path(out_dir) / "rounds.json"
        rounds = json.loads(rounds_file.read_text()) if rounds_file.exists() else None
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"workers": steps, "rounds": rounds}


# ---------------------------------------------------------------------------------------- analysis
def _steps_per_second(result: dict[str, Any], clock: str = "wall") -> float:
    """Mean over this run's concurrent processes of each one's steps per (wall or CPU) second over its window."""
    return statistics.fmean(w["steps"] / w[clock] for w in result["workers"])


def _cpu_share(result: dict[str, Any]) -> float:
    return min(w["cpu"] / w["wall"] for w in result["workers"])


def _per_trial_max(rounds: dict[str, Any], key: str) -> list[float]:
    """One trial's time is the slower rank's."""
    return [max(values) for values in zip(*(rank[key] for rank in rounds["ranks"]))]


def _check_window(result: dict[str, Any], settings: Settings) -> None:
    for worker in result["workers"]:
        if worker["threads"] != settings.threads or worker["rounds_in_window"] != 0:
            raise RuntimeError(f"unexpected run conditions: {worker['threads']} threads, "
                               f"{worker['rounds_in_window']} rounds in the window")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:8.1f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print_throughput(runs: list[dict[str, dict]], settings: Settings) -> float:
    kinds = ["auto", "gasloc"] + (["auto_x2"] if settings.control else [])
    print(f"\n(a) inner-step throughput per process, steps/s over {settings.steps} steps after {settings.warmup} "
          f"warm-up (no round in the window)")
    header = "  repeat    auto ws=1   gasloc ws=2" + ("   2 x auto ws=1" if settings.control else "")
    print(header + "   gasloc/auto" + ("   gasloc/(2 x auto)" if settings.control else ""))
    rates = {kind: [_steps_per_second(run[kind]) for run in runs] for kind in kinds}
    for i in range(len(runs)):
        row = f"  {i + 1:6d}   {rates['auto'][i]:10.3f}   {rates['gasloc'][i]:11.3f}"
        if settings.control:
            row += f"   {rates['auto_x2'][i]:15.3f}"
        row += f"   {rates['gasloc'][i] / rates['auto'][i]:11.3f}"
        if settings.control:
            row += f"   {rates['gasloc'][i] / rates['auto_x2'][i]:19.3f}"
        print(row)
    medians = {kind: statistics.median(values) for kind, values in rates.items()}
    ratio = statistics.median(g / a for g, a in zip(rates["gasloc"], rates["auto"]))
    row = f"  median   {medians['auto']:10.3f}   {medians['gasloc']:11.3f}"
    if settings.control:
        row += f"   {medians['auto_x2']:15.3f}"
    row += f"   {ratio:11.3f}"
    if settings.control:
        control = statistics.median(g / c for g, c in zip(rates["gasloc"], rates["auto_x2"]))
        row += f"   {control:19.3f}"
    print(row)
    if settings.control:
        sharing = statistics.median(c / a for c, a in zip(rates["auto_x2"], rates["auto"]))
        print(f"  two world-size-1 runs side by side reach {sharing:.3f}x of one alone: that part of gasloc/auto is "
              "the shared caches and memory bandwidth of 2 busy cores, not the strategy; gasloc/(2 x auto) is the "
              "strategy's own cost.")
    return ratio


def _print_rounds(runs: list[dict[str, dict]]) -> float:
    rounds = [run["gasloc"]["rounds"] for run in runs]
    memory = rounds[0]["ranks"][0]["memory"]
    print(f"\n(b) one round vs raw batch_isend_irecv of the same {memory['exchanged_fp32'] / 1e6:.1f} MB with the "
          "same peer, ms (median of each launch's trials; a trial is the slower rank)")
    print("  launch   trials      round        raw   round/raw")
    ratios, all_round, all_raw = [], [], []
    for i, record in enumerate(rounds):
        round_times, raw_times = _per_trial_max(record, "round"), _per_trial_max(record, "raw")
        all_round += round_times
        all_raw += raw_times
        ratio = statistics.median(round_times) / statistics.median(raw_times)
        ratios.append(ratio)
        print(f"  {i + 1:6d}   {len(round_times):6d}   {_ms(statistics.median(round_times))}   "
              f"{_ms(statistics.median(raw_times))}   {ratio:9.3f}")
    ratio = statistics.median(ratios)
    print(f"  median            {_ms(statistics.median(all_round))}   {_ms(statistics.median(all_raw))}   "
          f"{ratio:9.3f}   (median of the launches' ratios)")
    _print_pieces(rounds, statistics.median(all_raw))
    return ratio


def _print_pieces(rounds: list[dict[str, Any]], raw: float) -> None:
    pieces: dict[str, list[float]] = {}
    for record in rounds:
        for rank in record["ranks"]:
            for name, times in rank["pieces"].items():
                calls = len(times) // len(rank["pieces"]["whole round"])  # mix runs twice per round
                per_round = [sum(times[i : i + calls]) for i in range(0, len(times), calls)] if calls else []
                pieces.setdefault(name, []).extend(per_round)
    whole = statistics.median(pieces.pop("whole round"))
    print("  where a round's time goes (profiled rounds, median per round over ranks and launches):")
    accounted = 0.0
    for name, times in pieces.items():
        value = statistics.median(times) if times else 0.0
        accounted += value
        print(f"    {name:28s} {_ms(value)} ms   {value / whole:6.1%}")
    print(f"    {'other (peers, python)':28s} {_ms(whole - accounted)} ms   {(whole - accounted) / whole:6.1%}")
    print(f"    {'whole _communicate':28s} {_ms(whole)} ms   (raw transfer alone: {_ms(raw).strip()} ms)")


def _print_memory(runs: list[dict[str, dict]]) -> float:
    memory = runs[0]["gasloc"]["rounds"]["ranks"][0]["memory"]
    model = memory["model_parameters"]
    print(f"\nmemory of one worker, in copies of the model's parameters ({model / 1e6:.1f} MB fp32)")
    rows = [
        ("outer state (round start + anchor)", memory["outer_state"]),
        (f"receive buffers ({memory['receive_buffer_count']} peer slot)", memory["receive_buffers"]),
        ("scratch message vector", memory["scratch"]),
    ]
    for name, num_bytes in rows:
        print(f"  {name:40s} {num_bytes / 1e6:8.1f} MB   {num_bytes / model:5.2f}")
    total = sum(num_bytes for _, num_bytes in rows)
    print(f"  {'total beyond the model and optimizer':40s} {total / 1e6:8.1f} MB   {total / model:5.2f}")
    rss = {kind: statistics.median(w["max_rss_mb"] for run in runs for w in run[kind]["workers"])
           for kind in ("auto", "gasloc")}
    print(f"  peak RSS, median: gasloc worker {rss['gasloc']:.0f} MB, auto {rss['auto']:.0f} MB, difference "
          f"{(rss['gasloc'] - rss['auto']) * 2**20 / model:.2f} model copies (at the end of the window, before the "
          "first round allocates its receive buffer: outer state + scratch + the process group)")
    return memory["outer_state"] / model


# ---------------------------------------------------------------------------------------- main
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record))


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "gasloc_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a torch deprecation inside Lightning


def _parse() -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="alternated repeats of each kind of run (5)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run, after warm-up (8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--model", default=None, help="GPT preset (small: 10.8M parameters)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step per process")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--round-trials", type=int, default=None, help="round/raw pairs per GASLoC launch (6)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (cores / 2)")
    parser.add_argument("--no-control", action="store_true", help="skip the two-concurrent-auto control runs")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 repeats: a smoke run")
    args = parser.parse_args()
    quick = args.quick
    model = args.model or ("tiny" if quick else "small")
    return Settings(
        model=model,
        batch_size=args.batch_size,
        block_size=min(args.block_size, GPTConfig.preset(model).block_size),
        warmup=args.warmup,
        steps=args.steps or (4 if quick else 8),
        repeats=args.repeats or (2 if quick else 5),
        round_trials=args.round_trials or (3 if quick else 6),
        threads=args.threads or max(1, (os.cpu_count() or 2) // 2),
        control=not args.no_control,
    )


def main() -> None:
    settings = _parse()
    _quiet()
    parameters = sum(p.numel() for p in LanguageModel(model=settings.model).parameters())
    print(f"GASLoC overhead: GPT {settings.model!r} ({parameters / 1e6:.2f}M parameters), batch "
          f"{settings.batch_size} x {settings.block_size} tokens, {settings.threads} torch thread(s) per process, "
          f"{os.cpu_count()} cores, {settings.repeats} alternated repeats")
    print(f"settings: {json.dumps(asdict(settings))}")
    kinds = ["auto", "gasloc"] + (["auto_x2"] if settings.control else [])
    runs = []
    for repeat in range(settings.repeats):
        order = kinds if repeat % 2 == 0 else kinds[::-1]  # A B C, C B A, ...: drift hits every kind alike
        run = {}
        for kind in order:
            run[kind] = _measure(kind, settings)
            _check_window(run[kind], settings)
        runs.append(run)
        print(f"  repeat {repeat + 1}/{settings.repeats} done ({' '.join(order)})", flush=True)
    throughput = _print_throughput(runs, settings)
    round_ratio = _print_rounds(runs)
    outer_copies = _print_memory(runs)
    print("\nsummary")
    print(f"  (a) inner-step throughput gasloc ws=2 / auto ws=1: {throughput:.3f}x   target >= {TARGET_THROUGHPUT}x   "
          f"{_verdict(throughput >= TARGET_THROUGHPUT)}")
    print(f"  (b) one round / raw transfer of the same bytes:    {round_ratio:.3f}x   target <= {TARGET_ROUND}x    "
          f"{_verdict(round_ratio <= TARGET_ROUND)}")
    print(f"  outer state, model copies:                        {outer_copies:.2f}     target <= "
          f"{TARGET_OUTER_COPIES:.0f} (+ receive buffers)   {_verdict(outer_copies <= TARGET_OUTER_COPIES)}")


if __name__ == "__main__":
    main()
