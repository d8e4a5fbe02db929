"""benchmarks/two_level_probe.py: every method it runs composes into a simulator config that its engine accepts."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench_utils import load_benchmark
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.topology.regions import TwoLevelTopology

probe = load_benchmark("two_level_probe", "two_level_probe")


@pytest.mark.parametrize("method", sorted(probe.METHODS))
def test_every_probe_method_composes_and_its_two_level_rule_is_accepted(method):
    overrides = ["experiment=demo", "network=two_clusters", "sim.workers=16", *probe.METHODS[method]]
    if method in probe.TWO_LEVEL:
        overrides.append("topology.cross_every=4")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=overrides)
    topology = instantiate(cfg.topology)
    assert isinstance(topology, TwoLevelTopology) == (method in probe.TWO_LEVEL)
    if method in probe.TWO_LEVEL:
        rule = topology.rule(region_lr=cfg.strategy.outer_lr, region_momentum=cfg.strategy.outer_momentum)
        assert topology.check_rule(rule) < 1.0
        assert rule.cross_mean == method.startswith("hierarchical")
    assert set(probe.DILOCO_FAMILY) <= set(probe.METHODS)
