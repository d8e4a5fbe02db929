"""Per-rank checkpoints: exact resume, the consensus export, format errors, loading safety, fsspec paths."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dist_utils import SaveFinalState, write_text_corpus
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.plugins.per_rank import CheckpointFormatError, export_consensus, load_rank_checkpoint, rank_file
from gasloc_lightning.data import ByteDataModule
from gasloc_lightning.models.lm import LanguageModel

pytestmark = [pytest.mark.distributed]


def lm_trainer(tmp_path, strategy, max_steps, callbacks=(), devices=2, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      limit_val_batches=0, default_root_dir=tmp_path, callbacks=list(callbacks), **kwargs)


def lm_and_data(tmp_path, samples_per_epoch):
    model = LanguageModel(model={"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.2},
                          warmup_steps=2, max_steps=12)  # fixed: the LR schedule must not depend on the run length
    data = ByteDataModule(source=write_text_corpus(tmp_path / "corpus"), block_size=16, batch_size=4,
                          cache_dir=tmp_path / "cache", samples_per_epoch=samples_per_epoch, val_fraction=0.2)
    return model, data


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "topology, samples_per_epoch",
    [("one_peer", 24), ("complete", 40)],  # 24 samples = 6 batches: the checkpoint at step 6 ends an epoch;
    ids=["one_peer-epoch_boundary", "complete-mid_epoch"],  # 10 batches per epoch: step 6 is mid-epoch
)
def test_resume_is_bitwise_identical(tmp_path, fresh_port, topology, samples_per_epoch):
    """2R rounds uninterrupted == R rounds + resume from the per-rank checkpoint + R rounds (AdamW, dropout)."""
    H, R = 3, 2

    def strategy():
        return GASLoCStrategy(topology=topology, inner_steps=H, start_method="fork", gossip_timeout=60.0)

    pl.seed_everything(0)
    model, data = lm_and_data(tmp_path, samples_per_epoch)
    lm_trainer(tmp_path, strategy(), 2 * R * H, [SaveFinalState(str(tmp_path), "full")],
               enable_checkpointing=False).fit(model, data)

    fresh_port()
    pl.seed_everything(0)
    model, data = lm_and_data(tmp_path, samples_per_epoch)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=R * H, save_top_k=-1)
    lm_trainer(tmp_path, strategy(), R * H, [checkpoints]).fit(model, data)
    (saved,) = (tmp_path / "ckpt").iterdir()
    assert saved.name.endswith(f"step={R * H}.ckpt") and saved.is_dir() and sorted(p.name for p in saved.iterdir()) == [
        "meta.json", "rank_0.ckpt", "rank_1.ckpt", "shared.ckpt"]

    fresh_port()
    pl.seed_everything(123)  # the resumed run must not depend on the seed it starts with
    model, data = lm_and_data(tmp_path, samples_per_epoch)
    lm_trainer(tmp_path, strategy(), 2 * R * H, [SaveFinalState(str(tmp_path), "resumed")],
               enable_checkpointing=False).fit(model, data, ckpt_path=str(saved))

    for rank in range(2):
        full = torch.load(tmp_path / f"full{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed{rank}.pt", weights_only=False)
        assert resumed["global_step"] == full["global_step"] == 2 * R * H
        for a, b in zip(full["params"], resumed["params"]):
            assert torch.equal(a, b)
        outer_full, outer_resumed = full["strategy"]["outer"], resumed["strategy"]["outer"]
        assert torch.equal(outer_full["round_start"], outer_resumed["round_start"])
        assert torch.equal(outer_full["anchor"], outer_resumed["anchor"])
        assert full["strategy"]["round_index"] == resumed["strategy"]["round_index"] == 2 * R
        assert full["strategy"]["counters"] == resumed["strategy"]["counters"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_consensus_export_averages_the_replicas_and_loads_for_inference(tmp_path, fresh_port):
    model, data = lm_and_data(tmp_path, 40)
    strategy = GASLoCStrategy(topology="local", inner_steps=3, start_method="fork", gossip_timeout=60.0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    lm_trainer(tmp_path, strategy, 6, [checkpoints]).fit(model, data)
    directory = tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    replicas = [load_rank_checkpoint(directory, r, 2)["state_dict"] for r in range(2)]
    report = export_consensus(directory, tmp_path / "consensus.ckpt")
    assert report["world_size"] == 2 and report["consensus_distance"] > 0
    restored = LanguageModel.load_from_checkpoint(tmp_path / "consensus.ckpt")
    for name, tensor in restored.state_dict().items():
        if torch.is_floating_point(tensor):
            assert torch.allclose(tensor, (replicas[0][name] + replicas[1][name]) / 2, atol=1e-6), name
    plain = torch.load(tmp_path / "consensus.ckpt", weights_only=True)["state_dict"]
    assert set(plain) == set(restored.state_dict())
    logits = restored(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()


def test_export_cli_reports_errors_and_result(tmp_path, capsys):
    from gasloc_lightning.app.export import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "missing"), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2 and "not a complete GASLoC checkpoint" in capsys.readouterr().err


def test_truncated_or_foreign_checkpoint_files_name_the_file(tmp_path):
    from gasloc_lightning.plugins.per_rank import FORMAT, write_meta

    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_meta(directory, world_size=2, global_step=3)
    torch.save({"loops": {}}, directory / "shared.ckpt")
    torch.save({"state_dict": {}}, rank_file(directory, 0))
    rank_file(directory, 1).write_bytes(rank_file(directory, 0).read_bytes()[:20])  # truncated
    with pytest.raises(CheckpointFormatError, match="rank_1.ckpt"):
        load_rank_checkpoint(directory, 1, 2)
    with pytest.raises(CheckpointFormatError, match="saved by 2 workers, this run has 4.*gasloc-export"):
        load_rank_checkpoint(directory, 0, 4)
    (directory / "meta.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointFormatError, match=FORMAT):
        load_rank_checkpoint(directory, 0, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_with_another_world_size_fails_clearly(tmp_path, fresh_port):
    model, data = lm_and_data(tmp_path, 40)
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    lm_trainer(tmp_path, strategy, 3, [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)]).fit(
        model, data)
    fresh_port()
    model, data = lm_and_data(tmp_path, 40)
    trainer = lm_trainer(tmp_path, GASLoCStrategy(inner_steps=3), 6, devices=1)
    with pytest.raises(CheckpointFormatError, match="saved by 2 workers, this run has 1"):
        trainer.fit(model, data, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
