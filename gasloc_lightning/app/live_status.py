"""The launchers' live status line: how far a run of many workers is, and whether it is healthy.

Built only from what each worker already writes in its folder (``progress.json``, rewritten atomically at every
step by :class:`~gasloc_lightning.app.elastic_worker.ElasticProgress`), so nothing new listens on the network:

- :func:`status_of` is a pure function from the workers' progress records (and the previous status, for rates) to a
  :class:`RunStatus`;
- :func:`format_status` makes it one line;
- :class:`LiveStatus` shows it: refreshed in place with ``rich`` on a terminal, or printed every ``every_s``
  seconds of the caller's clock when the output is a file or a pipe (what a long run's log keeps).

Example line::

    status: step 47/100 (slowest 45) | ETA 0:00:31 | quorum 3 (3 live) | val loss 3.214 | consensus distance 0.0123
    | failed exchanges 1 | in 12.3 kB/s out 12.1 kB/s | elapsed 0:00:52

``elapsed`` is the time since the launcher's first look, so a log file's lines say when they were printed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from gasloc_lightning.utils.progress import format_duration
from gasloc_lightning.utils.records import dash

STATUS_PREFIX = "status: "


@dataclass(frozen=True)
class RunStatus:
    """One look at the run. ``None``: nothing known yet (no worker has written it)."""

    time: float
    max_steps: int
    furthest_step: int
    slowest_step: int | None  # the slowest live worker's step
    live_workers: int
    quorum_size: int | None
    val_loss: float | None  # the last consensus validation loss any worker logged
    consensus_distance: float | None
    failed_exchanges: int
    bytes_in_per_s: float | None
    bytes_out_per_s: float | None
    eta_s: float | None  # until the slowest live worker reaches max_steps, at the rate seen since `origin`
    origin: tuple[float, int] | None = None  # (time, furthest step) of the first look with a step: the rate's start
    totals: Mapping[Any, tuple[float, float]] = field(default_factory=dict)  # (worker, pid) -> (sent, received)


def status_of(progress: Mapping[Any, Mapping[str, Any]], *, max_steps: int, now: float,
              previous: RunStatus | None = None, origin: tuple[float, int] | None = None) -> RunStatus:
    """The run's status from each worker's last ``progress.json`` record.

    Args:
        progress: worker id -> its record (``{}`` where none was written yet); only workers whose record says
            ``running`` or ``starting`` count as live.
        max_steps: the run's step budget (``trainer.max_steps``).
        now: the time of this look (seconds, the same clock as ``previous.time``).
        previous: the last status, for the step rate (ETA) and the byte rates; ``None`` at the first look.
        origin: (time, furthest step) the step rate is measured from (default: ``previous``'s, else this look's
            once a step is known).
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
    # A record is whatever a worker's file held: anything that is not a dict, or a field of the wrong type, reads
    # as unknown (a hostile or torn record must not stop the launcher that is supervising the run)
    progress = {w: (r if isinstance(r, Mapping) else {}) for w, r in progress.items()}
    live = {w: r for w, r in progress.items() if r.get("state") in ("running", "starting")}
    finished = {w: r for w, r in progress.items() if r.get("state") in ("done", "left")}
    steps = [as_int(r.get("step")) or 0 for r in progress.values() if r]
    live_steps = [as_int(r.get("step")) or 0 for r in live.values()]
    furthest = max(steps, default=0)
    latest = _latest(progress.values())
    totals = {(w, str(r.get("pid"))): (as_float(r.get("bytes_sent")) or 0.0,
                                       as_float(r.get("bytes_received")) or 0.0)
              for w, r in live.items()}
    origin = origin or (previous.origin if previous is not None else None)
    if origin is None and furthest > 0:
        origin = (now, furthest)
    slowest = min(live_steps, default=None)
    return RunStatus(
        time=now, max_steps=max_steps, furthest_step=furthest, slowest_step=slowest, live_workers=len(live),
        quorum_size=max((size for r in (live or finished).values() if (size := as_int(r.get("quorum_size")))),
                        default=None),  # with no live worker: the last quorum the finished ones saw
        val_loss=latest("val_loss"), consensus_distance=latest("consensus_distance"),
        failed_exchanges=sum(as_int(r.get("failed_exchanges")) or 0 for r in progress.values()),
        bytes_out_per_s=_rate(totals, previous, now, 0), bytes_in_per_s=_rate(totals, previous, now, 1),
        eta_s=_eta(origin, now, furthest, max_steps, slowest), origin=origin, totals=totals,
    )


def _latest(records: Any) -> Callable[[str], float | None]:
    """The value of a key in the record of the furthest worker that has one (the freshest consensus figure)."""
    ordered = sorted((r for r in records if r), key=lambda r: as_int(r.get("step")) or 0, reverse=True)

    def value(key: str) -> float | None:
        return next((number for r in ordered if (number := as_float(r.get(key))) is not None), None)
    return value


def as_int(value: Any) -> int | None:
    """An integer field of a worker's record; ``None`` when absent or not a number (a record is read from a file)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):
        return None


def as_float(value: Any) -> float | None:
    """A real field of a worker's record; ``None`` when absent or not a finite-or-infinite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _rate(totals: Mapping[Any, tuple[float, float]], previous: RunStatus | None, now: float,
          index: int) -> float | None:
    """Bytes per second since the previous look, summed over the incarnations seen both times (a restarted worker's
    counters start again at zero: it counts from its second look)."""
    if previous is None or now <= previous.time:
        return None
    grown = [totals[key][index] - previous.totals[key][index] for key in totals if key in previous.totals]
    return sum(max(0.0, delta) for delta in grown) / (now - previous.time)


def _eta(origin: tuple[float, int] | None, now: float, furthest: int, max_steps: int,
         slowest: int | None) -> float | None:
    if slowest is None and furthest >= max_steps:
        return 0.0  # every worker has finished
    if origin is None or slowest is None or furthest <= origin[1] or now <= origin[0]:
        return None
    steps_per_s = (furthest - origin[1]) / (now - origin[0])
    return max(0, max_steps - slowest) / steps_per_s


def format_status(status: RunStatus, elapsed_s: float | None = None) -> str:
    """One line: steps, ETA, quorum, loss, consensus distance, failed exchanges and bytes/s (``-``: not known yet),
    and, given ``elapsed_s``, the time since the launcher's first look (a log file's lines then carry their time)."""
    slowest = "-" if status.slowest_step is None else status.slowest_step
    elapsed = "" if elapsed_s is None else f" | elapsed {format_duration(elapsed_s)}"
    return (f"{STATUS_PREFIX}step {status.furthest_step}/{status.max_steps} (slowest {slowest}) "
            f"| ETA {format_duration(status.eta_s)} | quorum {dash(status.quorum_size)} ({status.live_workers} live) "
            f"| val loss {_number(status.val_loss, '.4g')} "
            f"| consensus distance {_number(status.consensus_distance, '.3g')} "
            f"| failed exchanges {status.failed_exchanges} "
            f"| in {_bytes_per_s(status.bytes_in_per_s)} out {_bytes_per_s(status.bytes_out_per_s)}{elapsed}")


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bytes_per_s(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.1f} {unit}/s" if unit != "B" else f"{value:.0f} B/s"
        value /= 1000
    return "-"  # unreachable


def _has_rich() -> bool:
    import importlib.util

    return importlib.util.find_spec("rich") is not None


class LiveStatus:
    """Shows a run's status: in place on a terminal (``rich``), else one line every ``every_s`` seconds.

    Args:
        max_steps: the run's step budget.
        every_s: on a file or pipe, the seconds between two printed lines (> 0).
        show: ``False``: print nothing (the quiet option); the status is still computed for ``on_status``.
        stream: where to write (default ``sys.stdout``); a terminal gets the refreshed line.
        clock: the time source (``time.monotonic``); tests pass their own.
        on_status: also called with every computed status (e.g. to log it to TensorBoard).
    """

    def __init__(self, *, max_steps: int, every_s: float = 5.0, show: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_status: Callable[[RunStatus], None] | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        self.max_steps, self.every_s, self.show = max_steps, float(every_s), show
        self._stream = stream if stream is not None else sys.stdout
        self._clock, self._on_status = clock, on_status
        self._last: RunStatus | None = None
        self._window: RunStatus | None = None  # the latest look that started a window of every_s
        self._older: RunStatus | None = None  # the one before: the rates are measured from it
        self._printed: RunStatus | None = None  # the last status printed on a file
        self._printed_at: float | None = None
        self._live: Any = None  # rich.live.Live on a terminal, once started
        self._started: float | None = None  # the clock at the first look: each line says the time since
        # rich draws the refreshed line (Lightning's progress bar uses it too); without it, a terminal gets lines
        self._terminal = show and bool(getattr(self._stream, "isatty", lambda: False)()) and _has_rich()

    @property
    def last(self) -> RunStatus | None:
        return self._last

    def update(self, progress: Mapping[Any, Mapping[str, Any]]) -> RunStatus:
        """Look at the workers' records now; show the status if it is due. Returns the status."""
        now = self._clock()
        if self._started is None:
            self._started = now
        # Rates over the last every_s to 2 x every_s (a round's bytes arrive in bursts: poll-to-poll rates are
        # mostly 0, and a window just restarted would flicker on a terminal)
        since = self._older or self._window
        self._last = status_of(progress, max_steps=self.max_steps, now=now, previous=since,
                               origin=None if self._last is None else self._last.origin)
        if self._window is None or now - self._window.time >= self.every_s:
            self._older, self._window = self._window, self._last
        if self._on_status is not None:
            self._on_status(self._last)
        if self.show and self._terminal:
            self._refresh(self._line(now))
        elif self.show and (self._printed_at is None or now - self._printed_at >= self.every_s):
            self._print(now)
        return self._last

    def _line(self, now: float) -> str:
        return format_status(self._last, elapsed_s=now - self._started)

    def _print(self, now: float) -> None:
        print(self._line(now), file=self._stream, flush=True)
        self._printed_at, self._printed = now, self._last

    def _refresh(self, line: str) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        if self._live is None:  # other prints of the launcher go above the line (rich redirects stdout)
            self._live = Live(Text(line), console=Console(file=self._stream), auto_refresh=False, transient=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()
        self._live.update(Text(line), refresh=True)

    def close(self) -> None:
        """Leave the last line on screen and stop refreshing; on a file, print the last status if it was not yet
        (the run's end: every worker's final figures). Idempotent."""
        if self.show and not self._terminal and self._last is not None and self._printed is not self._last:
            self._print(self._clock())
        if self._live is not None:
            self._live.stop()
            self._live = None
