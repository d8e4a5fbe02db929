"""Workers made of several ranks: DDP or FSDP inside a worker, gossip between workers.

With ``ranks_per_worker = k``, ranks ``[w k, (w + 1) k)`` form worker w.

- ``intra_worker="ddp"``: the k ranks train as one DDP replica (gradient all-reduce in the worker's own
  process group); the worker's first rank (its leader) exchanges for the worker and broadcasts the result.
- ``intra_worker="fsdp"``: the k ranks shard the worker's replica with FSDP2 over a 2-D device mesh
  ``(workers, shards)``. Rank ``w k + r`` holds shard r; it exchanges that shard with shard r of its peer
  workers (the mesh's ``workers`` dimension: ranks ``r, k + r, 2 k + r, ...``), every r at once, so there is
  no leader, no gather and no broadcast, and each rank sends 1/k of the model.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gasloc_lightning.strategies.schedule import check_positive_int

IntraWorker = Literal["ddp", "fsdp"]
MESH_DIMS = ("workers", "shards")


class WorkerGroups:
    """The worker of each rank, and the process groups inside and across workers.

    Args:
        ranks_per_worker: k, ranks per worker (1: every rank is a worker).
        intra_worker: ``"ddp"`` (every rank holds the whole replica) or ``"fsdp"`` (the ranks shard it).
    """

    def __init__(self, ranks_per_worker: int = 1, intra_worker: IntraWorker = "ddp") -> None:
        check_positive_int("ranks_per_worker", ranks_per_worker)
        if intra_worker not in ("ddp", "fsdp"):
            raise ValueError(f"intra_worker must be 'ddp' or 'fsdp', got {intra_worker!r}")
        if intra_worker == "fsdp" and ranks_per_worker == 1:
            raise ValueError("intra_worker='fsdp' shards a worker over its ranks: set ranks_per_worker > 1 "
                             "(or leave intra_worker='ddp')")
        self.ranks_per_worker = ranks_per_worker
        self.intra_worker = intra_worker
        self.group: dist.ProcessGroup | None = None  # inside this rank's worker
        self.mesh: DeviceMesh | None = None  # (workers, shards), sharded workers only

    @property
    def sharded(self) -> bool:
        return self.intra_worker == "fsdp"

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

    def shard_of(self, rank: int) -> int:
        """The shard ``rank`` holds of its worker's replica (0 when workers are not sharded)."""
        return rank % self.ranks_per_worker if self.sharded else 0

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` exchanges for its worker (the worker's first rank)."""
        return rank % self.ranks_per_worker == 0

    def exchanges(self, rank: int) -> bool:
        """Whether ``rank`` takes part in the exchange between workers: every rank of a sharded worker (its own
        shard), the leader of an unsharded one."""
        return self.sharded or self.is_leader(rank)

    def peer_rank(self, worker: int, rank: int) -> int:
        """The global rank this rank exchanges with in ``worker``: the same shard of that worker."""
        return worker * self.ranks_per_worker + self.shard_of(rank)

    def create_mesh(self, world_size: int, device_type: str) -> DeviceMesh:
        """The 2-D mesh ``(workers, shards)`` of a sharded run (a collective: every rank, same order)."""
        self.mesh = init_device_mesh(device_type, (self.num_workers(world_size), self.ranks_per_worker),
                                     mesh_dim_names=MESH_DIMS)
        self.group = self.mesh["shards"].get_group()
        return self.mesh

    @property
    def shard_peers_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shard in every worker (the exchange's group); None: the world."""
        return self.mesh["workers"].get_group() if self.mesh is not None else None

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
        """Copy the worker leader's tensors to the other ranks of its worker (no-op with one rank per worker, and
        in a sharded worker, where every rank exchanged its own shard)."""
        if self.group is None or self.sharded:
            return
        leader = self.worker_of(rank) * self.ranks_per_worker
        for tensor in tensors:
            dist.broadcast(tensor, src=leader, group=self.group)

    def all_agree(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on every rank of this worker (a collective inside a sharded worker)."""
        if not self.sharded or self.group is None:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())
