"""Every private Lightning attribute this package relies on, in one place to check on each upgrade.

Tested against Lightning 2.6 (pyproject pins ``lightning>=2.6,<2.7``). For each one: what it is, why
we use it, and what breaks if it changes.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl

# DDPStrategy's own private members that LocalStepsStrategy uses (it subclasses DDPStrategy):
# - `_configure_launcher` and `_launcher`, `_start_method`: to put StoppingSubprocessLauncher in place;
# - `_ddp_kwargs`: the DDP arguments inside a worker (its process group);
# - `_layer_sync`: to refuse sync_batchnorm.
# Lightning's popen launcher (`_SubprocessScriptLauncher`), subclassed by StoppingSubprocessLauncher:
# - `_call_children_scripts`: overridden to put the launcher's pid in the workers' environment;
# - `procs`: rebound to a new list in `_call_children_scripts`, then handed as is (not copied) to
#   `_launch_process_observer`, whose thread ends when the list is empty (`all([])`). The launcher empties it
#   before stopping the workers, so the observer does not SIGKILL the launching process for a worker it
#   stopped itself (cutting short its traceback and whatever the script does after catching the error).
#   If Lightning copies the list, test_a_failing_launcher_reports_its_error_and_stops_every_worker (slow,
#   distributed: run it on each upgrade) fails.
# Sharded workers (intra_worker="fsdp"), after Lightning's ModelParallelStrategy:
# - `LightningModule._device_mesh`: set in setup_environment so `self.device_mesh` reaches configure_model
#   (a rename leaves the module unsharded, which the strategy refuses with a TypeError);
# - `_MultiProcessingLauncher` and its `_collect_rank_zero_results`: ShardedResultsLauncher hands back the
#   whole model (test_validate_after_a_sharded_fit_evaluates_the_consensus_it_returned catches a change).

# Sets torch's threads to cores / local processes unless OMP_NUM_THREADS is set (what Lightning's
# launchers call in every worker). Used for cpu_threads="auto" in processes no launcher started.
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed  # noqa: F401

# Lightning's RNG capture (torch, CUDA, numpy, Python) for per-rank checkpoints.
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states  # noqa: F401

# `_TrainingEpochLoop._broadcast_sigterm_tensor`: called before every training step, it broadcasts a
# SIGTERM flag from rank 0 (a global collective). If renamed, `move_sigterm_check` does nothing and
# every step synchronises all workers again (correct, but the rounds lose their point): the test
# `test_no_collective_between_rounds_and_bytes_match_the_analytic_volume` catches it.
__all__ = ["_collect_rng_states", "_set_num_threads_if_needed", "_set_rng_states", "move_sigterm_check"]

_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
_PATCHED = "_gasloc_round_boundaries"


def move_sigterm_check(trainer: pl.Trainer, at_round_start: Callable[[], bool]) -> None:
    """Run Lightning's per-step SIGTERM broadcast only when ``at_round_start()`` (all ranks still stop
    together on SIGTERM, one round later at most, without a global collective at every step)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    original = getattr(epoch_loop, _SIGTERM_BROADCAST, None)
    if original is None or getattr(original, _PATCHED, False):
        return

    def sigterm_check_at_round_start() -> None:
        if at_round_start():
            original()

    setattr(sigterm_check_at_round_start, _PATCHED, True)
    setattr(epoch_loop, _SIGTERM_BROADCAST, sigterm_check_at_round_start)
