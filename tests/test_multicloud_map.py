"""benchmarks/multicloud_map.py: issue 31's map from a multicloud record: per cell (site layout x cross-region
bandwidth) each method's time over the fastest DiLoCo-family method's, per held-out seed, and its final loss over
the best family member's."""

from __future__ import annotations

import json

import pytest

from bench_utils import load_benchmark

mm = load_benchmark("multicloud_map")


def _result(family: list, loss: float) -> dict:
    reached = [r for r in family if r is not None]
    return {"family_ratios": family, "family_ratio_mean": sum(reached) / len(reached) if len(reached) == len(family)
            else None, "val_loss_mean": loss}


def _record() -> dict:
    fast = {"diloco": _result([1.2, 1.1], 2.50), "streaming_diloco": _result([1.0, 1.0], 2.52),
            "two_level": _result([0.8, 0.7], 2.49)}
    slow = {"diloco": _result([2.0, 3.0], 2.50), "hierarchical": _result([1.0, 1.0], 2.55),
            "two_level": _result([None, 0.9], 2.60)}
    scenario = {"held_out_seeds": [1, 2]}
    return {"workers": 64, "scenarios": {"two_clusters_100m": {**scenario, "results": slow},
                                         "jitter": {**scenario, "results": fast},  # not a map cell: left out
                                         "two_clusters_10g": {**scenario, "results": fast}}}


def test_the_map_orders_cells_fast_to_slow_and_gives_each_seed_and_the_loss_over_the_familys_best(tmp_path, capsys):
    record = _record()
    assert [cell[1] for cell in mm.cells(record)] == ["two_clusters_10g", "two_clusters_100m"]
    table = mm.map_table(record)
    assert table["two_clusters_100m"]["two_level"]["family_ratio_mean"] is None  # one seed never got there
    assert table["two_clusters_10g"]["two_level"]["loss_ratio"] == pytest.approx(2.49 / 2.50)
    assert table["two_clusters_100m"]["two_level"]["loss_ratio"] == pytest.approx(2.60 / 2.50)
    (tmp_path / "multicloud_n64.json").write_text(json.dumps(record))
    mm.main(["--out", str(tmp_path), "--workers", "64"])
    out = capsys.readouterr().out
    assert "| method | two_clusters 10 Gbit/s | two_clusters 100 Mbit/s |" in out
    assert "| two_level | **0.75** (0.80 / 0.70) | **never** (never / 0.90) |" in out
    assert "| streaming_diloco | **1.00** (1.00 / 1.00) |  |" in out  # not run on the slow cell
    assert (tmp_path / "multicloud_map.png").stat().st_size > 0
    (tmp_path / "multicloud_n8.json").write_text(json.dumps({"workers": 8, "scenarios": {"jitter": record["scenarios"]
                                                                                         ["jitter"]}}))
    with pytest.raises(SystemExit):
        mm.main(["--out", str(tmp_path), "--workers", "8"])
