"""Streaming DiLoCo with a quantized mean overlaps: two gloo ranks under Lightning's Trainer, one of them late.

Rank 1 enters fragment 0's all-reduce only once rank 0 has computed the step after that fragment left (a link
as slow as it gets, observed by event order, not by timing). A mean that blocks where it leaves would keep
rank 0 from that step: the run could not finish (it did not before the quantized mean was posted
asynchronously: rank 1 gave up waiting). With the mean in flight under rank 0's step, both ranks finish.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gasloc_lightning import DiLoCoStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240), pytest.mark.usefixtures("threads_safe_to_fork")]

INNER_STEPS, FRAGMENTS, STEPS = 4, 2, 8  # overlap: fragment 0 leaves after step 1 and lands after step 2
GATE = timedelta(seconds=60)  # a failure deadline only


class _Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.global_rank)
        inputs = torch.randn(4 * STEPS, 8, generator=generator)
        return DataLoader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)), batch_size=4)


class _LatePeer(Callback):
    """Rank 0 marks that it has computed step 2 (after fragment 0 left, before it lands); rank 1 waits for that
    mark before its first optimizer step, so its part of fragment 0's mean comes after rank 0's step 2."""

    def __init__(self, folder: Path) -> None:
        self.mark = folder / "rank0_computed_step2"

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 1:
            self.mark.write_text("computed")
        if trainer.global_rank == 1 and trainer.global_step == 0:
            deadline = time.monotonic() + GATE.total_seconds()
            while not self.mark.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 never computed step 2: fragment 0's mean blocked it where it left")
                time.sleep(0.01)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.mark.parent / f"rank{trainer.global_rank}.done").write_text(str(trainer.strategy.round_index))


def test_a_rank_computes_the_next_step_while_its_quantized_fragment_mean_waits_for_a_late_peer(
        tmp_path, monkeypatch, fresh_port):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # fresh_port: a rendezvous on 127.0.0.1
    strategy = DiLoCoStrategy(inner_steps=INNER_STEPS, fragments=FRAGMENTS, overlap=True, message_codec="int4",
                              consensus_every=0, start_method="fork", gossip_timeout=120.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path,
                         callbacks=[_LatePeer(tmp_path)])
    try:
        trainer.fit(_Regressor())
    finally:
        for process in getattr(strategy.launcher, "procs", []):  # a rank left by a failed fit, by pid
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    assert (tmp_path / "rank0_computed_step2").exists()
    assert [(tmp_path / f"rank{rank}.done").read_text() for rank in (0, 1)] == [str(STEPS // INNER_STEPS)] * 2
