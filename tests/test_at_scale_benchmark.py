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


def test_h1_tunes_on_the_first_seed_and_runs_the_chosen_value_on_every_seed(monkeypatch, tmp_path):
    calls = []

    def stand_in(overrides, out, experiment="demo"):  # lowest at gamma 0.5, at lr 0.1 (SGD) and 0.012 (AdamW)
        calls.append(overrides)
        best_lr = 0.1 if "model/optimizer=sgd" in overrides else 0.012
        loss = 2.5 + abs(float(_value(overrides, "strategy.outer_momentum=", 0.9)) - 0.5)
        loss += abs(float(_value(overrides, "model.optimizer.lr=", best_lr)) - best_lr)
        return {"val_loss": loss + 0.01 * int(_value(overrides, "seed=")), "goodput": 1.0, "wall_time_s": 1.0,
                "bytes_sent": 1.0, "outer_momentum": None, "trace": []}

    monkeypatch.setattr(sys.modules["sim_runs"], "run_sim", stand_in)
    result = at_scale.h1(8, 20, (0, 1, 2))
    chosen = {name: tuning["chosen"] for name, tuning in result["tuning"].items()}
    assert chosen == {"gossip_adamw": "lr=0.012", "gasloc_adamw": "gamma=0.5", "gossip_sgd_momentum": "lr=0.1"}
    tuning_runs = [c for c in calls if any(label in " ".join(c) for label in ("momentum=0.7", "lr=0.03", "lr=0.003"))]
    assert tuning_runs and all("seed=0" in c for c in tuning_runs)  # the grids run on the first seed only
    assert all(sorted(run["seeds"], key=int) == ["0", "1", "2"] for run in result["runs"].values())
    assert "strategy.outer_momentum=0.5" in result["runs"]["gasloc_adamw"]["overrides"]
    assert "model.optimizer.lr=0.1" in result["runs"]["gossip_sgd_momentum"]["overrides"]
    inner = [o for o in result["runs"]["gossip_adamw"]["overrides"] if o.startswith("model.optimizer")]
    assert "model.optimizer.lr=0.012" in inner  # GASLoC takes gossip's tuned AdamW, tuned or not
    assert all(o in result["runs"]["gasloc_adamw"]["overrides"] for o in inner)
    assert all("model.optimizer.lr=0.012" in c for c in calls if "strategy.outer_momentum=0.7" in c)


def _value(overrides: list[str], prefix: str, default=None) -> str:
    return next((o[len(prefix):] for o in overrides if o.startswith(prefix)), default)
