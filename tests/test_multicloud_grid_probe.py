"""benchmarks/multicloud_grid_probe.py: extra grid points on the tuning seed, compared with a record's choices."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the probe imports its sibling multicloud


def _load():
    spec = importlib.util.spec_from_file_location("multicloud_grid_probe", ROOT / "benchmarks" / "multicloud_grid_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _load()


def _run(overrides: list[str], out: Path) -> dict:
    """Loss falls with the step, faster at eta 0.5 (an extra point) than anywhere on the recorded grid."""
    if "topology=bandwidth_aware" in overrides:
        raise probe.mc.SimRunError("gasloc-sim exited 1: ...\nTopologyError('bandwidth_aware needs clusters')")
    rate = 0.02 if "strategy.outer_lr=0.5" in overrides else 0.01
    seconds = 0.5 if "topology=one_peer" in overrides else 1.0
    steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    trace = [(step, 5.0 - rate * step, step * seconds) for step in range(10, steps + 1, 10)]
    return {"overrides": overrides, "val_loss": trace[-1][1], "goodput": 1.0, "bytes_sent": 1, "trace": trace}


def test_a_point_off_the_grid_that_wins_is_named_and_the_record_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(probe.mc, "run_sim", _run)
    probe.mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco",
                   "gasloc_one_peer", "--out", str(tmp_path)])
    record = (tmp_path / "multicloud_n4.json").read_text()
    result = probe.probe(4, tmp_path, ("jitter",))
    rows = result["scenarios"]["jitter"]
    assert rows["diloco"]["beaten_by"] == ["eta=0.5,gamma=0.5"]
    assert rows["diloco"]["rerun_loss"] == rows["diloco"]["recorded_loss"]
    assert rows["gasloc_one_peer"]["beaten_by"] == ["eta=0.5,gamma=0.5"]  # reaches the target sooner
    assert set(rows) == {"diloco", "gasloc_one_peer"}  # methods the record did not run are not probed
    assert (tmp_path / "multicloud_n4.json").read_text() == record
    assert json.loads((tmp_path / "grid_probe_n4.json").read_text()) == result
