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
- fewer than ``min_workers`` live workers: :meth:`start_quorum` logs that it waits, then raises
  :class:`MembershipError` after ``quorum_timeout``;
- a lighthouse that dies, even with a quorum request in flight: the worker waits for it to come back on the same
  address and goes on (:mod:`~gasloc_lightning.comm.lighthouse_watch`); no request to it waits longer than
  ``lighthouse_timeout``, and a lighthouse down for longer than ``lighthouse_wait`` fails the worker with a
  :class:`MembershipError` that says so;
- a worker that asks after the others committed their end-of-fit average and left (it was stalled, or started
  late): :class:`RunEndedError` at once, read from the lighthouse's last quorum (:mod:`gasloc_lightning.comm.run_end`);
- a failed exchange is reported with :meth:`commit` *after* the round's collectives: torchft turns the
  collectives of an errored manager into no-ops, which would leave the peers waiting for the timeout.

Every service a worker starts (torchft's manager server, the process group's store, gloo's
listener, the state-transfer server) listens on ``endpoint.bind`` (127.0.0.1 unless the caller names
another address) and is advertised as ``endpoint.advertise``. A heal never unpickles: peer state
travels through :class:`~gasloc_lightning.comm.state_transfer.AuthenticatedStateTransport` (the run's
secret, ``weights_only=True``), never through torchft's ``HTTPTransport``.

Nothing here imports Lightning.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from gasloc_lightning.comm.endpoints import Endpoint
from gasloc_lightning.comm.lighthouse_watch import (
    LighthouseWatch,
    RestartSafeQuorum,
    needs_new_group,
    quorum_retries,
    reachable,
)
from gasloc_lightning.comm.run_end import read_last_quorum, run_tag

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs ~10 INFO lines per round otherwise

log = logging.getLogger(__name__)
_QUORUM_DRAIN_S = 5.0  # how long shutdown waits for a quorum in flight on torchft's thread

StateDictFn = Callable[[], dict[str, Any]]
LoadStateDictFn = Callable[[dict[str, Any]], None]
QuorumGroupListener = Callable[[Any, int, tuple[str, ...], int], None]  # (store, quorum_id, members, index)


class MembershipError(RuntimeError):
    """The lighthouse or the quorum could not be reached in time."""


class SurplusWorkerError(MembershipError):
    """This worker was past ``max_workers`` in a quorum and left the run."""


class RunEndedError(MembershipError):
    """The run ended without this worker (the lighthouse's last quorum committed the end-of-fit average; see
    :mod:`gasloc_lightning.comm.run_end`): it leaves instead of waiting for a quorum that will not form."""


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
    return reachable(lighthouse_url(address), timeout=timeout)


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
        heals: how many members heal from this worker in this quorum (torchft's ``recover_dst_replica_ranks``).
    """

    quorum_id: int
    members: tuple[str, ...]
    index: int
    max_step: int
    healed: bool
    error: Exception | None = None
    heals: int = 0

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


class _RefusedPeerState(Exception):
    """``load_state_dict`` refused a peer's state: carried through torchft unchanged, raised again as is."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _QuorumRecorder:
    """Stands in for the Manager's client and keeps the last ``QuorumResult`` (the Manager drops its ``replica_ids``).

    It also makes the result safe across a lighthouse restart (the new lighthouse numbers quorums from 1 again):
    the process group's rendezvous is keyed by members and round too, and a reused id with other members rebuilds
    the group (see :func:`~gasloc_lightning.comm.lighthouse_watch.rendezvous_prefix`)."""

    def __init__(self, client: Any, manager: Any) -> None:
        self._inner = client
        self._manager = manager
        self.last: Any = None
        self._last_ids: list[str] | None = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = RestartSafeQuorum(self._inner._quorum(*args, **kwargs))
        replica_ids = list(result.replica_ids)
        if needs_new_group(int(result.quorum_id), replica_ids, self._manager._quorum_id, self._last_ids):
            log.warning("quorum id %d reused with other members (the lighthouse restarted): new process group",
                        result.quorum_id)
            self._manager._quorum_id = -1  # torchft reconfigures only when the id changes
        self._last_ids = replica_ids
        self.last = result
        return result

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
        max_workers: the largest quorum this worker trains in (``None``: no limit). In a larger quorum the members
            sorted past ``max_workers`` are surplus: they leave with :class:`SurplusWorkerError`, and the others
            treat that quorum as unusable (no exchange) and go on in the next one.
        endpoint: the address every service of this worker listens on and advertises (default: 127.0.0.1).
        secret: the run's secret: a peer's state is only sent to, and taken from, members that know it.
        start_step: the round count this worker resumes at (from its own checkpoint): a worker is healed only if a
            peer is further, so workers resumed at the same round keep their own replicas.
        max_state_bytes: the largest peer state this worker accepts (``None``: any); a larger body is refused
            before it is read.
        lighthouse_timeout: seconds one quorum request may wait for the lighthouse's answer; then it is asked
            again (within ``quorum_timeout``). Within it, torchft sends a request the lighthouse dropped (it died)
            again every 0.5 s, so a lighthouse restarted on the same address answers it.
        lighthouse_wait: seconds this worker waits for a lighthouse that stopped answering to come back on the
            same address; then :class:`MembershipError` (at most ``lighthouse_timeout`` later).
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
        max_workers: int | None = None,
        endpoint: Endpoint | None = None,
        secret: bytes,
        start_step: int = 0,
        max_state_bytes: int | None = None,
        lighthouse_timeout: float = 30.0,
        lighthouse_wait: float = 60.0,
    ) -> None:
        self._url = lighthouse_url(lighthouse)
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
            raise ValueError(f"worker_id must be an int >= 0, got {worker_id!r}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1, got {min_workers!r}")
        for name, value in (("connect_timeout", connect_timeout), ("quorum_timeout", quorum_timeout),
                            ("gossip_timeout", gossip_timeout), ("transfer_timeout", transfer_timeout),
                            ("heartbeat_interval", heartbeat_interval), ("lighthouse_timeout", lighthouse_timeout)):
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
        if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                        or max_workers < min_workers):
            raise ValueError(f"max_workers must be None or an int >= min_workers={min_workers}, got {max_workers!r}")
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("secret must be non-empty bytes (the run's secret; see docs/security.md)")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if max_state_bytes is not None and (isinstance(max_state_bytes, bool) or not isinstance(max_state_bytes, int)
                                            or max_state_bytes < 1):
            raise ValueError(f"max_state_bytes must be None or an int >= 1, got {max_state_bytes!r}")
        self.max_workers, self.start_step, self.max_state_bytes = max_workers, start_step, max_state_bytes
        self.endpoint = endpoint if endpoint is not None else Endpoint()
        self._secret = secret
        self.lighthouse_timeout = float(lighthouse_timeout)
        self._watch = LighthouseWatch(address=self._url, worker=self.name, lighthouse_wait=lighthouse_wait)
        self._manager: Any = None
        self._transport: Any = None
        self._pg: Any = None
        self._store: Any = None
        self._recorder: _QuorumRecorder | None = None
        self._quorum: Quorum | None = None
        self._healed = False
        self._waiting = False
        self._may_have_ended = True  # nothing seen of the run yet, or the last round failed: the run may be over
        self._group_listeners: list[QuorumGroupListener] = []
        self.membership_changes = 0

    # ------------------------------------------------------------------ life cycle
    def connect(self) -> None:
        """Start this worker's services on its endpoint and register with the lighthouse.

        :class:`MembershipError` if the lighthouse is unreachable; whatever was started is stopped again.
        """
        try:
            self._start_services()
        except BaseException:
            self.shutdown()
            raise

    @property
    def heal_server_counters(self) -> dict[str, int]:
        """What peers made this worker's heal server do (``served``, ``refused``, ``aborted``, ``not_staged``,
        ``log_lines_suppressed``; zeros before it starts): the metrics that replace per-request log lines."""
        transport = getattr(self, "_transport", None)
        if transport is None:
            return {"served": 0, "refused": 0, "aborted": 0, "not_staged": 0, "log_lines_suppressed": 0}
        return transport.counters

    def _start_services(self) -> None:
        from torchft import Manager

        from gasloc_lightning.comm.endpoints import BoundProcessGroupGloo, bound_manager_server, listening_store
        from gasloc_lightning.comm.state_transfer import AuthenticatedStateTransport

        endpoint = self.endpoint
        # The quorum's first member's store is the rendezvous of the reconfigured process group.
        self._store = listening_store(endpoint, timeout=self.transfer_timeout)
        self._pg = BoundProcessGroupGloo(endpoint=endpoint, timeout=timedelta(seconds=self.gossip_timeout))
        self._pg.on_configured = self._group_configured
        self._transport = AuthenticatedStateTransport(
            bind=endpoint.bind, advertise=endpoint.advertised, secret=self._secret, timeout=self.transfer_timeout,
            max_bytes=self.max_state_bytes)
        try:
            with bound_manager_server(endpoint):
                self._manager = Manager(
                    pg=self._pg, load_state_dict=self._apply_peer_state, state_dict=self._state_dict,
                    min_replica_size=self.min_workers, use_async_quorum=False,
                    timeout=timedelta(seconds=self.transfer_timeout),
                    quorum_timeout=timedelta(seconds=self.quorum_timeout),
                    connect_timeout=timedelta(seconds=self.connect_timeout),
                    rank=0, world_size=1, store_addr=endpoint.advertised, store_port=self._store.port,
                    hostname=endpoint.advertised_host, lighthouse_addr=self._url, replica_id=self.name,
                    heartbeat_interval=timedelta(seconds=self.heartbeat_interval),
                    checkpoint_transport=self._transport,
                    # a request in flight when the lighthouse dies is sent again, until one restarted answers it
                    quorum_retries=quorum_retries(min(self.quorum_timeout, self.lighthouse_timeout)),
                    init_sync=True,  # founders too take the first member's state: one start, and a signature check
                )
        except RuntimeError as error:
            raise MembershipError(
                f"{self.name}: could not reach the lighthouse at {self._url} within connect_timeout="
                f"{self.connect_timeout:g}s (is it running? check --lighthouse / elastic.lighthouse): {error}"
            ) from error
        # A resumed worker counts its own rounds: it is healed only by a peer that is further.
        self._manager.load_state_dict({"step": self.start_step, "batches_committed": 0})
        # torchft keeps no member list: record it
        self._recorder = _QuorumRecorder(self._manager._client, self._manager)
        self._manager._client = self._recorder

    def shutdown(self) -> None:
        """Stop heartbeating and every service this worker started (idempotent); the lighthouse drops it after
        its heartbeat timeout."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)  # the state transport, the manager server, the quorum thread
            # A quorum asked for before the leave may still be in flight on torchft's quorum thread. torchft 0.2.0
            # does not cancel that request (it runs until the lighthouse answers or quorum_timeout): wait a bounded
            # time. Past it, a late quorum finds the gloo group below closed, and its configure() is refused (torchft
            # logs that refusal as "got exception in pg configure" with a traceback; the worker has left).
            in_flight = getattr(manager, "_quorum_future", None)
            if in_flight is not None:
                concurrent.futures.wait([in_flight], timeout=_QUORUM_DRAIN_S)
            _drop_rust_services(manager, self._recorder)
        if self._transport is not None:
            self._transport.shutdown(wait=True)  # torchft 0.2.0's shutdown(wait=False) leaves a server running
            self._transport = None
        if self._pg is not None:
            _release_process_group(self._pg)
            self._pg = None
        self._store = None  # the last reference: the store's server closes its socket

    def on_quorum_group(self, listener: QuorumGroupListener) -> None:
        """Call ``listener(store, quorum_id, members, index)`` each time the process group is configured for a new
        quorum: in torchft's quorum, right after the gloo rendezvous that every member completes together and before
        any heal (a joiner's heal over a slow link can take ``transfer_timeout``). ``store`` is the quorum's
        rendezvous store. Member authentication attests there (:mod:`~gasloc_lightning.comm.member_auth`)."""
        self._group_listeners.append(listener)

    def _group_configured(self, store: Any) -> None:
        result = None if self._recorder is None else self._recorder.last
        if result is None:
            return
        quorum_id, members, index = int(result.quorum_id), tuple(result.replica_ids), int(result.replica_rank)
        for listener in self._group_listeners:
            listener(store, quorum_id, members, index)

    def leave(self) -> None:
        """Leave the run cleanly after a committed round: stop heartbeating, so the next quorum forms without this
        worker (after the lighthouse's heartbeat timeout) and no peer exchanges with it again."""
        log.info("leaving worker=%s round=%s", self.name, None if self._quorum is None else self._quorum.max_step)
        self.shutdown()

    # ------------------------------------------------------------------ quorum
    def start_quorum(self) -> Quorum:
        """Wait for the next quorum of at least ``min_workers`` (healing from a peer if this worker is behind).

        A smaller quorum (the lighthouse's ``min_replicas`` may be lower) is not trained in: this worker
        asks again until ``quorum_timeout`` has passed, then raises :class:`MembershipError`. A quorum larger than
        ``max_workers`` is unusable (see the argument); a surplus member raises :class:`SurplusWorkerError`.
        """
        with self._waiting_for_quorum():
            return self._wait_for_quorum()

    def _wait_for_quorum(self) -> Quorum:
        deadline = time.monotonic() + self.quorum_timeout
        healed = False
        while True:
            quorum = self._limit_size(self._next_quorum(deadline))
            healed = healed or quorum.healed  # a heal in a quorum too small to train in still happened
            if quorum.size >= self.min_workers:
                return replace(quorum, healed=healed)
            if time.monotonic() >= deadline:
                self._raise_if_run_ended()
                raise self._too_few_error(f"the last quorum had {quorum.size}")
            self._log_waiting()
            time.sleep(0.2)

    @contextmanager
    def _waiting_for_quorum(self) -> Iterator[None]:
        outer, self._waiting = self._waiting, True
        try:
            yield
        finally:
            self._waiting = outer

    @property
    def waiting(self) -> bool:
        """Whether this worker is waiting for a quorum (no round of its own is in progress)."""
        return self._waiting

    def _limit_size(self, quorum: Quorum) -> Quorum:
        """Enforce ``max_workers``: gamma was checked for the sizes up to it, no further."""
        if self.max_workers is None or quorum.size <= self.max_workers:
            return quorum
        if quorum.index >= self.max_workers:
            self.leave()
            raise SurplusWorkerError(
                f"{self.name}: the quorum has {quorum.size} workers, more than max_workers={self.max_workers}, and this "
                f"worker is surplus (index {quorum.index} of {','.join(quorum.names)}); it leaves. Raise max_workers "
                "(elastic.max_workers) on every worker to train with more."
            )
        error = MembershipError(f"quorum of {quorum.size} workers exceeds max_workers={self.max_workers}: "
                                "its surplus members leave, this round exchanges nothing")
        log.warning("oversized quorum worker=%s size=%d max_workers=%d", self.name, quorum.size, self.max_workers)
        return replace(quorum, error=error)

    def join(self) -> Quorum:
        """The first quorum this worker trains in: like :meth:`start_quorum`, but an unusable one (a member died
        while it formed, so this worker may not have received a peer's state) is reported and asked again,
        instead of training a round from this worker's own start. :class:`MembershipError` after ``quorum_timeout``.
        """
        with self._waiting_for_quorum():
            time.sleep(self.first_quorum_delay)  # heartbeating meanwhile: see the argument's doc
        deadline = time.monotonic() + self.quorum_timeout
        quorum = self.start_quorum()
        healed = quorum.healed
        while not quorum.usable:
            if time.monotonic() >= deadline:
                raise MembershipError(f"{self.name}: no usable quorum to join within quorum_timeout="
                                      f"{self.quorum_timeout:g}s (the last failed with: {quorum.error})")
            log.info("joining again worker=%s (the quorum failed as it formed)", self.name)
            self.commit(quorum.max_step if healed else self.start_step, quorum.error)
            quorum = self.start_quorum()
            healed = healed or quorum.healed
        return replace(quorum, healed=healed)

    def _next_quorum(self, deadline: float) -> Quorum:
        """One quorum from the lighthouse; a failed request (a timeout or any other error) is asked again until
        ``deadline``, then :class:`MembershipError` says why. No request waits longer than ``lighthouse_timeout``."""
        while True:
            try:
                if self._may_have_ended:
                    self._raise_if_run_ended()
                self._wait_for_lighthouse(deadline)
                return self._ask_quorum(max(0.1, min(deadline - time.monotonic(), self.lighthouse_timeout)))
            except _RefusedPeerState as refused:  # this worker refused to join: not a quorum failure
                raise refused.error from refused.error.__cause__
            except RunEndedError:
                raise
            except Exception as error:  # noqa: BLE001 - torchft raises RuntimeError, TimeoutError, ...
                self._require_manager()._quorum_future = None  # torchft re-raises a failed quorum forever otherwise
                if self._watch.gone:
                    raise MembershipError(self._watch.gone_message()) from error
                if time.monotonic() >= deadline:
                    self._raise_if_run_ended()
                    raise self._quorum_error(error) from error
                log.warning("quorum request failed worker=%s error=%s (asking again)", self.name,
                            str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__)
                time.sleep(0.2)

    def _raise_if_run_ended(self) -> None:
        """A worker that asks after the others committed their end-of-fit average and left (it was stalled, or started
        late): :class:`RunEndedError`, read from the lighthouse's last quorum, instead of a quorum that never forms."""
        last = read_last_quorum(self._url, timeout=min(self.connect_timeout, 5.0))
        if last is not None and last.ended(self.run_tag):
            raise RunEndedError(f"{self.name}: the run has ended without this worker: the lighthouse's last quorum "
                                f"({','.join(last.names)}) committed the end-of-fit average")

    def _wait_for_lighthouse(self, deadline: float) -> None:
        """Ask only when the lighthouse answers (it may restart on the same address): a request sent while it is
        down only waits for torchft's next try. :class:`MembershipError` once it has been down ``lighthouse_wait``."""
        self._watch.wait_until_up(deadline)
        if self._watch.gone:
            raise MembershipError(self._watch.gone_message())

    def _ask_quorum(self, timeout: float) -> Quorum:
        manager = self._require_manager()
        self._healed = False
        waiting = threading.Timer(min(2.0, timeout / 4), self._log_waiting)
        waiting.daemon = True
        waiting.start()
        try:
            with self._watch.watching():  # a lighthouse that dies meanwhile is logged, and its down time counted
                manager.start_quorum(timeout=timedelta(seconds=timeout))
        finally:
            waiting.cancel()
        if self._recorder.last is None:
            raise RuntimeError(f"quorum failed: {manager.errored().original_exception}")
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
        if isinstance(error, TimeoutError) or "timed out" in str(error).lower():
            return self._too_few_error(str(error))
        return MembershipError(f"{self.name}: no quorum within quorum_timeout={self.quorum_timeout:g}s "
                               f"(lighthouse {self._url}); the last request failed with: {error}")

    def _too_few_error(self, detail: str) -> MembershipError:
        return MembershipError(
            f"{self.name}: no quorum of at least min_workers={self.min_workers} workers within "
            f"quorum_timeout={self.quorum_timeout:g}s (lighthouse {self._url}); too few workers are alive ({detail})"
        )

    def _record_quorum(self) -> Quorum:
        result, errored = self._recorder.last, self._manager.errored()
        if errored is not None:
            _release_frames(errored.original_exception)
        self._recorder.last = None
        quorum = Quorum(quorum_id=int(result.quorum_id), members=tuple(result.replica_ids),
                        index=int(result.replica_rank), max_step=int(result.max_step), healed=self._healed,
                        error=None if errored is None else errored.original_exception,
                        heals=len(result.recover_dst_replica_ranks or ()))
        if not quorum.usable:
            log.warning("unusable quorum worker=%s quorum_id=%d round=%d error=%s", self.name, quorum.quorum_id,
                        quorum.max_step, str(quorum.error).splitlines()[0][:200])
        if self._quorum is None or quorum.members != self._quorum.members:
            if self._quorum is not None:
                self.membership_changes += 1
            log.info("quorum worker=%s quorum_id=%d size=%d members=%s round=%d healed=%s", self.name,
                     quorum.quorum_id, quorum.size, ",".join(quorum.names), quorum.max_step, quorum.healed)
        self._quorum, self._may_have_ended = quorum, False
        return quorum

    def _apply_peer_state(self, state: dict[str, Any]) -> None:
        try:
            self._load_state_dict(state)
        except Exception as error:
            raise _RefusedPeerState(error) from error
        self._healed = True

    def wait_for_healers(self, quorum: Quorum) -> bool:
        """Wait until every member that heals from this worker in ``quorum`` has fetched its state, or was refused it
        for want of the run's secret (at most ``transfer_timeout``); whether they all were answered. Inside a round
        the collective that follows keeps the source alive for its healers; where none follows (the end-of-fit
        decision), a source that left at once would cut them off. No wait when torchft staged nothing for this
        quorum (it failed before staging)."""
        transport = self._transport
        if quorum.heals == 0 or not quorum.usable or transport is None or transport.staged_step != quorum.max_step:
            return quorum.heals == 0  # nothing to hand over: torchft failed before staging (pg configure, ...)
        answered = transport.wait_answered(quorum.max_step, quorum.heals, timeout=self.transfer_timeout)
        if not answered:
            log.warning("healers did not fetch this worker's state worker=%s heals=%d step=%d within "
                        "transfer_timeout=%gs", self.name, quorum.heals, quorum.max_step, self.transfer_timeout)
        return answered

    def commit(self, round_index: int, error: Exception | None = None) -> None:
        """End a round: report a failed exchange (after the round's collectives), and record ``round_index``
        rounds as done whatever the outcome, so a worker that kept its own point is not healed over it.

        A reported error bumps the next quorum's id, which rebuilds the process group's connections.
        """
        manager = self._require_manager()
        if error is not None:
            manager.report_error(error)
            self._may_have_ended = True  # e.g. this worker was stalled and its peers are gone
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
    def run_tag(self) -> int:
        """Tells this run's end-of-fit commit from another run's on the same lighthouse (from the run's secret)."""
        return run_tag(self._secret)

    @property
    def state_transfer_address(self) -> str | None:
        """``http://HOST:PORT`` of this worker's state-transfer server (None when not connected)."""
        return None if self._transport is None else self._transport.metadata()

    @property
    def connected(self) -> bool:
        """Between :meth:`connect` and :meth:`shutdown`."""
        return self._manager is not None


def _drop_rust_services(manager: Any, recorder: _QuorumRecorder | None) -> None:
    """Drop the shut-down Manager's Rust server and client now, and with them their tokio runtimes' threads
    ("torchft-manager", "torchft-mgrclnt").

    torchft 0.2.0 keeps the Manager in a reference cycle (its ``_ManagerLogger`` points back at it; our recorder is
    another), so without this those threads live on until the garbage collector runs. A process that forks later
    (a fork-started Lightning launch, a test after this one) would copy locks those threads hold into its child."""
    manager._manager = None  # the ManagerServer: already shut down by Manager.shutdown
    manager._client = None
    if recorder is not None:
        recorder._inner = None
    errored = manager.errored()
    if errored is not None:
        _release_frames(errored.original_exception)


def _release_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback (and those of its causes), keeping the
    exception and its message. A failed heal's traceback holds torchft's quorum frame, and in it the client it opened
    to the heal source, with that client's runtime threads: whoever keeps the error (a Quorum, a log record) would
    keep them running until a garbage collection (see _drop_rust_services)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _release_process_group(pg: Any) -> None:
    """Close the reconfigurable gloo group: gloo releases its listener, connections and threads only with the
    backend's last reference, which ``close()`` drops."""
    try:
        pg.close()
    except Exception as error:  # noqa: BLE001 - an unconfigured group has nothing to close
        log.debug("process group close: %s", error)
