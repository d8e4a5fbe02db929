"""Lightning features under GASLoC: manual optimization, bf16-mixed, accumulation, clipping, schedulers, validate."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from dist_utils import (
    flat_parameters,
    ManualRegressor,
    PerRankWeights,
    RecordParameters,
    ScheduledRegressor,
    TinyRegressor,
    load_ranks,
)
from gasloc_lightning import GASLoCStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240), pytest.mark.usefixtures("threads_safe_to_fork")]


def trainer_for(tmp_path, strategy, **kwargs):
    kwargs.setdefault("max_steps", 6)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      limit_val_batches=0, default_root_dir=tmp_path, **kwargs)


def gasloc(**kwargs):
    return GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0, **kwargs)


def test_manual_optimization_counts_optimizer_steps(tmp_path, fresh_port):
    trainer_for(tmp_path, gasloc(), callbacks=[RecordParameters(str(tmp_path))]).fit(ManualRegressor())
    records = load_ranks(tmp_path, 2)
    assert [r["rounds_at_fit_end"] for r in records] == [2, 2]
    history = torch.stack([r["history"] for r in records])  # (ranks, 1 + steps, P)
    assert not torch.equal(history[0, 1], history[0, 0])  # the manual steps were applied
    assert not torch.allclose(history[0, 2], history[1, 2])  # mid-round: the replicas differ
    assert torch.allclose(history[0, 3], history[1, 3], atol=1e-6)  # the round after 3 steps mixed them


def test_accumulation_clipping_and_scheduler(tmp_path, fresh_port):
    """H counts optimizer steps: 6 steps of 2 accumulated batches are 2 rounds."""
    trainer = trainer_for(tmp_path, gasloc(), accumulate_grad_batches=2, gradient_clip_val=0.5,
                          callbacks=[RecordParameters(str(tmp_path))])
    trainer.fit(ScheduledRegressor())
    records = load_ranks(tmp_path, 2)
    assert [r["rounds_at_fit_end"] for r in records] == [2, 2]
    assert all(r["global_step"] == 6 for r in records)
    assert len(records[0]["history"]) == 1 + 12  # a record per batch: 12 batches for 6 steps
    assert all(r["lr"] == pytest.approx(0.05 * 0.5**6) for r in records)  # stepped every optimizer step


def test_bf16_mixed_precision_keeps_float32_outer_state(tmp_path, fresh_port):
    trainer_for(tmp_path, gasloc(), precision="bf16-mixed",
                callbacks=[RecordParameters(str(tmp_path))]).fit(TinyRegressor())
    records = load_ranks(tmp_path, 2)
    assert [r["rounds_at_fit_end"] for r in records] == [2, 2]
    assert all(torch.isfinite(r["after_fit"]).all() for r in records)


def test_bf16_true_parameters_train_with_float32_rounds(tmp_path, fresh_port):
    trainer_for(tmp_path, gasloc(), precision="bf16-true",
                callbacks=[RecordParameters(str(tmp_path))]).fit(TinyRegressor())
    records = load_ranks(tmp_path, 2)
    history = torch.stack([r["history"] for r in records])  # (ranks, 1 + steps, P), before end-of-fit averaging
    assert not torch.equal(history[0, 2], history[1, 2])  # bfloat16 replicas trained apart mid-round
    assert torch.equal(history[0, 3], history[1, 3])  # the float32 round averaged them, cast back identically
    assert torch.equal(history[0, 6], history[1, 6])


def test_validate_without_a_fit_evaluates_rank_zero_weights_on_every_rank(tmp_path, fresh_port):
    # Averaging n different initialisations would evaluate a model nobody trained.
    model = PerRankWeights(str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=gasloc(), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=2,
                         default_root_dir=tmp_path)
    trainer.validate(model)
    records = load_ranks(tmp_path, 2, prefix="validate")
    assert not torch.allclose(records[0]["before"], records[1]["before"])  # the ranks did start apart
    for record in records:
        assert torch.equal(record["evaluated"], records[0]["before"])
        assert torch.equal(record["after"], records[0]["before"])


class PerRankOffset(pl.Callback):
    """Runs before GASLoCCallback: gives each rank its own replica right before predicting."""

    def on_predict_start(self, trainer, pl_module):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.add_(0.1 * (trainer.global_rank + 1))
        pl_module.before = flat_parameters(pl_module)


class RecordPredict(TinyRegressor):
    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def predict_dataloader(self):
        return self.val_dataloader()

    def predict_step(self, batch, batch_idx):
        self.evaluated = flat_parameters(self)
        return self(batch[0])

    def on_predict_end(self):  # module hooks run after the callbacks': the replica is back
        torch.save({"before": self.before, "evaluated": self.evaluated, "after": flat_parameters(self)},
                   f"{self.out_dir}/predict{self.global_rank}.pt")


def test_predict_runs_on_the_consensus_and_puts_the_replica_back(tmp_path, fresh_port):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=gasloc(), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, limit_predict_batches=2,
                         default_root_dir=tmp_path, callbacks=[PerRankOffset()])
    trainer.predict(RecordPredict(str(tmp_path)), return_predictions=False)
    records = load_ranks(tmp_path, 2, prefix="predict")
    consensus = (records[0]["before"] + records[1]["before"]) / 2
    assert not torch.allclose(records[0]["before"], records[1]["before"])
    for record in records:
        assert torch.allclose(record["evaluated"], consensus, atol=1e-6)
        assert torch.equal(record["after"], record["before"])
