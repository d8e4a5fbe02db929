"""Byte-level data for GASLoC workers: each rank trains on its own shard of one token stream.

The default corpus is the source code of the Python standard library, which every Python
installation carries, so training and tests need no download. Any local text file or folder
works too, and ``source="hf:<name>"`` reads a Hugging Face dataset when the optional
``datasets`` package is installed.

Pipeline:

1. List the documents (files, or dataset records) and split them BY DOCUMENT: a document goes
   to validation iff a SHA-256 of its name falls in the ``val_fraction`` bucket, so the split
   never depends on the order of listing, on Python's salted ``hash()`` or on the world size.
   A single file is split by bytes instead: its last ``val_fraction`` goes to validation.
2. Fingerprint the content: SHA-256 over (name, SHA-256 of bytes) of every document, with the
   Python version for the standard library, since it differs between versions.
3. Concatenate each split into one file of raw bytes (token id = byte value, vocabulary 256),
   once, under ``cache_dir/<source>-<fingerprint key>/``, and memory-map it with
   ``torch.from_file``.
4. Rank r of W trains on the r-th contiguous 1/W of the train stream (disjoint shards), on
   windows of ``block_size + 1`` bytes at seeded random offsets; validation uses fixed,
   non-overlapping windows, the same number of batches on every rank.

Because the module shards by rank itself, Lightning must not add a DistributedSampler:
use ``Trainer(use_distributed_sampler=False)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
DEFAULT_CACHE_DIR = "~/.cache/gasloc-lightning"
LOCK_TIMEOUT_S = 600.0
MAX_STDLIB_FILE_BYTES = 1 << 20
_LOCK_POLL_S = 0.05
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_SPLITS = ("train", "val")


# ----------------------------------------------------------------------------------------------
# Documents, split and fingerprint


@dataclass(frozen=True)
class _Piece:
    """Bytes [start, stop) of one document; stop=None means to the end."""

    key: str
    read: Callable[[], bytes]
    start: int = 0
    stop: int | None = None

    def content(self) -> bytes:
        data = self.read()
        return data if (self.start, self.stop) == (0, None) else data[self.start : self.stop]


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted, without tests and installed packages.

    Directories named ``site-packages``, ``dist-packages``, ``test``, ``tests`` and
    ``idle_test`` (hence ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``) are skipped, as
    are files over ``MAX_STDLIB_FILE_BYTES`` (generated tables). Python source cannot contain
    NUL bytes, so no binary file gets through.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_EXCLUDED_DIRS]
        for name in names:
            path = Path(directory, name)
            if not name.endswith(".py") or path.is_symlink():
                continue
            if path.stat().st_size <= MAX_STDLIB_FILE_BYTES:
                files.append(path)
    return sorted(files)


def _folder_files(root: Path) -> list[Path]:
    """Every regular file under root, sorted; hidden files and folders (.git, ...) are skipped."""
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        paths = (Path(directory, name) for name in names if not name.startswith("."))
        files.extend(path for path in paths if path.is_file())
    return sorted(files)


def _file_pieces(root: Path, files: list[Path]) -> list[_Piece]:
    return [_Piece(key=path.relative_to(root).as_posix(), read=path.read_bytes) for path in files]


def _hf_pieces(name: str, split: str, text_field: str) -> list[_Piece]:
    try:
        import datasets  # optional dependency, imported only when asked for
    except ImportError as error:
        raise ImportError(
            f"source='hf:{name}' needs the optional 'datasets' package: pip install 'gasloc-lightning[hf]'"
        ) from error
    dataset = datasets.load_dataset(name, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(
            f"hf_text_field={text_field!r} is not a column of {name}; columns: {dataset.column_names}"
        )
    texts = dataset[text_field]
    return [_Piece(key=str(i), read=lambda text=text: text.encode("utf-8")) for i, text in enumerate(texts)]


def _bucket(key: str) -> float:
    """Stable position of a document name in [0, 1)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def _split_by_document(pieces: list[_Piece], val_fraction: float) -> dict[str, list[_Piece]]:
    val = [p for p in pieces if _bucket(p.key) < val_fraction]
    # Both splits must be non-empty: borrow the document nearest to the bucket boundary.
    if not val:
        val = [min(pieces, key=lambda p: _bucket(p.key))]
    if len(val) == len(pieces):
        val.remove(max(pieces, key=lambda p: _bucket(p.key)))
    val_keys = {p.key for p in val}
    return {"train": [p for p in pieces if p.key not in val_keys], "val": val}


def _split_by_bytes(piece: _Piece, val_fraction: float) -> dict[str, list[_Piece]]:
    size = len(piece.read())
    if size < 2:
        raise ValueError(f"source {piece.key!r} has {size} bytes, too few to split into train and validation")
    train_size = min(size - 1, max(1, size - math.ceil(size * val_fraction)))
    return {
        "train": [_Piece(piece.key, piece.read, 0, train_size)],
        "val": [_Piece(piece.key, piece.read, train_size, None)],
    }


def _content_sha256(pieces: list[_Piece]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece.key.encode("utf-8") + b"\0" + hashlib.sha256(piece.read()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Source:
    kind: str  # "stdlib", "folder", "file" or "hf"
    path: Path | None = None
    hf_name: str = ""
    hf_split: str = "train"
    hf_text_field: str = "text"

    def pieces(self) -> list[_Piece]:
        if self.kind == "stdlib":
            return _file_pieces(Path(sysconfig.get_paths()["stdlib"]), stdlib_source_files())
        if self.kind == "folder":
            return _file_pieces(self.path, _folder_files(self.path))
        if self.kind == "file":
            return [_Piece(key=self.path.name, read=self.path.read_bytes)]
        return _hf_pieces(self.hf_name, self.hf_split, self.hf_text_field)

    def describe(self) -> str:
        return f"hf:{self.hf_name}" if self.kind == "hf" else str(self.path or "stdlib")


def _parse_source(source: str | os.PathLike, hf_split: str, hf_text_field: str) -> _Source:
    if source == "stdlib":
        return _Source("stdlib")
    if isinstance(source, str) and source.startswith("hf:"):
        if not source[3:]:
            raise ValueError("source='hf:<name>' needs a dataset name after 'hf:'")
        return _Source("hf", hf_name=source[3:], hf_split=hf_split, hf_text_field=hf_text_field)
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"source path does not exist: {path}")
    return _Source("folder" if path.is_dir() else "file", path=path)


@dataclass(frozen=True)
class _Plan:
    """What the cache holds: the documents of each split and the fingerprint naming it."""

    splits: dict[str, list[_Piece]]
    fingerprint: dict[str, Any]

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _make_plan(source: _Source, val_fraction: float) -> _Plan:
    pieces = source.pieces()
    if not pieces:
        raise ValueError(f"source {source.describe()} contains no documents")
    if len(pieces) == 1:
        splits = _split_by_bytes(pieces[0], val_fraction)
    else:
        splits = _split_by_document(pieces, val_fraction)
    fingerprint = {
        "format": CACHE_FORMAT,
        "source": source.kind,
        "val_fraction": val_fraction,
        "documents": len(pieces),
        "sha256": _content_sha256(pieces),
    }
    if source.kind == "stdlib":
        fingerprint["python"] = platform.python_version()
    return _Plan(splits=splits, fingerprint=fingerprint)


# ----------------------------------------------------------------------------------------------
# The on-disk cache


def _write_atomically(path: Path, chunks: Iterator[bytes]) -> int:
    """Writes to a temporary file in the same folder, then renames it: readers see all or nothing."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    size = 0
    try:
        with os.fdopen(fd, "wb") as file:
            for chunk in chunks:
                size += file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return size


def _is_complete(entry: Path, fingerprint: dict[str, Any]) -> bool:
    # fingerprint.json is renamed into place last, so its presence means both splits are complete.
    try:
        stored = json.loads((entry / "fingerprint.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return stored == fingerprint and all((entry / f"{split}.u8").is_file() for split in _SPLITS)


def _build(entry: Path, plan: _Plan) -> None:
    start = time.monotonic()
    entry.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split in _SPLITS:
        sizes[split] = _write_atomically(entry / f"{split}.u8", (p.content() for p in plan.splits[split]))
        if sizes[split] == 0:
            documents = len(plan.splits[split])
            raise ValueError(f"the {split} split of {entry.name} is empty (documents: {documents})")
    text = json.dumps(plan.fingerprint, indent=2, sort_keys=True)
    _write_atomically(entry / "fingerprint.json", iter([text.encode()]))
    log.info(
        "built byte cache path=%s train_bytes=%d val_bytes=%d seconds=%.2f",
        entry, sizes["train"], sizes["val"], time.monotonic() - start,
    )


def _ensure_cache(entry: Path, plan: _Plan) -> bool:
    """Builds the cache unless present; returns whether this process built it.

    Concurrency: the first process to create ``<entry>.lock`` (O_CREAT | O_EXCL) builds while
    the others poll for the completed cache. Correctness does not rest on the lock: every
    builder writes identical bytes through temp-file + rename, so if the lock holder dies and
    a waiter times out after LOCK_TIMEOUT_S, the waiter builds too, and racing builders are
    harmless. The lock only avoids duplicated work.
    """
    if _is_complete(entry, plan.fingerprint):
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = entry.parent / f"{entry.name}.lock"
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _is_complete(entry, plan.fingerprint):
                return False
            if time.monotonic() > deadline:
                log.warning("cache lock held for %.0fs, building anyway lock=%s", LOCK_TIMEOUT_S, lock)
                _build(entry, plan)
                return True
            time.sleep(_LOCK_POLL_S)
            continue
        try:
            os.write(fd, f"{platform.node()} {os.getpid()}\n".encode())
            if _is_complete(entry, plan.fingerprint):  # finished by another process meanwhile
                return False
            _build(entry, plan)
            return True
        finally:
            os.close(fd)
            lock.unlink(missing_ok=True)


def _memory_map(path: Path) -> Tensor:
    # shared=False maps the file privately: pages load lazily and nothing is ever written back.
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def byte_unigram_entropy(data: bytes | Tensor) -> float:
    """Entropy in nats per byte of the byte histogram of ``data``.

    A model that ignores context cannot beat this loss on the same bytes, which makes it the
    acceptance bar for a language model's validation loss.

    Args:
        data: bytes, or a 1-D uint8 tensor.
    """
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
    if tokens.numel() == 0:
        raise ValueError("data must not be empty")
    counts = torch.zeros(256, dtype=torch.int64)
    for chunk in tokens.flatten().split(1 << 24):
        counts += torch.bincount(chunk, minlength=256)
    p = counts[counts > 0].double() / counts.sum()
    return float(-(p * p.log()).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


# ----------------------------------------------------------------------------------------------
# Datasets and the stateful sampler


class _Windows(Dataset):
    """Index = start offset into the byte stream; item = (x, y), y shifted by one byte.

    Pickles as the cache file's path (a memory map cannot cross into a spawned DataLoader
    worker); each process maps the file again.
    """

    def __init__(self, path: Path, block_size: int) -> None:
        self.path, self.block_size = Path(path), block_size
        self.tokens = _memory_map(self.path)

    def __getstate__(self) -> dict:
        return {"path": self.path, "block_size": self.block_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["block_size"])

    def __len__(self) -> int:
        return self.tokens.numel() - self.block_size

    def __getitem__(self, start: int) -> tuple[Tensor, Tensor]:
        window = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


def _stable_seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big") >> 1


class RandomWindowSampler(Sampler[int]):
    """Resumable sampler of random window starts inside one rank's shard.

    Epoch e draws ``num_samples`` starts uniformly in [low, high] from a generator seeded by
    (seed, rank, e), so each rank's sequence is reproducible and independent of the others.
    Finishing an iteration advances to the next epoch; ``set_epoch`` (called by Lightning) moves
    to another epoch from its start. ``state_dict`` records the epoch and how many samples it
    has handed out, so a restored sampler continues exactly where this one stopped.

    Args:
        low: smallest window start.
        high: largest window start (inclusive).
        num_samples: samples per epoch.
        seed: base seed shared by all ranks.
        rank: this worker's rank, mixed into the seed.
    """

    def __init__(self, *, low: int, high: int, num_samples: int, seed: int, rank: int) -> None:
        if high < low:
            raise ValueError(f"high ({high}) must be >= low ({low})")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.low, self.high, self.num_samples, self.seed, self.rank = low, high, num_samples, seed, rank
        self._epoch = 0
        self._position = 0

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(_stable_seed(self.seed, self.rank, self._epoch))
        starts = torch.randint(self.low, self.high + 1, (self.num_samples,), generator=generator)
        while self._position < self.num_samples:
            # Count before yielding: once a consumer holds the sample, it is recorded as handed out.
            self._position += 1
            yield int(starts[self._position - 1])
        self._epoch, self._position = self._epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch``; a no-op if already there, so a restored position survives."""
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "samples_done": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._position = int(state["epoch"]), int(state["samples_done"])
        if self._position >= self.num_samples:  # saved at the very end of an epoch
            self._epoch, self._position = self._epoch + 1, 0


# ----------------------------------------------------------------------------------------------
# The DataModule


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        or_none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {minimum}{or_none}, got {value!r}")


class ByteDataModule(pl.LightningDataModule):
    """Byte-level LM data, sharded by rank by the module itself.

    Train: rank r of W draws windows of ``block_size + 1`` bytes at random offsets inside the
    r-th contiguous 1/W of the train stream; an epoch is ``samples_per_epoch`` windows per rank
    (by default one pass worth of the smallest shard), the same on every rank so all workers
    take the same number of steps. Validation and test: fixed, non-overlapping windows spread
    evenly over the validation stream, exactly the same number of full batches on every rank.

    Resume: ``state_dict``/``load_state_dict`` (saved in Lightning checkpoints automatically)
    hold the epoch and the number of training samples used. Under a Trainer that count is of
    batches that reached the training step (DataLoader workers fetch ahead), otherwise of
    samples the sampler handed out. Every rank resumes from the same (epoch, samples) with its
    own rank-keyed generator, so rank 0's saved state is right for all ranks. Lightning's
    "dataloader is not resumable" warning on a mid-epoch resume does not apply here. The count
    comes from this module's ``on_before_batch_transfer``; if the LightningModule overrides
    that hook too, Lightning runs only this one (and warns).

    Args:
        source: "stdlib" (the standard library's source), a path to a text file or folder,
            or "hf:<dataset name>" (needs the optional ``datasets`` package; its text column is
            read into memory once, to build the cache).
        block_size: tokens per training example (T).
        batch_size: examples per batch on each worker (B).
        val_fraction: share of documents (of bytes, for a single file) held out, in (0, 1).
        val_batches: cap on validation batches per rank; None uses all of them.
        cache_dir: where tokenized splits are cached; None means ~/.cache/gasloc-lightning.
        seed: seed of the training sampler, shared by all ranks.
        num_workers: DataLoader worker processes.
        samples_per_epoch: training windows per rank per epoch, a multiple of ``batch_size``;
            None derives it from the smallest shard's length.
        hf_split: split of the Hugging Face dataset to read.
        hf_text_field: column holding the text in the Hugging Face dataset.
        rank: override the rank (tests, custom launchers); None reads ``trainer.global_rank``.
        world_size: override the world size; None reads ``trainer.world_size``.
    """

    def __init__(
        self,
        *,
        source: str | os.PathLike = "stdlib",
        block_size: int = 256,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        val_batches: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        seed: int = 0,
        num_workers: int = 0,
        samples_per_epoch: int | None = None,
        hf_split: str = "train",
        hf_text_field: str = "text",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        _check_int("block_size", block_size, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("val_batches", val_batches, 1, allow_none=True)
        _check_int("seed", seed, 0)
        _check_int("num_workers", num_workers, 0)
        _check_int("samples_per_epoch", samples_per_epoch, 1, allow_none=True)
        _check_int("world_size", world_size, 1, allow_none=True)
        _check_int("rank", rank, 0, allow_none=True)
        if samples_per_epoch is not None and samples_per_epoch % batch_size != 0:
            raise ValueError(
                f"samples_per_epoch must be a multiple of batch_size ({batch_size}), got {samples_per_epoch}"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        if (rank is None) != (world_size is None):
            raise ValueError(
                f"rank and world_size must be given together, got rank={rank}, world_size={world_size}"
            )
        if rank is not None and rank >= world_size:
            raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
        # Plain strings, so checkpoints holding these hyperparameters load with weights_only=True.
        self.save_hyperparameters(
            {
                "source": os.fspath(source),
                "block_size": block_size,
                "batch_size": batch_size,
                "val_fraction": val_fraction,
                "val_batches": val_batches,
                "cache_dir": None if cache_dir is None else os.fspath(cache_dir),
                "seed": seed,
                "num_workers": num_workers,
                "samples_per_epoch": samples_per_epoch,
                "hf_split": hf_split,
                "hf_text_field": hf_text_field,
            }
        )
        self._source = _parse_source(source, hf_split, hf_text_field)
        self.block_size, self.batch_size, self.val_fraction = block_size, batch_size, val_fraction
        self.val_batches, self.seed, self.num_workers = val_batches, seed, num_workers
        self.cache_dir = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
        self._samples_per_epoch = samples_per_epoch
        self._rank_override, self._world_size_override = rank, world_size
        self._plan: _Plan | None = None
        self._tokens: dict[str, Tensor] = {}
        self._train_sampler: RandomWindowSampler | None = None
        self._resume_state: dict[str, int] | None = None
        self._consumed: tuple[int, int] | None = None  # (epoch, samples) reached the training step
        self.built_cache = False  # whether this instance wrote the cache

    # --- identity of the data ---------------------------------------------------------------

    @property
    def fingerprint(self) -> dict[str, Any]:
        """Python version (for "stdlib"), source kind, split and SHA-256 of the content."""
        return dict(self._get_plan().fingerprint)

    @property
    def cache_path(self) -> Path:
        """Folder holding ``train.u8``, ``val.u8`` and ``fingerprint.json``."""
        plan = self._get_plan()
        return self.cache_dir / f"{plan.fingerprint['source']}-{plan.key}"

    def documents(self, split: str) -> list[str]:
        """Names of the documents (relative paths, or record indices) in ``split``."""
        _check_split(split)
        return [piece.key for piece in self._get_plan().splits[split]]

    @property
    def rank(self) -> int:
        return self._rank_and_world_size()[0]

    @property
    def world_size(self) -> int:
        return self._rank_and_world_size()[1]

    def _rank_and_world_size(self) -> tuple[int, int]:
        if self._rank_override is not None:
            return self._rank_override, self._world_size_override
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def _get_plan(self) -> _Plan:
        if self._plan is None:
            self._plan = _make_plan(self._source, self.val_fraction)
        return self._plan

    # --- Lightning hooks --------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Builds the cache if missing (Lightning calls this on one process per node)."""
        self.built_cache = _ensure_cache(self.cache_path, self._get_plan()) or self.built_cache

    def setup(self, stage: str | None = None) -> None:
        """Checks the Trainer's settings, then maps both splits (building them if needed)."""
        self._check_trainer()
        for split in _SPLITS:
            self._split_tokens(split)
        self._train_shard()  # raises now, before training, if a shard is too small
        self._eval_window_starts(self.val_batches)

    def _check_trainer(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return
        if trainer._accelerator_connector.use_distributed_sampler:
            raise ValueError(
                "ByteDataModule shards the data by rank itself, so Lightning must not add a "
                "DistributedSampler: pass Trainer(use_distributed_sampler=False)"
            )

    def _split_path(self, split: str) -> Path:
        self._split_tokens(split)  # builds the cache if needed
        return self.cache_path / f"{split}.u8"

    def _split_tokens(self, split: str) -> Tensor:
        if split not in self._tokens:
            self.prepare_data()  # every rank checks: cheap when built, safe when racing
            self._tokens[split] = _memory_map(self.cache_path / f"{split}.u8")
        return self._tokens[split]

    def train_dataloader(self) -> DataLoader:
        low, high = self._train_shard()
        # A reloaded dataloader continues where the last one stopped; the first one from a resume.
        previous = self._train_sampler.state_dict() if self._train_sampler is not None else self._resume_state
        self._train_sampler = RandomWindowSampler(
            low=low, high=high, num_samples=self.samples_per_epoch, seed=self.seed, rank=self.rank
        )
        if previous is not None:
            self._train_sampler.load_state_dict(previous)
        dataset = _Windows(self._split_path("train"), self.block_size)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            drop_last=True,
            num_workers=self.num_workers,
            generator=self._loader_generator(),
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader(self.val_batches)

    def test_dataloader(self) -> DataLoader:
        """The validation split without the ``val_batches`` cap."""
        return self._eval_dataloader(None)

    def _eval_dataloader(self, cap: int | None) -> DataLoader:
        dataset = _Windows(self._split_path("val"), self.block_size)
        starts = self._eval_window_starts(cap)
        return DataLoader(
            dataset, batch_size=self.batch_size, sampler=starts, num_workers=self.num_workers,
            generator=self._loader_generator(),
        )

    def _loader_generator(self) -> torch.Generator:
        # A DataLoader without a generator draws its worker base seed from torch's global RNG at every
        # iter(): a resumed run would then draw once more than the uninterrupted one and diverge.
        return torch.Generator().manual_seed(_stable_seed(self.seed, self.rank, 7))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this when a batch is about to be trained on, whereas DataLoader workers
        # (and Lightning, for unsized loaders) fetch ahead of training; counting here makes the
        # saved position exact.
        trainer = self.trainer
        if trainer is not None and trainer.training:
            epoch = trainer.current_epoch
            if self._consumed is None or self._consumed[0] != epoch:
                self._consumed = (epoch, self._resumed_position(epoch))
            self._consumed = (epoch, self._consumed[1] + len(batch[0]))
        return batch

    def _resumed_position(self, epoch: int) -> int:
        state = self._resume_state
        return state["samples_done"] if state is not None and state["epoch"] == epoch else 0

    def state_dict(self) -> dict[str, int]:
        """Position of the training stream: epoch and samples used in it, per rank."""
        if self._consumed is not None:
            epoch, samples_done = self._consumed
        else:
            sampler = self._train_sampler
            position = sampler.state_dict() if sampler is not None else self._resume_state
            position = position or {"epoch": 0, "samples_done": 0}
            epoch, samples_done = position["epoch"], position["samples_done"]
        return {
            "epoch": epoch,
            "samples_done": samples_done,
            "world_size": self.world_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resumes the training stream at the saved position (before or after setup)."""
        saved_world_size, saved_seed = state_dict.get("world_size"), state_dict.get("seed")
        if (saved_world_size, saved_seed) != (self.world_size, self.seed):
            log.warning(
                "resuming the data position of another setup saved_world_size=%s world_size=%d "
                "saved_seed=%s seed=%d",
                saved_world_size, self.world_size, saved_seed, self.seed,
            )
        self._resume_state = {
            "epoch": int(state_dict["epoch"]),
            "samples_done": int(state_dict["samples_done"]),
        }
        self._consumed = None
        if self._train_sampler is not None:
            self._train_sampler.load_state_dict(self._resume_state)

    # --- sizes and statistics ---------------------------------------------------------------

    def _train_shard(self) -> tuple[int, int]:
        """(lowest, highest) window start of this rank's contiguous slice of the train stream."""
        rank, world_size = self._rank_and_world_size()
        total = self._split_tokens("train").numel()
        if total // world_size < self.block_size + 1:
            raise ValueError(
                f"the train split has {total} bytes: too few for world_size={world_size} shards of at "
                f"least block_size + 1 = {self.block_size + 1} bytes"
            )
        begin, end = rank * total // world_size, (rank + 1) * total // world_size
        return begin, end - (self.block_size + 1)

    @property
    def samples_per_epoch(self) -> int:
        """Training windows per rank per epoch (a multiple of batch_size by default)."""
        if self._samples_per_epoch is not None:
            return self._samples_per_epoch
        # The smallest shard sets it, so every rank takes the same number of steps.
        smallest_shard = self._split_tokens("train").numel() // self.world_size
        return max(1, smallest_shard // self.block_size // self.batch_size) * self.batch_size

    def _eval_window_starts(self, cap: int | None) -> list[int]:
        rank, world_size = self._rank_and_world_size()
        windows = (self._split_tokens("val").numel() - 1) // self.block_size
        batches = windows // self.batch_size
        per_rank = batches // world_size if cap is None else min(cap, batches // world_size)
        if per_rank == 0:
            raise ValueError(
                f"the validation split has {windows} windows of block_size={self.block_size}: too few "
                f"for one batch of batch_size={self.batch_size} on each of world_size={world_size} ranks; "
                "raise val_fraction or lower batch_size/block_size"
            )
        # Spread the chosen batches evenly over the stream; rank r takes the r-th group of them.
        needed = per_rank * world_size
        chosen = [k * batches // needed for k in range(rank * per_rank, (rank + 1) * per_rank)]
        return [(b * self.batch_size + i) * self.block_size for b in chosen for i in range(self.batch_size)]

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy (nats per byte) of ``split``'s byte histogram, over the whole split.

        Args:
            split: "train" or "val".
        """
        _check_split(split)
        return byte_unigram_entropy(self._split_tokens(split))

    def tokens_per_step(self, world_size: int | None = None) -> int:
        """Tokens consumed per optimizer step over all workers: B x T x world_size.

        Args:
            world_size: number of workers; None uses this module's world size.
        """
        _check_int("world_size", world_size, 1, allow_none=True)
        return self.batch_size * self.block_size * (world_size or self.world_size)


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
