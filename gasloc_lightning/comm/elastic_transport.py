"""ElasticTransport: :class:`~gasloc_lightning.comm.transport.GossipTransport`'s interface over torchft's process group.

Ranks are indices in the current quorum's sorted member list (:class:`~gasloc_lightning.comm.membership.Quorum`).
Unlike the static transport, an exchange that fails does not raise: a peer that died fails fast
("Connection closed by peer"), a hung one once the exchange's single deadline has passed
(``gossip_timeout`` from posting, whatever the number of peers, so a worker asks for the next quorum
at most that late), and either way this worker keeps its own point for that peer's share (the failed
peer is left out of the received list) and the failure is counted once, in :attr:`failed_exchanges`
(a round's exchange, DiLoCo's all-reduce included) or :attr:`failed_collectives` (the other
all-reduces: consensus evaluation, the end-of-fit average). The first error of a round is kept in
:attr:`error` for the membership to report after the round's collectives.

Authentication (``docs/security.md``): with a :class:`~gasloc_lightning.comm.member_auth.MemberAuthenticator`,
the quorum's members attest and agree on one admitted set before its first exchange (:meth:`ElasticTransport.admitted`,
over the quorum's rendezvous store: no gloo operation); a refused
member is never sent or read anything (:attr:`refused_members` counts refusals), and an all-reduce then runs as
a ring over the admitted members (:mod:`~gasloc_lightning.comm.ring`). With a
:class:`~gasloc_lightning.comm.message_auth.MessageAuthenticator`, every message and ring chunk travels with a
keyed tag; one whose tag fails is dropped like a failed exchange and counted in :attr:`unauthentic_messages`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gasloc_lightning.comm.member_auth import (MemberAuthenticator, MemberCheck, attest, still_agreed, tag_base,
                                               verify_members)
from gasloc_lightning.comm.membership import ElasticMembership
from gasloc_lightning.comm.message_auth import TAG_BYTES, MessageAuthenticator, context, tag_bytes, tag_tensor
from gasloc_lightning.comm.ring import UnauthenticMessageError, ring_all_reduce_sum
from gasloc_lightning.comm.transport import PendingExchange, TrafficCounters, ring_all_reduce_bytes

log = logging.getLogger(__name__)

# torchft's PGTransport uses tags 1, 2, 3+i on the same process group. Ours are tag_base(agreement digest) + these
# offsets: members whose views of the quorum's agreement differ (a store edited by an attacker) use different tags,
# so their sends never match each other's receives (a timeout, a failed exchange) instead of a size mismatch
# (gloo aborts the receiving process on a message longer than the posted receive).
# (The elastic DiLoCo's quantized mean, comm/elastic_encoded_mean.py, uses offsets 4 and 5; the two-level shard
# exchange, comm/elastic_regions.py, 6 and 7; TAG_SPAN is 16.)
_GOSSIP, _GOSSIP_TAG, _RING_CHUNK, _RING_TAG = 0, 1, 2, 3
# The two-level round's rings (chunk, tag), one pair per kind: a member that failed one collective and went on to the
# next never posts a receive that a neighbour's chunk of another size (still in the first) would overrun, which makes
# gloo abort the receiving process; it times out instead.
CHANNELS = {"control": (8, 9), "copy": (10, 11), "mean": (12, 13), "gather": (14, 15)}


class ElasticCollectiveError(RuntimeError):
    """An all-reduce over the quorum failed (a member died or hung)."""


class ElasticTransport:
    """Point-to-point exchanges and all-reduces over the live quorum; failures are counted, not raised.

    Args:
        numel: elements of one message.
        membership: the worker's membership (its process group is reconfigured at every quorum change).
        device: where buffers live (CPU: torchft's gloo group).
        member_auth: authenticates the quorum's members before its first exchange (``None``: trusts them). Each
            attests as soon as the quorum's group is configured (a rendezvous all members complete together, before
            any heal: :meth:`ElasticMembership.on_quorum_group`), and waits for the others' attestations at most
            ``gossip_timeout``, what any exchange allows a peer.
        message_auth: tags every message and checks every received one (``None``: no tags).
    """

    def __init__(self, numel: int, membership: ElasticMembership, device: torch.device | None = None, *,
                 member_auth: MemberAuthenticator | None = None,
                 message_auth: MessageAuthenticator | None = None) -> None:
        self.numel, self.membership = numel, membership
        self.device = torch.device("cpu") if device is None else device
        self.dtype = torch.float32
        self.timeout = membership.gossip_timeout
        self.counters = TrafficCounters()
        self.failed_exchanges = 0
        self.failed_collectives = 0
        self.error: Exception | None = None
        self._receive_buffers: list[Tensor] = []
        self._tag_buffers: list[Tensor] = []
        self.member_auth, self.message_auth = member_auth, message_auth
        self.refused_members = 0  # members left out of the agreed admitted set (once per member and quorum)
        self.unauthentic_messages = 0  # received messages or ring chunks whose tag failed (dropped)
        self.tampered_agreements = 0  # quorums whose member-auth keys vanished or changed in the store (reported)
        self._quorum_key: tuple | None = None  # the quorum the two below belong to
        self._check: MemberCheck | None = None
        self._collectives = 0  # all-reduces in this quorum: bound into the ring's tags (no replay across them)
        self._silent_reported: set[tuple[str, ...]] = set()  # member sets whose silent members were reported
        self._digest = b""  # the quorum's agreement digest: its gloo tags and the ring's tag context come from it
        if member_auth is not None and hasattr(membership, "on_quorum_group"):  # attest as each quorum's group forms
            membership.on_quorum_group(self._attest)

    @property
    def rank(self) -> int:
        return self.membership.quorum.index

    @property
    def world_size(self) -> int:
        return self.membership.quorum.size

    def admitted(self) -> tuple[int, ...]:
        """The quorum indices this worker exchanges with (its own included): every member, or with member
        authentication the set the quorum's members agreed on (run at the quorum's first call:
        :func:`~gasloc_lightning.comm.member_auth.verify_members`): the same on every member in it."""
        quorum = self.membership.quorum
        key = (quorum.quorum_id, quorum.members)
        if key != self._quorum_key:
            self._quorum_key, self._check, self._collectives = key, None, 0
            self._digest = hashlib.sha256(context("agreement", quorum.quorum_id, *quorum.members)).digest()
        if self.member_auth is None or not quorum.usable or quorum.size <= 1:
            return tuple(range(quorum.size))
        store = getattr(self.membership.process_group, "quorum_store", None)
        if self._check is None:
            self._check = verify_members(store, quorum_id=quorum.quorum_id, members=quorum.members,
                                         index=quorum.index, authenticator=self.member_auth, timeout=self.timeout)
            self.refused_members += len(self._check.refused)
            self._digest = self._check.digest(quorum.members)
            if self._check.tampered:
                self.tampered_agreements += 1
        elif self._check.decision and not still_agreed(store, self._check.decision, quorum_id=quorum.quorum_id,
                                                       members=quorum.members, index=quorum.index,
                                                       authenticator=self.member_auth):
            log.warning("member-auth keys tampered with quorum_id=%d worker=%s: the agreed decision or this "
                        "worker's attestation vanished or changed in the store", quorum.quorum_id,
                        self.membership.name)
            self.tampered_agreements += 1  # this quorum's exchanges fail from now on: it exchanges with nobody
            self._check = MemberCheck(quorum_id=quorum.quorum_id, admitted=(quorum.index,),
                                      refused=tuple(i for i in range(quorum.size) if i != quorum.index),
                                      left_out=True, tampered=True)
            self._digest = self._check.digest(quorum.members)
        least = max(2, getattr(self.membership, "min_workers", 1) or 1)
        if self._check.tampered:  # reported at every use: never a quiet worker training alone
            self.error = self.error or RuntimeError(
                f"{self.membership.name}: this quorum's member-auth keys were tampered with in the rendezvous "
                "store (a decision or attestation vanished or changed): its exchanges fail")
        elif self._check.left_out:  # an honest member is never left out for good: the next quorum agrees again
            self.error = self.error or RuntimeError(
                f"{self.membership.name} is not in this quorum's agreed member set (it attested too late)")
        elif self._check.unanswered and (len(self._check.admitted) < least
                                         or quorum.members not in self._silent_reported):
            # Maybe an honest member that was slow: reported (the next quorum agrees again). Once per member set
            # while enough members remain admitted (a member that never attests, an intruder, would else cost a
            # new quorum every round); at every use when fewer than max(2, min_workers) remain: a worker must
            # never quietly train alone.
            self._silent_reported.add(quorum.members)
            missing = ",".join(quorum.names[i] for i in self._check.unanswered)
            self.error = self.error or RuntimeError(
                f"not in this quorum's agreed member set (no attestation in time): {missing}")
        return self._check.admitted

    @property
    def agreement_digest(self) -> bytes:
        """The digest of this quorum's agreement as this worker sees it (after :meth:`admitted`): bound into the
        tags' contexts and the gloo tags of every exchange in the quorum."""
        return self._digest

    def gloo_tag(self, offset: int) -> int:
        """The gloo tag of one use (``_GOSSIP`` ...) in this quorum under its agreement (see :func:`tag_base`)."""
        return tag_base(self._digest) + offset

    def _attest(self, store: Any, quorum_id: int, members: tuple[str, ...], index: int) -> None:
        attest(store, quorum_id=quorum_id, members=members, index=index, authenticator=self.member_auth)

    def take_error(self) -> Exception | None:
        """The first failure since the last call (for the membership's commit), then forget it."""
        error, self.error = self.error, None
        return error

    def receive_buffer(self, slot: int) -> Tensor:
        while len(self._receive_buffers) <= slot:
            self._receive_buffers.append(torch.empty(self.numel, dtype=self.dtype, device=self.device))
        return self._receive_buffers[slot]

    def tag_buffer(self, slot: int) -> Tensor:
        while len(self._tag_buffers) <= slot:
            self._tag_buffers.append(torch.zeros(TAG_BYTES, dtype=torch.uint8))
        return self._tag_buffers[slot]

    def post(self, message: Tensor, peers: Mapping[int, float], round_index: int, clock: float | None = None
             ) -> PendingExchange:
        """Start sending ``message`` to every peer (quorum indices) and receiving theirs; returns at once
        (with message authentication, once this worker's tags are computed, while the messages travel)."""
        if clock is not None:
            raise ValueError("ElasticTransport carries no simulated clock")
        pending = PendingExchange(round_index=round_index, peers=dict(peers), deadline=time.monotonic() + self.timeout)
        pg, quorum = self.membership.process_group, self.membership.quorum
        admitted = self.admitted() if peers and quorum.usable else ()
        tagged: list[tuple[int, list[Any]]] = []  # the peers whose message went out: their tag follows
        for slot, peer in enumerate(sorted(peers)):
            pending.received.append((peers[peer], self.receive_buffer(slot)))
            if not quorum.usable:
                pending.works.append((peer, [_FailedWork(RuntimeError(f"unusable quorum: {quorum.error}"))]))
                continue
            if peer not in admitted:  # refused (not in the agreed set): nothing is sent to it or read from it
                refused = RuntimeError("refused member (not in the agreed admitted set)")
                pending.works.append((peer, [_FailedWork(refused)]))
                continue
            try:  # every receive and send is posted before any wait (a triangle cannot deadlock); the receive
                # first, so both directions flow at once (see transport._RECV_FIRST)
                gossip = self.gloo_tag(_GOSSIP)
                works = [pg.recv([self.receive_buffer(slot)], peer, gossip), pg.send([message], peer, gossip)]
                if self.message_auth is not None:
                    works.append(pg.recv([self.tag_buffer(slot)], peer, self.gloo_tag(_GOSSIP_TAG)))
                    tagged.append((peer, works))
            except Exception as error:  # an unconfigured group raises AssertionError
                works = [_FailedWork(error)]
            pending.works.append((peer, works))
        if tagged:
            leaves = self.message_auth.leaves(message)  # hashed once for every peer
            for peer, works in tagged:
                tag = tag_tensor(self.message_auth.seal(leaves, self._gossip_use(round_index, quorum.index, peer)))
                try:
                    works.append(pg.send([tag], peer, self.gloo_tag(_GOSSIP_TAG)))
                except Exception as error:  # noqa: BLE001
                    works.append(_FailedWork(error))
        return pending

    def _gossip_use(self, round_index: int, sender: int, receiver: int) -> bytes:
        quorum = self.membership.quorum
        return context("gossip", quorum.quorum_id, self._digest, round_index, quorum.members[sender],
                       quorum.members[receiver])

    def complete(self, pending: PendingExchange) -> tuple[list[tuple[float, Tensor]], list[int]]:
        """Wait for each peer; returns the ``(w_ij, u_j)`` pairs and the peers that completed.

        A failed peer, or one whose message's tag fails, is left out (this worker keeps its own point for its
        share) and counted.
        """
        received, completed = [], []
        for slot, ((peer, works), pair) in enumerate(zip(pending.works, pending.received)):
            failure = self._wait_all(works, pending.deadline)
            if failure is None and self.message_auth is not None:
                failure = self._check_tag(pair[1], slot, pending.round_index, peer)
            if failure is None:
                received.append(pair)
                completed.append(peer)
                self._count_bytes(pair[1], 1)
                continue
            self.failed_exchanges += 1
            self.error = self.error or failure
            log.warning("exchange failed round=%d peer=%s worker=%s error=%s", pending.round_index,
                        self.membership.quorum.names[peer], self.membership.name, _first_line(failure))
        pending.works = []
        if completed:
            self.counters.exchanges += 1
        return received, completed

    def _check_tag(self, message: Tensor, slot: int, round_index: int, peer: int) -> Exception | None:
        use = self._gossip_use(round_index, peer, self.membership.quorum.index)
        if self.message_auth.verify(message, use, tag_bytes(self.tag_buffer(slot))):
            return None
        self.unauthentic_messages += 1
        return UnauthenticMessageError("the message's tag failed (dropped, not mixed in)")

    @staticmethod
    def _wait_all(works: list[Any], deadline: float | None) -> Exception | None:
        failure = None
        for work in works:  # wait for every op even after a failure: none is left half posted
            try:
                if deadline is None:
                    work.wait()
                else:  # what is left of the exchange's one deadline (0 would mean gloo's own timeout)
                    work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except Exception as error:
                failure = failure or error
        return failure

    def _count_bytes(self, tensor: Tensor, messages: int) -> None:
        num_bytes = tensor.numel() * tensor.element_size() * messages
        self.counters.bytes_sent += num_bytes
        self.counters.bytes_received += num_bytes

    def all_reduce_mean(self, tensor: Tensor, *, round_exchange: bool = False) -> Tensor:
        """In-place mean over the quorum's admitted members; :class:`ElasticCollectiveError` if a member failed
        (``tensor`` is then undefined: callers restore it). A failure is counted once: in :attr:`failed_exchanges`
        when the all-reduce is a round's exchange (``round_exchange``, DiLoCo), else in :attr:`failed_collectives`.
        Fewer than ``max(2, min_workers)`` admitted members is such a failure: a "mean" over this worker alone (the
        others refused or silent) must not pass for an average (the end-of-fit average would commit it).

        gloo's all-reduce when every member is admitted and messages carry no tags; else a ring over the admitted
        members (:func:`~gasloc_lightning.comm.ring.ring_all_reduce_sum`), each chunk tagged if asked."""
        if self.world_size <= 1:
            return tensor
        try:
            ring = self._all_reduce_sum(tensor, least=max(2, getattr(self.membership, "min_workers", 1)))
        except Exception as error:
            self.count_failure(error, round_exchange=round_exchange)
            raise ElasticCollectiveError(f"all-reduce over {self.world_size} workers failed: "
                                         f"{_first_line(error)}") from error
        tensor.div_(len(ring))
        volume = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), len(ring))
        self.counters.bytes_sent += volume
        self.counters.bytes_received += volume
        self.counters.exchanges += 1
        return tensor

    def count_failure(self, error: Exception, *, round_exchange: bool) -> None:
        """Count one failed collective: a round's exchange in :attr:`failed_exchanges`, another in
        :attr:`failed_collectives` (a tag that failed also in :attr:`unauthentic_messages`); the round's first error
        is kept for the commit."""
        if isinstance(error, UnauthenticMessageError):
            self.unauthentic_messages += 1
        if round_exchange:
            self.failed_exchanges += 1
        else:
            self.failed_collectives += 1
        self.error = self.error or error

    def all_reduce_sum(self, tensor: Tensor, members: tuple[int, ...] | None = None, *, channel: str | None = None,
                       least: int = 1, deadline: float | None = None) -> tuple[int, ...]:
        """In-place sum of ``tensor`` (contiguous, 1-D) over the admitted members, or over those of them in ``members``
        (quorum indices, this worker's own among them: a ring over that subset alone, e.g. one region), neither
        counted as an exchange nor as a failure here (the caller decides and counts the bytes); returns the quorum
        indices that took part. ``RuntimeError`` if one of them failed or fewer than ``least`` are admitted
        (``tensor`` is then undefined).

        Args:
            channel: a ring on that channel's own gloo tags (:data:`CHANNELS`), never gloo's all-reduce.
            deadline: ``time.monotonic()`` by which it must be done (default: ``gossip_timeout`` from now).
        """
        if channel is not None and channel not in CHANNELS:
            raise ValueError(f"channel must be one of {sorted(CHANNELS)} or None, got {channel!r}")
        return self._all_reduce_sum(tensor, least=least, members=members, channel=channel, deadline=deadline)

    def _all_reduce_sum(self, tensor: Tensor, *, least: int = 1, members: tuple[int, ...] | None = None,
                        channel: str | None = None, deadline: float | None = None) -> tuple[int, ...]:
        """Sum ``tensor`` in place over the admitted members (those in ``members`` if given); returns them.
        ``RuntimeError`` when fewer than ``least`` are admitted (a mean over this worker alone is no average: it
        must not pass for one)."""
        from torch.distributed import AllreduceOptions, ReduceOp

        quorum = self.membership.quorum
        if not quorum.usable:
            raise RuntimeError(f"unusable quorum: {quorum.error}")
        ring = self.admitted()
        if members is not None:
            ring = tuple(index for index in ring if index in members)
        self._collectives += 1
        if len(ring) < least:
            raise RuntimeError(f"only {len(ring)} of the quorum's {quorum.size} members admitted (at least {least} "
                               "needed): the others were refused or did not attest in time")
        if len(ring) <= 1:
            return ring
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        if self.message_auth is None and members is None and channel is None and len(ring) == quorum.size:
            options = AllreduceOptions()
            options.reduceOp = ReduceOp.SUM
            self.membership.process_group.allreduce([tensor], options).wait(
                timedelta(seconds=max(0.001, deadline - time.monotonic())))
        else:
            chunk, tag = CHANNELS[channel] if channel is not None else (_RING_CHUNK, _RING_TAG)
            ring_all_reduce_sum(self.membership.process_group, tensor, ring=ring, rank=quorum.index,
                                deadline=deadline, authenticator=self.message_auth,
                                use=context("all-reduce", quorum.quorum_id, *quorum.members, self._digest,
                                            self._collectives, channel or "ring"),
                                tags=(self.gloo_tag(chunk), self.gloo_tag(tag)))
        return ring


class _FailedWork:
    """A send or receive that could not even be posted."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self._error


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
