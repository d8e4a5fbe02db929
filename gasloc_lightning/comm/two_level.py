"""The two-level round's transport on a process group: region means on subgroups, shard-parallel crossings.

:class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound` holds the arithmetic; this module moves its
tensors between ranks (one rank is one worker):

- **region mean**: an all-reduce over the region's ranks only (a ``new_group`` per region, over its fast
  links);
- **cross gossip**: after a region step every member of region A holds the same u_A, so rank l sends only
  the l-th of m shards to rank l of each paired region (``TwoLevelTopology.cross_peers``: the lifted region
  mixing), mixes that shard, and the region all-gathers the mixed shards. Each rank carries 1/m of the model
  across, and m flows share the slow link. Regions must have equal sizes here (the shards line up);
- **cross mean** (hierarchical DiLoCo): an all-reduce over every rank.

Every rank of the world creates every region's group, in region order, because ``new_group`` is a
collective of the whole world. Bytes are counted per level, where they are sent (all-reduce and all-gather:
the ring algorithm's volume).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.topology.regions import Regions


class RegionTransport:
    """The process groups and wire of the two-level round for this rank.

    Args:
        regions: every rank's region (equal sizes).
        rank: this rank in the default process group.
    """

    def __init__(self, regions: Regions, rank: int) -> None:
        if len(set(regions.sizes)) != 1:
            raise ValueError(f"the multi-process two-level round needs regions of equal sizes (rank l pairs with rank "
                             f"l), got sizes {list(regions.sizes)}")
        if dist.get_world_size() != regions.world_size:
            raise ValueError(f"regions cover {regions.world_size} ranks, the process group has {dist.get_world_size()}")
        self.regions, self.rank = regions, rank
        groups = [dist.new_group(list(members)) for members in regions.members]  # every rank, every region, in order
        self.region = regions.region_of(rank)
        self.group = groups[self.region]
        self.size = regions.sizes[0]
        self.local_index = regions.local_index(rank)
        self.bytes_region = 0
        self.bytes_cross = 0

    @torch.no_grad()
    def region_mean_(self, tensor: Tensor) -> Tensor:
        """In place: the mean of ``tensor`` over this rank's region."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            tensor.div_(self.size)
            self.bytes_region += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        return tensor

    @torch.no_grad()
    def world_mean_(self, tensor: Tensor) -> Tensor:
        """In place: the mean of ``tensor`` over every rank (hierarchical DiLoCo's crossing)."""
        world = self.regions.world_size
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(world)
        self.bytes_cross += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), world)
        return tensor

    @torch.no_grad()
    def cross_mix(self, message: Tensor, destination: Tensor, peers: Mapping[int, float]) -> Tensor:
        """``destination = u + sum_j w_j (u_j - u)`` with the peers' messages, carried shard by shard.

        Args:
            message: u_A, this rank's region point to send (identical on every member of the region).
            destination: receives the mixed point (may not alias ``message``).
            peers: ``{rank: weight}`` across regions (every member of a region has peers in the same regions).
        """
        if not peers:
            return destination.copy_(message)
        numel = message.numel()
        chunk = math.ceil(numel / self.size)
        padded = torch.zeros(chunk * self.size, dtype=message.dtype, device=message.device)
        padded[:numel].copy_(message)
        shards = padded.view(self.size, chunk)  # (m, chunk)
        own = shards[self.local_index]
        received = {j: torch.empty_like(own) for j in sorted(peers)}
        operations = [dist.P2POp(dist.irecv, received[j], j) for j in sorted(peers)]  # receives first (see transport)
        operations += [dist.P2POp(dist.isend, own, j) for j in sorted(peers)]
        for work in dist.batch_isend_irecv(operations):
            work.wait()
        mixed = own.clone()
        for j in sorted(peers):
            mixed.add_(received[j] - own, alpha=peers[j])
        self.bytes_cross += len(peers) * min(chunk, numel) * message.element_size()
        if self.size > 1:  # every member mixed its own shard: gather them (m - 1 shards in, as a ring all-gather)
            dist.all_gather(list(shards.unbind(0)), mixed, group=self.group)
            self.bytes_cross += (self.size - 1) * chunk * message.element_size()
        else:
            shards[0].copy_(mixed)
        return destination.copy_(padded[:numel])

    def level_bytes(self) -> dict[str, float]:
        """Bytes this rank sent at each level, so far."""
        return {"comm/bytes_region": float(self.bytes_region), "comm/bytes_cross": float(self.bytes_cross)}
