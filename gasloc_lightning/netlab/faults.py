"""Network faults on the lab's links, fired at a training step and lifted after a number of seconds.

``netlab.faults`` entries (STEP: the furthest live worker's step, as ``elastic.chaos`` counts it):

- ``partition:SITE@STEP:SECONDS``: SITE's link goes down, and comes back SECONDS later;
- ``flap:SITE@STEP:SECONDS``: SITE's link goes down and up every ``flap_period_s`` for SECONDS, then stays up;
- ``slow:SITE@STEP:SECONDS:MBIT``: both directions of SITE's links are capped at MBIT Mbit/s for SECONDS.

:class:`FaultSchedule` is driven by polls (:meth:`FaultSchedule.poll` with the current step and time), so it needs
no thread of its own; :meth:`FaultSchedule.lift_all` restores every link (the run ended, or failed, mid-fault).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

ACTIONS = ("partition", "flap", "slow")
_FAULT = re.compile(r"^(partition|flap|slow):(\d+)@(\d+):(\d+(?:\.\d+)?)(?::(\d+(?:\.\d+)?))?$")


class _Links(Protocol):
    def set_link(self, site: int, up: bool) -> None: ...
    def throttle(self, site: int, mbit: float | None) -> None: ...


@dataclass(frozen=True)
class Fault:
    """One fault: ``action`` on ``site``'s link at ``step`` for ``seconds`` (``slow``: down to ``mbit``)."""

    action: str
    site: int
    step: int
    seconds: float
    mbit: float | None = None

    def __str__(self) -> str:
        suffix = f":{self.mbit:g}" if self.action == "slow" else ""
        return f"{self.action}:{self.site}@{self.step}:{self.seconds:g}{suffix}"


def parse_faults(entries: list[str], sites: int) -> list[Fault]:
    """Parse and check ``netlab.faults`` for a lab of ``sites`` sites (sorted by step, stable within a step)."""
    faults = []
    for entry in entries:
        match = _FAULT.match(str(entry).strip())
        if match is None:
            raise ValueError(f"netlab.faults entry {entry!r}: expected partition:SITE@STEP:SECONDS, "
                             "flap:SITE@STEP:SECONDS or slow:SITE@STEP:SECONDS:MBIT")
        action, site, step, seconds, mbit = match.groups()
        if int(site) >= sites:
            raise ValueError(f"netlab.faults entry {entry!r}: site {site} does not exist (the preset has {sites})")
        if (action == "slow") != (mbit is not None):
            raise ValueError(f"netlab.faults entry {entry!r}: only slow takes :MBIT, and it needs it")
        if float(seconds) <= 0 or (mbit is not None and float(mbit) <= 0):
            raise ValueError(f"netlab.faults entry {entry!r}: SECONDS and MBIT must be > 0")
        faults.append(Fault(action, int(site), int(step), float(seconds), None if mbit is None else float(mbit)))
    return sorted(faults, key=lambda fault: fault.step)


@dataclass
class _Active:
    fault: Fault
    ends_at: float
    link_up: bool = False  # flap: the link's state now
    next_toggle: float = 0.0


@dataclass
class FaultSchedule:
    """Fires :class:`Fault`s on ``links`` as the run's step passes theirs; lifts each after its seconds.

    Args:
        faults: the parsed schedule.
        links: the lab (``set_link``, ``throttle``).
        flap_period_s: a flapping link's seconds down, then up, in turn.
        report: where each action is told (default ``print``): the run's log shows every fault.
        clock: seconds, monotonic (tests pass a fake one).
    """

    faults: list[Fault]
    links: _Links
    flap_period_s: float = 1.0
    report: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    _pending: list[Fault] = field(init=False)
    _active: list[_Active] = field(init=False, default_factory=list)
    fired: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not self.flap_period_s > 0:
            raise ValueError(f"netlab.flap_period_s must be > 0, got {self.flap_period_s!r}")
        self._pending = list(self.faults)

    @property
    def done(self) -> bool:
        """Every fault has fired and been lifted."""
        return not self._pending and not self._active

    def poll(self, step: int) -> None:
        """Fire the faults whose step has come; toggle flapping links; lift the faults whose time is up."""
        now = self.clock()
        while self._pending and step >= self._pending[0].step:
            self._fire(self._pending.pop(0), step, now)
        for active in list(self._active):
            if now >= active.ends_at:
                self._lift(active)
            elif active.fault.action == "flap" and now >= active.next_toggle:
                active.link_up = not active.link_up
                self.links.set_link(active.fault.site, active.link_up)
                active.next_toggle = now + self.flap_period_s

    def lift_all(self) -> None:
        """Restore every link a fault still holds (and drop the faults not fired yet)."""
        self._pending = []
        for active in list(self._active):
            self._lift(active)

    def _fire(self, fault: Fault, step: int, now: float) -> None:
        active = _Active(fault, ends_at=now + fault.seconds, next_toggle=now + self.flap_period_s)
        if fault.action == "slow":
            self.links.throttle(fault.site, fault.mbit)
            what = f"links of site {fault.site} capped at {fault.mbit:g} Mbit/s"
        else:
            self.links.set_link(fault.site, False)
            what = f"site {fault.site}'s link down" + (" (flapping)" if fault.action == "flap" else "")
        self._active.append(active)
        self._say(f"netlab: fault {fault} at step {step}: {what} for {fault.seconds:g}s")

    def _lift(self, active: _Active) -> None:
        fault = active.fault
        if fault.action == "slow":
            self.links.throttle(fault.site, None)
        else:
            self.links.set_link(fault.site, True)
        self._active.remove(active)
        self._say(f"netlab: fault {fault} lifted: site {fault.site}'s link restored")

    def _say(self, line: str) -> None:
        self.fired.append(line)
        self.report(line)
