"""Registration of the strategy names with Lightning (there is no entry point for strategies)."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry


def register_strategies() -> list[str]:
    """Register ``gasloc*`` and ``diloco*`` names in ``lightning.pytorch``'s registry; safe to call twice.

    Returns the names this call added.
    """
    from gasloc_lightning.strategies.diloco import DiLoCoStrategy
    from gasloc_lightning.strategies.gasloc import GASLoCStrategy

    before = set(StrategyRegistry)
    for cls in (GASLoCStrategy, DiLoCoStrategy):
        cls.register_strategies(StrategyRegistry)
    return sorted(set(StrategyRegistry) - before)
