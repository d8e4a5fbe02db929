"""When each fragment of a streamed round leaves and when it lands: pure arithmetic on step counts.

A round of H inner steps syncs F fragments of the model in turn (Streaming DiLoCo, and GASLoC's fragment
gossip). Fragment f *lands* (its outer step is performed) after inner step ``perform_at[f] = floor((f+1) H
/ F)`` of the round, so the last one lands as the round ends, and *leaves* (its message is computed and
posted) ``tau = fragment_sync_delay`` steps earlier, after step ``perform_at[f] - tau``; the tau steps in
between hide the transfer under compute. When F divides H this is torchft 0.2.0's schedule exactly
(``DiLoCo``: fragment f every h = H / F steps, from fragment 0); otherwise the landing points are the
nearest steps to the even split, which torchft refuses.

Each fragment carries 1/F of the bytes, so the peak bandwidth is 1/F of a whole-model round's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FragmentPoints:
    """The steps (1 to H, within a round) at which each fragment leaves and lands.

    Args:
        inner_steps: H, steps per round.
        fragments: F in [1, H].
        fragment_sync_delay: tau, steps between leaving and landing; at most :func:`max_fragment_sync_delay`.
    """

    inner_steps: int
    fragments: int
    fragment_sync_delay: int = 0

    def __post_init__(self) -> None:
        _check_int("inner_steps", self.inner_steps, 1)
        _check_int("fragments", self.fragments, 1)
        if self.fragments > self.inner_steps:
            raise ValueError(f"fragments (F={self.fragments}) must be <= inner_steps (H={self.inner_steps}): "
                             "one fragment lands per step at most")
        _check_int("fragment_sync_delay", self.fragment_sync_delay, 0)
        limit = max_fragment_sync_delay(self.inner_steps, self.fragments)
        if self.fragment_sync_delay > limit:
            raise ValueError(f"fragment_sync_delay (tau={self.fragment_sync_delay}) must be <= {limit} with "
                             f"inner_steps={self.inner_steps} and fragments={self.fragments}: a fragment must land "
                             "before the next one leaves")

    @property
    def perform_at(self) -> list[int]:
        return [((f + 1) * self.inner_steps) // self.fragments for f in range(self.fragments)]

    @property
    def prepare_at(self) -> list[int]:
        return [step - self.fragment_sync_delay for step in self.perform_at]

    def leaving(self, step_in_round: int) -> int | None:
        """The fragment that leaves after this step of the round (1 to H), or None."""
        return _index(self.prepare_at, self._check_step(step_in_round))

    def landing(self, step_in_round: int) -> int | None:
        """The fragment that lands after this step of the round, or None (after :meth:`leaving` on a tie)."""
        return _index(self.perform_at, self._check_step(step_in_round))

    def _check_step(self, step_in_round: int) -> int:
        if isinstance(step_in_round, bool) or not isinstance(step_in_round, int) or \
                not 1 <= step_in_round <= self.inner_steps:
            raise ValueError(f"step_in_round must be an int in [1, {self.inner_steps}], got {step_in_round!r}")
        return step_in_round


def resolve_points(inner_steps: int, fragments: int, fragment_sync_delay: int = 0,
                   overlap: bool = False) -> FragmentPoints:
    """The schedule of a streamed round. ``overlap=True`` hides each transfer under one step of compute (tau = 1,
    Streaming DiLoCo's usual setting: with alpha = 0 that one step of the fragment is dropped, a longer tau drops
    more), when the schedule has room for it; set ``fragment_sync_delay`` for more."""
    if overlap and fragment_sync_delay:
        raise ValueError("overlap=True chooses fragment_sync_delay itself: leave fragment_sync_delay at 0")
    if overlap and fragments <= inner_steps:
        fragment_sync_delay = min(1, max_fragment_sync_delay(inner_steps, fragments))
    return FragmentPoints(inner_steps, fragments, fragment_sync_delay)


def max_fragment_sync_delay(inner_steps: int, fragments: int) -> int:
    """The largest tau such that every fragment lands before the next one leaves (torchft: tau < H / F)."""
    points = [((f + 1) * inner_steps) // fragments for f in range(fragments)]
    gaps = [points[0]] + [b - a for a, b in zip(points, points[1:])]
    return min(gaps) - 1


def _index(points: list[int], step: int) -> int | None:
    return points.index(step) if step in points else None


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
