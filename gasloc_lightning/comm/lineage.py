"""Lineage: which model history a worker carries, and what happens when two histories meet in one quorum.

A lineage is ``(round, token)``: the last round r the worker committed, and a token naming the quorum that
committed it, a hash of torchft's quorum id and its members' ids. Member ids carry torchft's per-process uuid,
so two quorums that trained apart (the two sides of a partition, or two lighthouses, or a lighthouse restarted
with its quorum ids counting from 0 again) never share a token. All members of one quorum commit a round under
the same token: one lineage. A member healed from a peer takes the peer's lineage with its state (the lineage
is part of the strategy's state, so a checkpoint resumes it too).

When a quorum forms whose members come from several lineages, they end on one model, by a fixed rule:

1. members behind (fewer committed rounds) are healed by torchft from a member at the quorum's ``max_step``
   before anything else happens: **the further lineage wins** (this is torchft's own rule). A worker tells a
   diverged side from a mere laggard by the healer's recent history (the last ``HISTORY`` rounds and their
   tokens travel with the state): if the healer committed this worker's last round under another token, the
   two had split, and the replacement is logged at WARNING and counted as a merge
   (:meth:`LineageTracker.healed`);
2. members at the same round but with different tokens (two sides that trained apart equally long): **the
   sides are averaged**, an all-reduce mean of the exchanged tensors over the whole quorum, so each side weighs
   as many members as it has (:meth:`LineageTracker.reconcile`). Every member then carries the merged lineage
   (the new quorum's token), the merge is logged at WARNING with the groups, and counted
   (``elastic/lineage_merges``).

Finding out costs one all-reduce of 3 integers per member, and only when the quorum's id changed since this
worker's last meeting (a member joined, left or failed): a quorum whose members are unchanged is one lineage.
Every member of a quorum reaches the same decision from the same gathered lineages, so the merge's all-reduce
runs on all of them or on none.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.membership import Quorum

log = logging.getLogger(__name__)

HISTORY = 32  # rounds of (round, token) a worker remembers, and hands over with its state


class LineageExchangeError(RuntimeError):
    """The all-reduce that gathers the members' lineages failed (a member died or hung)."""


@dataclass(frozen=True)
class Lineage:
    """A model history: the last committed ``round`` and the ``token`` of the quorum that committed it."""

    round: int
    token: int

    def __str__(self) -> str:
        return f"round {self.round} token {self.token:016x}"


def quorum_token(quorum: Quorum) -> int:
    """A 62-bit name for ``quorum`` (its id and its members' ``name:uuid`` ids): identical on every member."""
    text = f"{quorum.quorum_id}|{','.join(quorum.members)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2


@dataclass(frozen=True)
class LineageMeeting:
    """The lineages of one quorum's members (index i: member i; ``None``: a refused member) and what was done."""

    quorum: Quorum
    lineages: tuple[Lineage | None, ...]
    merged: bool = False

    @property
    def groups(self) -> dict[Lineage, list[str]]:
        """Each lineage present -> the members (names) that carried it."""
        groups: dict[Lineage, list[str]] = {}
        for name, lineage in zip(self.quorum.names, self.lineages):
            if lineage is None:  # refused by member authentication: not part of the meeting
                continue
            groups.setdefault(lineage, []).append(name)
        return groups

    @property
    def diverged(self) -> bool:
        return len(self.groups) > 1

    def describe(self) -> str:
        return " | ".join(f"{','.join(names)} ({lineage})" for lineage, names in self.groups.items())


def gather_lineages(transport: ElasticTransport, quorum: Quorum, mine: Lineage) -> tuple[Lineage | None, ...]:
    """Every admitted member's lineage, in member order (``None`` for a member refused by member authentication: it
    is sent nothing): an all-gather written as a sum of int64 rows (row i is member i's, the others contribute
    zeros) over the members this worker exchanges with. :class:`LineageExchangeError` if the sum fails."""
    rows = torch.zeros(quorum.size, 3, dtype=torch.int64)
    rows[quorum.index] = torch.tensor([1, mine.round, mine.token])  # column 0: "this row was written"
    try:
        admitted = transport.all_reduce_sum(rows.view(-1))
    except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError, torchft's wrapper others
        raise LineageExchangeError(f"lineage exchange over {quorum.size} workers failed: {error}") from error
    for index in admitted:
        written, round_index, token = rows[index].tolist()
        # An admitted member may still be dishonest (or torn): a row it cannot have written honestly is refused
        # rather than taken into the history that tells a split from a laggard. Its round is at most the quorum's
        # max_step (the most rounds any member committed; no meeting is held at the end-of-fit step), its token a
        # quorum_token (62 bits).
        if written != 1 or not 0 <= round_index <= quorum.max_step or not 0 <= token < 1 << 62:
            raise LineageExchangeError(
                f"lineage exchange over {quorum.size} workers: member {index} gave written={written} "
                f"round={round_index} token={token} (expected written=1, 0 <= round <= max_step={quorum.max_step}, "
                "0 <= token < 2^62)")
    return tuple(Lineage(int(r), int(t)) if i in admitted else None for i, (_, r, t) in enumerate(rows.tolist()))


class LineageTracker:
    """One worker's lineage: set at each commit, taken with a peer's state, merged when lineages meet."""

    def __init__(self) -> None:
        self.lineage = Lineage(0, 0)
        self.merges = 0  # meetings of diverged lineages this worker took part in (each ended on one model)
        self._met_quorum: int | None = None  # the quorum id of this worker's last meeting
        self._history: list[Lineage] = [Lineage(0, 0)] * HISTORY  # the last rounds committed, oldest first

    def committed(self, round_index: int, quorum: Quorum) -> None:
        """Round ``round_index`` was committed in ``quorum``."""
        self.lineage = Lineage(round_index, quorum_token(quorum))
        self._history = [*self._history[1:], self.lineage]

    def healed(self, before: Lineage, worker: str) -> bool:
        """After taking a peer's state (and lineage): whether this worker's own lineage ``before`` had split from the
        peer's (the peer committed the same round under another token). Such a heal is a merge: logged, counted."""
        theirs = {lineage.round: lineage.token for lineage in self._history if lineage.round > 0}
        if before.round == 0 or theirs.get(before.round, before.token) == before.token:
            return False  # a fresh worker, a laggard of the same lineage, or too far behind to tell
        self.merges += 1
        log.warning("lineage replaced worker=%s: its side (%s) had split from the healing peer's (%s at that "
                    "round, now %s); the further side wins", worker, before, Lineage(before.round,
                                                                                   theirs[before.round]), self.lineage)
        return True

    def needs_meeting(self, quorum: Quorum) -> bool:
        """Whether ``quorum`` may hold several lineages: usable, of 2 or more, and not the quorum last met in."""
        return quorum.usable and quorum.size > 1 and quorum.quorum_id != self._met_quorum

    def reconcile(self, quorum: Quorum, transport: ElasticTransport, point: Tensor) -> LineageMeeting | None:
        """Gather the members' lineages (if :meth:`needs_meeting`); if they differ, average ``point`` (the exchanged
        tensors, in place) over the quorum. ``None`` when no meeting was needed.

        Raises :class:`LineageExchangeError` if the gathering failed (nothing changed; the next quorum meets again).
        A failed average leaves ``point`` as it was, the meeting not ``merged``, and the lineages apart until then.
        """
        if not self.needs_meeting(quorum):
            return None
        lineages = gather_lineages(transport, quorum, self.lineage)
        self._met_quorum = quorum.quorum_id
        meeting = LineageMeeting(quorum, lineages)
        if not meeting.diverged:
            return meeting
        log.warning("lineages meet worker=%s quorum_id=%d groups=%s: averaging the sides over the quorum",
                    transport.membership.name, quorum.quorum_id, meeting.describe())
        backup = point.clone()
        try:
            transport.all_reduce_mean(point)
        except ElasticCollectiveError as error:
            point.copy_(backup)
            self._met_quorum = None  # still apart: meet again in the next quorum
            log.warning("lineage merge failed worker=%s: %s (the sides stay apart until the next quorum)",
                        transport.membership.name, error)
            return meeting
        rounds = {lineage.round for lineage in lineages if lineage is not None}
        self.lineage = Lineage(max(rounds), quorum_token(quorum))
        self._history = [*self._history[1:], self.lineage]  # the merged token names that round from now on
        self.merges += 1
        log.warning("lineages merged worker=%s quorum_id=%d into %s (%d sides averaged)", transport.membership.name,
                    quorum.quorum_id, self.lineage, len(meeting.groups))
        return LineageMeeting(quorum, lineages, merged=True)

    def state_dict(self) -> list[list[int]]:
        """The last ``HISTORY`` committed rounds as ``[round, token]`` pairs, oldest first (a fixed length, so a
        peer's state has the same structure as this worker's)."""
        return [[lineage.round, lineage.token] for lineage in self._history]

    def load_state_dict(self, state: Any) -> None:
        """A checkpoint's or a peer's lineage (a checkpoint written before lineages existed has none: kept as is)."""
        if state is None:
            return
        if (not isinstance(state, list) or len(state) != HISTORY or not all(
                isinstance(pair, list) and len(pair) == 2 and all(type(v) is int and v >= 0 for v in pair)
                for pair in state)):
            raise ValueError(f"lineage must be {HISTORY} [round, token] pairs (ints >= 0), got {state!r}")
        self._history = [Lineage(*pair) for pair in state]
        self.lineage = self._history[-1]
