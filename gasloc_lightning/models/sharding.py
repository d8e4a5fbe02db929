"""Sharding a network by block with FSDP2, as a LightningModule does in ``configure_model``.

The strategy owns the device mesh (Lightning's ``ModelParallelStrategy`` convention); a sharded GASLoC
worker's mesh is 2-D, ``(workers, shards)``, and the module shards over its ``shards`` dimension only:
sharding over both would make FSDP2 all-reduce gradients across workers (HSDP), which local steps forbid.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh dimension a module shards over: ``shards`` of a GASLoC ``(workers, shards)`` mesh,
    ``data_parallel`` of Lightning's ``ModelParallelStrategy`` mesh, else the whole mesh."""
    names = mesh.mesh_dim_names or ()
    for name in ("shards", "data_parallel"):
        if name in names:
            return mesh[name]
    return mesh


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` already holds sharded (``DTensor``) parameters (``configure_model`` may run twice)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def shard_by_block(network: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each block, then the network (its remaining parameters: embeddings, final norm, head).

    Args:
        network: the module to shard in place.
        blocks: its repeated blocks (transformer layers), each gathered on its own in forward and backward.
        mesh: the device mesh of the strategy (a ``(workers, shards)`` mesh shards over ``shards``).
    """
    mesh = shard_mesh(mesh)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(network, mesh=mesh)
    return network
