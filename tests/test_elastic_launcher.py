"""``gasloc-elastic`` as a user drives it: what listens, where the secret goes, a clean leave, Ctrl-C and resume,
a quorum that can never form, elastic DiLoCo, and a budget that is not a whole number of rounds.

The launcher runs (``slow``, ``distributed``): tiny GPT, H = 5, 3 or 4 workers on CPU, at most 150 steps (the CI
machine has 2 cores); each checks that nothing the launcher started outlives it and that it leaves no hand-over
file behind. The settings the launcher refuses are checked without starting anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402

from app_utils import CONF, clean_env, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import (  # noqa: E402
    ELASTIC_SUMMARY_FILE,
    ChaosEvent,
    ElasticRun,
    check_elastic,
    end_grace_s,
    lighthouse_command,
    parse_chaos,
    run_elastic,
    worker_config,
)
from gasloc_lightning.app.elastic_worker import LEAVE_CHECKPOINT, read_progress  # noqa: E402
from gasloc_lightning.app.export import main as export_main  # noqa: E402
from gasloc_lightning.plugins.per_rank import load_rank_checkpoint  # noqa: E402
from gasloc_lightning.comm.wire import SECRET_ENV  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402
from net_utils import descendants, listening_sockets, non_loopback  # noqa: E402

MAX_STEPS = 100
H = 5
FAST = [
    "model=tiny", "data=stdlib", "trainer=cpu", f"inner_steps={H}", f"trainer.max_steps={MAX_STEPS}",
    f"trainer.val_check_interval={MAX_STEPS}", "trainer.enable_progress_bar=false", "data.batch_size=4",
    "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=3",
    "elastic.heartbeat_timeout_ms=1500", "elastic.join_timeout_ms=5000",
    "elastic.gossip_timeout=3", "elastic.quorum_timeout=20", "elastic.leave_grace_s=20", "elastic.timeout_s=240",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()  # once, not by racing workers
    return path


def _overrides(overrides: list[str], output_dir: Path, cache_dir: Path) -> list[str]:
    return [*FAST, *overrides, f"output_dir={output_dir}", f"cache_dir={cache_dir}"]


def _run(overrides: list[str], output_dir: Path, cache_dir: Path, on_poll=None) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app", overrides=_overrides(overrides, output_dir, cache_dir))
    return run_elastic(cfg, on_poll=on_poll)


def _rows(summary: dict) -> dict[int, dict]:
    return {row["worker"]: row for row in summary["workers"]}


def _progress(output_dir: Path, worker: int) -> dict:
    return read_progress(output_dir / f"worker_{worker}") or {}


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if b"=" in entry)


def _ours(pid: int) -> bool:
    """Whether ``pid`` is alive (not a zombie) and one of the launcher's processes (not a reused pid)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return state != "Z" and (b"elastic_worker" in command or b"torchft_lighthouse" in command)


def _assert_nothing_left(pids: list[int], run_dir: Path, in_process: bool = True) -> None:
    """Every process the launcher started is gone, no hand-over or torn file remains, and (when the launcher ran in
    this process) it holds no file of the run open."""
    assert pids, "the launcher recorded no process"
    alive = [pid for pid in pids if _ours(pid)]
    assert not alive, f"processes started by the launcher are still running: {alive}"
    leftovers = [p for pattern in ("release.*", "*.partial") for p in run_dir.rglob(pattern)]
    assert not leftovers, f"the launcher left hand-over files behind: {leftovers}"
    if in_process:
        held = []
        for link in Path("/proc/self/fd").iterdir():
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(str(run_dir)):
                held.append(target)
        assert not held, f"the launcher still holds files of the run open: {held}"


# ------------------------------------------------------------------ settings (nothing started)
def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="elastic/app", overrides=[*FAST, *overrides, "output_dir=/nonexistent"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["elastic.max_workers=2"], r"elastic.max_workers=2 is below elastic.workers=3: the surplus workers would be "
                                    r"refused at their first quorum"),
        (["elastic.leave_grace_s=-1"], r"elastic.leave_grace_s must be >= 0"),
        (["elastic.status_every_s=0"], r"elastic.status_every_s must be > 0"),
        (["elastic.bind=0.0.0.0"], r"elastic.bind='0.0.0.0', elastic.advertise=None: advertise is required"),
        (['elastic.bind="::"'], r"elastic.bind='::', elastic.advertise=None: advertise is required"),
        (["elastic.advertise=0.0.0.0"], r"elastic.advertise='0.0.0.0': .*not the wildcard"),
        (["elastic.bind=localhost"], r"elastic.bind='localhost'.*bind must be an IP address"),
    ],
)
def test_the_launcher_refuses_settings_that_cannot_work_naming_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_elastic(_compose(overrides))


def test_a_worker_that_trained_to_the_last_step_is_given_transfer_timeout_beyond_the_end_grace():
    """It may be handing the final model to a member that heals from it (up to transfer_timeout): stopping it at
    end_grace_s killed the holder of the final model. Every other worker keeps end_grace_s."""
    cfg = _compose(["elastic.end_grace_s=7", "elastic.transfer_timeout=11", "trainer.max_steps=40"])
    grace = lambda progress: end_grace_s(progress, cfg.elastic, max_steps=40)  # noqa: E731
    assert grace({"state": "running", "step": 40}) == 18
    assert grace({"state": "running", "step": 39}) == 7  # still training: a latecomer
    assert grace({"state": "starting", "step": 0}) == grace({}) == 7
    assert grace({"state": "done", "step": 40}) == 7  # it has finished: nothing to hand over from a live worker
    assert end_grace_s({"state": "running", "step": 40}, cfg.elastic, max_steps=-1) == 7  # no last step to know


def test_a_wildcard_bind_is_taken_when_written_with_an_address_to_advertise():
    cfg = _compose(["elastic.bind=0.0.0.0", "elastic.advertise=node0", "elastic.max_workers=3"])
    check_elastic(cfg)
    strategy = worker_config(cfg, 1, "node0:29510", "/nonexistent/worker_1").strategy
    assert (strategy.bind, strategy.advertise, strategy.lighthouse) == ("0.0.0.0", "node0", "node0:29510")


def test_workers_and_the_lighthouse_listen_on_loopback_by_default():
    cfg = _compose([])
    check_elastic(cfg)
    strategy = worker_config(cfg, 0, "127.0.0.1:29510", "/nonexistent/worker_0").strategy
    assert (strategy.bind, strategy.advertise, strategy.leave_grace_s) == ("127.0.0.1", None, 20.0)
    command = lighthouse_command(29510, 2, 5000, 1500)
    assert command[command.index("--bind") + 1] == "127.0.0.1:29510"
    command = lighthouse_command(29510, 2, 5000, 1500, bind="::1")
    assert command[command.index("--bind") + 1] == "[::1]:29510"


def test_the_elastic_diloco_worker_takes_strategy_diloco_codec_and_overlap_and_gossip_ignores_them():
    strategy = worker_config(_compose(["elastic.method=diloco", "strategy=diloco", "strategy.message_codec=int4",
                                       "strategy.overlap=true"]), 0, "127.0.0.1:29510", "/nonexistent/w").strategy
    assert strategy._target_.endswith("ElasticDiLoCoStrategy")
    assert (strategy.message_codec, strategy.overlap, strategy.fragments) == ("int4", True, 1)
    strategy = worker_config(_compose([]), 0, "127.0.0.1:29510", "/nonexistent/w").strategy  # gasloc: as before
    assert "message_codec" not in strategy and "overlap" not in strategy


def test_term_is_a_chaos_action():
    assert parse_chaos(["restart:2@50", "term:2@40"], workers=3) == [ChaosEvent("term", 2, 40),
                                                                       ChaosEvent("restart", 2, 50)]
    with pytest.raises(ValueError, match="expected kill:W@STEP, term:W@STEP"):
        parse_chaos(["terminate:2@40"], workers=3)


# ------------------------------------------------------------------ exposure and the secret
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_nothing_listens_beyond_loopback_during_a_run(tmp_path, cache_dir, capfd, monkeypatch):
    """Sampled at every poll of the launcher: the lighthouse's and every worker's listening sockets (the worker's
    manager server, store, gloo and state transfer) are on loopback. The generated secret, read from a worker's
    environment, appears in no file of the run and nowhere in the output, and the lighthouse is not given it.
    The run is 47 steps of H = 5 (a shorter last round): every worker stops at step 47 (not 45 or 50) on one model."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    listeners: dict[int, set[tuple[str, int]]] = {}
    environments: dict[int, dict[str, str]] = {}

    def sample(run: ElasticRun) -> None:
        for pid in run.live_pids():
            try:
                listeners.setdefault(pid, set()).update(listening_sockets(pid))
                environments.setdefault(pid, _environ(pid))
            except OSError:  # it exited meanwhile
                continue

    steps = 47
    # exec: a fresh interpreter per worker, whose /proc/<pid>/environ is the environment the launcher gave it (a fork
    # server's child shows the server's; tests/test_forked_workers.py checks what such a worker is given)
    summary = _run([f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "logger=tensorboard",
                    "elastic.worker_start=exec"], tmp_path, cache_dir, on_poll=sample)
    lighthouse = summary["lighthouse_pid"]
    workers = [pid for pid in listeners if pid != lighthouse]
    assert listeners.get(lighthouse), "the lighthouse was never seen listening: nothing was sampled"
    assert any(listeners[pid] for pid in workers), f"no worker was seen listening: {listeners}"

    secrets = {environments[pid].get(SECRET_ENV) for pid in workers}
    assert len(secrets) == 1, "the workers of one run were given different secrets (or none)"
    secret = secrets.pop()
    assert secret and len(secret) == 64, "the generated secret is not new_secret()'s 64 hex characters"
    assert SECRET_ENV not in environments[lighthouse], "the lighthouse was given the secret"
    output = capfd.readouterr()
    assert secret not in output.out and secret not in output.err, "the secret was printed"
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name == "worker_config.yaml" for path in files) and any(path.name == "worker.log" for path in files)
    written = [path for path in files if secret.encode() in path.read_bytes()]
    assert not written, f"the secret was written to {written}"
    assert all(row["status"] == "finished" and row["exit_steps"] == [steps] for row in summary["workers"]), summary
    checksums = {row["model_checksum"] for row in summary["workers"]}
    assert len(checksums) == 1 and None not in checksums, checksums
    _assert_nothing_left(summary["pids"], tmp_path)
    exposed = {pid: non_loopback(sorted(sockets)) for pid, sockets in listeners.items()}
    assert not any(exposed.values()), f"listening beyond loopback (pid: [(address, port)]): {exposed}"
    _assert_live_status(output.out, steps)
    _assert_one_tensorboard(tmp_path, workers=3)


def _assert_live_status(out: str, steps: int) -> None:
    """Captured output is not a terminal: status lines are printed, the last one at the run's end with its loss."""
    lines = [line for line in out.splitlines() if line.startswith("status: ")]
    assert lines, f"no live status line in the output:\n{out}"
    last = lines[-1]
    for part in (f"step {steps}/{steps}", "ETA 0:00:00", "quorum 3 ", "val loss "):
        assert part in last, f"{part!r} not in the last status line {last!r}"
    assert "val loss -" not in last, last


def _assert_one_tensorboard(run_dir: Path, workers: int) -> None:
    """logger=tensorboard: one run folder, one TensorBoard run per worker plus the launcher's quorum series."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(name: str) -> list[str]:
        accumulator = EventAccumulator(str(run_dir / "tensorboard" / name))
        accumulator.Reload()
        return accumulator.Tags()["scalars"]

    for worker in range(workers):
        assert "train/loss" in scalars(f"worker_{worker}"), f"worker {worker} has no train/loss series"
    assert "launcher/quorum_size" in scalars("launcher")


# ------------------------------------------------------------------ a clean leave
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_term_makes_a_worker_leave_cleanly(tmp_path, cache_dir, monkeypatch):
    """term:2@40 with 4 workers: worker 2 finishes its round, leaves with its checkpoint and exits 0; the other three
    reach max_steps on one model, and nobody records a failed exchange or collective (it left between rounds)."""
    monkeypatch.setenv(SECRET_ENV, "a-secret-the-user-shares-between-machines")
    given: set[str | None] = set()

    def sample(run: ElasticRun) -> None:
        for record in run.workers:
            if record.running:
                try:
                    given.add(_environ(record.process.pid).get(SECRET_ENV))
                except OSError:
                    continue

    # exec: the secret is read from /proc/<pid>/environ, which shows what a fresh interpreter was given
    summary = _run(["elastic.workers=4", "elastic.chaos=[term:2@40]", "elastic.worker_start=exec"], tmp_path,
                   cache_dir, on_poll=sample)
    assert given == {"a-secret-the-user-shares-between-machines"}, "the launcher's own secret was not passed on"
    rows = _rows(summary)
    leaver = rows[2]
    assert leaver["status"] == "left" and leaver["exit_code"] == 0, leaver
    assert leaver["checkpoint"] == str(tmp_path / "worker_2" / LEAVE_CHECKPOINT), leaver
    assert Path(leaver["checkpoint"]).exists()
    left_at = leaver["exit_steps"][0]
    assert 40 <= left_at < MAX_STEPS and left_at % H == 0, f"worker 2 did not leave at a round's end: {left_at}"
    stayers = [rows[worker] for worker in (0, 1, 3)]
    assert all(row["status"] == "finished" and row["final_step"] == MAX_STEPS for row in stayers), rows
    checksums = {row["model_checksum"] for row in stayers}
    assert len(checksums) == 1 and None not in checksums, f"the others did not end on one model: {checksums}"
    failures = {row["worker"]: (row["failed_exchanges"], row["failed_collectives"]) for row in rows.values()}
    assert all(counts == (0, 0) for counts in failures.values()), f"failed (exchanges, collectives): {failures}"
    assert json.loads((tmp_path / ELASTIC_SUMMARY_FILE).read_text())["workers"][2]["status"] == "left"
    _assert_gasloc_export_merges(Path(rows[0]["final_checkpoint"]), Path(leaver["checkpoint"]), tmp_path)
    written = [path for path in tmp_path.rglob("*") if path.is_file() and b"a-secret-the-user" in path.read_bytes()]
    assert not written, f"the secret was written to {written} (the leave checkpoint included)"
    _assert_nothing_left(summary["pids"], tmp_path)


def _assert_gasloc_export_merges(final: Path, left: Path, tmp_path: Path) -> None:
    """Real replicas of two models (a finisher's final checkpoint, the leaver's own): ``gasloc-export`` with both
    writes their average, one weight each, as it does for the groups of a run that split."""
    merged = tmp_path / "merged.ckpt"
    assert export_main([str(final), str(left), str(merged)]) == 0
    models = [load_rank_checkpoint(path, 0, 1)["state_dict"] for path in (final, left)]
    average = torch.load(merged, weights_only=True)["state_dict"]
    floating = [name for name, tensor in models[0].items() if torch.is_floating_point(tensor)]
    assert any(not torch.equal(models[0][name], models[1][name]) for name in floating), "one model, not two"
    for name in floating:
        expected = ((models[0][name].double() + models[1][name].double()) / 2).to(models[0][name].dtype)
        assert torch.allclose(average[name], expected, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_while_no_quorum_can_form_still_leaves_with_a_checkpoint(tmp_path, cache_dir):
    """Two workers, min_workers=2: worker 1 is killed inside round 5, so worker 0's next quorum can never form, and
    SIGTERM reaches worker 0 around that wait (as when a whole run is stopped and the others leave first). Its last
    round is committed: it leaves with its checkpoint and exits 0, instead of failing when quorum_timeout ends."""
    summary = _run(["elastic.workers=2", "elastic.quorum_timeout=8", "elastic.leave_grace_s=60",
                    "elastic.chaos=[kill:1@22,term:0@25]"], tmp_path, cache_dir)
    rows = _rows(summary)
    assert rows[1]["status"] == "killed", rows
    leaver = rows[0]
    assert leaver["status"] == "left" and leaver["exit_code"] == 0, leaver
    assert Path(leaver["checkpoint"]).exists(), leaver
    assert leaver["exit_steps"][0] % H == 0, f"worker 0 did not leave at a round's end: {leaver['exit_steps']}"
    _assert_nothing_left(summary["pids"], tmp_path)


# ------------------------------------------------------------------ Ctrl-C / SIGTERM and resume
def _wait_for_steps(run_dir: Path, workers: int, step: int, launcher: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        steps = [_progress(run_dir, worker).get("step") or 0 for worker in range(workers)]
        if min(steps) >= step:
            return
        assert launcher.poll() is None, f"gasloc-elastic exited early ({launcher.returncode})"
        assert time.monotonic() < deadline, f"the workers did not reach step {step} in {timeout:g}s: {steps}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_sigterm_to_the_launcher_leaves_a_checkpoint_per_worker_and_resume_restores_them(tmp_path, cache_dir):
    """SIGTERM to gasloc-elastic past step 30: every worker leaves with its own checkpoint, the launcher exits non-zero
    and says how to resume, and nothing it started survives it. elastic.resume=true on the same output_dir then
    starts every worker at the furthest step they left at (one that left a round earlier is healed), and all finish
    at max_steps on one model."""
    run_dir, log_path = tmp_path / "run", tmp_path / "launcher.log"
    command = [sys.executable, "-m", "gasloc_lightning.app.elastic", *_overrides([], run_dir, cache_dir),
               f"hydra.run.dir={tmp_path / 'hydra'}"]
    with open(log_path, "wb") as log_file:
        launcher = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path)
    try:
        _wait_for_steps(run_dir, 3, 30, launcher, timeout=180)
        started = descendants(launcher.pid)  # the workers, held spares and the lighthouse
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=20 + 30 + 30)  # leave_grace_s, the launcher's margin, the lighthouse's stop
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    output = log_path.read_text()
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "resume with:" in output and f"output_dir={run_dir}" in output and "elastic.resume=true" in output
    summary = json.loads((run_dir / ELASTIC_SUMMARY_FILE).read_text())
    assert summary["interrupted"] is True
    _assert_nothing_left(sorted({*started, *summary["pids"]}), run_dir, in_process=False)
    left_at = {}
    for worker in range(3):
        progress = _progress(run_dir, worker)
        assert progress.get("state") == "left", (worker, progress)
        assert (run_dir / f"worker_{worker}" / LEAVE_CHECKPOINT).exists(), f"worker {worker} left no checkpoint"
        assert progress["checkpoint"] == str(run_dir / f"worker_{worker}" / LEAVE_CHECKPOINT)
        left_at[worker] = progress["step"]
        assert 30 <= left_at[worker] < MAX_STEPS, left_at
    assert _rows(summary)[0]["status"] == "left"

    resumed = _run(["elastic.resume=true"], run_dir, cache_dir)
    rows = _rows(resumed)
    # A worker whose leave fell one round earlier than the others' (its signal came right after its commit; the
    # others had already asked for the next quorum and trained it as a smaller quorum) is healed to the furthest.
    furthest = max(left_at.values())
    assert furthest - min(left_at.values()) <= H, left_at
    for worker in range(3):
        assert rows[worker]["resumed_from"] == str(run_dir / f"worker_{worker}" / LEAVE_CHECKPOINT), rows[worker]
        assert rows[worker]["joined"][0] == furthest, f"worker {worker} did not resume at {furthest}: {rows}"
        assert rows[worker]["status"] == "finished" and rows[worker]["final_step"] == MAX_STEPS, rows[worker]
        assert rows[worker]["applied_steps"] == MAX_STEPS - furthest, rows[worker]
    assert len({rows[worker]["model_checksum"] for worker in range(3)}) == 1, rows
    _assert_nothing_left(resumed["pids"], run_dir)


# ------------------------------------------------------------------ failures
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_min_workers_never_met_fails_clearly(tmp_path, cache_dir):
    """min_workers=3 of 3 and one killed: no quorum can form again. The survivors fail within quorum_timeout with an
    error that names min_workers, the run fails saying so, and nothing is left running."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"min_workers=3") as failure:
        _run(["elastic.min_workers=3", "elastic.quorum_timeout=8", "elastic.chaos=[kill:1@10]"], tmp_path, cache_dir)
    assert time.monotonic() - start < 150, "the failure took too long to surface"
    assert "worker(s) [0, 2] failed" in str(failure.value), failure.value
    summary = json.loads((tmp_path / ELASTIC_SUMMARY_FILE).read_text())
    assert [row["status"] for row in summary["workers"]] == ["failed", "killed", "failed"], summary["workers"]
    for worker in (0, 2):
        assert "min_workers=3" in _progress(tmp_path, worker)["error"]
    _assert_nothing_left(summary["pids"], tmp_path)


# ------------------------------------------------------------------ engines and budgets
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_elastic_diloco_end_to_end(tmp_path, cache_dir):
    """elastic.method=diloco with a kill and a restart: all three end at max_steps on one model. (300 steps: a held
    restart builds its trainer while the others train: up to ~20 s on the loaded 2-core machine.) With the int8
    quantized mean, overlapped: the rounds after a quorum's first (which is the exact float32 all-reduce) post their
    mean after step H - 1 and apply it after step H, so one run covers both paths and a change of quorum."""
    steps = 300
    summary = _run(["elastic.method=diloco", "strategy=diloco", "strategy.message_codec=int8", "strategy.overlap=true",
                    f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                    "elastic.chaos=[kill:2@10,restart:2@20]"], tmp_path, cache_dir)
    rows = _rows(summary)
    assert all(row["status"] == "finished" and row["final_step"] == steps for row in rows.values()), rows
    assert rows[2]["incarnations"] == 2 and rows[2]["joined"][1] > 0, rows[2]
    checksums = {row["model_checksum"] for row in rows.values()}
    assert len(checksums) == 1 and None not in checksums, checksums
    _assert_nothing_left(summary["pids"], tmp_path)


def _stand_in(output_dir: Path, progress: dict, wait_for: Path | None = None) -> subprocess.Popen:
    """A process in a worker's place: it waits for ``wait_for`` (a held spare's release), writes ``progress`` and
    exits 0."""
    script = ("import json, os, pathlib, sys, time\n"
              "release = sys.argv[2]\n"
              "while release and not os.path.exists(release): time.sleep(0.02)\n"
              "pathlib.Path(sys.argv[1], 'progress.json').write_text(sys.argv[3])\n")
    return subprocess.Popen([sys.executable, "-c", script, str(output_dir), str(wait_for or ""), json.dumps(progress)])


def test_a_restart_after_the_leaver_exited_but_before_it_was_reaped_still_counts_that_incarnation(tmp_path):
    """Seen in CI: the restart of a worker that had just left fired in the poll between its exit and its reaping;
    the spare replaced it and the left incarnation vanished from the record (its joined and left steps)."""
    cfg = _compose(["elastic.workers=1", "elastic.min_workers=1", "elastic.lighthouse=127.0.0.1:1"])
    cfg.output_dir = str(tmp_path)
    run = ElasticRun(cfg)
    run.events = [ChaosEvent("restart", 0, 0)]
    record = run._write_worker_config(0)
    run.workers = [record]
    left = _stand_in(record.output_dir, {"state": "left", "step": 10, "first_step": 0, "applied": 10})
    left.wait(timeout=60)
    run._start_incarnation(record, left)  # it has exited, and no poll has seen it yet
    release = record.output_dir / "release.test"
    record.spare, record.spare_release = _stand_in(
        record.output_dir, {"state": "done", "step": 20, "first_step": 12, "applied": 8}, wait_for=release), release
    try:
        run.watch()
    finally:
        run.stop()
    row = run.summary()["workers"][0]
    assert row["incarnations"] == 2
    assert (row["joined"], row["left"], row["applied_steps"]) == ([0, 12], [10, 20], 18)


def test_a_view_that_fails_to_close_still_lets_stop_end_every_worker(tmp_path):
    """``head`` closing the launcher's pipe, or a full disk under the event files, makes closing the live line or the
    TensorBoard series raise: the workers must be stopped anyway (and stop() return, so the summary is written)."""
    cfg = _compose(["elastic.workers=1", "elastic.min_workers=1", "elastic.lighthouse=127.0.0.1:1"])
    cfg.output_dir = str(tmp_path)
    run = ElasticRun(cfg)
    record = run._write_worker_config(0)
    run.workers = [record]
    release = record.output_dir / "release.never"  # the stand-in waits for it: it runs until stopped
    record.process = _stand_in(record.output_dir, {"state": "running", "step": 1}, wait_for=release)

    class Broken:
        def close(self):
            raise BrokenPipeError("the reader went away")

    run.live, run.series = Broken(), Broken()
    try:
        run.stop()
        assert record.process.poll() is not None, "the worker was stopped although the views failed to close"
        assert record.ended_by == "stopped"
    finally:
        if record.process.poll() is None:
            record.process.kill()
            record.process.wait()
