"""No process outlives a run: a failing launcher stops its workers, and workers exit when their launcher dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PREAMBLE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    sys.path.insert(0, {tests!r})
    from dist_utils import TinyRegressor
    from gasloc_lightning import GASLoCStrategy

    OUT = Path({out!r})

    class WritesPid(Callback):
        def on_train_start(self, trainer, pl_module):
            (OUT / f"pid{{trainer.global_rank}}").write_text(str(os.getpid()))
    """
)

SCRIPT = PREAMBLE + textwrap.dedent(
    """
    class PidsAndStall(WritesPid):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_rank == {stalled_rank} and trainer.global_step == 5:
                time.sleep(600)

    if __name__ == "__main__":
        strategy = GASLoCStrategy(inner_steps=2, topology="ring", gossip_timeout=5.0, collective_timeout=60.0,
                                  start_method="popen")
        trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=40, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                             limit_val_batches=0, default_root_dir=str(OUT), callbacks=[PidsAndStall()])
        trainer.fit(TinyRegressor())
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_for_pids(out: Path, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(out.glob("pid*"))
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"the workers did not all start within {timeout} s: {sorted(out.glob('pid*'))}")


def assert_all_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:  # never leave them behind, even when the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"worker processes still running: {survivors}"


def launch(tmp_path: Path, port: int, template: str, **fields: object) -> subprocess.Popen:
    """Run ``template`` (a script of this module, filled with ``fields``) as the launching process."""
    script = tmp_path / "run.py"
    script.write_text(template.format(tests=str(Path(__file__).parent), out=str(tmp_path), **fields))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stalled_rank", [2], ids=["child_stalls"])
def test_a_stalled_worker_leaves_no_process_behind(tmp_path, fresh_port, stalled_rank):
    process = launch(tmp_path, fresh_port(), SCRIPT, stalled_rank=stalled_rank)
    try:
        pids = wait_for_pids(tmp_path, 3, timeout=240)  # a failure deadline
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert_all_gone([pid for pid in pids if pid != process.pid], within=15)
    assert process.returncode != 0
    assert "GossipTimeoutError" in output or "gossip round" in output or "Timed out" in output


@pytest.mark.timeout(120)
def test_workers_exit_when_their_launcher_is_killed(tmp_path, fresh_port):
    process = launch(tmp_path, fresh_port(), SCRIPT, stalled_rank=-1)
    try:
        pids = wait_for_pids(tmp_path, 3, timeout=240)  # a failure deadline
        process.kill()  # SIGKILL: no handler of the launcher runs
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    assert_all_gone([pid for pid in pids if pid != process.pid], within=15)


LAUNCHER_FAILS = PREAMBLE + textwrap.dedent(
    """
    class PidsAndFailure(WritesPid):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_rank == 0 and trainer.global_step == 3:
                while len(list(OUT.glob("pid*"))) < 3:
                    time.sleep(0.1)
                raise RuntimeError("the launching worker broke")

    if __name__ == "__main__":
        strategy = GASLoCStrategy(inner_steps=2, gossip_timeout=30.0, start_method="popen")
        trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=400, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                             limit_val_batches=0, default_root_dir=str(OUT), callbacks=[PidsAndFailure()])
        try:
            trainer.fit(TinyRegressor())
        except RuntimeError:
            time.sleep(7)  # longer than Lightning's process observer's period (5 s)
            print("the launching process outlived its stopped workers", flush=True)
            sys.exit(3)
    """
)


@pytest.mark.timeout(120)
def test_a_failing_launcher_reports_its_error_and_stops_every_worker(tmp_path, fresh_port):
    process = launch(tmp_path, fresh_port(), LAUNCHER_FAILS)
    try:
        pids = wait_for_pids(tmp_path, 3, timeout=240)  # a failure deadline: 3 fresh interpreters on a loaded 2-core box
        output, _ = process.communicate(timeout=45)
    finally:
        if process.poll() is None:
            process.kill()
    assert_all_gone([pid for pid in pids if pid != process.pid], within=15)
    # the launcher is not killed by Lightning's observer for a worker it stopped itself
    assert process.returncode == 3, output[-3000:]
    assert "the launching process outlived its stopped workers" in output
    assert "RuntimeError: the launching worker broke" in output  # the launcher's log line (the script catches it)


FORK_AFTER_OPENMP = textwrap.dedent(
    """
    import os, sys
    import torch, lightning.pytorch as pl
    from torch import nn
    from gasloc_lightning import GASLoCStrategy

    class Wide(pl.LightningModule):  # 65k parameters: the round's copies run as OpenMP parallel regions
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(256, 256)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 256)), batch_size=8)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    if __name__ == "__main__":
        torch.set_num_threads(2)
        torch.ones(1 << 22).add_(1).sum()  # the launching process runs a two-thread OpenMP region first
        strategy = GASLoCStrategy(inner_steps=2, start_method="fork", gossip_timeout=30.0)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, default_root_dir=sys.argv[1])
        trainer.fit(Wide())
        print("threads in the workers: 1, fit done")
    """
)


@pytest.mark.timeout(150)
def test_forked_workers_run_one_thread_even_when_omp_num_threads_is_set(tmp_path, fresh_port):
    """A forked worker with the parent's 2 threads waits forever for OpenMP's pool, which fork does not copy."""
    script = tmp_path / "fork_after_openmp.py"
    script.write_text(FORK_AFTER_OPENMP)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # Lightning then leaves the inherited thread count alone
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the launcher and its forked workers
            process.wait()
    assert process.returncode == 0 and "fit done" in output, f"the forked workers hung or failed:\n{output[-3000:]}"


def test_fork_with_several_threads_is_refused():
    from gasloc_lightning import GASLoCStrategy

    with pytest.raises(ValueError, match="OpenMP's thread pool does not survive a fork"):
        GASLoCStrategy(start_method="fork", cpu_threads=2)
