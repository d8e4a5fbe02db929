"""The simulator's two-level rounds (sim/two_level.py): against the float64 oracle of tests/test_two_level.py on
stacked rows, each level's bytes and clock, and `gasloc-sim ... topology=two_level / hierarchical` end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException

from dist_utils import write_text_corpus
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.algorithm.round import EncodedMean
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.sim import TwoLevelRounds, WorkerClocks
from gasloc_lightning.topology.regions import TwoLevelTopology
from test_regions import Quadratics
from test_two_level import oracle

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("region_topology", ["one_peer", "complete"])
def test_rounds_follow_the_oracle_and_count_each_level(region_topology):
    """Two regions of 4, K = 3: the stacked engine is the oracle's rule; the region level sends a ring all-reduce
    every round, the cross level a quarter model per rank (shard-parallel) plus the all-gather, or an all-reduce."""
    n, d, rounds = 8, 6, 9
    topology = TwoLevelTopology.from_network(sizes=[4, 4], cross_every=3, region_topology=region_topology)
    rule = topology.rule(region_lr=0.7, region_momentum=0.9)
    quadratics = Quadratics(n, dim=d, seed=3)
    network = NetworkModel.clusters(sizes=[4, 4], intra_gbps=100.0, inter_gbps=1.0, model_parameters=d,
                                    intra_latency_s=1e-5, inter_latency_s=0.03,
                                    step_time_s=1.0)
    clocks = WorkerClocks(network, n)
    engine = TwoLevelRounds(initial=torch.zeros(n, d), topology=topology, rule=rule, clocks=clocks)
    local = Quadratics(n, dim=d, seed=3)
    local.hessians, local.centres = quadratics.hessians.float(), quadratics.centres.float()
    flat = torch.zeros(n, d)
    for t, expected in enumerate(oracle(quadratics, topology.regions, rule, topology.region_topology, rounds)):
        flat = local.local(flat)
        engine.communicate(flat, t, list(range(n)))
        assert torch.allclose(flat.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    region_bytes = rounds * 2 * 3 * d * 4 / 4  # ring all-reduce among 4: 2 (m - 1) / m of the model, every round
    assert float(engine.bytes_region[0]) == pytest.approx(region_bytes)
    crossings = rounds // 3
    if region_topology == "complete":
        cross_bytes = crossings * 2 * 7 * d * 4 / 8
    else:
        cross_bytes = crossings * (d * 4 / 4 + 3 * d * 4 / 4)  # a quarter across, then the all-gather
    assert float(engine.bytes_cross[0]) == pytest.approx(cross_bytes)
    assert engine.level_bytes()["comm/bytes_cross"] == pytest.approx(cross_bytes)


def test_the_cross_step_waits_on_the_slow_link_and_the_region_step_does_not():
    """A 1 Gbit/s link across, 100 inside: a region round costs the intra all-reduce; a crossing adds the model over
    the slow link (4 shards in parallel, sharing it)."""
    parameters = 10**8  # 400 MB float32: 3.2 s over 1 Gbit/s
    network = NetworkModel.clusters(sizes=[4, 4], intra_gbps=100.0, inter_gbps=1.0, inter_latency_s=0.0,
                                    intra_latency_s=0.0, model_parameters=parameters, step_time_s=1.0)
    topology = TwoLevelTopology.from_network(sizes=[4, 4], cross_every=2)
    clocks = WorkerClocks(network, 8)
    engine = TwoLevelRounds(initial=torch.zeros(8, 3), topology=topology,
                            rule=topology.rule(region_lr=0.7, region_momentum=0.9), clocks=clocks)
    flat = torch.randn(8, 3)
    engine.communicate(flat, 0, list(range(8)))  # a region round
    region_round = clocks.times()[0]
    assert 0 < region_round < 0.1  # 0.06 s: 2 (3/4) 400 MB at 100 Gbit/s
    engine.communicate(flat, 1, list(range(8)))  # a crossing
    crossing = clocks.times()[0] - region_round
    assert crossing == pytest.approx(region_round + 3.2 + region_round / 2, rel=0.05)


@pytest.mark.parametrize("delayed", [False, True], ids=["waited", "delayed"])
def test_the_delayed_crossing_travels_under_the_region_rounds_compute(delayed):
    """3.2 s over the slow link per crossing, K = 2 rounds of 2 s of compute between crossings: the delayed crossing
    posted at round 1 lands at round 3 with nothing left to wait for (only the region's all-gather of the mixed
    shards); the waited one adds the whole transfer at each crossing. The last one lands at the end of training."""
    parameters = 10**8  # 400 MB float32: 3.2 s over 1 Gbit/s
    network = NetworkModel.clusters(sizes=[4, 4], intra_gbps=100.0, inter_gbps=1.0, inter_latency_s=0.0,
                                    intra_latency_s=0.0, model_parameters=parameters, step_time_s=1.0)
    topology = TwoLevelTopology.from_network(sizes=[4, 4], cross_every=2, cross_overlap=delayed)
    clocks = WorkerClocks(network, 8)
    engine = TwoLevelRounds(initial=torch.zeros(8, 3), topology=topology,
                            rule=topology.rule(region_lr=0.7, region_momentum=0.9), clocks=clocks)
    flat = torch.randn(8, 3)
    region_round = 2 * 0.75 * 400e6 * 8 / 100e9  # a ring all-reduce of the model inside a region of 4
    for t in range(4):
        for _ in range(2):
            clocks.advance_compute(range(8))
        engine.communicate(flat, t, list(range(8)))
    waited = 8 + 4 * region_round + 2 * (3.2 + region_round / 2)
    delayed_time = 8 + 4 * region_round + region_round / 2  # the landing at round 3 waits for nothing but its gather
    assert clocks.times() == pytest.approx([delayed_time if delayed else waited] * 8, rel=1e-3)
    end = clocks.times()[0]
    engine.flush(flat)
    assert clocks.times()[0] - end == pytest.approx(3.2 + region_round / 2 if delayed else 0.0, rel=1e-3)


def test_a_lossy_cross_codec_keeps_the_ranks_mean_and_sends_its_wire_s_bytes():
    """int8 shards across: the mixed points differ from float32's by about the rounding, the mean over ranks does
    not move (each rank keeps its own residual), and the cross bytes are int8's wire, about 0.26x float32's."""
    from gasloc_lightning.algorithm.codecs import build_codec

    numel, layout = 1000, [0, 0, 1, 1, 2, 2, 3, 3]
    rule_of = lambda t: t.rule(region_lr=1.0, region_momentum=0.0)  # noqa: E731  the region step is the identity
    results = {}
    for codec in ("float32", "int8"):
        topology = TwoLevelTopology(layout, cross_every=1, cross_momentum=0.0, cross_codec=codec)
        engine = TwoLevelRounds(initial=torch.zeros(8, numel), topology=topology, rule=rule_of(topology),
                                clocks=WorkerClocks(None, 8))
        flat = torch.randn(4, numel, generator=torch.Generator().manual_seed(0)).repeat_interleave(2, dim=0)
        before = flat.mean(dim=0)
        engine.communicate(flat, 0, list(range(8)))
        torch.testing.assert_close(flat.mean(dim=0), before, rtol=0, atol=1e-6)
        results[codec] = (flat, float(engine.bytes_cross[0]))
    (exact, exact_bytes), (coded, coded_bytes) = results["float32"], results["int8"]
    assert 0 < float((coded - exact).abs().max()) <= 2 * 3.5 / 254  # absmax of N(0, 1) blocks: below 3.5
    chunk = numel // 2
    assert coded_bytes == build_codec("int8").wire_numel(chunk) + 4 * chunk * 1  # wire out; the gather is float32
    assert exact_bytes == 4 * chunk + 4 * chunk


def test_hierarchical_diloco_s_quantized_mean_leaves_one_point_near_the_exact_mean():
    """int8 hierarchical crossing: every rank ends on the same point (a mean, not a mix), within int8's rounding of
    the changes since the last mean (not of the points), and each rank sends DiLoCo's quantized all-reduce of its
    shard among the r regions' rank l (2 (r - 1) sub-chunk wires), then gathers its region's shards."""
    numel, layout = 1000, [0, 0, 1, 1, 2, 2, 3, 3]
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 10  # points far larger than changes
    results = {}
    for codec in ("float32", "int8"):
        topology = TwoLevelTopology(layout, cross_every=1, region_topology="complete", cross_momentum=0.0,
                                    cross_codec=codec)
        engine = TwoLevelRounds(initial=start.repeat(8, 1), topology=topology,
                                rule=topology.rule(region_lr=1.0, region_momentum=0.0), clocks=WorkerClocks(None, 8))
        change = torch.randn(4, numel, generator=torch.Generator().manual_seed(0)).repeat_interleave(2, dim=0)
        flat = start + change
        engine.communicate(flat, 0, list(range(8)))
        results[codec] = (flat, float(engine.bytes_cross[0]))
    (exact, exact_bytes), (coded, coded_bytes) = results["float32"], results["int8"]
    assert torch.equal(coded, coded[0].expand_as(coded))  # one point
    error = float((coded[0] - exact[0]).abs().max())
    assert 0 < error <= 2 * 3.5 / 254  # the changes' rounding (N(0, 1) blocks), not the points' (10x larger)
    shard_mean = EncodedMean("int8", numel // 2, 4)  # each rank's shard (m = 2) averaged over r = 4 regions
    assert coded_bytes == 2 * 3 * shard_mean.chunk_wire + 4 * (numel // 2)  # all-to-all + all-gather; the gather
    assert exact_bytes == ring_all_reduce_bytes(4 * numel, 8)


def test_the_delayed_quantized_mean_is_dilocox_s_step_near_the_float32_one():
    """Hierarchical DiLoCo, delayed, int8 (DiLoCoX's delayed compressed step, gasloc-sim only): each landed mix is
    one point on every rank (the reference of the next changes), the points stay within int8's rounding of the
    float32 delayed mean's after three crossings and the final fold, and each crossing sends the quantized
    all-reduce's bytes plus the region's gather."""
    numel, layout, rounds = 1000, [0, 0, 1, 1, 2, 2, 3, 3], 3
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 10
    finals, engines = {}, {}
    for codec in ("float32", "int8"):
        topology = TwoLevelTopology(layout, cross_every=1, region_topology="complete", cross_momentum=0.0,
                                    cross_overlap=True, cross_codec=codec)
        engine = TwoLevelRounds(initial=start.repeat(8, 1), topology=topology,
                                rule=topology.rule(region_lr=1.0, region_momentum=0.0), clocks=WorkerClocks(None, 8))
        flat = start.repeat(8, 1)
        for t in range(rounds):
            flat += torch.randn(4, numel, generator=torch.Generator().manual_seed(t)).repeat_interleave(2, dim=0)
            engine.communicate(flat, t, list(range(8)))
            mix = engine.round.last_mix
            assert torch.equal(mix, mix[0].expand_as(mix)), f"{codec}: the landed mix differs between ranks"
        engine.flush(flat)
        finals[codec], engines[codec] = flat, engine
    error = float((finals["int8"] - finals["float32"]).abs().max())
    assert 0 < error <= rounds * 2 * 3.5 / 254  # the changes' rounding per crossing, not the points' (10x larger)
    shard_mean = EncodedMean("int8", numel // 2, 4)
    gather = ring_all_reduce_bytes(4 * numel, 2) / 2
    assert float(engines["int8"].bytes_cross[0]) == pytest.approx(rounds * (2 * 3 * shard_mean.chunk_wire + gather))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cross_codec": "topk"}, "sparse"), ({"cross_codec": "int3"}, "not a codec"),
    ({"cross_codec": "int2", "region_topology": "complete"}, "no zero level"),
    ({"cross_codec": "int8", "layout": [0, 0, 0, 1]}, "equal sizes")])
def test_a_cross_codec_the_crossing_cannot_take_is_refused_by_name(kwargs, message):
    layout = kwargs.pop("layout", [0, 0, 1, 1])
    with pytest.raises(ValueError, match=rf"cross_codec=.*{message}"):
        TwoLevelTopology(layout, **kwargs)


# ------------------------------------------------------------------ the app
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _compose(corpus: Path, tmp_path: Path, overrides: list[str]):
    quick = ["experiment=demo", "trainer.max_steps=4", "trainer.val_check_interval=4", "inner_steps=1",
             f"data.source={corpus}", "data.val_fraction=0.25", "data.batch_size=2", "data.val_batches=1",
             f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "sim.workers=4",
             "network=two_clusters", "strategy=gasloc", "strategy.outer_momentum=0.9", "topology.cross_every=2"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=quick + overrides)


@pytest.mark.parametrize("topology", ["two_level", "hierarchical"])
def test_app_runs_both_levels_from_the_network_s_clusters(corpus, tmp_path, topology):
    sim_app.simulate(_compose(corpus, tmp_path, [f"topology={topology}"]))
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    strategy = record["strategy"]
    assert strategy["name"] == ("two_level" if topology == "two_level" else "hierarchical_diloco")
    assert strategy["regions"] == [2, 2] and strategy["cross_every"] == 2 and strategy["outer_momentum"] == 0.9
    with (tmp_path / "out" / record["metrics_csv"]).open() as file:
        rows = [r for r in csv.DictReader(file) if r["comm/bytes_cross"]]
    assert len(rows) == 4 and float(rows[0]["comm/bytes_region"]) > 0
    assert float(rows[0]["comm/bytes_cross"]) == 0 < float(rows[1]["comm/bytes_cross"])  # a crossing every 2nd round
    assert record["sim"]["sim_time_max"] > 0


def test_app_refuses_an_unstable_rule_and_what_two_level_does_not_take(corpus, tmp_path):
    with pytest.raises(ValueError, match="cross_momentum below"):
        sim_app.build(_compose(corpus, tmp_path, ["topology=two_level", "topology.cross_every=1",
                                                  "topology.cross_momentum=0.9"]))
    with pytest.raises(ValueError, match="strategy.overlap.*topology.cross_overlap=true"):
        sim_app.build(_compose(corpus, tmp_path, ["topology=two_level", "overlap=true"]))
    with pytest.raises(InstantiationException, match="needs regions"):
        sim_app.build(_compose(corpus, tmp_path, ["topology=two_level", "network=uniform_fast", "sim.workers=8"]))
    cfg = _compose(corpus, tmp_path, ["topology=two_level", "topology.regions=[a,b,a,b]"])
    simulator, parts = sim_app.build(cfg)
    assert parts["strategy"]["regions"] == [2, 2] and simulator.rounds.regions.members[0] == (0, 2)
