"""Elastic GASLoC under churn: real worker processes, a real lighthouse, the gasloc-elastic launcher.

Tiny GPT, H = 5, 3 workers on CPU. Each test checks that the workers that should finish reach
max_steps and end on the same model (the end-of-fit average over the live quorum), and that no
process the launcher started is left behind.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402

from app_utils import CONF, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import run_elastic  # noqa: E402
from gasloc_lightning.app.elastic_worker import read_progress  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MAX_STEPS = 150
FAST = [
    "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", f"trainer.max_steps={MAX_STEPS}",
    f"trainer.val_check_interval={MAX_STEPS}", "trainer.enable_progress_bar=false", "data.batch_size=4",
    "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=3",
    "elastic.min_workers=2", "elastic.heartbeat_timeout_ms=1500", "elastic.join_timeout_ms=5000",
    "elastic.gossip_timeout=3", "elastic.quorum_timeout=20", "elastic.timeout_s=240",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()  # once, not by 3 racing workers
    return path


def _run(overrides: list[str], output_dir: Path, cache_dir: Path) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app",
                      overrides=[*FAST, *overrides, f"output_dir={output_dir}", f"cache_dir={cache_dir}"])
    return run_elastic(cfg)


def _progress(output_dir: Path, worker: int) -> dict:
    return read_progress(output_dir / f"worker_{worker}") or {}


def _assert_nothing_left(summary: dict, run_dir: Path) -> None:
    """No process, port or hand-over file of the run is left once ``run_elastic`` has returned."""
    for pid in summary["pids"]:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
        assert "zombie" in status, f"process {pid} started by the launcher is still running"
    host, _, port = summary["lighthouse"].rpartition(":")
    with socket.socket() as probe:
        assert probe.connect_ex((host, int(port))) != 0, "the lighthouse's port still accepts connections"
    leftovers = [path for pattern in ("release.*", "*.partial") for path in run_dir.rglob(pattern)]
    assert not leftovers, leftovers


@pytest.mark.timeout(240)
def test_killed_worker_survivors_go_on_and_the_restarted_one_rejoins(tmp_path, cache_dir):
    # The kill at 15 waits until the restart's spare is built (forked from the preloaded server, it holds after
    # building its trainer): released at 30, it only asks for a quorum and takes a peer's state, a few rounds' work,
    # whatever the machine's speed. (Before, its build raced the others' 120 steps left, and lost under load.)
    steps = 150
    base = [o for o in FAST if not o.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    summary = _run([*base, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                    "elastic.chaos=[kill:2@15,restart:2@30]"], tmp_path, cache_dir)
    rows = {row["worker"]: row for row in summary["workers"]}
    assert all(row["exit_code"] == 0 and row["final_step"] == steps for row in rows.values()), rows
    progress = [_progress(tmp_path, worker) for worker in range(3)]
    checksums = {record["model_checksum"] for record in progress}
    assert len(checksums) == 1, f"the workers did not end on the same consensus: {progress}"
    assert len({row["val_loss"] for row in rows.values()}) == 1
    assert rows[2]["incarnations"] == 2 and progress[2]["healed_rounds"], "the restarted worker took no peer state"
    assert rows[2]["applied_steps"] + progress[2]["applied"] < 2 * steps
    # the kill at step 15 fails the exchanges of one round at most; the rejoined incarnation fails none
    assert progress[2]["failed_exchanges"] == 0 and progress[2]["failed_collectives"] == 0, progress[2]
    assert all(record["failed_exchanges"] <= 2 for record in progress), progress
    summary_file = json.loads((tmp_path / "worker_2" / "summary.json").read_text())
    assert summary_file["final"]["step"] == steps
    _assert_nothing_left(summary, tmp_path)


def _validation_losses(output_dir: Path, worker: int) -> dict[int, float]:
    """step -> val/loss of a worker's run (its last incarnation's metrics)."""
    summary = json.loads((output_dir / f"worker_{worker}" / "summary.json").read_text())
    with open(output_dir / f"worker_{worker}" / summary["metrics_csv"], newline="") as handle:
        return {int(row["step"]) + 1: float(row["val/loss"]) for row in csv.DictReader(handle) if row.get("val/loss")}


def _last_metric(output_dir: Path, worker: int, name: str) -> float:
    """The last logged value of ``name`` in a worker's (last incarnation's) metrics."""
    summary = json.loads((output_dir / f"worker_{worker}" / "summary.json").read_text())
    with open(output_dir / f"worker_{worker}" / summary["metrics_csv"], newline="") as handle:
        values = [float(row[name]) for row in csv.DictReader(handle) if row.get(name)]
    assert values, f"worker {worker} logged no {name}"
    return values[-1]


@pytest.mark.timeout(240)
def test_a_worker_rejoining_where_the_others_validate_takes_part_and_nothing_times_out(tmp_path, cache_dir):
    """Validation every round: the restarted worker joins at a validation boundary. It must take part in the
    others' consensus average (else their all-reduce times out and they evaluate their own replicas), and from
    then on every worker validates the same consensus model."""
    steps = 150  # the restart's spare is built before the kill fires (see the test above)
    base = [o for o in FAST if not o.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    summary = _run([*base, f"trainer.max_steps={steps}", "trainer.val_check_interval=5",
                    "elastic.chaos=[kill:2@12,restart:2@20]"], tmp_path, cache_dir)
    rows = {row["worker"]: row for row in summary["workers"]}
    assert all(row["exit_code"] == 0 and row["final_step"] == steps for row in rows.values()), rows
    joined = rows[2]["joined"][1]
    assert joined is not None and 0 < joined < steps, rows[2]
    rejoined = _progress(tmp_path, 2)
    assert rejoined["healed_rounds"], "the restarted worker took no peer state"
    assert rejoined["failed_exchanges"] == 0 and rejoined["failed_collectives"] == 0, rejoined
    # the heal server counts what peers made it do in the metrics (not in log lines): some survivor served the heal
    served = [_last_metric(tmp_path, worker, "heal/served_requests") for worker in (0, 1)]
    assert sum(served) >= 1 and all(_last_metric(tmp_path, w, "heal/refused_requests") == 0 for w in range(3)), served
    losses = [_validation_losses(tmp_path, worker) for worker in range(3)]
    after = [step for step in losses[2] if step > joined]
    assert len(after) >= 2, (joined, losses[2])
    for step in after:  # one consensus, evaluated by all: no worker fell back to its local replica
        assert losses[0][step] == losses[1][step] == losses[2][step], (step, [loss.get(step) for loss in losses])
    assert len({_progress(tmp_path, worker)["model_checksum"] for worker in range(3)}) == 1
    _assert_nothing_left(summary, tmp_path)


@pytest.mark.timeout(240)
def test_stalled_worker_is_dropped_and_the_others_go_on(tmp_path, cache_dir):
    """Stopped (SIGSTOP) past the heartbeat timeout: the others drop it and go on; after SIGCONT its exchange
    fails, it asks for a quorum, is healed from a peer (it is behind) and ends on the same consensus. The stall is a
    window in steps (15 until the others reach 40), not in seconds: the others cannot pass the round boundary at
    step 20 until their exchange with it has failed and a quorum without it has formed, however fast or loaded the
    machine. 300 steps: the others still train while it resumes and rejoins (1.2 s from SIGCONT to its heal under
    a load of 15; 60 steps at an idle machine's pace of 50 steps/s). It used to be stopped for 8 s, which on an idle
    machine needed 1,000 steps."""
    steps = 300
    base = [o for o in FAST if not o.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    summary = _run([*base, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                    "elastic.chaos=[stall:1@15-40]"], tmp_path, cache_dir)
    rows = {row["worker"]: row for row in summary["workers"]}
    assert all(row["exit_code"] == 0 and row["final_step"] == steps for row in rows.values()), rows
    progress = [_progress(tmp_path, worker) for worker in range(3)]
    assert len({record["model_checksum"] for record in progress}) == 1, progress
    assert max(progress[w]["membership_changes"] for w in (0, 2)) >= 1, "the stalled worker was never dropped"
    assert progress[1]["healed_rounds"], "the stalled worker went on from its stale point instead of healing"
    _assert_nothing_left(summary, tmp_path)


@pytest.mark.timeout(300)
def test_one_of_four_killed_for_good_survivors_finish_close_to_the_no_failure_run(tmp_path, cache_dir):
    four = ["elastic.workers=4", "elastic.min_workers=3"]
    clean = _run(four, tmp_path / "clean", cache_dir)
    broken = _run([*four, "elastic.chaos=[kill:3@60]"], tmp_path / "broken", cache_dir)
    rows = {row["worker"]: row for row in broken["workers"]}
    assert rows[3]["status"] == "killed" and rows[3]["incarnations"] == 1, rows[3]
    survivors = [rows[worker] for worker in range(3)]
    final = [_progress(tmp_path / "broken", worker) for worker in range(3)]
    assert all(record["quorum_size"] == 3 and record["membership_changes"] >= 1 for record in final), final
    assert all(row["exit_code"] == 0 and row["final_step"] == MAX_STEPS for row in survivors), rows
    checksums = {_progress(tmp_path / "broken", worker)["model_checksum"] for worker in range(3)}
    assert len(checksums) == 1, "the survivors did not end on the same consensus"
    # Three workers instead of four for the last 90 of 150 steps: less data per round, and the two runs are not
    # bitwise equal before the kill either (a different peer order once a quorum changes). Measured: 3.4% above the
    # clean run (val 3.870 against 3.741, a fresh clone under strace), which a 3% bound refused now and then. A
    # survivor that stopped at the kill fails the final_step check above; this bound is for a model gone wrong.
    clean_loss = clean["workers"][0]["val_loss"]
    assert abs(survivors[0]["val_loss"] / clean_loss - 1) < 0.08, (survivors[0]["val_loss"], clean_loss)
    _assert_nothing_left(clean, tmp_path / "clean")
    _assert_nothing_left(broken, tmp_path / "broken")


@pytest.mark.timeout(240)
def test_a_worker_still_running_after_the_end_is_stopped_not_failed(tmp_path, cache_dir):
    """Stalled near the end: the others finish without it, and it is stopped end_grace_s later, instead of
    waiting out its quorum_timeout and failing the run."""
    start = time.monotonic()
    summary = _run(["elastic.chaos=[stall:1@130:120]", "elastic.end_grace_s=3"], tmp_path, cache_dir)
    elapsed = time.monotonic() - start
    rows = {row["worker"]: row for row in summary["workers"]}
    assert rows[1]["status"] == "stopped" and rows[1]["val_loss"] is None, rows[1]
    assert elapsed < 120, f"the run waited {elapsed:.0f}s: the stalled worker was not stopped end_grace_s after the end"
    for worker in (0, 2):
        assert rows[worker]["exit_code"] == 0 and rows[worker]["final_step"] == MAX_STEPS, rows
    _assert_nothing_left(summary, tmp_path)


@pytest.mark.timeout(300)
def test_seeded_chaos_of_ten_kills_and_restarts_never_hangs_and_every_worker_finishes(tmp_path, cache_dir, capsys):
    """elastic.random_chaos=10: five kills, each restarted; with 4 workers and min_workers=3 a kill can fall
    while the last restarted worker is still joining (the others then wait for it). A worker is restarted
    twice, so its second spare must be released too. Every worker ends at max_steps on one consensus, except a
    restart still starting when the run ended (a late chaos restart on a loaded machine): the launcher stops it as
    a latecomer, and says so."""
    steps = 300
    base = [o for o in FAST if not o.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    overrides = [*base, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", "elastic.workers=4",
                 "elastic.min_workers=3", "elastic.random_chaos=10", "elastic.chaos_seed=0", f"output_dir={tmp_path}",
                 f"cache_dir={cache_dir}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        summary = run_elastic(compose(config_name="elastic/app", overrides=overrides))
    out = capsys.readouterr().out
    print(out)  # kept in the report of a failure
    assert len(summary["chaos"]) == 10 and sum(event.startswith("kill") for event in summary["chaos"]) == 5
    rows = {row["worker"]: row for row in summary["workers"]}
    assert sum(row["incarnations"] for row in rows.values()) == 4 + 5, rows
    assert max(row["incarnations"] for row in rows.values()) >= 3, "seed 0 should restart one worker twice"
    # a late restart is stopped by the launcher as it starts, or finds by itself that the run ended (state "ended")
    latecomers = {int(w) for w in re.findall(r"^worker (\d+) arrived after the run ended: stopped$", out, re.M)}
    latecomers |= {w for w, row in rows.items() if row["incarnations"] > 1 and _progress(tmp_path, w).get("state") == "ended"}
    finished = [worker for worker in rows if worker not in latecomers]
    assert len(finished) >= 3, (latecomers, rows)  # min_workers finished the run
    for worker, row in rows.items():
        # every restart joined at the quorum's step (it took a peer's state), not from step 0
        assert all(step is None or step > 0 for step in row["joined"][1:]), row
        if worker in latecomers:  # stopped by the launcher as it started: not a failure, not a finisher
            assert row["status"] == "stopped" and row["incarnations"] > 1, row
            continue
        assert row["exit_code"] == 0 and row["final_step"] == steps, rows
        assert math.isfinite(row["val_loss"]), row
    progress = [_progress(tmp_path, worker) for worker in finished]
    assert len({record["model_checksum"] for record in progress}) == 1, progress
    for worker in range(4):
        losses = [float(r["train/loss"]) for r in csv.DictReader(open(tmp_path / f"worker_{worker}" / "csv" / "metrics.csv"))
                  if r.get("train/loss")]
        assert losses and all(math.isfinite(loss) for loss in losses), f"worker {worker} logged a non-finite loss"
    _assert_nothing_left(summary, tmp_path)
