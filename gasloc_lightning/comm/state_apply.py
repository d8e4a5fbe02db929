"""Apply a peer's state (a heal) all or nothing.

A heal replaces several pieces of a worker's state one after the other: the live point, the outer
(strategy) state, each optimizer, each LR scheduler. The received state is checked first
(:mod:`~gasloc_lightning.comm.wire`), but a check cannot foresee every way a ``load_state_dict`` may
raise (an optimizer can refuse a state its checks let through). Without a rollback such an error leaves
the worker half healed: the peer's point with its own optimizer, say, and an error that is not one of the
refusals. :func:`apply_all_or_nothing` saves a copy of every piece first, loads them in order and, if any
load raises (whatever the exception), loads the saved copies back into the pieces it touched, in reverse
order, before the error goes on.

The cost is one copy of the replaced state (about as large as the received one) held for the duration of
the heal. Nothing here imports Lightning or torchft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gasloc_lightning.comm.wire import UnsafePayloadError

log = logging.getLogger(__name__)


class StateApplyError(UnsafePayloadError):
    """Loading a peer's state raised; every piece was restored to what it held before (nothing was applied)."""


class StateRollbackError(RuntimeError):
    """Loading a peer's state raised, and so did restoring a saved piece: the worker's state is inconsistent."""


@dataclass(frozen=True)
class StatePart:
    """One piece of a worker's state that a heal replaces.

    Args:
        name: the piece's name in error messages, e.g. ``"optimizers.0"``.
        save: returns the piece's current state (it is copied before anything is loaded).
        load: replaces the piece's state with the one given (the peer's, or the saved copy on a rollback).
    """

    name: str
    save: Callable[[], Any]
    load: Callable[[Any], None]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        for argument in ("save", "load"):
            if not callable(getattr(self, argument)):
                raise ValueError(f"{argument} must be callable, got {getattr(self, argument)!r}")


def apply_all_or_nothing(parts: Sequence[tuple[StatePart, Any]]) -> None:
    """Load each ``(part, received)`` in order; if any load raises, restore every part touched so far.

    Args:
        parts: the pieces to replace, each with the peer's state for it.

    Raises:
        StateApplyError: a load raised an ``Exception``; every piece holds its state from before the call.
        StateRollbackError: a load raised and then restoring a piece raised too.
        BaseException: a ``KeyboardInterrupt`` or ``SystemExit`` during a load goes on as is, after the rollback.
    """
    saved = [(part, copied(part.save())) for part, _ in parts]  # all saved before anything changes
    touched: list[tuple[StatePart, Any]] = []
    for (part, received), (_, own) in zip(parts, saved):
        touched.append((part, own))  # before the load: one that raises halfway has changed part of the piece
        try:
            part.load(received)
        except BaseException as error:
            _roll_back(touched, error)
            if not isinstance(error, Exception):
                raise
            raise StateApplyError(f"loading {part.name} raised {type(error).__name__}: "
                                  f"{(str(error).splitlines() or [''])[0][:300]} (every piece was restored; "
                                  "nothing was applied)") from error


def _roll_back(touched: list[tuple[StatePart, Any]], cause: BaseException) -> None:
    failed: list[tuple[str, BaseException]] = []
    for part, own in reversed(touched):  # every piece is tried, even after one fails (or a second Ctrl-C)
        try:
            part.load(own)
        except BaseException as error:
            failed.append((part.name, error))
    if failed:
        name, error = failed[0]
        raise StateRollbackError(f"restoring {', '.join(n for n, _ in failed)} after a failed heal "
                                 f"({type(cause).__name__}) raised {type(error).__name__}: {error}; this worker's "
                                 "state is inconsistent") from error
    log.warning("heal rolled back parts=%s cause=%s", ",".join(part.name for part, _ in touched),
                type(cause).__name__)


def copied(value: Any) -> Any:
    """A copy of ``value`` whose tensors own their storage: a later in-place load cannot change it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(item) for item in value)
    return value
