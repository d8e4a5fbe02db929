"""gasloc-lightning: GASLoC decentralized low-communication training as a Lightning strategy.

``import gasloc_lightning`` registers the strategy names ``gasloc``, ``gasloc_spawn``,
``gasloc_notebook`` (fork, for notebooks) and the same three for ``diloco``, so that
``Trainer(strategy="gasloc")`` works.
"""

from gasloc_lightning.strategies.callbacks import GASLoCCallback, SimulatedClockCallback
from gasloc_lightning.strategies.diloco import DiLoCoStrategy
from gasloc_lightning.network import NetworkModel, SimulatedClock
from gasloc_lightning.algorithm.outer import OuterState
from gasloc_lightning.strategies.registry import register_strategies
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy
from gasloc_lightning.strategies.gasloc import GASLoCStrategy
from gasloc_lightning.topology import TOPOLOGIES, Topology, build_topology
from gasloc_lightning.comm.transport import GossipTimeoutError

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "DiLoCoStrategy",
    "GASLoCCallback",
    "GASLoCStrategy",
    "GossipTimeoutError",
    "LocalStepsStrategy",
    "NetworkModel",
    "SimulatedClock",
    "SimulatedClockCallback",
    "OuterState",
    "TOPOLOGIES",
    "Topology",
    "build_topology",
    "register_strategies",
]
