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
    for seeds in (("1", "2", "3"), ("1",), ()):  # the H = 1 panel: over three seeds, over one, no pair at all
        names = ("gossip_adamw", "gasloc_adamw", "gasloc_sgd", "gossip_sgd_nesterov") if seeds else ("gasloc_sgd",)
        h1 = {name: _run({s: 2.2 + 0.01 * index + 0.001 * int(s) for s in seeds or ("1",)})
              for index, name in enumerate(names)}
        (tmp_path / "h1_n64.json").write_text(json.dumps({"workers": 64, "runs": h1}))
        at_scale.plot_summary(tmp_path, figure)
        assert figure.stat().st_size > 10_000
        figure.unlink()
    at_scale.plot_summary(tmp_path, figure)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000


def test_the_h1_bars_are_gasloc_over_each_partner_that_ran_paired_by_seed():
    runs = {"gasloc_adamw": _run({"1": 2.0, "2": 3.0}), "gossip_adamw": _run({"1": 2.5, "2": 2.0, "3": 9.0}),
            "gasloc_sgd": _run({"1": 1.0, "2": 1.0}), "gossip_sgd_nesterov": _run({"1": 2.0, "2": 4.0})}
    bars = at_scale.h1_bars(runs)  # heavy-ball and plain gossip did not run: no bar
    assert [(label, n) for label, _, _, n in bars] == [("AdamW", 2), ("SGD /\nNesterov", 2)]
    assert bars[0][1:3] == pytest.approx(at_scale.mean_sd([0.8, 1.5]))
    assert bars[1][1:3] == pytest.approx(at_scale.mean_sd([0.5, 0.25]))
    assert at_scale.h1_bars({"gasloc_sgd": runs["gasloc_sgd"]}) == []


def test_h1_tunes_on_its_seed_and_reports_the_held_out_seeds_with_fair_partners(monkeypatch, tmp_path):
    calls = []

    def stand_in(overrides, out, experiment="demo"):  # lowest at gamma 0.5, at lr 0.1 (SGD) and 0.012 (AdamW)
        calls.append(overrides)
        best_lr = 0.1 if "model/optimizer=sgd" in overrides else 0.012
        loss = 2.5 + abs(float(_value(overrides, "strategy.outer_momentum=", 0.9)) - 0.5)
        loss += abs(float(_value(overrides, "model.optimizer.lr=", best_lr)) - best_lr)
        return {"val_loss": loss + 0.01 * int(_value(overrides, "seed=")), "goodput": 1.0, "wall_time_s": 1.0,
                "bytes_sent": 1.0, "outer_momentum": None, "trace": []}

    monkeypatch.setattr(sys.modules["sim_runs"], "run_sim", stand_in)
    with pytest.raises(ValueError, match="tuning seed 1"):
        at_scale.h1(8, 20, (1, 2), tuning_seed=1)
    with pytest.raises(ValueError, match="at least one held-out seed"):
        at_scale.h1(8, 20, (), tuning_seed=0)
    assert not calls
    result = at_scale.h1(8, 20, (1, 2, 3), tuning_seed=0)
    assert result["tuning_seed"] == 0 and all(t["tuning_seed"] == 0 for t in result["tuning"].values())
    chosen = {name: tuning["chosen"] for name, tuning in result["tuning"].items()}
    assert chosen == {"gossip_adamw": "lr=0.012", "gasloc_adamw": "gamma=0.5", "gossip_sgd_momentum": "lr=0.1",
                      "gossip_sgd_nesterov": "lr=0.1"}
    assert sum("seed=0" in c for c in calls) == 3 + 4 + 4 + 4  # the four grids, on the tuning seed only
    assert all(sorted(run["seeds"], key=int) == ["1", "2", "3"] for run in result["runs"].values())
    for call in calls:  # Hydra applies the last of two values for one key: every key is given once
        keys = [o.split("=")[0] for o in call]
        assert len(keys) == len(set(keys)), call
    runs = {name: set(run["overrides"]) for name, run in result["runs"].items()}
    assert {"strategy.outer_momentum=0.5", "model.optimizer.lr=0.012"} <= runs["gasloc_adamw"]
    adamw = {o for o in runs["gossip_adamw"] if o.startswith("model.optimizer")}
    assert "model.optimizer.lr=0.012" in adamw and adamw <= runs["gasloc_adamw"]  # the same tuned inner AdamW
    assert {"model.optimizer.momentum=0.9", "model.optimizer.lr=0.1"} <= runs["gossip_sgd_momentum"]
    assert {"model.optimizer.nesterov=true", "model.optimizer.lr=0.1"} <= runs["gossip_sgd_nesterov"]
    assert {"model.optimizer.lr=0.3", "strategy.outer_momentum=0.9", "inner_steps=1"} <= runs["gasloc_sgd"]
    assert not any(o.startswith("model.optimizer.momentum") for o in runs["gasloc_sgd"] | runs["gossip_sgd_plain"])
    gamma_grid = [c for c in calls if "strategy=gasloc" in c and "model/optimizer=sgd" not in c and "seed=0" in c]
    assert len(gamma_grid) == 4 and all("model.optimizer.lr=0.012" in c for c in gamma_grid)  # after gossip's tuning


def _value(overrides: list[str], prefix: str, default=None) -> str:
    return next((o[len(prefix):] for o in overrides if o.startswith(prefix)), default)


def test_a_part_says_which_run_of_how_many_records_each_and_resumes_from_the_records(tmp_path, monkeypatch, capsys):
    calls = []

    def stand_in(overrides, out, experiment="demo"):  # gasloc-sim's result for a run, without the process
        if len(calls) == 3 and not (tmp_path / "interrupted").exists():
            (tmp_path / "interrupted").touch()
            raise KeyboardInterrupt  # the session is interrupted during its fourth run
        calls.append(list(overrides))
        return {"overrides": overrides, "val_loss": 3.0 + 0.1 * len(calls), "goodput": 1.0, "wall_time_s": 1.0,
                "bytes_sent": 10, "outer_momentum": None, "trace": [[1, 3.0, 0.5]], "also_traces": {}}

    monkeypatch.setattr(sys.modules["sim_runs"], "run_sim", stand_in)
    with pytest.raises(KeyboardInterrupt):
        at_scale.churn(4, 2, (0, 1), out=tmp_path)
    first = capsys.readouterr().out
    assert "run 1 of 8 (0 done): 0.0/seed0 | ETA -" in first and "run 4 of 8 (3 done)" in first, first
    assert len(calls) == 3
    resumed = at_scale.churn(4, 2, (0, 1), out=tmp_path)
    second = capsys.readouterr().out
    assert len(calls) == 8, "the three recorded runs were read back, the five others run"
    assert "0.0/seed0: recorded" in second and "run 4 of 8 (3 done): 0.05/seed1" in second, second
    assert sorted(resumed["runs"]) == ["0.0", "0.05", "0.1", "0.2"]
    again = at_scale.churn(4, 2, (0, 1), out=tmp_path)
    assert len(calls) == 8 and again == resumed, "everything recorded: nothing runs, the same result"
    at_scale.churn(4, 3, (0, 1), out=tmp_path)  # other settings (steps) are other runs
    assert len(calls) == 16
