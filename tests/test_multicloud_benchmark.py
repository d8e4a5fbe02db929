"""benchmarks/multicloud.py: every method composes in every scenario, and the protocol (tune on one seed, report
held-out seeds, time to plain DiLoCo's loss as a ratio) does what its docstring says, on stand-in runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench_utils import load_benchmark
from gasloc_lightning.app import sim as _sim_app  # noqa: F401  (registers the sim app's schema)
from gasloc_lightning.app.config import config_dir

mc = load_benchmark("multicloud")  # as multicloud_benchmark: it imports its sibling sim_runs


@pytest.mark.parametrize("scenario", mc.SCENARIOS)
@pytest.mark.parametrize("workers", [64])
def test_every_method_composes_in_every_scenario(scenario, workers):
    """Every scenario's network with plain DiLoCo; in the first scenario every method's fixed overrides, and each of
    its grid points (and H) parsed as Hydra parses them, every key one that config has (the network and the strategy
    keys are separate nodes: a composition per point, about 100 with H, cost a minute and checked no more)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    methods = mc.METHODS if scenario == mc.SCENARIOS[0] else {"diloco": mc.METHODS["diloco"]}
    grid_of = mc.Scenario(scenario, workers, 600, 10, runs=None, inner_steps_grid=(10, 20, 50)).grid
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        for name, method in methods.items():
            overrides = [f"sim.workers={workers}", *mc.scenario_overrides(scenario), *method.overrides]
            cfg = compose("sim/app", overrides=["experiment=demo", *overrides])
            assert cfg.sim.workers == workers, name
            for label, extra in grid_of(name).items():
                for override in parser.parse_overrides(list(extra)):
                    key = override.key_or_group
                    assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", f"{name} {label}: {key}"
    streaming = mc.METHODS["streaming_diloco"]
    assert {"strategy.fragments=4", "strategy.overlap=true"} <= set(streaming.overrides)
    # its codec is tuned as GASLoC's compressed form's is: the same codecs, the first two outer points of its grid
    assert [label.split(",")[0] for label in streaming.grid] == [label.split(",")[0] for label in
                                                                 mc.METHODS["gasloc_compressed"].grid]


def _stand_in_run(overrides: list[str], out: Path) -> dict:
    """A run whose loss falls with the step and whose time per step depends on the method (and on eta)."""
    if "topology=bandwidth_aware" in overrides:
        raise mc.SimRunError("gasloc-sim exited 1: ...\nError in call to target 'x.from_clusters':\n"
                             "TopologyError('bandwidth_aware needs two clusters')\nfull_key: topology")  # as Hydra says it
    seconds_per_step = 0.5 if "topology=one_peer" in overrides else 1.0
    slower = 1.3 if "strategy.outer_lr=1.0" in overrides else 1.0  # a worse grid point: found by the tuning
    seed = int(next(o for o in overrides if o.startswith("seed=")).split("=")[1])
    steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    trace = [(step, 5.0 - 0.01 * step / slower - 0.001 * seed, step * seconds_per_step) for step in range(10, steps + 1, 10)]
    return {"overrides": overrides, "val_loss": trace[-1][1], "goodput": 1.0 / seconds_per_step, "bytes_sent": 1,
            "trace": trace}


def test_tuning_on_seed_0_and_ratios_on_the_held_out_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "--steps", "40", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())
    scenario = record["scenarios"]["two_clusters"]
    assert scenario["held_out_seeds"] == [1, 2, 3] and scenario["tuning_seed"] == 0 and scenario["steps"] == 60
    tuning, results = scenario["tuning"], scenario["results"]
    assert "outer_lr=1.0" not in " ".join(tuning["diloco"]["overrides"])  # the slower grid point lost
    assert tuning["gasloc_bw_spread"]["error"] == "TopologyError('bandwidth_aware needs two clusters')"
    assert "gasloc_bw_spread" not in results
    assert results["diloco"]["ratios"] == [1.0, 1.0, 1.0]
    # one_peer's steps take half the time: it reaches DiLoCo's loss at the same step, in half the time
    assert results["gasloc_one_peer"]["ratios"] == pytest.approx([0.5, 0.5, 0.5])
    assert results["gasloc_one_peer"]["goodput_mean"] == pytest.approx(2.0)
    assert (tmp_path / "multicloud.png").stat().st_size > 0
    mc.main(["--markdown", "--out", str(tmp_path)])
    table = capsys.readouterr().out.split("### two_clusters, n = 4", 1)[1]
    assert "| gasloc_one_peer | 0.50 | 0.50, 0.50, 0.50 | 2.000 |" in table
    assert "| gasloc_bw_spread | cannot run here |" in table and "held-out seeds 1, 2, 3" in table


def test_the_tuning_seed_cannot_be_a_held_out_seed(tmp_path):
    with pytest.raises(SystemExit):
        mc.main(["--seeds", "0", "1", "--out", str(tmp_path)])


def test_scenarios_that_differ_only_by_the_clock_share_one_run_per_configuration(tmp_path, monkeypatch):
    """two_clusters and jitter: each configuration runs once, timed on both networks (sim.also_networks); only the
    cluster-shaped schedule runs per scenario. Each scenario's ratios come from its own clock."""
    speed = {"network=two_clusters": 1.0, "jitter": 0.25}  # seconds per step of DiLoCo on each network
    calls = []

    def run(overrides: list[str], out: Path) -> dict:
        calls.append(overrides)
        run = _stand_in_run(overrides, out)
        primary = speed["network=two_clusters"] if "network=two_clusters" in overrides else speed["jitter"]
        also = [o for o in overrides if o.startswith("sim.also_networks=")]
        scaled = lambda factor: [(step, loss, time * factor) for step, loss, time in run["trace"]]  # noqa: E731
        return {**run, "trace": scaled(primary), "also_traces": {"jitter": scaled(speed["jitter"])} if also else {}}

    monkeypatch.setattr(mc, "run_sim", run)
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "jitter", "--steps", "40", "--out", str(tmp_path)])
    per_scenario = ("topology=bandwidth_aware", "topology=hierarchical", "topology=two_level")  # jitter has no sites
    assert all("network=jitter" not in call for call in calls if not any(t in call for t in per_scenario))
    shared = [call for call in calls if "sim.also_networks=[jitter]" in call]
    assert shared and len(shared) == len({tuple(call) for call in shared})  # each configuration once
    own = [c for c in calls if "topology=bandwidth_aware" in c and "network=jitter" in c]  # each point tried, refused
    assert len(own) == len(mc.METHODS["gasloc_bw_spread"].grid)
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]
    for name in ("two_clusters", "jitter"):
        assert record[name]["results"]["gasloc_one_peer"]["ratios"] == pytest.approx([0.5, 0.5, 0.5])
        targets = [s["diloco_time"] for s in record[name]["results"]["diloco"]["seeds"].values()]
        assert targets == pytest.approx([40 * speed["network=two_clusters" if name == "two_clusters" else name]] * 3)


def test_two_level_methods_share_runs_only_between_scenarios_of_one_site_layout_and_report_the_family_ratio(
        tmp_path, monkeypatch, capsys):
    """two_clusters at 1 and 10 Gbit/s and jitter, H in the grid: a two-level run is shared by the two two_clusters
    (their sites, hence regions, are the same) and runs alone on jitter (no sites: it cannot run there, and says
    so); each run validates at its own round ends; every held-out seed gives each method's time over the fastest
    DiLoCo-family method's."""
    calls = []

    def run(overrides: list[str], out: Path) -> dict:
        calls.append(overrides)
        if "network=jitter" in overrides and any(o.startswith("topology=") and "one_peer" not in o for o in overrides):
            raise mc.SimRunError("gasloc-sim exited 1: ...\nTopologyError('two_level needs regions')\n"
                                 "full_key: topology")
        result = _stand_in_run(overrides, out)
        factor = 2 / 3 if "topology=two_level" in overrides else 0.5 if "strategy.fragments=4" in overrides else 1.0
        result["trace"] = [(step, loss, time * factor) for step, loss, time in result["trace"]]  # streaming: 2x
        also = [o for o in overrides if o.startswith("sim.also_networks=")]
        names = also[0].split("=", 1)[1].strip("[]").split(",") if also else []
        return {**result, "also_traces": {name: result["trace"] for name in names}}

    monkeypatch.setattr(mc, "run_sim", run)
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "two_clusters_10g", "jitter", "--steps", "40",
             "--inner-steps-grid", "10", "20", "--methods", "diloco", "hierarchical", "two_level",
             "--out", str(tmp_path)])
    two_level = [c for c in calls if "topology=two_level" in c]
    assert two_level and all("sim.also_networks=[two_clusters_10g]" in c and "network=two_clusters" in c
                             for c in two_level if "network=jitter" not in c)
    assert any("network=jitter" in c for c in two_level)  # asked there on its own, and refused
    plain = [c for c in calls if "strategy=diloco" in c]
    assert plain and all("sim.also_networks=[two_clusters_10g,jitter]" in c for c in plain)
    for call in calls:  # H in the grid; validated at each run's own round ends
        h = next(o for o in call if o.startswith("inner_steps=")).split("=")[1]
        assert f"trainer.val_check_interval={h}" in call and call.count(f"inner_steps={h}") == 1, call
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]
    assert record["two_clusters"]["inner_steps_grid"] == [10, 20]
    assert record["jitter"]["tuning"]["two_level"]["error"] == "TopologyError('two_level needs regions')"
    results = record["two_clusters_10g"]["results"]
    assert results["two_level"]["family_ratios"] == pytest.approx([2 / 3] * 3)  # over DiLoCo and hierarchical's
    assert results["diloco"]["family_ratios"] == pytest.approx([1.0] * 3)
    assert record["two_clusters"]["tuning"]["two_level"]["label"].startswith("H=")
    # three K tried (2, 4, 8) and K=2 chosen (the stand-in ties, the first wins): an edge; two H: no inside to miss
    assert record["two_clusters"]["tuning"]["two_level"]["edges"] == ["K"]
    mc.main(["--markdown", "--out", str(tmp_path)])
    table = capsys.readouterr().out.split("### two_clusters_10g, n = 4", 1)[1].split("###")[0]
    assert "time / best DiLoCo-family, per seed |" in table and "| two_level |" in table and "(edge: K)" in table
    assert "0.67, 0.67, 0.67 |" in table
    # Streaming DiLoCo run later with the same protocol: merged in, it is the family's fastest for every method kept
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "two_clusters_10g", "jitter", "--steps", "40",
             "--inner-steps-grid", "10", "20", "--methods", "diloco", "streaming_diloco", "--out", str(tmp_path)])
    merged = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["two_clusters_10g"]["results"]
    assert merged["two_level"]["family_ratios"] == pytest.approx([4 / 3] * 3)  # (2/3) / (1/2)
    assert merged["streaming_diloco"]["family_ratios"] == pytest.approx([1.0] * 3)
    # --outer that names no point of a method's grid: that method is reported untuned, the others run
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "--steps", "40", "--methods", "diloco", "two_level",
             "--outer", "eta=0.7,gamma=0.5", "--out", str(tmp_path / "outer")])
    outer = json.loads((tmp_path / "outer" / "multicloud_n4.json").read_text())["scenarios"]["two_clusters"]
    assert outer["tuning"]["two_level"]["error"] == "no grid point of two_level has the outer step eta=0.7,gamma=0.5"


def test_a_size_can_reuse_the_configurations_tuned_at_another(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "preemption", "--steps", "40", "--out", str(tmp_path)])
    calls = []
    monkeypatch.setattr(mc, "run_sim", lambda overrides, out: calls.append(overrides) or _stand_in_run(overrides, out))
    mc.main(["--workers", "6", "--scenarios", "preemption", "--steps", "40", "--tuned-from", "4", "--out", str(tmp_path)])
    assert not any("seed=0" in call for call in calls)  # no tuning at 6
    tuned = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["preemption"]["tuning"]
    at6 = json.loads((tmp_path / "multicloud_n6.json").read_text())["scenarios"]["preemption"]
    assert at6["tuning"] == tuned and at6["tuned_at_workers"] == 4
    assert all("overlap=true" not in call for call in calls if "strategy=gasloc" in call)  # churn: no overlap
    with pytest.raises(FileNotFoundError, match="run it at n = 5 first"):
        mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--tuned-from", "5", "--out",
                 str(tmp_path)])


def _methods_run(monkeypatch) -> set[str]:
    """The methods that ``Scenario.run`` is asked to run from now on."""
    ran, run = set(), mc.Scenario.run
    monkeypatch.setattr(mc.Scenario, "run", lambda self, method, *args: ran.add(method) or run(self, method, *args))
    return ran


def test_a_subset_of_the_methods_is_tuned_and_run_and_the_tables_name_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    ran = _methods_run(monkeypatch)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "gasloc_streamed", "diloco",
             "--out", str(tmp_path)])
    assert ran == {"diloco", "gasloc_streamed"}
    at4 = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]
    assert list(at4["results"]) == [m for m in at4["tuning"] if m in mc.METHODS] == ["diloco", "gasloc_streamed"]
    assert at4["tuning"]["gasloc_best"]["form"] == "gasloc_streamed"  # the only form tuned
    assert set(at4["not_run"]) == set(mc.METHODS) - {"diloco", "gasloc_streamed"}
    capsys.readouterr()
    mc.main(["--markdown", "--out", str(tmp_path)])
    table = capsys.readouterr().out.split("### jitter, n = 4", 1)[1]
    assert "Not run here (left out with --methods): ddp, streaming_diloco," in table
    assert "gasloc_bw_spread | cannot run here" not in table  # not run, so not reported as unable to run
    with pytest.raises(SystemExit):
        mc.main(["--methods", "gasloc_streamed", "--out", str(tmp_path)])
    assert "--methods must include diloco" in capsys.readouterr().err
    with pytest.raises(ValueError, match="include diloco"):
        mc.run_scenarios(4, ("jitter",), 40, 10, 0, (1, 2, 3), tmp_path, methods=("gasloc_streamed",))


def test_a_rerun_with_other_methods_keeps_the_results_of_the_same_protocol(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])
    ran = _methods_run(monkeypatch)
    mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--tuned-from", "4",
             "--methods", "diloco", "streaming_diloco", "--out", str(tmp_path)])
    mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--tuned-from", "4",
             "--methods", "gasloc_streamed", "diloco", "--out", str(tmp_path)])
    assert ran == {"diloco", "streaming_diloco", "gasloc_streamed"}
    at6 = json.loads((tmp_path / "multicloud_n6.json").read_text())["scenarios"]["jitter"]
    assert list(at6["results"]) == ["diloco", "streaming_diloco", "gasloc_streamed"]
    assert "streaming_diloco" not in at6["not_run"] and "gasloc_one_peer" in at6["not_run"]
    assert at6["tuning_seed"] == 0 and at6["tuned_at_workers"] == 4
    mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])  # another protocol (tuned at 6): replaces the record
    assert list(json.loads((tmp_path / "multicloud_n6.json").read_text())["scenarios"]["jitter"]["results"]) == [
        "diloco"]


def test_a_record_written_before_tuned_at_workers_existed_is_kept_by_a_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])
    path = tmp_path / "multicloud_n4.json"
    legacy = json.loads(path.read_text())
    del legacy["scenarios"]["jitter"]["tuned_at_workers"]
    path.write_text(json.dumps(legacy))
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "gasloc_streamed",
             "--out", str(tmp_path)])
    results = json.loads(path.read_text())["scenarios"]["jitter"]["results"]
    assert {"ddp", "streaming_diloco", "gasloc_one_peer", "gasloc_compressed"} <= set(results)


def _new_simulator(monkeypatch, tmp_path: Path, run_sim) -> None:
    """Another simulator from now on: the runs recorded under the previous one are dropped (else they are read back)."""
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
    monkeypatch.setattr(mc, "run_sim", run_sim)


def test_a_rerun_reads_the_recorded_runs_back_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    calls = []

    def stops_after(count):
        def run_sim(overrides, out):
            if len(calls) == count:
                raise KeyboardInterrupt  # stopped (by pid) mid-benchmark
            calls.append(overrides)
            return _stand_in_run(overrides, out)
        return run_sim

    monkeypatch.setattr(mc, "run_sim", stops_after(5))
    with pytest.raises(KeyboardInterrupt):
        mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])
    assert len(list((tmp_path / "runs" / "n4").glob("*.json"))) == 5
    done = len(calls)
    monkeypatch.setattr(mc, "run_sim", stops_after(10**6))
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])
    rerun = calls[done:]
    assert rerun and not set(map(tuple, rerun)) & set(map(tuple, calls[:done]))  # nothing ran twice
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]
    assert record["results"]["gasloc_one_peer"]["ratios"] == pytest.approx([0.5, 0.5, 0.5])


def test_each_run_says_which_of_how_many_its_eta_and_a_resumed_session_counts_the_recorded(tmp_path, monkeypatch,
                                                                                             capsys):
    """The session counts its runs before the first one; a session stopped after 4 runs resumes at run 5 of the same
    total, with 4 done."""
    calls = []

    def stops_after(count):
        def run_sim(overrides, out):
            if len(calls) == count:
                raise KeyboardInterrupt
            calls.append(overrides)
            return _stand_in_run(overrides, out)
        return run_sim

    argv = ["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "gasloc_one_peer",
            "--out", str(tmp_path)]
    monkeypatch.setattr(mc, "run_sim", stops_after(4))
    with pytest.raises(KeyboardInterrupt):
        mc.main(argv)
    first = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("run ")]
    total = int(first[0].split(" of ")[1].split()[0])
    assert first[0].startswith(f"run 1 of {total} (0 done): ") and first[0].endswith("| ETA -"), first[0]
    assert first[3].startswith(f"run 4 of {total} (3 done): ") and "ETA -" not in first[3], first[3]
    monkeypatch.setattr(mc, "run_sim", stops_after(10**6))
    mc.main(argv)
    second = capsys.readouterr().out
    assert f"{total} gasloc-sim runs at n = 4, 4 recorded already" in second
    resumed = [line.strip() for line in second.splitlines() if line.strip().startswith("run ")]
    assert resumed[0].startswith(f"run 5 of {total} (4 done): "), resumed[0]
    assert len(calls) == total, "the plan counted other runs than the session ran"
    assert resumed[-1].startswith(f"run {total} of {total} ({total - 1} done): ")


def test_gaslocs_best_form_is_chosen_on_the_tuning_seed_and_alone_runs_the_held_out_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    ran = _methods_run(monkeypatch)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--forms", "best", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]
    best = record["tuning"]["gasloc_best"]
    assert best == {"form": mc.best_form(record["tuning"]), "seed": 0}
    # the stand-in's one_peer forms tie on time; the tie goes to the lower final loss, as within a form
    assert best["form"] in {"gasloc_one_peer", "gasloc_compressed"}
    assert set(record["results"]) & set(mc.GASLOC_FORMS) == {best["form"]}
    assert {"gasloc_streamed", "gasloc_one_peer", "gasloc_compressed"} <= ran  # all tuned on seed 0
    with pytest.raises(ValueError, match="at least 3 held-out seeds"):
        mc.run_scenarios(4, ("jitter",), 40, 10, 0, (1, 2), tmp_path)


def test_scenarios_sharing_runs_that_choose_different_points_keep_a_record_of_each(tmp_path, monkeypatch):
    """jitter and two_clusters share their runs: where they choose different codecs for one method, each held-out
    run is kept under its own grid label (one "chosen" name made the second overwrite the first's record)."""
    monkeypatch.setattr(mc, "run_sim", lambda overrides, out: (lambda run: {**run, "also_traces": {
        "two_clusters": run["trace"]}})(_stand_in_run(overrides, out)))
    given = {"jitter": {"gasloc_compressed": {"label": "int8,eta=0.7,gamma=0.5", "overrides": [
                 "strategy.message_codec=int8", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.5"]}},
             "two_clusters": {"gasloc_compressed": {"label": "int4,eta=0.7,gamma=0.5", "overrides": [
                 "strategy.message_codec=int4", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.5"]}}}
    mc.run_scenarios(4, ("jitter", "two_clusters"), 40, 10, 0, (1, 2, 3), tmp_path,
                     methods=("diloco", "gasloc_compressed"), given=given)
    folder = tmp_path / "runs" / "n4"
    for codec in ("int8", "int4"):
        for seed in (1, 2, 3):
            name = mc.slug(f"shared_jitter_two_clusters_gasloc_compressed_{codec},eta=0.7,gamma=0.5_seed{seed}")
            run = json.loads((folder / f"{name}.json").read_text())
            assert f"strategy.message_codec={codec}" in run["overrides"]


def test_a_rerun_drops_a_method_that_now_fails_and_a_new_reference_replaces_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])

    def streamed_fails(overrides, out):
        if "strategy.fragment_sync_delay=1" in overrides:
            raise mc.SimRunError("RuntimeError: fragments need H >= 4")
        return _stand_in_run(overrides, out)

    _new_simulator(monkeypatch, tmp_path, streamed_fails)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "gasloc_streamed",
             "--out", str(tmp_path)])
    scenario = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]
    assert "gasloc_streamed" not in scenario["results"] and "error" in scenario["tuning"]["gasloc_streamed"]
    assert "gasloc_one_peer" in scenario["results"]  # not tried now: kept

    def diloco_off_by(relative):  # plain DiLoCo's losses moved by ``relative``, nothing else
        def run_sim(overrides, out):
            run = _stand_in_run(overrides, out)
            if "strategy=diloco" in overrides:
                run["trace"] = [(step, loss * (1 + relative), time) for step, loss, time in run["trace"]]
            return run
        return run_sim

    # a real multi-process rerun: the same reference up to the last digits
    _new_simulator(monkeypatch, tmp_path, diloco_off_by(1e-5))
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])
    assert "gasloc_one_peer" in json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"][
        "results"]

    # a reference 1e-3 away is another one (seeds differ by about 7e-4)
    _new_simulator(monkeypatch, tmp_path, diloco_off_by(1e-3))
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])
    assert list(json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]["results"]) == [
        "diloco"]
    _new_simulator(monkeypatch, tmp_path, _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--out", str(tmp_path)])  # all again
    rebuilt = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]
    # against the stand-in's own DiLoCo, not the 1e-3 one
    assert set(rebuilt["tuning"]) == {*mc.DEFAULT_METHODS, "gasloc_best"}

    def slower_diloco(overrides, out):  # the reference moved (another simulator): every old ratio is void
        run = _stand_in_run(overrides, out)
        if "strategy=diloco" in overrides:
            run["trace"] = [(step, loss, 2 * time) for step, loss, time in run["trace"]]
        return run

    _new_simulator(monkeypatch, tmp_path, slower_diloco)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])
    assert list(json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["jitter"]["results"]) == [
        "diloco"]


def test_tuned_from_checks_every_scenario_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])
    ran = _methods_run(monkeypatch)
    with pytest.raises(FileNotFoundError, match="no preemption"):
        mc.main(["--workers", "6", "--scenarios", "jitter", "preemption", "--steps", "40", "--tuned-from", "4",
                 "--methods", "diloco", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--steps 40 --inner-steps 10, not 60 and 10"):
        mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "60", "--tuned-from", "4",
                 "--methods", "diloco", "--out", str(tmp_path)])
    assert not ran and not (tmp_path / "multicloud_n6.json").exists()


def test_never_reached_is_drawn_above_every_measured_ratio():
    records = [{"scenarios": {"a": {"results": {"m": {"ratios": [0.5, None]}}}}},
               {"scenarios": {"b": {"results": {"m": {"ratios": [80.0, 3.0]}}}}}]
    assert mc.never_height(records) > 80.0


def test_a_size_tuned_from_another_keeps_its_tuning_seed_out_of_the_held_out_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(["--workers", "4", "--scenarios", "jitter", "--steps", "40", "--methods", "diloco", "--out",
             str(tmp_path)])
    with pytest.raises(ValueError, match="tuned on seed 0"):
        mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--tuned-from", "4",
                 "--seeds", "0", "1", "--methods", "diloco", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # the source's tuning seed is the one recorded: another one is refused
        mc.main(["--workers", "6", "--scenarios", "jitter", "--steps", "40", "--tuned-from", "4",
                 "--tuning-seed", "5", "--methods", "diloco", "--out", str(tmp_path)])


@pytest.mark.parametrize(("output", "reason"), [
    ("Error in call to target 'x':\nTopologyError('needs clusters')\nfull_key: topology", "TopologyError('needs clusters')"),
    ("Traceback ...\nomegaconf.errors.ValidationError: bad value\n    full_key: a.b", "omegaconf.errors.ValidationError: bad value"),
    ("KeyError: 'x'\nThe above exception was the direct cause\nValueError: no such preset", "ValueError: no such preset"),
    ("  assert x\nAssertionError", "AssertionError"),
    ("Could not override 'a.b'.\nfull_key: a.b\nobject_type=dict", "Could not override 'a.b'."),
    ("", ""),
])
def test_a_failed_run_is_reported_by_the_error_it_raised(output, reason):
    assert mc.SimRunError(output).reason == reason


def test_a_run_keeps_hydras_error_line_and_a_hung_run_is_killed_and_reported(tmp_path, monkeypatch):
    import subprocess

    sim_runs = sys.modules["sim_runs"]
    told = "Error locating target 'x.Y', set env var HYDRA_FULL_ERROR=1 to see chained stack trace."
    monkeypatch.setattr(sim_runs.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, stdout=f"{told}\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"))
    with pytest.raises(mc.SimRunError) as failed:
        sim_runs.run_sim(["sim.workers=4"], tmp_path)
    assert failed.value.reason == told

    def hangs(command, timeout, **kwargs):
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(sim_runs.subprocess, "run", hangs)
    monkeypatch.setattr(sim_runs, "RUN_TIMEOUT_S", 5.0)
    with pytest.raises(mc.SimRunError) as hung:
        sim_runs.run_sim(["sim.workers=4"], tmp_path)
    assert hung.value.reason == "TimeoutError: no result after 5 s"


def test_a_chosen_point_at_an_end_of_its_grid_is_flagged_by_name():
    grid = [f"H={h},K={k},int4,eta=0.7" for h in (10, 20, 50) for k in (2, 4, 8)]
    assert mc.grid_edges(grid, "H=20,K=4,int4,eta=0.7") == []  # inside on both; eta was tried at one value only
    assert mc.grid_edges(grid, "H=50,K=4,int4,eta=0.7") == ["H"]
    assert mc.grid_edges(grid, "H=10,K=8,int4,eta=0.7") == ["H", "K"]
    assert mc.grid_edges(["default"], "default") == []


def test_a_dry_run_lists_the_runs_and_runs_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mc, "run_sim", lambda overrides, out: pytest.fail("a dry run ran gasloc-sim"))
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "two_clusters_10g", "--steps", "40",
             "--inner-steps-grid", "10", "20", "--methods", "diloco", "two_level", "--dry-run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith("  to run")]
    # plain DiLoCo: 6 points (3 outer x 2 H) on seed 0 + the chosen one on 3 held-out seeds; two_level: 12 + 3
    assert out.startswith(f"{len(listed)} gasloc-sim runs at n = 4, 0 recorded") and len(listed) == 6 + 3 + 12 + 3
    assert not (tmp_path / "multicloud_n4.json").exists()


def test_points_cut_each_method_s_grid_and_are_recorded_with_the_protocol(tmp_path, monkeypatch, capsys):
    """--points: only the grid labels with every given part (H included), so a cut protocol is sized with
    --dry-run and run as sized; the cut is part of the record's protocol."""
    protocol = ["--workers", "4", "--scenarios", "two_clusters", "--steps", "40", "--inner-steps-grid", "10", "20",
                "--methods", "diloco", "two_level"]
    common = [*protocol, "--points", "diloco=eta=1.0,gamma=0.3", "two_level=K=4,int4", "--out", str(tmp_path)]
    mc.main([*common, "--dry-run"])
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  to run")]
    assert len(listed) == 2 + 3 + 2 + 3  # each: its point at H 10 and 20 on seed 0, the chosen one on 3 seeds
    assert all("K_4_int4" in line for line in listed if "two_level" in line)
    monkeypatch.setattr(mc, "run_sim", _stand_in_run)
    mc.main(common)
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["two_clusters"]
    assert record["tuning"]["diloco"]["points"] == ["eta=1.0", "gamma=0.3"]
    assert record["tuning"]["two_level"]["points"] == ["K=4", "int4"]
    assert set(record["tuning"]["two_level"]["scores"]) == {"H=10,K=4,int4,eta=0.7,gamma=0.9",
                                                            "H=20,K=4,int4,eta=0.7,gamma=0.9"}
    for bad in (["diloco=eta=9"], ["two_level=H=30"], ["two_level=K=4,"], ["gasloc_streamed=default"],
                ["two_level=K=4", "two_level=int4"]):  # no such point, an empty part, not run, twice
        with pytest.raises(SystemExit):
            mc.main([*protocol, "--points", *bad, "--out", str(tmp_path / "none")])
    assert "no grid point of diloco has every part" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a tuning's shape does not go with --tuned-from (the source's choices run)
        mc.main(["--workers", "8", "--scenarios", "two_clusters", "--steps", "40", "--tuned-from", "4",
                 "--points", "diloco=eta=1.0", "--out", str(tmp_path)])


def test_a_batch_size_reaches_every_run_and_a_size_tuned_at_another_batch_is_refused(tmp_path, monkeypatch, capsys):
    """--batch-size: every run (its own-H points included) trains on that batch, the record says so, the tables
    name it, and --tuned-from refuses a source tuned at another batch."""
    calls = []
    monkeypatch.setattr(mc, "run_sim", lambda overrides, out: calls.append(overrides) or _stand_in_run(overrides, out))
    mc.main(["--workers", "4", "--scenarios", "two_clusters", "--steps", "40", "--inner-steps-grid", "10", "20",
             "--methods", "diloco", "--batch-size", "4", "--out", str(tmp_path)])
    assert calls and all("data.batch_size=4" in call for call in calls)
    assert {next(o for o in call if o.startswith("trainer.val_check_interval=")) for call in calls} == {
        "trainer.val_check_interval=10", "trainer.val_check_interval=20"}  # each H still validates at its rounds
    record = json.loads((tmp_path / "multicloud_n4.json").read_text())["scenarios"]["two_clusters"]
    assert record["batch_size"] == 4
    mc.main(["--markdown", "--out", str(tmp_path)])
    assert "60 steps of batch 4, H tuned over [10, 20]" in capsys.readouterr().out
    with pytest.raises(ValueError, match="tuned with --batch-size 4, not None"):
        mc.main(["--workers", "6", "--scenarios", "two_clusters", "--steps", "40", "--tuned-from", "4",
                 "--methods", "diloco", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        mc.main(["--workers", "4", "--batch-size", "0", "--out", str(tmp_path)])
