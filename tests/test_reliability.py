"""Decentralized state that survives: deadlines, dead peers, bad points (checkpoints: test_checkpoints.py)."""

from __future__ import annotations

import multiprocessing
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dist_utils import (
    CorruptMessages,
    PoisonOneBatch,
    RankDependentWidth,
    RecordParameters,
    SleepOnRank,
    TinyRegressor,
    load_ranks,
)
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.plugins.per_rank import load_rank_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("threads_safe_to_fork")]


def assert_no_children():
    """The failed launch stopped every rank it forked. Every child here is this test's: conftest kills and reports
    any child an earlier test leaves (a launch that hung until its timeout)."""
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = multiprocessing.active_children()
    assert left == [], f"ranks still running after the failed fit: {[(child.name, child.pid) for child in left]}"


def fault_trainer(tmp_path, callbacks, gossip_timeout=2.0, max_steps=12, **kwargs):
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=gossip_timeout,
                              collective_timeout=3.0)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      default_root_dir=tmp_path, callbacks=list(callbacks), **kwargs)


@pytest.mark.timeout(60)
def test_a_peer_that_stalls_past_the_deadline_fails_the_round_with_names(tmp_path, fresh_port):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = fault_trainer(tmp_path, [SleepOnRank(rank=1, at_step=5, seconds=30), checkpoints],
                            limit_val_batches=0)
    start = time.monotonic()
    with pytest.raises(Exception) as error:
        trainer.fit(TinyRegressor())
    assert time.monotonic() - start < 2.0 + 10 + 15  # deadline + 10 s, plus start-up on a loaded machine
    assert "gossip round 1: rank 0" in str(error.value) and "peer(s) [1]" in str(error.value)
    assert_no_children()
    last = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"  # the last completed checkpoint is intact
    assert load_rank_checkpoint(last, 0, 2)["global_step"] == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "death, trainer_kwargs",
    [
        ({"at_step": 4}, {"limit_val_batches": 0}),
        ({"during_validation": True}, {"limit_val_batches": 2, "val_check_interval": 3, "num_sanity_val_steps": 0}),
    ],
    ids=["mid_training", "during_validation"],
)
def test_a_peer_that_exits_ends_the_job(tmp_path, fresh_port, death, trainer_kwargs):
    trainer = fault_trainer(tmp_path, [SleepOnRank(rank=1, exit_code=3, **death)], **trainer_kwargs)
    start = time.monotonic()
    with pytest.raises(Exception):
        trainer.fit(TinyRegressor())
    assert time.monotonic() - start < 3.0 + 10 + 15  # collective_timeout + 10 s, plus start-up under load
    assert_no_children()


@pytest.mark.timeout(120)
def test_non_finite_messages_are_rejected_and_counted(tmp_path, fresh_port):
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[CorruptMessages(rank=1), RecordParameters(str(tmp_path))])
    trainer.fit(TinyRegressor())
    records = load_ranks(tmp_path, 2)
    assert all(torch.isfinite(r["history"]).all() for r in records)
    assert trainer.callback_metrics["comm/rejected_exchanges"] == 3  # rank 0 rejected all 3 rounds


@pytest.mark.timeout(120)
def test_a_worker_gone_non_finite_skips_the_round_and_recovers(tmp_path, fresh_port):
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path, callbacks=[RecordParameters(str(tmp_path))])
    trainer.fit(PoisonOneBatch(poison_steps=(4,)))
    records = load_ranks(tmp_path, 2)
    assert not torch.isfinite(records[1]["history"][5]).all()  # poisoned after step 5 (0-based step 4)
    assert all(torch.isfinite(r["after_fit"]).all() for r in records)
    assert all(r["rounds_at_fit_end"] == 3 for r in records)


@pytest.mark.timeout(120)
def test_on_nonfinite_raise_stops_at_once(tmp_path, fresh_port):
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=5.0, on_nonfinite="raise")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    with pytest.raises(Exception, match="rank 1, round 1: the local parameters are not finite"):
        trainer.fit(PoisonOneBatch(poison_steps=(4,)))


@pytest.mark.timeout(120)
def test_mismatched_models_across_ranks_stop_before_any_exchange(tmp_path, fresh_port):
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    with pytest.raises(Exception, match="rank 1 holds a different model than rank 0"):
        trainer.fit(RankDependentWidth())


class MaskedPoisonedRegressor(PoisonOneBatch):
    """Holds an additive causal mask of -inf (as hand-written GPTs do) next to its BatchNorm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def on_fit_end(self):
        torch.save({"mask": self.mask.clone(), "running_var": self.net[1].running_var.clone()},
                   f"{self.trainer.default_root_dir}/buffers{self.global_rank}.pt")


@pytest.mark.timeout(120)
def test_a_causal_mask_and_batchnorm_statistics_survive_a_discarded_round(tmp_path, fresh_port):
    # Before: the guard saw the mask's -inf, discarded every round, and "repaired" mask and running_var to 0.
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(MaskedPoisonedRegressor(poison_steps=(4,)))
    expected_mask = torch.full((4, 4), float("-inf")).triu(1)
    for rank in range(2):
        buffers = torch.load(tmp_path / f"buffers{rank}.pt")
        assert torch.equal(buffers["mask"], expected_mask)
        assert torch.isfinite(buffers["running_var"]).all() and (buffers["running_var"] > 0).all()
    assert trainer.callback_metrics["comm/skipped_rounds"] == 0  # rank 0's view: it never skipped


class UnevenLoaders(TinyRegressor):
    def train_dataloader(self):
        data = self._data(0)
        return torch.utils.data.DataLoader(data, batch_size=4 if self.global_rank == 0 else 8)


@pytest.mark.timeout(120)
def test_train_loaders_of_different_lengths_are_refused_before_any_round(tmp_path, fresh_port):
    # Before: rank 1's epoch ended first, and its validation collectives met rank 0's gossip.
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=10.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    with pytest.raises(Exception, match=r"different lengths \(rank 0: 64 train / 0 val, rank 1: 32 train"):
        trainer.fit(UnevenLoaders())
