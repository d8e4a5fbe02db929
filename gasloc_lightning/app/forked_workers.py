"""Elastic workers started as forks of a server that has already imported them.

A fresh ``python -m gasloc_lightning.app.elastic_worker`` spends about 7.5 CPU-seconds importing torch,
``torch._dynamo`` and Lightning (with the torchmetrics, transformers and matplotlib that Lightning pulls in)
before it does anything: a four-worker run on two cores waits half a minute for its first quorum, and every
chaos restart pays it again. Python's ``multiprocessing`` fork server imports the worker module once; each
worker is then a fork of that single-threaded server, never of the launcher (a fork copies the parent's
threads' locks in whatever state they are in, and the launcher runs threads).

A forked worker sees what a fresh process would: its own session (Ctrl-C in a terminal reaches the launcher
only), its output appended to its log, exactly the environment the launcher gives it, stdin on /dev/null. It
exits when the launcher does: a watchdog on the launcher's pid, and a parent-death signal from the fork server,
which exits with the launcher too. What
travels from the launcher to the server is the worker's command line, environment and log path, over the
standard library's private socket (a directory only this user can read); nothing from a peer or a file.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

WORKER_MODULE = "gasloc_lightning.app.elastic_worker"
WORKER_STARTS = ("forkserver", "exec")  # exec: a fresh interpreter per worker (needed where a command wraps it)

_CONTEXT = multiprocessing.get_context("forkserver")


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
    _CONTEXT.set_forkserver_preload([WORKER_MODULE])  # takes effect when the server starts (the first worker)
    process = _CONTEXT.Process(target=_run, args=(main, list(arguments), str(log_path), dict(env)),
                               name=f"gasloc-worker:{Path(log_path).parent.name}", daemon=True)
    process.start()
    return ForkedWorker(process)


def stop_fork_server() -> None:
    """Stop the fork server and wait for it to exit (it would exit with this process anyway: a launcher that returns
    leaves nothing running). A later forked worker starts a new one. Python has no public call for this: where
    its private one is missing, the server is left to exit with this process."""
    import multiprocessing.forkserver as forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def _run(main: Callable[[list[str]], object], arguments: list[str], log_path: str, env: dict[str, str]) -> None:
    """In the fork: become the process ``subprocess.Popen`` would have started, then call ``main``."""
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
