"""AuthenticatedStateTransport: torchft's checkpoint transport (the heal of a joining worker), made safe.

When a worker joins (or falls behind), torchft's ``Manager`` asks an up-to-date peer to ``send_checkpoint``
its state and the joiner to ``recv_checkpoint`` it. torchft 0.2.0's default ``HTTPTransport`` unpickles what
it fetches (``weights_only=False``: a rogue peer runs code on the joiner), listens on every interface, serves
anyone, and its ``disallow_checkpoint`` waits on a lock that a slow reader holds, so a slow reader makes
``Manager.should_commit`` raise. This transport replaces it:

- it listens on ``bind`` only (an ephemeral port) and advertises ``http://advertise:port``;
- both directions are signed with the run's secret (HMAC-SHA256, :mod:`~gasloc_lightning.comm.wire`): the
  request over (step, a fresh nonce), the response over (step, nonce, sha256 of the body). The server
  answers only members of the run; the client takes a state only from one;
- ``send_checkpoint`` serializes the state at once into bytes; ``disallow_checkpoint`` drops them and never
  waits (a response in flight keeps its own reference and ends by itself, within ``timeout``);
- a received body is loaded only once its signature checks out, and then still only through
  :func:`~gasloc_lightning.comm.wire.load_state` (``weights_only=True``: a member may be compromised) and
  :func:`~gasloc_lightning.comm.wire.check_plain`; comparing it with the local state's shapes
  (:func:`~gasloc_lightning.comm.wire.check_like`) is the caller's, who knows that state;
- one deadline bounds a whole transfer on either side (connect, headers, body), not each read.

The body is not encrypted: a peer's state crosses the network in clear, as with torchft's own transport.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import ipaddress
import logging
import math
import re
import secrets
import socket
import socketserver
import threading
import time
import urllib.parse
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
_READ_CHUNK = 1 << 20
_MAX_CONNECTIONS = 8  # connections served at once; more are closed at once
_POLL_INTERVAL = 0.05  # seconds: how fast the serving loop notices a shutdown


class StateTransferError(RuntimeError):
    """A peer's state could not be fetched: unreachable, refused, cut short, or past the deadline."""


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
        refused: requests refused (unsigned, unknown path, nothing staged, another step).
    """

    def __init__(self, *, bind: str, advertise: str | None = None, secret: bytes, timeout: float,
                 max_bytes: int | None = None) -> None:
        _check_arguments(bind, advertise, secret, timeout, max_bytes)
        self._secret, self.timeout, self.max_bytes = secret, float(timeout), max_bytes
        self._advertise = bind if advertise is None else advertise
        self._staged: _Staged | None = None
        self._retired_step = -1  # states up to this step were served and dropped: requests for them are refused
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self.served = self.refused = 0
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
    def staged_bytes(self) -> int:
        """Bytes of the state being served (0 when none is)."""
        staged = self._staged
        return 0 if staged is None else len(staged.payload)

    # ------------------------------------------------------------------ CheckpointTransport
    def metadata(self) -> str:
        """``http://advertise:port``: what a peer's :meth:`recv_checkpoint` is given to fetch from here."""
        return f"http://{_url_host(self._advertise)}:{self.port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serialize ``state_dict`` now and serve it for ``step`` until :meth:`disallow_checkpoint`."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._closed:
            raise StateTransferError("send_checkpoint after shutdown")
        payload = wire.dump_state(state_dict)
        # One attribute, replaced whole: a handler reads it once and keeps that copy, so no lock is shared
        # with disallow_checkpoint (torchft's HTTPTransport shares one, and a slow reader then blocks it).
        with self._lock:  # wakes the requests that came before the state was ready
            self._staged = _Staged(step, payload, hashlib.sha256(payload).digest())
            self._lock.notify_all()
        log.info("state staged step=%d bytes=%d dst_ranks=%s", step, len(payload), list(dst_ranks))

    def disallow_checkpoint(self) -> None:
        """Stop serving the staged state and drop it; never waits (runs inside ``Manager.should_commit``)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._retired_step = max(self._retired_step, staged.step)
            log.info("state unstaged step=%d bytes=%d", staged.step, len(staged.payload))

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
        host, port = _parse_metadata(metadata)
        nonce = secrets.token_hex(16)
        try:
            payload, mac = self._fetch(host, port, step, nonce, deadline, source)
        except TimeoutError as error:
            raise StateTransferError(f"state transfer {source} exceeded timeout={seconds:g}s") from error
        except (OSError, http.client.HTTPException) as error:
            raise StateTransferError(f"state transfer {source} failed: {error!r}") from error
        if not wire.verify(self._secret, mac, b"response", _step_bytes(step), nonce.encode(),
                           hashlib.sha256(payload).digest()):
            raise UnsafePayloadError(f"state transfer {source}: response not signed with this run's secret")
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
    def _fetch(self, host: str, port: int, step: int, nonce: str, deadline: float,
               source: str) -> tuple[bytearray, str | None]:
        mac = wire.sign(self._secret, b"request", _step_bytes(step), nonce.encode())
        with socket.create_connection((host, port), timeout=_left(deadline)) as sock:
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
            if refusal is None:
                refusal = _staged_refusal(staged, step)
            if refusal is not None:
                self._refuse(handler, *refusal)
            else:
                self._send(handler, staged, nonce)
        except OSError as error:  # the client left, or the deadline passed: that transfer only
            handler.close_connection = True
            log.warning("state transfer aborted peer=%s error=%r", handler.client_address[0], error)

    def _wait_for_stage(self, step: int, deadline: float) -> _Staged | None:
        """torchft's joiner asks as soon as the quorum forms, while the source may still be serializing its
        state: an authenticated request for a step not staged yet waits for it, up to the request's deadline."""
        with self._lock:
            while not self._closed and step > self._retired_step and (self._staged is None or self._staged.step < step):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 4 * _POLL_INTERVAL))
            return self._staged

    def _authenticate(self, handler: _Handler) -> tuple[int, str, tuple[int, str] | None]:
        match = _STATE_PATH.fullmatch(handler.path)
        nonce = handler.headers.get(NONCE_HEADER, "")
        if match is None:
            return -1, nonce, (404, "unknown path")
        step = int(match.group(1))
        if not _NONCE.fullmatch(nonce) or not wire.verify(
                self._secret, handler.headers.get(MAC_HEADER), b"request", _step_bytes(step), nonce.encode()):
            return step, nonce, (403, "request not signed with this run's secret")
        return step, nonce, None

    def _count_refusal(self) -> None:
        with self._lock:
            self.refused += 1

    def _refuse(self, handler: _Handler, code: int, reason: str) -> None:
        self._count_refusal()
        log.warning("state request refused peer=%s path=%r code=%d reason=%s",
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
        log.exception("state transfer server error peer=%s", client_address)


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


def _parse_metadata(metadata: str) -> tuple[str, int]:
    try:
        parts = urllib.parse.urlsplit(metadata)
        host, port = parts.hostname, parts.port
    except (TypeError, ValueError, AttributeError) as error:
        raise StateTransferError(f"metadata={metadata!r} is not http://host:port") from error
    if parts.scheme != "http" or not host or port is None:
        raise StateTransferError(f"metadata={metadata!r} is not http://host:port")
    return host, port


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
