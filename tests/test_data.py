"""Byte data: split, fingerprint and cache, concurrent builds, rank sharding, resume, entropy."""

from __future__ import annotations

import math
import multiprocessing
import platform
import random
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from gasloc_lightning.data import ByteDataModule, byte_unigram_entropy, stdlib_source_files
from gasloc_lightning.models import LanguageModel

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def text_folder(tmp_path) -> Path:
    words = "outer momentum gossip peers inner steps anchor round mixing weights consensus".split()
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(16):
        text = " ".join(rng.choice(words) for _ in range(400)) + "\n"
        (folder / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(text)
    (folder / ".hidden").write_text("skipped")
    return folder


def make(source, cache_dir, **kwargs) -> ByteDataModule:
    kwargs = {"block_size": 32, "batch_size": 4, "val_fraction": 0.25, **kwargs}
    return ByteDataModule(source=source, cache_dir=cache_dir, **kwargs)


def cached_bytes(data: ByteDataModule) -> dict[str, bytes]:
    return {split: (data.cache_path / f"{split}.u8").read_bytes() for split in ("train", "val")}


def take(loader, count: int) -> list[torch.Tensor]:
    """The next `count` x batches, moving on to the next epoch when one ends."""
    batches: list[torch.Tensor] = []
    while len(batches) < count:
        for x, _ in loader:
            batches.append(x)
            if len(batches) == count:
                break
    return batches


# --- split, fingerprint, cache ---------------------------------------------------------------


def test_stdlib_files_exclude_tests_and_installed_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [path.relative_to(root).as_posix() for path in stdlib_source_files()]
    assert len(relative) > 100 and relative == sorted(relative)
    assert "os.py" in relative
    for excluded in ("site-packages/", "test/", "tests/", "idle_test/"):
        assert not any(path.startswith(excluded) or f"/{excluded}" in path for path in relative), excluded


def test_stdlib_split_is_deterministic_and_disjoint(tmp_path):
    first, second = ByteDataModule(cache_dir=tmp_path / "a"), ByteDataModule(cache_dir=tmp_path / "b")
    first.prepare_data()
    second.prepare_data()
    assert first.fingerprint == second.fingerprint
    assert first.fingerprint["python"] == platform.python_version()
    for split in ("train", "val"):
        assert first.documents(split) == second.documents(split)
    train, val = set(first.documents("train")), set(first.documents("val"))
    assert train and val and not train & val
    root = Path(sysconfig.get_paths()["stdlib"])
    assert train | val == {path.relative_to(root).as_posix() for path in stdlib_source_files()}
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.1
    assert cached_bytes(first) == cached_bytes(second)
    assert (first.cache_path / "fingerprint.json").is_file()


def test_folder_split_is_by_file_and_skips_hidden_files(tmp_path, text_folder):
    data = make(text_folder, tmp_path / "cache")
    train, val = data.documents("train"), data.documents("val")
    expected = sorted(p.relative_to(text_folder).as_posix() for p in text_folder.rglob("doc*"))
    assert sorted(train + val) == expected
    assert not set(train) & set(val) and val
    data.setup("fit")
    expected_val = b"".join((text_folder / key).read_bytes() for key in val)
    assert cached_bytes(data)["val"] == expected_val


def test_single_file_holds_out_its_last_bytes(tmp_path):
    path = tmp_path / "corpus.txt"
    content = bytes(random.Random(1).randrange(256) for _ in range(4000))
    path.write_bytes(content)
    data = make(path, tmp_path / "cache", val_fraction=0.1)
    data.setup("fit")
    assert cached_bytes(data) == {"train": content[:3600], "val": content[3600:]}


def test_cache_is_reused(tmp_path, text_folder):
    first = make(text_folder, tmp_path / "cache")
    first.setup("fit")
    assert first.built_cache
    stamps = {p.name: p.stat().st_mtime_ns for p in first.cache_path.iterdir()}
    second = make(text_folder, tmp_path / "cache")
    second.prepare_data()
    second.setup("fit")
    assert not second.built_cache and second.cache_path == first.cache_path
    assert {p.name: p.stat().st_mtime_ns for p in second.cache_path.iterdir()} == stamps


def test_changed_content_gets_a_new_cache(tmp_path, text_folder):
    before = make(text_folder, tmp_path / "cache")
    before.prepare_data()
    (text_folder / "doc00.txt").write_text("changed")
    after = make(text_folder, tmp_path / "cache")
    after.prepare_data()
    assert after.fingerprint["sha256"] != before.fingerprint["sha256"]
    assert after.cache_path != before.cache_path and after.built_cache


def _build_in_child(cache_dir: str, barrier) -> tuple[bool, dict]:
    """Runs in a forked process: wait for the others, then prepare and set up at once."""
    data = ByteDataModule(cache_dir=cache_dir, block_size=64, batch_size=4)
    barrier.wait()
    data.prepare_data()
    data.setup("fit")
    return data.built_cache, data.fingerprint


def _child_entry(cache_dir: str, barrier, results) -> None:
    results.put(_build_in_child(cache_dir, barrier))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_concurrent_builds_from_four_processes_leave_one_valid_cache(tmp_path, threads_safe_to_fork):
    # Forked, not spawned: four processes with their own file descriptors and locks are what the cache's filelock
    # is for, and a spawned child would import torch and Lightning again first (about 45 s of the suite's time).
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()
    arguments = (str(tmp_path / "cache"), barrier, results)
    processes = [context.Process(target=_child_entry, args=arguments) for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=240) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert sum(built for built, _ in outcomes) == 1
    assert all(fingerprint == outcomes[0][1] for _, fingerprint in outcomes)
    reference = ByteDataModule(cache_dir=tmp_path / "reference")
    reference.prepare_data()
    # filelock keeps its empty lock file; nothing else is left
    entries = [p for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock"]
    assert [entry.name for entry in entries] == [reference.cache_path.name]
    # no temporary files left either
    assert sorted(p.name for p in entries[0].iterdir()) == ["fingerprint.json", "train.u8", "val.u8"]
    assert {s: (entries[0] / f"{s}.u8").read_bytes() for s in ("train", "val")} == cached_bytes(reference)


@pytest.mark.timeout(60)
def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(tmp_path, text_folder):
    """A build killed mid-way (SIGKILL, OOM) leaves its lock file; the next run must build at once,
    not wait out the 600 s lock timeout (the lock is an OS lock that dies with its holder)."""
    data = make(text_folder, tmp_path / "cache")
    lock = data.cache_path.parent / f"{data.cache_path.name}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("host 12345\n")  # what the killed builder left
    data.prepare_data()
    assert data.built_cache and data.cache_path.joinpath("fingerprint.json").is_file()


# --- sharding by rank --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_train_shards_are_disjoint_and_epochs_equal(tmp_path, text_folder, world_size):
    spans, lengths = [], set()
    for rank in range(world_size):
        data = make(text_folder, tmp_path / "cache", rank=rank, world_size=world_size)
        data.setup("fit")
        loader = data.train_dataloader()
        starts = list(loader.sampler)
        spans.append((min(starts), max(starts) + data.block_size + 1))  # bytes [first, last) this rank reads
        lengths.add(len(loader))
    assert len(lengths) == 1 and lengths.pop() > 0
    for (_, end), (next_start, _) in zip(spans, spans[1:]):
        assert end <= next_start


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_validation_batches_are_equal_on_every_rank(tmp_path, text_folder, world_size):
    counts, windows = [], []
    for rank in range(world_size):
        data = make(text_folder, tmp_path / "cache", rank=rank, world_size=world_size)
        data.setup("validate")
        loader = data.val_dataloader()
        counts.append(len(list(loader)))
        windows.append(list(loader.sampler))
    total = (len(cached_bytes(data)["val"]) - 1) // 32 // 4
    assert counts == [total // world_size] * world_size
    all_windows = [start for rank_windows in windows for start in rank_windows]
    assert len(set(all_windows)) == len(all_windows)  # no window evaluated twice
    assert all(b - a >= 32 for a, b in zip(sorted(all_windows), sorted(all_windows)[1:]))  # non-overlapping


def test_validation_cap_and_test_loader(tmp_path, text_folder):
    data = make(text_folder, tmp_path / "cache", val_batches=2, rank=1, world_size=2)
    data.setup("fit")
    assert len(data.val_dataloader()) == 2
    assert len(data.test_dataloader()) > 2
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_distributed_sampler_must_be_off(tmp_path, text_folder):
    data = make(text_folder, tmp_path / "cache")
    data.trainer = SimpleNamespace(
        world_size=2, global_rank=0, _accelerator_connector=SimpleNamespace(use_distributed_sampler=True)
    )
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        data.setup("fit")


# --- resume ----------------------------------------------------------------------------------------


def test_sampler_resumes_mid_epoch_and_across_epochs(tmp_path, text_folder):
    settings = {"samples_per_epoch": 5 * 4, "rank": 1, "world_size": 2, "seed": 3}
    uninterrupted = make(text_folder, tmp_path / "cache", **settings)
    uninterrupted.setup("fit")
    reference = take(uninterrupted.train_dataloader(), 12)

    for consumed in (3, 5, 7):  # mid-epoch, exactly at the epoch's end, inside the second epoch
        first = make(text_folder, tmp_path / "cache", **settings)
        first.setup("fit")
        take(first.train_dataloader(), consumed)
        state = first.state_dict()
        resumed = make(text_folder, tmp_path / "cache", **settings)
        resumed.load_state_dict(state)
        resumed.setup("fit")
        continued = take(resumed.train_dataloader(), 12 - consumed)
        for got, expected in zip(continued, reference[consumed:], strict=True):
            torch.testing.assert_close(got, expected)


def test_epochs_and_seeds_draw_different_windows(tmp_path, text_folder):
    first_rank = make(text_folder, tmp_path / "cache", samples_per_epoch=8, seed=1, rank=0, world_size=1)
    other_seed = make(text_folder, tmp_path / "cache", samples_per_epoch=8, seed=2, rank=0, world_size=1)
    loader = first_rank.train_dataloader()
    epoch0, epoch1 = torch.cat(take(loader, 2)), torch.cat(take(loader, 2))
    assert not torch.equal(epoch0, epoch1)
    assert not torch.equal(epoch0, torch.cat(take(other_seed.train_dataloader(), 2)))


class _RecordBatches(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].clone())


def _fit(text_folder, root, max_steps, ckpt_path=None, callbacks=()) -> _RecordBatches:
    recorder = _RecordBatches()
    # A worker process makes the DataLoader fetch ahead of training (Lightning itself does not
    # for sized loaders), so the sampler's own count would be ahead of the trained position.
    data = make(text_folder, root / "cache", samples_per_epoch=4 * 4, seed=5, num_workers=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=[recorder, *callbacks],
        limit_val_batches=0, default_root_dir=root,
    )
    model = LanguageModel(model={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16})
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return recorder


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_trainer_resume_continues_the_data_stream(tmp_path, text_folder):
    """The DataLoader fetches ahead; the saved position must still be the trained one."""
    full = _fit(text_folder, tmp_path / "full", max_steps=7).batches
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _fit(text_folder, tmp_path / "first", max_steps=3, callbacks=[checkpoint])
    resumed = _fit(text_folder, tmp_path / "second", max_steps=7, ckpt_path=checkpoint.best_model_path)
    resumed = resumed.batches
    assert len(resumed) == 4
    for got, expected in zip(resumed, full[3:], strict=True):
        torch.testing.assert_close(got, expected)


# --- errors and statistics -----------------------------------------------------------------------


def test_missing_path_is_reported_at_construction(tmp_path):
    missing = tmp_path / "no" / "such" / "corpus"
    with pytest.raises(FileNotFoundError, match="corpus"):
        ByteDataModule(source=missing, cache_dir=tmp_path)


def test_hf_source_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: nothing is downloaded
    data = ByteDataModule(source="hf:some/corpus", cache_dir=tmp_path)
    with pytest.raises(ImportError, match="datasets"):
        data.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"batch_size": 0}, "batch_size"),
        ({"block_size": -4}, "block_size"),
        ({"val_batches": 0}, "val_batches"),
        ({"rank": 1}, "rank"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"samples_per_epoch": 10, "batch_size": 4}, "samples_per_epoch"),
        ({"seed": -1}, "seed"),
    ],
)
def test_arguments_are_validated(tmp_path, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ByteDataModule(cache_dir=tmp_path, **kwargs)


def test_too_small_validation_split_fails_at_setup(tmp_path, text_folder):
    data = make(text_folder, tmp_path / "cache", batch_size=512)
    with pytest.raises(ValueError, match="batch_size"):
        data.setup("fit")


def test_unigram_entropy_of_known_bytes(tmp_path):
    assert byte_unigram_entropy(b"aaaa") == 0.0
    assert byte_unigram_entropy(b"abab") == pytest.approx(math.log(2))
    assert byte_unigram_entropy(bytes(range(256)) * 3) == pytest.approx(math.log(256))
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a" * 900 + b"abcd" * 25)  # validation = the last 100 bytes
    data = make(path, tmp_path / "cache", val_fraction=0.1)
    assert data.unigram_entropy("val") == pytest.approx(math.log(4))
    assert data.unigram_entropy("train") == 0.0  # only "a" 


def test_tokens_per_step(tmp_path):
    data = ByteDataModule(cache_dir=tmp_path, block_size=128, batch_size=16)
    assert data.tokens_per_step(4) == 16 * 128 * 4
    assert data.tokens_per_step() == 16 * 128


def test_datasets_cross_into_spawned_loader_workers(tmp_path, text_folder):
    """A memory map cannot be pickled: the dataset travels as its cache path (num_workers > 0 under spawn)."""
    import pickle

    data = make(text_folder, tmp_path / "cache")
    data.setup("fit")
    for loader in (data.train_dataloader(), data.val_dataloader()):
        dataset = loader.dataset
        copy = pickle.loads(pickle.dumps(dataset))
        assert len(copy) == len(dataset)
        for index in (0, len(dataset) // 2, len(dataset) - 1):
            assert all(torch.equal(a, b) for a, b in zip(copy[index], dataset[index]))
