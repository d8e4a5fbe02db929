"""``PerRankCheckpointIO``: Lightning's checkpoint IO plugin for per-rank checkpoint directories.

GASLoC and DiLoCo strategies hold it as their ``checkpoint_io`` (the default). Every rank calls
``save_checkpoint`` with its own checkpoint; the plugin writes the rank's file and, on rank 0, the
shared file and ``meta.json`` (format: :mod:`gasloc_lightning.plugins.per_rank`). Paths are local
paths or fsspec URLs; ``storage_options`` reach fsspec. It can be wrapped in Lightning's
``AsyncCheckpointIO``: the files carry a save id, so their order of arrival does not matter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from typing_extensions import override

from gasloc_lightning.plugins import per_rank


class PerRankCheckpointIO(CheckpointIO):
    """Writes and reads per-rank checkpoint directories (and plain single-file checkpoints) through fsspec.

    A checkpoint with a ``"gasloc"`` entry (``{"rank", "world_size", "save_id", ...}``, added by the
    strategy) is written as this rank's part of a directory; one without is written as a single file.

    Loading is safe unless the caller passes ``weights_only=False`` (the strategy does when built with
    ``trust_checkpoint_code=True``): a file that needs an unsafe load is refused with
    :class:`~gasloc_lightning.plugins.per_rank.UntrustedCheckpointError`, naming it.

    Args:
        storage_options: fsspec options (e.g. credentials) for every path; the ``storage_options`` of
            one ``trainer.save_checkpoint`` call are merged over them.
    """

    def __init__(self, *, storage_options: Mapping[str, Any] | None = None) -> None:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ValueError(f"storage_options must be a mapping or None, got {type(storage_options).__name__}")
        self._storage_options = dict(storage_options or {})

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._storage_options)

    def _options(self, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping or None, got {type(storage_options).__name__}")
        return {**self._storage_options, **(storage_options or {})}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        options = self._options(storage_options)
        gasloc = checkpoint.get("gasloc")
        if gasloc is None:
            per_rank.save_file(checkpoint, path, options)
            return
        fs, directory = per_rank.filesystem(path, options)
        fs.makedirs(directory, exist_ok=True)  # every rank: per-node disks each need it
        shared, own = per_rank.split_checkpoint(checkpoint)
        per_rank.save_file(own, per_rank.rank_file(path, gasloc["rank"]), options)
        if gasloc["rank"] == 0:
            shared["gasloc"] = {"save_id": gasloc["save_id"]}
            per_rank.save_file(shared, per_rank.join(path, per_rank.SHARED_FILE), options)
            per_rank.write_meta(path, world_size=gasloc["world_size"], global_step=int(checkpoint.get("global_step", 0)),
                                save_id=gasloc["save_id"], storage_options=options)

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> dict[str, Any]:
        """This rank's checkpoint from a per-rank directory (``rank`` and ``world_size`` needed), or a single file.

        ``weights_only=None`` (Lightning's default) loads safely, as ``True`` does.
        """
        options = {"weights_only": weights_only is not False, "map_location": map_location or "cpu",
                   "storage_options": self._storage_options}
        if not per_rank.is_per_rank_checkpoint(path, self._storage_options):
            return per_rank.load_file(path, **options)
        if rank is None or world_size is None:
            raise ValueError(
                f"{path} is a per-rank checkpoint directory: loading it needs rank= and world_size= (the strategy "
                "passes them); to get one model out of it, use gasloc-export"
            )
        return per_rank.load_rank_checkpoint(path, rank, world_size, **options)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        fs, fs_path = per_rank.filesystem(path, self._storage_options)
        if fs.exists(fs_path):
            fs.rm(fs_path, recursive=True)


def resolve_checkpoint_io(checkpoint_io: CheckpointIO | None) -> CheckpointIO:
    """The checkpoint IO a per-rank strategy holds: ``PerRankCheckpointIO`` by default, also inside a wrapper
    such as ``AsyncCheckpointIO`` that was given none; any other base plugin is refused."""
    if checkpoint_io is None:
        return PerRankCheckpointIO()
    innermost, wrapper = checkpoint_io, None
    while isinstance(innermost, _WrappingCheckpointIO):
        innermost, wrapper = innermost.checkpoint_io, innermost
    if innermost is None:
        wrapper.checkpoint_io = PerRankCheckpointIO()
    elif not isinstance(innermost, PerRankCheckpointIO):
        raise ValueError(
            f"checkpoint_io={type(checkpoint_io).__name__}: GASLoC and DiLoCo write one file per rank and need a "
            f"PerRankCheckpointIO (got {type(innermost).__name__} inside). Leave checkpoint_io out, or pass "
            "PerRankCheckpointIO(storage_options=...), or AsyncCheckpointIO(PerRankCheckpointIO())."
        )
    return checkpoint_io
