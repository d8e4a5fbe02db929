"""``GASLoCCallback``: what a user sees of the rounds — metrics, consensus evaluation, end-of-fit consensus.

The strategy adds one automatically (before any checkpoint callback); pass your own to change
its options. Every hook that communicates is reached by every rank at the same point of the
loop, so the collectives stay in the same order on all ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import MeanMetric
from typing_extensions import override

from gasloc_lightning.network import NetworkModel, SimulatedClock, Throttle
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy, use_round_callback

log = logging.getLogger(__name__)


class GASLoCCallback(Callback):
    """Logs round metrics, evaluates the consensus model and averages the replicas at the end of fit.

    Metrics (through the Lightning logger): ``comm/round``, ``comm/bytes_sent``,
    ``comm/bytes_received`` (this worker, counted at the transport), ``comm/skipped_rounds`` (its own
    non-finite rounds discarded), ``comm/rejected_exchanges`` (non-finite messages from peers) and, every
    ``consensus_every`` rounds, ``comm/consensus_distance`` (mean squared distance of the
    replicas to their average, measured by all ranks together), and ``sim_time`` (the simulated
    clock, with a network model).

    Args:
        evaluate: ``"consensus"`` evaluates the average of the replicas (validation and test);
            ``"local"`` evaluates each rank's own replica.
        local_loss_name: with ``evaluate="consensus"`` and a LightningModule that defines
            ``compute_loss(batch) -> Tensor``, the mean over workers of each replica's own
            validation loss is logged under this name (``None`` disables it).
        average_at_end: at the end of fit, run a final round if steps are pending, then replace
            every replica by the consensus model (so rank 0's weights, which the spawn launcher
            returns, are the consensus).
    """

    def __init__(
        self,
        evaluate: Literal["consensus", "local"] = "consensus",
        local_loss_name: str | None = "val/loss_local",
        average_at_end: bool = True,
    ) -> None:
        if evaluate not in ("consensus", "local"):
            raise ValueError(f"evaluate must be 'consensus' or 'local', got {evaluate!r}")
        self.evaluate = evaluate
        self.local_loss_name = local_loss_name
        self.average_at_end = average_at_end
        # A metric, not a sum: it syncs over every rank at the epoch end also where a rank had no batches.
        self._local_loss = MeanMetric()

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> LocalStepsStrategy | None:
        strategy = trainer.strategy
        return strategy if isinstance(strategy, LocalStepsStrategy) else None

    # ------------------------------------------------------------------ training metrics
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy = self._strategy(trainer)
        if strategy is None:
            return
        # Logged every step (Python floats, no sync): Lightning keeps one row every log_every_n_steps.
        metrics = {
            "comm/round": float(strategy.round_index),
            "comm/bytes_sent": float(strategy.bytes_sent),
            "comm/bytes_received": float(strategy.bytes_received),
            "comm/skipped_rounds": float(strategy.skipped_rounds),
            "comm/rejected_exchanges": float(strategy.rejected_exchanges),
        }
        metrics.update(getattr(strategy, "level_bytes", dict)())  # two-level: comm/bytes_region, comm/bytes_cross
        if strategy.consensus_distance is not None:
            metrics["comm/consensus_distance"] = strategy.consensus_distance
        if strategy.sim_time is not None:
            metrics["sim_time"] = strategy.sim_time
        # Values are already per worker or globally reduced: no sync, nothing on the hot path.
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if strategy is not None:
            strategy.check_loader_lengths(trainer.num_training_batches, sum(trainer.num_val_batches))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if strategy is None:
            return
        if strategy.finish_pending_round():
            log.info("final round run at step %d (max_steps not a multiple of inner_steps)", trainer.global_step)
        if self.average_at_end:
            strategy.average_replicas()

    # ------------------------------------------------------------------ evaluation
    def _swap_in(self, trainer: pl.Trainer) -> None:
        strategy = self._strategy(trainer)
        if strategy is not None and self.evaluate == "consensus":
            strategy.swap_in_consensus()
        self._local_loss.reset()

    def _restore(self, trainer: pl.Trainer) -> None:
        strategy = self._strategy(trainer)
        if strategy is not None:
            strategy.restore_local()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(trainer)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        strategy = self._strategy(trainer)
        if not self._tracks_local_loss(strategy, pl_module):
            return
        strategy.show_local()
        with torch.no_grad():
            loss = pl_module.compute_loss(batch).detach().float()
        strategy.show_consensus()
        self._local_loss.to(loss.device).update(loss)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank reaches this, with or without validation batches of its own: the sync is collective.
        if trainer.sanity_checking or not self._tracks_local_loss(self._strategy(trainer), pl_module):
            return
        pl_module.log(self.local_loss_name, self._local_loss.compute(), on_epoch=True)

    def _tracks_local_loss(self, strategy: LocalStepsStrategy | None, pl_module: pl.LightningModule) -> bool:
        return (
            strategy is not None
            and self.evaluate == "consensus"
            and self.local_loss_name is not None
            and strategy.consensus_swapped_in
            and callable(getattr(pl_module, "compute_loss", None))
        )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"evaluate": self.evaluate, "average_at_end": self.average_at_end}


class SimulatedClockCallback(Callback):
    """``sim_time`` for strategies without rounds (Lightning's ``ddp``): one DDP step per optimizer step.

    DDP synchronises every step, so every rank's clock is the same and needs no communication:
    each optimizer step costs the slowest worker's modelled step time plus a gradient all-reduce
    of the modelled model size (see :meth:`SimulatedClock.ddp_step`).

    Args:
        network: the modelled network, over the ranks of the run; ``None`` disables the callback (so
            configs can always include it and pass the run's optional network).
    """

    def __init__(self, network: NetworkModel | None) -> None:
        if network is not None and not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel or None, got {type(network).__name__}")
        self.network = network
        self.clock: SimulatedClock | None = None
        self.throttle: Throttle | None = None  # sleeps for the network's ``throttle``, if any
        self._last_step = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.network is None or isinstance(trainer.strategy, LocalStepsStrategy):
            return  # no network, or a strategy that keeps its own clock
        self.network.check_world_size(trainer.world_size)
        self.clock = SimulatedClock(self.network, rank=trainer.global_rank)
        self.throttle = Throttle(self.clock, self.network.throttle)
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.clock is None:
            return
        for _ in range(trainer.global_step - self._last_step):
            self.clock.ddp_step()
        self._last_step = trainer.global_step
        self.throttle()
        pl_module.log("sim_time", self.clock.time, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"clock": self.clock.state_dict() if self.clock else None, "last_step": self._last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.clock is not None and state_dict.get("clock") is not None:
            self.clock.load_state_dict(state_dict["clock"])
            self.throttle = Throttle(self.clock, self.network.throttle)  # sleep only for what follows
            self._last_step = state_dict["last_step"]


use_round_callback(GASLoCCallback)
