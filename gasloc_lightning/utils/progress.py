"""Progress of a long script made of runs (a benchmark, the lab's claim): which run of how many, its ETA, and
what is already recorded; and the ``H:MM:SS`` form of a duration the launchers' live status shares.

Pure Python, no torch and no Lightning. It sits in ``utils``, below every layer, so each may import it: the
lab's ``netlab.claim3``, the app's live status, and the benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``-``: not known yet; a negative duration, an estimate overtaken, shows as ``0:00:00``)."""
    if seconds is None:
        return "-"
    whole = max(0, int(round(seconds)))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class ScriptProgress:
    """Progress of a long script made of runs: which run of how many, its ETA, what is already recorded.

    The ETA is the mean duration of the runs this session finished times the runs left (runs kept from an
    earlier session's record cost nothing and are not timed). A script that resumes from its record passes
    how many of its runs that record already holds as ``recorded``. A plan that counted too few runs does not
    print ``run 4 of 2``: the total grows to the runs recorded plus the one starting.

    Args:
        total: the runs the script will have recorded at its end (kept ones included), >= 0.
        recorded: how many of them an earlier session already recorded.
        clock: the time source (``time.monotonic``); tests pass their own.
    """

    def __init__(self, *, total: int, recorded: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if total < 0 or not 0 <= recorded <= total:
            raise ValueError(f"need 0 <= recorded <= total, got recorded={recorded!r} total={total!r}")
        self.total, self.recorded, self._clock = total, recorded, clock
        self._durations: list[float] = []
        self._started: float | None = None

    def start(self, label: str) -> str:
        """The line that announces the next run (``label``: what it is); times it until :meth:`done`."""
        self._started = self._clock()
        self.total = max(self.total, self.recorded + 1)  # the plan counted too few: this run is one more
        left = max(0, self.total - self.recorded)
        eta = None if not self._durations else left * sum(self._durations) / len(self._durations)
        return (f"run {self.recorded + 1} of {self.total} ({self.recorded} done): {label} "
                f"| ETA {format_duration(eta)}")

    def done(self) -> None:
        """The run announced last is recorded."""
        if self._started is not None:
            self._durations.append(self._clock() - self._started)
            self._started = None
        self.recorded += 1
