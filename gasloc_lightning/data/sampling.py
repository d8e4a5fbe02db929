"""Windows of block_size + 1 bytes, and the seeded sampler of random training offsets in a rank's shard."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from gasloc_lightning.data.cache import _memory_map

log = logging.getLogger(__name__)


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


