"""Two-level GASLoC and hierarchical DiLoCo in the elastic mode: wiring only.

The round is :class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound` (docs/algorithm.md, section 8a), as in
:class:`~gasloc_lightning.strategies.two_level.TwoLevelStrategy` and ``gasloc-sim``; its tensors move through
:class:`~gasloc_lightning.comm.elastic_regions.ElasticRegions` over the live quorum; membership, heals, lineages,
leaves and the end-of-fit average are :class:`~gasloc_lightning.strategies.elastic.ElasticGASLoCStrategy`'s.

Each worker declares its region (``region``; default: its entry in the topology's region list, by worker id). Right
after every quorum the members learn each other's regions, and if one of them may hold another region's state (it
joined, rejoined, or a collective of its last round failed) every region copies one settled member's two-level
state to its other members, who also take it as their live point (comm/elastic_regions.py). Then each round is the
region mean and step over the region's members and, every K rounds with two regions or more present, the crossing:
the mean over every member (hierarchical DiLoCo) or the shard-parallel gossip between the regions' points.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable
from typing import Any

import torch
from typing_extensions import override

from gasloc_lightning.algorithm.two_level import TwoLevelRound
from gasloc_lightning.comm.elastic_regions import ElasticRegions, QuorumRegions, check_region_label
from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError
from gasloc_lightning.comm.flat import all_finite
from gasloc_lightning.comm.run_end import is_final
from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy
from gasloc_lightning.topology.regions import TwoLevelTopology

log = logging.getLogger(__name__)

__all__ = ["ElasticTwoLevelStrategy"]


class ElasticTwoLevelStrategy(ElasticGASLoCStrategy):
    """DiLoCo inside every region each round, an outer step across regions every K rounds, over a live quorum.

    Args:
        topology: the two-level topology (``topology=two_level`` or ``hierarchical``): K, the region mixing, the
            cross step, and the region list the default ``region`` is read from.
        region: this worker's region (a name such as a cloud region or a host name, or an int); ``None``: entry
            ``worker_id`` of the topology's region list.
        outer_lr, outer_momentum: eta_r and gamma_r of DiLoCo inside a region (``None``: DiLoCo's 0.9).
        **kwargs: the arguments of :class:`~gasloc_lightning.strategies.elastic.ElasticGASLoCStrategy`.

    The delayed crossing (``cross_overlap``) and a lossy ``cross_codec`` are refused here: gasloc-sim and the
    multi-process ``strategy=two_level`` run them.
    """

    strategy_name = "two_level_elastic"

    def __init__(self, *, topology: TwoLevelTopology, region: Hashable | None = None, outer_lr: float = 0.7,
                 outer_momentum: float | None = 0.9, **kwargs: Any) -> None:
        if not isinstance(topology, TwoLevelTopology):
            raise ValueError(f"topology must be a TwoLevelTopology (topology=two_level or hierarchical), got "
                             f"{type(topology).__name__}")
        rule = topology.rule(region_lr=outer_lr, region_momentum=0.9 if outer_momentum is None else outer_momentum)
        unsupported = (["topology.cross_overlap=true"] if rule.cross_overlap else []) + (
            [f"topology.cross_codec={topology.cross_codec}"] if topology.cross_codec != "float32" else [])
        if unsupported:
            raise ValueError(f"the elastic mode crosses regions waited and in float32: {' and '.join(unsupported)} "
                             "run in gasloc-sim and gasloc-train (strategy=two_level); leave cross_overlap=false and "
                             "cross_codec=float32 here")
        worker_id = kwargs.get("worker_id")
        if region is None:
            regions = topology.regions
            if not isinstance(worker_id, int) or not 0 <= worker_id < regions.world_size:
                raise ValueError(f"region: worker {worker_id!r} has no entry in the topology's region list (of "
                                 f"{regions.world_size}): give it its region (strategy.region=NAME)")
            region = regions.names[regions.region_of(worker_id)]
        check_region_label(region)
        super().__init__(topology=topology, outer_lr=outer_lr, outer_momentum=rule.region_momentum, **kwargs)
        self._rule, self._region = rule, region
        self._two_level: TwoLevelRound | None = None
        self._regions: ElasticRegions | None = None
        self._view: QuorumRegions | None = None  # this quorum's regions (None: no exchange this round)
        self._settled = True  # this worker's two-level state is its region's (every worker starts from one point)

    @property
    def region(self) -> Hashable:
        return self._region

    @property
    def regions(self) -> QuorumRegions | None:
        """The regions of the current quorum's members, as learned when it formed."""
        return self._view

    def level_bytes(self) -> dict[str, float]:
        """Bytes this worker sent at each level (the round callback logs them)."""
        return self._regions.level_bytes() if self._regions is not None else {}

    # ------------------------------------------------------------------ configuration
    @override
    def check_configuration(self, world_size: int) -> None:
        LocalStepsStrategy.check_configuration(self, world_size)
        if world_size != 1:
            raise ValueError(f"{type(self).__name__} runs one process per worker (Lightning's world is the worker): "
                             f"set devices=1 and num_nodes=1, got a world of {world_size} processes")
        self._topology.check_rule(self._rule)  # both levels' stability, for every K-round schedule
        self._outer_momentum = self._rule.region_momentum

    @override
    def _init_outer_state(self) -> None:
        if self._outer_momentum is None:
            self.check_configuration(self.world_size)
        params, _ = self.layout.split(self.layout.read())
        self._two_level = TwoLevelRound(params, rule=self._rule, num_regions=self._topology.regions.num_regions)
        self._two_level.region_tensors()  # b_A exists from the start: a heal's state has it on both sides
        self._round = None
        self._pending = self._completed = None

    @override
    def _signature(self) -> dict[str, Any]:
        return {**super()._signature(), "two_level": dataclasses.asdict(self._rule),
                "region_topology": self._topology.region_topology.name}

    # ------------------------------------------------------------------ regions, at every quorum
    @override
    def _meet_lineages(self) -> None:
        merges = self._lineage.merges
        super()._meet_lineages()
        if self._lineage.merges != merges:  # the sides' region and cross states differ: copy one per region
            self._settled = False
        self._settle_regions()

    def _settle_regions(self) -> None:
        """Right after every quorum, on every member alike: learn the members' regions and, if one may hold another
        region's state, bring every region's members onto one state (module docstring)."""
        self._view = None
        quorum = self.quorum
        if is_final(quorum.max_step) or not quorum.usable or quorum.size <= 1:
            return  # the end-of-fit average (or no exchange) follows: no round is trained in this quorum
        if self._regions is None or self._regions.transport is not self._transport:
            self._regions = ElasticRegions(self._transport, self._region, known=self._topology.regions.names)
        try:
            view = self._regions.learn(self._settled, least=max(2, self._min_workers))
        except ElasticCollectiveError as error:  # a member died or wrote outside its slot: no exchange this round
            log.warning("regions not learned worker=%s: %s (a local round)", self.membership.name, error)
            self._settled = False
            return
        if view.needs_copy:
            try:
                self._regions.copy_state(view, self._two_level.region_tensors())
            except ElasticCollectiveError as error:
                log.warning("region state not copied worker=%s: %s (a local round)", self.membership.name, error)
                self._settled = False
                return
            live = self.layout.read()
            params, _ = self.layout.split(live)
            params.copy_(self._two_level.region_start.detach())
            self.layout.scatter(live)
            self._settled = True
            source = view.source(view.region_of(self.quorum.index))
            if source != self.quorum.index:
                log.info("took region %s's state worker=%s source=%s", self._region, self.membership.name,
                         self.quorum.names[source])
        self._view = view

    @override
    def _on_replicas_averaged(self) -> None:
        """A lineage merge or the end-of-fit average: the averaged point is every region's new start (after a merge
        the regions then copy one member's state: :meth:`_meet_lineages`)."""
        if self._two_level is not None:
            params, _ = self.layout.split(self.layout.read())
            self._two_level.region_start.data.copy_(params)

    # ------------------------------------------------------------------ the round
    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        two, view = self._two_level, self._view
        message = self.layout.read()  # thetaH | buffers
        self._guard_local_point(message, two.region_start.detach())
        params, _ = self.layout.split(message)
        two.pseudo_gradient(params)  # params now hold Delta_i
        if view is None:  # a round without the region: this worker's region point is its own until the next copy
            self._settled = False
        else:
            own = self._transport.receive_buffer(0)
            own.copy_(message)
            try:
                self._regions.region_mean_(view, message)
                if not all_finite(message):
                    raise ElasticCollectiveError("the region mean is not finite (a member sent non-finite values)")
            except ElasticCollectiveError as error:
                log.warning("region mean failed round=%d: %s (own pseudo-gradient kept)", self.round_index, error)
                message.copy_(own)
                self._settled = False
        params.copy_(two.region_step(params))
        t = self.quorum.max_step  # identical on every member
        if view is not None and view.num_regions > 1 and self._rule.is_cross_round(t) and self._crosses_with(view):
            params.copy_(self._cross(view, t))
        self.layout.scatter(message)

    def _crosses_with(self, view: QuorumRegions) -> bool:
        """Whether the region topology has a graph for the regions present (every member decides alike): a topology
        of fixed size, or one that needs more regions, skips the crossing and says so."""
        if self._rule.cross_mean:
            return True
        try:
            self._topology.region_topology.check_world_size(view.num_regions)
        except ValueError as error:
            log.warning("no crossing round=%d: the region topology has no graph for %d regions (%s)",
                        self.round_index, view.num_regions, error)
            return False
        return True

    def _cross(self, view: QuorumRegions, round_index: int) -> torch.Tensor:
        two = self._two_level
        u, destination = two.cross_message(), two.cross_destination
        try:
            if self._rule.cross_mean:
                self._regions.cross_mean_(destination.copy_(u))
            else:
                region = view.region_of(self.quorum.index)
                crossing = round_index // self._rule.cross_every  # the region graph's time: one draw per crossing
                weights = self._topology.region_topology.mixing_weights(region, view.num_regions, crossing)
                self._regions.cross_gossip(view, u, weights, destination, round_index)
            if not all_finite(destination):
                raise ElasticCollectiveError("the crossing's mix is not finite (a member sent non-finite values)")
        except ElasticCollectiveError as error:
            log.warning("crossing failed round=%d: %s (the region's own point kept)", round_index, error)
            destination.copy_(u)
            self._settled = False
        return two.cross_finish()

    # ------------------------------------------------------------------ state
    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        state = super().strategy_state_dict()
        if self._two_level is not None:
            state["two_level"] = self._two_level.state_dict()
        return state

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's state (a heal: perhaps another region's) or a checkpoint's: unsettled until the next quorum
        brings this worker onto its region's state."""
        super().load_strategy_state_dict(state)
        if self._two_level is not None and state.get("two_level") is not None:
            self._two_level.load_state_dict(state["two_level"])
        self._settled = False
