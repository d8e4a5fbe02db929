"""Requests to a torchft lighthouse that may die and come back on the same address.

torchft 0.2.0's manager server forwards a worker's quorum request to the lighthouse once (``quorum_retries=0``):
if the lighthouse dies while the request is in flight, the request is lost, nothing answers it, and the worker
waits for the request's whole timeout, even after a restarted lighthouse is back on the same address. Three
pieces make every request end within one deadline instead:

- :func:`quorum_retries`: the manager server sends a dropped request again about every ``retry_interval``
  seconds (a killed lighthouse resets the connection: the failure is seen at once), so a request in flight
  reaches a lighthouse restarted on the same address and is answered by it;
- a request never waits longer than ``lighthouse_timeout`` (the caller's deadline per request): a lighthouse that
  vanished without resetting the connection (a dead host) costs one request, then the caller asks again;
- :class:`LighthouseWatch` probes the lighthouse while a request is in flight and between requests, logs when it
  goes down and when it is back (:data:`DOWN_MARK` starts the first line: launchers and tests wait on it), and
  says when it has been down longer than ``lighthouse_wait``: the caller then fails with a clear error.

Nothing here imports Lightning or torch.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

DOWN_MARK = "lighthouse down"  # the log line a worker writes when it starts waiting for the lighthouse
BACK_MARK = "lighthouse back"
RETRY_INTERVAL_S = 0.5  # how often torchft's manager server sends a dropped quorum request again
_MIN_TORCHFT_SLEEP_S = 0.1  # torchft sleeps at least this long between two tries


def quorum_retries(request_timeout: float, retry_interval: float = RETRY_INTERVAL_S) -> int:
    """torchft's ``quorum_retries`` for requests of at most ``request_timeout`` seconds, tried again every
    ``retry_interval`` seconds.

    torchft 0.2.0 sleeps ``timeout / (quorum_retries + 1)`` (at least 0.1 s) between two tries of one request,
    each try with the request's whole timeout; it gives up after ``quorum_retries`` tries. So this many retries
    keep trying for about the request's whole timeout, ``retry_interval`` apart (or closer, for a shorter one).
    torchft also sends a request again when the lighthouse did not answer it within its timeout (no quorum yet):
    that try runs on after the caller gave up and asked again, and ends with the next quorum, which both tries
    receive (the same member, at the same step, since no round runs while it waits).
    """
    _check_seconds("request_timeout", request_timeout)
    _check_seconds("retry_interval", retry_interval)
    return max(1, math.ceil(request_timeout / max(retry_interval, _MIN_TORCHFT_SLEEP_S)))


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to ``http://HOST:PORT`` opens."""
    parsed = urlparse(address)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
            return True
    except OSError:
        return False


class LighthouseWatch:
    """Whether the lighthouse is up, since when it is down, and how long this worker still waits for it.

    Args:
        address: ``http://HOST:PORT`` of the lighthouse.
        worker: this worker's name (for the log lines).
        lighthouse_wait: seconds this worker waits for a lighthouse that went down to answer again (on the same
            address); past them :attr:`gone` is True and the caller fails.
        probe_interval: seconds between two probes while a request is in flight.
        probe_timeout: seconds one probe (a TCP connect) may take; a probe that times out counts as down.
    """

    def __init__(self, *, address: str, worker: str, lighthouse_wait: float, probe_interval: float = 0.25,
                 probe_timeout: float = 0.5) -> None:
        parsed = urlparse(address)
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"address must be 'http://HOST:PORT', got {address!r}")
        _check_seconds("lighthouse_wait", lighthouse_wait)
        _check_seconds("probe_interval", probe_interval)
        _check_seconds("probe_timeout", probe_timeout)
        self.address, self.worker = address, worker
        self.lighthouse_wait = float(lighthouse_wait)
        self.probe_interval, self.probe_timeout = float(probe_interval), float(probe_timeout)
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self.outages = 0  # how many times this worker saw the lighthouse go down

    # ---------------------------------------------------------------- state
    def probe(self) -> bool:
        """Probe once; log the first probe that finds it down, and the first that finds it back."""
        up = reachable(self.address, timeout=self.probe_timeout)
        with self._lock:
            if not up and self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                log.warning("%s worker=%s lighthouse=%s: waiting up to lighthouse_wait=%gs for it to come back on "
                            "the same address", DOWN_MARK, self.worker, self.address, self.lighthouse_wait)
            elif up and self._down_since is not None:
                log.warning("%s worker=%s lighthouse=%s after=%.1fs", BACK_MARK, self.worker, self.address,
                            time.monotonic() - self._down_since)
                self._down_since = None
        return up

    @property
    def down_for(self) -> float:
        """Seconds since the lighthouse was first found down (0 while it is up)."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    @property
    def gone(self) -> bool:
        """Down for longer than ``lighthouse_wait``."""
        return self.down_for > self.lighthouse_wait

    def gone_message(self) -> str:
        return (f"{self.worker}: the lighthouse at {self.address} has not answered for {self.down_for:.0f}s, more "
                f"than lighthouse_wait={self.lighthouse_wait:g}s (elastic.lighthouse_wait): restart it on the same "
                "address (docs/elastic.md, 'A lighthouse that dies'), or wait longer")

    # ---------------------------------------------------------------- waiting
    def wait_until_up(self, deadline: float) -> float:
        """Block while the lighthouse is down, until it answers, it is :attr:`gone`, or ``deadline`` (monotonic)
        passes; returns the seconds spent waiting (the caller may credit them against its own deadline)."""
        start = time.monotonic()
        while not self.probe() and not self.gone and time.monotonic() < deadline:
            time.sleep(self.probe_interval)
        return time.monotonic() - start

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Probe in the background while the body (a request in flight) runs: a lighthouse that dies meanwhile is
        logged at once, and the time it stays down counts towards ``lighthouse_wait``."""
        stop = threading.Event()
        thread = threading.Thread(target=self._probe_until, args=(stop,), name="lighthouse-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _probe_until(self, stop: threading.Event) -> None:
        while not stop.wait(self.probe_interval):
            self.probe()


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


# ------------------------------------------------------------------ quorum ids across a restart
def rendezvous_prefix(store_address: str, replica_ids: list[str], max_step: int) -> str:
    """``store_address`` with a path that names the quorum's members and round, for torchft's process-group
    rendezvous (torchft appends ``/torchft/<quorum id>/<rank>``).

    A restarted lighthouse numbers its quorums from 1 again. torchft 0.2.0 keys each rendezvous by the quorum id
    alone, in the store of the quorum's first member, which still holds the keys of the old quorum with that id:
    the members would read a dead peer's address and fail to connect (seen: ``Gloo connectFullMesh failed ...
    Connection refused``, one lost round per id). Every member computes the same path from the same quorum, and a
    quorum of another lighthouse's life with the same id differs in its members (their uuids) or its round.
    """
    digest = zlib.crc32(",".join(replica_ids).encode())
    return f"{store_address}/m{digest:08x}s{max_step}"


class RestartSafeQuorum:
    """A torchft ``QuorumResult`` whose ``store_address`` carries :func:`rendezvous_prefix`; everything else is the
    lighthouse's answer."""

    def __init__(self, result: Any) -> None:
        self._result = result
        self.store_address = rendezvous_prefix(result.store_address, list(result.replica_ids), int(result.max_step))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


def needs_new_group(quorum_id: int, replica_ids: list[str], last_id: int, last_ids: list[str] | None) -> bool:
    """Whether a quorum that torchft would not reconfigure for (its id is the last one's) has other members: only a
    restarted lighthouse reuses an id for another member set, and the old process group no longer fits it."""
    return quorum_id == last_id and last_ids is not None and list(replica_ids) != list(last_ids)
