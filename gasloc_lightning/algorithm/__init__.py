"""The math of GASLoC on plain tensors: the outer step and mixing, and the stability analysis.

No Lightning and no process group here: every function takes tensors and numbers.
"""

from gasloc_lightning.algorithm.outer import OuterState, mix, validate_outer_hyperparameters

__all__ = ["OuterState", "mix", "validate_outer_hyperparameters"]
