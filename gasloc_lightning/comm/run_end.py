"""The end of a run as the lighthouse records it: the committed end-of-fit average, and who can read it later.

The end-of-fit average commits under a torchft step of its own, ``FINAL_STEP + run_tag * 2**24 + r`` (r: the
rounds done; ``run_tag``: 16 bits of a hash of the run's secret), far above any round count. Two things follow from
that one number, with no new service:

- in the quorum that decides the average (see :mod:`gasloc_lightning.strategies.final_average`), torchft's own
  rule (members behind ``max_step`` are healed from a member at it) hands the committed average to every member
  whose collective failed;
- the lighthouse keeps the last quorum it issued, with each member's step, on its status page
  (``GET /status``, plain HTML, torchft 0.2.0). A worker that wakes after the run has ended (it was stalled, or
  started late) and finds no quorum reads that page: a final step with its run's tag means the others committed
  their final average and left. (The tag keeps a lighthouse that outlives a run from ending the next one at once;
  two runs with the same secret on the same lighthouse share it: give each run its own secret, as
  ``gasloc-elastic`` does, or restart the lighthouse.) It then leaves as well (:class:`~gasloc_lightning.comm.membership.RunEndedError`) instead of waiting for a quorum
  that will not form and failing.

Nothing read from the page is evaluated or unpickled: two regular expressions over text, and a page that does not
match (another torchft version) reads as "unknown", so the worker waits and fails as before.
"""

from __future__ import annotations

import hashlib
import logging
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)

FINAL_STEP = 1 << 40  # a committed end-of-fit average: FINAL_STEP + run_tag * 2**24 + rounds (int64 in torchft)
_ROUND_BITS = 24
_MAX_PAGE_BYTES = 4 << 20
_MEMBER = re.compile(r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)")


def run_tag(secret: bytes) -> int:
    """16 bits that tell this run's final step from another run's on the same lighthouse."""
    return int.from_bytes(hashlib.blake2b(secret, digest_size=2, person=b"gasloc-run-end").digest(), "big")


def final_step(rounds: int, tag: int) -> int:
    """The torchft step under which the end-of-fit average after ``rounds`` rounds of run ``tag`` commits."""
    if not 0 <= rounds < 1 << _ROUND_BITS or not 0 <= tag < 1 << 16:
        raise ValueError(f"rounds must be in [0, 2**24) and tag in [0, 2**16), got {rounds}, {tag}")
    return FINAL_STEP + (tag << _ROUND_BITS) + rounds


def is_final(step: int) -> bool:
    return step >= FINAL_STEP


@dataclass(frozen=True)
class LastQuorum:
    """The lighthouse's last issued quorum: member id (``name:uuid``) -> its step."""

    steps: dict[str, int]

    def ended(self, tag: int) -> bool:
        """Whether its members committed run ``tag``'s end-of-fit average (that run is over)."""
        return any(is_final(step) and (step - FINAL_STEP) >> _ROUND_BITS == tag for step in self.steps.values())

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
