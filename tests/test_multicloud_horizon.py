"""benchmarks/multicloud_horizon.py: the recorded tuning runs of one H read back, each method's time to plain DiLoCo's
loss at a short horizon (the traces cut) and at the record's, over DiLoCo's and over the best family member's."""

from __future__ import annotations

import pytest

from bench_utils import load_benchmark
from test_multicloud_benchmark import _stand_in_run

mc = load_benchmark("multicloud")
mh = load_benchmark("multicloud_horizon")


def test_the_short_horizon_cuts_the_recorded_traces_and_ratios_follow_each_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "--steps", "120", "--inner-steps-grid",
             "10", "20", "--methods", "diloco", "gasloc_one_peer", "--points", "gasloc_one_peer=eta=1.0,gamma=0.3",
             "--seeds", "1", "--out", str(tmp_path)])
    ran = []
    monkeypatch.setattr(mc, "run_sim", lambda overrides, out: ran.append(overrides))
    table = mh.horizon(tmp_path, 4, short_steps=90)
    assert not ran  # read back, never rerun
    assert set(table) == {"two_clusters"}
    rows = table["two_clusters"]
    assert rows["diloco"]["label"].startswith("H=10,") and rows["gasloc_one_peer"]["label"] == "H=10,eta=1.0,gamma=0.3"
    # the stand-in: one_peer's steps take half the time, and at eta 1.0 it needs 1.3x the steps for a loss: DiLoCo's
    # loss at step 60 (short) or 120 (whole) is first seen at the validation of step 80 or 160: 2/3 of DiLoCo's time
    for horizon in ("short", "whole"):
        assert rows["diloco"][horizon] == pytest.approx(1.0)
        assert rows["gasloc_one_peer"][horizon] == pytest.approx(2 / 3)
        assert rows["gasloc_one_peer"][f"{horizon}_family"] == pytest.approx(2 / 3)  # the family: plain DiLoCo alone
    mh.main(["--out", str(tmp_path), "--workers", "4", "--short-steps", "90"])
    out = capsys.readouterr().out
    assert "### two_clusters: 90 steps against 180" in out and "| gasloc_one_peer | H=10,eta=1.0,gamma=0.3 | 0.67 |" in out
    with pytest.raises(ValueError, match="beyond the runs' 180 steps"):
        mh.horizon(tmp_path, 4, short_steps=200)
    with pytest.raises(ValueError, match="has no H = 50"):
        mh.horizon(tmp_path, 4, short_steps=90, inner_steps=50)
