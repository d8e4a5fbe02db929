"""The notebooks run end to end: executed with nbclient in a python3 kernel of this interpreter, at tiny budgets.

Each notebook is read, given its test parameters in a cell inserted right after its cell tagged
``parameters`` (as papermill does), and given a last cell that prints what the test checks as
one JSON line. Then it is executed in ``tmp_path``. The kernel is ipykernel's ``python3``,
which jupyter_client starts with ``sys.executable``, so it is this interpreter whichever
kernelspecs the machine has.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
RESULT_MARKER = "NOTEBOOK-TEST-RESULT "
CELL_TIMEOUT_S = 240
# Variables a launch must not inherit: every fit in the kernel picks its own free port.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _inject_parameters(notebook, source: str) -> None:
    """Insert ``source`` as a code cell right after the cell tagged ``parameters``."""
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    notebook.cells.insert(tagged[0] + 1, cell)


def _append_result(notebook, expression: str) -> None:
    """Append a cell printing ``expression`` (evaluated in the notebook's namespace) as one JSON line."""
    source = f"import json as _json\nprint({RESULT_MARKER!r} + _json.dumps({expression}))"
    notebook.cells.append(nbformat.v4.new_code_cell(source))


def _kernel_env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCH_ENV}
    env["IPYTHONDIR"] = str(tmp_path / ".ipython")  # no profile written into the home folder
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    return env


def _execute(name: str, tmp_path: Path, parameters: str | None, result: str):
    """Run notebooks/<name> in tmp_path; returns (the executed notebook, the decoded result line)."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    if parameters:
        _inject_parameters(notebook, parameters)
    _append_result(notebook, result)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=_kernel_env(tmp_path))
    lines = [
        line
        for output in notebook.cells[-1].outputs
        if output.output_type == "stream"
        for line in output.text.splitlines()
        if line.startswith(RESULT_MARKER)
    ]
    assert len(lines) == 1, f"no result line in the last cell's output: {notebook.cells[-1].outputs}"
    return notebook, json.loads(lines[0][len(RESULT_MARKER) :])


def _markdown_outputs(notebook) -> list[str]:
    return [
        output.data["text/markdown"]
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type in ("display_data", "execute_result") and "text/markdown" in output.data
    ]


@pytest.mark.parametrize("name", ["quickstart.ipynb", "topology.ipynb"])
def test_notebook_is_saved_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1


QUICKSTART_PARAMETERS = """\
STEPS = 8
INNER_STEPS = 4
VAL_EVERY = 4
BATCH_SIZE = 4
VAL_BATCHES = 1
OUT_DIR = "runs"
"""

QUICKSTART_RESULT = """{
    "runs": [
        {"name": r["strategy"]["name"], "val_loss": r["final"]["val_loss"], "tokens": r["budget"]["tokens"],
         "rounds": r["budget"]["rounds"], "bytes_sent": r["bytes_sent"]}
        for r in result.runs
    ],
    "plots": [str(p) for p in result.plots],
    "table_path": str(result.table_path),
}"""


@pytest.mark.distributed
def test_quickstart_trains_compares_and_plots(tmp_path):
    notebook, result = _execute("quickstart.ipynb", tmp_path, QUICKSTART_PARAMETERS, QUICKSTART_RESULT)
    runs = {run["name"]: run for run in result["runs"]}
    assert list(runs) == ["gasloc", "diloco", "ddp"]
    assert all(math.isfinite(run["val_loss"]) for run in runs.values())
    # Equal compute: 8 steps x B=4 x T=64 x 2 workers for every strategy.
    assert {run["tokens"] for run in runs.values()} == {8 * 4 * 64 * 2}
    assert runs["gasloc"]["rounds"] == runs["diloco"]["rounds"] == 2
    # Two rounds of parameters against eight steps of gradients.
    assert 0 < runs["gasloc"]["bytes_sent"] < runs["ddp"]["bytes_sent"]
    # With 2 workers a random matching is the complete graph: GASLoC is DiLoCo.
    assert runs["gasloc"]["val_loss"] == pytest.approx(runs["diloco"]["val_loss"], rel=1e-4)
    written = [Path(path) for path in [*result["plots"], result["table_path"]]]
    assert [path.name for path in written] == ["val_loss_vs_tokens.png", "val_loss_vs_bytes.png", "comparison.md"]
    assert all(path.is_file() and path.is_relative_to(tmp_path.resolve() / "runs") for path in written)
    assert any(text.startswith("| run | strategy |") for text in _markdown_outputs(notebook))


TOPOLOGY_RESULT = """{
    "gaps": {name: {str(n): gap for n, gap in by_n.items()} for name, by_n in gaps.items()},
    "limits": {form: {name: {str(n): gamma for n, gamma in by_n.items()} for name, by_n in by_name.items()}
               for form, by_name in limits.items()},
}"""


# The sizes the assertions read. Every n runs the same cells; each random-graph limit costs about 2 CPU-seconds at any
# n (a bisection on the simulated rate), so the notebook's n = 4 and 8 rows, which nothing below checks apart from
# "anchored is stable", are left out. Those small-n limits are checked without the notebook by
# test_paper_presets.py::test_outer_sweep_keeps_only_stable_momenta (n = 8) and the topology unit tests.
TOPOLOGY_PARAMETERS = """\
SIZES = (16, 32, 64)
"""


def test_topology_tables_match_the_known_limits(tmp_path):
    notebook, result = _execute("topology.ipynb", tmp_path, TOPOLOGY_PARAMETERS, TOPOLOGY_RESULT)
    gaps, anchored, post_mix = result["gaps"], result["limits"]["anchored"], result["limits"]["post_mix"]
    assert set(gaps["ring"]) == {"16", "32", "64"}  # the injected parameters reached the notebook
    assert gaps["complete"]["64"] == pytest.approx(1.0)
    assert gaps["ring"]["64"] < gaps["torus"]["64"] < gaps["one_peer"]["64"]
    # The hypercube schedule's exact limits (ALGORITHM.md): any gamma up to n = 16, then 0.848 and 0.786.
    assert anchored["exponential"]["16"] == pytest.approx(0.999)
    assert anchored["exponential"]["32"] == pytest.approx(0.848, abs=2e-3)
    assert anchored["exponential"]["64"] == pytest.approx(0.786, abs=2e-3)
    # The default form is stable on every other shipped graph; post_mix diverges on random matchings.
    assert all(gamma == pytest.approx(0.999) for name, by_n in anchored.items() if name != "exponential"
               for gamma in by_n.values())
    assert 0.7 < post_mix["one_peer"]["16"] < 0.95
    assert post_mix["exponential"]["64"] < 0.6
    figures = [output for cell in notebook.cells for output in cell.get("outputs", [])
               if "image/png" in output.get("data", {})]
    assert len(figures) == 2
