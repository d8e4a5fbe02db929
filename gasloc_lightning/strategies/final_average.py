"""The elastic end-of-fit average as a two-phase commit, decided by the lighthouse: every survivor ends on one model.

Why not torchft's ``should_commit``: its vote runs among the ranks of one replica group, and every elastic
worker is a replica group of one process, so it cannot make the workers agree (torchft's docstring: "different
replica groups may return different values"). torchft makes replica groups agree through the step instead: a
group that did not commit is behind, and the next quorum heals it from one that did. The end-of-fit average does
the same, with a step of its own (:func:`~gasloc_lightning.comm.run_end.final_step`, far above any round count):

1. *prepare*: the all-reduce of the replicas over the quorum. A member whose all-reduce completed applies the
   average and records the final step; one whose all-reduce failed keeps its replica and its round count;
2. *decide*: every member asks for one more quorum. The lighthouse forms it from the survivors (a member that
   died is out once its heartbeat stops; a live one is waited for up to its join timeout, which the launcher
   keeps above ``gossip_timeout``, the longest a failed all-reduce takes), and its ``max_step`` is the decision,
   the same on every member:

   - at the final step: some member holds the committed average; torchft heals every member still behind from
     one that holds it (members whose all-reduce completed hold the same average: one collective's result). No
     collective follows that heal, so a source waits until its healers have fetched the average
     (:meth:`~gasloc_lightning.comm.membership.ElasticMembership.wait_for_healers`) before it goes on to leave;
   - below it: no member completed the all-reduce; the quorum averages again (from 1), until ``quorum_timeout``.

A worker that dies anywhere inside leaves the survivors on one model. What a member cannot learn is a model it
was cut off from: a survivor that finds the others committed and gone (it stalled past the join timeout) leaves
with :class:`~gasloc_lightning.comm.membership.RunEndedError` and its own replica, not as finished.

Fault points (:mod:`gasloc_lightning.comm.faults`, for tests): ``final_average.before_reduce``,
``final_average.after_reduce`` (``fail`` turns a completed all-reduce into a failed one on that worker, as a death
that cuts the collective short on some members only), ``final_average.after_commit``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gasloc_lightning.comm.faults import FaultPoints, InjectedFault
from gasloc_lightning.comm.membership import ElasticMembership, MembershipError, Quorum, RunEndedError
from gasloc_lightning.comm.run_end import final_step, is_final

log = logging.getLogger(__name__)

FAULT_POINTS = ("final_average.before_reduce", "final_average.after_reduce", "final_average.after_commit")


class FinalAverage:
    """One worker's part in the end-of-fit average (see the module docstring).

    Args:
        membership: this worker's membership (its quorum, its commit, the lighthouse).
        average_once: one all-reduce of the replicas over the current quorum, applied in place on success; returns
            whether it completed (on failure the replica must be left as it was).
        restore_own: put back the replica as it was before the last ``average_once`` (only a ``fail`` fault point
            after a completed all-reduce needs it).
        take_error: the failure of the last collective, if any (reported with the commit).
        leaving: whether this worker is leaving (SIGTERM): it then takes no further quorum.
        faults: the fault points this worker honours.
        quorum_formed: called after a deciding quorum that averages again, as after every quorum a worker trains or
            averages in (the lineage meeting: a worker healed into this quorum does the same).
    """

    def __init__(self, membership: ElasticMembership, *, average_once: Callable[[], bool],
                 restore_own: Callable[[], None], take_error: Callable[[], Exception | None],
                 leaving: Callable[[], bool], faults: FaultPoints, quorum_formed: Callable[[], None]) -> None:
        self._membership, self._average_once, self._restore_own = membership, average_once, restore_own
        self._take_error, self._leaving, self._faults = take_error, leaving, faults
        self._quorum_formed = quorum_formed

    def run(self, rounds: int) -> bool:
        """Average until the survivors agree; ``rounds``: the rounds done. Returns whether this worker holds the
        committed average (``False``: it keeps its own replica; the reason is logged)."""
        membership = self._membership
        deadline = time.monotonic() + membership.quorum_timeout
        committed_step = final_step(rounds, membership.run_tag)
        while True:
            prepared, error = self._prepare()
            membership.commit(committed_step if prepared else rounds, error)
            self._faults.hit("final_average.after_commit")
            if self._leaving():
                return prepared
            quorum = self._decide(prepared, rounds, deadline)
            if quorum is None or is_final(quorum.max_step):
                return prepared or (quorum is not None and quorum.healed)
            if time.monotonic() >= deadline:
                log.warning("end-of-fit average failed worker=%s: this worker keeps its own replica", membership.name)
                return False
            log.warning("end-of-fit average failed on every member worker=%s: averaging again over %s",
                        membership.name, ",".join(quorum.names))
            self._quorum_formed()

    def _decide(self, prepared: bool, rounds: int, deadline: float) -> Quorum | None:
        """Phase 2: the lighthouse's next quorum (``None``: none formed). A member behind is healed inside it; one
        whose heal failed asks again while the deadline allows: it gets the average if a member that holds it is
        still there, else it learns that the run ended without it (:class:`RunEndedError`)."""
        membership = self._membership
        while True:
            try:
                quorum = membership.start_quorum()
            except RunEndedError:
                raise  # committed without this worker: it cannot take that average any more
            except MembershipError as error:
                log.warning("no quorum to decide the end-of-fit average worker=%s prepared=%s: %s",
                            membership.name, prepared, error)
                return None
            if not is_final(quorum.max_step) or prepared or quorum.healed:
                if is_final(quorum.max_step):
                    log.info("end-of-fit average committed worker=%s quorum=%s%s", membership.name,
                             ",".join(quorum.names), "" if prepared else " (took it from a peer)")
                    membership.wait_for_healers(quorum)  # no collective follows: stay until they have the average
                return quorum
            log.warning("end-of-fit average committed but not received worker=%s: %s (asking again)",
                        membership.name, quorum.error)
            if time.monotonic() >= deadline:
                return None
            membership.commit(rounds, quorum.error)

    def _prepare(self) -> tuple[bool, Exception | None]:
        """Phase 1: whether this worker holds the average, and the failure to report with the commit."""
        self._faults.hit("final_average.before_reduce")
        completed = self._average_once()
        error = self._take_error()
        try:
            self._faults.hit("final_average.after_reduce")
        except InjectedFault as fault:
            if completed:
                log.warning("%s: this worker drops the completed average", fault)
                self._restore_own()
            return False, error or fault
        return completed, None if completed else error
