"""benchmarks/two_level_probe.py: every method it runs composes into a simulator config that its engine accepts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from gasloc_lightning.app.config import config_dir
from gasloc_lightning.topology.regions import TwoLevelTopology

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the probe imports its sibling sim_runs


def _load():
    spec = importlib.util.spec_from_file_location("two_level_probe", ROOT / "benchmarks" / "two_level_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _load()


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
