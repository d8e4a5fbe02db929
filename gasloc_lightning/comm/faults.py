"""Fault injection for tests: named points in the code where a worker dies or fails, at a fixed place, never by a timer.

A failure that depends on *when* a process is killed (a timer, a step count seen from outside) lands at a
different place on every machine. A fault point lands at the same place every time: the code calls
:meth:`FaultPoints.hit` with the point's name, and the environment variable ``GASLOC_FAULT_INJECT`` says what
happens there, on which worker::

    GASLOC_FAULT_INJECT="final_average.after_reduce=exit@worker_0002,final_average.after_reduce=fail@worker_0001"

Each entry is ``POINT=ACTION[@WORKER]`` (no worker: every worker). Actions:

- ``exit``: the process dies on the spot (``os._exit``: no cleanup, no goodbye to the peers, as a SIGKILL);
- ``fail``: the step at that point is reported as failed on this worker (:class:`InjectedFault`), as when a member's
  death cuts a collective short on some members and not on others.

This is a test hook: nothing in a normal run sets the variable, and an unset or empty variable costs one dict lookup
per point. A name that is not a known point is refused (:class:`ValueError`), so a typo cannot silently test nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

log = logging.getLogger(__name__)

FAULT_ENV = "GASLOC_FAULT_INJECT"
FAULT_EXIT_CODE = 86  # what a worker killed at a fault point exits with (recognisable in a launcher's table)
ACTIONS = ("exit", "fail")


class InjectedFault(RuntimeError):
    """The ``fail`` action at a fault point."""


class FaultPoints:
    """The fault points one worker honours.

    Args:
        spec: the ``GASLOC_FAULT_INJECT`` value (``None`` or empty: no fault).
        worker: this worker's member name (``worker_0002``), matched against ``@WORKER``.
        known: the point names the caller has; any other name in ``spec`` is refused.
    """

    def __init__(self, spec: str | None, *, worker: str, known: Iterable[str]) -> None:
        self.worker = worker
        self._actions: dict[str, str] = {}
        known = set(known)
        for entry in filter(None, (part.strip() for part in (spec or "").split(","))):
            point, sep, rest = entry.partition("=")
            action, _, target = rest.partition("@")
            if not sep or point not in known or action not in ACTIONS:
                raise ValueError(f"{FAULT_ENV}: {entry!r} is not POINT=ACTION[@WORKER] with POINT one of "
                                 f"{sorted(known)} and ACTION one of {list(ACTIONS)}")
            if not target or target == worker:
                self._actions[point] = action

    @classmethod
    def from_env(cls, *, worker: str, known: Iterable[str]) -> FaultPoints:
        return cls(os.environ.get(FAULT_ENV), worker=worker, known=known)

    @property
    def armed(self) -> bool:
        return bool(self._actions)

    def hit(self, point: str) -> None:
        """Reached ``point``: die, fail (:class:`InjectedFault`) or, for any point not armed here, nothing."""
        action = self._actions.get(point)
        if action is None:
            return
        log.warning("fault injection point=%s action=%s worker=%s", point, action, self.worker)
        if action == "exit":
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(FAULT_EXIT_CODE)
        raise InjectedFault(f"fault injected at {point} on {self.worker} ({FAULT_ENV})")
