"""Per-rank checkpoint directories: the format, its file helpers and the consensus export.

In GASLoC every rank holds different parameters, its own inner and outer optimizer state, its own
RNG streams and its own data position, so a checkpoint is a directory::

    epoch=0-step=100.ckpt/
        meta.json     format, world size, global step and the save's id, written by rank 0
        shared.ckpt   epoch, step and hyper-parameters: identical on every rank, written by rank 0
        rank_0.ckpt   rank 0's replica, optimizer and scheduler states, loops (its dataloader's position),
                      callbacks, GASLoC state, RNG states
        rank_1.ckpt   ...

Each file is written through fsspec in a transaction (to a temporary file, moved on commit, as
Lightning's own ``_atomic_save``), so paths may be local paths or URLs (``file://``, ``s3://``,
``memory://``...). The files are written in any order, also from ``AsyncCheckpointIO``'s thread:
a directory is complete when ``meta.json`` exists and ``shared.ckpt`` and every rank file carry
its save id, so a reader tells a complete directory from one that a crash (or a save still in
flight) left mixed. The matching sequence needs no saving: it is a pure function of seed and round.

Loading is safe by default: ``torch.load(weights_only=True)``, which runs no code from the file.
Checkpoints written by this package hold only tensors and plain data (the numpy RNG state is
stored as a tensor), so they load that way. A file that needs more (e.g. hyper-parameters holding a
``functools.partial``) is refused with an :class:`UntrustedCheckpointError` naming it, unless the
caller opts in (the strategy's ``trust_checkpoint_code=True``, ``gasloc-export --trust-checkpoint-code``,
``weights_only=False`` here), which lets the file run code: only for files you trust.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

FORMAT = "gasloc-per-rank-v2"
READABLE_FORMATS = ("gasloc-per-rank-v1", FORMAT)  # v1: loops and callbacks in shared.ckpt, no save id
META_FILE = "meta.json"
SHARED_FILE = "shared.ckpt"
# Identical on every rank: kept once, in the shared file. Loops (which hold stateful dataloaders'
# positions) and callbacks differ per rank and stay in the rank files.
SHARED_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name",
               "datamodule_hyper_parameters", "hparams_type")
TRUST_HINT = ("pass trust_checkpoint_code=True to the strategy (GASLoCStrategy(..., trust_checkpoint_code=True)), "
              "use gasloc-export --trust-checkpoint-code, or weights_only=False in a direct call")


class CheckpointFormatError(RuntimeError):
    """A checkpoint file or directory is missing, truncated or not in the expected format."""


class UntrustedCheckpointError(CheckpointFormatError):
    """A checkpoint file holds objects that only an unsafe load (``weights_only=False``) would build."""


# ------------------------------------------------------------------ paths
def filesystem(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of a local path or URL, and the path inside it."""
    return url_to_fs(os.fspath(path), **dict(storage_options or {}))


def join(directory: str | os.PathLike, name: str) -> str:
    """``directory/name`` for local paths and URLs alike (``pathlib`` would turn ``file:///x`` into ``file:/x``)."""
    return os.fspath(directory).rstrip("/") + "/" + name


def rank_file(directory: str | os.PathLike, rank: int) -> str:
    return join(directory, f"rank_{rank}.ckpt")


def is_per_rank_checkpoint(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bool:
    fs, directory = filesystem(path, storage_options)
    return fs.isfile(join(directory, META_FILE))


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the keys shared by all ranks from this rank's own."""
    shared = {k: v for k, v in checkpoint.items() if k in SHARED_KEYS}
    own = {k: v for k, v in checkpoint.items() if k not in SHARED_KEYS}
    return shared, own


# ------------------------------------------------------------------ RNG states
def rng_state_dict() -> dict[str, Any]:
    """Lightning's RNG states (torch, CUDA once initialised, numpy, Python), numpy's keys as a tensor so
    the file loads with ``weights_only=True``."""
    include_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never initialise CUDA here
    states = _collect_rng_states(include_cuda=include_cuda)
    name, keys, position, has_gauss, gauss = states["numpy"]
    states["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)
    return states


def load_rng_state_dict(states: Mapping[str, Any]) -> None:
    """Restore states from :func:`rng_state_dict` (or a v1 checkpoint's, which had no numpy state)."""
    states = dict(states)
    if "cuda" in states:  # v1's name
        states["torch.cuda"] = states.pop("cuda")
    if "numpy" in states:
        name, keys, position, has_gauss, gauss = states["numpy"]
        states["numpy"] = (name, keys.numpy().astype(np.uint32), position, has_gauss, gauss)
    _set_rng_states(states)


# ------------------------------------------------------------------ files
def save_file(obj: Any, path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """``torch.save`` to a local path or URL, committed whole. As Lightning's ``_atomic_save``, which takes
    no ``storage_options``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _write_bytes(buffer.getvalue(), path, storage_options)


def _write_bytes(data: bytes, path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> None:
    fs, fs_path = filesystem(path, storage_options)
    with fs.transaction, fs.open(fs_path, "wb") as file:  # a temporary file, moved to fs_path on commit
        file.write(data)


def load_file(
    path: str | os.PathLike,
    *,
    weights_only: bool = True,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``torch.load`` of a local path or URL, safe unless ``weights_only=False``, with errors that name the file."""
    fs, fs_path = filesystem(path, storage_options)
    if not fs.isfile(fs_path):
        raise CheckpointFormatError(f"checkpoint file {path} is missing")
    try:
        with fs.open(fs_path, "rb") as file:
            return torch.load(file, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if weights_only and "weights_only" in str(error).lower():
            raise UntrustedCheckpointError(
                f"checkpoint file {path} holds objects that a safe load (weights_only=True) refuses: loading it "
                f"would run code from the file. If you trust the file, {TRUST_HINT}. Refused: "
                f"{_first_line(error)}"
            ) from error
        raise CheckpointFormatError(f"checkpoint file {path} is corrupt or not a torch checkpoint: {error}") from error
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointFormatError(f"checkpoint file {path} is truncated or not a torch checkpoint: {error}") from error


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if "Unsupported global" in line or "GLOBAL" in line]
    return (lines or str(error).splitlines() or [""])[0].strip()


# ------------------------------------------------------------------ meta.json
def write_meta(
    directory: str | os.PathLike,
    *,
    world_size: int,
    global_step: int,
    save_id: int,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    meta = {"format": FORMAT, "world_size": world_size, "global_step": global_step, "save_id": save_id}
    _write_bytes(json.dumps(meta, indent=2).encode(), join(directory, META_FILE), storage_options)


def read_meta(directory: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    path = join(directory, META_FILE)
    fs, fs_path = filesystem(path, storage_options)
    if not fs.isfile(fs_path):
        raise CheckpointFormatError(
            f"{directory} is not a complete GASLoC checkpoint directory (no {META_FILE}: it was not written to "
            "the end, or it is a single-file checkpoint)"
        )
    try:
        meta = json.loads(fs.cat_file(fs_path))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointFormatError(f"{path} is unreadable: {error}") from error
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointFormatError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _check_save_id(meta: Mapping[str, Any], part: Mapping[str, Any], path: str) -> None:
    if "save_id" not in meta:  # v1
        return
    found = part.get("gasloc", {}).get("save_id")
    if found != meta["save_id"]:
        raise CheckpointFormatError(
            f"checkpoint file {path} belongs to another save than its directory's {META_FILE} (save id {found} != "
            f"{meta['save_id']}): the directory was not written to the end (a crash, or a save still in flight)"
        )


# ------------------------------------------------------------------ reading and exporting
def load_rank_checkpoint(
    directory: str | os.PathLike,
    rank: int,
    world_size: int,
    *,
    weights_only: bool = True,
    map_location: Any = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The full Lightning checkpoint of ``rank``: the shared part merged with the rank's own file.

    Args:
        directory: a per-rank checkpoint directory (local path or URL).
        rank, world_size: the reading rank, and the world size it runs with (must be the saved one).
        weights_only: False lets the files run code while loading: only for files you trust.
        map_location, storage_options: as in ``torch.load`` and fsspec.
    """
    meta = read_meta(directory, storage_options)
    if meta["world_size"] != world_size:
        raise CheckpointFormatError(
            f"checkpoint {directory} was saved by {meta['world_size']} workers, this run has {world_size}: "
            "per-rank state (replicas, optimizer and outer state) cannot be redistributed. Export the consensus "
            f"model with `gasloc-export {directory} consensus.ckpt` and start a new run from it "
            "(e.g. LightningModule.load_from_checkpoint), or resume with the original world size."
        )
    options = {"weights_only": weights_only, "map_location": map_location, "storage_options": storage_options}
    checkpoint = {}
    for path in (join(directory, SHARED_FILE), rank_file(directory, rank)):
        part = load_file(path, **options)
        _check_save_id(meta, part, path)
        checkpoint.update(part)
    saved_rank = checkpoint.get("gasloc", {}).get("rank", rank)
    if saved_rank != rank:
        raise CheckpointFormatError(f"checkpoint file {rank_file(directory, rank)} holds rank {saved_rank}'s state")
    return checkpoint


def export_consensus(
    directory: str | os.PathLike | Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Average the replicas of a per-rank checkpoint into one standard Lightning checkpoint.

    The result loads with ``LightningModule.load_from_checkpoint`` and with plain
    ``torch.load(...)["state_dict"]``. Floating tensors are averaged; integer ones (step counters)
    are taken from rank 0. DDP inside a worker stores its replica once per rank: the mean is the same.

    Several directories (e.g. the final checkpoints of an elastic run that ended on two models, one per model,
    as ``gasloc-elastic`` prints them) are merged with one weight each: each directory's replicas are averaged,
    then the directories' averages. Integer tensors and the step come from the first directory.

    A sharded run (``intra_worker="fsdp"``) is assembled first: each worker's k rank files hold one shard of its
    replica each, put together in shard order, so the result is the whole model.

    Args:
        directory: the per-rank checkpoint directory, or several (local paths or URLs).
        output: the file to write (a local path or URL).
        weights_only: False lets the files run code while loading: only for files you trust.
        storage_options: fsspec options for every path.

    Returns:
        ``{"world_size", "replicas", "consensus_distance", "directories"}``: the rank files and replicas read (over
        every directory), the weighted mean squared distance of the replicas to the average, over floating tensors,
        that the export averaged away, and how many directories were merged.
    """
    directories = [directory] if isinstance(directory, (str, os.PathLike)) else list(directory)
    if not directories:
        raise CheckpointFormatError("no checkpoint directory to export")
    options = {"weights_only": weights_only, "storage_options": storage_options}
    first, states, weights, world_size = None, [], [], 0
    for path in directories:
        size = read_meta(path, storage_options)["world_size"]
        ranks = [load_rank_checkpoint(path, r, size, **options) for r in range(size)]
        replicas = _replicas(ranks)
        first, world_size = first or ranks[0], world_size + size
        states += replicas
        weights += [1.0 / (len(directories) * len(replicas))] * len(replicas)  # one weight per directory
    average = {}
    distance = 0.0
    for name, reference in states[0].items():
        if not torch.is_floating_point(reference):
            average[name] = reference.clone()
            continue
        if any(name not in state or state[name].shape != reference.shape for state in states):
            raise CheckpointFormatError(f"entry {name!r} differs in shape or is missing across the checkpoints: "
                                        "they are not replicas of one model")
        stacked = torch.stack([s[name].double() for s in states])  # (replicas, ...)
        w = torch.tensor(weights, dtype=torch.float64).reshape(-1, *([1] * reference.dim()))
        mean = (w * stacked).sum(0)
        distance += float((w * (stacked - mean) ** 2).sum())
        average[name] = mean.to(reference.dtype)
    exported = {k: v for k, v in first.items() if k in ("epoch", "global_step", "pytorch-lightning_version",
                                                         "hyper_parameters", "hparams_name")}
    exported["state_dict"] = average
    sources = [os.fspath(path) for path in directories]
    exported["gasloc_export"] = {"source": sources[0] if len(sources) == 1 else sources, "world_size": world_size,
                                 "replicas": len(states), "consensus_distance": distance}
    save_file(exported, output, storage_options)
    return {"world_size": world_size, "replicas": len(states), "consensus_distance": distance,
            "directories": len(directories)}


def _replicas(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One whole state dict per replica. Ranks of a sharded worker (``gasloc["shards"]``: its index, the count
    k and the names of the sharded entries) each hold the dim-0 chunk ``index`` of those entries, as FSDP2 shards
    them: a worker's k consecutive ranks are put together in shard order; their other entries are shard 0's.

    The rank files are untrusted input: anything that does not describe k whole shards of one model is a
    :class:`CheckpointFormatError`, not a traceback."""
    described = [rank.get("gasloc", {}).get("shards") for rank in ranks]
    if all(shards is None for shards in described):
        return [rank["state_dict"] for rank in ranks]
    if any(not isinstance(shards, Mapping) for shards in described):
        raise CheckpointFormatError("some rank files hold shards of a sharded worker and some do not: the "
                                    "directory mixes checkpoints")
    k, sharded = described[0].get("count"), described[0].get("sharded")
    if (isinstance(k, bool) or not isinstance(k, int) or k < 1 or len(ranks) % k
            or not isinstance(sharded, (list, tuple)) or not all(isinstance(name, str) for name in sharded)):
        raise CheckpointFormatError(f"rank 0's shard description (count {k!r} for {len(ranks)} rank files, sharded "
                                    "entries) is malformed")
    if any(shards.get("count") != k or list(shards.get("sharded", ())) != list(sharded) for shards in described):
        raise CheckpointFormatError("the rank files disagree on the shard count or on which entries are sharded")
    sharded = set(sharded)
    replicas = []
    for first in range(0, len(ranks), k):
        worker = ranks[first : first + k]
        indices = [shards.get("index") for shards in described[first : first + k]]
        if indices != list(range(k)):
            raise CheckpointFormatError(f"ranks {first}..{first + k - 1} hold shards {indices}, expected 0..{k - 1}")
        names = set(worker[0]["state_dict"])
        if not sharded <= names or any(set(rank["state_dict"]) != names for rank in worker):
            raise CheckpointFormatError(f"ranks {first}..{first + k - 1} hold different entries, or lack sharded ones")
        replica = {}
        for name, value in worker[0]["state_dict"].items():
            if name not in sharded:
                replica[name] = value
                continue
            parts = [rank["state_dict"][name] for rank in worker]
            if (not all(isinstance(part, torch.Tensor) and part.dim() > 0 for part in parts)
                    or len({part.shape[1:] for part in parts}) > 1):
                raise CheckpointFormatError(f"ranks {first}..{first + k - 1}: the shards of {name} do not put "
                                            "together into one tensor")
            replica[name] = torch.cat(parts)
        replicas.append(replica)
    return replicas
