"""Each lab link's measured throughput, from the byte counters of the htb class that shapes it.

The lab shapes the direction from site a to site b as one htb class on a's ``wan`` egress
(:class:`~gasloc_lightning.netlab.lab.Lab`); the class's ``Sent N bytes`` counter (``tc -s class show``) counts
every byte that crossed that direction. The launcher reads every site's counters now and then (one ``tc`` command per
site, no socket: nothing new listens on the network) and turns two reads into Mbit/s per direction, which
``gasloc-netlab`` logs as the launcher's TensorBoard series ``launcher/link_<a>_to_<b>_mbit_s``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping

from gasloc_lightning.netlab.lab import SITE_DEVICE, Lab, class_of_site
from gasloc_lightning.netlab.shell import run

Link = tuple[int, int]  # (from site, to site)
READ_TIMEOUT_S = 2.0  # one site's counters: the launcher's watch loop waits on it, so a hung tc must not hold it
_CLASS_SENT = re.compile(r"^class htb (\S+) [^\n]*\n\s*Sent (\d+) bytes", re.MULTILINE)


def class_bytes(text: str) -> dict[str, int]:
    """Bytes sent by each htb class of ``tc -s class show`` output: ``{classid: bytes}``."""
    return {classid: int(sent) for classid, sent in _CLASS_SENT.findall(text)}


def site_link_bytes(lab: Lab, site: int) -> dict[int, int]:
    """Bytes ``site`` has sent to each other site over its shaped link so far: ``{other site: bytes}``."""
    sent = class_bytes(run("tc", "-n", lab.site_namespace(site), "-s", "class", "show", "dev", SITE_DEVICE,
                           timeout_s=READ_TIMEOUT_S))
    return {other: sent.get(class_of_site(other), 0) for other in range(lab.plan.sites) if other != site}


class LinkMeter:
    """Mbit/s of every directed link between two reads of the counters, read at most every ``every_s``.

    Args:
        sites: the lab's site count (>= 1).
        read: site -> {other site: bytes sent to it so far} (:func:`site_link_bytes` on a lab; tests pass their own).
        every_s: the least seconds between two reads (> 0): a round's bytes cross in bursts, so a rate over a few
            seconds says more than one poll to the next.
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, *, sites: int, read: Callable[[int], Mapping[int, int]], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if sites < 1:
            raise ValueError(f"sites must be >= 1, got {sites!r}")
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        self.sites, self.every_s, self._read, self._clock = sites, float(every_s), read, clock
        self._previous: tuple[float, dict[Link, int]] | None = None
        self._next_read: float | None = None  # no read before then, failed or not
        self.failures = 0  # reads that raised (the caller warns at the first)

    @classmethod
    def of_lab(cls, lab: Lab, every_s: float = 5.0) -> LinkMeter:
        return cls(sites=lab.plan.sites, read=lambda site: site_link_bytes(lab, site), every_s=every_s)

    def poll(self) -> dict[Link, float] | None:
        """Each link's Mbit/s since the previous read, if ``every_s`` has passed since it (else None; the first
        read only starts the window). A read that raises is not tried again before ``every_s`` has passed either:
        a broken or hung ``tc`` costs the caller's loop one read per window, not one per poll."""
        now = self._clock()
        if self._next_read is not None and now < self._next_read:
            return None
        self._next_read = now + self.every_s
        try:
            counts = {(a, b): int(sent) for a in range(self.sites) for b, sent in self._read(a).items()}
        except Exception:
            self.failures += 1
            raise
        previous, self._previous = self._previous, (now, counts)
        if previous is None:
            return None
        seconds = now - previous[0]
        # max(0, ...): a counter that started again (a class rebuilt) counts from zero, never negative
        return {link: max(0, sent - previous[1].get(link, 0)) * 8 / 1e6 / seconds for link, sent in counts.items()}
