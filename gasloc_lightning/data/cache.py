"""The byte cache: each split concatenated once into a file of raw bytes, built under a lock, then memory-mapped."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from torch import Tensor

from gasloc_lightning.data.sources import LOCK_TIMEOUT_S, _SPLITS, _Plan

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# The on-disk cache


def _write_atomically(path: Path, chunks: Iterator[bytes]) -> int:
    """Writes to a temporary file in the same folder, then renames it: readers see all or nothing."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    size = 0
    try:
        with os.fdopen(fd, "wb") as file:
            for chunk in chunks:
                size += file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return size


def _is_complete(entry: Path, fingerprint: dict[str, Any]) -> bool:
    # fingerprint.json is renamed into place last, so its presence means both splits are complete.
    try:
        stored = json.loads((entry / "fingerprint.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return stored == fingerprint and all((entry / f"{split}.u8").is_file() for split in _SPLITS)


def _build(entry: Path, plan: _Plan) -> None:
    start = time.monotonic()
    entry.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split in _SPLITS:
        sizes[split] = _write_atomically(entry / f"{split}.u8", (p.content() for p in plan.splits[split]))
        if sizes[split] == 0:
            documents = len(plan.splits[split])
            raise ValueError(f"the {split} split of {entry.name} is empty (documents: {documents})")
    text = json.dumps(plan.fingerprint, indent=2, sort_keys=True)
    _write_atomically(entry / "fingerprint.json", iter([text.encode()]))
    log.info(
        "built byte cache path=%s train_bytes=%d val_bytes=%d seconds=%.2f",
        entry, sizes["train"], sizes["val"], time.monotonic() - start,
    )


def _ensure_cache(entry: Path, plan: _Plan) -> bool:
    """Builds the cache unless present; returns whether this process built it.

    Concurrency: builders take ``<entry>.lock`` with ``filelock`` (an OS lock, released by the
    kernel when its holder exits, even killed: a crashed build never blocks the next run), and
    the others wait for it, then find the cache complete. Correctness does not rest on the lock:
    every builder writes identical bytes through temp-file + rename, so if a live holder hangs
    and a waiter times out after LOCK_TIMEOUT_S, the waiter builds too, and racing builders are
    harmless. The lock only avoids duplicated work. The empty lock file stays (filelock does not
    remove it on POSIX: unlinking a lock file others may be opening would let two holders in).
    """
    if _is_complete(entry, plan.fingerprint):
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = entry.parent / f"{entry.name}.lock"
    try:
        with FileLock(lock, timeout=LOCK_TIMEOUT_S):
            if _is_complete(entry, plan.fingerprint):  # finished by another process meanwhile
                return False
            _build(entry, plan)
            return True
    except Timeout:
        log.warning("cache lock held for %.0fs, building anyway lock=%s", LOCK_TIMEOUT_S, lock)
        _build(entry, plan)
        return True


def _memory_map(path: Path) -> Tensor:
    # shared=False maps the file privately: pages load lazily and nothing is ever written back.
    return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)


def byte_unigram_entropy(data: bytes | Tensor) -> float:
    """Entropy in nats per byte of the byte histogram of ``data``.

    A model that ignores context cannot beat this loss on the same bytes, which makes it the
    acceptance bar for a language model's validation loss.

    Args:
        data: bytes, or a 1-D uint8 tensor.
    """
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes) else data
    if tokens.numel() == 0:
        raise ValueError("data must not be empty")
    counts = torch.zeros(256, dtype=torch.int64)
    for chunk in tokens.flatten().split(1 << 24):
        counts += torch.bincount(chunk, minlength=256)
    p = counts[counts > 0].double() / counts.sum()
    return float(-(p * p.log()).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


