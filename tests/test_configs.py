"""The config tree composes, every node points at a real class, and bad configs fail with clear errors."""

from __future__ import annotations

import inspect

import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import get_object, instantiate
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torch.nn.parallel import DistributedDataParallel

from app_utils import CONF, EXPERIMENTS, compose_config
from gasloc_lightning.app.train import Budget, check_budget, train

GROUPS = ("strategy", "topology", "network", "model", "model/optimizer", "data", "trainer", "logger", "callbacks",
          "sweep")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _targets(node) -> list[str]:
    """Every ``_target_`` below ``node``, interpolations resolved."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        own = [node["_target_"]] if "_target_" in node else []
        return own + [t for key, value in node.items() if key != "_target_" for t in _targets(value)]
    if isinstance(node, list):
        return [t for item in node for t in _targets(item)]
    return []


# Arguments the Trainer or a test supplies, never a config file (and message_dtype, message_codec's former name).
_NOT_CONFIGURED = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                   "rank", "world_size", "message_dtype"}


def _parameters(cls) -> tuple[set[str], bool]:
    """Keyword parameters of cls(...), following **kwargs up the MRO; and whether some **kwargs stays open.

    A factory (a classmethod target such as ``BandwidthAwareTopology.from_clusters``) gives its own parameters.
    """
    if not isinstance(cls, type):
        parameters = inspect.signature(cls).parameters.values()
        names = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        return names, any(p.kind is p.VAR_KEYWORD for p in parameters)
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self"}
        if klass is DDPStrategy:  # its **kwargs go to torch's DistributedDataParallel
            return names | _parameters(DistributedDataParallel)[0], False
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return names, False
    return names, True


def _nodes(node):
    if isinstance(node, DictConfig) and not node._is_none():  # a typed dict left null (worker_ddp_kwargs)
        if "_target_" in node:
            yield node
        for key in node:
            yield from _nodes(node._get_node(key))


@pytest.fixture(scope="module")
def option_config(tmp_path_factory):
    """The composed config of one ``group=option`` (with a text source), composed once for the two tests that read
    it: composing is most of their time. The tests only read it."""
    output_dir = tmp_path_factory.mktemp("option_configs")
    configs: dict[tuple[str, str], DictConfig] = {}

    def composed(group: str, option: str) -> DictConfig:
        if (group, option) not in configs:
            overrides = [f"{group}={option}", "data.source=/some/corpus.txt"]
            configs[group, option] = compose_config(overrides, output_dir=output_dir)
        return configs[group, option]

    return composed


@pytest.mark.parametrize("group", ("strategy", "model", "data", "topology", "trainer", "logger", "callbacks"))
def test_config_keys_are_exactly_the_constructor_arguments(group, option_config):
    """No key the class would reject, and (for this package's classes) no argument the config hides."""
    for option in _options(group):
        cfg = option_config(group, option)
        for node in _nodes(cfg[group]):
            keys = {k for k in node if k not in ("_target_", "_partial_", "_convert_")}
            parameters, open_kwargs = _parameters(get_object(node._target_))
            if not open_kwargs:
                assert keys <= parameters, f"{group}/{option}: {node._target_} has no {keys - parameters}"
            target = get_object(node._target_)
            if node._target_.startswith("gasloc_lightning.") and "__init__" in vars(target):  # arguments of its own
                assert parameters - _NOT_CONFIGURED <= keys, f"{group}/{option} lacks {parameters - keys}"


def test_every_group_has_its_options():
    assert set(_options("strategy")) >= {"gasloc", "diloco", "ddp", "local"}
    topologies = {"one_peer", "two_peer", "ring", "torus", "exponential", "complete", "local"}
    assert set(_options("topology")) >= topologies
    assert set(_options("model")) >= {"tiny", "small", "gpt2_125m", "hf_causal_lm", "hf_gpt2_tiny", "hf_llama_tiny"}
    assert set(_options("data")) >= {"stdlib", "text", "hf"}
    assert set(_options("trainer")) >= {"cpu", "gpu"}
    assert set(_options("logger")) >= {"csv", "tensorboard"}
    assert "compare" in _options("sweep")
    assert "demo" in EXPERIMENTS


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=str
)
def test_every_option_composes_and_targets_real_classes(group, option, option_config):
    cfg = option_config(group, option)
    for target in _targets(cfg):
        assert callable(get_object(target)), target


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_states_its_token_arithmetic(experiment, tmp_path):
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert "Token arithmetic" in text
    cfg = compose_config([f"experiment={experiment}"], output_dir=tmp_path)
    for target in _targets(cfg):
        assert callable(get_object(target)), target
    check_budget(cfg.trainer)
    assert cfg.data.block_size == cfg.model.model.block_size
    round_length = cfg.strategy.fastest_inner_steps if cfg.inner_steps == "auto" else cfg.inner_steps
    assert cfg.trainer.max_steps % round_length == 0  # whole rounds only


def test_demo_budget_is_the_documented_one(tmp_path):
    cfg = compose_config(["experiment=demo"], output_dir=tmp_path)
    budget = Budget(workers=cfg.trainer.devices, steps=cfg.trainer.max_steps, batch_size=cfg.data.batch_size,
                    block_size=cfg.data.block_size, inner_steps=cfg.inner_steps)
    assert (budget.tokens_per_step, budget.tokens, budget.rounds) == (4096, 409_600, 20)
    assert budget.rounds >= 20


def test_every_strategy_shares_H_and_spawns(tmp_path):
    for strategy in ("gasloc", "diloco", "local"):
        cfg = compose_config([f"strategy={strategy}", "inner_steps=7"], output_dir=tmp_path)
        assert cfg.strategy.inner_steps == 7
        assert cfg.strategy.start_method == "spawn"
    assert compose_config(["strategy=ddp"], output_dir=tmp_path).strategy.start_method == "spawn"


def test_topology_option_reaches_the_gasloc_strategy(tmp_path):
    cfg = compose_config(["topology=ring"], output_dir=tmp_path)
    assert OmegaConf.to_container(cfg.strategy, resolve=True)["topology"]["_target_"].endswith("RingTopology")


def test_unknown_option_names_the_available_ones(tmp_path):
    with pytest.raises(MissingConfigException, match="(?s)strategy/gosip.*gasloc"):
        compose_config(["strategy=gosip"], output_dir=tmp_path)


def test_schema_rejects_misspelled_keys(tmp_path):
    with pytest.raises(ConfigCompositionException, match="inner_step"):
        compose_config(["strategy.inner_step=3"], output_dir=tmp_path)


def test_schema_rejects_wrong_types(tmp_path):
    with pytest.raises(ConfigCompositionException, match="max_steps"):
        compose_config(["trainer.max_steps=many"], output_dir=tmp_path)


def test_bad_choice_is_refused_before_launch(tmp_path):
    cfg = compose_config(["strategy.start_method=thread"], output_dir=tmp_path)
    with pytest.raises(ValueError, match="start_method must be one of"):
        train(cfg)


def test_zero_step_budget_is_refused_before_launch(tmp_path):
    cfg = compose_config(["trainer.max_steps=0"], output_dir=tmp_path)
    with pytest.raises(ValueError, match="max_steps=0.*zero steps"):
        train(cfg)


def test_an_interval_that_does_not_divide_the_budget_is_accepted(tmp_path):
    """A shortened run runs: the app validates after the last step whatever the interval."""
    cfg = compose_config(["trainer.max_steps=20"], output_dir=tmp_path)
    assert cfg.trainer.val_check_interval == 50
    check_budget(cfg.trainer)


def test_missing_data_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_corpus.txt"
    cfg = compose_config(["data=text", f"data.source={missing}"], output_dir=tmp_path, cache_dir=tmp_path)
    # Hydra names the node (full_key: data) under the data module's own message.
    expected = "(?s)source path does not exist.*no_such_corpus.txt.*full_key: data"
    with pytest.raises(InstantiationException, match=expected):
        train(cfg)


def test_text_data_without_a_path_says_which_key(tmp_path):
    cfg = compose_config(["data=text"], output_dir=tmp_path)
    with pytest.raises(MissingMandatoryValue, match="source"):
        train(cfg)


def test_two_cluster_scenario_builds_the_documented_gasloc(tmp_path):
    """The overrides its comment gives: spread bandwidth-aware peers, overlap, bf16 messages, gamma 0.7."""
    text = (CONF / "experiment" / "scenario_two_clusters.yaml").read_text()
    documented = "strategy.message_codec=bfloat16 strategy.outer_momentum=0.7"
    assert documented in text
    cfg = compose_config(["experiment=scenario_two_clusters", *documented.split()], output_dir=tmp_path)
    strategy = instantiate(cfg.strategy)
    assert strategy.topology.schedule == "spread" and strategy.topology.cluster_sizes == (4, 4)
    assert strategy.topology.expected_slow_link_rate(8) == 0.25
    assert strategy.outer_momentum == 0.7
    assert (strategy.overlap, strategy.message_dtype) == (True, torch.bfloat16)


@pytest.mark.parametrize(("option", "cls"), [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_inner_optimizer_option_builds_that_optimizer_with_the_models_lr(option, cls, tmp_path):
    """model/optimizer=sgd with strategy=gossip is gossip SGD; every key is a constructor argument."""
    cfg = compose_config(["strategy=gossip", f"model/optimizer={option}", "model.optimizer.lr=0.25"],
                         output_dir=tmp_path)
    keys = {k for k in cfg.model.optimizer if not k.startswith("_")}
    assert keys <= set(inspect.signature(cls).parameters)
    optimizer = instantiate(cfg.model).configure_optimizers()["optimizer"]
    assert type(optimizer) is cls and optimizer.defaults["lr"] == 0.25
    assert (cfg.strategy.inner_steps, cfg.strategy.outer_lr, cfg.strategy.outer_momentum) == (1, 1.0, 0.0)
