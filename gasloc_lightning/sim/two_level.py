"""The two-level round on stacked points: DiLoCo inside every region, a cross step every K rounds.

The arithmetic is :class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound`'s on ``(n, P)`` rows (one row per
worker, its region's state); this class moves the tensors between rows, as the multi-process engine would move
them over process groups, and charges each move to the clocks:

- **region step, every round:** the exact mean of the members' pseudo-gradients, a ring all-reduce over the
  region's ranks (the network's intra-region links), region by region;
- **cross step, every K rounds:** either a gossip between regions, carried shard-parallel (rank l of region A
  sends the l-th 1/m of its region's point to rank l of the paired region A': m concurrent flows sharing the
  slow link, together one model), then an all-gather inside each region (charged as half an all-reduce), or,
  for hierarchical DiLoCo (``region_topology`` complete), an all-reduce over every rank (the network's
  cheaper of ring and hierarchical).

The cross exchange is waited on where it happens, or with the delayed crossing (``cross_overlap``) posted at one
crossing and completed at the next: the workers' clocks run the K region rounds (compute and region all-reduces)
meanwhile, and the next crossing waits only for what is left of the transfer, then for the region's all-gather
of the mixed shards. The arithmetic lands the mix there too (``TwoLevelRound.cross_land``), so what the
simulator computes is what the engine does when the exchange arrives.

With a lossy ``cross_codec`` each rank encodes its own shard (what the engine sends), mixes the peers' decoded
shards with its own decoded one and keeps its own rounding residual (``shard + sum_j w_j (m_j - m_i)``), and the
region gathers the mixed shards: the rows compute what each rank does, block for block.

Bytes are counted per worker and per level: :attr:`bytes_region` and :attr:`bytes_cross` (their sum is
:attr:`bytes_sent`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.codecs import build_codec
from gasloc_lightning.algorithm.round import EncodedMean
from gasloc_lightning.algorithm.two_level import TwoLevelRound, TwoLevelRule
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.sim.rounds import WorkerClocks
from gasloc_lightning.topology.regions import TwoLevelTopology

_FLOAT32 = 4


class TwoLevelRounds:
    """Two-level GASLoC (or hierarchical DiLoCo) on the stacked points.

    Args:
        initial: (n, P) float32 starting points (every row equal).
        topology: the regions, K, the region mixing and the cross step's hyperparameters.
        rule: the two levels' hyperparameters (``topology.rule(region_lr=..., region_momentum=...)``), checked by
            the caller with ``topology.check_rule``.
        clocks: the workers' simulated clocks.
    """

    #: Model-sized float32 tensors of the outer state: region start, region momentum, cross point and anchor.
    outer_state_copies = 4

    def __init__(self, *, initial: Tensor, topology: TwoLevelTopology, rule: TwoLevelRule, clocks: WorkerClocks) -> None:
        workers = initial.shape[0]
        topology.check_world_size(workers)
        self.topology, self.rule, self.clocks = topology, rule, clocks
        self.regions = topology.regions
        self.round = TwoLevelRound(initial, rule=rule, num_regions=self.regions.num_regions)
        self.bytes_region = torch.zeros(workers, dtype=torch.float64)
        self.bytes_cross = torch.zeros(workers, dtype=torch.float64)
        self._members = [torch.as_tensor(list(ranks), device=initial.device) for ranks in self.regions.members]
        self._mean_ends: tuple[float, ...] = ()  # the delayed crossing's posted all-reduce: when it ends, per network
        self._codec = None if topology.cross_codec == "float32" else build_codec(topology.cross_codec)

    @property
    def bytes_sent(self) -> Tensor:
        return self.bytes_region + self.bytes_cross

    def level_bytes(self) -> dict[str, float]:
        """Mean bytes sent per worker at each level, so far (what the engine logs)."""
        return {"comm/bytes_region": float(self.bytes_region.mean()), "comm/bytes_cross": float(self.bytes_cross.mean())}

    @torch.no_grad()
    def communicate(self, flat: Tensor, round_index: int, live: Sequence[int]) -> None:
        """End round t: ``flat`` holds every worker's thetaH and receives its region's new point."""
        if len(live) != flat.shape[0]:
            raise ValueError("two-level rounds need every worker (churn is not simulated with topology two_level)")
        numel = flat.shape[1]
        delta = self.round.pseudo_gradient(flat)  # (n, P), over flat: it is overwritten below
        for index in self._members:
            m = index.numel()
            delta[index] = delta.index_select(0, index).sum(dim=0).div_(m)  # as the region's all-reduce: sum, / m
            self.bytes_region[index] += ring_all_reduce_bytes(numel * _FLOAT32, m)
            self.clocks.all_reduce(index.tolist())
        self.round.region_step(delta)
        if self.round.crosses(round_index):
            self._land(numel)
            self._cross(round_index, numel)
        flat.copy_(self.round.region_start)

    def _cross(self, round_index: int, numel: int) -> None:
        u = self.round.cross_message()  # (n, P): identical rows inside a region (p with the delayed crossing)
        destination = self.round.cross_destination
        workers = u.shape[0]
        if self.rule.cross_mean and self._codec is not None:
            self._encoded_mean(u, destination, numel)  # the destination holds the last mean (its reference) until then
        elif self.rule.cross_mean:
            destination.copy_(u.sum(dim=0).div_(workers))
            self.bytes_cross += ring_all_reduce_bytes(numel * _FLOAT32, workers)
            if self.rule.cross_overlap:
                self._mean_ends = self.clocks.all_reduce_posted(list(range(workers)), None, 1.0)
            else:
                self.clocks.all_reduce(list(range(workers)))
        else:
            self._gossip(u, destination, round_index, numel)
        self.round.cross_finish()

    def _land(self, numel: int) -> None:
        """The delayed crossing's exchange posted at the last crossing: wait for what is left of it, then land it."""
        if not self.round.in_flight:
            return
        workers = list(range(self.round.region_start.shape[0]))
        if self.rule.cross_mean:
            self.clocks.wait_until(workers, self._mean_ends)
            if self._codec is not None:
                self._all_gather(numel)
        else:
            self.clocks.complete()
            self._all_gather(numel)
        self.round.cross_land()

    def _gossip(self, u: Tensor, destination: Tensor, round_index: int, numel: int) -> None:
        """phi' = B C u: rank l mixes with rank l of the paired region (C), then each region averages (B)."""
        cross = self.topology.cross_matrix(round_index)  # (n, n) float64, C
        peers: dict[int, dict[int, float]] = {i: {} for i in range(u.shape[0])}
        for i, j in (cross - torch.diag(cross.diagonal())).nonzero().tolist():
            peers[i][j] = float(cross[i, j])
        pairs = sorted({(min(i, j), max(i, j)) for i, row in peers.items() for j in row})
        shard = self._shard_fraction(peers)
        if self._codec is None:
            destination.copy_(u)
            for i, row in peers.items():
                for j, weight in row.items():
                    destination[i].add_(u[j] - u[i], alpha=weight)
            for index in self._members:
                destination[index] = destination.index_select(0, index).sum(dim=0).div_(index.numel())
            for i, row in peers.items():
                self.bytes_cross[i] += len(row) * shard[i] * numel * _FLOAT32
            element_size = _FLOAT32
        else:
            element_size = self._encoded_mix(u, destination, peers)
        # The clock charges a whole message per pair at element_size bytes per modelled parameter: a shard.
        share = max(shard.values()) if shard else 1.0
        self.clocks.post(list(range(u.shape[0])), peers, pairs, element_size * share)
        if not self.rule.cross_overlap:  # else completed (and gathered) where it lands, at the next crossing
            self.clocks.complete()
            self._all_gather(numel)

    def _all_gather(self, numel: int) -> None:
        """Each region gathers its members' mixed shards: (m - 1) / m of the model, half an all-reduce."""
        for index in self._members:
            if index.numel() > 1:
                self.bytes_cross[index] += ring_all_reduce_bytes(numel * _FLOAT32, index.numel()) / 2
                self.clocks.all_reduce(index.tolist(), element_size=_FLOAT32 / 2)

    def _encoded_mix(self, u: Tensor, destination: Tensor, peers: dict[int, dict[int, float]]) -> float:
        """The crossing through ``cross_codec``, shard by shard as the ranks do it (regions of equal sizes m): rank i
        (local index l) encodes shard l of u_i, mixes ``shard + sum_j w_ij (m_j - m_i)`` with the peers' decoded
        shards, and its region gathers the members' mixed shards. Returns the wire's bytes per element."""
        workers, numel = u.shape
        m = self.regions.sizes[0]
        chunk = math.ceil(numel / m)
        padded = torch.zeros(workers, m * chunk, dtype=u.dtype, device=u.device)
        padded[:, :numel].copy_(u)
        local = torch.as_tensor([self.regions.local_index(i) for i in range(workers)], device=u.device)
        own = padded.view(workers, m, chunk)[torch.arange(workers, device=u.device), local]  # (n, chunk): a copy
        wire = self._codec.new_wire(chunk, workers, device=u.device)
        decoded = self._codec.encode(own, wire, decoded=torch.empty_like(own))
        mixed = own.clone()
        for i, row in peers.items():
            for j, weight in row.items():
                mixed[i].add_(decoded[j] - decoded[i], alpha=weight)
        gathered = torch.empty_like(padded).view(workers, m, chunk)
        for index in self._members:  # every member holds the region's mixed shards, in local order
            gathered[index] = mixed.index_select(0, index).unsqueeze(0)
        destination.copy_(gathered.view(workers, -1)[:, :numel])
        for i, row in peers.items():
            self.bytes_cross[i] += len(row) * wire.shape[1]
        return wire.shape[1] / chunk

    def _encoded_mean(self, u: Tensor, destination: Tensor, numel: int) -> None:
        """Hierarchical DiLoCo's quantized crossing (regions of equal sizes m): rank l averages shard l of u - phi (phi,
        the last mean, is the destination and the same on every row) with rank l of every other region by DiLoCo's
        quantized all-reduce (:class:`EncodedMean`, ranks in rank order, as a process group orders them), adds phi
        back, and its region gathers the shards. The clock charges an all-reduce of the model at the wire's bytes per
        element (its in-region phases at that size too, on the fast links)."""
        workers = u.shape[0]
        m, r = self.regions.sizes[0], self.regions.num_regions
        chunk = math.ceil(numel / m)
        padded = torch.zeros(workers, m * chunk, dtype=torch.float32, device=u.device)
        torch.sub(u, destination, out=padded[:, :numel])
        base = torch.zeros(m * chunk, dtype=torch.float32, device=u.device)
        base[:numel].copy_(destination[0])
        encoded = EncodedMean(self.topology.cross_codec, chunk, r)
        mean = torch.empty(m, chunk, dtype=torch.float32, device=u.device)
        for local in range(m):
            column = sorted(int(members[local]) for members in self._members)
            shards = padded.view(workers, m, chunk)[column, local]  # (r, chunk), in rank order
            torch.add(encoded.mean(shards), base.view(m, chunk)[local], out=mean[local])
        destination.copy_(mean.view(-1)[:numel].expand(workers, numel))
        self.bytes_cross += 2 * (r - 1) * encoded.chunk_wire
        element_size = encoded.chunk_wire / encoded.chunk
        if self.rule.cross_overlap:  # DiLoCoX's delayed compressed step: landed (and gathered) at the next crossing
            self._mean_ends = self.clocks.all_reduce_posted(list(range(workers)), element_size, 1.0)
        else:
            self.clocks.all_reduce(list(range(workers)), element_size=element_size)
            self._all_gather(numel)

    def _shard_fraction(self, peers: dict[int, dict[int, float]]) -> dict[int, float]:
        """The share of the model each paired rank carries: 1 / (ranks paired between its two regions)."""
        fraction = {}
        for i, row in peers.items():
            for j in row:
                a, b = self.regions.region_of(i), self.regions.region_of(j)
                fraction[i] = 1.0 / min(len(self.regions.members[a]), len(self.regions.members[b]))
        return fraction

    def flush(self, flat: Tensor) -> None:
        """End of training: the delayed crossing's exchange in flight lands and its correction is folded in."""
        if self.rule.cross_overlap:
            self._land(flat.shape[1])
            flat.copy_(self.round.fold_correction())

    @torch.no_grad()
    def restore_round_start(self, flat: Tensor, worker: int) -> None:
        """A discarded round: ``worker``'s point goes back to its region's round start."""
        flat[worker].copy_(self.round.region_start[worker])

    def join(self, worker: int, source: int, state_bytes: float) -> None:
        raise ValueError("two-level rounds do not simulate churn")
