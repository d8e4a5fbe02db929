"""Evaluation on the consensus model: the average of the replicas, swapped in and out of the live model.

Validation, test and predict run on the average of every worker's replica (the model the run would
deliver), while training continues from each worker's own replica afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gasloc_lightning.comm.flat import FlatLayout

ReplicaMean = Callable[[Tensor], Tensor]


class ConsensusSwap:
    """Swaps the replicas' average into the live model and back.

    Args:
        layout: the flat layout of the live model.
        replica_mean: returns the average of a flat vector over every replica (a collective), in a
            buffer of its own that stays valid until the next call.
        drain: finishes any exchange in flight before the live point is read.
    """

    def __init__(self, layout: FlatLayout, replica_mean: ReplicaMean, drain: Callable[[], None]) -> None:
        self._layout = layout
        self._replica_mean = replica_mean
        self._drain = drain
        self._backup: Tensor | None = None  # the local replica while the consensus is swapped in
        self._mean: Tensor | None = None
        self._swapped_in = False

    @property
    def swapped_in(self) -> bool:
        return self._swapped_in

    @torch.no_grad()
    def swap_in(self) -> None:
        """Replace the replica by the average of all replicas (a collective); ``restore`` undoes it."""
        if self._swapped_in:
            return
        self._drain()
        if self._backup is None:  # allocated at the first evaluation, kept for the next ones
            self._backup = self._layout.new_buffer()
        self._layout.gather(self._backup)
        self._mean = self._replica_mean(self._backup)
        self._layout.scatter(self._mean)
        self._swapped_in = True

    @torch.no_grad()
    def show_local(self) -> None:
        """While swapped in: put the local replica back temporarily (no communication)."""
        if self._swapped_in:
            self._layout.scatter(self._backup)

    @torch.no_grad()
    def show_consensus(self) -> None:
        """Undo ``show_local`` (the average is still in its buffer)."""
        if self._swapped_in:
            self._layout.scatter(self._mean)

    @torch.no_grad()
    def restore(self) -> None:
        if self._swapped_in:
            self._layout.scatter(self._backup)
            self._swapped_in = False

    @torch.no_grad()
    def make_permanent(self) -> None:
        """Replace every replica by the average for good (end of fit)."""
        self.restore()
        self.swap_in()
        self._swapped_in = False
