"""A simulated engine: n GASLoC (or DiLoCo, or local) workers in one process, on the strategy's own math.

Layer: beside ``strategies/``. It uses ``algorithm`` (the outer step), ``topology`` (the graphs),
``network`` (the simulated clocks), ``comm.exchange`` (the correction math of bfloat16 and
overlapped gossip), ``models`` and ``data``; never the strategies or the app.
"""

from gasloc_lightning.sim.checks import (check_memory, estimate_bytes, resolve_outer_momentum,
                                         resolve_outer_momentum_for_sizes)
from gasloc_lightning.sim.churn import ChurnEvent, ChurnSchedule
from gasloc_lightning.sim.cohorts import CohortReplicas
from gasloc_lightning.sim.data import ShardedBatches
from gasloc_lightning.sim.engine import Simulator
from gasloc_lightning.sim.replicas import StackedReplicas, parameter_count
from gasloc_lightning.sim.rounds import DiLoCoRounds, GossipRounds, WorkerClocks, round_peers
from gasloc_lightning.sim.two_level import TwoLevelRounds

__all__ = [
    "ChurnEvent", "ChurnSchedule", "CohortReplicas", "DiLoCoRounds", "GossipRounds", "ShardedBatches", "Simulator",
    "StackedReplicas", "TwoLevelRounds", "WorkerClocks", "check_memory", "estimate_bytes", "parameter_count",
    "resolve_outer_momentum", "resolve_outer_momentum_for_sizes", "round_peers",
]
