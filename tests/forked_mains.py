"""Module-level mains for ``tests/test_forked_workers.py``: a fork server imports them by name."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

from gasloc_lightning.strategies.launcher import exit_with_parent


def report_and_exit(arguments: list[str]) -> None:
    """Print what the process is (session, environment, argv, threads), then exit with code ``arguments[0]``."""
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "env": dict(os.environ), "argv": sys.argv[1:],
                      "stdin_is_devnull": os.path.samefile(f"/proc/self/fd/{sys.stdin.fileno()}", os.devnull),
                      "mp_parent": multiprocessing.parent_process() is not None,
                      "start_method": multiprocessing.get_start_method(),
                      "child_exit": _a_child_of_its_own()}),
          flush=True)
    sys.exit(int(arguments[0]))


def report_parent_and_exit(arguments: list[str]) -> None:
    """Print the parent's pid (the fork server), then exit 0."""
    print(os.getppid(), flush=True)


def _exit_3() -> None:
    sys.exit(3)


def _a_child_of_its_own() -> int | None:
    """A worker may start processes (a DataLoader's workers): the exit code of one it started."""
    child = multiprocessing.get_context("fork").Process(target=_exit_3)
    child.start()
    child.join()
    return child.exitcode


def wait_forever(arguments: list[str]) -> None:
    """As a worker does: exit with the launcher. Says it is ready, then waits."""
    exit_with_parent()
    print("ready", flush=True)
    while True:
        time.sleep(1)
