"""Workers made of several ranks: DDP inside a worker, gossip between workers.

With ``ranks_per_worker = k``, ranks ``[w k, (w + 1) k)`` form worker w. They train as one DDP
replica (gradient all-reduce in the worker's own process group); the worker's first rank (its
leader) exchanges for the worker and broadcasts the result to the others.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.strategies.schedule import check_positive_int


class WorkerGroups:
    """The worker of each rank, and the process group inside it.

    Args:
        ranks_per_worker: k, ranks per worker (1: every rank is a worker).
    """

    def __init__(self, ranks_per_worker: int = 1) -> None:
        check_positive_int("ranks_per_worker", ranks_per_worker)
        self.ranks_per_worker = ranks_per_worker
        self.group: dist.ProcessGroup | None = None

    def check_world_size(self, world_size: int) -> None:
        if world_size % self.ranks_per_worker:
            raise ValueError(
                f"{world_size} ranks are not divisible by ranks_per_worker={self.ranks_per_worker}: every worker "
                "needs the same number of ranks"
            )

    def num_workers(self, world_size: int) -> int:
        return world_size // self.ranks_per_worker

    def worker_of(self, rank: int) -> int:
        return rank // self.ranks_per_worker

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` exchanges for its worker (the worker's first rank)."""
        return rank % self.ranks_per_worker == 0

    def create(self, world_size: int, rank: int) -> dist.ProcessGroup | None:
        """Create every worker's process group (a collective: all ranks, same order); returns this rank's."""
        if self.ranks_per_worker == 1:
            return None
        k = self.ranks_per_worker
        for worker in range(world_size // k):
            group = dist.new_group(list(range(worker * k, (worker + 1) * k)))
            if worker == self.worker_of(rank):
                self.group = group
        return self.group

    def broadcast(self, rank: int, *tensors: Tensor) -> None:
        """Copy the worker leader's tensors to the other ranks of its worker (no-op with one rank per worker)."""
        if self.group is None:
            return
        leader = self.worker_of(rank) * self.ranks_per_worker
        for tensor in tensors:
            dist.broadcast(tensor, src=leader, group=self.group)
