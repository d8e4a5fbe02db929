"""Two-level GASLoC and hierarchical DiLoCo as a multi-process strategy: wiring only.

The round is :class:`~gasloc_lightning.algorithm.two_level.TwoLevelRound` (docs/algorithm.md, section 8a), the
tensors move through :class:`~gasloc_lightning.comm.two_level.RegionTransport` (a process group per region, the
shard-parallel crossing), and the regions, K and the cross step come from a
:class:`~gasloc_lightning.topology.regions.TwoLevelTopology` (``topology=two_level`` or ``hierarchical``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from gasloc_lightning.algorithm.outer import validate_outer_hyperparameters
from gasloc_lightning.algorithm.two_level import TwoLevelRound
from gasloc_lightning.comm.two_level import PendingCross, RegionTransport
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy
from gasloc_lightning.topology.regions import TwoLevelTopology


class TwoLevelStrategy(LocalStepsStrategy):
    """DiLoCo inside every region each round; an outer step across regions every K rounds (one rank per worker).

    On failure: every move is a collective or a paired exchange of the default process group, bounded by its
    ``collective_timeout``. Buffers (BatchNorm statistics) are averaged inside the region only.

    Args:
        inner_steps: H, optimizer steps per round.
        outer_lr, outer_momentum: eta_r and gamma_r of DiLoCo inside a region (DiLoCo: 0.7, 0.9).
        topology: the regions, ``cross_every`` (K), the region mixing and the cross step's ``cross_lr`` /
            ``cross_momentum`` (``region_topology`` complete: hierarchical DiLoCo).
        **kwargs: the remaining arguments of :class:`~gasloc_lightning.strategies.local_steps.LocalStepsStrategy`
            (a ``network`` gives no simulated clock here: gasloc-sim models the two levels' time).
    """

    strategy_name = "two_level"

    def __init__(self, *, inner_steps: Any = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 topology: TwoLevelTopology, **kwargs: Any) -> None:
        validate_outer_hyperparameters(outer_lr, outer_momentum, "anchored")
        if not isinstance(topology, TwoLevelTopology):
            raise ValueError(f"topology must be a TwoLevelTopology (topology=two_level or hierarchical), got "
                             f"{type(topology).__name__}")
        super().__init__(inner_steps=inner_steps, **kwargs)
        self._topology = topology
        self._rule = topology.rule(region_lr=outer_lr, region_momentum=outer_momentum)
        if self._rule.cross_mean and self._rule.cross_overlap and topology.cross_codec != "float32":
            raise ValueError(f"topology.cross_codec={topology.cross_codec!r} with cross_overlap=true on hierarchical "
                             "DiLoCo (DiLoCoX's delayed compressed step) runs in gasloc-sim only: here its quantized "
                             "mean is blocking. Use cross_overlap=false, a float32 mean, or gasloc-sim")
        self._round: TwoLevelRound | None = None
        self._regions: RegionTransport | None = None
        self._in_flight: PendingCross | None = None  # the delayed crossing's exchange, landed at the next crossing

    @property
    def topology(self) -> TwoLevelTopology:
        return self._topology

    @property
    def outer_lr(self) -> float:
        """eta_r, the region step's."""
        return self._rule.region_lr

    @property
    def outer_momentum(self) -> float:
        """gamma_r, the region step's."""
        return self._rule.region_momentum

    @property
    def cross_mean(self) -> bool:
        """Whether the cross step is the exact mean (hierarchical DiLoCo)."""
        return self._rule.cross_mean

    def level_bytes(self) -> dict[str, float]:
        """Bytes this rank sent at each level (the round callback logs them)."""
        return self._regions.level_bytes() if self._regions is not None else {}

    @property
    @override
    def bytes_sent(self) -> int:
        return int(sum(self.level_bytes().values()))

    @property
    @override
    def bytes_received(self) -> int:
        return self.bytes_sent  # every move here is symmetric

    @override
    def check_configuration(self, world_size: int) -> None:
        super().check_configuration(world_size)
        if self.ranks_per_worker != 1:
            raise ValueError("the two-level strategy runs one rank per worker: ranks_per_worker must be 1")
        self._topology.check_world_size(world_size)
        self._topology.check_rule(self._rule)

    @override
    def _start_clock(self) -> None:
        self._round_clock = None
        if self._network is not None:
            rank_zero_warn("network: the two-level strategy keeps no simulated clock (sim_time is not logged); "
                           "gasloc-sim models both levels' time")

    @override
    def _init_outer_state(self) -> None:
        params, _ = self.layout.split(self.layout.read())
        self._round = TwoLevelRound(params, rule=self._rule, num_regions=self._topology.regions.num_regions)
        if self.world_size > 1 and self._regions is None:  # new_group is a collective: once per process
            self._regions = RegionTransport(self._topology.regions, self.global_rank, delayed=self._rule.cross_overlap,
                                            timeout=self._collective_timeout, codec=self._topology.cross_codec,
                                            cross_mean=self._rule.cross_mean)

    @override
    @torch.no_grad()
    def _communicate(self) -> None:
        round_, regions = self._round, self._regions
        message = self.layout.read()  # thetaH | buffers
        self._guard_local_point(message, round_.region_start.detach())
        params, _ = self.layout.split(message)
        round_.pseudo_gradient(params)  # params now hold Delta_i
        if regions is not None:
            regions.region_mean_(message)  # the region's mean Delta | mean buffers
        params.copy_(round_.region_step(params))
        if regions is not None and round_.crosses(self.round_index):
            self._drain_exchanges()  # the delayed crossing: the last one's exchange lands before this one's message
            u = round_.cross_message()
            peers = None if self._rule.cross_mean else self._topology.cross_peers(self.global_rank, self.round_index)
            if self._rule.cross_overlap:
                self._in_flight = regions.post_cross(u, peers)
            else:  # a quantized mean averages the change since the last mean (the cross step's round start)
                posted = regions.post_cross(u, peers, reference=round_.last_mix)
                for peer in regions.land_cross(posted, round_.cross_destination):
                    self._guard.reject(peer, self._where())
            params.copy_(round_.cross_finish())
        self.layout.scatter(message)

    @override
    def _drain_exchanges(self) -> None:
        """Land the delayed crossing's exchange in flight (its correction is applied at the next crossing)."""
        if self._in_flight is None:
            return
        rejected = self._regions.land_cross(self._in_flight, self._round.cross_destination)
        self._in_flight = None  # landed: a failed wait above leaves it in flight (and the round refuses a state)
        self._round.cross_land()
        for peer in rejected:
            self._guard.reject(peer, self._where())

    @override
    def _drain_for_consensus(self) -> None:
        """Nothing: landing the delayed crossing changes no live point (its correction waits for the next crossing),
        so a consensus measurement or evaluation leaves it in flight instead of waiting for the slow link."""

    @override
    @torch.no_grad()
    def _flush_exchanges(self) -> None:
        """End of training: the last delayed correction goes into the live point and the region's round start."""
        if self._round is None or not self._rule.cross_overlap:
            return
        self._drain_exchanges()
        live = self.layout.read()
        params, _ = self.layout.split(live)
        params.copy_(self._round.fold_correction())
        self.layout.scatter(live)

    @override
    def _on_replicas_averaged(self) -> None:
        if self._round is not None:
            params, _ = self.layout.split(self.layout.read())
            self._round.region_start.data.copy_(params)

    @override
    def strategy_state_dict(self) -> dict[str, Any]:
        self._drain_exchanges()  # a checkpoint holds the landed correction, never an exchange in flight
        state = super().strategy_state_dict()
        if self._round is not None:
            state["two_level"] = self._round.state_dict()
        return state

    @override
    def load_strategy_state_dict(self, state: dict[str, Any]) -> None:
        super().load_strategy_state_dict(state)
        if self._round is not None and state.get("two_level") is not None:
            self._round.load_state_dict(state["two_level"])
