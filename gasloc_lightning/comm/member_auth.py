"""Member authentication: before a quorum's first exchange, its members prove that they know the run's secret and
agree on one admitted set; a worker exchanges only with the members of that set.

torchft 0.2.0's lighthouse, stores and gloo group admit anyone who reaches their ports, so a quorum may hold a
member without the secret. Two phases run over the quorum's rendezvous store (the ``TCPStore`` prefix that
torchft's process group was just configured with: every member reached it moments before, and it is plain TCP,
so no gloo operation is ever left pending):

1. **Attest.** Each member writes ``HMAC(key, "attest", quorum id, the quorum's sorted replica ids, its index)``
   under a key whose name is itself a MAC of (quorum id, replica ids, index). The name hides nothing: any client
   of the store (no secret, not even a member) can list, read, overwrite and delete every key; but it cannot
   write an attestation that verifies, so its own cannot exist. A worker
   attests (:func:`attest`) as soon as the quorum's gloo group is configured, a rendezvous every member completes
   together before any heal, so a joiner healing over a slow link has attested long before its first exchange.
2. **Agree.** Each member waits for every member's attestation, or until its deadline. The first member to get
   there writes a signed decision, ``HMAC(key, "decision", quorum id, replica ids, admitted) || admitted``, with
   the store's atomic ``compare_set``: unless a store client deletes it, one decision is written for a quorum,
   and every member (the slow ones included, however late they arrive) reads that same decision. So honest
   members hold the *same* admitted set: an honest member that was too slow to attest is left out by every
   member alike (it then exchanges with nobody, reports, and the next quorum agrees again).
3. **Keep checking.** A deleted decision lets a later member write a second, validly signed one, so members
   could hold different sets. Each member reads the decision and its own attestation back at its first use and
   before each later exchange (:func:`still_agreed`): a vanished or changed decision, or a vanished attestation,
   is tampering (reported, the quorum's exchanges fail). And the quorum's gloo tags derive from the agreement (:meth:`MemberCheck.digest`,
   :func:`tag_base`), so members whose views differ never match each other's sends and receives: a timeout, a
   failed exchange, never gloo's abort on a message longer than the posted receive.

Why no nonce, as a challenge-response would have: an attestation names its quorum and the whole member list
(torchft's replica ids carry a fresh uuid per process) and its author's index, and an honest member only ever
attests itself. A recorded attestation therefore proves, anywhere it could be replayed, only the presence of the
process that wrote it, in the quorum it was written for. What is proven is the replica id, not the gloo connection
at that rank; a host that registers with an honest member's replica id could race it for that rank in the
(unauthenticated) rendezvous: ``docs/security.md`` lists that as not protected.

Any client of the store (its host, any member, any host that reaches its port) sees the key names and values and
can withhold, delete or swap them: it cannot forge an attestation or a decision, so at worst the members admit
fewer peers, or hold different views and fail the quorum's exchanges, which is reported every time. The keys of a
replaced quorum are left in the store: torchft builds each quorum's store prefix anew, and the store lives on
the quorum's first member, so they go when that process does (a few hundred bytes per quorum).

Nothing here imports Lightning.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from gasloc_lightning.comm.message_auth import context

log = logging.getLogger(__name__)

__all__ = ["TAG_SPAN", "MemberAuthenticator", "MemberCheck", "attest", "still_agreed", "tag_base", "verify_members"]

ATTESTATION_BYTES = 32
_LABEL = b"gasloc member-auth v2"
_KEY_PREFIX = "gasloc-member/"
_POLL_FIRST, _POLL_MAX = 0.01, 0.2  # seconds between looks at the store while members are missing (doubling)
_MAX_DECISION_BYTES = 32 + 8 * 4096  # a MAC and up to 4096 indices: anything longer is refused unparsed


class MemberAuthenticator:
    """The arithmetic of member authentication: attestations, the store's key names and the signed decision (no I/O).

    Args:
        secret: the run's secret (``GASLOC_ELASTIC_SECRET``); a key for this use is derived from it.
    """

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes (the run's secret; see docs/security.md)")
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest()

    def _mac(self, *parts: object) -> bytes:
        return hmac.digest(self._key, context(*parts), "sha256")

    def attestation(self, *, quorum_id: int, members: tuple[str, ...], index: int) -> bytes:
        """What member ``index`` writes to prove it knows the secret in this quorum."""
        return self._mac("attest", quorum_id, *members, index)

    def key_name(self, *, quorum_id: int, members: tuple[str, ...], index: int | None = None) -> str:
        """The store key of member ``index``'s attestation (``None``: of the quorum's decision); only a holder of
        the secret can name it."""
        what = "decision" if index is None else index
        return _KEY_PREFIX + self._mac("key", quorum_id, *members, what)[:16].hex()

    def seal_decision(self, *, quorum_id: int, members: tuple[str, ...], admitted: tuple[int, ...]) -> bytes:
        """The signed decision that ``admitted`` (sorted quorum indices) is this quorum's admitted set."""
        body = ",".join(str(index) for index in admitted).encode("ascii")
        return self._mac("decision", quorum_id, *members, body) + body

    def open_decision(self, value: bytes, *, quorum_id: int, members: tuple[str, ...]) -> tuple[int, ...] | None:
        """The admitted set of a decision read from the store, or ``None`` if it is not one this run signed."""
        if not isinstance(value, bytes) or not ATTESTATION_BYTES < len(value) <= _MAX_DECISION_BYTES:
            return None
        mac, body = value[:ATTESTATION_BYTES], value[ATTESTATION_BYTES:]
        if not hmac.compare_digest(mac, self._mac("decision", quorum_id, *members, body)):
            return None
        try:  # signed, so written by a member, but parsed defensively: a malformed body is refused, never raised
            admitted = tuple(int(part) for part in body.decode("ascii").split(","))
        except ValueError:  # UnicodeDecodeError included
            return None
        return admitted if list(admitted) == sorted(set(admitted)) and 0 <= admitted[0] and admitted[-1] < len(
            members) else None


@dataclass(frozen=True)
class MemberCheck:
    """The outcome of one quorum's member authentication, as quorum indices. ``admitted``: whom this worker exchanges
    with, its own index included (only its own when the agreed set leaves it out); ``refused``: the others;
    ``unanswered``: the refused members that did not attest in time (dead, stalled, slow, or without the secret)."""

    quorum_id: int
    admitted: tuple[int, ...]
    refused: tuple[int, ...]
    unanswered: tuple[int, ...] = ()
    left_out: bool = False  # this worker is not in the agreed set (or there is none): it exchanges with nobody
    decision: bytes = b""  # the signed decision agreed on (b"": none): its digest picks the quorum's gloo tags
    tampered: bool = False  # the decision or this worker's attestation vanished or changed in the store

    def digest(self, members: tuple[str, ...]) -> bytes:
        """What every member holding this same agreement (decision, quorum, members) derives alike: the quorum's
        gloo tags come from it (:func:`tag_base`), so members whose views differ never match each other's sends."""
        return hashlib.sha256(context("agreement", self.quorum_id, *members, self.decision,
                                      *self.admitted)).digest()


TAG_SPAN = 16  # gloo tags one agreement uses: tag_base(...) + 0 .. TAG_SPAN - 1 (comm/elastic_transport.py lists them)
_TAG_FLOOR, _TAG_SLOTS = 1 << 24, 1 << 26  # clear of torchft's PGTransport tags (1, 2, 3 + i); below 2**31


def tag_base(digest: bytes) -> int:
    """The first of :data:`TAG_SPAN` gloo tags for one agreement: a 26-bit slice of its digest, so two different
    agreements in one group pick the same tags with odds 2**-26, and a tag stays within gloo's (u)int32 range."""
    return _TAG_FLOOR + TAG_SPAN * (int.from_bytes(digest[:4], "big") % _TAG_SLOTS)


def attest(store: Any, *, quorum_id: int, members: tuple[str, ...], index: int,
           authenticator: MemberAuthenticator) -> None:
    """Write this worker's attestation for the quorum in its rendezvous ``store`` (idempotent). Done as soon as the
    quorum's group is configured, before any heal, so that a joiner healing over a slow link is not late for it."""
    store.set(authenticator.key_name(quorum_id=quorum_id, members=members, index=index),
              authenticator.attestation(quorum_id=quorum_id, members=members, index=index))


def verify_members(store: Any, *, quorum_id: int, members: tuple[str, ...], index: int,
                   authenticator: MemberAuthenticator, timeout: float) -> MemberCheck:
    """Attest this worker in the quorum's ``store`` and return the quorum's agreed admitted set.

    Args:
        store: the quorum's rendezvous store (``set``, ``get``, ``check``, ``compare_set`` of ``torch.distributed``).
        quorum_id: the quorum's id; members: its sorted replica ids; index: this worker's position in them.
        authenticator: holds the run's secret.
        timeout: seconds this worker waits for the others' attestations before it decides with those it has
            (a decision already written by another member is taken at once).

    A failing store (its host died) admits this worker alone: it exchanges with nobody in this quorum.
    """
    n, me = len(members), members[index]
    keys = [authenticator.key_name(quorum_id=quorum_id, members=members, index=peer) for peer in range(n)]
    decision_key = authenticator.key_name(quorum_id=quorum_id, members=members)
    try:
        if store is None:
            raise RuntimeError("the quorum's process group has no rendezvous store (not configured)")
        attest(store, quorum_id=quorum_id, members=members, index=index, authenticator=authenticator)
        value = _agree(store, keys, decision_key, time.monotonic() + timeout,
                       lambda: _decide(store, keys, authenticator, quorum_id, members, index))
    except Exception as error:  # noqa: BLE001 - a store that closed or timed out (DistStoreError, OSError, ...)
        log.warning("member authentication failed quorum_id=%d worker=%s error=%s", quorum_id, me.split(":")[0],
                    str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__)
        value = b""
    agreed = authenticator.open_decision(value, quorum_id=quorum_id, members=members)
    tampered = agreed is not None and not still_agreed(store, value, quorum_id=quorum_id, members=members,
                                                       index=index, authenticator=authenticator)
    if tampered:
        log.warning("member-auth keys tampered with quorum_id=%d worker=%s: the decision or this worker's "
                    "attestation vanished or changed in the store", quorum_id, me.split(":")[0])
        agreed = None
    admitted = agreed if agreed is not None and index in agreed else (index,)
    refused = tuple(peer for peer in range(n) if peer not in admitted)
    reason = ("no valid decision" if agreed is None else "not in the agreed set" if index in agreed
              else "this worker is not in the agreed set")
    for peer in refused:
        log.warning("member refused quorum_id=%d member=%s worker=%s reason=%s", quorum_id,
                    members[peer].split(":")[0], me.split(":")[0], reason)
    return MemberCheck(quorum_id=quorum_id, admitted=admitted, refused=refused, unanswered=refused,
                       left_out=agreed is None or index not in agreed, decision=value if agreed else b"",
                       tampered=tampered)


def still_agreed(store: Any, decision: bytes, *, quorum_id: int, members: tuple[str, ...], index: int,
                 authenticator: MemberAuthenticator) -> bool:
    """Whether the store still holds ``decision`` unchanged, and this worker's attestation (two store round trips:
    a ``check`` of both keys, a ``get`` of the decision; an attestation matters only until the decision is made).

    Any client of the rendezvous store (no secret needed) can list, delete or overwrite these keys; a deleted
    decision lets a later member write a second, validly signed one, so members could hold different admitted
    sets. A worker reads both back at its first use and before each exchange: a vanished or changed key is
    tampering (reported, the quorum's exchanges fail), and a store that fails the read counts as such too."""
    decision_key = authenticator.key_name(quorum_id=quorum_id, members=members)
    own_key = authenticator.key_name(quorum_id=quorum_id, members=members, index=index)
    try:
        if not store.check([decision_key, own_key]):
            return False
        return hmac.compare_digest(bytes(store.get(decision_key)), decision)
    except Exception:  # noqa: BLE001 - a store that closed or timed out
        return False


def _agree(store: Any, keys: list[str], decision_key: str, deadline: float, decide: Any) -> bytes:
    """The quorum's decision: the one already written, or this worker's once every member attested or the deadline
    passed (``compare_set`` writes it only if no other member's came first, and returns whichever is stored)."""
    pause = _POLL_FIRST
    while True:
        if store.check([decision_key]):
            return store.get(decision_key)
        if store.check(keys) or time.monotonic() >= deadline:
            return store.compare_set(decision_key, "", decide())
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, _POLL_MAX)


def _decide(store: Any, keys: list[str], authenticator: MemberAuthenticator, quorum_id: int,
            members: tuple[str, ...], index: int) -> bytes:
    """This worker's proposal: itself and every member whose attestation is in the store and checks."""
    def attested(peer: int) -> bool:
        expected = authenticator.attestation(quorum_id=quorum_id, members=members, index=peer)
        return store.check([keys[peer]]) and hmac.compare_digest(bytes(store.get(keys[peer])), expected)

    proven = [peer for peer in range(len(members)) if peer == index or attested(peer)]
    return authenticator.seal_decision(quorum_id=quorum_id, members=members, admitted=tuple(proven))
