"""Loading a script of ``benchmarks/`` as a module in the tests (it is not a package: its siblings import by name)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, name: str | None = None) -> ModuleType:
    """``benchmarks/<script>.py`` as the module ``name`` (default ``<script>_benchmark``), registered in
    ``sys.modules`` (dataclasses look their module up while a class is built), with ``benchmarks/`` on the path
    for the siblings it imports (``sim_runs``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    name = name or f"{script}_benchmark"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
