"""Member authentication: a worker proves to every quorum member that it knows the run's secret before the
first exchange with it, and exchanges only with the members that proved it to it.

torchft 0.2.0's lighthouse, stores and gloo group admit anyone who reaches their ports, so a quorum may hold
a member without the secret. Before a quorum's first exchange, every pair of members runs one mutual
challenge over the quorum's own gloo group (so what is proven is the peer at that rank, on the connection
later exchanges use):

1. each sends the other a fresh 32-byte nonce;
2. each answers ``HMAC(key, quorum_id, prover id, verifier id, verifier's nonce, prover's nonce)`` (ids are
   torchft's replica ids ``name:uuid`` in the quorum's sorted member list);
3. each checks the answer it received in constant time.

The answer names prover and verifier, so it proves nothing anywhere else: not reflected back to its sender,
not relayed to a third member, not replayed in another quorum (a fresh nonce, the quorum id). A member that
answers wrongly, not at all within the deadline, or not in the expected shape is *refused* for the whole
quorum: nothing of this worker's model is ever sent to it, and nothing it sends is read. A member that did not
answer may be an honest one that was slow (a stall, a long heal): the transport reports that as a failed
exchange, once per member set, so the next quorum (a new id) challenges again; a wrong answer is not reported (the
quorum stays). No wait of the challenge ever times out on the group: on gloo that would close every connection of
the group, and one silent member would make the honest ones refuse each other (see :func:`_exchange`). What happens then
(:mod:`~gasloc_lightning.comm.elastic_transport`): a gossip round draws its pairs over the admitted members
only; an all-reduce runs as a ring over the admitted members (point to point on the same group: gloo's own
all-reduce would hand the refused member partial sums). Every honest member refuses the intruder, so the
admitted lists agree; if they disagree (a member died mid-challenge) the round's exchange fails, is
reported, and the next quorum challenges again.

Nothing here imports Lightning.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from gasloc_lightning.comm.message_auth import context

log = logging.getLogger(__name__)

__all__ = ["MemberAuthenticator", "MemberCheck", "verify_members"]

NONCE_BYTES = 32
RESPONSE_BYTES = 32
# Point-to-point tags on the quorum's group: torchft's PGTransport uses 1, 2, 3+i, the gossip message 1000.
NONCE_TAG, RESPONSE_TAG = 1001, 1002
_LABEL = b"gasloc member-auth v1"


class MemberAuthenticator:
    """The challenge's arithmetic: nonces, answers and their check (no I/O).

    Args:
        secret: the run's secret (``GASLOC_ELASTIC_SECRET``); a key for this use is derived from it.
    """

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes (the run's secret; see docs/security.md)")
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest()

    @staticmethod
    def nonce() -> bytes:
        return secrets.token_bytes(NONCE_BYTES)

    def answer(self, *, quorum_id: int, prover: str, verifier: str, verifier_nonce: bytes,
               prover_nonce: bytes) -> bytes:
        """What ``prover`` sends ``verifier`` to prove it knows the secret in quorum ``quorum_id``."""
        return hmac.digest(self._key, context(quorum_id, prover, verifier, verifier_nonce, prover_nonce), "sha256")

    def check(self, answer: bytes, *, quorum_id: int, prover: str, verifier: str, verifier_nonce: bytes,
              prover_nonce: bytes) -> bool:
        expected = self.answer(quorum_id=quorum_id, prover=prover, verifier=verifier,
                               verifier_nonce=verifier_nonce, prover_nonce=prover_nonce)
        return hmac.compare_digest(expected, answer)


@dataclass(frozen=True)
class MemberCheck:
    """The outcome of one quorum's challenges, as quorum indices (this worker's own is admitted). ``unanswered``:
    the refused members that sent no well-formed answer in time (dead, stalled, or slow: maybe honest)."""

    quorum_id: int
    admitted: tuple[int, ...]
    refused: tuple[int, ...]
    unanswered: tuple[int, ...] = ()


def verify_members(pg: Any, *, quorum_id: int, members: tuple[str, ...], index: int,
                   authenticator: MemberAuthenticator, timeout: float) -> MemberCheck:
    """Challenge every other member of the quorum over ``pg`` (ranks = indices in ``members``); returns who is
    admitted and who is refused. Each of the two steps waits at most ``timeout`` seconds, the second from when
    the first ended: a silent member spends the first step's deadline on every member alike, and the members
    that did answer still have a whole deadline to exchange their answers, on connections that the silent
    member's deadline left open (no gloo wait times out: :func:`_exchange`)."""
    me, deadline = members[index], time.monotonic() + timeout
    peers = [peer for peer in range(len(members)) if peer != index]
    mine = {peer: authenticator.nonce() for peer in peers}
    theirs = {peer: torch.zeros(NONCE_BYTES, dtype=torch.uint8) for peer in peers}
    ok = _exchange(pg, peers, {peer: _as_tensor(mine[peer]) for peer in peers}, theirs, NONCE_TAG, deadline)
    answers = {peer: torch.zeros(RESPONSE_BYTES, dtype=torch.uint8) for peer in ok}
    proofs = {peer: _as_tensor(authenticator.answer(
        quorum_id=quorum_id, prover=me, verifier=members[peer], verifier_nonce=bytes(theirs[peer].numpy()),
        prover_nonce=mine[peer])) for peer in ok}
    answered = _exchange(pg, ok, proofs, answers, RESPONSE_TAG, time.monotonic() + timeout)
    admitted = [peer for peer in answered if authenticator.check(
        bytes(answers[peer].numpy()), quorum_id=quorum_id, prover=members[peer], verifier=me,
        verifier_nonce=mine[peer], prover_nonce=bytes(theirs[peer].numpy()))]
    refused = tuple(peer for peer in peers if peer not in admitted)
    for peer in refused:
        log.warning("member refused quorum_id=%d member=%s worker=%s reason=%s", quorum_id,
                    members[peer].split(":")[0], me.split(":")[0],
                    "wrong answer" if peer in answered else "no answer in time")
    return MemberCheck(quorum_id=quorum_id, admitted=tuple(sorted([index, *admitted])), refused=refused,
                       unanswered=tuple(peer for peer in refused if peer not in answered))


def _exchange(pg: Any, peers: list[int], outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor],
              tag: int, deadline: float) -> list[int]:
    """Send ``outgoing[p]`` to and receive ``incoming[p]`` from every peer at once; the peers that completed by
    ``deadline``.

    Why threads and not ``work.wait(timeout)``: on gloo a wait that times out closes *every* connection of the
    group ("Application timeout caused pair closure"), so one silent member would cut the honest members off from
    each other; and a gloo send/recv reports ``is_completed()`` only once waited on, so it cannot be polled. Each
    peer's pair is waited on by a daemon thread with a long timeout (:data:`LEFTOVER_WAIT`); this call returns at
    the deadline and leaves a silent peer's pair pending in its thread. Harmless: that peer is refused, so nothing
    else of this group is ever sent to it or read from it (a late message of its lands in the abandoned buffer),
    the honest members use other tags on this group, and torchft builds a new group (a new gloo context, new
    connections) at the next quorum. The thread, and the old group it holds, go when the message arrives, the
    connection closes, or :data:`LEFTOVER_WAIT` passes (that timeout then closes the old group's connections:
    if its quorum is still in use by then, its exchanges fail, are reported, and the next quorum challenges
    again)."""
    done: list[int] = []
    threads = []
    for peer in peers:
        try:  # every receive and send posted before any wait, receive first (see elastic_transport.post)
            pair = [pg.recv([incoming[peer]], peer, tag), pg.send([outgoing[peer]], peer, tag)]
        except Exception as error:  # noqa: BLE001 - an unconfigured group raises AssertionError
            log.debug("challenge not posted peer=%d: %s", peer, error)
            continue
        thread = threading.Thread(target=_wait_pair, args=(pair, peer, done), daemon=True,
                                  name=f"member-auth-wait-{peer}")
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _DONE_LOCK:
        return [peer for peer in peers if peer in done]


LEFTOVER_WAIT = timedelta(hours=6)  # how long an abandoned challenge op stays posted (see _exchange)
_DONE_LOCK = threading.Lock()


def _wait_pair(pair: list[Any], peer: int, done: list[int]) -> None:
    try:
        for work in pair:
            work.wait(LEFTOVER_WAIT)
    except Exception as error:  # noqa: BLE001 - a closed connection, a size mismatch, the leftover timeout
        log.debug("challenge failed peer=%d: %s", peer, error)
        return
    with _DONE_LOCK:
        done.append(peer)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
