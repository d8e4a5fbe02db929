"""Elastic workers started as forks of a server that has already imported them.

A fresh ``python -m gasloc_lightning.app.elastic_worker`` spends about 7.5 CPU-seconds importing torch,
``torch._dynamo`` and Lightning (with the torchmetrics, transformers and matplotlib that Lightning pulls in)
before it does anything: a four-worker run on two cores waits half a minute for its first quorum, and every
chaos restart pays it again. Python's ``multiprocessing`` fork server imports the worker module once; each
worker is then a fork of that server (it runs no Python thread; importing torch starts one idle native thread),
never of the launcher (a fork copies the parent's
threads' locks in whatever state they are in, and the launcher runs threads).

A forked worker sees what a fresh process would: its own session (Ctrl-C in a terminal reaches the launcher
only), its output appended to its log, exactly the environment the launcher gives it, stdin on /dev/null, no
multiprocessing parent, and it may start processes of its own (a DataLoader's workers). Its differences from a
fresh interpreter: what torch, torchft and OpenMP read from the environment at import (``RUST_LOG``,
``TORCH_LOGS``, ``OMP_*`` besides the thread count, which is applied again) is what the launcher had when the
server started, and ``/proc/<pid>/environ`` and ``cmdline`` show the server's (``elastic.worker_start=exec``
where that matters).

Lifetime. The server runs in its own session (``fork_server_session``), so a signal to the launcher's process
group reaches the launcher, which makes the workers leave cleanly. It exits when the launcher does (the launcher
holds the only writing end of its "alive" pipe: each fork closes the copy it is handed), and every fork gets
SIGKILL when the server exits (a parent-death signal armed before anything else runs), even a stopped one. A
watchdog on the launcher's own pid is a second guard. The launcher stops the server at the end of each run, so a
long-lived process (a notebook) never forks workers from stale code; a test session shares one server across its
runs instead (:func:`fork_server_kept`).

What travels from the launcher to the server is the worker's command line, environment and log path, over the
standard library's socket in a directory only this user can read (Python 3.11's fork server authenticates no
client: any process of the same user could ask it to fork, which that user can do anyway); nothing from a peer
or a file.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

WORKER_MODULE = "gasloc_lightning.app.elastic_worker"
WORKER_STARTS = ("forkserver", "exec")  # exec: a fresh interpreter per worker (needed where a command wraps it)

_CONTEXT = multiprocessing.get_context("forkserver")
_PRELOAD = ["gasloc_lightning.app.fork_server_session", WORKER_MODULE]  # its own session first, then the imports
_server_started = False  # whether this process has used the server (stop_fork_server stops only that one)
_server_kept = False  # inside fork_server_kept(): stop_fork_server() leaves the server running
_STOP_WAIT_S = 30.0  # the server exits at once on its pipe's end, unless still importing (about 7.5 CPU-s)


class ForkedWorker:
    """A worker forked from the server, with the calls the launcher makes on a ``subprocess.Popen``."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode  # non-blocking: the server reports the exit status on the sentinel

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(WORKER_MODULE, timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid whose process was already reaped
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_forked_worker(arguments: list[str], log_path: Path, env: dict[str, str]) -> ForkedWorker:
    """Start ``python -m gasloc_lightning.app.elastic_worker ARGUMENTS`` as a fork of the preloaded server.

    Args:
        arguments: the worker's command-line arguments (its config path, then ``KEY=VALUE`` overrides).
        log_path: the file its stdout and stderr are appended to.
        env: its whole environment (nothing of the launcher's or the server's own leaks in).
    """
    from gasloc_lightning.app.elastic_worker import main

    return start_forked(main, arguments, log_path, env)


def start_forked(main: Callable[[list[str]], object], arguments: list[str], log_path: Path,
                 env: dict[str, str]) -> ForkedWorker:
    """Run ``main(arguments)`` in a fork of the server, as a process of its own (see the module's docstring).

    Args:
        main: a module-level function (the server imports its module, if it has not already).
    """
    global _server_started
    _CONTEXT.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first worker of a run)
    _server_started = True
    process = _CONTEXT.Process(target=_run, args=(main, list(arguments), str(log_path), dict(env)),
                               name=f"gasloc-worker:{Path(log_path).parent.name}", daemon=True)
    process.start()
    return ForkedWorker(process)


@contextmanager
def fork_server_kept() -> Iterator[None]:
    """Within it the runs of this process share one fork server: :func:`stop_fork_server` leaves it running, and it
    is stopped on exit. For a process that launches many runs of code that does not change meanwhile, such as a
    test session: each server costs about 7.5 CPU-s to start, and every run's workers fork from the code imported
    when it started."""
    global _server_kept
    outer, _server_kept = _server_kept, True
    try:
        yield
    finally:
        _server_kept = outer
        stop_fork_server()


def stop_fork_server() -> None:
    """Stop the fork server and reap it: its forks (there should be none left) get SIGKILL as it exits. A later
    forked worker starts a new one. Python has no public call for this; where its private state is missing, the
    server is left to exit with this process. Inside :func:`fork_server_kept`, nothing."""
    import multiprocessing.forkserver as forkserver

    global _server_started
    if not _server_started or _server_kept:
        return
    _server_started = False
    server = getattr(forkserver, "_forkserver", None)
    pid, alive_fd = getattr(server, "_forkserver_pid", None), getattr(server, "_forkserver_alive_fd", None)
    if server is None or pid is None or alive_fd is None:
        return
    os.close(alive_fd)  # the server reads the end of its pipe and exits
    deadline = time.monotonic() + _STOP_WAIT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:  # stuck (in its imports): its forks die with it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    address = getattr(server, "_forkserver_address", None)
    if address and isinstance(address, str) and os.path.exists(address):
        os.unlink(address)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


def _run(main: Callable[[list[str]], object], arguments: list[str], log_path: str, env: dict[str, str]) -> None:
    """In the fork: become the process ``subprocess.Popen`` would have started, then call ``main``."""
    _leave_the_server()
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    import torch  # already imported by the server: free

    threads = env.get("OMP_NUM_THREADS")
    if threads:  # the server imported torch before this worker's thread count was known
        torch.set_num_threads(int(threads))
    sys.argv = [sys.modules[main.__module__].__file__ or main.__module__, *arguments]
    main(arguments)


def _leave_the_server() -> None:
    """Drop what ties this fork to the server and the launcher, and die with the server.

    The fork is handed copies of the launcher's end of the server's "alive" pipe and of the resource tracker's
    pipe: kept, they would keep the server alive after the launcher died. It is marked as a daemonic child of the
    launcher (which may not start processes) and defaults to the fork-server start method: a fresh interpreter is
    neither."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.process as mp_process
    import multiprocessing.resource_tracker as resource_tracker

    from gasloc_lightning.strategies.launcher import set_parent_death_signal

    set_parent_death_signal(os.getppid())  # the server: it exits when the launcher does
    for holder, attribute in ((forkserver._forkserver, "_forkserver_alive_fd"),
                              (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(holder, attribute, None)
        if fd is not None:
            os.close(fd)
            setattr(holder, attribute, None)
    multiprocessing.current_process().daemon = False
    mp_process._parent_process = None  # as a fresh interpreter: no multiprocessing parent
    multiprocessing.set_start_method(None, force=True)  # the platform's default again
