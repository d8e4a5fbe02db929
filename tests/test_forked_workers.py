"""Elastic workers forked from the preloaded server (``elastic.worker_start=forkserver``) are processes of their own:
their own session, exactly the environment they are given, their output in their log, their exit status seen as a
``subprocess.Popen``'s, and gone with their launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forked_mains import report_and_exit, wait_forever
from gasloc_lightning.app.forked_workers import start_forked, stop_fork_server
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def _stop_the_server():
    """As the launcher does at the end of a run (a no-op inside the session's fork_server_kept(): conftest)."""
    yield
    stop_fork_server()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return True


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_worker_is_a_process_of_its_own_and_reports_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("GASLOC_TEST_NOT_GIVEN", "launcher-only")
    log = tmp_path / "worker.log"
    log.write_text("earlier incarnation\n")
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "GIVEN": "yes"}
    worker = start_forked(report_and_exit, ["3", "x=1"], log, env)
    assert worker.wait(timeout=120) == 3 and worker.poll() == 3 and worker.returncode == 3
    first, report = log.read_text().splitlines()[:2]
    assert first == "earlier incarnation"  # appended, as the launcher's Popen does
    seen = json.loads(report)
    assert seen["pid"] == worker.pid and seen["sid"] == worker.pid != os.getsid(0)  # its own session
    assert seen["env"] == env, "the worker must see exactly the environment it was given"
    assert seen["argv"] == ["3", "x=1"] and seen["stdin_is_devnull"]
    # as a fresh interpreter: no multiprocessing parent, the platform's start method, and children of its own
    assert not seen["mp_parent"] and seen["start_method"] == "fork" and seen["child_exit"] == 3
    worker.send_signal(signal.SIGTERM)  # after the end: a no-op, as Popen's


def test_a_forked_worker_times_out_then_stops_on_sigkill(tmp_path):
    env = {"PATH": os.environ.get("PATH", ""), LAUNCHER_PID_ENV: str(os.getpid())}
    worker = start_forked(wait_forever, [], tmp_path / "worker.log", env)
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(timeout=0.1)
    log, deadline = tmp_path / "worker.log", time.monotonic() + 120
    try:  # the forked worker opens its log itself: it may not exist yet (seen in a fresh clone's suite)
        while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.poll() is None
    finally:
        worker.kill()
    assert worker.wait(timeout=60) == -signal.SIGKILL


def test_inside_fork_server_kept_the_runs_share_one_server_stopped_at_its_end(tmp_path):
    """As a test session's elastic runs do: the launcher's stop at each run's end keeps the server, the block's end
    stops it (in a process of its own: this session's server is kept for the whole session)."""
    result = subprocess.run([sys.executable, str(SCRIPTS / "kept_fork_server.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["servers"][0] == seen["servers"][1] != os.getpid() and not seen["alive_after"], seen


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_forked_worker_even_stopped_exits_with_its_fork_server_when_its_launcher_is_killed(tmp_path):
    """SIGSTOPped (a stall), the worker's own watchdog cannot act: the fork server exits once the launcher's end of
    its pipe closes, and its death SIGKILLs the worker."""
    log, worker_pid = tmp_path / "worker.log", None
    launcher = subprocess.Popen([sys.executable, str(SCRIPTS / "forked_launcher.py"), str(log)],
                                stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(launcher.stdout.readline())
        deadline = time.monotonic() + 120
        while not (log.exists() and "ready" in log.read_text()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the forked worker never got ready"
            time.sleep(0.05)
        server = _parent(worker_pid)
        os.kill(worker_pid, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30  # a failure deadline: the server reads its pipe's end at once
        while not (_gone(worker_pid) and _gone(server)):
            assert time.monotonic() < deadline, f"worker {worker_pid} or its server {server} outlived the launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if worker_pid is not None and not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


@pytest.mark.parametrize(("overrides", "forked"), [([], True), (["elastic.worker_start=exec"], False),
                                                   (["trainer=gpu"], False)])
def test_workers_are_forked_when_asked_and_on_cpu_only(overrides, forked, tmp_path):
    from hydra import compose, initialize_config_dir

    from gasloc_lightning.app.config import config_dir
    from gasloc_lightning.app.elastic import ElasticRun

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("elastic/app", overrides=["elastic.lighthouse=127.0.0.1:1", f"output_dir={tmp_path}", *overrides])
    assert ElasticRun(cfg)._forks_workers is forked
