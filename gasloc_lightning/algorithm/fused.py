"""GASLoC's exact round (float32 messages, no overlap, anchored form, one peer) in two memory passes.

The round of :mod:`~gasloc_lightning.algorithm.round` reads and writes the model-size vectors in seven
separate kernels: a finite check of thetaH, two lerps for the message, a finite check of the peer's
u_j, the mix, the anchor update and the copy back into the live parameters. The two functions here
do the same math with the finite check of thetaH and the last three passes folded into one kernel each:

* :func:`fused_message`: u = z + gamma (z - x), z = theta + eta (thetaH - theta), over thetaH, and
  whether u is finite (one pass: reads thetaH, theta, x; writes u).
* :func:`fused_pair_finish`: theta' = u + w (u_j - u) into the point and the round start, and
  x' = theta' + gamma / (1 + gamma) (x - theta') (one pass: reads u, u_j, x; writes three).

Symbols: thetaH (``local_end``), theta (``round_start``), x (``anchor``), eta (``outer_lr``),
gamma (``outer_momentum``), w (``weight``), u_j (``received``), as in :mod:`.outer`.

Each runs one of two implementations with the same semantics:

* eager: exactly today's torch.lerp sequence (the same bits as OuterState.message, mix, finish);
* compiled: one torch.compile'd (inductor) kernel, C++ on CPU, Triton on CUDA. Both paths use
  torch.lerp's formula, ``start + w (end - start)`` for ``|w| < 0.5`` and ``end - (1 - w)(end - start)``
  otherwise; the compiled kernel contracts into FMAs and so differs from eager in the last bits
  (measured: at most 1.2e-7 of max|result| on random data).

:func:`enabled` picks the compiled kernel for vectors of at least ``MIN_COMPILED_NUMEL`` (2**20)
elements when torch.compile works; below that, compiling (seconds per process) buys nothing. The
environment variable ``GASLOC_FUSED_ROUND`` = ``0`` / ``1`` forces it off / on whatever the size;
an explicit ``compiled=`` argument wins over both. The first compile failure (no C++ compiler, an
unsupported platform) logs one warning, and the process stays eager from then on.

One compiled graph per function serves every size >= 2 (dynamic shapes) and every eta, gamma and
w (passed as a device tensor, not baked in as constants); vectors of 0 or 1 elements run eagerly,
since dynamo specializes those sizes. Inductor bakes the thread count into CPU kernels and dynamo
guards on it, so a change of ``torch.set_num_threads`` between rounds costs one recompile.
Compilation runs in this process (``compile_threads=1``): inductor's worker pool would outlive us.

Measured on a 10.8M-element float32 vector, CPU (2 cores, torch 2.13), best of 10 rounds:
``python -m gasloc_lightning.algorithm.fused`` (add ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`` for a
cold compile cache)

    torch threads   eager: 7 passes   fused: 2 kernels + 1 check   raw copy (clone)
    1               TBD               TBD                          TBD
    2               TBD               TBD                          TBD

First calls (both kernels, dynamo and inductor imports included): TBD cold cache, TBD warm.
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

from gasloc_lightning.algorithm.outer import validate_outer_hyperparameters

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
    if _use_compiled(compiled, local_end.numel()):
        coefficients = _scalars(local_end, outer_lr, 1.0 + outer_momentum)
        finite = _STATE.run("message", _message_kernel, local_end.view(-1), round_start.view(-1),
                            anchor.view(-1), coefficients)
        if finite is not _FAILED:
            return bool(finite)
    torch.lerp(round_start, local_end, outer_lr, out=local_end)  # z
    torch.lerp(anchor, local_end, 1.0 + outer_momentum, out=local_end)  # u
    return _all_finite(local_end)


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
    validate_outer_hyperparameters(1.0, outer_momentum, "anchored")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight (w_ij) must lie in [0, 1], got {weight!r}")
    _check_vectors(point=point, received=received, round_start=round_start, anchor=anchor)
    keep = outer_momentum / (1.0 + outer_momentum)
    if _use_compiled(compiled, point.numel()):
        coefficients = _scalars(point, weight, keep)
        vectors = (point.view(-1), received.view(-1), round_start.view(-1), anchor.view(-1))
        if _STATE.run("pair_finish", _pair_finish_kernel, *vectors, coefficients) is not _FAILED:
            return
    torch.lerp(point, received, weight, out=round_start)  # theta', as outer.mix
    torch.lerp(round_start, anchor, keep, out=anchor)  # x', as OuterState.finish
    point.copy_(round_start)


def enabled(numel: int, *, min_numel: int = MIN_COMPILED_NUMEL) -> bool:
    """Whether a round on ``numel`` elements runs the compiled kernels (when no ``compiled=`` is given).

    Yes when ``GASLOC_FUSED_ROUND`` is ``1`` or ``numel >= min_numel``, unless the variable is ``0``,
    the vector has fewer than 2 elements, torch.compile is unavailable, or a compile failed earlier.
    """
    forced = _forced()
    if forced is False:
        return False
    return (forced is True or numel >= min_numel) and _can_compile(numel)


# ---------------------------------------------------------------------- the compiled kernels
def _message_kernel(local_end: Tensor, round_start: Tensor, anchor: Tensor, coefficients: Tensor) -> Tensor:
    z = torch.lerp(round_start, local_end, coefficients[0])  # (N,)
    u = torch.lerp(anchor, z, coefficients[1])  # (N,)
    local_end.copy_(u)
    return torch.isfinite(u).all()  # () reduced in the same loop that writes u


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
                self._kernels[name] = torch.compile(kernel, dynamic=True, fullgraph=True)
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


def _use_compiled(compiled: bool | None, numel: int) -> bool:
    return enabled(numel) if compiled is None else compiled and _can_compile(numel)


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
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {tensor.dtype}")
        if tensor.shape != first.shape or tensor.device != first.device:
            raise ValueError(f"{name} must match {first_name}: shape {tuple(first.shape)} on {first.device}, "
                             f"got {tuple(tensor.shape)} on {tensor.device}")


def _all_finite(tensor: Tensor) -> bool:
    """As ``round.all_finite``: one read pass, no temporary (NaN and +-inf reach min or max)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


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
    start = time.perf_counter()
    fused_message(point, outer.round_start, outer.anchor, eta, gamma, compiled=True)
    fused_pair_finish(point, received, weight, outer.round_start, outer.anchor, gamma, compiled=True)
    print(f"first_call_s={time.perf_counter() - start:.2f} compiled={not _STATE.broken}")

    def eager() -> None:  # passes 1, 2, 4, 5, 6, 7 of the round as round.py runs them
        _all_finite(point)
        outer.message(point)
        _all_finite(received)
        mix(point, [(weight, received)], out=outer.mixed_destination())
        point.copy_(outer.finish(point, outer.mixed_destination()))

    def fused() -> None:
        fused_message(point, outer.round_start, outer.anchor, eta, gamma, compiled=True)
        _all_finite(received)
        fused_pair_finish(point, received, weight, outer.round_start, outer.anchor, gamma, compiled=True)

    steps = {"eager": eager, "fused": fused, "clone": received.clone}
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
    _benchmark(device="cuda" if "--cuda" in sys.argv else "cpu")
