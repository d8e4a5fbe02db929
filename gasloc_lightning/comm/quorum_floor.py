"""The quorum floor of elastic mode: ``min_workers`` is a majority of the workers the run allows, by default.

torchft's lighthouse forms a quorum from whichever workers reach it, as soon as ``min_workers`` (its
``--min_replicas``) of them do. Nothing stops two sides of a network partition from each holding
``min_workers`` and forming quorums of their own (for example a side that lost the lighthouse and reaches it
again while the other side still trains): they then train apart and the run ends on two models. This was seen in
the network lab with 2 + 2 workers and ``min_workers=2`` (``docs/netlab.md``). Two disjoint sides cannot both
hold a majority of the ``max_workers`` the run allows, so with ``min_workers > max_workers / 2`` at most one side
ever trains, and the other waits.

A smaller floor (a run that must go on with fewer survivors) is allowed only when asked for by name
(``allow_split_quorum``), and then it warns, saying what it risks. Pure arithmetic: no torchft, no Lightning.
"""

from __future__ import annotations

from typing import Any

SPLIT_RISK = ("two sides of a network partition can each hold that many workers and form quorums of their own: "
              "they train apart and the run can end on two models")


class SplitQuorumWarning(UserWarning):
    """``allow_split_quorum``: ``min_workers`` is at most half of ``max_workers``, so a partition can split the run."""


def majority(workers: int) -> int:
    """The smallest number of workers that two disjoint groups of ``workers`` cannot both hold: W // 2 + 1."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    return workers // 2 + 1


def quorum_floor(min_workers: Any, max_workers: int, *, allow_split_quorum: bool, prefix: str = "") -> int:
    """``min_workers`` resolved and checked against the majority rule.

    Args:
        min_workers: the smallest quorum a round runs in; ``None``: a majority of ``max_workers``.
        max_workers: the most workers the run allows (the majority is of them).
        allow_split_quorum: accept a ``min_workers`` below the majority (the caller warns: :func:`split_warning`).
        prefix: what the caller's keys start with in errors (``"elastic."`` for the launcher's config).

    Raises:
        ValueError: ``min_workers`` below the majority without ``allow_split_quorum``, naming it; or not an int in
            [1, ``max_workers``].
    """
    floor = majority(max_workers)
    if min_workers is None:
        return floor
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or not 1 <= min_workers <= max_workers:
        raise ValueError(f"{prefix}min_workers must be null (a majority) or an int in [1, {prefix}max_workers="
                         f"{max_workers}], got {min_workers!r}")
    if min_workers < floor and not allow_split_quorum:
        raise ValueError(
            f"{prefix}min_workers={min_workers} is not a majority of {max_workers} workers (that is {floor}): "
            f"{SPLIT_RISK}. Leave {prefix}min_workers unset for {floor}, or pass "
            f"{prefix}allow_split_quorum=true to accept that risk")
    return min_workers


def is_split_quorum(min_workers: int, max_workers: int) -> bool:
    """Whether two disjoint sides of ``max_workers`` workers can each hold ``min_workers``."""
    return min_workers < majority(max_workers)


def split_warning(min_workers: int, max_workers: int, prefix: str = "") -> str:
    """What an allowed split floor risks, for the caller's warning."""
    return (f"{prefix}min_workers={min_workers} is not a majority of {max_workers} workers "
            f"({prefix}allow_split_quorum=true): {SPLIT_RISK} (gasloc-elastic and gasloc-netlab then exit 3, "
            "naming them)")
