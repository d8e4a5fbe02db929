"""Did an elastic run end on one model? The finished workers grouped by their final model, and the split report.

Elastic mode promises that the workers that finish end on one model. A run whose quorum floor allows a split
(``elastic.allow_split_quorum=true``) can break that promise under a partition: two sides train apart and each
ends on its own model. Such a run must not look finished: ``gasloc-elastic`` and ``gasloc-netlab`` group the
finished workers by the checksum of their final model (``model_checksum`` in each worker's progress) and, when
there is more than one group, print every group (workers, checksum, final validation loss), the ``gasloc-export``
command that merges them (each group's final checkpoint, one weight per group), and exit with
:data:`SPLIT_EXIT_CODE`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLIT_EXIT_CODE = 3  # the run ended on several models (1: a worker failed; 2: a setting cannot work)
MERGED_FILE = "merged.ckpt"


@dataclass(frozen=True)
class ModelGroup:
    """Finished workers that ended on one model."""

    checksum: float | None
    workers: tuple[int, ...]
    val_loss: float | None  # the first worker's (the same model: the same loss, up to evaluation order)
    checkpoint: str | None  # a final checkpoint of this model (the first worker's that has one)


class SplitRunError(RuntimeError):
    """The finished workers ended on more than one model (the message names every group and the merge command)."""

    def __init__(self, message: str, groups: list[ModelGroup]) -> None:
        super().__init__(message)
        self.groups = groups


def model_groups(rows: list[dict[str, Any]]) -> list[ModelGroup]:
    """The finished workers of a launcher summary (``rows``: its ``workers``) grouped by ``model_checksum``,
    the largest group first (ties: the one with the lowest worker id)."""
    by_checksum: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "finished":
            by_checksum.setdefault(row.get("model_checksum"), []).append(row)
    groups = [ModelGroup(checksum=checksum, workers=tuple(row["worker"] for row in members),
                         val_loss=members[0].get("val_loss"),
                         checkpoint=next((row["final_checkpoint"] for row in members if row.get("final_checkpoint")),
                                         None))
              for checksum, members in by_checksum.items()]
    return sorted(groups, key=lambda group: (-len(group.workers), min(group.workers)))


def merge_command(groups: list[ModelGroup], output: Path | str) -> str | None:
    """The ``gasloc-export`` command that averages the groups' models into ``output`` (one weight per group);
    None when a group has no final checkpoint."""
    if any(group.checkpoint is None for group in groups):
        return None
    return shlex.join(["gasloc-export", *(str(group.checkpoint) for group in groups), str(output)])


def split_report(groups: list[ModelGroup], run_dir: Path | str) -> str:
    """What a run that ended on several models prints: each group and the command that merges them."""
    lines = [f"the run ended on {len(groups)} models, not one (a partition split it: the finished workers trained "
             "apart):"]
    for index, group in enumerate(groups):
        loss = "-" if group.val_loss is None else f"{group.val_loss:.4f}"
        lines.append(f"  model {index}: workers {list(group.workers)} checksum {group.checksum!r} val_loss {loss}")
    command = merge_command(groups, Path(run_dir) / MERGED_FILE)
    if command is None:
        lines.append("  no final checkpoint for every model: nothing to merge")
    else:
        lines.append(f"  merge them (each model one weight) with: {command}")
    return "\n".join(lines)


def raise_if_split(summary: dict[str, Any], run_dir: Path | str, prefix: str = "") -> None:
    """Raise :class:`SplitRunError` (``prefix`` starts its message) when the finished workers of ``summary`` (a
    launcher summary) ended on more than one model."""
    groups = model_groups(summary["workers"])
    if len(groups) > 1:
        raise SplitRunError(prefix + split_report(groups, run_dir), groups)
