"""Documents of a corpus (the standard library, a local file or folder, a Hugging Face dataset) and their split by document."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


log = logging.getLogger(__name__)



CACHE_FORMAT = 1
DEFAULT_CACHE_DIR = "~/.cache/gasloc-lightning"
LOCK_TIMEOUT_S = 600.0
MAX_STDLIB_FILE_BYTES = 1 << 20
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_SPLITS = ("train", "val")


# ----------------------------------------------------------------------------------------------
# Documents, split and fingerprint


@dataclass(frozen=True)
class _Piece:
    """Bytes [start, stop) of one document; stop=None means to the end."""

    key: str
    read: Callable[[], bytes]
    start: int = 0
    stop: int | None = None

    def content(self) -> bytes:
        data = self.read()
        return data if (self.start, self.stop) == (0, None) else data[self.start : self.stop]


def stdlib_source_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted, without tests and installed packages.

    Directories named ``site-packages``, ``dist-packages``, ``test``, ``tests`` and
    ``idle_test`` (hence ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``) are skipped, as
    are files over ``MAX_STDLIB_FILE_BYTES`` (generated tables). Python source cannot contain
    NUL bytes, so no binary file gets through.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_EXCLUDED_DIRS]
        for name in names:
            path = Path(directory, name)
            if not name.endswith(".py") or path.is_symlink():
                continue
            if path.stat().st_size <= MAX_STDLIB_FILE_BYTES:
                files.append(path)
    return sorted(files)


def _folder_files(root: Path) -> list[Path]:
    """Every regular file under root, sorted; hidden files and folders (.git, ...) are skipped."""
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        paths = (Path(directory, name) for name in names if not name.startswith("."))
        files.extend(path for path in paths if path.is_file())
    return sorted(files)


def _file_pieces(root: Path, files: list[Path]) -> list[_Piece]:
    return [_Piece(key=path.relative_to(root).as_posix(), read=path.read_bytes) for path in files]


# datasets' packaged builders for local files: "hf:<builder>:<path or glob>" loads no script and
# downloads nothing.
HF_LOCAL_BUILDERS = ("json", "csv", "text", "parquet", "arrow")


def _hf_pieces(name: str, split: str, text_field: str, data_files: str | None = None) -> list[_Piece]:
    shown = name if data_files is None else f"{name}:{data_files}"
    try:
        import datasets  # optional dependency, imported only when asked for
    except ImportError as error:
        raise ImportError(
            f"source='hf:{shown}' needs the optional 'datasets' package: pip install 'gasloc-lightning[hf]'"
        ) from error
    if data_files is None:
        dataset = datasets.load_dataset(name, split=split)
    else:
        dataset = datasets.load_dataset(name, data_files=data_files, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(
            f"hf_text_field={text_field!r} is not a column of {shown}; columns: {dataset.column_names}"
        )
    texts = dataset[text_field]
    return [_Piece(key=str(i), read=lambda text=text: text.encode("utf-8")) for i, text in enumerate(texts)]


def _bucket(key: str) -> float:
    """Stable position of a document name in [0, 1)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def _split_by_document(pieces: list[_Piece], val_fraction: float) -> dict[str, list[_Piece]]:
    val = [p for p in pieces if _bucket(p.key) < val_fraction]
    # Both splits must be non-empty: borrow the document nearest to the bucket boundary.
    if not val:
        val = [min(pieces, key=lambda p: _bucket(p.key))]
    if len(val) == len(pieces):
        val.remove(max(pieces, key=lambda p: _bucket(p.key)))
    val_keys = {p.key for p in val}
    return {"train": [p for p in pieces if p.key not in val_keys], "val": val}


def _split_by_bytes(piece: _Piece, val_fraction: float) -> dict[str, list[_Piece]]:
    size = len(piece.read())
    if size < 2:
        raise ValueError(f"source {piece.key!r} has {size} bytes, too few to split into train and validation")
    train_size = min(size - 1, max(1, size - math.ceil(size * val_fraction)))
    return {
        "train": [_Piece(piece.key, piece.read, 0, train_size)],
        "val": [_Piece(piece.key, piece.read, train_size, None)],
    }


def _content_sha256(pieces: list[_Piece]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece.key.encode("utf-8") + b"\0" + hashlib.sha256(piece.read()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Source:
    kind: str  # "stdlib", "folder", "file" or "hf"
    path: Path | None = None
    hf_name: str = ""
    hf_split: str = "train"
    hf_text_field: str = "text"
    hf_data_files: str | None = None  # local files read by the builder hf_name (json, text, ...)

    def pieces(self) -> list[_Piece]:
        if self.kind == "stdlib":
            return _file_pieces(Path(sysconfig.get_paths()["stdlib"]), stdlib_source_files())
        if self.kind == "folder":
            return _file_pieces(self.path, _folder_files(self.path))
        if self.kind == "file":
            return [_Piece(key=self.path.name, read=self.path.read_bytes)]
        return _hf_pieces(self.hf_name, self.hf_split, self.hf_text_field, self.hf_data_files)

    def describe(self) -> str:
        if self.kind != "hf":
            return str(self.path or "stdlib")
        return f"hf:{self.hf_name}" + (f":{self.hf_data_files}" if self.hf_data_files is not None else "")


def _parse_source(source: str | os.PathLike, hf_split: str, hf_text_field: str) -> _Source:
    if source == "stdlib":
        return _Source("stdlib")
    if isinstance(source, str) and source.startswith("hf:"):
        if not source[3:]:
            raise ValueError("source='hf:<name>' needs a dataset name after 'hf:'")
        builder, _, files = source[3:].partition(":")
        if builder in HF_LOCAL_BUILDERS:
            return _local_hf_source(builder, files, hf_split, hf_text_field)
        return _Source("hf", hf_name=source[3:], hf_split=hf_split, hf_text_field=hf_text_field)
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"source path does not exist: {path}")
    return _Source("folder" if path.is_dir() else "file", path=path)


def _local_hf_source(builder: str, files: str, hf_split: str, hf_text_field: str) -> _Source:
    """``hf:<builder>:<path>``: local files through a packaged ``datasets`` builder (a glob is allowed)."""
    if not files:
        raise ValueError(f"source='hf:{builder}:<path>' needs the local files after 'hf:{builder}:'")
    path = str(Path(files).expanduser().resolve())
    if not any(char in files for char in "*?[") and not Path(path).exists():
        raise FileNotFoundError(f"source path does not exist: {path}")
    return _Source("hf", hf_name=builder, hf_split=hf_split, hf_text_field=hf_text_field, hf_data_files=path)


@dataclass(frozen=True)
class _Plan:
    """What the cache holds: the documents of each split and the fingerprint naming it."""

    splits: dict[str, list[_Piece]]
    fingerprint: dict[str, Any]

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _make_plan(source: _Source, val_fraction: float) -> _Plan:
    pieces = source.pieces()
    if not pieces:
        raise ValueError(f"source {source.describe()} contains no documents")
    if len(pieces) == 1:
        splits = _split_by_bytes(pieces[0], val_fraction)
    else:
        splits = _split_by_document(pieces, val_fraction)
    fingerprint = {
        "format": CACHE_FORMAT,
        "source": source.kind,
        "val_fraction": val_fraction,
        "documents": len(pieces),
        "sha256": _content_sha256(pieces),
    }
    if source.kind == "stdlib":
        fingerprint["python"] = platform.python_version()
    return _Plan(splits=splits, fingerprint=fingerprint)


