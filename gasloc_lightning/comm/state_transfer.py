"""AuthenticatedStateTransport: torchft's checkpoint transport (the heal of a joining worker), made safe.

When a worker joins (or falls behind), torchft's ``Manager`` asks an up-to-date peer to ``send_checkpoint``
its state and the joiner to ``recv_checkpoint`` it. torchft 0.2.0's default ``HTTPTransport`` unpickles what
it fetches (``weights_only=False``: a rogue peer runs code on the joiner), listens on every interface, serves
anyone, and its ``disallow_checkpoint`` waits on a lock that a slow reader holds, so a slow reader makes
``Manager.should_commit`` raise. This transport replaces it:

- it listens on ``bind`` only (an ephemeral port) and advertises ``http://advertise:port/instance`` (a random
  id drawn at start);
- both directions are signed with the run's secret (HMAC-SHA256, :mod:`~gasloc_lightning.comm.wire`): the
  request over (the server it is addressed to: its address and instance; step; a fresh nonce), the response
  over (step, nonce, sha256 of the body). The server answers only members of the run, only requests addressed to itself (a heal source
  without the secret cannot relay a joiner's request to an honest member, nor replay one to a restarted
  server at the same address), and each nonce once (no replay);
  the client takes a state only from a member;
- a request for a step not staged yet waits at most 1 s for it, then gets 503: the client asks
  again, with a fresh nonce, until its deadline (a request is never held for the whole deadline);
- ``send_checkpoint`` serializes the state at once into bytes; ``disallow_checkpoint`` drops them and never
  waits (a response in flight keeps its own reference and ends by itself, within ``timeout``);
- a received body is loaded only once its signature checks out, and then still only through
  :func:`~gasloc_lightning.comm.wire.load_state` (``weights_only=True``: a member may be compromised) and
  :func:`~gasloc_lightning.comm.wire.check_plain`; comparing it with the local state's shapes
  (:func:`~gasloc_lightning.comm.wire.check_like`) is the caller's, who knows that state;
- one deadline bounds a whole transfer on either side (name resolution, connect, headers, body), not each read;
  a host name is resolved once, and its addresses share what is left of the deadline;
- what a peer can trigger (refusals, aborted connections, server errors) is counted in :attr:`counters` and
  logged at most a few lines a minute per kind, so no client can fill a disk with log lines.

The body is not encrypted: a peer's state crosses the network in clear, as with torchft's own transport.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import ipaddress
import logging
import math
import random
import re
import secrets
import socket
import socketserver
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from gasloc_lightning.comm import wire
from gasloc_lightning.comm.wire import UnsafePayloadError

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ImportError:
    # The base install has no torchft. The interface is an ABC with no state or behaviour of its own,
    # so without torchft the transport is the same class on `object` (and nothing can hand it to a Manager).
    CheckpointTransport = object  # type: ignore[misc,assignment]

log = logging.getLogger(__name__)

NONCE_HEADER = "X-Gasloc-Nonce"
MAC_HEADER = "X-Gasloc-Mac"
LENGTH_MAC_HEADER = "X-Gasloc-Length-Mac"
_STATE_PATH = re.compile(r"/state/(\d{1,19})", re.ASCII)
_NONCE = re.compile(r"[0-9a-f]{32,128}", re.ASCII)
_INSTANCE = re.compile(r"[0-9a-f]{32}", re.ASCII)
_READ_CHUNK = 1 << 20
_MAX_CONNECTIONS = 8  # connections served at once; more are closed at once
_POLL_INTERVAL = 0.05  # seconds: how fast the serving loop notices a shutdown
_SEEN_NONCES = 4096  # signed requests remembered (only a member can add one: 4096 heals before one is forgotten)
_ANSWERED_STEPS_KEPT = 64  # steps whose answered requests are counted (wait_answered), the latest first kept
_STAGE_WAIT = 1.0  # seconds a signed request waits for its step to be staged before it gets 503
_RETRY_FIRST, _RETRY_MAX = 0.02, 0.2  # seconds between a client's asks for a step not staged yet (doubling)
_LOG_LINES, _LOG_WINDOW = 5, 60.0  # at most this many lines per kind of peer-triggered event per window (s)


class StateTransferError(RuntimeError):
    """A peer's state could not be fetched: unreachable, refused, cut short, or past the deadline."""


class _NotStagedYet(Exception):
    """The source has not staged the step yet (503): ask again with a fresh nonce."""


class _Staged(NamedTuple):
    step: int
    payload: bytes
    digest: bytes  # sha256 of payload, signed in every response


class AuthenticatedStateTransport(CheckpointTransport):
    """torchft ``CheckpointTransport`` over HTTP: signed both ways with the run's secret, loaded safely.

    Args:
        bind: the host or IP this server listens on, e.g. ``"127.0.0.1"`` or ``"::1"``. A wildcard
            (``"0.0.0.0"``, ``"::"``) only when passed explicitly, and then ``advertise`` is required.
        advertise: the host peers fetch from, put in :meth:`metadata` (default: ``bind``); never a wildcard.
        secret: the run's secret (non-empty bytes, e.g. :func:`~gasloc_lightning.comm.wire.run_secret`).
        timeout: seconds that one served transfer may take in all (reading the request, writing the body).
        max_bytes: refuse to receive a body longer than this (None: no limit).

    Attributes:
        served: transfers served in full.
        refused: requests refused (unsigned, addressed to another server, a nonce seen before, unknown path,
            nothing staged, another step) and connections turned away (more than 8 at once).
        aborted: connections that broke or passed their deadline mid-request.
        not_staged: requests whose step was not staged within 1 s (answered 503; the client asks again).
    """

    def __init__(self, *, bind: str, advertise: str | None = None, secret: bytes, timeout: float,
                 max_bytes: int | None = None) -> None:
        _check_arguments(bind, advertise, secret, timeout, max_bytes)
        self._secret, self.timeout, self.max_bytes = secret, float(timeout), max_bytes
        self._advertise = bind if advertise is None else advertise
        # Names this server among all that ever ran at advertise:port (a restarted worker reuses the address and
        # may stage the same step again): requests are signed for it, so a request captured before a restart,
        # whose nonce the new server has never seen, is still refused.
        self.instance = secrets.token_hex(16)
        self._staged: _Staged | None = None
        self._retired_step = -1  # states up to this step were served and dropped: requests for them are refused
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._seen: OrderedDict[str, None] = OrderedDict()  # nonces of signed requests, oldest first
        self.served = self.refused = self.aborted = self.not_staged = 0
        self._answered_by_step: OrderedDict[int, int] = OrderedDict()  # requests answered for good, per step
        self._log = _RateLimitedLog(lines=_LOG_LINES, window=_LOG_WINDOW)
        self._server = _Server(bind, self)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_INTERVAL,),
                                        name=f"gasloc-state-server-{self.port}", daemon=True)
        self._thread.start()
        log.info("state transfer server started bind=%s port=%d advertise=%s",
                 bind, self.port, self._advertise)

    # ------------------------------------------------------------------ properties
    @property
    def port(self) -> int:
        """The port this server listens on."""
        return self._server.server_address[1]

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs (False after :meth:`shutdown`)."""
        return self._thread.is_alive()

    @property
    def staged_step(self) -> int | None:
        """The step of the state being served, or None."""
        staged = self._staged
        return None if staged is None else staged.step

    @property
    def counters(self) -> dict[str, int]:
        """What peers made this server do, for metrics: ``served``, ``refused``, ``aborted``, ``not_staged`` and
        ``log_lines_suppressed`` (peer-triggered log lines over the rate limit, counted instead of written)."""
        return {"served": self.served, "refused": self.refused, "aborted": self.aborted,
                "not_staged": self.not_staged, "log_lines_suppressed": self._log.suppressed}

    @property
    def staged_bytes(self) -> int:
        """Bytes of the state being served (0 when none is)."""
        staged = self._staged
        return 0 if staged is None else len(staged.payload)

    # ------------------------------------------------------------------ CheckpointTransport
    def metadata(self) -> str:
        """``http://advertise:port/instance``: what a peer's :meth:`recv_checkpoint` is given to fetch from here."""
        return f"http://{_target(self._advertise, self.port)}/{self.instance}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serialize ``state_dict`` now and serve it for ``step`` until :meth:`disallow_checkpoint`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._closed:
            raise StateTransferError("send_checkpoint after shutdown")
        payload = wire.dump_state(state_dict)
        # One attribute, replaced whole: a handler reads it once and keeps that copy, so no lock is shared
        # with disallow_checkpoint (torchft's HTTPTransport shares one, and a slow reader then blocks it).
        with self._lock:  # wakes the requests that came (at most _STAGE_WAIT) before the state was ready
            self._staged = _Staged(step, payload, hashlib.sha256(payload).digest())
            self._lock.notify_all()
        log.info("state staged step=%d bytes=%d dst_ranks=%s", step, len(payload), list(dst_ranks))

    def disallow_checkpoint(self) -> None:
        """Stop serving the staged state and drop it; never waits (runs inside ``Manager.should_commit``)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._retired_step = max(self._retired_step, staged.step)
            log.info("state unstaged step=%d bytes=%d", staged.step, len(staged.payload))

    def wait_answered(self, step: int, count: int, timeout: float) -> bool:
        """Wait until ``count`` requests for the state of ``step`` were answered for good, at most ``timeout`` seconds
        or until :meth:`shutdown`; whether they were. Answered for good: served in full (a healer has it), or refused
        as not signed with the run's secret (a requester that can never have it: an intruder in the quorum). A
        source that left right after staging would cut its healers off: where no collective follows the heal (the
        end-of-fit decision), it waits here. Anyone who can reach the port can end this wait early with unsigned
        requests; the healer it cuts off then reports that it has no final model, as when the source dies. Unsigned
        requests for 64 other steps make it forget the step's count, and so wait out ``timeout``."""
        def answered() -> bool:
            return self._answered_by_step.get(step, 0) >= count

        with self._lock:
            return self._lock.wait_for(lambda: answered() or self._closed, timeout=timeout) and answered()

    def _answered(self, step: int) -> None:
        """Counts a request for ``step`` answered for good (the caller holds the lock). An unsigned request may come
        before its step is staged (a peer asks as soon as the quorum answers): it counts all the same."""
        self._answered_by_step[step] = self._answered_by_step.pop(step, 0) + 1
        while len(self._answered_by_step) > _ANSWERED_STEPS_KEPT:
            self._answered_by_step.popitem(last=False)
        self._lock.notify_all()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | float) -> Any:
        """Fetch, authenticate and safely load a peer's state for ``step``, within ``timeout`` in all.

        Raises:
            StateTransferError: the peer is unreachable, refuses, cuts the body short, or the deadline passes.
            UnsafePayloadError: the body is not signed with this run's secret, or not tensors and plain data.
        """
        seconds = _seconds(timeout)
        start = time.monotonic()
        deadline = start + seconds
        source = f"src_rank={src_rank} address={metadata} step={step}"
        host, port, instance = _parse_metadata(metadata)
        try:
            payload = self._fetch_when_staged(host, port, instance, step, deadline, source)
        except TimeoutError as error:
            raise StateTransferError(f"state transfer {source} exceeded timeout={seconds:g}s") from error
        except (OSError, http.client.HTTPException) as error:
            raise StateTransferError(f"state transfer {source} failed: {error!r}") from error
        state = _load(payload, self.max_bytes, source)
        log.info("state received %s bytes=%d seconds=%.3f", source, len(payload), time.monotonic() - start)
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and close the port (also with ``wait=False``); idempotent.

        Args:
            wait: also wait, up to ``timeout``, for responses in flight to end.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()  # wakes wait_answered
        self._staged = None
        self._server.shutdown()  # returns once the serving loop has stopped (within _POLL_INTERVAL)
        self._server.server_close()
        self._thread.join(timeout=self.timeout)
        if wait:
            with self._lock:
                self._lock.wait_for(lambda: self._in_flight == 0, timeout=self.timeout)
        log.info("state transfer server stopped port=%d served=%d refused=%d",
                 self.port, self.served, self.refused)

    def __enter__(self) -> AuthenticatedStateTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ client
    def _fetch_when_staged(self, host: str, port: int, instance: str, step: int, deadline: float,
                           source: str) -> bytearray:
        """torchft's joiner asks as soon as the quorum forms, while the source may still be serializing its state:
        the source holds a request at most 1 s for it, then answers 503, and this asks again until the deadline."""
        addresses = _resolve(host, port, deadline)  # once: a slow resolver is not paid again on each ask
        pause = _RETRY_FIRST
        while True:
            nonce = secrets.token_hex(16)
            try:
                payload, mac = self._fetch(host, port, instance, addresses, step, nonce, deadline, source)
            except _NotStagedYet:
                time.sleep(min(pause * random.uniform(0.5, 1.0), _left(deadline)))
                pause = min(2 * pause, _RETRY_MAX)
                continue
            if not wire.verify(self._secret, mac, b"response", _step_bytes(step), nonce.encode(),
                               hashlib.sha256(payload).digest()):
                raise UnsafePayloadError(f"state transfer {source}: response not signed with this run's secret")
            return payload

    def _fetch(self, host: str, port: int, instance: str, addresses: list[Any], step: int, nonce: str,
               deadline: float, source: str) -> tuple[bytearray, str | None]:
        mac = wire.sign(self._secret, b"request", _target(host, port, instance).encode(), _step_bytes(step),
                        nonce.encode())
        with _connect(addresses, deadline) as sock:
            sock.settimeout(_left(deadline))
            sock.sendall(_request(host, port, step, nonce, mac))
            response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline))
            response.begin()
            length = self._body_length(response, source)
            # signed before the body is read: an unauthenticated source cannot make this worker read much
            if not wire.verify(self._secret, response.getheader(LENGTH_MAC_HEADER), b"length", _step_bytes(step),
                               nonce.encode(), str(length).encode()):
                raise UnsafePayloadError(f"state transfer {source}: response not signed with this run's secret")
            return _read_body(response, length), response.getheader(MAC_HEADER)

    def _body_length(self, response: http.client.HTTPResponse, source: str) -> int:
        if response.status == 503:
            raise _NotStagedYet()
        if response.status != 200:
            raise StateTransferError(f"state transfer {source} refused: {response.status} {response.reason}")
        if response.chunked or response.length is None:
            raise StateTransferError(f"state transfer {source}: response has no Content-Length")
        if self.max_bytes is not None and response.length > self.max_bytes:
            raise StateTransferError(f"state transfer {source}: body of {response.length} bytes "
                                     f"exceeds max_bytes={self.max_bytes}")
        return response.length

    # ------------------------------------------------------------------ server
    def _answer(self, handler: _Handler) -> None:
        try:
            step, nonce, refusal = self._authenticate(handler)
            # read once: disallow_checkpoint may drop it now, this response keeps it
            staged = self._staged if refusal is not None else self._wait_for_stage(step, handler.deadline)
            if refusal is None and self._not_staged_yet(staged, step):
                self._answer_not_staged(handler, step)
                return
            if refusal is None:
                refusal = _staged_refusal(staged, step)
            if refusal is not None:
                self._refuse(handler, *refusal)
            else:
                self._send(handler, staged, nonce)
        except OSError as error:  # the client left, or the deadline passed: that transfer only
            handler.close_connection = True
            self._count_aborted(handler.client_address, error)

    def _wait_for_stage(self, step: int, deadline: float) -> _Staged | None:
        """The joiner usually asks before the source has serialized its state: a signed request waits for it, but
        at most _STAGE_WAIT (a held request keeps one of the 8 connections; the client asks again after a 503)."""
        end = min(deadline, time.monotonic() + _STAGE_WAIT)
        with self._lock:
            while self._not_staged_yet(self._staged, step) and (left := end - time.monotonic()) > 0:
                self._lock.wait(min(left, 4 * _POLL_INTERVAL))
            return self._staged

    def _not_staged_yet(self, staged: _Staged | None, step: int) -> bool:
        return not self._closed and step > self._retired_step and (staged is None or staged.step < step)

    def _answer_not_staged(self, handler: _Handler, step: int) -> None:
        # Never held until the deadline: the nonce is spent either way, and the client asks again with a fresh one.
        with self._lock:
            self.not_staged += 1
        log.debug("state request before its step was staged peer=%s step=%d", handler.client_address[0], step)
        handler.close_connection = True
        handler.send_error(503, "step not staged yet")

    def _authenticate(self, handler: _Handler) -> tuple[int, str, tuple[int, str] | None]:
        match = _STATE_PATH.fullmatch(handler.path)
        nonce = handler.headers.get(NONCE_HEADER, "")
        if match is None:
            return -1, nonce, (404, "unknown path")
        step = int(match.group(1))
        # Signed over this server's own advertised address and instance: a request a joiner addressed to another
        # server (a heal source without the secret that relays it here), or to an earlier server at this address
        # (captured before a restart), does not verify.
        if not _NONCE.fullmatch(nonce) or not wire.verify(
                self._secret, handler.headers.get(MAC_HEADER), b"request",
                _target(self._advertise, self.port, self.instance).encode(), _step_bytes(step), nonce.encode()):
            with self._lock:
                self._answered(step)  # it can never have this step's state: wait_answered need not wait for it
            return step, nonce, (403, "request not signed with this run's secret for this server")
        if not self._first_use(nonce):
            return step, nonce, (403, "nonce seen before (a replayed request)")
        return step, nonce, None

    def _first_use(self, nonce: str) -> bool:
        """Records a signed request's nonce; False if it was seen before. Only a member (who knows the secret) can
        add one, so a bounded record cannot be flushed by anyone who could replay: that needs a signed request."""
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen[nonce] = None
            if len(self._seen) > _SEEN_NONCES:
                self._seen.popitem(last=False)
            return True

    def _count_refusal(self) -> None:
        with self._lock:
            self.refused += 1

    def _count_aborted(self, client_address: Any, error: BaseException) -> None:
        with self._lock:
            self.aborted += 1
        self._log(logging.WARNING, "aborted", "state transfer aborted peer=%s error=%r",
                  _peer(client_address), error)

    def _refuse(self, handler: _Handler, code: int, reason: str) -> None:
        self._count_refusal()
        self._log(logging.WARNING, "refused", "state request refused peer=%s path=%r code=%d reason=%s",
                  handler.client_address[0], handler.path[:80], code, reason)
        handler.close_connection = True
        handler.send_error(code, reason)

    def _send(self, handler: _Handler, staged: _Staged, nonce: str) -> None:
        mac = wire.sign(self._secret, b"response", _step_bytes(staged.step), nonce.encode(), staged.digest)
        handler.connection.settimeout(_left(handler.deadline))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(staged.payload)))
        handler.send_header(MAC_HEADER, mac)
        handler.send_header(LENGTH_MAC_HEADER, wire.sign(self._secret, b"length", _step_bytes(staged.step),
                                                         nonce.encode(), str(len(staged.payload)).encode()))
        handler.end_headers()
        # Since Python 3.5 a socket timeout bounds a whole sendall, so this is the rest of the deadline.
        handler.connection.settimeout(_left(handler.deadline))
        handler.wfile.write(staged.payload)
        with self._lock:
            self.served += 1
            self._answered(staged.step)
        log.info("state served peer=%s step=%d bytes=%d", handler.client_address[0], staged.step,
                 len(staged.payload))

    def _track(self, delta: int) -> None:
        with self._lock:
            self._in_flight += delta
            self._lock.notify_all()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck connection never holds up shutdown or the interpreter's exit
    request_queue_size = 64

    def process_request(self, request: Any, client_address: Any) -> None:
        # At most _MAX_CONNECTIONS threads: a flood of connections is turned away, not given a thread each.
        if not self.slots.acquire(blocking=False):
            self.transport._count_refusal()
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def __init__(self, bind: str, transport: AuthenticatedStateTransport) -> None:
        try:
            family, _, _, _, address = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as error:
            raise ValueError(f"bind={bind!r} is not a host or IP of this machine: {error}") from error
        self.address_family = family
        self.transport = transport
        self.slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        try:
            super().__init__(address, _Handler)
        except OSError as error:
            raise ValueError(f"bind={bind!r} cannot be listened on: {error}") from error

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host's FQDN up, which can wait on DNS; nothing here needs it.
        socketserver.TCPServer.server_bind(self)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Called inside an ``except``: a client that resets mid-request is an aborted transfer, not a server error,
        # and neither is worth a traceback per connection (one client wrote 460 KB/s of them).
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self.transport._count_aborted(client_address, error)
        else:
            self.transport._log(logging.ERROR, "error", "state transfer server error peer=%s error=%r",
                                _peer(client_address), error, exc_info=error)  # a bug: its traceback, rate-limited


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def setup(self) -> None:
        self.timeout = self.server.transport.timeout
        self.deadline = time.monotonic() + self.timeout
        super().setup()
        # One deadline for the whole request: per-read timeouts alone let a client that trickles a byte
        # at a time hold this thread for ever.
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.deadline))
        self.server.transport._track(+1)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.transport._track(-1)

    def do_GET(self) -> None:
        self.server.transport._answer(self)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("state transfer server peer=%s %s", self.client_address[0], format % args)


class _DeadlineReader(io.RawIOBase):
    """Reads a socket under one deadline for all reads together."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What ``http.client.HTTPResponse`` needs of a socket, reading under one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


# ------------------------------------------------------------------ helpers
def _check_arguments(bind: Any, advertise: Any, secret: Any, timeout: Any, max_bytes: Any) -> None:
    if not isinstance(bind, str) or not bind:
        raise ValueError(f"bind must be a non-empty host or IP, got {bind!r}")
    if _is_wildcard(bind) and advertise is None:
        raise ValueError(f"advertise is required when bind={bind!r} is a wildcard: peers cannot reach it")
    if advertise is not None and (not isinstance(advertise, str) or not advertise or _is_wildcard(advertise)):
        raise ValueError(f"advertise must be a host or IP peers can reach, not a wildcard; got {advertise!r}")
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("secret must be non-empty bytes (the run's secret)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes < 1):
        raise ValueError(f"max_bytes must be None or an int >= 1, got {max_bytes!r}")


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _target(host: str, port: int, instance: str | None = None) -> str:
    """``host:port`` as a client parses it from :meth:`AuthenticatedStateTransport.metadata` (urllib lowers the
    host's case), and with ``/instance``: what a request is signed for, and what a server checks against its own."""
    address = f"{_url_host(host.lower())}:{port}"
    return address if instance is None else f"{address}/{instance}"


def _peer(client_address: Any) -> str:
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else "?"


def _step_bytes(step: int) -> bytes:
    return str(step).encode("ascii")


def _seconds(timeout: timedelta | float) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a timedelta or seconds > 0, got {timeout!r}")
    return float(seconds)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _parse_metadata(metadata: str) -> tuple[str, int, str]:
    """``(host, port, instance)`` of ``http://host:port/instance`` (no instance: "", which no server has)."""
    try:
        parts = urllib.parse.urlsplit(metadata)
        host, port = parts.hostname, parts.port
    except (TypeError, ValueError, AttributeError) as error:
        raise StateTransferError(f"metadata={metadata!r} is not http://host:port/instance") from error
    instance = parts.path.strip("/")
    if (parts.scheme != "http" or not host or port is None or parts.query or parts.fragment
            or (instance and not _INSTANCE.fullmatch(instance))):
        raise StateTransferError(f"metadata={metadata!r} is not http://host:port/instance")
    return host, port, instance


def _resolve(host: str, port: int, deadline: float) -> list[Any]:
    """``getaddrinfo`` under the deadline: the resolver has no timeout of its own, and the name comes from an
    unauthenticated manager server. A lookup past the deadline is left to finish on its own daemon thread."""
    result: dict[str, Any] = {}

    def lookup() -> None:
        try:
            result["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            result["error"] = error

    thread = threading.Thread(target=lookup, name=f"gasloc-state-resolve-{host[:40]}", daemon=True)
    thread.start()
    thread.join(_left(deadline))
    if thread.is_alive():
        raise TimeoutError(f"resolving {host!r} passed the deadline")
    if "error" in result:
        raise result["error"]
    if not result["addresses"]:
        raise OSError(f"{host!r} resolves to no address")
    return result["addresses"]


def _connect(addresses: list[Any], deadline: float) -> socket.socket:
    """Connects to the first address that answers, each given an equal share of what is left of the deadline
    (``socket.create_connection`` gives each the whole timeout: five dead addresses took five timeouts)."""
    error: OSError | None = None
    for index, (family, kind, proto, _, address) in enumerate(addresses):
        share = _left(deadline) / (len(addresses) - index)
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(share)
            sock.connect(address)
            return sock
        except OSError as failed:
            sock.close()
            error = failed
    assert error is not None
    raise error


def _request(host: str, port: int, step: int, nonce: str, mac: str) -> bytes:
    lines = [f"GET /state/{step} HTTP/1.0", f"Host: {_url_host(host)}:{port}", f"{NONCE_HEADER}: {nonce}",
             f"{MAC_HEADER}: {mac}", "", ""]
    return "\r\n".join(lines).encode("ascii")


def _read_body(response: http.client.HTTPResponse, length: int) -> bytearray:
    # In chunks: a claimed Content-Length allocates nothing until the bytes actually arrive.
    body = bytearray()
    while len(body) < length:
        chunk = response.read(min(_READ_CHUNK, length - len(body)))
        if not chunk:
            raise http.client.IncompleteRead(bytes(0), length - len(body))
        body += chunk
    return body


class _RateLimitedLog:
    """Log lines a peer can trigger: at most ``lines`` per ``window`` seconds for each kind; the rest are counted
    (:attr:`suppressed`) and the next line written says how many were left out."""

    def __init__(self, *, lines: int, window: float) -> None:
        self.lines, self.window, self.suppressed = lines, window, 0
        self._lock = threading.Lock()
        self._kinds: dict[str, list[float]] = {}  # kind -> [window start, lines written in it, left out since]

    def __call__(self, level: int, kind: str, message: str, *args: Any, exc_info: BaseException | None = None) -> None:
        with self._lock:
            now = time.monotonic()
            state = self._kinds.setdefault(kind, [now, 0, 0])
            if now - state[0] >= self.window:
                state[0], state[1] = now, 0
            if state[1] >= self.lines:
                state[2] += 1
                self.suppressed += 1
                return
            state[1] += 1
            left_out, state[2] = int(state[2]), 0
        log.log(level, message + " left_out_since_last=%d", *args, left_out, exc_info=exc_info)


def _staged_refusal(staged: _Staged | None, step: int) -> tuple[int, str] | None:
    if staged is None:
        return 404, "no state staged"
    if staged.step != step:
        return 409, f"staged step={staged.step}, requested step={step}"
    return None


def _load(payload: bytearray, max_bytes: int | None, source: str) -> Any:
    try:
        state = wire.load_state(payload, max_bytes=max_bytes)
        # Tensors and plain data only; finiteness is the caller's (check_like): a model may keep -inf masks.
        wire.check_plain(state, finite=False)
    except UnsafePayloadError as error:
        raise UnsafePayloadError(f"state transfer {source}: {error}") from error
    return state
