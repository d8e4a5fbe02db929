"""The launchers' live status line (:mod:`gasloc_lightning.app.live_status`) on stand-in worker records: what it
computes from the workers' ``progress.json``, the line it prints, and when it prints on a file (a stand-in clock:
nothing waits)."""

from __future__ import annotations

import io
import json

import pytest

from gasloc_lightning.app.live_status import STATUS_PREFIX, LiveStatus, format_status, status_of
from gasloc_lightning.utils.progress import ScriptProgress, format_duration


def _record(step: int, *, state: str = "running", pid: int = 1, quorum: int | None = 3, sent: float = 0.0,
            received: float = 0.0, **extra) -> dict:
    return {"state": state, "pid": pid, "step": step, "quorum_size": quorum, "bytes_sent": sent,
            "bytes_received": received, **extra}


def test_the_status_reads_steps_quorum_loss_failures_and_rates_from_the_workers_records():
    first = status_of({0: _record(10, sent=1000), 1: _record(8, sent=500), 2: {}}, max_steps=100, now=0.0)
    assert (first.furthest_step, first.slowest_step, first.live_workers, first.quorum_size) == (10, 8, 2, 3)
    assert first.eta_s is None and first.bytes_out_per_s is None, "no rate from a single look"
    later = status_of({0: _record(30, sent=3000, received=2000, val_loss=3.5, consensus_distance=0.01,
                                  failed_exchanges=1),
                       1: _record(28, sent=2500, val_loss=3.9, failed_exchanges=2),
                       2: _record(0, state="failed")},
                      max_steps=100, now=10.0, previous=first)
    assert later.furthest_step == 30 and later.slowest_step == 28 and later.live_workers == 2
    assert later.val_loss == 3.5 and later.consensus_distance == 0.01, "the furthest worker's figures"
    assert later.failed_exchanges == 3
    assert later.bytes_out_per_s == pytest.approx((2000 + 2000) / 10.0)
    assert later.eta_s == pytest.approx((100 - 28) / 2.0), "20 steps in 10 s: 2 steps/s; the slowest has 72 left"


def test_a_restarted_worker_counts_its_bytes_from_its_second_look():
    first = status_of({0: _record(10, pid=1, sent=5000)}, max_steps=50, now=0.0)
    restarted = status_of({0: _record(12, pid=2, sent=100)}, max_steps=50, now=1.0, previous=first)
    assert restarted.bytes_out_per_s == 0.0, "a new incarnation's counter restarts at zero: no negative rate"


def test_the_line_carries_step_eta_quorum_and_loss():
    first = status_of({0: _record(10)}, max_steps=100, now=0.0)
    status = status_of({0: _record(20, val_loss=3.25, sent=2e6)}, max_steps=100, now=5.0, previous=first)
    line = format_status(status)
    assert line.startswith(STATUS_PREFIX)
    for part in ("step 20/100", "ETA 0:00:40", "quorum 3 (1 live)", "val loss 3.25", "failed exchanges 0"):
        assert part in line, line


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_on_a_file_one_line_is_printed_every_every_s_and_quiet_prints_nothing():
    clock, out = _Clock(), io.StringIO()
    live = LiveStatus(max_steps=100, every_s=10.0, stream=out, clock=clock)
    for second in range(0, 31):
        clock.now = float(second)
        live.update({0: _record(second, sent=1000.0 * (second // 5))})  # 1 kB per round of 5 s, in bursts
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"{STATUS_PREFIX}step {s}/100" for s in (0, 10, 20, 30)]
    assert all("out 200 B/s |" in line for line in lines[1:]), "the rate over the last 10 s, not poll to poll"
    assert [line.rsplit("| elapsed ", 1)[1] for line in lines] == ["0:00:00", "0:00:10", "0:00:20", "0:00:30"]
    assert "ETA 0:01:10" in lines[3], "1 step/s since the first step: 70 of 100 left at step 30"
    clock.now = 31.0
    live.update({0: _record(100, state="done", val_loss=2.5), 1: _record(40, state="exited", quorum=4)})
    live.close()
    live.close()
    final = out.getvalue().splitlines()[len(lines):]
    assert len(final) == 1 and "step 100/100" in final[0] and "ETA 0:00:00" in final[0] and "val loss 2.5" in final[0]
    assert "quorum 3 (0 live)" in final[0], "the end's line keeps the last quorum"
    quiet_out, seen = io.StringIO(), []
    quiet = LiveStatus(max_steps=100, stream=quiet_out, show=False, clock=clock, on_status=seen.append)
    quiet.update({0: _record(5)})
    assert quiet_out.getvalue() == "" and [status.furthest_step for status in seen] == [5]


@pytest.mark.parametrize("kwargs, message", [({"every_s": 0}, "every_s"), ({"max_steps": 0}, "max_steps")])
def test_bad_settings_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LiveStatus(**{"max_steps": 10, **kwargs})


def test_the_launcher_series_and_the_workers_loggers_share_one_tensorboard(tmp_path):
    """logger=tensorboard: workers log to <run>/tensorboard/worker_<W>; the launcher's quorum and events to
    <run>/tensorboard/launcher, readable by TensorBoard's EventAccumulator."""
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gasloc_lightning.app.run_tensorboard import LauncherSeries, place_worker_tensorboard

    worker_cfg = OmegaConf.create({"logger": {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger"},
                                              "tensorboard": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger",
                                                              "save_dir": "elsewhere", "name": "tb", "version": ""}}})
    place_worker_tensorboard(worker_cfg, run_dir=tmp_path, worker=3)
    node = worker_cfg.logger.tensorboard
    assert (node.save_dir, node.name, node.version) == (str(tmp_path), "tensorboard", "worker_3")
    assert "save_dir" not in worker_cfg.logger.csv

    series = LauncherSeries.for_run(OmegaConf.create({"output_dir": str(tmp_path), "logger": worker_cfg.logger}))
    first = status_of({0: _record(10, quorum=4)}, max_steps=100, now=0.0)
    series.status(first)
    series.status(status_of({0: _record(20, quorum=3)}, max_steps=100, now=1.0, previous=first))
    series.event("chaos kill:2@15 at step 15", 15)
    series.close()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard" / "launcher"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("launcher/quorum_size")] == [(10, 4.0), (20, 3.0)]
    assert [e.step for e in accumulator.Scalars("launcher/events")] == [15]
    assert LauncherSeries.for_run(OmegaConf.create({"output_dir": str(tmp_path), "logger": {}})).log_dir is None


def test_a_long_script_says_which_run_of_how_many_its_eta_and_what_is_recorded():
    clock = _Clock()
    progress = ScriptProgress(total=4, recorded=1, clock=clock)  # one run kept from an earlier session
    assert progress.start("a") == "run 2 of 4 (1 done): a | ETA -"
    clock.now = 60.0
    progress.done()
    assert progress.start("b") == "run 3 of 4 (2 done): b | ETA 0:02:00", "2 runs left at 60 s each"
    with pytest.raises(ValueError, match="recorded"):
        ScriptProgress(total=2, recorded=3)


def test_a_plan_that_counted_too_few_runs_grows_its_total_and_never_shows_a_negative_eta():
    clock = _Clock()
    progress = ScriptProgress(total=2, recorded=2, clock=clock)
    assert progress.start("extra") == "run 3 of 3 (2 done): extra | ETA -"
    clock.now = 30.0
    progress.done()
    line = progress.start("another")
    assert line == "run 4 of 4 (3 done): another | ETA 0:00:30", line
    assert format_duration(-5.0) == "0:00:00"


def test_on_a_terminal_the_line_is_redrawn_in_place_and_stays_after_close():
    pytest.importorskip("rich")
    import os

    master, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        live = LiveStatus(max_steps=10, stream=terminal, every_s=1000.0, clock=_Clock())
        for step in (1, 2):
            live.update({0: _record(step)})
        live.close()
        terminal.flush()
    chunks = []  # one read may return part of what was written: read until the closed follower's end (EIO)
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    drawn = b"".join(chunks).decode()
    assert "status: step 1/10" in drawn and "status: step 2/10" in drawn, "every look is drawn (every_s is for files)"
    assert "\x1b[1A" in drawn or "\r" in drawn, "the line is redrawn in place, not appended"


def test_the_readme_figure_is_rendered_from_a_runs_event_files(tmp_path):
    """benchmarks/tensorboard_view.py (the README's TensorBoard figure): one panel per series found, every run."""
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    from gasloc_lightning.app.run_tensorboard import LauncherSeries

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tensorboard_view.py"
    spec = importlib.util.spec_from_file_location("tensorboard_view", script)
    view = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(view)
    board = tmp_path / "tensorboard"
    series = LauncherSeries(board / "launcher")
    series.status(status_of({0: _record(10, quorum=4)}, max_steps=100, now=0.0))
    series.status(status_of({0: _record(20, quorum=3)}, max_steps=100, now=1.0))
    series.close()
    found = view.read_scalars(board, ("launcher/quorum_size", "train/loss"))
    assert found == {"launcher/quorum_size": {"launcher": [(10, 4.0), (20, 3.0)]}}, "only the series logged"
    view.main([str(board), "--out", str(tmp_path / "view.png"), "--tags", "launcher/quorum_size"])
    assert (tmp_path / "view.png").stat().st_size > 0


@pytest.mark.parametrize("record", [
    [1, 2], "running", 3, None,
    {"state": "running", "step": "abc", "pid": [1], "quorum_size": {"a": 1}, "val_loss": "x",
     "consensus_distance": [0.1], "failed_exchanges": "many", "bytes_sent": "lots", "bytes_received": None},
    {"state": ["running"], "step": True, "pid": {"x": 1}},
])
def test_a_record_of_the_wrong_shape_reads_as_unknown_and_never_stops_the_launcher(tmp_path, record):
    from gasloc_lightning.app.elastic_worker import PROGRESS_FILE, read_progress

    (tmp_path / PROGRESS_FILE).write_text(json.dumps(record))
    read = read_progress(tmp_path)
    assert read is None or isinstance(read, dict), "only a JSON object is a record"
    good = _record(7, val_loss=2.5)
    first = status_of({0: record, 1: good}, max_steps=10, now=0.0)
    later = status_of({0: record, 1: {**good, "step": 9}}, max_steps=10, now=1.0, previous=first)
    assert later.furthest_step == 9 and later.val_loss == 2.5, "the good worker's figures are still read"
    format_status(later, elapsed_s=1.0)
