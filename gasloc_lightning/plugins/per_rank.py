"""Per-rank checkpoint directories and the consensus export.

In GASLoC every rank holds different parameters, its own inner and outer optimizer state and its
own RNG streams, so a checkpoint is a directory::

    epoch=0-step=100.ckpt/
        shared.ckpt     loops, callbacks, hyper-parameters: identical on every rank, written once by rank 0
        rank_0.ckpt     rank 0's replica, optimizer and scheduler states, GASLoC state, RNG states
        rank_1.ckpt     ...
        meta.json       format, world size, written last: a directory without it is incomplete

Every file is written to a temporary name and renamed, so a crash never leaves a truncated file
under a final name. The matching sequence needs no saving: it is a pure function of seed and round.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = "gasloc-per-rank-v1"
META_FILE = "meta.json"
SHARED_FILE = "shared.ckpt"
# Identical on every rank: kept once, in the shared file.
SHARED_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "hyper_parameters",
               "hparams_name", "datamodule_hyper_parameters", "hparams_type")


class CheckpointFormatError(RuntimeError):
    """A checkpoint file or directory is missing, truncated or not in the expected format."""


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.ckpt"


def is_per_rank_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file()


def capture_rng_states() -> dict[str, Any]:
    """The RNG states a resumed run needs to draw the same numbers (torch CPU and CUDA, Python)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_state_to_list(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_python_state_from_list(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _python_state_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the keys shared by all ranks from this rank's own."""
    shared = {k: v for k, v in checkpoint.items() if k in SHARED_KEYS}
    own = {k: v for k, v in checkpoint.items() if k not in SHARED_KEYS}
    return shared, own


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_meta(directory: Path, world_size: int, global_step: int) -> None:
    meta = {"format": FORMAT, "world_size": world_size, "global_step": global_step}
    tmp = directory / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, directory / META_FILE)


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise CheckpointFormatError(
            f"{directory} is not a complete GASLoC checkpoint directory (no {META_FILE}: it was not written to "
            "the end, or it is a single-file checkpoint)"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointFormatError(f"{path} is unreadable: {error}") from error
    if meta.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_file(path: Path) -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True`` where the content allows it, and errors that name the file."""
    if not path.is_file():
        raise CheckpointFormatError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" not in str(error):
            raise CheckpointFormatError(f"checkpoint file {path} is corrupt or not a torch checkpoint: {error}") from error
        # Hyper-parameters may hold arbitrary objects (e.g. a partial optimizer): trusted files written by us.
        log.info("loading %s with weights_only=False (it holds non-tensor hyper-parameters)", path)
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointFormatError(f"checkpoint file {path} is truncated or not a torch checkpoint: {error}") from error


def load_rank_checkpoint(directory: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
    """The full Lightning checkpoint of ``rank``: the shared part merged with the rank's own file."""
    meta = read_meta(directory)
    if meta["world_size"] != world_size:
        raise CheckpointFormatError(
            f"checkpoint {directory} was saved by {meta['world_size']} workers, this run has {world_size}: "
            "per-rank state (replicas, optimizer and outer state) cannot be redistributed. Export the consensus "
            f"model with `gasloc-export {directory} consensus.ckpt` and start a new run from it "
            "(e.g. LightningModule.load_from_checkpoint), or resume with the original world size."
        )
    checkpoint = load_file(Path(directory) / SHARED_FILE)
    checkpoint.update(load_file(rank_file(directory, rank)))
    return checkpoint


def export_consensus(directory: str | os.PathLike, output: str | os.PathLike) -> dict[str, float]:
    """Average the replicas of a per-rank checkpoint into one standard Lightning checkpoint.

    The result loads with ``LightningModule.load_from_checkpoint`` and with plain
    ``torch.load(...)["state_dict"]``. Floating tensors are averaged; integer ones (step counters)
    are taken from rank 0.

    Returns:
        ``{"world_size", "consensus_distance"}``: the mean squared distance of the replicas to the
        average, over floating tensors, that the export averaged away.
    """
    meta = read_meta(directory)
    world_size = meta["world_size"]
    shared = load_file(Path(directory) / SHARED_FILE)
    states = [load_file(rank_file(directory, r))["state_dict"] for r in range(world_size)]
    average = {}
    distance = 0.0
    for name, reference in states[0].items():
        if not torch.is_floating_point(reference):
            average[name] = reference.clone()
            continue
        stacked = torch.stack([s[name].double() for s in states])  # (world, ...)
        mean = stacked.mean(0)
        distance += float(((stacked - mean) ** 2).sum()) / world_size
        average[name] = mean.to(reference.dtype)
    exported = {k: v for k, v in shared.items() if k in ("epoch", "global_step", "pytorch-lightning_version",
                                                          "hyper_parameters", "hparams_name")}
    exported["state_dict"] = average
    exported["gasloc_export"] = {"source": str(directory), "world_size": world_size, "consensus_distance": distance}
    atomic_save(exported, Path(output))
    return {"world_size": world_size, "consensus_distance": distance}
