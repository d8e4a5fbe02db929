"""State dicts of a sharded worker (``intra_worker="fsdp"``): each rank's own shards as plain tensors.

FSDP2 parameters and the optimizer state built on them are ``DTensor``s, which hold a device mesh and
cannot be written to a per-rank file that loads with ``weights_only=True``. A rank therefore saves the
local shard of each (:func:`local_module_state`, :func:`local_optimizer_state`), with the names of the
sharded entries, and loads them back into its own shards (:func:`load_local_module_state`,
:func:`sharded_optimizer_state`). FSDP2 shards dim 0 as ``torch.chunk`` does, so concatenating the k
local shards of an entry in shard order gives the whole tensor (what ``gasloc-export`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from gasloc_lightning.comm.flat import local_tensor

SHARDED_KEYS = "sharded_keys"  # the optimizer state entries that were DTensors, as (param index, key)


def local_module_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A module state dict with each DTensor replaced by this rank's shard; and the names of those entries."""
    local, sharded = {}, []
    for name, value in state.items():
        if isinstance(value, DTensor):
            sharded.append(name)
            value = value.to_local().detach().clone()
        local[name] = value
    return local, sharded


@torch.no_grad()
def load_local_module_state(module: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Copy saved local shards (and whole buffers) into ``module``'s own; the names must match when ``strict``."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise RuntimeError(f"the sharded checkpoint does not match the module: missing {missing}, "
                           f"unexpected {unexpected}")
    for name, value in state.items():
        if name not in own:
            continue
        target = local_tensor(own[name])
        if target.shape != value.shape:
            raise RuntimeError(f"{name}: the checkpoint holds a shard of shape {tuple(value.shape)}, this rank's is "
                               f"{tuple(target.shape)} (resume with the same ranks_per_worker and world size)")
        target.copy_(value)
    for submodule in module.modules():  # a module that kept its parameters gathered must gather the new shards
        if isinstance(submodule, FSDPModule):  # FSDP2's reshard, not any method of that name
            submodule.reshard()


def local_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each DTensor replaced by this rank's shard, the sharded entries named."""
    state = optimizer.state_dict()
    # state_dict() packs the optimizer's own per-parameter dicts: replacing entries in them would put plain
    # copies in place of the live DTensor state (the next step would then mix DTensors and plain tensors)
    state["state"] = {index: dict(entries) for index, entries in state["state"].items()}
    sharded = []
    for index, entries in state["state"].items():
        for key, value in list(entries.items()):
            if isinstance(value, DTensor):
                entries[key] = value.to_local().detach().clone()
                sharded.append([int(index), key])
    return {**state, SHARDED_KEYS: sharded}


def sharded_optimizer_state(optimizer: Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`local_optimizer_state` for ``optimizer``: saved shards become DTensors laid out
    as the parameters they belong to (ready for ``optimizer.load_state_dict``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    restored = {key: value for key, value in state.items() if key != SHARDED_KEYS}
    restored["state"] = {index: dict(entries) for index, entries in state["state"].items()}
    for index, key in state.get(SHARDED_KEYS, []):
        param = params[index]
        value = restored["state"][index][key]
        restored["state"][index][key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                            run_check=False, shape=param.shape,
                                                            stride=param.stride())
    return restored


def full_module_state(module: nn.Module) -> dict[str, Any]:
    """The module's whole state dict, each DTensor gathered (a collective inside the worker)."""
    return {name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in module.state_dict().items()}


def check_sharded_module(module: nn.Module, shards: DeviceMesh) -> None:
    """Refuse a module a sharded worker cannot train as one replica: every trainable parameter must be a DTensor
    sharded on dim 0 over exactly the worker's ranks (``shards``, the mesh's ``shards`` dimension).

    A trainable parameter FSDP2 does not manage gets no gradient reduction inside the worker (each rank would train
    its own copy); one sharded over the whole ``(workers, shards)`` mesh (HSDP) or over ``workers`` would all-reduce
    gradients across workers at every step; a dim other than 0 would be put together wrongly by ``gasloc-export``.
    """
    ranks = shards.mesh.flatten().tolist()
    plain, elsewhere = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if not isinstance(param, DTensor):
            plain.append(name)
        elif param.device_mesh.mesh.flatten().tolist() != ranks or tuple(param.placements) != (Shard(0),):
            elsewhere.append(f"{name} ({tuple(param.placements)} over ranks {param.device_mesh.mesh.tolist()})")
    if plain and len(plain) == sum(1 for p in module.parameters() if p.requires_grad):
        raise TypeError(
            "intra_worker='fsdp': the LightningModule has no sharded parameter. Shard it in configure_model, e.g. "
            "fully_shard(block, mesh=self.device_mesh['shards']) for each block and then for the whole network "
            "(see gasloc_lightning.models.sharding.shard_by_block), or use intra_worker='ddp'"
        )
    if plain:
        raise TypeError(
            f"intra_worker='fsdp': trainable parameters {plain[:5]}{' ...' if len(plain) > 5 else ''} are not sharded, "
            "so the ranks of a worker would train separate copies of them: fully_shard the whole network last (its "
            "root takes every parameter left), or freeze them"
        )
    if elsewhere:
        raise ValueError(
            f"intra_worker='fsdp': parameters {elsewhere[:3]}{' ...' if len(elsewhere) > 3 else ''} are not sharded "
            f"on dim 0 over this worker's ranks {ranks}: shard with fully_shard(..., mesh=self.device_mesh['shards']) "
            "(the whole (workers, shards) mesh would all-reduce gradients across workers at every step)"
        )
