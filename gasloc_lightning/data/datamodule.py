"""ByteDataModule: each rank trains on its own contiguous shard of one byte stream."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

from gasloc_lightning.data.sources import DEFAULT_CACHE_DIR, _SPLITS, _parse_source, _Plan, _make_plan
from gasloc_lightning.data.cache import _ensure_cache, _memory_map, byte_unigram_entropy
from gasloc_lightning.data.sampling import _Windows, RandomWindowSampler, _stable_seed

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
            "hf:<dataset name>" (a hub dataset), or "hf:<builder>:<local files>" with builder
            json, csv, text, parquet or arrow (e.g. "hf:json:/data/docs.jsonl", a glob allowed;
            read offline by ``datasets``' packaged builder, one record = one document). Both
            need the optional ``datasets`` package; the text column is read into memory once,
            to build the cache.
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
