"""The one place the lab runs ``ip`` and ``tc``: argument lists (no shell), checked exit codes, clear errors.

Why ``ip``/``tc`` and not pyroute2: the lab's every action is one iproute2 command a user can read in the log
and type by hand to inspect or undo it (``ip netns list``, ``tc -n NS qdisc show``); iproute2 is on every Linux
machine that can run the lab at all (root, namespaces); ``ip netns exec`` is how the lab starts a process in a
site, keeping its pid (it execs), so the launcher stops it by pid as usual; and the base install keeps no
dependency that only the lab would use. The cost, a fork per command, is paid only while the lab is built.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import threading

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000


class LabError(RuntimeError):
    """The lab cannot be built or driven (not root, no iproute2, a command failed): one line, no traceback."""


def check_can_build() -> None:
    """Raise :class:`LabError` unless this process can make namespaces (root with ``ip`` and ``tc``)."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root: it creates network namespaces, veth links and tc shapers "
                       "(run it as root, e.g. in a VM or container with CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabError(f"the lab needs iproute2's `{tool}` on PATH")


def run(*args: str, check: bool = True, timeout_s: float = 30.0) -> str:
    """Run one iproute2 command (``run("ip", "netns", "add", name)``); its stdout, or LabError with its stderr
    (also when it runs past ``timeout_s``)."""
    log.debug("netlab: %s", " ".join(args))
    try:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError) as error:
        raise LabError(f"`{' '.join(args)}` did not run: {error}") from None
    if check and result.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def netns_names() -> list[str]:
    """Every network namespace ``ip netns`` knows (named ones)."""
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


def why_no_lab() -> str | None:
    """Why the lab cannot be built here, or None if it can; found without making anything that outlives the check.

    Root and iproute2 (:func:`check_can_build`), then one network namespace, unshared by a thread that ends with
    the check: the namespace goes with it, and no name, folder or mount is left (``ip netns add`` would make
    ``/run/netns`` and a bind mount). Safe to call when a test module is imported.
    """
    try:
        check_can_build()
    except LabError as error:
        return str(error)
    result: list[str] = []
    thread = threading.Thread(target=_try_unshare, args=(result,), name="netlab-unshare-probe")
    thread.start()
    thread.join()
    return result[0] if result else None


def _try_unshare(result: list[str]) -> None:
    # unshare(CLONE_NEWNET) moves this thread only; the namespace is freed when the thread ends.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        result.append(f"network namespaces cannot be made here: {os.strerror(ctypes.get_errno())}")
