"""torchft's lighthouse, started without importing torch.

torchft's ``torchft_lighthouse`` console script does ``from torchft._torchft import lighthouse_main``. That import
runs ``torchft/__init__.py`` first, which imports torch: 2.5 s of CPU before the lighthouse listens (12 s of wall
time on a loaded 2-core machine), for a server that is a Rust extension with no torch in it. Every ``gasloc-elastic``
run pays it once, and a ``lighthouse@STEP`` chaos restart pays it while every worker waits. Run as a script, this
file loads that same extension by its path, so the package ``__init__`` never runs. It is run by path, not with
``-m`` (which would import gasloc_lightning, and torch with it), and takes the lighthouse's own options
(the extension parses the process's arguments after the program's name).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys


def _extension() -> str | None:
    """The path of torchft's compiled extension, found without importing torchft (None: not installed)."""
    spec = importlib.util.find_spec("torchft")  # a top-level package: found, not imported
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    paths = [os.path.join(folder, "_torchft" + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    return next((path for path in paths if os.path.exists(path)), None)


def lighthouse_program() -> list[str]:
    """The start of the lighthouse's command line (its options follow): this file run by this Python, else the
    ``torchft_lighthouse`` console script (next to this Python, else on PATH)."""
    if _extension() is not None:
        return [sys.executable, os.path.abspath(__file__)]
    script = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = script if os.path.exists(script) else shutil.which("torchft_lighthouse")
    if found is None:
        raise RuntimeError("torchft_lighthouse not found: install the elastic extra (pip install 'gasloc-lightning[elastic]')")
    return [found]


def main() -> int:
    spec = importlib.util.spec_from_file_location("torchft._torchft", _extension())
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    return extension.lighthouse_main()


if __name__ == "__main__":
    sys.exit(main())
