"""A seeded fuzz harness for the heal transport's three parsers of untrusted bytes.

- the server's request parser (:class:`AuthenticatedStateTransport` behind its port);
- the client's response parser (:meth:`AuthenticatedStateTransport.recv_checkpoint` against a fake source);
- :func:`gasloc_lightning.comm.wire.load_state`.

Each input is a valid message with a few random edits (bytes flipped, inserted, deleted, cut off), or random
bytes. ``derandomize=True`` draws the same examples on every run (no flakes, no example database), and
``max_examples`` bounds the time (a few seconds for all three on two cores).
"""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest
import torch

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gasloc_lightning.comm import wire  # noqa: E402
from gasloc_lightning.comm.state_transfer import (  # noqa: E402
    LENGTH_MAC_HEADER,
    MAC_HEADER,
    NONCE_HEADER,
    AuthenticatedStateTransport,
    StateTransferError,
)
from gasloc_lightning.comm.wire import UnsafePayloadError  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SECRET = b"run-secret-" + b"x" * 21
MARK = 1234.5
MARK_BYTES = torch.full((4,), MARK).numpy().tobytes()
STATE = {"live": torch.full((64,), MARK), "optimizer": {"step": torch.tensor(3.0), "lr": 0.1},
         "names": ["a", "b"], "none": None}


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


EDITS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "cut"]), st.floats(0, 1),
                           st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


def edited(message: bytes, edits) -> bytes:
    out = bytearray(message)
    for kind, where, chunk in edits:
        at = min(int(where * len(out)), max(len(out) - 1, 0))
        if kind == "flip" and out:
            out[at] ^= chunk[0] or 1
        elif kind == "insert":
            out[at:at] = chunk
        elif kind == "delete":
            del out[at:at + len(chunk)]
        elif kind == "cut":
            del out[at:]
    return bytes(out)


def inputs(valid: bytes):
    """A valid message with random edits, or random bytes."""
    return st.one_of(EDITS.map(lambda edits: edited(valid, edits)), st.binary(max_size=512))


def exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)  # the server sees the end of the request at once, not at its deadline
        except OSError:  # it already answered and closed
            pass
        data = bytearray()
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return bytes(data)


def signed_request(step: int, port: int, instance: str) -> bytes:
    nonce = "ab" * 16
    mac = wire.sign(SECRET, b"request", f"127.0.0.1:{port}/{instance}".encode(), str(step).encode(), nonce.encode())
    return (f"GET /state/{step} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n{NONCE_HEADER}: {nonce}\r\n"
            f"{MAC_HEADER}: {mac}\r\n\r\n").encode()


def test_fuzzed_requests_never_get_a_state_they_did_not_sign_and_never_stop_the_server():
    server = AuthenticatedStateTransport(bind="127.0.0.1", secret=SECRET, timeout=3.0)
    receiver = AuthenticatedStateTransport(bind="127.0.0.1", secret=SECRET, timeout=3.0)
    try:
        server.send_checkpoint([1], 3, STATE, None)
        valid = signed_request(3, server.port, server.instance)
        mac_line = valid.split(b"\r\n")[3]

        @fuzz(100)
        @given(request=inputs(valid))
        def check(request):
            answer = exchange(server.port, request)
            assert answer == b"" or answer.startswith(b"HTTP/") or answer.lstrip().startswith(b"<!DOCTYPE"), answer[:80]
            if MARK_BYTES in answer:  # only a request that still carries the member's signature and nonce
                assert mac_line in request and b"/state/3" in request

        check()
        assert server.alive and server.served <= 1  # the valid request's nonce is spent after its first use
        assert torch.equal(receiver.recv_checkpoint(0, server.metadata(), 3, 5.0)["live"], STATE["live"])
    finally:
        server.shutdown(wait=False)
        receiver.shutdown(wait=False)


def signed_response(nonce: bytes, step: int = 3) -> bytes:
    body = wire.dump_state(STATE)
    step_bytes = str(step).encode()
    mac = wire.sign(SECRET, b"response", step_bytes, nonce, hashlib.sha256(body).digest())
    length_mac = wire.sign(SECRET, b"length", step_bytes, nonce, str(len(body)).encode())
    return (f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n{MAC_HEADER}: {mac}\r\n"
            f"{LENGTH_MAC_HEADER}: {length_mac}\r\n\r\n").encode() + body


def answer_once(listener: socket.socket, edits, garbage: bytes | None) -> None:
    """A fake source: reads the request, answers a validly signed response with ``edits`` (or ``garbage``)."""
    try:
        connection, _ = listener.accept()
    except OSError:
        return
    with connection:
        connection.settimeout(5)
        request = b""
        while b"\r\n\r\n" not in request and (chunk := connection.recv(4096)):
            request += chunk
        nonce = request.split(f"{NONCE_HEADER}: ".encode(), 1)[1].split(b"\r\n", 1)[0]
        response = garbage if garbage is not None else edited(signed_response(nonce), edits)
        try:
            connection.sendall(response)
        except OSError:
            pass


def test_fuzzed_responses_give_the_state_or_a_transfer_error_within_the_deadline():
    receiver = AuthenticatedStateTransport(bind="127.0.0.1", secret=SECRET, timeout=3.0)
    try:
        @fuzz(80)
        @given(edits=EDITS, garbage=st.one_of(st.none(), st.binary(max_size=512)))
        def check(edits, garbage):
            listener = socket.create_server(("127.0.0.1", 0))
            listener.settimeout(10)
            source = threading.Thread(target=answer_once, args=(listener, edits, garbage), daemon=True)
            source.start()
            try:
                state = receiver.recv_checkpoint(0, f"http://127.0.0.1:{listener.getsockname()[1]}", 3, 2.0)
            except (StateTransferError, UnsafePayloadError):
                pass
            else:  # an edit that keeps the response valid (e.g. in the reason phrase): the very same state
                assert torch.equal(state["live"], STATE["live"]) and state["names"] == STATE["names"]
            finally:
                listener.close()
                source.join(10)

        check()
    finally:
        receiver.shutdown(wait=False)


PAYLOAD = wire.dump_state(STATE)


@fuzz(200)
@given(payload=inputs(PAYLOAD))
def test_fuzzed_payloads_load_as_plain_bounded_state_or_are_refused(payload):
    try:
        state = wire.load_state(payload, max_bytes=len(PAYLOAD) + 64)
        wire.check_plain(state, finite=False)
    except UnsafePayloadError:
        return
    # what was loaded is no larger than what was sent: nothing inflated
    nbytes = sum(leaf.untyped_storage().nbytes() for leaf in _tensors(state))
    assert nbytes <= len(payload)


def _tensors(state):
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            yield node
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
