"""Issue 33's acceptance, on the issue's own command, run once for every assertion here:
``gasloc-elastic experiment=demo elastic.workers=4 'elastic.chaos=[kill:2@40]' logger=tensorboard`` with its output
in a file (not a terminal).

- the file has at least one status line per 10 s of training, each carrying the step, the ETA, the quorum size and
  (once a validation ran) the loss; the cadence is read from the launcher's own ``elapsed`` field, never timed here;
- ``<output_dir>/tensorboard`` holds one run per worker (4) and the launcher's, and ``EventAccumulator`` finds
  each worker's loss series and the launcher's quorum series (4, then 3 after the kill);
- ``gasloc-compare <run folder>`` writes the per-worker table and plots.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from app_utils import clean_env, shared_cache_dir  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
COMMAND = ["experiment=demo", "elastic.workers=4", "elastic.chaos=[kill:2@40]", "logger=tensorboard"]
MAX_STEPS = 100  # experiment=demo's
STATUS = re.compile(r"^status: step (\d+)/(\d+) .*\| ETA (\S+) \| quorum (\S+) .*\| val loss (\S+) .*"
                    r"\| elapsed (\d+):(\d\d):(\d\d)$")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str]:
    """The issue's run (once for the module): its folder and its output file's text."""
    cache_dir = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=cache_dir).prepare_data()
    run_dir = tmp_path_factory.mktemp("demo_run")
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as output:  # a file: the launcher prints a line every elastic.status_every_s
        code = subprocess.run([sys.executable, "-m", "gasloc_lightning.app.elastic", *COMMAND,
                               f"output_dir={run_dir}", f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"],
                              stdout=output, stderr=subprocess.STDOUT, env=clean_env(), timeout=480).returncode
    text = log.read_text()
    assert code == 0, text[-4000:]
    return run_dir, text


def _status_lines(text: str) -> list[tuple[int, str, str, str, int]]:
    """(step, ETA, quorum, val loss, elapsed seconds) of every status line."""
    lines = [line for line in text.splitlines() if line.startswith("status: ")]
    parsed = [STATUS.match(line) for line in lines]
    assert all(parsed), [line for line, match in zip(lines, parsed) if not match]
    return [(int(m[1]), m[3], m[4], m[5], 3600 * int(m[6]) + 60 * int(m[7]) + int(m[8])) for m in parsed]


def _chaos_step(text: str) -> int:
    """The step the launcher fired the kill at (on a fast machine the workers are past 40 by its next look)."""
    fired = re.search(r"^chaos kill:2@40 at step (\d+)$", text, re.MULTILINE)
    assert fired, text[-4000:]
    assert int(fired[1]) >= 40, fired[0]
    return int(fired[1])


@pytest.mark.timeout(600)
def test_the_output_file_has_a_status_line_every_10_s_of_training_with_step_eta_quorum_and_loss(demo_run):
    _, text = demo_run
    lines = _status_lines(text)
    assert lines and lines[-1][0] == MAX_STEPS and lines[-1][1] == "0:00:00", lines[-1:]
    # Training spans from the last look before the first step (if the launcher saw one) to the end: however fast
    # the machine, no gap there is longer than 10 s, so the count follows from the elapsed time the lines carry
    start = max((index for index, line in enumerate(lines) if line[0] == 0), default=0)
    training = lines[start:]
    gaps = [later[4] - earlier[4] for earlier, later in zip(training, training[1:])]
    assert not gaps or max(gaps) <= 10, f"a gap of more than 10 s between status lines: {gaps}"
    assert len(training) >= 1 + (training[-1][4] - training[0][4]) // 10, training
    for step, eta, quorum, loss, _ in training[1:] if training[0][0] == 0 else training:
        assert quorum.isdigit(), f"no quorum size at step {step}: {quorum!r}"
        if step >= 20:  # the first validation is at step 10: its loss is known from the next look on
            assert eta != "-" and float(loss) > 0, (step, eta, loss)
    before_kill = _status_lines(text[:text.index(f"chaos kill:2@40 at step {_chaos_step(text)}")])
    assert "4" in [line[2] for line in before_kill], f"no quorum of 4 before the kill: {before_kill}"
    assert lines[-1][2] == "3", f"the kill of worker 2 does not show in the last quorum: {lines[-1]}"


@pytest.mark.timeout(600)
def test_tensorboard_lists_every_worker_and_the_launcher_with_their_series(demo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, text = demo_run
    board = run_dir / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["launcher", "worker_0", "worker_1", "worker_2", "worker_3"]

    def scalars(name: str) -> EventAccumulator:
        accumulator = EventAccumulator(str(board / name))
        accumulator.Reload()
        return accumulator

    for worker in range(4):
        steps = [event.step for event in scalars(f"worker_{worker}").Scalars("train/loss")]
        assert steps and max(steps) >= (30 if worker == 2 else MAX_STEPS - 10), (worker, steps)
    launcher = scalars("launcher")
    quorum = [event.value for event in launcher.Scalars("launcher/quorum_size")]
    assert 4.0 in quorum and quorum[-1] == 3.0, quorum
    fired = _chaos_step(text)
    assert [event.step for event in launcher.Scalars("launcher/events")] == [fired], f"the chaos kill at {fired}"


@pytest.mark.timeout(600)
def test_gasloc_compare_on_the_run_folder_writes_the_per_worker_table_and_plots(demo_run, tmp_path):
    pytest.importorskip("matplotlib")
    from gasloc_lightning.app.compare import main

    run_dir, _ = demo_run
    assert main([str(run_dir), "--out", str(tmp_path)]) == 0
    table = (tmp_path / "workers.md").read_text()
    assert "| 2 | killed |" in table and "chaos: kill:2@40" in table
    for name in ("loss_vs_step.png", "quorum_vs_time.png", "failed_exchanges.png"):
        assert (tmp_path / name).stat().st_size > 0, name
