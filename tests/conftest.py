"""Shared fixtures: a fresh port per launch; no leaked environment, thread count or process group between tests,
and no thread or child process left running by a test (a later fork-started test would hang on them)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gasloc_lightning.app.forked_workers import fork_server_kept

# One OpenMP thread here and, through the environment, in every process the suite starts (exec'd ranks, elastic
# workers, console scripts): the suite runs its xdist workers side by side on 2 cores, and an OpenMP pool of 2 beside
# another busy process spins instead of computing. Measured on test_sim_equivalence alone, -n 2: 240 s wall and
# 469 CPU-s with torch's default threads, 97 s and 180 CPU-s with one. A test that needs more threads sets them.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# OMP_NUM_THREADS too: Lightning's launchers set it in the launching process, and a later test's forked
# workers would then keep the parent's thread count.
# The fused round is chosen by size unless forced: a value in the user's environment must not change the suite.
os.environ.pop("GASLOC_FUSED_ROUND", None)

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "OMP_NUM_THREADS")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _restore_distributed_state():
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _one_fork_server_per_session():
    """The elastic runs of one xdist worker fork their workers from one server (each server costs about 7.5 CPU-s
    to start: about 30 runs in the suite), stopped when the session ends."""
    with fork_server_kept():
        yield


@pytest.fixture
def fresh_port(monkeypatch):
    """Writes a free port to MASTER_PORT now; call the returned function before each further launch."""

    def new_port() -> int:
        port = free_port()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return port

    new_port()
    return new_port


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is faster, and avoids oversubscription next to other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- no thread and no child left behind
# A test that leaves native threads running (a torchft manager's tokio runtime, a TCPStore's libuv loop, gloo's
# loops, an HTTP server) makes every later fork() in this pytest process copy the locks those threads may hold at
# that instant. Worse, where such threads end only when the garbage collector frees their owner (torchft 0.2.0 keeps
# its Manager in a reference cycle), a forked child that runs the collector drops the owner there, and its Rust
# runtime waits forever for threads the child does not have: a fork-started test (GASLoCStrategy(start_method=
# "fork")) hung until its timeout, and its ranks outlived it. So the last test of each module fails in teardown,
# naming the threads its module left and the test after which each appeared; every test that leaves
# multiprocessing children fails, after they are killed by pid; and a fork-started test refuses to fork beside
# leftover threads, naming them, instead of hanging.

# Started once, on first use, for the process's lifetime, and safe beside a fork: torchft's TimeoutManager
# (torchft.futures) and its watchdog; jemalloc's background purger (pyarrow's allocator, loaded with `datasets`:
# jemalloc takes its locks around fork() in its own atfork handlers); tqdm's monitor (a Python thread that sleeps).
_LIFETIME_THREADS = ("TimeoutManager", "(_watchdog_loop)", "jemalloc_bg_thd", "tqdm_monitor")
_THREAD_GRACE_S = 10.0  # a bounded wait for threads that are ending (an observer's last sleep, a joined server)
_CHILD_GRACE_S = 10.0
_MAIN_COMM = Path("/proc/self/comm").read_text().strip() if Path("/proc/self/comm").exists() else ""


def _threads() -> dict[int, str]:
    """This process's threads that a test may leave behind: native id -> name (Python's, else the kernel's).

    Unnamed native threads (named as the main thread: torch's intra-op/OpenMP pool, created once and kept) and
    torchft's lifetime threads are not counted. Empty where /proc is missing."""
    if not _MAIN_COMM:
        return {}
    python = {thread.native_id: thread.name for thread in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # it ended meanwhile
            continue
        name = python.get(int(tid))
        if name is None and comm == _MAIN_COMM:
            continue
        name = name or comm
        if int(tid) != threading.main_thread().native_id and not name.endswith(_LIFETIME_THREADS):
            found[int(tid)] = name
    return found


def _left_since(baseline: dict[int, str], *, collect: bool) -> dict[int, str]:
    """Threads absent from ``baseline`` still running after a bounded wait; with ``collect``, garbage is collected
    first (an object in a reference cycle may own them)."""
    deadline = time.monotonic() + _THREAD_GRACE_S
    while True:
        if collect:
            gc.collect()
        left = {tid: name for tid, name in _threads().items() if tid not in baseline}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class _ThreadLedger:
    """Which test first saw each thread, and the threads that ran when the current module began."""

    def __init__(self) -> None:
        self.session: dict[int, str] = _threads()
        self.module: dict[int, str] = dict(self.session)
        self.module_name: str | None = None
        self.first_seen: dict[int, str] = {}

    def describe(self, threads: dict[int, str]) -> str:
        return ", ".join(f"{name!r} (tid {tid}, first seen after {self.first_seen.get(tid, 'an earlier test')})"
                         for tid, name in sorted(threads.items()))


_LEDGER: _ThreadLedger | None = None


def pytest_sessionstart(session):
    global _LEDGER
    _LEDGER = _ThreadLedger()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if _LEDGER is not None and item.module.__name__ != _LEDGER.module_name:
        _LEDGER.module_name, _LEDGER.module = item.module.__name__, _threads()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    # tryfirst: around the logging plugin's wrapper, which drops the test's log records (a record of a logged
    # exception holds its traceback, and so every object in its frames) before this judges what is left.
    result = yield  # the test's fixtures, and the module's where this is its last test, are finalized
    _reap_children(item)
    if _LEDGER is None:
        return result
    for tid in _threads():
        _LEDGER.first_seen.setdefault(tid, item.nodeid)
    if nextitem is None or nextitem.module is not item.module:
        _judge_module(item)
    return result


def _judge_module(item) -> None:
    """Fail the module's last test if the module left threads, also those that end only when the garbage collector
    frees their owner: a forked child that collects such an owner hangs (a torchft Manager's Rust runtime waits
    for its threads, which the child does not have). Collected here, so the next module starts clean."""
    left = _left_since(_LEDGER.module, collect=False)
    still = _left_since(_LEDGER.module, collect=True) if left else {}
    _LEDGER.module = _threads()
    if still:
        pytest.fail(f"{item.module.__name__} left {len(still)} thread(s) running: {_LEDGER.describe(still)}. "
                    "A later fork-started test would copy them, and their locks, into its child: stop them in the "
                    "test (shut down the manager, close the store, server or group, join the thread).", pytrace=False)
    if left:
        pytest.fail(f"{item.module.__name__} left {len(left)} thread(s) that ended only when the garbage collector "
                    f"freed their owner: {_LEDGER.describe(left)}. A forked child that collects such an owner can "
                    "hang (a torchft Manager's runtime waits for threads the child does not have): release it "
                    "explicitly (shutdown(), close()).", pytrace=False)


def _reap_children(item) -> None:
    """Fail a test that leaves multiprocessing children running (a launch that hung until its timeout), after
    killing them by pid, so that no later test inherits them."""
    deadline = time.monotonic() + _CHILD_GRACE_S
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(timeout=5)
    if children:
        pytest.fail(f"{item.nodeid} left {len(children)} child process(es) running, now killed: "
                    + ", ".join(f"{child.name} (pid {child.pid})" for child in children), pytrace=False)


@pytest.fixture
def threads_safe_to_fork():
    """For tests that fork their ranks. Garbage is collected here, in the parent, where the threads of what it frees
    exist; then the test refuses to fork while threads left by earlier tests run, naming them (see above)."""
    left = _left_since({} if _LEDGER is None else _LEDGER.session, collect=True)
    if left:
        pytest.fail(f"this process runs {len(left)} thread(s) that earlier tests left: "
                    f"{_LEDGER.describe(left) if _LEDGER else left}; a fork now could copy a held lock into the "
                    "child and hang it, so this test does not fork.", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``--dist loadgroup`` keep each ``xdist_group`` on one worker again.

    pytest-xdist (3.8) marks a grouped test by appending ``@<group>`` to ``item._nodeid``; pytest 9.2 reads the id
    from ``item._id``, so the suffix is lost and the groups are spread over the workers (the sweep ran on both, and
    the netlab tests, which must not run beside each other, did). Here the suffix goes where pytest reads it, in
    the workers only (where xdist's own hook ran), and only when it is missing (an older pytest keeps xdist's)."""
    if not getattr(config.option, "loadgroup", False) or not hasattr(config, "workerinput"):
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):  # xdist's rule: an id's "@" may be a param's
            from _pytest.nodeid import coerce_node_id  # pytest >= 9.2, the only one where the suffix goes missing

            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
