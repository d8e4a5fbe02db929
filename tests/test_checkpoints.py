"""Per-rank checkpoints: exact resume, the consensus export, format errors, loading safety, fsspec paths."""

from __future__ import annotations

import pathlib
import uuid

import fsspec
from fsspec.implementations.memory import MemoryFileSystem
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader

from dist_utils import RecordParameters, SaveAt, SaveFinalState, TinyRegressor, flat_parameters, write_text_corpus
from gasloc_lightning import DiLoCoStrategy, GASLoCStrategy
from gasloc_lightning.app.export import main as export_main
from gasloc_lightning.data import ByteDataModule
from gasloc_lightning.models.lm import LanguageModel
from gasloc_lightning.plugins.per_rank import (
    CheckpointFormatError,
    export_consensus,
    load_rank_checkpoint,
    rank_file,
)
from gasloc_lightning.plugins.per_rank_io import PerRankCheckpointIO

pytestmark = [pytest.mark.distributed]


@pytest.fixture(autouse=True)
def one_thread_before_forking():
    """A run inside this process (one rank) sets torch's threads to the cores and starts an OpenMP pool; ranks
    forked after it inherit the pool broken (libgomp is not fork-safe) and hang in their first parallel op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_trainer(tmp_path, strategy, max_steps, callbacks=(), devices=2, **kwargs):
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
    make_trainer(tmp_path, strategy(), 2 * R * H, [SaveFinalState(str(tmp_path), "full")],
               enable_checkpointing=False).fit(model, data)

    fresh_port()
    pl.seed_everything(0)
    model, data = lm_and_data(tmp_path, samples_per_epoch)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=R * H, save_top_k=-1)
    make_trainer(tmp_path, strategy(), R * H, [checkpoints]).fit(model, data)
    (saved,) = (tmp_path / "ckpt").iterdir()
    assert saved.name.endswith(f"step={R * H}.ckpt") and saved.is_dir() and sorted(p.name for p in saved.iterdir()) == [
        "meta.json", "rank_0.ckpt", "rank_1.ckpt", "shared.ckpt"]

    fresh_port()
    pl.seed_everything(123)  # the resumed run must not depend on the seed it starts with
    model, data = lm_and_data(tmp_path, samples_per_epoch)
    make_trainer(tmp_path, strategy(), 2 * R * H, [SaveFinalState(str(tmp_path), "resumed")],
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
    make_trainer(tmp_path, strategy, 6, [checkpoints]).fit(model, data)
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
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(tmp_path / "missing"), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2 and "not a complete GASLoC checkpoint" in capsys.readouterr().err


def write_two_ranks(directory, save_ids=(7, 7), **io_kwargs):
    """A small per-rank directory written through the plugin, as two ranks of one save would."""
    io = PerRankCheckpointIO(**io_kwargs)
    for rank in (1, 0):  # any order: the save id, not the order, tells a complete directory
        checkpoint = {"global_step": 3, "state_dict": {"w": torch.full((2,), float(rank))}, "loops": {"rank": rank},
                      "gasloc": {"rank": rank, "world_size": 2, "save_id": save_ids[rank]}}
        io.save_checkpoint(checkpoint, directory)


def test_truncated_mixed_or_foreign_checkpoint_files_name_the_file(tmp_path):
    directory = tmp_path / "ckpt"
    write_two_ranks(directory)
    assert load_rank_checkpoint(directory, 1, 2)["loops"] == {"rank": 1}  # loops are per rank
    with pytest.raises(CheckpointFormatError, match="saved by 2 workers, this run has 4.*gasloc-export"):
        load_rank_checkpoint(directory, 0, 4)
    pathlib.Path(rank_file(directory, 1)).write_bytes(pathlib.Path(rank_file(directory, 0)).read_bytes()[:20])
    with pytest.raises(CheckpointFormatError, match="rank_1.ckpt is truncated"):
        load_rank_checkpoint(directory, 1, 2)
    write_two_ranks(tmp_path / "mixed", save_ids=(7, 8))  # rank 1's file is from another save
    with pytest.raises(CheckpointFormatError, match="rank_1.ckpt belongs to another save"):
        load_rank_checkpoint(tmp_path / "mixed", 1, 2)
    (directory / "meta.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointFormatError, match="gasloc-per-rank-v2"):
        load_rank_checkpoint(directory, 0, 2)


def test_a_v1_directory_still_loads_with_its_shared_loops(tmp_path):
    directory = tmp_path / "v1"
    directory.mkdir()
    (directory / "meta.json").write_text('{"format": "gasloc-per-rank-v1", "world_size": 1, "global_step": 3}')
    torch.save({"global_step": 3, "loops": {"fit_loop": 1}}, directory / "shared.ckpt")
    torch.save({"state_dict": {}, "gasloc": {"strategy": {}, "rng": {}}}, directory / "rank_0.ckpt")
    assert load_rank_checkpoint(directory, 0, 1)["loops"] == {"fit_loop": 1}


def test_rng_states_round_trip_through_a_safe_load(tmp_path):
    import random

    import numpy as np

    from gasloc_lightning.plugins.per_rank import load_file, load_rng_state_dict, rng_state_dict, save_file

    save_file({"rng": rng_state_dict()}, tmp_path / "rng.ckpt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    load_rng_state_dict(load_file(tmp_path / "rng.ckpt")["rng"])  # weights_only=True
    assert torch.equal(torch.rand(3), expected[0]) and (np.random.rand(3) == expected[1]).all()
    assert random.random() == expected[2]


class RecordingFileSystem(MemoryFileSystem):
    """An in-memory filesystem that remembers the storage options it was built with."""

    protocol = "recordingfs"
    seen_options: list[dict] = []

    def __init__(self, *args, **storage_options):
        super().__init__(*args, **storage_options)
        RecordingFileSystem.seen_options.append(dict(storage_options))


def test_storage_options_reach_fsspec(tmp_path):
    fsspec.register_implementation("recordingfs", RecordingFileSystem, clobber=True)
    root = f"recordingfs://{uuid.uuid4().hex}"
    write_two_ranks(f"{root}/ckpt", storage_options={"token": "secret", "skip_instance_cache": True})
    assert RecordingFileSystem.seen_options and all(o.get("token") == "secret" for o in RecordingFileSystem.seen_options)
    io = PerRankCheckpointIO(storage_options={"token": "secret", "skip_instance_cache": True})
    assert io.load_checkpoint(f"{root}/ckpt", rank=1, world_size=2)["loops"] == {"rank": 1}
    io.remove_checkpoint(f"{root}/ckpt")
    assert not fsspec.filesystem("memory").exists(f"{root}/ckpt")


def test_only_a_per_rank_checkpoint_io_is_accepted():
    assert isinstance(GASLoCStrategy(inner_steps=2).checkpoint_io, PerRankCheckpointIO)
    wrapped = GASLoCStrategy(inner_steps=2, checkpoint_io=AsyncCheckpointIO())  # Lightning's async wrapper
    assert isinstance(wrapped.checkpoint_io.checkpoint_io, PerRankCheckpointIO)
    with pytest.raises(ValueError, match="TorchCheckpointIO.*PerRankCheckpointIO"):
        GASLoCStrategy(inner_steps=2, checkpoint_io=TorchCheckpointIO())
    with pytest.raises(ValueError, match="need a PerRankCheckpointIO"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=GASLoCStrategy(inner_steps=2), plugins=[TorchCheckpointIO()])
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=GASLoCStrategy(inner_steps=2),
                         plugins=[AsyncCheckpointIO()], logger=False)
    assert isinstance(trainer.strategy.checkpoint_io.checkpoint_io, PerRankCheckpointIO)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_with_another_world_size_fails_clearly(tmp_path, fresh_port):
    model, data = lm_and_data(tmp_path, 40)
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=60.0)
    make_trainer(tmp_path, strategy, 3, [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)]).fit(
        model, data)
    fresh_port()
    model, data = lm_and_data(tmp_path, 40)
    trainer = make_trainer(tmp_path, GASLoCStrategy(inner_steps=3), 6, devices=1)
    with pytest.raises(CheckpointFormatError, match="saved by 2 workers, this run has 1"):
        trainer.fit(model, data, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))


# ------------------------------------------------------------------ resume through every path and configuration
def assert_same(expected, actual, where="state"):
    """Bitwise equality of nested tensors, dicts, lists and scalars."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert expected == actual, where


def assert_resume_is_bitwise_identical(tmp_path, fresh_port, strategy, first_steps, total_steps, devices=2,
                                       save_to=None):
    """``total_steps`` uninterrupted == ``first_steps``, a checkpoint at ``save_to``, a resumed fit to ``total_steps``.

    An epoch is ``first_steps`` batches: TinyRegressor's loader is not resumable mid-epoch (the LM test covers that).
    """
    save_to = save_to or str(tmp_path / "ck")
    pl.seed_everything(0)
    make_trainer(tmp_path, strategy(), total_steps, [SaveFinalState(str(tmp_path), "full")], devices=devices,
                 enable_checkpointing=False).fit(TinyRegressor(batches=first_steps))
    fresh_port()
    pl.seed_everything(0)
    make_trainer(tmp_path, strategy(), first_steps, [SaveAt(first_steps, save_to)], devices=devices,
                 enable_checkpointing=False).fit(TinyRegressor(batches=first_steps))
    fresh_port()
    pl.seed_everything(123)  # the resumed run must not depend on the seed it starts with
    model = TinyRegressor(batches=first_steps)
    with torch.no_grad():  # nor on the weights it starts with: all comes from the checkpoint
        for parameter in model.parameters():
            parameter.add_(1.0)
    make_trainer(tmp_path, strategy(), total_steps, [SaveFinalState(str(tmp_path), "resumed")], devices=devices,
                 enable_checkpointing=False).fit(model, ckpt_path=save_to)
    for rank in range(devices):
        full = torch.load(tmp_path / f"full{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed{rank}.pt", weights_only=False)
        assert full["global_step"] == resumed["global_step"] == total_steps
        assert_same(full, resumed, f"rank {rank}")


def gasloc(**kwargs):
    return lambda: GASLoCStrategy(start_method="fork", gossip_timeout=60.0, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy, first_steps, total_steps, devices",
    [
        (gasloc(inner_steps=2, overlap=True), 4, 8, 2),
        (gasloc(inner_steps=2, message_dtype="bfloat16"), 4, 8, 2),
        (lambda: DiLoCoStrategy(inner_steps=2, start_method="fork", gossip_timeout=60.0), 4, 8, 2),
        (gasloc(inner_steps=2, ranks_per_worker=2), 4, 8, 4),
        (gasloc(inner_steps=[2, 3]), 6, 12, 2),  # H_i per rank: rounds of max(H_i) = 3 steps
        (gasloc(inner_steps=2, topology="ring", message_codec="int4", error_feedback=True), 4, 8, 2),
        # H = 4, F = 2, tau = 1: after step 5 fragment 0's exchange is in flight when the checkpoint is taken
        (gasloc(inner_steps=4, fragments=2, fragment_sync_delay=1, message_codec="int8"), 5, 12, 2),
        (lambda: DiLoCoStrategy(inner_steps=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.25,
                                message_codec="int8", start_method="fork", gossip_timeout=60.0), 5, 12, 2),
    ],
    ids=["overlap", "bf16_messages", "diloco", "ranks_per_worker_2", "per_rank_inner_steps", "int4_error_feedback",
         "fragments_in_flight", "streaming_diloco_in_flight"],
)
def test_resume_is_bitwise_identical_for_every_configuration(tmp_path, fresh_port, strategy, first_steps, total_steps,
                                                            devices):
    assert_resume_is_bitwise_identical(tmp_path, fresh_port, strategy, first_steps, total_steps, devices)


@pytest.mark.timeout(120)
def test_trainer_save_checkpoint_to_a_file_url_writes_that_path(tmp_path, fresh_port, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the old code made a folder literally named "file:"
    url = f"file://{tmp_path}/url/ck"
    assert_resume_is_bitwise_identical(tmp_path, fresh_port, gasloc(inner_steps=2), 4, 8, save_to=url)
    assert sorted(p.name for p in (tmp_path / "url" / "ck").iterdir()) == [
        "meta.json", "rank_0.ckpt", "rank_1.ckpt", "shared.ckpt"]
    assert not (tmp_path / "file:").exists()


@pytest.mark.timeout(120)
def test_resume_from_fsspec_memory_filesystem(tmp_path, fresh_port):
    """One rank, in this process (the memory filesystem is per process); GASLoC with one worker has outer steps."""
    root = f"memory://{uuid.uuid4().hex}"
    try:
        assert_resume_is_bitwise_identical(tmp_path, fresh_port, lambda: GASLoCStrategy(inner_steps=2), 4, 8,
                                           devices=1, save_to=f"{root}/ck")
        assert sorted(p.rsplit("/", 1)[-1] for p in fsspec.filesystem("memory").ls(f"{root}/ck", detail=False)) == [
            "meta.json", "rank_0.ckpt", "shared.ckpt"]
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.timeout(120)
def test_async_checkpoint_io_writes_a_complete_directory(tmp_path, fresh_port):
    strategy = GASLoCStrategy(inner_steps=2, start_method="fork", gossip_timeout=60.0,
                              checkpoint_io=AsyncCheckpointIO(PerRankCheckpointIO()))
    make_trainer(tmp_path, strategy, 4, [SaveAt(4, str(tmp_path / "ck"))], enable_checkpointing=False).fit(
        TinyRegressor())
    assert [load_rank_checkpoint(tmp_path / "ck", r, 2)["global_step"] for r in range(2)] == [4, 4]


# ------------------------------------------------------------------ per-rank loops
class PositionLoader(DataLoader):
    """A stateful loader (Lightning keeps its state in ``loops``) whose state names its rank and position."""

    def __init__(self, dataset, rank: int, out_dir: str):
        super().__init__(dataset, batch_size=4)
        self.rank, self.out_dir, self.served = rank, out_dir, 0

    def __iter__(self):
        for batch in super().__iter__():
            self.served += 1
            yield batch

    def state_dict(self):
        return {"rank": self.rank, "position": self.served * (self.rank + 1)}  # differs per rank

    def load_state_dict(self, state):
        torch.save(state, pathlib.Path(self.out_dir) / f"loaded{self.rank}.pt")


class PositionRegressor(TinyRegressor):
    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def train_dataloader(self):
        return PositionLoader(self._data(0), self.global_rank, self.out_dir)


@pytest.mark.timeout(120)
def test_each_rank_resumes_its_own_dataloader_position(tmp_path, fresh_port):
    make_trainer(tmp_path, gasloc(inner_steps=2)(), 4, [SaveAt(4, str(tmp_path / "ck"))],
                 enable_checkpointing=False).fit(PositionRegressor(str(tmp_path)))
    fresh_port()
    make_trainer(tmp_path, gasloc(inner_steps=2)(), 6, enable_checkpointing=False).fit(
        PositionRegressor(str(tmp_path)), ckpt_path=str(tmp_path / "ck"))
    loaded = [torch.load(tmp_path / f"loaded{rank}.pt") for rank in range(2)]
    assert loaded[0]["rank"] == 0 and loaded[1]["rank"] == 1  # before: both got rank 0's
    assert loaded[1]["position"] == 2 * loaded[0]["position"] > 0


# ------------------------------------------------------------------ single files
@pytest.mark.timeout(120)
def test_fit_from_a_single_file_checkpoint_starts_every_replica_from_it(tmp_path, fresh_port):
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         default_root_dir=tmp_path)
    model = TinyRegressor(seed=5)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    start = flat_parameters(model)
    torch.set_num_threads(1)  # before forking: see one_thread_before_forking
    fresh_port()
    make_trainer(tmp_path, gasloc(inner_steps=2)(), 7, [RecordParameters(str(tmp_path))],
                 enable_checkpointing=False).fit(TinyRegressor(), ckpt_path=str(tmp_path / "single.ckpt"))
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(record["history"][0], start)  # both replicas start from the file's weights
        assert record["global_step"] == 7 and record["round_index"] == 2  # 4 steps after step 3: 2 rounds


# ------------------------------------------------------------------ loading safety
class MarkerPayload:
    """Unpickling it creates a marker file: it stands for the code a malicious checkpoint would run."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


@pytest.mark.timeout(180)
def test_a_checkpoint_that_would_run_code_is_refused_unless_trusted(tmp_path, fresh_port, capsys):
    directory, marker = tmp_path / "ck", tmp_path / "marker"
    make_trainer(tmp_path, gasloc(inner_steps=2)(), 2, [SaveAt(2, str(directory))], enable_checkpointing=False).fit(
        TinyRegressor())
    for path in directory.glob("*.ckpt"):  # our own files need no unsafe load
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == [], path.name
    rank_1 = torch.load(directory / "rank_1.ckpt", weights_only=True)
    torch.save({**rank_1, "payload": MarkerPayload(marker)}, directory / "rank_1.ckpt")

    fresh_port()
    with pytest.raises(Exception) as refused:
        make_trainer(tmp_path, gasloc(inner_steps=2)(), 4).fit(TinyRegressor(), ckpt_path=str(directory))
    assert "rank_1.ckpt" in str(refused.value) and "trust_checkpoint_code=True" in str(refused.value)
    with pytest.raises(SystemExit):
        export_main([str(directory), str(tmp_path / "out.ckpt")])
    error = capsys.readouterr().err
    assert "rank_1.ckpt" in error and "--trust-checkpoint-code" in error
    assert not marker.exists()

    assert export_main([str(directory), str(tmp_path / "out.ckpt"), "--trust-checkpoint-code"]) == 0
    assert marker.exists()
    marker.unlink()
    fresh_port()
    make_trainer(tmp_path, gasloc(inner_steps=2, trust_checkpoint_code=True)(), 4).fit(
        TinyRegressor(), ckpt_path=str(directory))
    assert marker.exists()
