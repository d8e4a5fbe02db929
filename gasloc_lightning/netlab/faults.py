"""Network faults on the lab's links, fired at a training step and lifted after a number of seconds or at a later step.

``netlab.faults`` entries (STEP: the furthest live worker's step, as ``elastic.chaos`` counts it; the launcher
reads it from the workers' progress files):

- ``partition:SITE@STEP:SECONDS``: SITE's link goes down, and comes back SECONDS later;
- ``flap:SITE@STEP:SECONDS``: SITE's link goes down and up every ``flap_period_s`` for SECONDS, then stays up;
- ``slow:SITE@STEP:SECONDS:MBIT``: both directions of SITE's links are capped at MBIT Mbit/s for SECONDS.

Each also takes ``@STEP-UNTIL`` instead of ``@STEP:SECONDS`` (``partition:1@15-30``, ``slow:1@15-30:2``): the fault
holds until the furthest live worker reaches step UNTIL, however long that takes. Its window is then a number of
the run's steps, not of seconds: a cut that must span round boundaries spans them on a loaded machine too (a
seconds window may fall inside one round's compute and cut nothing). It ends only when some worker trains on, so
it suits a side that keeps a quorum (the other side waits, and heals when it comes back).

Two faults that act on the same thing of one site (its link's state: partition and flap; its rate: slow) at the
same STEP are refused: their windows certainly overlap. Faults at different steps may still overlap (a window is
in seconds, a step's time is known only in the run); then they compose instead of undoing each other: a link is
down while any partition, or any flap in its down phase, holds it, and capped at the lowest cap in force.

:class:`FaultSchedule` is driven by polls (:meth:`FaultSchedule.poll` with the current step and time), so it needs
no thread of its own; :meth:`FaultSchedule.lift_all` restores every link (the run ended, or failed, mid-fault).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

ACTIONS = ("partition", "flap", "slow")
_FAULT = re.compile(r"^(partition|flap|slow):(\d+)@(\d+)(?::(\d+(?:\.\d+)?)|-(\d+))(?::(\d+(?:\.\d+)?))?$")
_LINK_ACTIONS = ("partition", "flap")  # both set the link's state; slow sets its rate


class _Links(Protocol):
    def set_link(self, site: int, up: bool) -> None: ...
    def throttle(self, site: int, mbit: float | None) -> None: ...


@dataclass(frozen=True)
class Fault:
    """One fault: ``action`` on ``site``'s link at ``step`` for ``seconds``, or until the run reaches ``until_step``
    (``slow``: down to ``mbit``)."""

    action: str
    site: int
    step: int
    seconds: float | None
    mbit: float | None = None
    until_step: int | None = None

    def __str__(self) -> str:
        suffix = f":{self.mbit:g}" if self.action == "slow" else ""
        window = f":{self.seconds:g}" if self.until_step is None else f"-{self.until_step}"
        return f"{self.action}:{self.site}@{self.step}{window}{suffix}"

    @property
    def lasts(self) -> str:
        """The window, in words."""
        return f"for {self.seconds:g}s" if self.until_step is None else f"until step {self.until_step}"

    def conflicts_with(self, other: Fault) -> bool:
        """Whether both act on the same thing of the same site: its link's state, or its rate."""
        return self.site == other.site and (self.action in _LINK_ACTIONS) == (other.action in _LINK_ACTIONS)


def parse_faults(entries: list[str], sites: int) -> list[Fault]:
    """Parse and check ``netlab.faults`` for a lab of ``sites`` sites (sorted by step, stable within a step)."""
    faults = sorted((_parse(str(entry).strip(), sites) for entry in entries), key=lambda fault: fault.step)
    for i, fault in enumerate(faults):
        for other in faults[i + 1:]:
            if other.step == fault.step and other.conflicts_with(fault):
                raise ValueError(f"netlab.faults entries {str(fault)!r} and {str(other)!r} both act on site "
                                 f"{fault.site}'s {'link' if fault.action in _LINK_ACTIONS else 'rate'} from step "
                                 f"{fault.step}: their windows overlap; give one a later step")
    return faults


def _parse(entry: str, sites: int) -> Fault:
    match = _FAULT.match(entry)
    if match is None:
        raise ValueError(f"netlab.faults entry {entry!r}: expected partition:SITE@STEP:SECONDS, "
                         "flap:SITE@STEP:SECONDS or slow:SITE@STEP:SECONDS:MBIT (or @STEP-UNTIL for :SECONDS)")
    action, site, step, seconds, until, mbit = match.groups()
    if int(site) >= sites:
        raise ValueError(f"netlab.faults entry {entry!r}: site {site} does not exist (the preset has {sites})")
    if (action == "slow") != (mbit is not None):
        raise ValueError(f"netlab.faults entry {entry!r}: only slow takes :MBIT, and it needs it")
    if (seconds is not None and float(seconds) <= 0) or (mbit is not None and float(mbit) <= 0):
        raise ValueError(f"netlab.faults entry {entry!r}: SECONDS and MBIT must be > 0")
    if until is not None and int(until) <= int(step):
        raise ValueError(f"netlab.faults entry {entry!r}: UNTIL must be a later step than STEP")
    return Fault(action, int(site), int(step), None if seconds is None else float(seconds),
                 None if mbit is None else float(mbit), None if until is None else int(until))


@dataclass
class _Active:
    fault: Fault
    ends_at: float  # inf: it ends at the fault's until_step
    link_up: bool = False  # flap: the link's state now
    next_toggle: float = 0.0

    def over(self, now: float, step: int) -> bool:
        until = self.fault.until_step
        return now >= self.ends_at or (until is not None and step >= until)

    @property
    def holds_link_down(self) -> bool:
        return self.fault.action == "partition" or (self.fault.action == "flap" and not self.link_up)


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
    # The sites whose link is down, and the caps in force, as the links were last told (see _apply).
    _down: set[int] = field(init=False, default_factory=set)
    _caps: dict[int, float] = field(init=False, default_factory=dict)
    fired: list[str] = field(init=False, default_factory=list)
    unfired: list[Fault] = field(init=False, default_factory=list)  # dropped by lift_all before their step came

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
            if active.over(now, step):
                self._lift(active)
            elif active.fault.action == "flap" and now >= active.next_toggle:
                active.link_up = not active.link_up
                active.next_toggle = now + self.flap_period_s
                self._apply(active.fault.site)

    def lift_all(self) -> None:
        """Restore every link a fault still holds (and drop the faults not fired yet: see ``unfired``)."""
        self.unfired, self._pending = self.unfired + self._pending, []
        for active in list(self._active):
            self._lift(active)
        for site in sorted(self._down | set(self._caps)):  # an interrupt may have cut a command short
            self._apply(site)

    def _fire(self, fault: Fault, step: int, now: float) -> None:
        holding = [str(a.fault) for a in self._active if a.fault.conflicts_with(fault)]
        ends_at = math.inf if fault.seconds is None else now + fault.seconds
        self._active.append(_Active(fault, ends_at=ends_at, next_toggle=now + self.flap_period_s))
        self._apply(fault.site)
        if fault.action == "slow":
            what = f"links of site {fault.site} capped at {fault.mbit:g} Mbit/s"
        else:
            what = f"site {fault.site}'s link down" + (" (flapping)" if fault.action == "flap" else "")
        also = f" (with {', '.join(holding)} still in force: the stricter holds)" if holding else ""
        self._say(f"netlab: fault {fault} at step {step}: {what} {fault.lasts}{also}")

    def _lift(self, active: _Active) -> None:
        self._active.remove(active)
        self._apply(active.fault.site)
        fault = active.fault
        still = [str(a.fault) for a in self._active if a.fault.site == fault.site]
        if still:
            self._say(f"netlab: fault {fault} lifted; site {fault.site} stays under {', '.join(still)}")
        else:
            self._say(f"netlab: fault {fault} lifted: site {fault.site}'s link restored")

    def _apply(self, site: int) -> None:
        """Bring ``site``'s link and cap to what the faults in force on it ask for (a command only on a change).

        A cut is recorded before its command and a restore after it, so whatever an interrupt cuts short, the
        record never says "restored" of a link that is not: lift_all then restores it once more."""
        mine = [active for active in self._active if active.fault.site == site]
        down = any(active.holds_link_down for active in mine)
        cap = min((a.fault.mbit for a in mine if a.fault.action == "slow"), default=None)
        if down and site not in self._down:
            self._down.add(site)
            self.links.set_link(site, False)
        elif not down and site in self._down:
            self.links.set_link(site, True)
            self._down.discard(site)
        if cap is not None and cap != self._caps.get(site):
            self._caps[site] = cap
            self.links.throttle(site, cap)
        elif cap is None and site in self._caps:
            self.links.throttle(site, None)
            del self._caps[site]

    def _say(self, line: str) -> None:
        self.fired.append(line)
        self.report(line)
