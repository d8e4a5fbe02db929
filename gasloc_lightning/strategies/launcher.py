"""No worker outlives its launcher, and no launcher leaves a worker behind.

- :class:`StoppingSubprocessLauncher` is Lightning's subprocess launcher (``start_method="popen"``)
  that, when the launching process fails for any reason (an exception, Ctrl-C), stops every
  worker process it started: SIGTERM, then SIGKILL after a grace period, by pid.
- :func:`exit_with_parent` makes a worker exit when the process that launched it is gone (it was
  killed, say): Linux's parent-death signal where available, and a watchdog thread on the parent's
  pid everywhere (on the launcher's own pid for a fork server's child, whose parent is the server).
- :func:`release_process_group` destroys the process group before the interpreter's shutdown: at once in a
  spawned or forked worker, at exit elsewhere (torchrun's ranks).
- :class:`ShardedResultsLauncher` is Lightning's spawn/fork launcher for sharded workers: the weights it
  hands back to the launching process are the whole model, gathered from rank 0's worker, not rank 0's shard.

A failing worker other than the launching one is already handled by Lightning: its process observer
stops the others within a few seconds.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection  # private: re-check on upgrades
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "GASLOC_LAUNCHER_PID"
_WATCHDOG_PERIOD_S = 1.0
_PR_SET_PDEATHSIG = 1


class StoppingSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher that stops the workers it started when the launching process fails.

    Args:
        cluster_environment, num_processes, num_nodes: as Lightning's ``_SubprocessScriptLauncher``.
        grace_s: seconds a worker gets after SIGTERM before SIGKILL.
    """

    def __init__(self, *args: Any, grace_s: float = 5.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace_s = grace_s

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException as error:
            if any(proc.poll() is None for proc in self.procs):
                # said before the workers go, in case anything cuts this process short before its traceback
                cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                log.error("the launching process stopped (%s); stopping the worker processes it started "
                          "(SIGTERM, SIGKILL after %g s)", cause, self.grace_s)
            self.stop_workers()
            raise

    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # only the workers started here inherit it
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER_PID_ENV, None)

    def stop_workers(self) -> None:
        """Stop every worker process still running: SIGTERM, then SIGKILL after ``grace_s``.

        The workers are first taken out of the list Lightning's process observer watches (the same list object),
        so that the observer, seeing a worker this launcher stopped, does not SIGKILL the launching process
        while it stops the others and reports its own error."""
        procs = list(self.procs)
        self.procs.clear()
        for proc in procs:
            if proc.poll() is None:
                log.info("stopping worker process pid=%d", proc.pid)
        try:
            terminate(procs, self.grace_s)
        except BaseException:  # a second Ctrl-C during the grace: no more grace
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            raise


class ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (``spawn``, ``fork``, ``forkserver``) for workers sharded with FSDP2.

    Lightning returns rank 0's ``state_dict()`` to the launching process; a sharded rank's holds DTensors (its
    shard and a device mesh) that the launching process, which has no process group, cannot load. The strategy
    hands this launcher its worker's whole state dict with :meth:`keep` while the process group still exists (a
    collective inside each worker, at teardown after a fit that ended normally; after the end-of-fit average
    every worker holds the consensus), and rank 0 returns that instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._full_state: dict[str, Any] | None = None

    def keep(self, full_state: dict[str, Any]) -> None:
        self._full_state = full_state

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        full, self._full_state = self._full_state, None
        if full is None:  # not a finished fit: nothing is handed back but the state, as Lightning does
            return super()._collect_rank_zero_results(trainer, results)
        module = trainer.lightning_module
        module.state_dict = lambda *args, **kwargs: full  # what Lightning's collection reads, for this call only
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


def terminate(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Stop ``processes`` by pid: SIGCONT (a stopped process cannot act on SIGTERM), SIGTERM, then SIGKILL what
    still runs ``grace_s`` later."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exit_with_parent() -> None:
    """In a worker process: exit when the process that launched it is gone. A no-op in a launching process."""
    parent = _launching_parent()
    if parent is None:
        return
    set_parent_death_signal()  # a fork server's child: its server, which exits with the launcher
    if os.getppid() == parent:
        watch = _watch_parent
    elif _alive(parent):  # a fork server's child: the launcher asked for it but is not its parent
        watch = _watch_launcher
    else:  # gone before the signal was armed
        os._exit(1)
    threading.Thread(target=watch, args=(parent,), name="gasloc-parent-watchdog", daemon=True).start()


def _launching_parent() -> int | None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None and int(launcher) != os.getpid():
        return int(launcher)
    parent = multiprocessing.parent_process()  # spawn and fork workers
    return parent.pid if parent is not None else None


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl: the watchdog still works
        return None


# Looked up once, here: loading libc in a child forked from a threaded parent (a ``preexec_fn``) can deadlock.
_PRCTL = _load_prctl()


def set_parent_death_signal(parent: int | None = None) -> None:
    """Linux: this process gets SIGKILL when its parent dies (also usable as a ``subprocess`` ``preexec_fn``).

    Args:
        parent: the pid of the expected parent; if it is already gone when the signal is armed, exit at once.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _watch_launcher(launcher: int) -> None:
    """Exit once ``launcher``, which is not this process's parent, is gone: wait on a pidfd where Linux has them
    (no pid reuse can fool it), else poll the pid."""
    try:
        pidfd = os.pidfd_open(launcher)
    except (AttributeError, OSError):
        while _alive(launcher):
            time.sleep(_WATCHDOG_PERIOD_S)
    else:
        poller = select.poll()  # (select.select fails on a descriptor past 1023)
        poller.register(pidfd, select.POLLIN)
        poller.poll()  # readable once the process has exited
    log.error("the launching process (pid %d) is gone: this worker exits", launcher)
    os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCHDOG_PERIOD_S)
    log.error("the launching process (pid %d) is gone: this worker exits", parent)
    os._exit(1)


def release_process_group() -> None:
    """Destroy the process group before the interpreter's shutdown, where gloo's threads were seen to abort the
    process ("terminate called without an active exception"; about one in six runs of a 2-rank DDP job on a loaded
    2-core machine, and a torchrun rank of the suite's).

    - In a spawned or forked worker (which exits right after its teardown): now.
    - Anywhere else (torchrun's ranks, a script re-executed by the subprocess launcher, the launching process): at
      exit, once, so that the group stays usable after ``fit`` (a ``trainer.test`` in the same script). The handler
      is Lightning's own, which it registers for NCCL groups only (Ctrl-C is ignored while it runs).

    Destroying is local: it waits for nothing but this process's queued work (a failed run's exchange still in
    flight: at most its collective timeout, as at the interpreter's shutdown).
    """
    global _RELEASE_AT_EXIT
    if multiprocessing.parent_process() is not None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    elif not _RELEASE_AT_EXIT:
        _RELEASE_AT_EXIT = True
        atexit.register(_destroy_dist_connection)


_RELEASE_AT_EXIT = False
