"""The Lightning strategies: the local-steps round machinery, GASLoC, DiLoCo, baselines and callbacks."""

from gasloc_lightning.strategies.callbacks import GASLoCCallback, SimulatedClockCallback
from gasloc_lightning.strategies.diloco import DiLoCoStrategy
from gasloc_lightning.strategies.gasloc import GASLoCStrategy
from gasloc_lightning.strategies.local_steps import LocalStepsStrategy
from gasloc_lightning.strategies.registry import register_strategies

__all__ = [
    "DiLoCoStrategy",
    "GASLoCCallback",
    "GASLoCStrategy",
    "LocalStepsStrategy",
    "SimulatedClockCallback",
    "register_strategies",
]
