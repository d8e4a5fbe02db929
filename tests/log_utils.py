"""Waiting on log lines: tests that must know a thread has reached a point wait for the line it logs there."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator


class LogRecords(logging.Handler):
    """Collects the log records of a logger; :meth:`wait` blocks until one contains a text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def wait(self, text: str, timeout: float) -> None:
        """Until a line contains ``text``; ``timeout`` is only the failure deadline."""
        with self.changed:
            assert self.changed.wait_for(lambda: any(text in line for line in self.lines), timeout), \
                f"no log line with {text!r} within {timeout:g}s: {self.lines[-5:]}"


@contextlib.contextmanager
def log_records(name: str) -> Iterator[LogRecords]:
    """A :class:`LogRecords` on logger ``name`` (at INFO) for the block."""
    handler = LogRecords()
    logger = logging.getLogger(name)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
