"""The quantized mean of the elastic DiLoCo: over the live quorum's admitted members, posted and waited on.

The same bits as :class:`~gasloc_lightning.algorithm.round.EncodedMean` (and the static transport's blocking
and asynchronous forms, :mod:`~gasloc_lightning.comm.encoded_mean`): each admitted member encodes its vector in
n chunks (n: the admitted members), the owner of chunk c receives every member's encoding of it, decodes them,
sums in member order, divides by n and encodes the mean again, and every member receives every chunk's mean.

What differs is how the chunks travel. torchft's process group spans the whole quorum, and member
authentication (:mod:`~gasloc_lightning.comm.member_auth`) may admit only some of its members: so the all-to-all
and the all-gather are point-to-point sends and receives between admitted members (each posted before any is
waited on, as the gossip exchange does), each chunk tagged with a keyed hash when messages are authenticated
(:mod:`~gasloc_lightning.comm.message_auth`, as the ring all-reduce's chunks are). Each member sends and receives
2 (n - 1) encoded chunks: the volume of a ring all-reduce of the encoded vector.

Posted and waited on (torchft's quantized all-reduce returns a work that is waited on where the fragment
lands): :meth:`ElasticEncodedMean.post` encodes on the calling thread and runs the exchange and the decoding on
a thread of its own; :meth:`ElasticEncodedMean.wait` returns the mean. The caller posts nothing else on the
process group while a mean is in flight (collectives on one group must be posted in the same order on every
member): the elastic DiLoCo posts after the round's last step but one and waits after its last step, and waits
before any consensus evaluation that falls in between.

On failure (a member that died or hung, a chunk whose tag fails, fewer admitted members than the quorum's
floor): :meth:`~ElasticEncodedMean.wait` counts it once as a failed round exchange on the transport
(``comm/failed_exchanges``; a bad tag also in ``comm/unauthentic_messages``), keeps the first error for the
membership's commit, and raises :class:`~gasloc_lightning.comm.elastic_transport.ElasticCollectiveError`, as
the float32 all-reduce does. A member that dies before it has sent its chunk's mean to every other member fails
the mean of every member that has not received it; the exchange has one deadline, ``gossip_timeout`` from
posting.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gasloc_lightning.algorithm.round import EncodedMean
from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.encoded_mean import EncodedAllReduce
from gasloc_lightning.comm.message_auth import TAG_BYTES, MessageAuthenticator, context, tag_bytes, tag_tensor
from gasloc_lightning.comm.ring import UnauthenticMessageError, wait_all

__all__ = ["ENCODED_CHUNK", "ENCODED_TAG", "ElasticEncodedMean", "PendingElasticMean", "QuantizedRoundMean"]

# Offsets of this mean's gloo tags from the quorum agreement's tag base (``ElasticTransport.gloo_tag``: the gossip
# and the ring use 0-3): members whose views of the agreement differ never match each other's sends and receives.
ENCODED_CHUNK, ENCODED_TAG = 4, 5


@dataclass
class PendingElasticMean:
    """A mean posted with :meth:`ElasticEncodedMean.post`; ``tensor`` holds it once waited on (not read or written
    before)."""

    tensor: Tensor
    future: Future
    deadline: float  # time.monotonic() by which every chunk must have arrived
    members: int  # n, the admitted members it averages over
    volume: int  # bytes this member sends (and receives)
    _buffers: EncodedAllReduce | None = field(default=None, repr=False)
    _failure: Exception | None = field(default=None, repr=False)  # raised again by a second wait, not recounted


class ElasticEncodedMean:
    """Quantized means over an :class:`~gasloc_lightning.comm.elastic_transport.ElasticTransport`'s quorum.

    Args:
        transport: the worker's elastic transport (its membership, admitted members, timeout, counters).
        message_codec: a lossy codec :class:`~gasloc_lightning.algorithm.round.EncodedMean` takes (``int8``,
            ``int4``, ``fp8``, ``bfloat16``).
    """

    def __init__(self, transport: ElasticTransport, message_codec: str) -> None:
        self.check_codec(message_codec)
        self.transport, self.message_codec = transport, message_codec
        self._free: dict[tuple[int, int], EncodedAllReduce] = {}  # (numel, n): buffers of a mean waited on
        self._means = 0  # means posted in this quorum, bound into the tags (no replay across them)
        self._quorum_key: tuple | None = None

    @staticmethod
    def check_codec(message_codec: str) -> str:
        """``message_codec`` if a quantized mean takes it; ValueError (naming the argument) for float32, int2 and
        sparse codecs, as :class:`~gasloc_lightning.algorithm.round.EncodedMean` refuses them."""
        try:
            EncodedMean(message_codec, 1, 1)
        except ValueError as error:
            raise ValueError(f"message_codec={message_codec!r}: {error}") from None
        return message_codec

    def mean(self, tensor: Tensor, round_index: int) -> Tensor:
        """The blocking form: :meth:`post` then :meth:`wait`."""
        return self.wait(self.post(tensor, round_index))

    def post(self, tensor: Tensor, round_index: int) -> PendingElasticMean:
        """Encode ``tensor`` (read now) and start its mean over the admitted members; returns at once. ``tensor``
        receives the mean (see :meth:`wait`). Member authentication, if any, runs here, on the calling thread."""
        transport = self.transport
        quorum = transport.membership.quorum
        deadline = time.monotonic() + transport.timeout
        future: Future = Future()
        try:
            if not quorum.usable:
                raise RuntimeError(f"unusable quorum: {quorum.error}")
            ring = transport.admitted()
            least = max(2, getattr(transport.membership, "min_workers", 1))
            if len(ring) < least:
                raise RuntimeError(f"only {len(ring)} of the quorum's {quorum.size} members admitted (at least "
                                   f"{least} needed): the others were refused or did not answer their challenge")
        except Exception as error:  # noqa: BLE001 - reported by wait(), like a failed exchange
            future.set_exception(error)
            return PendingElasticMean(tensor, future, deadline, 0, 0)
        key = (quorum.quorum_id, quorum.members)
        if key != self._quorum_key:
            self._quorum_key, self._means = key, 0
        self._means += 1
        buffers = self._free.pop((tensor.numel(), len(ring)), None) or EncodedAllReduce(
            self.message_codec, tensor.numel(), len(ring), tensor.device)
        buffers.encode(tensor)
        use = context("encoded-mean", quorum.quorum_id, *quorum.members, transport.agreement_digest, round_index,
                      self._means)
        tags = (transport.gloo_tag(ENCODED_CHUNK), transport.gloo_tag(ENCODED_TAG))
        job = (transport.membership.process_group, buffers, ring, quorum.index, deadline, transport.message_auth,
               use, tags, tensor)
        threading.Thread(target=_run, args=(future, job), name="gasloc-elastic-encoded-mean", daemon=True).start()
        return PendingElasticMean(tensor, future, deadline, len(ring), buffers.volume, buffers)

    def done(self, pending: PendingElasticMean) -> bool:
        """Whether ``pending``'s mean has ended (waiting on it would not block)."""
        return pending.future.done()

    def wait(self, pending: PendingElasticMean) -> Tensor:
        """Block until ``pending``'s mean is in its tensor; returns it. On failure counts it (once) and raises
        :class:`~gasloc_lightning.comm.elastic_transport.ElasticCollectiveError` (``tensor`` is then undefined:
        callers restore it)."""
        transport = self.transport
        if pending._failure is not None:
            raise pending._failure
        try:
            # The thread's sends and receives end by the deadline; the margin covers its decoding and hashing.
            pending.future.result(timeout=max(0.0, pending.deadline - time.monotonic()) + transport.timeout)
        except Exception as error:  # noqa: BLE001 - a failed or late member, a bad tag, too few members
            if isinstance(error, FutureTimeout):
                error = TimeoutError(f"the quantized mean did not end {transport.timeout:g}s after its deadline")
            if isinstance(error, UnauthenticMessageError):
                transport.unauthentic_messages += 1
            transport.failed_exchanges += 1
            transport.error = transport.error or error
            pending._buffers = None  # the thread may still hold them: never reused
            first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            pending._failure = ElasticCollectiveError(f"quantized mean over {max(pending.members, 1)} workers "
                                                      f"failed: {first_line}")
            raise pending._failure from error
        if pending._buffers is not None:
            self._free[(pending.tensor.numel(), pending.members)] = pending._buffers
            pending._buffers = None
            transport.counters.bytes_sent += pending.volume
            transport.counters.bytes_received += pending.volume
            transport.counters.exchanges += 1
        return pending.tensor


def _run(future: Future, job: tuple) -> None:
    """The mean's thread: the exchange and the decoding, the outcome into ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        exchange_encoded(*job[:-1])
        job[1].decode(job[-1])
    except BaseException as error:  # handed to the waiting thread, which raises it
        future.set_exception(error)
    else:
        future.set_result(None)


def exchange_encoded(pg: Any, buffers: EncodedAllReduce, ring: tuple[int, ...], rank: int, deadline: float,
                     authenticator: MessageAuthenticator | None, use: bytes, tags: tuple[int, int]) -> None:
    """Phase 2 of :class:`~gasloc_lightning.comm.encoded_mean.EncodedAllReduce` between the members ``ring``
    (sorted quorum indices, ``rank`` among them), point to point: every encoded chunk to its owner, the owner's
    reduction, every chunk's mean to every member, on the gloo ``tags`` (chunks, their keyed hashes). Raises
    ``RuntimeError`` on a failed or late operation, :class:`~gasloc_lightning.comm.ring.UnauthenticMessageError` on a
    chunk whose tag fails."""
    position = ring.index(rank)
    incoming = buffers.incoming
    incoming[position].copy_(buffers.outgoing[position])  # this member's own share of the chunk it owns
    _swap(pg, {q: buffers.outgoing[q] for q in range(len(ring)) if q != position},
          {q: incoming[q] for q in range(len(ring)) if q != position}, ring, position, deadline, authenticator,
          (use, "scatter"), tags)
    own = buffers.reduce_owned()
    gathered = buffers.gathered
    gathered[position].copy_(own)
    _swap(pg, {q: own for q in range(len(ring)) if q != position},
          {q: gathered[q] for q in range(len(ring)) if q != position}, ring, position, deadline, authenticator,
          (use, "gather"), tags)


def _swap(pg: Any, outgoing: dict[int, Tensor], incoming: dict[int, Tensor], ring: tuple[int, ...], position: int,
          deadline: float, authenticator: MessageAuthenticator | None, where: tuple, tags: tuple[int, int]) -> None:
    """Send ``outgoing[q]`` to member q and receive ``incoming[q]`` from it, for every q (ring positions), every
    operation posted before any is waited on (the receives first); then check the tags."""
    me = ring[position]
    chunk_tag, hash_tag = tags
    works, tags_in = [], {}
    for q in sorted(incoming):
        works.append(pg.recv([incoming[q]], ring[q], chunk_tag))
        if authenticator is not None:
            tags_in[q] = torch.zeros(TAG_BYTES, dtype=torch.uint8)
            works.append(pg.recv([tags_in[q]], ring[q], hash_tag))
    for q in sorted(outgoing):
        works.append(pg.send([outgoing[q]], ring[q], chunk_tag))
    if authenticator is not None:  # hashed while the chunks travel
        for q in sorted(outgoing):
            tag = tag_tensor(authenticator.tag(outgoing[q], context(*where, me, ring[q])))
            works.append(pg.send([tag], ring[q], hash_tag))
    failure = wait_all(works, deadline)
    if failure is not None:
        raise RuntimeError(f"quantized mean ({where[1]}) failed: {failure}") from failure
    for q, tag in tags_in.items():
        if not authenticator.verify(incoming[q], context(*where, ring[q], me), tag_bytes(tag)):
            raise UnauthenticMessageError(f"the encoded chunk from quorum member {ring[q]} ({where[1]}) failed its tag")


class QuantizedRoundMean:
    """The elastic DiLoCo's round mean with a lossy codec: each member's message u_i (its outer step's point, see
    ``docs/algorithm.md`` section 2) becomes ``round_start + mean_j(u_j - round_start)``, the difference sent
    encoded by :class:`ElasticEncodedMean`.

    Why the difference to the round start, and why the first round of a quorum is exact: encoding the point itself
    would cost the model its low bits every round; the difference is a pseudo-gradient (with the momentum's share),
    which a codec keeps well, as DiLoCo's quantized all-reduce does. It equals ``mean(u_j)`` only when every member
    holds the same round start. After a successful mean they do (the same bits plus the same bits), but a new
    quorum does not guarantee it: a failed round leaves each member its own point, a joiner or a merged lineage
    brings another. So the first round of every quorum (and the round after a rejected mean) is the exact float32
    all-reduce of u, which brings the members together, and the next rounds of that quorum are quantized. Every
    member of a quorum takes the same path: all of them meet the quorum together (a failure reported at a commit
    makes a new quorum).

    The mean can be posted at a prepare point (:meth:`post`) and is applied later (:meth:`apply`); in between only
    this object's thread may use the process group, so :meth:`drain` must run before any other collective.

    Args:
        transport: the worker's elastic transport.
        message_codec: the lossy codec (``int8``, ``int4``, ``fp8``, ``bfloat16``).
        num_parameters: elements of the exchanged vector that are parameters (the rest, buffers, are averaged in
            float32 where the mean is applied).
    """

    def __init__(self, transport: ElasticTransport, message_codec: str, num_parameters: int) -> None:
        self.means = ElasticEncodedMean(transport, message_codec)
        self.transport, self.num_parameters = transport, int(num_parameters)
        self._synced: tuple | None = None  # the quorum whose members hold this member's round start
        self._pending: PendingElasticMean | None = None
        self._failure: ElasticCollectiveError | None = None  # a drained mean's failure, raised where it is applied
        self._delta: Tensor | None = None
        self.exact_rounds = 0  # rounds that took the exact float32 all-reduce (first of a quorum)
        self.quantized_rounds = 0

    def _quorum_key(self) -> tuple:
        quorum = self.transport.membership.quorum
        return (quorum.quorum_id, quorum.members)

    @property
    def quantized(self) -> bool:
        """Whether this round's mean is quantized (this quorum's members share the round start)."""
        return self._synced is not None and self._synced == self._quorum_key()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def post(self, message: Tensor, round_start: Tensor, round_index: int) -> bool:
        """The prepare point: start the mean of ``message - round_start`` (parameters; read now). Returns whether
        it was posted: not in a round that must be exact, nor twice, nor for a non-finite message (the round's
        apply point then takes the blocking path, whose guards apply)."""
        if not self.quantized or self._pending is not None:
            return False
        if self._delta is None or self._delta.shape != round_start.shape:
            self._delta = torch.empty_like(round_start)
        torch.sub(message, round_start, out=self._delta)
        if not bool(torch.isfinite(self._delta).all()):
            return False
        self._pending, self._failure = self.means.post(self._delta, round_index), None
        return True

    def drain(self) -> None:
        """Wait for a mean in flight without applying it (before another collective on the group); a failure is
        counted now and raised where the mean is applied."""
        if self._pending is None or self._failure is not None or self._pending._buffers is None:
            return
        try:
            self.means.wait(self._pending)
        except ElasticCollectiveError as error:
            self._failure = error

    def apply(self, message: Tensor, round_start: Tensor, round_index: int) -> Tensor:
        """The apply point: ``message`` (u | buffers, in place) becomes the round's mean over the quorum. Raises
        :class:`~gasloc_lightning.comm.elastic_transport.ElasticCollectiveError` if a member failed (``message``
        is then undefined: callers restore it)."""
        params, buffers = message[: self.num_parameters], message[self.num_parameters:]
        key = self._quorum_key()
        try:
            if self._pending is None and not (self.quantized and self.post(params, round_start, round_index)):
                self.transport.all_reduce_mean(message, round_exchange=True)  # exact: the members meet
                self.exact_rounds += 1
            else:
                pending, self._pending = self._pending, None
                if self._failure is not None:
                    failure, self._failure = self._failure, None
                    raise failure
                self.means.wait(pending)
                torch.add(round_start, pending.tensor, out=params)
                if buffers.numel():
                    self.transport.all_reduce_mean(buffers, round_exchange=True)
                self.quantized_rounds += 1
        except ElasticCollectiveError:
            self._synced = None
            raise
        self._synced = key if bool(torch.isfinite(message).all()) else None  # a rejected mean: the next is exact
        return message

    check_codec = staticmethod(ElasticEncodedMean.check_codec)
