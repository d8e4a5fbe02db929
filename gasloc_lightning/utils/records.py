"""A JSON record replaced atomically (its reader, another process, may open it at any moment: it sees the old
record or the new one, never a torn write), and the ``-`` the status lines and tables print for "not known"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any


def write_json_atomically(path: str | os.PathLike, record: Any, *, indent: int | None = None,
                          default: Callable[[Any], Any] | None = None) -> None:
    """Write ``record`` as JSON to a file beside ``path`` (``<name>.<pid>.partial``: two writers never share it),
    then rename it over ``path``. ``indent``, ``default``: as :func:`json.dumps`'s (an indented record ends
    with a newline)."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(record, indent=indent, default=default) + ("\n" if indent is not None else ""))
    os.replace(partial, path)


def dash(value: Any) -> str:
    """``value`` as text; ``-`` for ``None`` (not known yet)."""
    return "-" if value is None else str(value)
