"""Scenario presets users meet (conf/network): jitter, preemption, many_sites, and the cluster presets scaled to
the run. Each preset composes for both apps at the run's worker count, and runs a few simulated steps."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from app_utils import compose_config
from dist_utils import write_text_corpus
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.network import ComputeJitter, NetworkModel, Preemption, SimulatedClock, scaled_sizes

pytestmark = pytest.mark.timeout(300)

PRESETS = ("jitter", "preemption", "many_sites", "two_clusters", "cloud_mix")


# ---------------------------------------------------------------------- jitter
def test_jitter_is_a_deterministic_heavy_tailed_factor_with_episodes_of_2_to_5x():
    jitter = ComputeJitter(tail_scale=0.1, tail_index=2.5, slowdown_probability=0.2, slowdown_steps=10, seed=3)
    again = ComputeJitter(tail_scale=0.1, tail_index=2.5, slowdown_probability=0.2, slowdown_steps=10, seed=3)
    factors = [jitter.factor(rank, step) for rank in range(8) for step in range(400)]
    assert factors == [again.factor(rank, step) for rank in range(8) for step in range(400)]
    assert min(factors) >= 1.0
    noise = [jitter.noise(rank, step) for rank in range(8) for step in range(2000)]
    mean_excess = sum(noise) / len(noise) - 1
    assert 0.04 < mean_excess < 0.1  # Lomax: s / (alpha - 1) = 0.067
    assert max(noise) > 1.5  # the tail: 1% of steps above ~1.5x
    episodes = {(r, s // 10): jitter.slowdown(r, s) for r in range(8) for s in range(400)}
    assert all(jitter.slowdown(r, s) == episodes[(r, s // 10)] for r in range(8) for s in range(400))
    slowed = [f for f in episodes.values() if f > 1.0]
    assert 0.1 < len(slowed) / len(episodes) < 0.3 and all(2.0 <= f <= 5.0 for f in slowed)
    other = ComputeJitter(tail_scale=0.1, tail_index=2.5, slowdown_probability=0.2, slowdown_steps=10, seed=4)
    assert [other.factor(0, step) for step in range(50)] != factors[:50]  # another seed, other draws


def test_a_jittered_clock_sums_each_steps_time_and_resumes_exactly():
    network = NetworkModel.uniform(world_size=2, bandwidth_gbps=10, latency_s=0.0, step_time_s=0.5,
                                   compute_jitter=ComputeJitter(slowdown_probability=0.5, slowdown_steps=3, seed=1))
    clock = SimulatedClock(network, rank=1)
    clock.advance_compute(5)
    assert clock.time == pytest.approx(sum(network.step_time(1, k) for k in range(5)))
    assert clock.time > 5 * 0.5
    saved = clock.state_dict()
    clock.advance_compute(4)
    restored = SimulatedClock(network, rank=1)
    restored.load_state_dict(saved)
    restored.advance_compute(4)
    assert restored.time == clock.time


@pytest.mark.parametrize("kwargs,message", [
    (dict(tail_index=0), "tail_index"), (dict(slowdown_probability=1.5), "slowdown_probability"),
    (dict(slowdown_min=0.5), "slowdown_min"), (dict(slowdown_min=3, slowdown_max=2), "min <= max"),
    (dict(slowdown_steps=0), "slowdown_steps"), (dict(tail_scale=-1), "tail_scale"),
])
def test_bad_jitter_is_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ComputeJitter(**kwargs)


# ---------------------------------------------------------------------- preemption
def test_a_static_clock_refuses_preemption_and_an_elastic_one_takes_it():
    network = NetworkModel.uniform(world_size=4, bandwidth_gbps=10, latency_s=0.0, preemption=Preemption())
    with pytest.raises(ValueError, match="preemption.*elastic membership.*gasloc-sim"):
        SimulatedClock(network, rank=0)
    assert SimulatedClock(network, rank=0, membership="elastic").time == 0.0
    with pytest.raises(ValueError, match="preemption.*elastic membership"):  # at construction, before any launch
        GASLoCStrategy(inner_steps=2, network=network)
    with pytest.raises(ValueError, match="down_fraction"):
        Preemption(down_fraction=1.0)
    with pytest.raises(ValueError, match="mean_downtime_rounds"):
        Preemption(mean_downtime_rounds=0.5)


# ---------------------------------------------------------------------- many sites
def test_sites_links_are_the_narrower_uplink_and_share_each_sites_uplink():
    network = NetworkModel.sites(sizes=[2, 2, 2], uplink_gbps=[8.0, 2.0, 4.0], uplink_latency_s=[0.01, 0.02, 0.03],
                                 intra_gbps=100.0, intra_latency_s=0.0)
    assert network.link(0, 2) == (2.0e9 / 8, 0.03)
    assert network.link(0, 4) == (4.0e9 / 8, 0.04)
    assert network.link(0, 1) == (100e9 / 8, 0.0)
    # site 0 sends two exchanges out (to sites 1 and 2): both share its uplink, even to different sites
    flows = network.concurrent_flows([(0, 2), (1, 4), (3, 5)])
    assert flows[(0, 2)] == 2 and flows[(1, 4)] == 2 and flows[(3, 5)] == 2
    separate = NetworkModel.clusters(sizes=[2, 2, 2], intra_gbps=100.0, intra_latency_s=0.0, inter_gbps=2.0,
                                     inter_latency_s=0.03)
    assert separate.concurrent_flows([(0, 2), (1, 4), (3, 5)])[(0, 2)] == 1
    with pytest.raises(ValueError, match="uplink_gbps"):
        NetworkModel.sites(sizes=[2, 2], uplink_gbps=[1.0], uplink_latency_s=0.0, intra_gbps=1.0, intra_latency_s=0.0)


def test_an_all_reduce_over_the_live_ranks_costs_what_those_ranks_cost():
    network = NetworkModel.sites(sizes=[2, 2], uplink_gbps=[10.0, 1.0], uplink_latency_s=0.01, intra_gbps=100.0,
                                 intra_latency_s=0.0)
    inside = network.all_reduce_time(4e9, ranks=[0, 1])
    assert inside == pytest.approx(network.ring_all_reduce_time(4e9, ranks=[0, 1]))
    assert inside < network.all_reduce_time(4e9) and network.all_reduce_time(4e9, ranks=[0]) == 0.0


@pytest.mark.parametrize(("variant", "base", "factor"), [("two_clusters_10g", "two_clusters", 10.0),
                                                          ("two_clusters_100m", "two_clusters", 0.1),
                                                          ("many_sites_fast", "many_sites", 10.0),
                                                          ("many_sites_slow", "many_sites", 0.1)])
def test_the_bandwidth_sweep_presets_change_only_the_links_between_sites(variant, base, factor, tmp_path):
    """Issue 31's sweep of the cross-region bandwidth: a variant is its base with the links between its clusters
    (or its sites' uplinks) ``factor`` times as fast; inside a cluster, compute and latency are the same."""
    built = {}
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        for name in (variant, base):
            cfg = compose("sim/app", overrides=["experiment=demo", f"network={name}", "sim.workers=16",
                                                f"output_dir={tmp_path}"])
            built[name] = instantiate(cfg.network, _convert_="all")
    fast, slow = built[variant], built[base]
    bytes_ = fast.message_bytes()
    assert fast.pairwise_time(0, 1, bytes_) == slow.pairwise_time(0, 1, bytes_)  # inside the first cluster
    far = fast.world_size - 1  # in the last cluster
    transfer = lambda network: network.pairwise_time(0, far, bytes_) - network.pairwise_time(0, far, 0.0)  # noqa: E731
    assert transfer(slow) / transfer(fast) == pytest.approx(factor, rel=1e-6)
    assert fast.step_time(0) == slow.step_time(0) and fast.num_clusters == slow.num_clusters


# ---------------------------------------------------------------------- scaling
def test_cluster_presets_scale_in_proportion_with_speeds_by_cluster():
    assert scaled_sizes([4, 4], 64) == [32, 32] and scaled_sizes([4, 2, 2], 64) == [32, 16, 16]
    assert scaled_sizes([4, 2, 2], 5) == [3, 1, 1] and sum(scaled_sizes([1, 1, 1, 10], 5)) == 5
    network = NetworkModel.clusters(sizes=[4, 2, 2], scale_to=16, intra_gbps=100.0, intra_latency_s=0.0,
                                    inter_gbps=1.0, inter_latency_s=0.03, speeds=[1.0] * 4 + [0.7] * 2 + [0.5] * 2)
    assert network.world_size == 16 and network.speeds == (1.0,) * 8 + (0.7,) * 4 + (0.5,) * 4
    with pytest.raises(ValueError, match="scale_to=2 cannot hold"):
        scaled_sizes([1, 1, 1], 2)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_follows_the_run_in_both_apps(preset, tmp_path):
    train = compose_config([f"network={preset}", "trainer.devices=4"], output_dir=tmp_path)
    network = instantiate(train.network, _convert_="all")
    assert network.world_size == 4
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=["experiment=demo", f"network={preset}", "sim.workers=64",
                                            f"output_dir={tmp_path}"])
    network = instantiate(cfg.network, _convert_="all")
    assert network.world_size == 64
    if preset == "many_sites":
        assert network.num_clusters == 4 and network.uplinks
    if preset == "jitter":
        assert network.compute_jitter is not None and network.step_time(0, 0) != network.step_time(0)
    assert (network.preemption is not None) == (preset == "preemption")


# ---------------------------------------------------------------------- the presets in gasloc-sim
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _sim(corpus: Path, tmp_path: Path, overrides: list[str]) -> dict:
    quick = ["experiment=demo", "trainer.max_steps=4", "trainer.val_check_interval=4", "inner_steps=1",
             f"data.source={corpus}", "data.val_fraction=0.25", "data.batch_size=2", "data.val_batches=1",
             f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "sim.workers=8",
             "sim.progress_every=0"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=quick + overrides)
    sim_app.simulate(cfg)
    return json.loads((tmp_path / "out" / "summary.json").read_text())


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_in_the_simulator(preset, corpus, tmp_path):
    extra = ["network.preemption.mean_downtime_rounds=1", "network.preemption.down_fraction=0.2"] \
        if preset == "preemption" else []
    record = _sim(corpus, tmp_path, [f"network={preset}", *extra])
    assert math.isfinite(record["final"]["val_loss"]) and record["sim"]["sim_time_max"] > 0
    if preset == "preemption":  # its churn: some worker was away, and some came back
        assert record["sim"]["goodput"] < 1.0 and record["sim"]["joins"] >= 1
    else:
        assert record["sim"]["goodput"] == 1.0


def test_preemption_and_sim_down_fraction_together_are_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match="give one"):
        _sim(corpus, tmp_path, ["network=preemption", "sim.down_fraction=0.1"])


@pytest.mark.parametrize("preset", ["jitter", "preemption"])
def test_bandwidth_aware_on_a_network_without_clusters_says_what_to_give(preset, tmp_path):
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=["experiment=demo", f"network={preset}", "topology=bandwidth_aware",
                                            "sim.workers=8", f"output_dir={tmp_path}"])
    with pytest.raises(Exception, match="bandwidth_aware needs clusters: give topology.sizes") as caught:
        instantiate(cfg.topology, _convert_="all")
    assert "network=two_clusters" in str(caught.value)


# ---------------------------------------------------------------------- one run timed on several networks
def _val_times(out: Path, record: dict, column: str) -> list[float]:
    with open(out / record["metrics_csv"], newline="") as handle:
        return [float(row[column]) for row in csv.DictReader(handle) if row.get("val/loss")]


@pytest.mark.parametrize("method", [
    ["strategy=gasloc", "topology=one_peer", "overlap=true", "strategy.message_codec=int8"],
    ["strategy=diloco", "strategy.fragments=2", "strategy.overlap=true", "strategy.message_codec=int4"],
], ids=["gasloc_overlap_int8", "streaming_diloco"])
def test_a_run_timed_alongside_on_other_networks_gives_each_networks_own_clock(method, corpus, tmp_path):
    """sim.also_networks: the validations of one run carry the simulated time it would take on each preset, the
    same times as running it there (the training does not depend on these networks)."""
    steps = ["trainer.max_steps=8", "trainer.val_check_interval=4", "inner_steps=2"]
    alongside = _sim(corpus, tmp_path / "alongside",
                     [*steps, *method, "network=two_clusters", "sim.also_networks=[jitter,many_sites]"])
    assert set(alongside["sim"]["sim_time_max_also"]) == {"jitter", "many_sites"}
    for preset in ("jitter", "many_sites"):
        alone = _sim(corpus, tmp_path / preset, [*steps, *method, f"network={preset}"])
        assert alone["final"]["val_loss"] == alongside["final"]["val_loss"]
        times = _val_times(tmp_path / preset / "out", alone, "val/sim_time")
        assert len(times) == 2 and times == _val_times(tmp_path / "alongside" / "out", alongside,
                                                       f"val/sim_time/{preset}")
        assert alone["sim"]["sim_time_max"] == alongside["sim"]["sim_time_max_also"][preset]
    assert len({alongside["sim"]["sim_time_max"], *alongside["sim"]["sim_time_max_also"].values()}) == 3


@pytest.mark.parametrize(("overrides", "message"), [
    (["network=two_clusters", "sim.also_networks=[preemption]"], "preemption has preemption; its churn would change"),
    (["sim.also_networks=[jitter]"], r"give the run's network too \(network=...\)"),
    (["network=preemption", "sim.also_networks=[jitter]"], "this run's network has preemption"),
    (["network=two_clusters", "sim.also_networks=[nowhere]"], r"no network preset 'nowhere' \(available: \["),
])
def test_networks_that_cannot_be_timed_alongside_are_refused(overrides, message, corpus, tmp_path):
    with pytest.raises(ValueError, match=message):
        _sim(corpus, tmp_path, overrides)
