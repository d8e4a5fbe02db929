"""The lab itself: one network namespace per site, each joined to a backbone bridge by a veth link shaped with htb.

::

    <run>-s0 [10.213.0.1 dev wan] --veth-- [s0 <run>-bb: bridge br0 ] --veth-- [wan 10.213.0.2] <run>-s1

Everything lives in namespaces the lab creates (``<run>-bb``, ``<run>-s<i>``; ``<run>`` is ``glab-<pid>-<hex>``,
unique per run, so parallel runs never meet and a leftover names the process that made it). The root namespace
gets no link, address or route: deleting the namespaces removes every link with them. Each site's ``wan`` egress
carries an htb class per other site (a u32 filter on the destination address), at the plan's rate for that
direction, so the link between two sites is shaped in both directions and the flows that cross it share it.
Traffic inside a site (workers sharing its address) goes over its loopback, unshaped: the presets' links inside
a cluster are 10-100x faster than between.

:meth:`Lab.close` (also on ``with`` exit) kills, by pid, what still runs in a lab namespace (``ip netns pids``:
only processes inside namespaces this lab made), then deletes the namespaces. It is idempotent and never raises
part way: each step is tried.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import threading
from typing import Any

from gasloc_lightning.netlab.plan import SUBNET, LabPlan
from gasloc_lightning.netlab.shell import LabError, check_can_build, netns_names, run

log = logging.getLogger(__name__)

PREFIX = "glab-"
SITE_DEVICE = "wan"  # the site's end of its link, in every site namespace
_DEFAULT_CLASS_RATE = "10gbit"  # non-IP frames (ARP) and anything no filter matches
_UPLINK_CLASS = "1:2"  # the site's uplink, parent of its per-site classes (presets with uplinks only)
_CLONE_NEWNET = 0x40000000
_GSO_MAX_BYTES = 16384
_QUEUE_S = 0.05  # a class holds at most this many seconds of its rate
_QUEUE_MIN_BYTES = 4 * _GSO_MAX_BYTES


def run_prefix() -> str:
    """A fresh ``glab-<pid>-<hex>``: unique per run, and naming the process that made it."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"


class Lab:
    """The namespaces, links and shapers of one plan; a context manager that removes all of them on exit.

    Args:
        plan: what to build (:func:`~gasloc_lightning.netlab.plan.plan_lab`).
        prefix: the namespaces' name prefix (default: a fresh :func:`run_prefix`).
    """

    def __init__(self, plan: LabPlan, *, prefix: str | None = None) -> None:
        if not isinstance(plan, LabPlan):
            raise ValueError(f"plan must be a LabPlan, got {type(plan).__name__}")
        self.plan = plan
        self.prefix = prefix or run_prefix()
        self.namespaces: list[str] = []  # made so far, in order: what close() removes
        self._rates = [list(row) for row in plan.rates_mbit]  # the rates in force (slow: changes them)

    # ---------------------------------------------------------------- names
    @property
    def backbone(self) -> str:
        return f"{self.prefix}-bb"

    def site_namespace(self, site: int) -> str:
        return f"{self.prefix}-s{self._site(site)}"

    # ---------------------------------------------------------------- build
    def __enter__(self) -> Lab:
        self.build()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def build(self) -> None:
        """Make the backbone, every site and its shaped link; on any failure, remove what was made and raise."""
        check_can_build()
        try:
            self._add_namespace(self.backbone)
            run("ip", "-n", self.backbone, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.backbone, "link", "set", "br0", "up")
            for site in range(self.plan.sites):
                self._add_site(site)
        except BaseException:
            self.close()
            raise
        log.info("netlab built prefix=%s sites=%s", self.prefix, list(self.plan.addresses))

    def _add_namespace(self, name: str) -> None:
        self.namespaces.append(name)  # first: an interrupt during the add must still leave it to close()
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def _add_site(self, site: int) -> None:
        ns, port = self.site_namespace(site), f"s{site}"
        self._add_namespace(ns)
        run("ip", "-n", ns, "link", "add", SITE_DEVICE, "type", "veth", "peer", "name", port, "netns", self.backbone)
        run("ip", "-n", self.backbone, "link", "set", port, "master", "br0")
        run("ip", "-n", self.backbone, "link", "set", port, "up")
        run("ip", "-n", ns, "addr", "add", f"{self.plan.addresses[site]}/{SUBNET.prefixlen}", "dev", SITE_DEVICE)
        # Segments of at most 16 KiB (not 64 KiB): the short queues below then hold several of them.
        run("ip", "-n", ns, "link", "set", SITE_DEVICE, "gso_max_size", str(_GSO_MAX_BYTES))
        run("ip", "-n", ns, "link", "set", SITE_DEVICE, "up")
        self._shape(site)

    def _shape(self, site: int) -> None:
        ns = self.site_namespace(site)
        run("tc", "-n", ns, "qdisc", "add", "dev", SITE_DEVICE, "root", "handle", "1:", "htb", "default", "1")
        run("tc", "-n", ns, "class", "add", "dev", SITE_DEVICE, "parent", "1:", "classid", "1:1", "htb",
            "rate", _DEFAULT_CLASS_RATE)
        if self.plan.uplinks_mbit is not None:  # every flow leaving the site shares its uplink (in: below)
            uplink = self.plan.uplinks_mbit[site]
            run("tc", "-n", ns, "class", "add", "dev", SITE_DEVICE, "parent", "1:", "classid", _UPLINK_CLASS, "htb",
                *_rate_args(uplink))
            self._shape_ingress(site, uplink)
        for other in range(self.plan.sites):
            if other == site:
                continue
            self._shape_pair(site, other, "add")
            run("tc", "-n", ns, "filter", "add", "dev", SITE_DEVICE, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", f"{self.plan.addresses[other]}/32", "flowid", class_of_site(other))

    def _shape_pair(self, site: int, other: int, verb: str) -> None:
        """The htb class from ``site`` to ``other`` and the short queue under it, both sized for the rate in force
        (``verb``: ``add`` when building, ``change`` when a fault changes the rate)."""
        ns = self.site_namespace(site)
        parent = "1:" if self.plan.uplinks_mbit is None else _UPLINK_CLASS
        run("tc", "-n", ns, "class", verb, "dev", SITE_DEVICE, "parent", parent, "classid", class_of_site(other), "htb",
            *self._class_args(site, other))
        # A short queue under each class (fq_codel, sfq and netem are not in this kernel): the default, 1000
        # segments, holds seconds at these rates, and gloo sends both directions of a pair over one TCP
        # connection, so one direction's ACKs would wait behind the other's data. Resized with the rate: a queue
        # sized for the planned rate would hold seconds of data under a ``slow`` cap.
        run("tc", "-n", ns, "qdisc", verb, "dev", SITE_DEVICE, "parent", class_of_site(other), "bfifo", "limit",
            str(_queue_bytes(self._rates[site][other])))

    def _shape_ingress(self, site: int, mbit: float) -> None:
        """What enters ``site`` crosses its uplink too: its backbone port's egress, capped at ``mbit``."""
        port = f"s{site}"
        run("tc", "-n", self.backbone, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "1")
        run("tc", "-n", self.backbone, "class", "add", "dev", port, "parent", "1:", "classid", "1:1", "htb",
            *_rate_args(mbit))
        run("tc", "-n", self.backbone, "qdisc", "add", "dev", port, "parent", "1:1", "bfifo", "limit",
            str(_queue_bytes(mbit)))

    def _class_args(self, site: int, other: int) -> list[str]:
        """htb rate and ceil of the class from ``site`` to ``other``: its pair rate; under an uplink, a fair share
        of the uplink guaranteed and the pair rate as ceiling."""
        ceil = self._rates[site][other]
        if self.plan.uplinks_mbit is None:
            return _rate_args(ceil)
        share = min(ceil, self.plan.uplinks_mbit[site] / (self.plan.sites - 1))
        return ["rate", _kbit(share), "ceil", _kbit(ceil)]

    # ---------------------------------------------------------------- use
    def wrap(self, command: list[str], site: int) -> list[str]:
        """``command`` run inside ``site``'s namespace (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.site_namespace(site), *command]

    def reachable(self, site: int, host: str, port: int, timeout: float = 0.5) -> bool:
        """Whether a TCP connection to ``host:port`` opens from inside ``site`` (from a thread moved there)."""
        result: list[bool] = []
        thread = threading.Thread(target=_probe_in, args=(self.site_namespace(site), host, port, timeout, result))
        thread.start()
        thread.join()
        return bool(result and result[0])

    # ---------------------------------------------------------------- faults
    def set_link(self, site: int, up: bool) -> None:
        """Take ``site``'s link down (its backbone port: the site sees no carrier) or bring it back up."""
        run("ip", "-n", self.backbone, "link", "set", f"s{self._site(site)}", "up" if up else "down")

    def throttle(self, site: int, mbit: float | None) -> None:
        """Cap both directions of every link of ``site`` at ``mbit`` (None: back to the plan's rates); each class's
        queue is resized with its rate, as when the lab was built."""
        site = self._site(site)
        if mbit is not None and not (isinstance(mbit, (int, float)) and mbit > 0):
            raise ValueError(f"mbit must be a number > 0 or None, got {mbit!r}")
        for other in range(self.plan.sites):
            if other == site:
                continue
            for a, b in ((site, other), (other, site)):
                planned = self.plan.rates_mbit[a][b]
                self._rates[a][b] = planned if mbit is None else min(planned, mbit)
                self._shape_pair(a, b, "change")

    def rates_mbit(self) -> list[list[float]]:
        """The rates in force now (the plan's, unless a ``slow`` fault holds)."""
        return [list(row) for row in self._rates]

    # ---------------------------------------------------------------- tear down
    def close(self) -> None:
        """Kill what runs in the lab's namespaces (by pid), then delete them; safe to call twice.

        Every step is tried even when one fails (failures are logged), and every namespace carrying this
        run's prefix is swept too, so an add interrupted halfway is not left behind. Ctrl-C, SIGTERM and
        SIGHUP are held while it runs (a second Ctrl-C must not leave half a lab) and delivered once it is
        done: blocked for the ``ip`` children, and recorded by a Python handler on the main thread (the
        kernel may hand a process-directed signal to any thread that does not block it)."""
        with _signals_held():
            ours = [ns for ns in _listed_namespaces() if ns.startswith(f"{self.prefix}-")]
            doomed = list(reversed(self.namespaces)) + [ns for ns in ours if ns not in self.namespaces]
            for ns in doomed:
                _kill_inside(ns)
            failed = []
            for ns in doomed:
                try:
                    run("ip", "netns", "del", ns, check=ns in ours)
                except LabError:
                    failed.append(ns)
            for ns in failed:  # once more (a hung `ip` times out), then say what is left
                try:
                    run("ip", "netns", "del", ns)
                except LabError as error:
                    log.error("netlab: could not delete namespace %s (remove it with `ip netns del %s`): %s",
                              ns, ns, error)
            self.namespaces = []

    def _site(self, site: int) -> int:
        if isinstance(site, bool) or not isinstance(site, int) or not 0 <= site < self.plan.sites:
            raise ValueError(f"site must be an int in [0, {self.plan.sites}), got {site!r}")
        return site


class _signals_held:
    """Hold SIGINT, SIGTERM and SIGHUP for a block; deliver the first one received when it ends."""

    _HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        self._received: list[int] = []
        if self._main:
            self._handlers = {sig: signal.signal(sig, lambda number, frame: self._received.append(number))
                              for sig in self._HELD}
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self._HELD)  # the ip children inherit it

    def __exit__(self, *exc: object) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)  # a blocked pending signal runs the recorder
        if self._main:
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
            if self._received:
                signal.raise_signal(self._received[0])  # now, with the caller's handler in place


def _listed_namespaces() -> list[str]:
    try:
        return netns_names()
    except LabError as error:
        log.error("netlab: could not list namespaces: %s", error)
        return []


def class_of_site(site: int) -> str:
    """The htb class id that shapes a site's link towards ``site`` (on the sending site's ``wan``)."""
    return f"1:{10 + site:x}"


def _queue_bytes(mbit: float) -> int:
    """A class's queue: ``_QUEUE_S`` of its rate, at least ``_QUEUE_MIN_BYTES``."""
    return max(_QUEUE_MIN_BYTES, int(mbit * 1e6 / 8 * _QUEUE_S))


def _kbit(mbit: float) -> str:
    return f"{max(mbit, 0.001) * 1000:.0f}kbit"


def _rate_args(mbit: float) -> list[str]:
    return ["rate", _kbit(mbit), "ceil", _kbit(mbit)]


def _kill_inside(ns: str) -> None:
    try:
        pids = [int(pid) for pid in run("ip", "netns", "pids", ns, check=False).split()]
    except (ValueError, LabError):
        pids = []
    for pid in pids:
        log.warning("netlab: process %d still runs in %s: killed", pid, ns)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _probe_in(ns: str, host: str, port: int, timeout: float, result: list[bool]) -> None:
    # setns(CLONE_NEWNET) moves this thread only; the thread ends with the probe.
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise LabError(f"setns into {ns} failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            result.append(True)
    except OSError:
        result.append(False)


def stale_namespaces() -> list[str]:
    """Lab namespaces whose maker (the pid in their name) no longer runs: leftovers of a killed run."""
    stale = []
    for name in netns_names():
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            stale.append(name)
    return stale


def remove_namespaces(names: list[str]) -> None:
    """Kill what runs in each of ``names`` (lab namespaces only) by pid, then delete them."""
    for name in names:
        if not name.startswith(PREFIX):
            raise ValueError(f"{name!r} is not a lab namespace (they start with {PREFIX!r})")
        _kill_inside(name)
        run("ip", "netns", "del", name)


def lab_namespaces() -> list[str]:
    """Every lab namespace on this machine (any run's)."""
    return [name for name in netns_names() if name.startswith(PREFIX)]
