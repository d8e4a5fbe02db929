"""The end of a run as the lighthouse records it: the committed end-of-fit average, and who can read it later.

The end-of-fit average commits under a torchft step of its own, ``FINAL_STEP + r`` (r: the rounds done), far
above any round count. Two things follow from that one number, with no new service:

- in the quorum that decides the average (see :mod:`gasloc_lightning.strategies.final_average`), torchft's own
  rule (members behind ``max_step`` are healed from a member at it) hands the committed average to every member
  whose collective failed;
- the lighthouse keeps the last quorum it issued, with each member's step, on its status page
  (``GET /status``, plain HTML, torchft 0.2.0). A worker that wakes after the run has ended (it was stalled, or
  started late) and finds no quorum reads that page: a step at or past ``FINAL_STEP`` means the others committed
  their final average and left. It then leaves as well (:class:`~gasloc_lightning.comm.membership.RunEndedError`) instead of waiting for a quorum
  that will not form and failing.

Nothing read from the page is evaluated or unpickled: two regular expressions over text, and a page that does not
match (another torchft version) reads as "unknown", so the worker waits and fails as before.
"""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)

FINAL_STEP = 1 << 40  # a committed end-of-fit average after r rounds is step FINAL_STEP + r (int64 in torchft)
_MAX_PAGE_BYTES = 4 << 20
_MEMBER = re.compile(r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)")


def final_step(rounds: int) -> int:
    """The torchft step under which the end-of-fit average after ``rounds`` rounds commits."""
    return FINAL_STEP + rounds


def is_final(step: int) -> bool:
    return step >= FINAL_STEP


@dataclass(frozen=True)
class LastQuorum:
    """The lighthouse's last issued quorum: member id (``name:uuid``) -> its step."""

    steps: dict[str, int]

    @property
    def ended(self) -> bool:
        """Whether its members committed the end-of-fit average (the run is over)."""
        return any(is_final(step) for step in self.steps.values())

    @property
    def names(self) -> list[str]:
        return sorted(member.split(":")[0] for member in self.steps)


def parse_status_page(page: str) -> LastQuorum | None:
    """The previous quorum of torchft's lighthouse status page (``None``: no previous quorum, or not this format)."""
    _, found, rest = page.partition("Previous Quorum")
    if not found:
        return None
    previous = rest.partition("<h2>Heartbeats</h2>")[0]
    steps = {member.strip(): int(step) for member, step in _MEMBER.findall(previous)}
    return LastQuorum(steps) if steps else None


def read_last_quorum(lighthouse_url: str, timeout: float) -> LastQuorum | None:
    """``GET <lighthouse>/status`` within ``timeout`` seconds; ``None`` if it does not answer or shows no quorum."""
    try:
        with urllib.request.urlopen(f"{lighthouse_url.rstrip('/')}/status", timeout=timeout) as response:
            page = response.read(_MAX_PAGE_BYTES).decode("utf-8", errors="replace")
    except (OSError, urllib.error.URLError, ValueError) as error:
        log.debug("lighthouse status unreadable url=%s error=%s", lighthouse_url, error)
        return None
    return parse_status_page(page)
