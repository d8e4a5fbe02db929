"""Where an elastic worker's services listen, and the address its peers are told: one :class:`Endpoint`.

An elastic worker runs four listeners: torchft's gRPC ``ManagerServer`` (it serves an unauthenticated Kill
RPC), the rendezvous ``TCPStore`` of its process group, the gloo device of that group, and (on the
launcher) the lighthouse. Left to themselves they listen on every interface: torchft 0.2.0 binds its
``ManagerServer`` to ``[::]``, a master ``TCPStore`` binds the wildcard whatever ``host_name`` says, and
gloo's default device binds whatever the host name resolves to. The contract here:

- nothing listens beyond loopback unless asked: ``Endpoint()`` binds ``127.0.0.1``;
- a multi-host run names the IP to listen on (``bind``) and the address peers dial (``advertise``);
- a wildcard (``0.0.0.0``, ``::``) only when written explicitly, and then ``advertise`` is required.

One listener per helper: :func:`listening_store` (the store), :class:`BoundProcessGroupGloo` (gloo),
:func:`bound_manager_server` (torchft's ``ManagerServer``, built inside ``Manager.__init__``) and
:func:`lighthouse_bind` (the lighthouse's ``--bind``). The checkpoint transport, a fifth listener, takes
a bind and an advertised host of its own: ``endpoint.bind`` and ``endpoint.advertised``.

What each torchft/torch argument takes, for a worker's ``endpoint``:

- ``TCPStore(host_name=...)`` of a client, ``Manager(store_addr=...)``: :attr:`Endpoint.advertised`
  (bare, an IPv6 address without brackets: torchft splits ``host:port`` at the last colon);
- ``Manager(hostname=...)``, any ``host:port`` or URL peers dial: :attr:`Endpoint.advertised_host`
  (IPv6 bracketed) or :meth:`Endpoint.address`;
- the lighthouse: ``--bind`` :func:`lighthouse_bind`; clients dial ``endpoint.address(port)``, not
  ``LighthouseServer.address()``, which names ``socket.gethostname()`` whatever the bind.

Nothing here imports Lightning; torchft (the ``elastic`` extra) is needed only by the gloo group and
:func:`bound_manager_server`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroup as _C10dGroup
from torch.distributed import Store, TCPStore
from torch.distributed import ProcessGroupGloo as _GlooBackend

try:
    from torchft.process_group import ProcessGroupGloo as _TorchftGloo
except ImportError:
    # The base install has no torchft: BoundProcessGroupGloo then refuses to be built (see its __init__).
    _TorchftGloo = object  # type: ignore[misc,assignment]

_log = logging.getLogger(__name__)

__all__ = ["BoundProcessGroupGloo", "Endpoint", "bound_manager_server", "lighthouse_bind", "listening_store"]

LOOPBACK = "127.0.0.1"
# RFC 1123 labels (plus "_", which container runtimes put in host names); no port, scheme or brackets.
_HOST_NAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                        r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?", re.ASCII)


def _ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return None


def _host_port_form(host: str) -> str:
    """``host`` as it goes before ``:port`` (an IPv6 literal in brackets)."""
    address = _ip(host)
    return f"[{host}]" if address is not None and address.version == 6 else host


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 literal in brackets (``[::1]:29510``)."""
    return f"{_host_port_form(host)}:{port}"


@dataclass(frozen=True)
class Endpoint:
    """The IP a worker's services listen on, and the address its peers reach them at.

    Args:
        bind: an IPv4 or IPv6 literal to listen on (default loopback). ``"0.0.0.0"`` or ``"::"`` listens on
            every interface: only when written here, and then ``advertise`` is required.
        advertise: the IP or host name peers dial (default: ``bind``). Never a wildcard, and not a
            non-loopback IP for a loopback ``bind`` (peers could not reach it). It must lead to ``bind``:
            gloo tells its peers the address its device is bound to, not this one (see :attr:`gloo_host`).
    """

    bind: str = LOOPBACK
    advertise: str | None = None

    def __post_init__(self) -> None:
        bind = _ip(self.bind) if isinstance(self.bind, str) else None
        if bind is None:
            raise ValueError(f"bind must be an IP address to listen on, without brackets (e.g. '127.0.0.1', "
                             f"'10.0.0.5', '::1'; '0.0.0.0' or '::' for every interface), got {self.bind!r}")
        if self.advertise is None:
            if bind.is_unspecified:
                raise ValueError(f"advertise is required with a wildcard bind={self.bind!r}: peers cannot "
                                 f"dial a wildcard (give this host's IP or name, e.g. advertise='10.0.0.5')")
            return
        _check_advertise(self.advertise, bind)

    @property
    def is_wildcard(self) -> bool:
        """Whether :attr:`bind` is ``0.0.0.0`` or ``::`` (every interface)."""
        return ipaddress.ip_address(self.bind).is_unspecified

    @property
    def advertised(self) -> str:
        """The bare address peers dial (IPv6 without brackets): ``TCPStore``, ``Manager(store_addr=...)``."""
        return self.advertise if self.advertise is not None else self.bind

    @property
    def advertised_host(self) -> str:
        """:attr:`advertised` before ``:port`` or in a URL (IPv6 in brackets): ``Manager(hostname=...)``."""
        return _host_port_form(self.advertised)

    @property
    def bind_host(self) -> str:
        """:attr:`bind` before ``:port`` (IPv6 in brackets), for torchft's ``host:port`` binds."""
        return _host_port_form(self.bind)

    @property
    def gloo_host(self) -> str:
        """The address gloo's device binds to and tells its peers: :attr:`bind`, or :attr:`advertised` for a
        wildcard (gloo has no separate advertised address, and a peer cannot dial ``0.0.0.0``)."""
        return self.advertised if self.is_wildcard else self.bind

    def address(self, port: int) -> str:
        """``HOST:PORT`` that peers dial for a listener of this endpoint on ``port``."""
        return f"{self.advertised_host}:{_check_port(port)}"

    def _self_host(self) -> str:
        # The address this process dials to reach its own listener: a wildcard is reached on loopback.
        if not self.is_wildcard:
            return self.bind
        return "::1" if ipaddress.ip_address(self.bind).version == 6 else LOOPBACK


def _check_advertise(advertise: Any, bind: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    # A name ending in a numeric label ('10.0.0') is no host name: getaddrinfo reads it as an odd IPv4 form.
    named = isinstance(advertise, str) and bool(_HOST_NAME.fullmatch(advertise))
    if named and advertise.rstrip(".").rpartition(".")[2].isdigit():
        named = False
    if not isinstance(advertise, str) or not (_ip(advertise) or named):
        raise ValueError(f"advertise must be an IP address or a host name, without port, scheme or brackets "
                         f"(e.g. '10.0.0.5', 'node0', '::1'), got {advertise!r}")
    address = _ip(advertise)
    if address is not None and address.is_unspecified:
        raise ValueError(f"advertise must be an address peers can dial, not the wildcard {advertise!r}")
    if address is not None and bind.is_loopback and not address.is_loopback:
        raise ValueError(f"advertise={advertise!r} cannot reach a worker listening on loopback only "
                         f"(bind={str(bind)!r}): bind this host's address too")


def _check_port(port: Any) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")
    return port


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


# ------------------------------------------------------------------ the rendezvous store
def listening_store(endpoint: Endpoint, *, timeout: float) -> TCPStore:
    """A master ``TCPStore`` on a free port that listens on ``endpoint.bind`` only.

    A master ``TCPStore`` binds the wildcard whatever its ``host_name``; so the listening socket is bound
    here and handed over with ``master_listen_fd`` (works with the default libuv backend and the legacy
    one). The store owns that descriptor from then on and closes it when the store is destroyed: the
    listener goes when the last reference to the returned store goes (``del store``).

    Args:
        endpoint: where to listen; clients dial ``endpoint.advertised`` on the store's ``.port``.
        timeout: seconds a store operation (``get``, ``wait``) may take.

    Returns:
        the master ``TCPStore`` (its port is ``.port``).
    """
    if not isinstance(endpoint, Endpoint):
        raise ValueError(f"endpoint must be an Endpoint, got {endpoint!r}")
    seconds = _check_seconds("timeout", timeout)
    family = socket.AF_INET6 if ipaddress.ip_address(endpoint.bind).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((endpoint.bind, 0))
        listener.listen(socket.SOMAXCONN)
        # The store gets a duplicate, so the `with` may always close ours: whether a failed constructor
        # already closed the duplicate is unknown, so _close_if_ours checks before closing it.
        handed = os.dup(listener.fileno())
        try:
            return TCPStore(host_name=endpoint._self_host(), port=listener.getsockname()[1], is_master=True,
                            wait_for_workers=False, timeout=timedelta(seconds=seconds),
                            master_listen_fd=handed)
        except BaseException:
            _close_if_ours(handed, os.fstat(listener.fileno()).st_ino)
            raise


def _close_if_ours(fd: int, inode: int) -> None:
    # Only a descriptor that still names our socket is closed: its number may have been reused since.
    try:
        if os.fstat(fd).st_ino == inode:
            os.close(fd)
    except OSError:
        pass


# ------------------------------------------------------------------ the gloo group
class BoundProcessGroupGloo(_TorchftGloo):
    """torchft's reconfigurable gloo group, its device bound to the endpoint's :attr:`~Endpoint.gloo_host`.

    torchft 0.2.0 builds gloo with its default device, which binds whatever the host name resolves to, or
    the interface ``GLOO_SOCKET_IFNAME`` names; this group ignores that variable: the endpoint decides.
    Everything else of torchft's ``_create_pg`` is kept: the sequence number, the quorum's global ranks,
    the group name and the backend registration per device type.

    Tear-down: gloo's ``abort()`` and ``shutdown()`` close nothing in torch 2.13; its listener, connections
    and threads go when the last reference to the backend goes. torchft's ``configure()`` aborts and drops
    the previous group before building the next one, and its ``shutdown()`` only drops the reference.
    :meth:`close` aborts the group and drops this wrapper's reference; drop any ``Work`` of the group too. A
    closed group refuses :meth:`configure`: a torchft quorum still in flight when its worker shut down must not
    build a new gloo listener behind it.

    Args:
        endpoint: where gloo listens (and what it tells peers): see :attr:`Endpoint.gloo_host`.
        timeout: the store rendezvous and every collective of the group may take this long.
    """

    def __init__(self, *, endpoint: Endpoint, timeout: timedelta) -> None:
        if _TorchftGloo is object:
            raise ImportError("BoundProcessGroupGloo needs torchft: pip install 'gasloc-lightning[elastic]'")
        if not isinstance(endpoint, Endpoint):
            raise ValueError(f"endpoint must be an Endpoint, got {endpoint!r}")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout must be a timedelta > 0, got {timeout!r}")
        super().__init__(timeout=timeout)
        self._endpoint = endpoint
        self._closed = False
        self._quorum_store: Store | None = None
        # Called with the quorum's store once each configure has built the group (before torchft's heal): see
        # ElasticMembership.on_quorum_group. An exception there is logged, never raised into torchft's quorum.
        self.on_configured: Callable[[Store], None] | None = None

    @property
    def quorum_store(self) -> Store | None:
        """The current quorum's rendezvous store (torchft's ``PrefixStore`` for this quorum id, members and round;
        ``None`` before the first configure or after :meth:`close`): member authentication agrees over it
        (:mod:`~gasloc_lightning.comm.member_auth`)."""
        return self._quorum_store

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kwargs: Any) -> None:
        """torchft's ``configure`` (abort the previous group, build the next one), refused once closed."""
        if self._closed:
            raise RuntimeError(f"this gloo group was closed; it cannot be configured again (replica {replica_id})")
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        if self._closed:  # closed while the rendezvous ran: drop what it built
            self.abort(errored=False)
            raise RuntimeError(f"this gloo group was closed while it was configured (replica {replica_id})")
        if self.on_configured is not None and self._quorum_store is not None:
            try:
                self.on_configured(self._quorum_store)
            except Exception as error:  # noqa: BLE001 - the hook's failure must not fail torchft's quorum
                _log.warning("on_configured hook failed replica=%s: %s", replica_id, error)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> _C10dGroup:
        self._quorum_store = store
        backend = self._gloo_backend(store, rank, world_size)
        group = _C10dGroup(store, rank, world_size)
        group._set_default_backend(_C10dGroup.BackendType.GLOO)
        for device in self._device_types():
            group._register_backend(torch.device(device), _C10dGroup.BackendType.GLOO, backend)
        return group

    def _gloo_backend(self, store: Store, rank: int, world_size: int) -> _GlooBackend:
        backend = _GlooBackend(store, rank, world_size, gloo_options(self._endpoint, self._timeout))
        backend._set_sequence_number_for_group()
        # As torchft's own _create_pg: flight-recorder and DeviceMesh bookkeeping read these.
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            backend.options.group_name = (f"torchft_quorum_{self._quorum_id}_rank_"
                                          f"{self._group_rank % self._group_world_size}")
        return backend

    @staticmethod
    def _device_types() -> list[str]:
        # Gloo also serves tensors on an accelerator (copied through the host), as in torchft.
        devices = ["cpu"]
        if torch.cuda.is_available():
            devices.append("cuda")
        if torch.xpu.is_available():
            devices.append("xpu")
        return devices

    def close(self) -> None:
        """Abort pending collectives and drop the group (gloo closes its sockets with the last reference); the
        group cannot be configured again."""
        self._closed = True
        self._quorum_store = None
        self.abort(errored=False)


def gloo_options(endpoint: Endpoint, timeout: timedelta) -> Any:
    """Options of a gloo backend whose device listens on ``endpoint`` only (gloo's default device listens on
    whatever the host name resolves to, or on ``GLOO_SOCKET_IFNAME``)."""
    options = _GlooBackend._Options()
    options._timeout = timeout
    options._devices = [_GlooBackend.create_device(hostname=endpoint.gloo_host)]
    return options


# ------------------------------------------------------------------ torchft's ManagerServer
_MANAGER_SERVER_LOCK = threading.RLock()


class _BoundManagerServer:
    """Stands in for torchft's ``ManagerServer`` while a ``Manager`` is built: rewrites the ``bind`` host."""

    def __init__(self, server_class: Any, host: str) -> None:
        self.server_class, self.host = server_class, host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or not isinstance(kwargs.get("bind"), str):
            raise RuntimeError("torchft.manager built its ManagerServer without a bind= keyword: this "
                               "torchft is not the 0.2 series bound_manager_server was written for "
                               "(the package pins <0.3)")
        port = kwargs["bind"].rpartition(":")[2]  # torchft's: its port argument or TORCHFT_MANAGER_PORT
        return self.server_class(**{**kwargs, "bind": f"{self.host}:{port}"})


@contextmanager
def bound_manager_server(endpoint: Endpoint) -> Iterator[None]:
    """Within this block, a torchft ``Manager`` built here binds its ``ManagerServer`` to ``endpoint.bind``.

    torchft 0.2.0 hard-codes ``bind=f"[::]:{port}"`` in ``Manager.__init__``; there is no argument for it. So
    ``torchft.manager.ManagerServer`` is replaced for the block by a stand-in that rewrites the host of that
    one keyword (the port stays torchft's) and is restored on exit. This relies on torchft < 0.3 (the
    package pins it). The replacement is process-wide: a module-level lock holds other threads' blocks until
    this one ends (a ``Manager`` another thread builds meanwhile outside any block is bound here too), and a
    nested block raises. Pass ``hostname=endpoint.advertised_host`` to the ``Manager``: it is the host its
    ``ManagerServer`` advertises to the lighthouse (``address()`` is ``http://{hostname}:{port}``).

    Raises:
        RuntimeError: ``torchft.manager`` has no ``ManagerServer`` (another torchft), or a block is nested.
    """
    if not isinstance(endpoint, Endpoint):
        raise ValueError(f"endpoint must be an Endpoint, got {endpoint!r}")
    import torchft.manager as manager_module

    with _MANAGER_SERVER_LOCK:
        original = getattr(manager_module, "ManagerServer", None)
        if original is None:
            raise RuntimeError("torchft.manager has no ManagerServer: bound_manager_server relies on "
                               "torchft<0.3 (the version this package pins), which builds it in "
                               "Manager.__init__")
        if isinstance(original, _BoundManagerServer):
            raise RuntimeError("bound_manager_server blocks cannot be nested")
        manager_module.ManagerServer = _BoundManagerServer(original, endpoint.bind_host)
        try:
            yield
        finally:
            manager_module.ManagerServer = original


# ------------------------------------------------------------------ the lighthouse
def lighthouse_bind(endpoint: Endpoint, port: int) -> str:
    """``torchft_lighthouse --bind`` (or ``LighthouseServer(bind=...)``): ``endpoint.bind`` on ``port``.

    Workers dial ``endpoint.address(port)``: torchft's ``LighthouseServer.address()`` and its log line
    name ``socket.gethostname()`` whatever the bind, which need not reach it.
    """
    if not isinstance(endpoint, Endpoint):
        raise ValueError(f"endpoint must be an Endpoint, got {endpoint!r}")
    return f"{endpoint.bind_host}:{_check_port(port)}"
