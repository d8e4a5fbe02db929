"""benchmarks/at_scale.py: losses are compared seed by seed, and the summary figure is drawn from the parts' records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # at_scale imports its sibling sim_runs


def _load():
    spec = importlib.util.spec_from_file_location("at_scale_benchmark", ROOT / "benchmarks" / "at_scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["at_scale_benchmark"] = module
    spec.loader.exec_module(module)
    return module


at_scale = _load()


def _run(losses: dict[str, float]) -> dict:
    return {"val_loss": sum(losses.values()) / len(losses), "seeds": {s: {"val_loss": v} for s, v in losses.items()}}


def test_ratios_pair_the_same_seed_and_skip_a_seed_only_one_side_ran():
    run = _run({"2": 1.0, "0": 2.0, "1": 6.0})
    reference = _run({"0": 1.0, "1": 2.0})  # seed 2 never ran for the reference
    assert at_scale.paired_ratios(run, reference) == [2.0, 3.0]  # not the ratio of the means (3.0 / 1.5)


def test_a_one_seed_record_gives_one_ratio_and_disjoint_seeds_are_refused():
    assert at_scale.paired_ratios({"val_loss": 3.0}, {"val_loss": 2.0}) == [1.5]
    assert at_scale.mean_sd([1.5]) == (1.5, 0.0)
    assert at_scale.mean_sd([1.0, 3.0]) == pytest.approx((2.0, 2.0 ** 0.5))
    with pytest.raises(ValueError, match="share no seed"):
        at_scale.paired_ratios(_run({"0": 1.0}), _run({"1": 1.0}))


def test_the_summary_figure_is_drawn_from_three_seed_and_one_seed_records(tmp_path):
    names = ("diloco", "one_peer", "two_peer", "ring", "exponential")
    for n, seeds in ((16, ("0", "1", "2")), (256, None)):
        runs = {}
        for index, name in enumerate(names):
            if seeds is None:
                runs[name] = {"val_loss": 2.5 + 0.01 * index}
            else:
                runs[name] = _run({s: 2.5 + 0.01 * index + 0.001 * int(s) for s in seeds})
        (tmp_path / f"quality_n{n}.json").write_text(json.dumps({"workers": n, "runs": runs}))
    shares = {str(f): _run({"0": 2.5 + f, "1": 2.6 + f}) for f in (0.0, 0.1, 0.2)}
    (tmp_path / "churn_n16.json").write_text(json.dumps({"workers": 16, "runs": shares}))
    figure = tmp_path / "at_scale.png"
    at_scale.plot_summary(tmp_path, figure)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
