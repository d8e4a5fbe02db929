"""The package's layers: no import runs back up, and the math layers never import Lightning.

Read from the source with ``ast`` (a lazy import inside a function is still an arrow).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gasloc_lightning

PACKAGE = Path(gasloc_lightning.__file__).parent

# Bottom to top; a module may import its own layer and those below it.
LAYERS = [
    {"utils"},  # a script's progress, atomic JSON records: pure Python every layer may use
    {"algorithm"},
    {"topology", "network"},
    {"comm"},
    {"plugins"},
    {"strategies"},
    {"data", "models"},
    {"sim"},  # trains the models on the data, with the math layers' rounds (never the strategies')
    {"netlab"},  # sites as network namespaces; runs the apps' workers in them as processes, never imports the app
    {"app"},
]
MATH_LAYERS = {"utils", "algorithm", "topology", "network", "comm"}


def layer_of(subpackage: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if subpackage in names)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules_of_layers() -> list[tuple[str, Path]]:
    return [(path.relative_to(PACKAGE).parts[0], path) for path in sorted(PACKAGE.glob("*/*.py"))
            if path.relative_to(PACKAGE).parts[0] != "conf"]


@pytest.mark.parametrize("subpackage, path", modules_of_layers(), ids=lambda v: str(v).split("gasloc_lightning/")[-1])
def test_no_import_runs_back_up(subpackage, path):
    own = layer_of(subpackage)
    for name in imported_modules(path):
        parts = name.split(".")
        if parts[0] != "gasloc_lightning" or len(parts) < 2 or parts[1] not in {n for s in LAYERS for n in s}:
            continue
        assert layer_of(parts[1]) <= own, f"{path.relative_to(PACKAGE)} ({subpackage}) imports {name} from a layer above"


@pytest.mark.parametrize("subpackage, path", [m for m in modules_of_layers() if m[0] in MATH_LAYERS],
                         ids=lambda v: str(v).split("gasloc_lightning/")[-1])
def test_math_layers_do_not_import_lightning(subpackage, path):
    lightning = {name for name in imported_modules(path) if name.split(".")[0] in ("lightning", "pytorch_lightning")}
    assert not lightning, f"{path.relative_to(PACKAGE)} imports {sorted(lightning)}"


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - {"conf"}
    assert subpackages <= {n for names in LAYERS for n in names}, subpackages
