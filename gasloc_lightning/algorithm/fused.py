"""GASLoC's exact round (float32 messages, no overlap, anchored form, one peer) in two fused kernels.

:mod:`~gasloc_lightning.algorithm.round` runs this round as seven model-size kernels: a finite check
of thetaH, two lerps for the message, a finite check of the peer's u_j, the mix, the anchor update and
the copy back into the live parameters. Here the finite check of u_j stays (the caller's) and the
rest become two passes:

* :func:`fused_message`: u = z + gamma (z - x), z = theta + eta (thetaH - theta), over thetaH, and
  whether u is finite (reads thetaH, theta, x; writes u).
* :func:`fused_pair_finish`: theta' = u + w (u_j - u) into the point and the round start, and
  x' = theta' + gamma / (1 + gamma) (x - theta') (reads u, u_j, x; writes three).

Symbols as in :mod:`.outer`: thetaH ``local_end``, theta ``round_start``, x ``anchor``, eta
``outer_lr``, gamma ``outer_momentum``, w ``weight``, u_j ``received``.

Two implementations, one semantics. Eager: today's torch.lerp sequence, bit for bit. Compiled: one
torch.compile'd (inductor) kernel each, C++ on CPU, Triton on CUDA, with torch.lerp's formula
(``start + w (end - start)`` for ``|w| < 0.5``, else ``end - (1 - w)(end - start)``); FMA contraction
makes it differ from eager in the last bits (measured: at most 1.8e-7 of max|result|).

:func:`enabled` takes the compiled kernels on CPU from ``MIN_COMPILED_NUMEL`` (2**20) elements when
torch.compile works: below that, compiling (seconds per process) buys nothing; on CUDA never by
default (the table below). ``GASLOC_FUSED_ROUND`` = ``0`` / ``1`` forces it off / on for any size
and device; an explicit ``compiled=`` argument wins over both. The first compile failure (no C++
compiler, an unsupported platform) logs one warning and leaves the process eager. :func:`warm_up`
compiles ahead of the first round.

One graph per function serves every size >= 2 (dynamic shapes; dynamo specializes 0 and 1, which run
eagerly) and every eta, gamma, w (a device tensor, not constants). Dynamo guards on the thread count:
a ``torch.set_num_threads`` change costs one recompile. The CPU kernel reads the thread count when it
runs (``cpp.dynamic_threads``; otherwise a graph first compiled on a small vector stays serial).
Compilation runs in this process (``compile_threads=1``): inductor's worker pool would outlive us.
A compiled call costs ~0.2 ms of Python (dynamo's guards) against ~0.08 ms eager, at 4k elements.

``python -m gasloc_lightning.algorithm.fused [--cuda]`` (cold cache: ``TORCHINDUCTOR_CACHE_DIR=$(mktemp
-d)``), one round on 10.8M float32 elements, best of 10-30 (eager: passes 1, 2, 4-7 as round.py runs
them; fused: fused_message, aminmax of u_j, fused_pair_finish; copy: one vector ``copy_``):

    machine                                    threads   eager ms   fused ms   copy ms
    dev box, 2 cores, torch 2.13 (load ~4)     1         58-87      37-55      8.5-9.4
    H200 host CPU, 16 cores, torch 2.11 (*)    1         51.9       34.9       7.1
    H200 host CPU (*)                          2         26.6       27.4       3.9
    H200 GPU, 268M elements (*)                -         4.18       4.73       0.54

16 model-size reads and writes become 11; CPU time follows (0.6-0.7x). (*): before
``cpp.dynamic_threads``; the second thread's missing gain there is unexplained (the dev box, loaded,
ran every kernel slower on two threads than on one). On the GPU the Triton split reduction for the
finite flag is slower than aminmax, so the compiled round loses. First calls (both kernels, imports
included): dev box 23-28 s cold cache, 4-7 s warm; H200 host CPU ~50 s cold; CUDA 5.9 s cold, 3.3 s warm.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from gasloc_lightning.algorithm.outer import all_finite, validate_outer_hyperparameters

log = logging.getLogger(__name__)

FUSED_ROUND_ENV = "GASLOC_FUSED_ROUND"
MIN_COMPILED_NUMEL = 2**20


def fused_message(
    local_end: Tensor,
    round_start: Tensor,
    anchor: Tensor,
    outer_lr: float,
    outer_momentum: float,
    *,
    compiled: bool | None = None,
) -> bool:
    """Overwrite thetaH with the anchored message u in one pass; return whether every element of u is finite.

    u = z + gamma (z - x) with z = theta + eta (thetaH - theta), as two torch.lerp's (see the module).
    With eta > 0, 1 + gamma > 0 and a finite theta and x, a non-finite thetaH gives a non-finite u, so
    the flag is also the check of thetaH. It is False as well for a finite thetaH whose u overflows
    float32 (|values| near 3e38), a point that could not be sent anyway. On False, ``local_end`` holds u,
    not thetaH.

    Args:
        local_end: thetaH, the point after the local steps (overwritten with u).
        round_start: theta, the round-start point.
        anchor: x, the anchor.
        outer_lr: eta > 0.
        outer_momentum: gamma in [0, 1).
        compiled: True / False forces the compiled / eager kernel; None asks :func:`enabled`.
    """
    validate_outer_hyperparameters(outer_lr, outer_momentum, "anchored")
    _check_vectors(local_end=local_end, round_start=round_start, anchor=anchor)
    if _use_compiled(compiled, local_end):
        coefficients = _scalars(local_end, outer_lr, 1.0 + outer_momentum)
        finite = _STATE.run("message", _message_kernel, local_end.view(-1), round_start.view(-1),
                            anchor.view(-1), coefficients)
        if finite is not _FAILED:
            return bool(finite)
    torch.lerp(round_start, local_end, outer_lr, out=local_end)  # z
    torch.lerp(anchor, local_end, 1.0 + outer_momentum, out=local_end)  # u
    return all_finite(local_end)


def fused_pair_finish(
    point: Tensor,
    received: Tensor,
    weight: float,
    round_start: Tensor,
    anchor: Tensor,
    outer_momentum: float,
    *,
    compiled: bool | None = None,
) -> None:
    """Mix with one peer and finish the anchored outer step in one pass.

    theta' = u + w (u_j - u) (torch.lerp), written into ``point`` and ``round_start``, and
    x' = theta' + gamma / (1 + gamma) (x - theta') = (theta' + gamma x) / (1 + gamma) into ``anchor``.
    The caller checks ``received`` for non-finite values first (a rejected peer is not mixed).

    Args:
        point: u, this worker's message (overwritten with theta', the new round start).
        received: u_j, the peer's message (read only).
        weight: w_ij in [0, 1].
        round_start: theta (overwritten with theta').
        anchor: x (overwritten with x').
        outer_momentum: gamma in [0, 1).
        compiled: True / False forces the compiled / eager kernel; None asks :func:`enabled`.
    """
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum (gamma) must be in [0, 1), got {outer_momentum}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight (w_ij) must lie in [0, 1], got {weight!r}")
    _check_vectors(point=point, received=received, round_start=round_start, anchor=anchor)
    keep = outer_momentum / (1.0 + outer_momentum)
    if _use_compiled(compiled, point):
        coefficients = _scalars(point, weight, keep)
        vectors = (point.view(-1), received.view(-1), round_start.view(-1), anchor.view(-1))
        if _STATE.run("pair_finish", _pair_finish_kernel, *vectors, coefficients) is not _FAILED:
            return
    torch.lerp(point, received, weight, out=round_start)  # theta', as outer.mix
    torch.lerp(round_start, anchor, keep, out=anchor)  # x', as OuterState.finish
    point.copy_(round_start)


def enabled(numel: int, *, device: torch.device | str = "cpu", min_numel: int = MIN_COMPILED_NUMEL) -> bool:
    """Whether a round on ``numel`` elements on ``device`` runs the compiled kernels (no ``compiled=`` given).

    By default on CPU from ``min_numel`` elements on; never by default on CUDA, where the eager passes
    already run near the memory bandwidth and the compiled ones were measured slower (module docstring).
    ``GASLOC_FUSED_ROUND=1`` turns it on for any size and device, ``0`` off. Never for fewer than 2
    elements, without a working torch.compile, or after a compile failed in this process.
    """
    forced = _forced()
    if forced is False:
        return False
    by_default = torch.device(device).type == "cpu" and numel >= min_numel
    return (forced is True or by_default) and _can_compile(numel)


def warm_up(device: torch.device | str = "cpu") -> bool:
    """Compile both kernels now, on scratch vectors; returns whether the compiled kernels work here.

    A compile takes seconds with a warm inductor cache and up to a minute with a cold one. Call this in
    setup, after the thread count is set and before the first exchange, where the strategy decided on
    the compiled path: otherwise the first round pays it while the peers wait for this worker's message.
    One graph serves every size, so 16 elements compile what a model of any size runs.
    """
    local_end, round_start, anchor, received = (torch.zeros(16, device=device) for _ in range(4))
    fused_message(local_end, round_start, anchor, 1.0, 0.0, compiled=True)
    fused_pair_finish(local_end, received, 0.5, round_start, anchor, 0.0, compiled=True)
    return _can_compile(local_end.numel())


# ---------------------------------------------------------------------- the compiled kernels
def _message_kernel(local_end: Tensor, round_start: Tensor, anchor: Tensor, coefficients: Tensor) -> Tensor:
    z = torch.lerp(round_start, local_end, coefficients[0])  # (N,)
    local_end.copy_(torch.lerp(anchor, z, coefficients[1]))  # u
    # Reduced from local_end, not from u: on CPU one loop either way; from u, inductor's CUDA code
    # stored u twice (a temporary for its split reduction, and local_end).
    return torch.isfinite(local_end).all()  # ()


def _pair_finish_kernel(point: Tensor, received: Tensor, round_start: Tensor, anchor: Tensor,
                        coefficients: Tensor) -> None:
    mixed = torch.lerp(point, received, coefficients[0])  # (N,) theta'
    anchor.copy_(torch.lerp(mixed, anchor, coefficients[1]))
    round_start.copy_(mixed)
    point.copy_(mixed)


class _CompileState:
    """The process's compiled kernels, and whether compiling has failed (then eager for good)."""

    def __init__(self) -> None:
        self.broken = False
        self._kernels: dict[str, Callable[..., Tensor | None]] = {}

    def run(self, name: str, kernel: Callable[..., Tensor | None], *args: Tensor) -> object:
        """The compiled ``kernel``'s result on ``args``; ``_FAILED`` (after one warning) when compiling fails."""
        if self.broken:
            return _FAILED
        try:
            if name not in self._kernels:
                self._kernels[name] = torch.compile(kernel, dynamic=True, fullgraph=True,
                                                    options={"cpp.dynamic_threads": True})
            with _compile_context(args[0].device):
                return self._kernels[name](*args)
        except Exception as error:  # noqa: BLE001 - any compile failure means "stay eager"
            self.broken = True
            log.warning("fused round: torch.compile failed, the round stays eager in this process "
                        "kernel=%s error=%s: %s", name, type(error).__name__, error)
            return _FAILED


_FAILED = object()
_STATE = _CompileState()


@contextlib.contextmanager
def _compile_context(device: torch.device) -> Iterator[None]:
    """The same global state on every call (dynamo guards on it), and compilation in this process."""
    import torch._inductor.config as inductor_config

    threads = inductor_config.compile_threads  # set and restored by hand: config.patch costs ~50 us a call
    inductor_config.compile_threads = 1
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            yield
    finally:
        inductor_config.compile_threads = threads


def _use_compiled(compiled: bool | None, vector: Tensor) -> bool:
    if compiled is None:
        return enabled(vector.numel(), device=vector.device)
    return compiled and _can_compile(vector.numel())


def _can_compile(numel: int) -> bool:
    return numel >= 2 and not _STATE.broken and _dynamo_supported()


@functools.cache
def _dynamo_supported() -> bool:
    if not hasattr(torch, "compile"):
        return False
    try:
        from torch._dynamo import is_dynamo_supported

        return bool(is_dynamo_supported())
    except Exception:  # noqa: BLE001 - an import failure means no compiler
        return False


def _forced() -> bool | None:
    value = os.environ.get(FUSED_ROUND_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FUSED_ROUND_ENV} must be 0 or 1 (or unset), got {value!r}")
    return None if value == "" else value == "1"


def _scalars(like: Tensor, *values: float) -> Tensor:
    """Scalars as one float32 device tensor: a graph input, so new values reuse the compiled graph."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _check_vectors(**vectors: Tensor) -> None:
    first_name, first = next(iter(vectors.items()))
    for name, tensor in vectors.items():
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {tensor.dtype} "
                             f"(contiguous: {tensor.is_contiguous()})")
        if tensor.shape != first.shape or tensor.device != first.device:
            raise ValueError(f"{name} must match {first_name}: shape {tuple(first.shape)} on {first.device}, "
                             f"got {tuple(tensor.shape)} on {tensor.device}")


# ---------------------------------------------------------------------- measurement
def _benchmark(numel: int = 10_800_000, threads: tuple[int, ...] = (1, 2), device: str = "cpu",
               repeats: int = 20) -> None:
    """Print the first-call (compile) time, then today's eager passes vs the fused round vs a raw copy.

    The three are timed in turn, ``repeats`` times, and each one's best time is printed (other load
    on the machine only ever adds time).
    """
    import time

    from gasloc_lightning.algorithm.outer import OuterState, mix

    eta, gamma, weight = 0.7, 0.5, 0.5
    point, received = torch.randn(numel, device=device), torch.randn(numel, device=device)
    outer = OuterState(torch.randn(numel, device=device), eta, gamma)
    torch.set_num_threads(threads[0])  # dynamo guards on the thread count: compile for the first one timed
    start = time.perf_counter()
    fused_message(point, outer.round_start, outer.anchor, eta, gamma, compiled=True)
    fused_pair_finish(point, received, weight, outer.round_start, outer.anchor, gamma, compiled=True)
    print(f"first_call_s={time.perf_counter() - start:.2f} compiled={not _STATE.broken}")

    def eager() -> None:  # passes 1, 2, 4, 5, 6, 7 of the round as round.py runs them
        all_finite(point)
        outer.message(point)
        all_finite(received)
        mix(point, [(weight, received)], out=outer.mixed_destination())
        point.copy_(outer.finish(point, outer.mixed_destination()))

    def fused() -> None:
        fused_message(point, outer.round_start, outer.anchor, eta, gamma, compiled=True)
        all_finite(received)
        fused_pair_finish(point, received, weight, outer.round_start, outer.anchor, gamma, compiled=True)

    receive_buffer = torch.empty_like(received)
    steps = {"eager": eager, "fused": fused, "copy": lambda: receive_buffer.copy_(received)}
    for count in threads:
        torch.set_num_threads(count)
        best = dict.fromkeys(steps, math.inf)
        for repeat in range(repeats + 1):  # repeat 0 warms up (and recompiles for a new thread count)
            for name, step in steps.items():
                _synchronize(device)
                begin = time.perf_counter()
                step()
                _synchronize(device)
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - begin)
        print(f"threads={count} numel={numel} device={device} "
              + " ".join(f"{name}_ms={seconds * 1e3:.2f}" for name, seconds in best.items()))


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    if "--cuda" in sys.argv:
        _benchmark(device="cuda", threads=(1,), numel=2**28)
    else:
        _benchmark()
