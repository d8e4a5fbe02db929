"""The two-level round's moves over an elastic quorum: regions learned per quorum, region means, region-state copies
and shard-parallel crossings, on :class:`~gasloc_lightning.comm.elastic_transport.ElasticTransport`.

:class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound` holds the arithmetic; the multi-process engine
(:mod:`gasloc_lightning.comm.two_level`) knows every rank's region from the start. Here members come and go, so:

- **Regions are learned at every quorum.** Each worker declares its region (a label: ``eu-west``, a host name, a
  number). Right after a quorum forms, every admitted member adds a key of its label, and whether its two-level state
  is its region's, into its own slot of a small control vector (an all-reduce over the quorum; slots that are not
  what honest members write fail it). Every member then derives the same :class:`QuorumRegions`: regions in the
  order of the topology's region list (labels it does not list after, by key), members in quorum order.
- **A region's members hold one state.** A member whose state may differ from its region's (it joined or rejoined:
  it took a peer's state, perhaps another region's; or a collective of its last round failed) is *unsettled*. When a
  quorum has one, every region copies the state of one settled member (its first; the first member where none is)
  to the others: a sum over the region in which only that member contributes. Every region does it whenever one
  does, so all members run the same collectives.
- **Region mean:** a ring all-reduce over the region's members only (over its fast links).
- **Cross mean** (hierarchical DiLoCo): the quorum's all-reduce over every member (the mean over workers).
- **Cross gossip** (two-level GASLoC): the regions' mixing W_R for the round (the topology's region graph over the
  regions present) is applied to the regions' points. Every member of region A holds u_A, so with s = the smallest
  region's size, member l < s of A sends only the l-th of s shards of u_A to member l of each paired region, mixes
  that shard, and the region then gathers the mixed shards (a sum over the region in which each member contributes
  its own). The slow link carries each region's point once per pair, over s parallel flows.
  With regions of equal sizes this is the multi-process engine's crossing; with unequal sizes the regions' points,
  not the ranks', are mixed (each region stays one point), so the mean over regions is what the gossip preserves.

On failure nothing raises from here but :class:`~gasloc_lightning.comm.elastic_transport.ElasticCollectiveError`
from a region or cross collective (the strategy keeps its own values and becomes unsettled). A sum over fewer than
the region's members is such a failure, never a partial result. A failed shard exchange keeps this region's own shard
(the pair's weight stays on the diagonal: the region stays one point, but the pair's mean is not kept if only one side
failed) and is counted in the transport's ``failed_exchanges``. Every kind of ring has its own gloo tags
(``elastic_transport.CHANNELS``), and the exchange and the gather of a crossing share one deadline.

Nothing here imports Lightning.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.flat import all_finite
from gasloc_lightning.comm.message_auth import TAG_BYTES, context, tag_bytes, tag_tensor
from gasloc_lightning.comm.ring import UnauthenticMessageError, wait_all
from gasloc_lightning.comm.transport import ring_all_reduce_bytes

__all__ = ["ElasticRegions", "QuorumRegions", "check_region_label", "region_key"]

# Gloo tag offsets of the shard exchange (the others: comm/elastic_transport.py).
_SHARD, _SHARD_TAG = 6, 7
_KEY_LIMIT = 1 << 52  # keys travel in float64-exact int64 slots


def check_region_label(label: Hashable) -> Hashable:
    """A region label as workers declare it: a non-empty name or an int."""
    if isinstance(label, bool) or not isinstance(label, (int, str)) or label == "":
        raise ValueError(f"region must be a non-empty name or an int, got {label!r}")
    return label


def region_key(label: Hashable) -> int:
    """The key of a region label, the same on every machine (never 0: a 0 slot is a member that did not take part)."""
    digest = hashlib.blake2b(str(label).encode(), digest_size=8, person=b"gasloc-region").digest()
    return int.from_bytes(digest, "big") % (_KEY_LIMIT - 1) + 1


@dataclass(frozen=True)
class QuorumRegions:
    """The regions of one quorum's admitted members, the same on every member.

    Args:
        members: the quorum indices of every region's members (regions ordered by key, members in quorum order).
        keys: every region's key.
        unsettled: the members whose two-level state may not be their region's.
    """

    members: tuple[tuple[int, ...], ...]
    keys: tuple[int, ...]
    unsettled: frozenset[int] = frozenset()

    @classmethod
    def from_slots(cls, keys: Sequence[int], unsettled: Sequence[int],
                   order: Mapping[int, int] | None = None) -> QuorumRegions:
        """From the control vector's two columns (one row per quorum index; key 0: not admitted). ``order``: the
        position of known region keys (the topology's region list, so regions are numbered as the simulator numbers
        them); unknown keys follow, by key."""
        regions: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            if key:
                regions.setdefault(int(key), []).append(index)
        order = order or {}
        ordered = sorted(regions, key=lambda key: (order.get(key, math.inf), key))
        return cls(members=tuple(tuple(regions[key]) for key in ordered), keys=tuple(ordered),
                   unsettled=frozenset(index for index, flag in enumerate(unsettled) if flag and keys[index]))

    @property
    def num_regions(self) -> int:
        return len(self.members)

    @property
    def shards(self) -> int:
        """s: the smallest region's size, the number of shards a crossing splits a region's point into."""
        return min(map(len, self.members))

    def region_of(self, index: int) -> int:
        for region, members in enumerate(self.members):
            if index in members:
                return region
        raise ValueError(f"quorum index {index} is in no region of this quorum (not admitted)")

    def local_index(self, index: int) -> int:
        return self.members[self.region_of(index)].index(index)

    @property
    def needs_copy(self) -> bool:
        """Whether the regions copy one member's state to the others at this quorum (some member is unsettled)."""
        return bool(self.unsettled)

    def source(self, region: int) -> int:
        """The member whose state ``region`` takes: its first settled member, else its first."""
        members = self.members[region]
        return next((index for index in members if index not in self.unsettled), members[0])


class ElasticRegions:
    """This worker's region and the two-level moves over its transport's quorum.

    Args:
        transport: the worker's elastic transport (its quorum, process group and authenticators).
        label: this worker's region.
    """

    def __init__(self, transport: ElasticTransport, label: Hashable, known: Sequence[Hashable] = ()) -> None:
        self.transport, self.label = transport, check_region_label(label)
        self.key = region_key(label)
        self._order = {region_key(name): position for position, name in enumerate(known)}
        self.bytes_region = 0.0
        self.bytes_cross = 0.0

    def level_bytes(self) -> dict[str, float]:
        """Bytes this worker sent at each level, so far (the round callback logs them)."""
        return {"comm/bytes_region": self.bytes_region, "comm/bytes_cross": self.bytes_cross}

    # ------------------------------------------------------------------ per quorum
    def learn(self, settled: bool, least: int = 2) -> QuorumRegions:
        """Every admitted member's region and whether its state is its region's (a control all-reduce over the
        quorum, which every member runs right after the quorum forms). Raises :class:`ElasticCollectiveError` if it
        fails, if fewer than ``least`` members are admitted, or if the slots are not what honest members write
        (this worker's own as it wrote it, nothing at a member that did not take part, flags of 0 or 1)."""
        quorum = self.transport.membership.quorum
        slots = torch.zeros(quorum.size, 2, dtype=torch.int64)
        slots[quorum.index, 0] = self.key
        slots[quorum.index, 1] = 0 if settled else 1
        own = slots[quorum.index].clone()
        try:
            ring = self.transport.all_reduce_sum(slots.view(-1), channel="control", least=least)
        except Exception as error:
            raise self._failed("the regions' control all-reduce", error) from error
        outside = [index for index in range(quorum.size) if index not in ring]
        if (not torch.equal(slots[quorum.index], own) or bool(slots[outside].any())
                or bool((slots[list(ring), 0] <= 0).any()) or not set(slots[:, 1].tolist()) <= {0, 1}):
            error = RuntimeError("the regions' control slots are not what the members wrote (a member wrote outside "
                                 "its own slot)")
            raise self._failed("the regions' control all-reduce", error)
        return QuorumRegions.from_slots(slots[:, 0].tolist(), slots[:, 1].tolist(), self._order)

    def copy_state(self, regions: QuorumRegions, tensors: list[Tensor]) -> None:
        """Every member of this worker's region takes its source's ``tensors`` (see :meth:`QuorumRegions.source`).
        Raises :class:`ElasticCollectiveError` if a member failed or the state is not finite (the tensors are then
        undefined)."""
        me = self.transport.rank
        region = regions.region_of(me)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if regions.source(region) == me else \
            torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
        self._region_sum(flat, regions.members[region], "copy")
        if not all_finite(flat):
            raise self._failed("the region's state copy", RuntimeError("the copied state is not finite"))
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    # ------------------------------------------------------------------ per round
    def region_mean_(self, regions: QuorumRegions, tensor: Tensor) -> Tensor:
        """In-place mean of ``tensor`` over this worker's region. :class:`ElasticCollectiveError` on failure."""
        members = regions.members[regions.region_of(self.transport.rank)]
        self._region_sum(tensor, members, "mean")
        return tensor.div_(len(members))

    def cross_mean_(self, tensor: Tensor) -> Tensor:
        """In-place mean of ``tensor`` over every admitted member (hierarchical DiLoCo's crossing)."""
        before = self.transport.counters.bytes_sent
        self.transport.all_reduce_mean(tensor, round_exchange=True)
        self.bytes_cross += self.transport.counters.bytes_sent - before
        return tensor

    def cross_gossip(self, regions: QuorumRegions, u: Tensor, weights: Mapping[int, float], out: Tensor,
                     round_index: int) -> list[int]:
        """``out = sum_B W_R[A, B] u_B`` for this worker's region A, from the region weights ``weights``
        (paired region index -> w, as a topology's ``mixing_weights``; A's own is the rest), shard-parallel (module
        docstring). Returns the quorum indices whose shard did not arrive (their weight stayed on this region's own
        shard). :class:`ElasticCollectiveError` if
        the gather inside the region fails (``out`` is then undefined). One deadline covers the exchange and the
        gather: a member whose exchange waited for a hung peer still meets its region's gather in time."""
        transport = self.transport
        deadline = time.monotonic() + 2 * transport.timeout
        me = transport.rank
        region, local = regions.region_of(me), regions.local_index(me)
        s, numel = regions.shards, u.numel()
        out.zero_()
        failed: list[int] = []
        if local < s:
            lo, hi = numel * local // s, numel * (local + 1) // s
            peers = {regions.members[b][local]: w for b, w in weights.items() if b != region and w}
            shard = out[lo:hi]
            shard.copy_(u[lo:hi]).mul_(1.0 - sum(peers.values()))
            received, failed = self._exchange(u[lo:hi], peers, round_index, time.monotonic() + transport.timeout)
            for peer, weight in peers.items():
                shard.add_(received[peer] if peer in received else u[lo:hi], alpha=weight)
        self._region_sum(out, regions.members[region], "gather", deadline)  # the gather: shards are disjoint
        return failed

    # ------------------------------------------------------------------ moves
    def _failed(self, what: str, error: Exception, round_exchange: bool = False) -> ElasticCollectiveError:
        """Count a failure once, as the transport counts its own (a round's exchange: the region mean, a crossing's
        gather), and say what failed."""
        self.transport.count_failure(error, round_exchange=round_exchange)
        return ElasticCollectiveError(f"{what} failed: {error}")

    def _region_sum(self, tensor: Tensor, members: tuple[int, ...], channel: str, deadline: float | None = None
                    ) -> None:
        """Sum over every member of ``members``: a sum over fewer (some not admitted: refused, or the agreement
        unreadable) is a failure, never a partial result."""
        transport = self.transport
        try:
            ring = transport.all_reduce_sum(tensor, members=members, channel=channel, deadline=deadline)
            if set(ring) != set(members):
                raise RuntimeError(f"only {len(ring)} of the region's {len(members)} members took part")
        except Exception as error:
            raise self._failed(f"the region's {channel} all-reduce over {len(members)} members", error,
                               round_exchange=channel in ("mean", "gather")) from error
        volume = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), len(ring))
        transport.counters.bytes_sent += volume
        transport.counters.bytes_received += volume
        self.bytes_region += volume  # a crossing's gather of the mixed shards travels inside the region too

    def _exchange(self, shard: Tensor, peers: Mapping[int, float], round_index: int, deadline: float
                  ) -> tuple[dict[int, Tensor], list[int]]:
        """Send ``shard`` to every peer and receive theirs (all posted before any wait, so no cycle of pairs can
        deadlock), each with its keyed tag when messages are authenticated; returns the shards that arrived intact
        and the peers that failed (counted)."""
        transport = self.transport
        pg, quorum, auth = transport.membership.process_group, transport.membership.quorum, transport.message_auth
        admitted = transport.admitted()
        buffers = {peer: torch.empty_like(shard) for peer in peers}
        tags_in = {peer: torch.zeros(TAG_BYTES, dtype=torch.uint8) for peer in peers}
        leaves = auth.leaves(shard) if auth is not None and peers else None  # hashed once for every peer
        works: dict[int, list] = {}
        for peer in sorted(peers):
            if peer not in admitted:
                continue
            try:
                works[peer] = [pg.recv([buffers[peer]], peer, transport.gloo_tag(_SHARD)),
                               pg.send([shard], peer, transport.gloo_tag(_SHARD))]
                if auth is not None:
                    works[peer].append(pg.recv([tags_in[peer]], peer, transport.gloo_tag(_SHARD_TAG)))
                    tag = tag_tensor(auth.seal(leaves, self._use(round_index, me=quorum.index, to=peer)))
                    works[peer].append(pg.send([tag], peer, transport.gloo_tag(_SHARD_TAG)))
            except Exception as error:  # noqa: BLE001 - an unconfigured group raises AssertionError
                works[peer] = []
                transport.error = transport.error or error
        received, failed = {}, []
        for peer in sorted(peers):
            failure = wait_all(works[peer], deadline) if works.get(peer) else RuntimeError("not sent (refused or "
                                                                                          "unconfigured)")
            if failure is None and auth is not None and not auth.verify(
                    buffers[peer], self._use(round_index, me=peer, to=quorum.index), tag_bytes(tags_in[peer])):
                failure = UnauthenticMessageError("the shard's tag failed (dropped, not mixed in)")
            if failure is None:
                received[peer] = buffers[peer]
                self.bytes_cross += shard.numel() * shard.element_size()
                transport.counters.bytes_sent += shard.numel() * shard.element_size()
                transport.counters.bytes_received += shard.numel() * shard.element_size()
            else:
                failed.append(peer)
                transport.count_failure(failure, round_exchange=True)
        return received, failed

    def _use(self, round_index: int, *, me: int, to: int) -> bytes:
        quorum = self.transport.membership.quorum
        return context("cross-shard", quorum.quorum_id, self.transport.agreement_digest, round_index,
                       quorum.members[me], quorum.members[to])
