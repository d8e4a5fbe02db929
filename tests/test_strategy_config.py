"""Configuration of the strategies: registered names, and clear errors before the first step."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import gasloc_lightning
from gasloc_lightning import DiLoCoStrategy, GASLoCStrategy
from gasloc_lightning.topology import CustomTopology


def make_trainer(strategy, devices=2, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize(
    "name, cls, start_method",
    [("gasloc", GASLoCStrategy, "popen"), ("gasloc_spawn", GASLoCStrategy, "spawn"),
     ("gasloc_notebook", GASLoCStrategy, "fork"), ("diloco", DiLoCoStrategy, "popen"),
     ("diloco_spawn", DiLoCoStrategy, "spawn"), ("diloco_notebook", DiLoCoStrategy, "fork")],
)
def test_names_resolve_in_the_trainer(name, cls, start_method):
    trainer = make_trainer(name)
    assert type(trainer.strategy) is cls
    assert trainer.strategy._start_method == start_method


def test_registration_is_idempotent():
    assert gasloc_lightning.register_strategies() == []
    assert {"gasloc", "diloco"} <= set(StrategyRegistry)


def test_defaults_follow_the_topology_table():
    trainer = make_trainer(GASLoCStrategy(), devices=4)
    strategy = trainer.strategy
    assert strategy.topology.name == "one_peer" and strategy.outer_lr == 0.7
    assert strategy.outer_momentum == 0.9  # the table in docs/user_guide.md: DiLoCo's value, stable on one_peer
    assert strategy.inner_steps == 50


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"topology": "star"}, "topology must be one of"),
        ({"inner_steps": 0}, "inner_steps"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": -0.1}, "outer_momentum"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_form": "nesterov"}, "outer_form"),
        ({"gossip_timeout": 0}, "gossip_timeout"),
        ({"consensus_every": -1}, "consensus_every"),
        ({"cpu_threads": 0}, "cpu_threads"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GASLoCStrategy(**kwargs)


def test_diloco_validates_its_arguments():
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoStrategy(outer_momentum=1.5)
    with pytest.raises(ValueError, match="inner_steps"):
        DiLoCoStrategy(inner_steps=-3)


@pytest.mark.parametrize(
    "topology, devices, match",
    [("two_peer", 2, "two_peer"), ("exponential", 3, "exponential"), ("torus", 5, "torus")],
)
def test_topology_impossible_for_the_world_size_fails_at_trainer_construction(topology, devices, match):
    with pytest.raises(ValueError, match=match):
        make_trainer(GASLoCStrategy(topology=topology), devices=devices)


def test_unstable_outer_momentum_is_refused_with_the_largest_stable_value():
    # ALGORITHM.md: the hypercube schedule at n = 64 is stable up to gamma ~ 0.786 (construction only, no launch)
    with pytest.raises(ValueError, match=r"unstable.*largest stable gamma is about 0\.7[89]"):
        make_trainer(GASLoCStrategy(topology="exponential", outer_momentum=0.82), devices=64)


def test_stable_post_mix_on_a_fixed_ring_is_accepted():
    trainer = make_trainer(GASLoCStrategy(topology="ring", outer_form="post_mix", outer_momentum=0.5), devices=4)
    assert trainer.strategy.outer_momentum == 0.5


def test_custom_topology_object_is_accepted():
    ring4 = CustomTopology([(0, 1, 0.25), (1, 2, 0.25), (2, 3, 0.25), (3, 0, 0.25)])
    trainer = make_trainer(GASLoCStrategy(topology=ring4, outer_momentum=0.9), devices=4)
    assert trainer.strategy.topology is ring4


def test_sync_batchnorm_is_refused_before_training(tmp_path):
    from dist_utils import TinyRegressor

    trainer = make_trainer(GASLoCStrategy(), devices=1, sync_batchnorm=True, max_steps=1,
                           default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="sync_batchnorm"):
        trainer.fit(TinyRegressor())


def test_codec_options_are_checked_with_the_worker_count():
    with pytest.raises(ValueError, match="error_feedback=True needs edges that repeat"):
        GASLoCStrategy(topology="one_peer", message_codec="int8", error_feedback=True,
                       ranks_per_worker=2).check_configuration(8)  # 4 workers on random matchings
    GASLoCStrategy(topology="ring", message_codec="int8", error_feedback=True, ranks_per_worker=2).check_configuration(8)
    with pytest.raises(ValueError, match="error_feedback=True needs a lossy message_codec"):
        GASLoCStrategy(topology="ring", error_feedback=True)
    with pytest.raises(ValueError, match="int2"):
        DiLoCoStrategy(message_codec="int2")
    with pytest.raises(ValueError, match="message_codec"):
        GASLoCStrategy(message_codec="int3")
    with pytest.raises(ValueError, match="disagree"):
        GASLoCStrategy(message_codec="int8", message_dtype="bfloat16")
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        GASLoCStrategy(inner_steps=4, fragments=2, fragment_sync_delay=2).check_configuration(2)
    with pytest.raises(ValueError, match="overlap=True delays whole-model rounds"):
        GASLoCStrategy(fragments=2, overlap=True)
