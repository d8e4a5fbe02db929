"""Each replica's own data shard, drawn exactly as the multi-process run draws it.

The samplers and windows come from :class:`~gasloc_lightning.data.ByteDataModule` built with
``rank=r, world_size=n`` for every worker r: the same shard, the same seeded
``RandomWindowSampler`` (epoch after epoch, as Lightning iterates it), and the same validation
windows. Batches are gathered from the memory-mapped byte stream for all computing workers at once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from gasloc_lightning.data import ByteDataModule


class ShardedBatches:
    """(m, B, T) training batches, row k from the shard of the k-th computing worker; and the validation windows.

    A worker's sampler advances only when it computes (a down worker's data stream stands still), and a
    worker that comes back as a fresh process (:meth:`restart`) starts its shard's sampler afresh, as an
    elastic worker's new incarnation does.

    Args:
        make_datamodule: builds the data module of one rank, ``make_datamodule(rank, world_size)``.
        workers: n.
        shared_validation: validate on the windows of a single-worker run (``make_datamodule(0, 1)``), as
            ``gasloc-elastic`` validates every worker; False: the union of every worker's validation windows
            (what the strategies' consensus evaluation sees).
        device: where the batches go (the token stream stays in host memory).
    """

    def __init__(self, make_datamodule: Callable[[int, int], ByteDataModule], workers: int, *,
                 shared_validation: bool = False, device: torch.device | str = "cpu") -> None:
        self.workers = workers
        self.device = torch.device(device)
        self._samplers, self._iterators = [], []
        val_starts: list[int] = []
        for rank in range(workers):
            datamodule = make_datamodule(rank, workers)
            datamodule.setup("fit")
            train = datamodule.train_dataloader()
            self._samplers.append(train.sampler)
            self._iterators.append(iter(train.sampler))
            val_starts += list(datamodule.val_dataloader().sampler)
        self._fresh = [copy.deepcopy(sampler) for sampler in self._samplers]  # as a new process builds it
        if shared_validation:
            datamodule = make_datamodule(0, 1)
            datamodule.setup("fit")
            val_starts = list(datamodule.val_dataloader().sampler)
        self.batch_size = train.batch_size
        self.block_size = train.dataset.block_size
        self._train_tokens = train.dataset.tokens
        self._val_tokens = datamodule.val_dataloader().dataset.tokens
        self._val_starts = torch.tensor(val_starts)
        self._offsets = torch.arange(self.block_size + 1)

    def _next_start(self, rank: int) -> int:
        try:
            return next(self._iterators[rank])
        except StopIteration:  # a new epoch: the sampler moved on by itself, as under Lightning
            self._iterators[rank] = iter(self._samplers[rank])
            return next(self._iterators[rank])

    def next_batch(self, rows: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """The next (x, y) of the workers in ``rows`` (default all): (m, B, T) long tensors; only their samplers
        advance."""
        rows = range(self.workers) if rows is None else rows
        starts = torch.tensor([[self._next_start(r) for _ in range(self.batch_size)] for r in rows])
        return self._windows(self._train_tokens, starts)

    def restart(self, rank: int) -> None:
        """Worker ``rank`` comes back as a fresh process: its sampler starts again from the beginning."""
        self._samplers[rank] = copy.deepcopy(self._fresh[rank])
        self._iterators[rank] = iter(self._samplers[rank])

    def _windows(self, tokens: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        window = tokens[starts.unsqueeze(-1) + self._offsets].long().to(self.device)  # (..., T + 1)
        return window[..., :-1], window[..., 1:]

    def validation_batches(self, sequences: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Every worker's validation windows, ``sequences`` at a time: (S, T) ids and targets."""
        for begin in range(0, len(self._val_starts), sequences):
            yield self._windows(self._val_tokens, self._val_starts[begin: begin + sequences])

    @property
    def validation_tokens(self) -> int:
        return len(self._val_starts) * self.block_size
