"""benchmarks/multicloud_grid_probe.py: extra grid points on the tuning seed, compared with a record's choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_utils import load_benchmark

probe = load_benchmark("multicloud_grid_probe", "multicloud_grid_probe")  # it imports its sibling multicloud
CALLS: list[list[str]] = []
EXTRA_CURVES = {  # GASLoC at the extra points: (0.5, 0.5) reaches the target sooner but ends higher,
    (0.5, 0.5): lambda step: max(5.0 - 0.03 * step, 4.5),  # (0.7, 0.3) reaches it later but ends lower
    (0.7, 0.3): lambda step: 5.0 - 0.002 * step if step < 60 else 4.0,
}


def _value(overrides: list[str], key: str) -> float:
    return float(next(o for o in overrides if o.startswith(key)).split("=")[1])


def _curve(overrides: list[str]):
    """Validation loss per step. DiLoCo: each point its own rate, the extra (0.5, 0.5) the best. GASLoC: on the
    recorded grid all alike (int4 a little faster); the extra (0.5, 0.5) reaches the target sooner but ends
    higher, the extra (0.7, 0.3) reaches it later but ends lower."""
    outer = (_value(overrides, "strategy.outer_lr="), _value(overrides, "strategy.outer_momentum="))
    if "strategy=diloco" in overrides:
        rate = {(0.5, 0.5): 0.013, (0.7, 0.5): 0.011, (0.7, 0.3): 0.009}.get(outer, 0.010)
        return lambda step: 5.0 - rate * step
    if outer in EXTRA_CURVES:
        return EXTRA_CURVES[outer]
    rate = 0.012 if "strategy.message_codec=int4" in overrides else 0.010
    return lambda step: 5.0 - rate * step


def _run(overrides: list[str], out: Path) -> dict:
    CALLS.append(overrides)
    if "topology=bandwidth_aware" in overrides:
        raise probe.SimRunError("gasloc-sim exited 1: ...\nTopologyError('bandwidth_aware needs clusters')")
    if "strategy.fragments=4" in overrides and "strategy.outer_lr=0.5" in overrides:
        raise probe.SimRunError("gasloc-sim exited 1: ...\nValueError('no such point')")
    loss = _curve(overrides)
    seconds = 1.0 if "strategy=diloco" in overrides else 0.5
    steps = int(_value(overrides, "trainer.max_steps="))
    trace = [(step, loss(step), step * seconds) for step in range(10, steps + 1, 10)]
    return {"overrides": overrides, "val_loss": trace[-1][1], "goodput": 1.0, "bytes_sent": 1, "trace": trace}


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A real multicloud record at n = 4 on jitter (40 target steps), written through the stand-in runs."""
    monkeypatch.setattr(probe.mc, "run_sim", _run)
    probe.mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco",
                   "gasloc_one_peer", "gasloc_bw_spread", "gasloc_compressed", "gasloc_streamed",
                   "--out", str(tmp_path)])
    CALLS.clear()
    return tmp_path / "multicloud_n4.json"


def test_a_point_beats_the_choice_only_by_the_rule_that_chose_it(record):
    before = record.read_text()
    tuning = json.loads(before)["scenarios"]["jitter"]["tuning"]
    assert tuning["diloco"]["label"] == "eta=0.7,gamma=0.5" and tuning["gasloc_compressed"]["label"].startswith("int4,")

    result = probe.probe(4, record.parent, ("jitter",))
    jitter = result["scenarios"]["jitter"]
    rows = jitter["methods"]
    assert rows["diloco"]["rerun_loss"] == pytest.approx(5.0 - 0.011 * 40)  # the recorded choice, rerun
    assert rows["diloco"]["beaten_by"] == ["eta=0.5,gamma=0.5"]
    assert jitter["target_moves"] and jitter["target_loss"] == rows["diloco"]["rerun_loss"]
    # sooner to the target wins even with a higher final loss; lower final loss but later does not
    assert rows["gasloc_one_peer"]["beaten_by"] == ["eta=0.5,gamma=0.5"]
    assert rows["gasloc_compressed"]["beaten_by"] == ["int4,eta=0.5,gamma=0.5"]
    compressed = [c for c in CALLS if "strategy.message_codec=int4" in c or "strategy.message_codec=int8" in c]
    assert len(compressed) == 2 and all("strategy.message_codec=int4" in c for c in compressed)  # the chosen codec
    assert rows["gasloc_streamed"]["error"] == "ValueError('no such point')"
    assert "gasloc_bw_spread" not in rows  # the record says jitter cannot run it
    assert record.read_text() == before
    assert json.loads((record.parent / "grid_probe_n4.json").read_text()) == result


def test_at_equal_time_to_the_target_the_lower_final_loss_wins_and_never_reaching_it_loses(record, monkeypatch):
    # the choice (rate 0.010) reaches 4.56 at step 50 and ends at 4.40
    monkeypatch.setitem(EXTRA_CURVES, (0.5, 0.5), lambda step: 5.0 - 0.010 * step if step < 60 else 4.35)  # tie, lower
    monkeypatch.setitem(EXTRA_CURVES, (0.7, 0.3), lambda step: 5.0 - 0.010 * step if step < 60 else 4.45)  # tie, higher
    rows = probe.probe(4, record.parent, ("jitter",), ("diloco", "gasloc_one_peer"))["scenarios"]["jitter"]["methods"]
    assert rows["gasloc_one_peer"]["beaten_by"] == ["eta=0.5,gamma=0.5"]
    monkeypatch.setitem(EXTRA_CURVES, (0.5, 0.5), lambda step: 4.9)  # never reaches the target: last, whatever its loss
    monkeypatch.setitem(EXTRA_CURVES, (0.7, 0.3), lambda step: 4.9)
    rows = probe.probe(4, record.parent, ("jitter",), ("diloco", "gasloc_one_peer"))["scenarios"]["jitter"]["methods"]
    assert rows["gasloc_one_peer"]["beaten_by"] == []
    assert all(score["time_to_target"] is None for score in rows["gasloc_one_peer"]["extra_scores"].values())


def test_a_record_that_does_not_reproduce_is_refused(record):
    data = json.loads(record.read_text())
    data["scenarios"]["jitter"]["tuning"]["diloco"]["losses"]["eta=0.7,gamma=0.5"] += 0.01
    record.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not reproduced"):
        probe.probe(4, record.parent, ("jitter",))
    assert len(CALLS) == 1  # stopped before any extra point


@pytest.mark.parametrize("change, args, match", [
    (lambda data: data["scenarios"]["jitter"].update(tuned_at_workers=64), {}, "another worker count"),
    (lambda data: data["scenarios"].pop("jitter"), {}, "no record of"),
    (lambda data: None, {"methods": ("gasloc_one_peer",)}, "include diloco"),
    (lambda data: None, {"workers": 0}, "workers must be"),
])
def test_the_probe_refuses_what_it_cannot_compare(record, change, args, match):
    data = json.loads(record.read_text())
    change(data)
    record.write_text(json.dumps(data))
    workers = args.get("workers", 4)
    with pytest.raises(ValueError, match=match):
        probe.probe(workers, record.parent, ("jitter",), args.get("methods", probe.PROBED))
    assert CALLS == []


def test_a_missing_record_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--workers", "8", "--scenarios", "jitter", "--out", str(tmp_path)])
    assert "multicloud_n8.json does not exist" in capsys.readouterr().err
