"""Argument checks and table parsing of the network model (errors name the argument)."""

from __future__ import annotations

import math

import numbers
from collections.abc import Sequence
from typing import Any

Pair = tuple[int, int]
Table = Sequence[Sequence[float]]

# ---------------------------------------------------------------------- validation
def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(name: str, value: object) -> float:
    if not _is_number(value) or not value > 0:  # NaN fails too
        raise ValueError(f"{name} must be a number > 0 (math.inf allowed), got {value!r}")
    return float(value)


def _non_negative(name: str, value: object) -> float:
    if not _is_number(value) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _positive_finite(name: str, value: object) -> float:
    if not _is_number(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _finite(name: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _sequence(name: str, value: object) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _rows(name: str, table: object) -> list[list]:
    rows = [_sequence(f"{name}[{a}]", row) for a, row in enumerate(_sequence(name, table))]
    if not rows:
        raise ValueError(f"{name} must not be empty")
    return rows


def _table(name: str, table: Table, k: int, used_diagonal: set[int], check: Any) -> tuple[tuple[float, ...], ...]:
    """A validated k x k symmetric table; unused diagonal entries become NaN."""
    rows = _rows(name, table)
    if len(rows) != k or any(len(row) != k for row in rows):
        shape = f"{len(rows)} rows of lengths {[len(row) for row in rows]}"
        raise ValueError(f"{name} must be a {k} x {k} matrix (one row and column per cluster or rank), got {shape}")
    out = [[math.nan] * k for _ in range(k)]
    for a in range(k):
        for b in range(k):
            if a != b or a in used_diagonal:
                out[a][b] = check(f"{name}[{a}][{b}]", rows[a][b])
    for a in range(k):
        for b in range(a):
            if out[a][b] != out[b][a]:
                raise ValueError(f"{name} must be symmetric: [{a}][{b}] = {out[a][b]} but [{b}][{a}] = {out[b][a]}")
    return tuple(tuple(row) for row in out)


def _cluster_assignment(clusters: Sequence[int] | None, k: int) -> tuple[int, ...]:
    if clusters is None:
        return tuple(range(k))
    members = _sequence("clusters", clusters)
    if not members or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < k for c in members):
        raise ValueError(f"clusters must be a non-empty list of ints in [0, {k}) (k from the tables), got {clusters!r}")
    return tuple(members)


def _membership(sizes: Sequence[int] | None, assignment: Sequence[int] | None, world_size: int | None) -> list[int]:
    """Cluster of every rank, from block sizes or an explicit assignment."""
    if (sizes is None) == (assignment is None):
        raise ValueError("give exactly one of sizes (contiguous rank blocks) or assignment (cluster per rank)")
    if sizes is not None:
        blocks = [_positive_int(f"sizes[{c}]", s) for c, s in enumerate(_sequence("sizes", sizes))]
        members = [c for c, size in enumerate(blocks) for _ in range(size)]
    else:
        members = _sequence("assignment", assignment)
        k = len(set(members))
        if any(isinstance(c, bool) or not isinstance(c, int) for c in members) or set(members) != set(range(k)):
            raise ValueError(f"assignment must use every cluster index 0..k-1, got {assignment!r}")
    if not members:
        raise ValueError("sizes must not be empty")
    if world_size is not None and world_size != len(members):
        raise ValueError(f"the clusters hold {len(members)} ranks but world_size={world_size!r}")
    return members


def _cluster_table(intra_name: str, intra: object, inter_name: str, inter: object, k: int) -> list[list[object]]:
    """k x k table with the per-cluster intra values on the diagonal and the inter values off it."""
    diagonal = _sequence(intra_name, intra) if not _is_number(intra) else [intra] * k
    if len(diagonal) != k:
        raise ValueError(f"{intra_name} must be a number or one value per cluster ({k}), got {intra!r}")
    table = [[inter] * k for _ in range(k)] if _is_number(inter) else _rows(inter_name, inter)
    if len(table) != k or any(len(row) != k for row in table):
        raise ValueError(f"{inter_name} must be a number or a {k} x {k} matrix (one row per cluster), got {inter!r}")
    for c in range(k):
        table[c][c] = diagonal[c]
    return table


def _speeds(speeds: Sequence[float] | None, n: int) -> tuple[float, ...]:
    if speeds is None:
        return (1.0,) * n
    values = _sequence("speeds", speeds)
    if len(values) != n:
        raise ValueError(f"speeds must have one factor per worker ({n}), got {len(values)}")
    return tuple(_positive_finite(f"speeds[{r}]", s) for r, s in enumerate(values))

