"""benchmarks/compression.py: its plan composes with the package's configs, and a dry run launches nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compression.py"
    spec = importlib.util.spec_from_file_location("compression_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compression_benchmark"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


cb = _load()


def test_every_cell_composes_into_the_configuration_it_names():
    cells = cb.preset_cells("demo", full_grid=True)
    assert {(c.method, c.codec) for c in cells} >= {("gasloc", "int8"), ("gasloc", "int4"), ("diloco", "int4")}
    for cell in cells:
        cfg = cb.compose_cell(cell)
        assert cfg.strategy.message_codec == cell.codec
        assert cfg.strategy.get("error_feedback", False) == cell.error_feedback
        if cell.topology is not None:
            assert cfg.topology._target_.rsplit(".", 1)[-1].lower().startswith(cell.topology.replace("_", ""))


def test_dry_run_prints_the_plan_and_launches_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cb.subprocess, "Popen", lambda *a, **k: pytest.fail("a dry run launched a job"))
    assert cb.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and "diloco" in out
