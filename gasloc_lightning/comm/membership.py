"""Elastic membership on torchft: who is in this round's quorum, and a process group over exactly them.

:class:`ElasticMembership` wraps one torchft ``Manager`` per worker (its own replica group of one
process) that talks to a torchft lighthouse. Each round a worker calls :meth:`start_quorum`; it
returns once the lighthouse has issued a quorum, the process group has been reconfigured over the
quorum's members, and (if this worker is new, restarted or behind) the state of an up-to-date peer
has been received through torchft's checkpoint transport and applied with ``load_state_dict``.

Every member gets the same sorted list of member ids (``name:uuid``; a restarted worker is a new
member) and the same ``max_step``; index i in that list is rank i of the process group. So a
matching drawn from (seed, round index, sorted ids) is the same on every member with no message.

Failures (torchft 0.2.0 behaviour, see ``docs/elastic.md``):

- unreachable lighthouse: :class:`MembershipError` within ``connect_timeout``;
- fewer than ``min_workers`` live workers, or a lighthouse that died: :meth:`start_quorum` logs that it
  waits, then raises :class:`MembershipError` after ``quorum_timeout`` (it tells which case it saw);
- a failed exchange is reported with :meth:`commit` *after* the round's collectives: torchft turns the
  collectives of an errored manager into no-ops, which would leave the peers waiting for the timeout.

Nothing here imports Lightning.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs ~10 INFO lines per round otherwise

log = logging.getLogger(__name__)

StateDictFn = Callable[[], dict[str, Any]]
LoadStateDictFn = Callable[[dict[str, Any]], None]


class MembershipError(RuntimeError):
    """The lighthouse or the quorum could not be reached in time."""


def lighthouse_url(address: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` -> the URL torchft expects."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"lighthouse must be 'HOST:PORT', got {address!r}")
    url = address if "://" in address else f"http://{address}"
    parsed = urlparse(url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"lighthouse must be 'HOST:PORT' (e.g. 'node0:29510'), got {address!r}")
    return url


def lighthouse_reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to the lighthouse opens (no torchft involved)."""
    parsed = urlparse(lighthouse_url(address))
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout):
            return True
    except OSError:
        return False


def worker_name(worker_id: int) -> str:
    """Zero-padded, so the lighthouse's lexicographic sort is the numeric one (``worker_0010``)."""
    return f"worker_{worker_id:04d}"


@dataclass(frozen=True)
class Quorum:
    """One quorum as every member sees it.

    Args:
        quorum_id: changes whenever the member set changes (or a member failed to commit).
        members: the sorted member ids; index i is process-group rank i.
        index: this worker's rank in ``members``.
        max_step: the most rounds any member has completed (identical on every member): the round index t.
        healed: whether this worker received a peer's state in this quorum.
        error: why this quorum cannot be used (its process group or the state transfer failed, e.g. a member
            died while it formed): its round then exchanges nothing, and the next quorum rebuilds the group.
    """

    quorum_id: int
    members: tuple[str, ...]
    index: int
    max_step: int
    healed: bool
    error: Exception | None = None

    @property
    def usable(self) -> bool:
        return self.error is None

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def names(self) -> list[str]:
        """The members without torchft's uuid suffix (``worker_0002``)."""
        return [member.split(":")[0] for member in self.members]


class _QuorumRecorder:
    """Stands in for the Manager's client and keeps the last ``QuorumResult`` (the Manager drops its ``replica_ids``)."""

    def __init__(self, client: Any) -> None:
        self._inner = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._inner._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ElasticMembership:
    """One worker's membership in an elastic job: a torchft Manager, its quorum, and its process group.

    Args:
        lighthouse: ``HOST:PORT`` of the torchft lighthouse.
        worker_id: this worker's number; the member name is ``worker_<id>`` (zero-padded).
        min_workers: the smallest quorum this worker trains in (the lighthouse's ``min_replicas`` should match).
        state_dict: returns this worker's state for a joining peer (tensors must be copies: the checkpoint
            transport serves them after this worker has moved on).
        load_state_dict: applies a peer's state on this worker (called from :meth:`start_quorum`; an exception
            there, e.g. a refused joiner, propagates out of it).
        connect_timeout: seconds to reach the lighthouse and the peers' managers.
        quorum_timeout: seconds :meth:`start_quorum` waits for a quorum of at least ``min_workers``.
        gossip_timeout: seconds any send, receive or all-reduce on the process group may take (a hung peer).
        transfer_timeout: seconds a state transfer to or from a peer may take.
        heartbeat_interval: seconds between heartbeats to the lighthouse.
        first_quorum_delay: seconds between registering and asking for the first quorum, so that workers started
            together are all heartbeating when it forms (the lighthouse then waits for every heartbeating worker,
            up to its join timeout; without the delay the first ``min_workers`` to ask form it alone).
    """

    def __init__(
        self,
        *,
        lighthouse: str,
        worker_id: int,
        min_workers: int,
        state_dict: StateDictFn,
        load_state_dict: LoadStateDictFn,
        connect_timeout: float = 10.0,
        quorum_timeout: float = 60.0,
        gossip_timeout: float = 30.0,
        transfer_timeout: float = 60.0,
        heartbeat_interval: float = 0.1,
        first_quorum_delay: float = 0.0,
    ) -> None:
        self._url = lighthouse_url(lighthouse)
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
            raise ValueError(f"worker_id must be an int >= 0, got {worker_id!r}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1, got {min_workers!r}")
        for name, value in (("connect_timeout", connect_timeout), ("quorum_timeout", quorum_timeout),
                            ("gossip_timeout", gossip_timeout), ("transfer_timeout", transfer_timeout),
                            ("heartbeat_interval", heartbeat_interval)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        self.worker_id, self.name, self.min_workers = worker_id, worker_name(worker_id), min_workers
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.connect_timeout, self.quorum_timeout = float(connect_timeout), float(quorum_timeout)
        self.gossip_timeout, self.transfer_timeout = float(gossip_timeout), float(transfer_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        if not isinstance(first_quorum_delay, (int, float)) or isinstance(first_quorum_delay, bool) or first_quorum_delay < 0:
            raise ValueError(f"first_quorum_delay must be a number of seconds >= 0, got {first_quorum_delay!r}")
        self.first_quorum_delay = float(first_quorum_delay)
        self._manager: Any = None
        self._store: Any = None
        self._recorder: _QuorumRecorder | None = None
        self._quorum: Quorum | None = None
        self._healed = False
        self.membership_changes = 0

    # ------------------------------------------------------------------ life cycle
    def connect(self) -> None:
        """Start this worker's manager and register with the lighthouse (:class:`MembershipError` if unreachable)."""
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        host = socket.gethostname()
        # The quorum's first member's store is the rendezvous of the reconfigured process group.
        self._store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=self.transfer_timeout))
        pg = ProcessGroupGloo(timeout=timedelta(seconds=self.gossip_timeout))
        try:
            self._manager = Manager(
                pg=pg, load_state_dict=self._apply_peer_state, state_dict=self._state_dict,
                min_replica_size=self.min_workers, use_async_quorum=False,
                timeout=timedelta(seconds=self.transfer_timeout),
                quorum_timeout=timedelta(seconds=self.quorum_timeout),
                connect_timeout=timedelta(seconds=self.connect_timeout),
                rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                lighthouse_addr=self._url, replica_id=self.name,
                heartbeat_interval=timedelta(seconds=self.heartbeat_interval),
                init_sync=True,  # founders too take the first member's state: one start, and a signature check
            )
        except RuntimeError as error:
            raise MembershipError(
                f"{self.name}: could not reach the lighthouse at {self._url} within connect_timeout="
                f"{self.connect_timeout:g}s (is it running? check --lighthouse / elastic.lighthouse): {error}"
            ) from error
        self._recorder = _QuorumRecorder(self._manager._client)  # torchft keeps no member list: record it
        self._manager._client = self._recorder

    def shutdown(self) -> None:
        """Stop heartbeating and serving; the lighthouse drops this worker after its heartbeat timeout."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # ------------------------------------------------------------------ quorum
    def start_quorum(self) -> Quorum:
        """Wait for the next quorum of at least ``min_workers`` (healing from a peer if this worker is behind).

        A smaller quorum (the lighthouse's ``min_replicas`` may be lower) is not trained in: this worker
        asks again until ``quorum_timeout`` has passed, then raises :class:`MembershipError`.
        """
        deadline = time.monotonic() + self.quorum_timeout
        healed = False
        while True:
            quorum = self._next_quorum(max(0.1, deadline - time.monotonic()))
            healed = healed or quorum.healed  # a heal in a quorum too small to train in still happened
            if quorum.size >= self.min_workers:
                return replace(quorum, healed=healed)
            if time.monotonic() >= deadline:
                raise self._too_few_error(f"the last quorum had {quorum.size}")
            self._log_waiting()
            time.sleep(0.2)

    def join(self) -> Quorum:
        """The first quorum this worker trains in: like :meth:`start_quorum`, but an unusable one (a member died
        while it formed, so this worker may not have received a peer's state) is reported and asked again,
        instead of training a round from this worker's own start. :class:`MembershipError` after ``quorum_timeout``.
        """
        time.sleep(self.first_quorum_delay)  # heartbeating meanwhile: see the argument's doc
        deadline = time.monotonic() + self.quorum_timeout
        quorum = self.start_quorum()
        healed = quorum.healed
        while not quorum.usable:
            if time.monotonic() >= deadline:
                raise MembershipError(f"{self.name}: no usable quorum to join within quorum_timeout="
                                      f"{self.quorum_timeout:g}s (the last failed with: {quorum.error})")
            log.info("joining again worker=%s (the quorum failed as it formed)", self.name)
            self.commit(quorum.max_step if healed else 0, quorum.error)
            quorum = self.start_quorum()
            healed = healed or quorum.healed
        return replace(quorum, healed=healed)

    def _next_quorum(self, timeout: float) -> Quorum:
        manager = self._require_manager()
        self._healed = False
        waiting = threading.Timer(min(2.0, timeout / 4), self._log_waiting)
        waiting.daemon = True
        waiting.start()
        try:
            manager.start_quorum(timeout=timedelta(seconds=timeout))
        except TimeoutError as error:
            manager._quorum_future = None  # torchft re-raises a failed quorum forever otherwise
            raise self._quorum_error(error) from error
        finally:
            waiting.cancel()
        if self._recorder.last is None:
            raise MembershipError(f"{self.name}: quorum failed: {manager.errored().original_exception}")
        return self._record_quorum()

    def _log_waiting(self) -> None:
        log.info("waiting for a quorum worker=%s min_workers=%d lighthouse=%s quorum_timeout=%gs",
                 self.name, self.min_workers, self._url, self.quorum_timeout)

    def _quorum_error(self, error: Exception) -> MembershipError:
        if not lighthouse_reachable(self._url):
            return MembershipError(
                f"{self.name}: the lighthouse at {self._url} stopped answering (it died or is unreachable); "
                f"no quorum within quorum_timeout={self.quorum_timeout:g}s"
            )
        return self._too_few_error(str(error))

    def _too_few_error(self, detail: str) -> MembershipError:
        return MembershipError(
            f"{self.name}: no quorum of at least min_workers={self.min_workers} workers within "
            f"quorum_timeout={self.quorum_timeout:g}s (lighthouse {self._url}); too few workers are alive ({detail})"
        )

    def _record_quorum(self) -> Quorum:
        result, errored = self._recorder.last, self._manager.errored()
        self._recorder.last = None
        quorum = Quorum(quorum_id=int(result.quorum_id), members=tuple(result.replica_ids),
                        index=int(result.replica_rank), max_step=int(result.max_step), healed=self._healed,
                        error=None if errored is None else errored.original_exception)
        if not quorum.usable:
            log.warning("unusable quorum worker=%s quorum_id=%d round=%d error=%s", self.name, quorum.quorum_id,
                        quorum.max_step, str(quorum.error).splitlines()[0][:200])
        if self._quorum is None or quorum.members != self._quorum.members:
            if self._quorum is not None:
                self.membership_changes += 1
            log.info("quorum worker=%s quorum_id=%d size=%d members=%s round=%d healed=%s", self.name,
                     quorum.quorum_id, quorum.size, ",".join(quorum.names), quorum.max_step, quorum.healed)
        self._quorum = quorum
        return quorum

    def _apply_peer_state(self, state: dict[str, Any]) -> None:
        self._load_state_dict(state)
        self._healed = True

    def commit(self, round_index: int, error: Exception | None = None) -> None:
        """End a round: report a failed exchange (after the round's collectives), and record ``round_index``
        rounds as done whatever the outcome, so a worker that kept its own point is not healed over it.

        A reported error bumps the next quorum's id, which rebuilds the process group's connections.
        """
        manager = self._require_manager()
        if error is not None:
            manager.report_error(error)
        manager.should_commit()
        manager.load_state_dict({"step": round_index, "batches_committed": manager.batches_committed()})

    # ------------------------------------------------------------------ accessors
    def _require_manager(self) -> Any:
        if self._manager is None:
            raise RuntimeError(f"{self.name}: membership is not connected (call connect())")
        return self._manager

    @property
    def quorum(self) -> Quorum:
        if self._quorum is None:
            raise RuntimeError(f"{self.name}: no quorum yet (call start_quorum())")
        return self._quorum

    @property
    def process_group(self) -> Any:
        """torchft's reconfigurable ``ProcessGroupGloo``: rank = :attr:`Quorum.index`, size = :attr:`Quorum.size`."""
        return self._require_manager()._pg

    @property
    def lighthouse(self) -> str:
        return self._url

    @property
    def connected(self) -> bool:
        """Between :meth:`connect` and :meth:`shutdown`."""
        return self._manager is not None
