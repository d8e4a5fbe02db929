"""Endpoints: every elastic listener (store, gloo, torchft's ManagerServer, lighthouse) on its bind IP only.

Real sockets on loopback addresses (127.0.0.2 is loopback on Linux, so "on the bind address only" is
checked without a second interface); what listens is read from /proc (see net_utils).
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust side is chatty at INFO

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore  # noqa: E402

from net_utils import descendants, listening_sockets, non_loopback  # noqa: E402

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="reads listening sockets from /proc"),
    # torchft's own logger calls Logger.warn
    pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning"),
]

torchft = pytest.importorskip("torchft")

import torchft.manager  # noqa: E402
import torchft.process_group  # noqa: E402
from torchft import Manager  # noqa: E402
from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from gasloc_lightning.comm import endpoints  # noqa: E402
from gasloc_lightning.comm.endpoints import (  # noqa: E402
    BoundProcessGroupGloo,
    Endpoint,
    bound_manager_server,
    lighthouse_bind,
    listening_store,
)

SECONDS = timedelta(seconds=10)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")


def _own_listeners() -> set[tuple[str, int]]:
    return set(listening_sockets(os.getpid()))


def _wait_released(baseline: set[tuple[str, int]], timeout: float = 5.0) -> set[tuple[str, int]]:
    """The listeners opened since ``baseline`` still open after ``timeout`` seconds (or once none is)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        left = _own_listeners() - baseline
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _client(endpoint: Endpoint, port: int) -> TCPStore:
    return TCPStore(endpoint.advertised, port, is_master=False, wait_for_workers=False, timeout=SECONDS)


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


# ------------------------------------------------------------------ Endpoint
@pytest.mark.timeout(30)
def test_endpoint_defaults_to_loopback():
    endpoint = Endpoint()
    assert endpoint.bind == "127.0.0.1" and endpoint.advertised == "127.0.0.1"
    assert not endpoint.is_wildcard and endpoint.gloo_host == "127.0.0.1"
    assert endpoint.address(29510) == "127.0.0.1:29510"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bind", ["localhost", "node0", "", "[::1]", "10.0.0.5:80", "10.0.0", None, 3])
def test_endpoint_bind_must_be_an_ip_literal(bind):
    with pytest.raises(ValueError, match="bind must be an IP address"):
        Endpoint(bind=bind)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bind, advertise", [("0.0.0.0", None), ("::", None), ("0.0.0.0", "0.0.0.0"),
                                             ("10.0.0.5", "::"), ("127.0.0.1", "10.0.0.5")])
def test_endpoint_refuses_an_advertise_peers_cannot_dial(bind, advertise):
    with pytest.raises(ValueError, match="advertise"):
        Endpoint(bind=bind, advertise=advertise)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("advertise", ["http://node0", "node0:29510", "[fd00::2]", "", "node 0", "10.0.0", 7])
def test_endpoint_advertise_is_a_bare_host(advertise):
    with pytest.raises(ValueError, match="advertise must be an IP address or a host name"):
        Endpoint(bind="10.0.0.5", advertise=advertise)


@pytest.mark.timeout(30)
def test_an_explicit_wildcard_bind_is_accepted_with_an_advertise():
    endpoint = Endpoint(bind="0.0.0.0", advertise="node0.cluster")
    assert endpoint.is_wildcard and endpoint.advertised == "node0.cluster"
    assert endpoint.gloo_host == "node0.cluster"  # gloo tells peers its bound address: never a wildcard
    assert lighthouse_bind(endpoint, 29510) == "0.0.0.0:29510"
    assert Endpoint(bind="10.0.0.5", advertise="node_0.example.org.").advertised == "node_0.example.org."


@pytest.mark.timeout(30)
def test_ipv6_is_bracketed_where_a_port_follows():
    endpoint = Endpoint(bind="::", advertise="fd00::2")
    assert endpoint.advertised == "fd00::2"  # TCPStore and torchft's store_addr take it bare
    assert endpoint.advertised_host == "[fd00::2]" and endpoint.bind_host == "[::]"
    assert endpoint.address(5) == "[fd00::2]:5" and lighthouse_bind(endpoint, 5) == "[::]:5"
    assert Endpoint(bind="::1").address(7) == "[::1]:7"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("port", [-1, 65536, "29510", True, 1.0])
def test_lighthouse_bind_validates_the_port(port):
    with pytest.raises(ValueError, match="port must be an int"):
        lighthouse_bind(Endpoint(), port)


# ------------------------------------------------------------------ the store
@pytest.mark.timeout(30)
def test_listening_store_listens_on_bind_only_and_serves_the_advertised_address():
    baseline = _own_listeners()
    endpoint = Endpoint(bind="127.0.0.2")
    store = listening_store(endpoint, timeout=10)
    try:
        assert _own_listeners() - baseline == {("127.0.0.2", store.port)}
        client = _client(endpoint, store.port)
        client.set("key", "value")
        assert store.get("key") == b"value" and client.get("key") == b"value"
        assert _refused("127.0.0.1", store.port)
        del client
    finally:
        del store
    assert not _wait_released(baseline)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(30)
def test_listening_store_leaks_no_descriptor():
    counts = []
    for _ in range(4):  # the first store also opens torch's own lasting descriptors
        store = listening_store(Endpoint(), timeout=10)
        del store
        counts.append(_open_descriptors())
    assert counts[1] == counts[-1]


@pytest.mark.timeout(30)
def test_listening_store_closes_the_socket_when_the_store_fails(monkeypatch):
    def failing_store(**kwargs):
        raise RuntimeError("store failed")

    listening_store(Endpoint(), timeout=10)  # dropped at once: warms up torch's own descriptors
    baseline, descriptors = _own_listeners(), _open_descriptors()
    monkeypatch.setattr(endpoints, "TCPStore", failing_store)
    with pytest.raises(RuntimeError, match="store failed"):
        listening_store(Endpoint(), timeout=10)
    assert _open_descriptors() == descriptors and not _wait_released(baseline)


@needs_ipv6
@pytest.mark.timeout(30)
def test_listening_store_on_ipv6_loopback():
    baseline = _own_listeners()
    endpoint = Endpoint(bind="::1")
    store = listening_store(endpoint, timeout=10)
    client = _client(endpoint, store.port)
    client.set("key", "value")
    assert store.get("key") == b"value"
    assert _own_listeners() - baseline == {("::1", store.port)}
    del client, store
    assert not _wait_released(baseline)


@pytest.mark.timeout(30)
def test_a_wildcard_store_only_when_written_and_seen_as_exposed():
    baseline = _own_listeners()
    store = listening_store(Endpoint(bind="0.0.0.0", advertise="127.0.0.1"), timeout=10)
    assert non_loopback(sorted(_own_listeners() - baseline)) == [("0.0.0.0", store.port)]
    del store
    assert not _wait_released(baseline)


@pytest.mark.timeout(30)
def test_listening_store_validates_its_arguments():
    with pytest.raises(ValueError, match="endpoint must be an Endpoint"):
        listening_store("127.0.0.1", timeout=10)
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        listening_store(Endpoint(), timeout=0)


# ------------------------------------------------------------------ the gloo group
def _allreduce_sum(groups: list, values: list[float]) -> list[torch.Tensor]:
    tensors = [torch.full((3,), value) for value in values]
    options = AllreduceOptions()
    options.reduceOp = ReduceOp.SUM
    works = [group.allreduce([tensor], options) for group, tensor in zip(groups, tensors)]
    for work in works:
        work.wait()
    return tensors


def _in_threads(*calls) -> None:
    """Run the calls at once (ranks of one group must rendezvous together); re-raise the first error."""
    errors: list[BaseException] = []

    def run(call):
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=25)
    if errors:
        raise errors[0]


@pytest.mark.timeout(30)
def test_bound_gloo_group_listens_on_bind_and_close_releases_it():
    baseline = _own_listeners()
    endpoint = Endpoint(bind="127.0.0.2")
    store = listening_store(endpoint, timeout=10)
    groups = [BoundProcessGroupGloo(endpoint=endpoint, timeout=SECONDS) for _ in range(2)]
    address = f"{endpoint.advertised}:{store.port}/quorum/1"
    try:
        _in_threads(*(lambda rank=rank: groups[rank].configure(address, f"r{rank}", rank, 2)
                      for rank in range(2)))
        assert [tensor.tolist() for tensor in _allreduce_sum(groups, [1.0, 2.0])] == [[3.0] * 3] * 2
        gloo = _own_listeners() - baseline - {("127.0.0.2", store.port)}
        assert len(gloo) == 2 and {address for address, _ in gloo} == {"127.0.0.2"}
        for group in groups:
            group.close()
        assert not _wait_released(baseline | {("127.0.0.2", store.port)})
        with pytest.raises(RuntimeError, match="closed"):  # a quorum arriving after the leave builds nothing
            groups[0].configure(address, "r0", 0, 2)
        assert not _wait_released(baseline | {("127.0.0.2", store.port)})
    finally:
        del store
    assert not _wait_released(baseline)


def test_a_group_closed_while_it_is_configured_keeps_nothing_it_built(monkeypatch):
    group = BoundProcessGroupGloo(endpoint=Endpoint(), timeout=SECONDS)
    aborted = []

    class Built:  # what the rendezvous built: the group must abort it
        def abort(self):
            aborted.append(True)

    def rendezvous_during_which_the_worker_leaves(self, *args, **kwargs):
        group.close()  # the leave, while the rendezvous still runs
        self._pg = Built()  # then the rendezvous completes

    monkeypatch.setattr(torchft.process_group.ProcessGroupGloo, "configure", rendezvous_during_which_the_worker_leaves)
    with pytest.raises(RuntimeError, match="closed while it was configured"):
        group.configure("127.0.0.1:1/quorum/1", "r0", 0, 2)
    assert aborted == [True] and group._pg is None


@pytest.mark.timeout(30)
def test_bound_gloo_group_validates_its_arguments():
    with pytest.raises(ValueError, match="endpoint must be an Endpoint"):
        BoundProcessGroupGloo(endpoint="127.0.0.1", timeout=SECONDS)
    with pytest.raises(ValueError, match="timeout must be a timedelta"):
        BoundProcessGroupGloo(endpoint=Endpoint(), timeout=10)


# ------------------------------------------------------------------ torchft's Manager
class _NoTransport(CheckpointTransport):
    """A checkpoint transport that listens nowhere (torchft's default HTTPTransport binds every interface)."""

    def metadata(self) -> str:
        return ""

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        raise RuntimeError("these tests transfer no state")

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        raise RuntimeError("these tests transfer no state")


def _manager(endpoint: Endpoint, store: TCPStore, group, lighthouse: str, worker: int) -> Manager:
    return Manager(
        pg=group, load_state_dict=lambda state: None, state_dict=lambda: {}, min_replica_size=2,
        use_async_quorum=False, timeout=SECONDS, quorum_timeout=timedelta(seconds=20),
        connect_timeout=SECONDS, rank=0, world_size=1, store_addr=endpoint.advertised, store_port=store.port,
        lighthouse_addr=lighthouse, replica_id=f"worker_{worker}", hostname=endpoint.advertised_host,
        checkpoint_transport=_NoTransport(), init_sync=False,
    )


@contextmanager
def _elastic_workers(endpoint: Endpoint, *, workers: int, bound: bool) -> Iterator[tuple[list, list]]:
    """A lighthouse on ``endpoint``, and per worker a store, a gloo group and a manager; shut down after."""
    lighthouse = LighthouseServer(bind=lighthouse_bind(endpoint, 0), min_replicas=2, join_timeout_ms=2000)
    stores, groups, managers = [], [], []
    try:
        # The lighthouse's address() names socket.gethostname(), not its bind: dial the endpoint instead.
        url = f"http://{endpoint.address(int(lighthouse.address().rpartition(':')[2]))}"
        for worker in range(workers):
            stores.append(listening_store(endpoint, timeout=10))
            groups.append(BoundProcessGroupGloo(endpoint=endpoint, timeout=SECONDS))
            with bound_manager_server(endpoint) if bound else _unchanged():
                managers.append(_manager(endpoint, stores[-1], groups[-1], url, worker))
        yield managers, groups
    finally:
        for manager in managers:
            manager.shutdown(wait=True)
        for group in groups:
            group.close()
        lighthouse.shutdown()
        del stores[:], managers[:], groups[:]


@contextmanager
def _unchanged() -> Iterator[None]:
    yield


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", pytest.param("::1", marks=needs_ipv6)])
def test_two_managers_form_a_quorum_and_listen_on_bind_only(bind):
    baseline = _own_listeners()
    endpoint = Endpoint(bind=bind)
    with _elastic_workers(endpoint, workers=2, bound=True) as (managers, groups):
        _in_threads(*(manager.start_quorum for manager in managers))
        assert [manager.errored() for manager in managers] == [None, None]
        assert [group.size() for group in groups] == [2, 2]
        assert [tensor.tolist() for tensor in _allreduce_sum(groups, [1.0, 2.0])] == [[3.0] * 3] * 2
        opened = _own_listeners() - baseline
        # lighthouse + per worker: manager server, store, gloo device
        assert len(opened) == 7 and {address for address, _ in opened} == {bind}
        assert not non_loopback(listening_sockets(os.getpid()))
    assert not _wait_released(baseline)


@pytest.mark.timeout(30)
def test_torchft_alone_binds_its_manager_server_to_every_interface():
    """What bound_manager_server is for: torchft 0.2.0's Manager listens on '::' (the test above can fail)."""
    baseline = _own_listeners()
    with _elastic_workers(Endpoint(), workers=1, bound=False):
        exposed = non_loopback(sorted(_own_listeners() - baseline))
        assert [address for address, _ in exposed] == ["::"]
    assert not _wait_released(baseline)


@pytest.mark.timeout(30)
def test_bound_manager_server_restores_torchft_even_on_error():
    original = torchft.manager.ManagerServer
    with pytest.raises(KeyError):
        with bound_manager_server(Endpoint()):
            assert torchft.manager.ManagerServer is not original
            raise KeyError("boom")
    assert torchft.manager.ManagerServer is original


@pytest.mark.timeout(30)
def test_bound_manager_server_refuses_nesting():
    with bound_manager_server(Endpoint()):
        with pytest.raises(RuntimeError, match="nested"):
            with bound_manager_server(Endpoint(bind="127.0.0.2")):
                pass
    assert torchft.manager.ManagerServer.__name__ == "ManagerServer"


@pytest.mark.timeout(30)
def test_bound_manager_server_needs_torchft_0_2(monkeypatch):
    monkeypatch.delattr(torchft.manager, "ManagerServer")
    with pytest.raises(RuntimeError, match="torchft<0.3"):
        with bound_manager_server(Endpoint()):
            pass


# ------------------------------------------------------------------ the lighthouse
def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(30)
def test_lighthouse_cli_listens_on_bind_only():
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    if not binary.exists():
        pytest.skip("no torchft_lighthouse next to this Python")
    port = _free_port("127.0.0.2")
    bind = lighthouse_bind(Endpoint(bind="127.0.0.2"), port)
    command = [str(binary), "--bind", bind, "--min_replicas", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert process.pid in descendants(os.getpid())
        deadline = time.monotonic() + 20
        while not listening_sockets(process.pid) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert listening_sockets(process.pid) == [("127.0.0.2", port)]
    finally:
        process.kill()
        process.wait(timeout=10)
