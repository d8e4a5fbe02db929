"""The two-level round's transport on a process group: region means on subgroups, shard-parallel crossings.

:class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound` holds the arithmetic; this module moves its
tensors between ranks (one rank is one worker):

- **region mean**: an all-reduce over the region's ranks only (a ``new_group`` per region, over its fast
  links);
- **cross gossip**: after a region step every member of region A holds the same u_A, so rank l sends only
  the l-th of m shards to rank l of each paired region (``TwoLevelTopology.cross_peers``: the lifted region
  mixing), mixes that shard, and the region all-gathers the mixed shards. Each rank carries 1/m of the model
  across, and m flows share the slow link. Regions must have equal sizes here (the shards line up);
- **cross mean** (hierarchical DiLoCo): an all-reduce over every rank; with a lossy codec, rank l averages the l-th
  shard of its region's change since the last mean with rank l of every other region by DiLoCo's quantized
  all-reduce (:class:`~gasloc_lightning.comm.encoded_mean.EncodedAllReduce`, on a group per local index), then the
  region all-gathers the shards (blocking).

The delayed crossing posts the cross traffic (:meth:`RegionTransport.post_cross`) and lands it at the next
crossing (:meth:`RegionTransport.land_cross`): the shard exchange, or the world all-reduce, then travels under
the K region rounds. It runs on a process group of its own, so that nothing posted on the default group in
between (Lightning's broadcasts, the region means' subgroups are separate already) can be matched against it.

Every rank of the world creates every region's group, in region order, because ``new_group`` is a
collective of the whole world. Bytes are counted per level, where they are sent (all-reduce and all-gather:
the ring algorithm's volume).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.algorithm.codecs import build_codec
from gasloc_lightning.algorithm.outer import all_finite
from gasloc_lightning.comm.encoded_mean import EncodedAllReduce, dedicated_group
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.topology.regions import Regions


@dataclass
class PendingCross:
    """A cross exchange posted by :meth:`RegionTransport.post_cross`, to be landed by its ``land_cross``."""

    padded: Tensor  # the message, padded to m equal shards (the world mean's sum, or the mean itself, when ``mean``)
    numel: int
    peers: Mapping[int, float] = field(default_factory=dict)
    received: dict[int, Tensor] = field(default_factory=dict)  # the peers' shards, or their wires with a codec
    works: list[Any] = field(default_factory=list)
    mean: bool = False
    own_decoded: Tensor | None = None  # with a codec: this rank's shard as its peers decode it
    own: Tensor | None = None  # the world mean's own message, kept if the mean is not finite
    divisor: int = 1  # the world mean's: what ``padded`` is divided by when it lands
    reference: Tensor | None = None  # the quantized mean's shared reference, moved to the mean if it is accepted


class RegionTransport:
    """The process groups and wire of the two-level round for this rank.

    Args:
        regions: every rank's region (equal sizes).
        rank: this rank in the default process group.
        delayed: the delayed crossing: a process group of its own for the cross traffic in flight.
        timeout: seconds a collective of that group may take.
        codec: how each shard crosses (a lossy codec: the decoded shards are mixed, this rank's own rounding
            residual kept, or for the world mean the shards' changes averaged by a quantized all-reduce, as
            :class:`~gasloc_lightning.sim.two_level.TwoLevelRounds` computes).
        cross_mean: the crossing is the world mean (hierarchical DiLoCo): with a lossy codec, a process group per
            local index (rank l of every region) carries it.
    """

    def __init__(self, regions: Regions, rank: int, *, delayed: bool = False, timeout: float = 600.0,
                 codec: str = "float32", cross_mean: bool = False) -> None:
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
        self._codec_name = codec
        self._codec = None if codec == "float32" else build_codec(codec)
        self._column = None  # rank l of every region: the quantized world mean's group
        if cross_mean and self._codec is not None:
            if delayed:
                raise ValueError(f"codec={codec!r} with the delayed crossing and the world mean (hierarchical DiLoCo): "
                                 "its quantized mean is blocking here; gasloc-sim runs the delayed form, or use "
                                 "cross_overlap=false here")
            limit = timedelta(seconds=timeout)
            columns = [dist.new_group([members[local] for members in regions.members], timeout=limit)
                       for local in range(self.size)]
            self._column = columns[self.local_index]
        self._encoded: EncodedAllReduce | None = None
        self._reference: Tensor | None = None  # the last accepted quantized mean, the same on every rank
        # created after the region groups, by every rank, in the same order
        self._cross_group = dedicated_group([range(regions.world_size)], rank, timeout=timeout) if delayed else None

    @torch.no_grad()
    def region_mean_(self, tensor: Tensor) -> Tensor:
        """In place: the mean of ``tensor`` over this rank's region."""
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            tensor.div_(self.size)
            self.bytes_region += ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        return tensor

    @torch.no_grad()
    def cross_mix(self, message: Tensor, destination: Tensor, peers: Mapping[int, float]) -> list[int]:
        """``destination = u + sum_j w_j (u_j - u)`` with the peers' messages, carried shard by shard; returns the
        peers whose shard was refused as not finite (see :meth:`land_cross`).

        Args:
            message: u_A, this rank's region point to send (identical on every member of the region).
            destination: receives the mixed point (may not alias ``message``).
            peers: ``{rank: weight}`` across regions (every member of a region has peers in the same regions).
        """
        return self.land_cross(self.post_cross(message, peers), destination)

    @torch.no_grad()
    def post_cross(self, message: Tensor, peers: Mapping[int, float] | None, *,
                   reference: Tensor | None = None) -> PendingCross:
        """Start the crossing of ``message`` (copied: the caller may change it): the shard exchange with ``peers``,
        or with ``peers=None`` the world mean (hierarchical DiLoCo). Land it with :meth:`land_cross`.

        ``reference``: with a lossy codec, the world mean averages ``message - reference`` and adds it back; it must
        be the same on every rank (the round's last mix). It is read at the first crossing only: after it the
        transport keeps the last accepted mean, so a mean refused as not finite (each rank then keeps its own
        message) leaves the next one common to all ranks. That mean is computed here, blocking (the delayed
        crossing refuses it)."""
        numel = message.numel()
        if peers is None and self._column is not None:
            return self._encoded_mean(message, reference)
        if peers is None:
            buffer = message.detach().clone()
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._cross_group, async_op=True)
            self.bytes_cross += ring_all_reduce_bytes(numel * message.element_size(), self.regions.world_size)
            return PendingCross(buffer, numel, works=[work], mean=True, own=message.detach().clone(),
                                divisor=self.regions.world_size)
        chunk = math.ceil(numel / self.size)
        padded = torch.zeros(chunk * self.size, dtype=message.dtype, device=message.device)
        padded[:numel].copy_(message)
        if not peers:
            return PendingCross(padded, numel)
        own = padded.view(self.size, chunk)[self.local_index]
        own_decoded = None
        if self._codec is None:
            outgoing = own
            self.bytes_cross += len(peers) * min(chunk, numel) * message.element_size()
        else:
            outgoing = self._codec.new_wire(chunk, device=own.device)
            own_decoded = self._codec.encode(own, outgoing, decoded=torch.empty_like(own))
            self.bytes_cross += len(peers) * outgoing.numel()
        received = {j: torch.empty_like(outgoing) for j in sorted(peers)}
        operations = [dist.P2POp(dist.irecv, received[j], j, group=self._cross_group) for j in sorted(peers)]
        operations += [dist.P2POp(dist.isend, outgoing, j, group=self._cross_group) for j in sorted(peers)]
        return PendingCross(padded, numel, dict(peers), received, dist.batch_isend_irecv(operations),
                            own_decoded=own_decoded)  # receives first (see comm/transport.py)

    def _encoded_mean(self, message: Tensor, reference: Tensor | None) -> PendingCross:
        """The quantized world mean: shard l of ``message - reference`` averaged over rank l of every region (DiLoCo's
        quantized all-reduce), ``reference`` added back, the region's shards gathered."""
        if reference is None or reference.shape != message.shape:
            raise ValueError("a quantized cross mean needs the reference point every rank shares (the last mean), "
                             "shaped as the message")
        if self._reference is None:
            self._reference = reference.detach().to(torch.float32, copy=True)
        reference = self._reference
        numel = message.numel()
        chunk = math.ceil(numel / self.size)
        padded = torch.zeros(chunk * self.size, dtype=torch.float32, device=message.device)
        torch.sub(message, reference, out=padded[:numel])
        if self._encoded is None:
            self._encoded = EncodedAllReduce(self._codec_name, chunk, self.regions.num_regions, message.device)
        shards = padded.view(self.size, chunk)
        own = shards[self.local_index]
        self._encoded.encode(own)
        self._encoded.exchange(self._column)
        mean = self._encoded.decode(torch.empty_like(own))
        lo = self.local_index * chunk  # the reference is added back to this rank's own shard only (its padding: 0)
        covered = max(0, min(numel, lo + chunk) - lo)
        mean[:covered].add_(reference[lo: lo + covered])
        self.bytes_cross += self._encoded.volume
        if self.size > 1:
            dist.all_gather(list(shards.unbind(0)), mean, group=self.group)
            self.bytes_cross += (self.size - 1) * chunk * padded.element_size()
        else:
            own.copy_(mean)
        return PendingCross(padded, numel, mean=True, own=message.detach().clone(), reference=reference)

    @torch.no_grad()
    def land_cross(self, pending: PendingCross, destination: Tensor) -> list[int]:
        """Wait for a posted crossing and write its result into ``destination``: the world mean, or this rank's
        mixed shard gathered with the other members' (m - 1 shards in, as a ring all-gather).

        A peer's shard that is not finite (overflowed, or corrupted on the way: a codec's scales are raw bytes)
        is left out, this rank keeping its own shard for that peer's share, as the one-level gossip drops such a
        message; a world mean that is not finite leaves this rank's own message. Returns the peers left out
        (-1: the world mean), for the caller to count (``comm/rejected_exchanges``).
        """
        for work in pending.works:
            work.wait()
        if pending.mean:
            mean = pending.padded[:pending.numel]
            if pending.divisor != 1:
                mean.div_(pending.divisor)
            if all_finite(mean):
                destination.copy_(mean)
                if pending.reference is not None:
                    pending.reference.copy_(mean)
                return []
            destination.copy_(pending.own)
            return [-1]
        if not pending.peers:
            destination.copy_(pending.padded[:pending.numel])
            return []
        shards = pending.padded.view(self.size, -1)  # (m, chunk)
        own = shards[self.local_index]
        mixed, rejected = own.clone(), []
        theirs = torch.empty_like(own)
        for j in sorted(pending.peers):
            if pending.own_decoded is None:
                theirs = pending.received[j]
                difference = theirs - own
            else:  # shard + sum_j w_j (m_j - m_own): the mean over ranks is kept, each keeps its rounding residual
                difference = self._codec.decode(pending.received[j], theirs).sub_(pending.own_decoded)
            if not all_finite(difference):
                rejected.append(j)
                continue
            mixed.add_(difference, alpha=pending.peers[j])
        if self.size > 1:  # every member mixed its own shard: gather them
            dist.all_gather(list(shards.unbind(0)), mixed, group=self.group)
            self.bytes_cross += (self.size - 1) * shards.shape[1] * pending.padded.element_size()
        else:
            shards[0].copy_(mixed)
        destination.copy_(pending.padded[:pending.numel])
        return rejected

    def level_bytes(self) -> dict[str, float]:
        """Bytes this rank sent at each level, so far."""
        return {"comm/bytes_region": float(self.bytes_region), "comm/bytes_cross": float(self.bytes_cross)}
