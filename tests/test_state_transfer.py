"""The heal's state transfer over real loopback sockets: authenticated both ways, loaded safely, not blocking.

Covers :mod:`gasloc_lightning.comm.wire` (what the network may hand us) and
:class:`~gasloc_lightning.comm.state_transfer.AuthenticatedStateTransport` (torchft's checkpoint transport).
"""

from __future__ import annotations

import builtins
import importlib.util
import hashlib
import io
import pickle
import re
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from gasloc_lightning.comm import wire
from gasloc_lightning.comm.state_transfer import (
    LENGTH_MAC_HEADER,
    MAC_HEADER,
    NONCE_HEADER,
    AuthenticatedStateTransport,
    StateTransferError,
)
from gasloc_lightning.comm.wire import UnsafePayloadError
from net_utils import drain

pytestmark = pytest.mark.timeout(30)

SECRET = b"run-secret-" + b"x" * 21
MARK = 1234.5  # a float whose bytes identify the served tensor


@pytest.fixture
def make_transport():
    """Builds transports that are shut down after the test, whatever it did."""
    made = []

    def make(**kwargs):
        kwargs = {"bind": "127.0.0.1", "secret": SECRET, "timeout": 5.0, **kwargs}
        made.append(AuthenticatedStateTransport(**kwargs))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown(wait=False)


def heal_state() -> dict:
    """A state as torchft's Manager sends it: a model, a stepped AdamW, two schedulers, plain data."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    lambda_lr.step()
    cosine.step()
    live = torch.cat([p.detach().flatten() for p in model.parameters()])
    default = {"live": live, "model": model.state_dict(), "optimizers": [optimizer.state_dict()],
               "schedulers": [lambda_lr.state_dict(), cosine.state_dict()],
               "signature": {"name": "gasloc", "numel": live.numel(), "mark": MARK, "none": None}}
    return {"user": {"default": default}, "torchft": {"step": 3, "batches_committed": 6}}


def assert_same(got, want, path="state"):
    assert type(got) is type(want) or (isinstance(got, dict) and isinstance(want, dict)), path
    if isinstance(want, torch.Tensor):
        assert want.dtype == got.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}.{index}")
    else:
        assert got == want, path


def signed_request(step: int, port: int, instance: str, secret: bytes = SECRET, host: str = "127.0.0.1") -> bytes:
    """A member's request for ``step``, signed for the server ``instance`` at ``host:port``."""
    nonce = secrets.token_hex(16)
    mac = wire.sign(secret, b"request", f"{host}:{port}/{instance}".encode(), str(step).encode(), nonce.encode())
    return (f"GET /state/{step} HTTP/1.0\r\nHost: {host}:{port}\r\n{NONCE_HEADER}: {nonce}\r\n"
            f"{MAC_HEADER}: {mac}\r\n\r\n").encode()


def wait_until(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# ------------------------------------------------------------------ wire
class _Marker:
    """Unpickling it creates the marker file: the payload's code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.exec, (f"open({self.path!r}, 'w').close()",)


def evil_payloads(marker) -> dict[str, tuple[bytes, object]]:
    """Payloads that run code when loaded unsafely, each with the unsafe loader that proves it."""
    archive = io.BytesIO()
    torch.save({"user": {"default": _Marker(marker)}, "torchft": {"step": 3}}, archive)
    return {
        "torch_archive": (archive.getvalue(), lambda data: torch.load(io.BytesIO(data), weights_only=False)),
        "raw_pickle": (pickle.dumps(_Marker(marker)), pickle.loads),
    }


REFUSALS = {"torch_archive": r"refused by torch.load\(weights_only=True\): UnpicklingError",
            "raw_pickle": "not a torch archive"}


@pytest.mark.parametrize("kind", ["torch_archive", "raw_pickle"])
def test_load_state_never_runs_the_payload(tmp_path, kind):
    marker = tmp_path / "ran"
    payload, unsafe_load = evil_payloads(marker)[kind]
    unsafe_load(payload)  # the payload is live: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafePayloadError, match=REFUSALS[kind]):
        wire.load_state(payload)
    assert not marker.exists()


def test_load_state_refuses_oversized_compressed_and_garbage():
    payload = wire.dump_state({"x": torch.zeros(100)})
    assert torch.equal(wire.load_state(payload, max_bytes=len(payload))["x"], torch.zeros(100))
    with pytest.raises(UnsafePayloadError, match="max_bytes"):
        wire.load_state(payload, max_bytes=len(payload) - 1)
    with pytest.raises(UnsafePayloadError, match="not a torch archive"):
        wire.load_state(b"\x80\x02garbage")
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(payload)) as source, \
            zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as out:
        for entry in source.infolist():
            out.writestr(entry.filename, source.read(entry))
    with pytest.raises(UnsafePayloadError, match="a compressed or encrypted entry"):
        wire.load_state(deflated.getvalue())


def test_check_like_names_the_first_difference():
    def user(live, steps=(1, 2)):
        default = {"live": live} if steps is None else {"live": live, "steps": list(steps)}
        return {"default": default}

    reference = user(torch.zeros(12))
    wire.check_like(user(torch.ones(12), steps=(5, 6.0)), reference, path="user")
    cases = [
        (user(torch.zeros(10)), re.escape("user.default.live: shape (10,) expected (12,)")),
        (user(torch.zeros(12, dtype=torch.float64)), "user.default.live: dtype torch.float64"),
        (user(torch.zeros(12), steps=(1,)), "user.default.steps: list of length 1"),
        (user(torch.zeros(12), steps=None), r"user.default: keys differ, missing \['steps'\]"),
        (user(torch.full((12,), float("nan"))), "user.default.live: tensor holds non-finite"),
        (user([0.0] * 12), "user.default.live: list expected a tensor"),
    ]
    for received, message in cases:
        with pytest.raises(UnsafePayloadError, match=message):
            wire.check_like(received, reference, path="user")


def test_check_plain_allows_tensors_and_plain_data_only():
    wire.check_plain({"a": [torch.ones(2), (1, 2.5, float("inf"))], 3: {"b": None, "c": True, "d": "s"}})
    wire.check_plain({"mask": torch.tensor([float("-inf")])}, finite=False)
    for state, message in [({"x": {"d": torch.float32}}, "state.x.d: dtype"),
                           ({"x": [{1, 2}]}, "state.x.0: set"),
                           ({(1, 2): 0}, "key of type tuple"),
                           ({"x": torch.tensor([float("nan")])}, "state.x: tensor holds non-finite"),
                           ({"x": torch.zeros(2).to_sparse()}, "neither a dense tensor")]:
        with pytest.raises(UnsafePayloadError, match=message):
            wire.check_plain(state)


def test_sign_is_length_prefixed_and_verify_is_strict():
    assert wire.sign(SECRET, b"ab", b"c") != wire.sign(SECRET, b"a", b"bc")
    mac = wire.sign(SECRET, b"request", b"3", b"nonce")
    assert len(mac) == 64 and wire.verify(SECRET, mac, b"request", b"3", b"nonce")
    assert not wire.verify(SECRET, mac, b"request", b"4", b"nonce")
    assert not wire.verify(b"other secret", mac, b"request", b"3", b"nonce")
    assert not wire.verify(SECRET, None, b"request", b"3", b"nonce")
    assert not wire.verify(SECRET, "é" * 64, b"request", b"3", b"nonce")
    with pytest.raises(ValueError, match="secret"):
        wire.sign(b"", b"x")


def test_run_secret_from_argument_or_environment(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    assert wire.run_secret() is None
    monkeypatch.setenv(wire.SECRET_ENV, "from-env")
    assert wire.run_secret() == b"from-env"
    assert wire.run_secret("given") == b"given"
    with pytest.raises(ValueError, match="value"):
        wire.run_secret("")
    first, second = wire.new_secret(), wire.new_secret()
    assert len(first) == 64 and first != second and int(first, 16) >= 0


# ------------------------------------------------------------------ transport
def test_round_trip_of_a_heal_state(make_transport):
    sender, receiver = make_transport(), make_transport()
    state = heal_state()
    sender.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=None)
    # torchft's Manager passes a timedelta.
    received = receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=3,
                                        timeout=timedelta(seconds=5))
    assert_same(received, state)
    wire.check_like(received["user"], state["user"], path="user")
    # The server counts a transfer once its last byte is written, which may be just after the client has it.
    assert wait_until(lambda: sender.served == 1, 2.0)
    assert (sender.refused, receiver.served) == (0, 0)


def test_wait_answered_returns_once_each_request_for_the_step_was_served_or_refused_for_good(make_transport):
    sender, receiver = make_transport(), make_transport()
    intruder = make_transport(secret=b"a-guess-" + b"y" * 24)
    sender.send_checkpoint(dst_ranks=[1, 2], step=7, state_dict=heal_state(), timeout=None)
    assert not sender.wait_answered(7, 1, timeout=0.05)  # staged, not fetched: it waits out its timeout
    receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=7, timeout=5.0)
    assert sender.wait_answered(7, 1, timeout=5.0)  # a failure deadline: the server counts the last byte written
    assert not sender.wait_answered(7, 2, timeout=0.05) and not sender.wait_answered(6, 1, timeout=0.05)
    with pytest.raises(StateTransferError, match="403"):  # without the secret: refused, it can never have it
        intruder.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=7, timeout=5.0)
    assert sender.wait_answered(7, 2, timeout=5.0) and (sender.served, sender.refused) == (1, 1)
    with pytest.raises(StateTransferError, match="403"):  # another step: counted for that step only
        intruder.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=9, timeout=5.0)
    assert not sender.wait_answered(7, 3, timeout=0.05) and sender.wait_answered(9, 1, timeout=5.0)
    waiter = threading.Thread(target=lambda: sender.wait_answered(7, 3, timeout=30.0))
    waiter.start()
    sender.shutdown(wait=False)  # a shut-down server answers no one more: the wait ends at once
    waiter.join(timeout=10.0)
    assert not waiter.is_alive()


@pytest.mark.parametrize("signed", [False, True], ids=["wrong_mac", "rogue_knows_secret"])
@pytest.mark.parametrize("kind", ["torch_archive", "raw_pickle"])
def test_rogue_server_cannot_run_code_on_the_joiner(make_transport, tmp_path, signed, kind):
    marker = tmp_path / "ran"
    payload, _ = evil_payloads(marker)[kind]

    class Rogue(BaseHTTPRequestHandler):
        def do_GET(self):
            step = self.path.rsplit("/", 1)[-1].encode()
            nonce = self.headers.get(NONCE_HEADER, "").encode()
            digest = hashlib.sha256(payload).digest()
            mac = wire.sign(SECRET, b"response", step, nonce, digest) if signed else "0" * 64
            self.send_response(200)
            length_mac = (wire.sign(SECRET, b"length", step, nonce, str(len(payload)).encode()) if signed
                          else "0" * 64)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header(MAC_HEADER, mac)
            self.send_header(LENGTH_MAC_HEADER, length_mac)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        # A signed archive reaches torch.load, and weights_only is what stops it.
        message = "not signed" if not signed else REFUSALS[kind]
        with pytest.raises(UnsafePayloadError, match=message):
            make_transport().recv_checkpoint(0, f"http://127.0.0.1:{server.server_address[1]}", 3, 5.0)
    finally:
        server.shutdown()
        server.server_close()
    assert not marker.exists()


def test_unauthenticated_requests_get_403_and_no_state(make_transport):
    transport = make_transport()
    transport.send_checkpoint([1], 3, {"live": torch.full((256,), MARK)}, None)
    mark_bytes = torch.full((4,), MARK).numpy().tobytes()
    url = f"http://127.0.0.1:{transport.port}/state/3"
    wrong = signed_request(3, transport.port, transport.instance, secret=b"not the run secret")
    wrong = wrong.decode().split("\r\n")[2:4]
    requests = [urllib.request.Request(url),
                urllib.request.Request(url, headers=dict(line.split(": ", 1) for line in wrong))]
    for request in requests:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=5)
        assert caught.value.code == 403
        assert mark_bytes not in caught.value.read()
    assert (transport.refused, transport.served) == (2, 0)


def test_slow_readers_never_block_disallow_or_other_clients(make_transport):
    transport = make_transport(timeout=3.0)
    big = {"live": torch.zeros(8 << 20)}  # 32 MiB: far more than the sockets buffer
    transport.send_checkpoint([1], 3, big, None)
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", transport.port))
    stuck.sendall(signed_request(3, transport.port, transport.instance))  # then never reads: the server's write blocks
    half = socket.create_connection(("127.0.0.1", transport.port))
    half.sendall(b"GET /sta")  # and never finishes its request line, sending a byte now and then
    time.sleep(0.3)

    start = time.monotonic()
    transport.disallow_checkpoint()
    assert time.monotonic() - start < 2.0  # not the 3 s reader timeout (the rest is for a loaded machine)
    assert transport.staged_bytes == 0

    transport.send_checkpoint([1], 4, {"live": torch.arange(3.0)}, None)
    received = make_transport().recv_checkpoint(0, transport.metadata(), 4, 5.0)
    assert torch.equal(received["live"], torch.arange(3.0))

    # The server gives both up at its deadline, however the client trickles: the stuck reader gets less
    # than the full body.
    assert trickle_until_closed(half, seconds=7.0)
    assert time.monotonic() - start < 3.0 + 2.0
    stuck.settimeout(5)
    assert len(drain(stuck)) < 32 << 20
    assert time.monotonic() - start < 3.0 + 2.0
    assert wait_until(lambda: transport.served == 1, 10.0)
    half.close()
    stuck.close()


def trickle_until_closed(sock: socket.socket, seconds: float) -> bool:
    """Sends a byte every 0.3 s (well within any per-read timeout) until the server closes the connection."""
    end = time.monotonic() + seconds
    sock.settimeout(0.3)
    while time.monotonic() < end:
        try:
            sock.sendall(b"a")
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_disallow_drops_the_served_copy(make_transport):
    transport, receiver = make_transport(), make_transport()
    transport.send_checkpoint([1], 3, {"live": torch.ones(1000)}, None)
    assert transport.staged_step == 3 and transport.staged_bytes > 4000
    transport.disallow_checkpoint()
    assert (transport.staged_step, transport.staged_bytes) == (None, 0)
    with pytest.raises(StateTransferError, match="404"):
        receiver.recv_checkpoint(0, transport.metadata(), 3, 5.0)
    transport.send_checkpoint([1], 4, {"live": torch.ones(3)}, None)
    with pytest.raises(StateTransferError, match="409"):
        receiver.recv_checkpoint(0, transport.metadata(), 3, 5.0)
    assert transport.refused == 2


@pytest.mark.parametrize("wait", [False, True])
def test_shutdown_closes_the_port_and_stops_the_thread(make_transport, wait):
    transport = make_transport()
    transport.send_checkpoint([1], 3, {"live": torch.ones(3)}, None)
    port, name = transport.port, f"gasloc-state-server-{transport.port}"
    assert transport.alive and any(thread.name == name for thread in threading.enumerate())
    start = time.monotonic()
    transport.shutdown(wait=wait)
    assert time.monotonic() - start < 1.0
    assert not transport.alive and not any(thread.name == name for thread in threading.enumerate())
    assert transport.staged_bytes == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    transport.shutdown(wait=wait)  # idempotent


def test_each_transport_listens_on_its_own_address_only(make_transport):
    first = make_transport(bind="127.0.0.1")
    second = make_transport(bind="127.0.0.2", advertise="localhost")
    assert first.metadata() == f"http://127.0.0.1:{first.port}/{first.instance}"
    assert second.metadata() == f"http://localhost:{second.port}/{second.instance}"
    for transport, own, other in ((first, "127.0.0.1", "127.0.0.2"), (second, "127.0.0.2", "127.0.0.1")):
        socket.create_connection((own, transport.port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, transport.port), timeout=2).close()


def test_ipv6_loopback_round_trip(make_transport):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        sender = make_transport(bind="::1")
    except ValueError as error:
        pytest.skip(f"no IPv6 loopback: {error}")
    assert sender.metadata() == f"http://[::1]:{sender.port}/{sender.instance}"
    sender.send_checkpoint([1], 7, {"live": torch.arange(4)}, None)
    received = make_transport().recv_checkpoint(0, sender.metadata(), 7, 5.0)
    assert torch.equal(received["live"], torch.arange(4))


def test_receiver_refuses_bodies_over_max_bytes(make_transport):
    sender, receiver = make_transport(), make_transport(max_bytes=4096)
    sender.send_checkpoint([1], 3, {"live": torch.zeros(10_000)}, None)
    with pytest.raises(StateTransferError, match="max_bytes=4096"):
        receiver.recv_checkpoint(0, sender.metadata(), 3, 5.0)


@pytest.mark.parametrize("kwargs, argument", [
    ({"secret": b""}, "secret"),
    ({"secret": "a str"}, "secret"),
    ({"advertise": "0.0.0.0"}, "advertise"),
    ({"bind": "::", "advertise": "::"}, "advertise"),
    ({"bind": "0.0.0.0"}, "advertise"),
    ({"bind": ""}, "bind"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"max_bytes": 0}, "max_bytes"),
])
def test_arguments_are_validated(kwargs, argument):
    arguments = {"bind": "127.0.0.1", "secret": SECRET, "timeout": 5.0, **kwargs}
    with pytest.raises(ValueError, match=argument):
        AuthenticatedStateTransport(**arguments)


def test_is_torchfts_transport_and_imports_without_torchft(make_transport, monkeypatch):
    from torchft.checkpointing.transport import CheckpointTransport

    assert isinstance(make_transport(), CheckpointTransport)
    # A fresh copy of the module, as in a base install: the import of torchft fails.
    monkeypatch.setitem(sys.modules, "torchft.checkpointing.transport", None)
    spec = importlib.util.find_spec("gasloc_lightning.comm.state_transfer")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.AuthenticatedStateTransport.__bases__ == (object,)
    module.AuthenticatedStateTransport(bind="127.0.0.1", secret=SECRET, timeout=1.0).shutdown()


def test_wildcard_bind_only_when_explicit(make_transport):
    transport = make_transport(bind="0.0.0.0", advertise="127.0.0.1")
    transport.send_checkpoint([1], 3, {"live": torch.ones(2)}, None)
    received = make_transport().recv_checkpoint(0, transport.metadata(), 3, 5.0)
    assert torch.equal(received["live"], torch.ones(2))


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_one_deadline_bounds_a_trickling_transfer(make_transport, phase):
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    def trickle():
        connection, _ = listener.accept()
        with connection:
            request = connection.recv(4096).decode()
            nonce = request.split(f"{NONCE_HEADER}: ", 1)[1].split("\r\n", 1)[0].encode()
            length_mac = wire.sign(SECRET, b"length", b"3", nonce, b"1000")  # a member that knows the secret
            head = f"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n{LENGTH_MAC_HEADER}: {length_mac}\r\n\r\n".encode()
            if phase == "body":
                connection.sendall(head)
            stream = head if phase == "headers" else b"x" * 1000
            for byte in stream:
                if stop.wait(0.5):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(StateTransferError, match="exceeded timeout=2s"):
            make_transport().recv_checkpoint(0, f"http://127.0.0.1:{listener.getsockname()[1]}", 3, 2.0)
        assert 1.9 < time.monotonic() - start < 3.8  # one deadline (two, one per phase, would take 4 s)
    finally:
        stop.set()
        thread.join(5)
        listener.close()


@pytest.mark.timeout(30)
def test_a_flood_of_connections_gets_no_thread_each_and_honest_peers_fetch_once_it_has_timed_out(make_transport):
    sender = make_transport(timeout=1.0)
    sender.send_checkpoint([1], 3, {"live": torch.ones(4)}, timedelta(seconds=5))
    threads_before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", sender.port)) for _ in range(40)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - threads_before <= 8  # the rest were closed at once, without a thread
        assert wait_until(lambda: sender.refused >= 32, 2.0), sender.refused
    finally:
        for connection in flood:
            connection.close()
    time.sleep(1.2)  # the held connections reach their deadline
    received = make_transport().recv_checkpoint(0, sender.metadata(), 3, 5.0)
    assert torch.equal(received["live"], torch.ones(4))


@pytest.mark.timeout(30)
def test_an_unsigned_length_is_refused_before_the_body_is_read(make_transport):
    """A source that does not know the secret claims a 64 GB body: nothing of it is read."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 68719476736\r\n"
                               + f"{LENGTH_MAC_HEADER}: {'0' * 64}\r\n\r\n".encode() + b"x" * 65536)
            done.wait(30)  # holds the connection open: a client reading the body would wait here

    done = threading.Event()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(UnsafePayloadError, match="not signed"):
            make_transport().recv_checkpoint(0, f"http://127.0.0.1:{listener.getsockname()[1]}", 3, 10.0)
        # refused while the source still holds the connection (it ends only after done is set): a client that read
        # the body would have waited out its 10 s timeout instead (a wide bound, not a speed)
        assert thread.is_alive() and time.monotonic() - start < 8.0
    finally:
        done.set()
        thread.join(5)
        listener.close()
