"""The quantized all-reduce mean over a process group, blocking or asynchronous (Streaming DiLoCo's overlap).

:class:`~gasloc_lightning.algorithm.round.EncodedMean` holds the arithmetic (as torchft's
``allreduce_quantized``): each worker encodes its vector in n chunks, an all-to-all hands the owner of
chunk c every worker's encoding of it, the owner decodes, sums in worker order, divides by n and encodes
the mean again, and an all-gather hands every worker every chunk's mean. Here the chunks travel:

- :class:`EncodedAllReduce`: one set of buffers and the three phases (encode, exchange, decode);
  :meth:`~gasloc_lightning.comm.transport.GossipTransport.all_reduce_mean_encoded` runs them in a row.
- :class:`AsyncEncodedMean`: the same phases with the exchange (all-to-all, the owner's reduction,
  all-gather) and the decoding on a worker thread, so that a fragment's mean is *posted* where its
  pseudo-gradient leaves and *waited on* where it lands, the inner steps in between running meanwhile.
  torchft gets this from a CUDA stream; the host-side chain needs a thread on CPU (gloo), and the
  reduction between the two collectives makes a single ``async_op`` work handle impossible.

Why a process group of its own: the worker thread posts the all-gather when the all-to-all has
arrived, a moment that differs between ranks. Collectives on one group must be posted in the same
order on every rank, so the training thread's own collectives (buffer averages, consensus evaluation,
Lightning's) would interleave differently on each rank. On a dedicated group only the worker thread
posts, one mean after the other in the order the training thread posted them (the same on every rank).

The bits are those of the blocking mean: the same :class:`EncodedMean` steps on the same buffers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.algorithm.round import EncodedMean


class EncodedAllReduce:
    """The buffers and phases of one quantized all-reduce of ``numel`` elements over ``workers`` ranks.

    Args:
        message_codec: a lossy codec (``int8``, ``int4``, ``fp8``, ``bfloat16``).
        numel: elements of the averaged vector.
        workers: n, the size of the group it runs over.
        device: where the buffers live.
    """

    def __init__(self, message_codec: str, numel: int, workers: int, device: torch.device) -> None:
        self.mean = EncodedMean(message_codec, numel, workers)
        codec, chunk = self.mean.codec, self.mean.chunk
        self._padded = torch.zeros(self.mean.padded, device=device)
        self._send = codec.new_wire(chunk, workers, device=device)
        self._received = codec.new_wire(chunk, workers, device=device)
        self._gathered = codec.new_wire(chunk, workers, device=device)
        self._scratch = torch.empty(chunk, device=device)
        self._total = torch.empty(chunk, device=device)

    @property
    def volume(self) -> int:
        """Bytes each worker sends (and receives): 2 (n - 1) encoded chunks, as a ring all-reduce of the wire."""
        return 2 * (self.mean.workers - 1) * self.mean.chunk_wire

    def encode(self, tensor: Tensor) -> None:
        """Phase 1: this worker's vector into its n encoded chunks (``tensor`` is read now, not later)."""
        self.mean.encode_chunks(tensor, self._padded, self._send)

    def exchange(self, group: dist.ProcessGroup | None) -> None:
        """Phase 2: the all-to-all, the reduction of the chunk this worker owns, the all-gather of the means."""
        dist.all_to_all_single(self._received, self._send, group=group)
        own = self.reduce_owned()
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(self._gathered.view(-1), own, group=group)

    # The wires of phase 2, for a transport that moves them itself (the elastic quorum's point-to-point exchange,
    # comm/elastic_encoded_mean.py): row c of ``outgoing`` is this worker's encoding of chunk c, row j of
    # ``incoming`` worker j's encoding of the chunk this worker owns, row c of ``gathered`` chunk c's mean.
    @property
    def outgoing(self) -> Tensor:
        return self._send

    @property
    def incoming(self) -> Tensor:
        return self._received

    @property
    def gathered(self) -> Tensor:
        return self._gathered

    def reduce_owned(self) -> Tensor:
        """The owned chunk's mean from ``incoming`` (every row arrived), encoded into ``outgoing[0]`` (free once
        sent), which it returns."""
        own = self._send[0]
        self.mean.reduce_chunk(self._received, own, self._scratch, self._total)
        return own

    def decode(self, out: Tensor) -> Tensor:
        """Phase 3: every chunk's mean into ``out``."""
        return self.mean.decode_all(self._gathered, self._padded, out)


@dataclass
class PendingEncodedMean:
    """A mean posted with :meth:`AsyncEncodedMean.post`; ``tensor`` holds it once :meth:`AsyncEncodedMean.wait`
    has returned (and must not be read or written before)."""

    tensor: Tensor
    future: Future
    volume: int  # bytes this worker sends (and receives) for it
    _buffers: EncodedAllReduce | None = None
    _key: tuple[str, int] | None = None


class AsyncEncodedMean:
    """Quantized all-reduce means that run under compute: post now, wait later (see the module docstring).

    The training thread encodes at :meth:`post` (the vector is read there) and gets a handle back at once; a
    worker thread runs the all-to-all, the reduction, the all-gather and the decoding into the same tensor,
    one mean after the other in posting order, on this object's own process group. :meth:`wait` returns when
    the tensor holds the mean. Each in-flight mean has buffers of its own; they are reused once waited on.

    On failure: a collective that fails or outlasts the group's timeout raises in :meth:`wait`; ``wait`` itself
    gives up after ``timeout`` seconds from the call (a hung peer), with :class:`TimeoutError`.

    Args:
        group: the dedicated process group (build it with :func:`dedicated_group`), None in a world of one.
        timeout: seconds :meth:`wait` waits for a mean before it raises.
        device: where the buffers live.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, timeout: float, device: torch.device) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.group, self.timeout, self.device = group, float(timeout), device
        self._free: dict[tuple[str, int], list[EncodedAllReduce]] = {}
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def post(self, tensor: Tensor, message_codec: str) -> PendingEncodedMean:
        """Encode ``tensor`` and start its mean over the group; returns at once. ``tensor`` receives the mean."""
        key = (message_codec, tensor.numel())
        free = self._free.setdefault(key, [])
        buffers = free.pop() if free else EncodedAllReduce(message_codec, tensor.numel(), self.world_size,
                                                           self.device)
        buffers.encode(tensor)
        pending = PendingEncodedMean(tensor, Future(), buffers.volume, buffers, key)
        self._start_thread()
        self._jobs.put((lambda: self._run(buffers, tensor), pending.future))
        return pending

    def _run(self, buffers: EncodedAllReduce, tensor: Tensor) -> None:
        buffers.exchange(self.group)
        buffers.decode(tensor)

    def wait(self, pending: PendingEncodedMean) -> Tensor:
        """Block until ``pending``'s mean is in its tensor (at most ``timeout`` seconds); returns the tensor."""
        if pending._buffers is None:
            return pending.tensor  # waited on already
        try:
            pending.future.result(timeout=self.timeout)
        except FutureTimeout as error:
            raise TimeoutError(f"a quantized all-reduce did not complete within {self.timeout:g}s of waiting (a "
                               "peer stalled or died)") from error
        self._free[pending._key].append(pending._buffers)
        pending._buffers = None
        return pending.tensor

    def done(self, pending: PendingEncodedMean) -> bool:
        """Whether ``pending``'s mean has arrived (waiting on it would not block)."""
        return pending.future.done()

    def close(self) -> None:
        """Let the worker thread end once the means already posted are done (it is a daemon: a hung collective
        does not keep the process alive)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="gasloc-encoded-mean",
                                            daemon=True)
            self._thread.start()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The worker thread: run each job in order, its outcome into its future; ``None`` ends it."""
    while (job := jobs.get()) is not None:
        run, future = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            run()
        except BaseException as error:  # handed to the waiting thread, which raises it
            future.set_exception(error)
        else:
            future.set_result(None)


def dedicated_group(rank_lists: Sequence[Sequence[int]], rank: int, *, timeout: float,
                    backend: str | None = None) -> dist.ProcessGroup | None:
    """A new process group for each list of ``rank_lists`` (a collective: every rank of the world calls it with
    the same lists, in the same order); returns the one holding ``rank`` (None if none does).

    Args:
        rank_lists: the groups' global ranks, e.g. ``[range(world_size)]``, or one list per shard.
        rank: this process's global rank.
        timeout: seconds a collective on the group may take before it raises.
        backend: the group's backend (default: the world's).
    """
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout), backend=backend)
        if rank in ranks:
            mine = group
    return mine
