"""The round schedule: H_i optimizer steps per worker, max_i H_i steps of the training loop per round.

Every rank counts the same optimizer steps (Lightning calls ``optimizer_step`` once per real step,
also when a precision plugin skips the update), so every rank enters round t at the same step and
every collective is reached by all ranks in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from gasloc_lightning.network import NetworkModel

InnerSteps = int | Sequence[int] | Literal["auto"]


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class RoundSchedule:
    """Where each rank stands in the rounds, and how many steps it applies in one.

    Args:
        inner_steps: H (one int), one H_i per rank, or ``"auto"`` (H_i from the network's speeds).
        network: the modelled network, needed by ``"auto"``.
        fastest_inner_steps: with ``"auto"``, H of the fastest worker.
    """

    def __init__(
        self, inner_steps: InnerSteps, network: NetworkModel | None = None, fastest_inner_steps: int = 50
    ) -> None:
        if inner_steps == "auto" and network is None:
            raise ValueError("inner_steps='auto' needs a network model (network=NetworkModel(...)) for the speeds")
        check_positive_int("fastest_inner_steps", fastest_inner_steps)
        steps = [] if inner_steps == "auto" else [inner_steps] if isinstance(inner_steps, int) else inner_steps
        for value in steps:
            check_positive_int("inner_steps (H)", value)
        self._inner_steps: int | list[int] | str = (
            inner_steps if isinstance(inner_steps, (int, str)) else list(inner_steps)
        )
        self._network = network
        self._fastest_inner_steps = fastest_inner_steps
        self.round_index = 0
        self.steps_in_round = 0

    def resolve(self, world_size: int, ranks_per_worker: int) -> None:
        """Fix one H_i per rank for ``world_size`` ranks; the ranks of one worker must share it."""
        if self._inner_steps == "auto":  # one H_i per worker, repeated for each of its ranks
            per_worker = self._network.auto_inner_steps(self._fastest_inner_steps)
            self._inner_steps = [per_worker[rank // ranks_per_worker] for rank in range(world_size)]
        if isinstance(self._inner_steps, int):
            return
        if len(self._inner_steps) != world_size:
            raise ValueError(
                f"inner_steps has {len(self._inner_steps)} values (one H_i per rank) but the world size is {world_size}"
            )
        for first in range(0, world_size, ranks_per_worker):
            worker = self._inner_steps[first : first + ranks_per_worker]
            if len(set(worker)) > 1:
                raise ValueError(
                    f"inner_steps must be equal on the ranks of one worker (they train as one DDP replica): ranks "
                    f"{first}..{first + ranks_per_worker - 1} have {worker} (ranks_per_worker={ranks_per_worker})"
                )

    def inner_steps(self, rank: int) -> int:
        """H_i of ``rank``."""
        return self._inner_steps if isinstance(self._inner_steps, int) else self._inner_steps[rank]

    @property
    def round_length(self) -> int:
        """Steps of the training loop per round: max over ranks of H_i (the same on every rank)."""
        return self._inner_steps if isinstance(self._inner_steps, int) else max(self._inner_steps)

    @property
    def at_round_start(self) -> bool:
        return self.steps_in_round == 0

    def applies_step(self, rank: int) -> bool:
        """Whether ``rank`` applies the current step (a worker with H_i < max H_i computes, but does not
        apply, its last steps of the round: a slower worker does fewer updates in the same time)."""
        return self.steps_in_round < self.inner_steps(rank)

    def count_step(self) -> bool:
        """Count one step of the training loop; True when the round is complete."""
        self.steps_in_round += 1
        return self.steps_in_round >= self.round_length

    def finish_round(self) -> None:
        self.round_index += 1
        self.steps_in_round = 0

    def reset(self) -> None:
        self.round_index, self.steps_in_round = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"round_index": self.round_index, "steps_in_round": self.steps_in_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round_index = int(state["round_index"])
        self.steps_in_round = int(state["steps_in_round"])
