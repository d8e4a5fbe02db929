"""Structured-config schemas of the experiment app, and where its YAML config tree lives.

Every swappable part of a run is one Hydra config group under ``conf/`` (strategy, topology,
model, data, trainer, logger, callbacks, experiment, sweep), and every node is a ``_target_``
to a real class. The dataclasses here are registered in Hydra's ConfigStore under
``schema/<group>/<name>`` and each YAML option names its schema first in its defaults list
(``- /schema/strategy@_here_: gasloc``), so composition rejects misspelled keys
(``strategy.inner_step=5``) and ill-typed values (``strategy.inner_steps=abc``) before
anything is built. Choice-valued strings the schemas cannot express (OmegaConf has no
``Literal``) are checked by :func:`check_choices`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from gasloc_lightning.algorithm.round import check_codec


START_METHODS = ("popen", "spawn", "fork", "forkserver")
OUTER_FORMS = ("anchored", "post_mix")


def config_dir() -> Path:
    """The Hydra config tree: the package ``gasloc_lightning.conf`` (the repository's ``conf/``,
    shipped inside the wheel), found through :mod:`importlib.resources`."""
    tree = Path(str(resources.files("gasloc_lightning.conf")))
    if not (tree / "train.yaml").is_file():
        raise FileNotFoundError(f"the config tree {tree} has no train.yaml: the installation is incomplete")
    return tree


# ------------------------------------------------------------------ strategy and topology
@dataclass
class TopologySchema:
    """A named gossip graph; the class is the topology (``gasloc_lightning.topology.RingTopology``)."""

    _target_: str = MISSING
    seed: int = 0


@dataclass
class BandwidthAwareTopologySchema(TopologySchema):
    """Matchings that favour fast links: clusters over consecutive ranks (``sizes``; None without a clustered
    network: refused, with what to give, when the topology is built)."""

    sizes: Optional[list[int]] = None
    slow_link_rate: float = 0.2
    schedule: str = "concentrated"
    scale_to: Optional[int] = None


@dataclass
class TwoLevelTopologySchema(TopologySchema):
    """Regions (from the user's labels, a bandwidth matrix or a clustered network's sizes) and the cross step of the
    two-level round (``TwoLevelTopology.from_network``; gasloc-sim only for now)."""

    sizes: Optional[list[int]] = None
    scale_to: Optional[int] = None
    regions: Optional[list[Any]] = None
    bandwidth: Any = None  # a bandwidth matrix (a scalar, as a uniform network gives, is ignored)
    cross_every: int = 4
    region_topology: str = "one_peer"
    cross_lr: float = 1.0
    cross_momentum: float = 0.0
    cross_overlap: bool = False
    cross_delayed_weight: float = 0.5
    cross_codec: str = "float32"


@dataclass
class LocalStepsSchema:
    """Arguments shared by every strategy built on ``LocalStepsStrategy`` (gasloc, diloco, local)."""

    _target_: str = MISSING
    inner_steps: Any = 50  # an int, one int per rank, or "auto" (validated by the strategy)
    gossip_timeout: float = 300.0
    collective_timeout: Optional[float] = None
    consensus_every: int = 10
    bucket_cap_mb: float = 64.0
    cpu_threads: Any = "auto"  # "auto", null or an int >= 1
    on_nonfinite: str = "skip_round"
    max_skipped_rounds: int = 3
    ranks_per_worker: int = 1
    intra_worker: str = "ddp"  # "fsdp": the worker's ranks shard it with FSDP2; shard r gossips with shard r
    worker_ddp_kwargs: Optional[Dict[str, Any]] = None  # DDP's arguments inside a worker of several ranks
    trust_checkpoint_code: bool = False  # load checkpoint files a safe load refuses (only files you trust)
    network: Any = None  # a NetworkModel node, for the simulated clock
    fastest_inner_steps: int = 50
    start_method: str = "spawn"
    process_group_backend: Optional[str] = None


@dataclass
class GASLoCStrategySchema(LocalStepsSchema):
    _target_: str = "gasloc_lightning.GASLoCStrategy"
    outer_lr: float = 0.7
    outer_momentum: Optional[float] = None
    outer_form: str = "anchored"
    topology: Any = "one_peer"  # a name or a topology node
    seed: int = 0
    overlap: bool = False
    delayed_weight: float = 1.0
    message_codec: str = "float32"  # float32, bfloat16, int8, fp8, int4, int2
    error_feedback: bool = False  # CHOCO public copies per edge (fixed or periodic graphs)
    consensus_step: Optional[float] = None  # s on every correction; null: 1, or 0.05 for a top-k codec
    fragments: int = 1  # fragment gossip: F fragments, each its own round, staggered through the round
    fragment_sync_delay: int = 0  # steps between a fragment's message leaving and its mix landing
    fragment_update_alpha: float = 0.0  # live share when a fragment lands


@dataclass
class DiLoCoStrategySchema(LocalStepsSchema):
    _target_: str = "gasloc_lightning.DiLoCoStrategy"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    message_codec: str = "float32"  # float32 (exact all-reduce), or quantized: bfloat16, int8, fp8, int4, int2
    fragments: int = 1  # Streaming DiLoCo: fragments synced in turn
    fragment_sync_delay: int = 0  # steps between a fragment's pseudo-gradient leaving and its outer step
    fragment_update_alpha: float = 0.0  # live share when a fragment lands
    overlap: bool = False  # fragment_sync_delay 1: each all-reduce runs under one step of compute
    error_feedback: bool = False  # residual kept per worker; the mean is an all-gather of the wires (top-k)
    error_feedback_decay: float = 1.0  # beta on the residual (SparseLoCo: 0.95)


@dataclass
class TwoLevelStrategySchema(LocalStepsSchema):
    """Two-level GASLoC / hierarchical DiLoCo: the region step's eta_r, gamma_r; the rest is the topology's."""

    _target_: str = "gasloc_lightning.strategies.two_level.TwoLevelStrategy"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    topology: Any = None  # a two_level (or hierarchical) topology node


@dataclass
class DDPStrategySchema:
    """Lightning's DDP: a gradient all-reduce every optimizer step (the dense baseline)."""

    _target_: str = "gasloc_lightning.strategies.baselines.DenseDDPStrategy"
    start_method: str = "spawn"
    process_group_backend: Optional[str] = None
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


# ------------------------------------------------------------------ model and data
@dataclass
class GPTSchema:
    _target_: str = "gasloc_lightning.models.GPTConfig"
    vocab_size: int = 256
    block_size: int = MISSING
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    dropout: float = 0.0
    bias: bool = False


@dataclass
class HFCausalLMSchema:
    """A Hugging Face causal LM from its config (random init, no download): ``model=hf_causal_lm``."""

    _target_: str = "gasloc_lightning.models.HFCausalLMConfig"
    model_type: Optional[str] = None  # "gpt2", "llama", ...; or null with config_path
    config_path: Optional[str] = None  # a local config.json (or a folder holding one)
    overrides: Dict[str, Any] = field(default_factory=dict)  # config fields, e.g. {n_layer: 2}
    block_size: int = MISSING
    vocab_size: int = 256


@dataclass
class AdamWSchema:
    """The inner optimizer, a partial completed with the parameter groups by the LightningModule."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class SGDSchema:
    """SGD as the inner optimizer (e.g. gossip SGD), a partial like :class:`AdamWSchema`."""

    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class LanguageModelSchema:
    _target_: str = "gasloc_lightning.models.LanguageModel"
    model: GPTSchema = field(default_factory=GPTSchema)
    optimizer: Any = MISSING  # the model/optimizer group: AdamWSchema or SGDSchema
    warmup_steps: int = 0
    max_steps: Optional[int] = None  # null: the trainer's max_steps
    min_lr_ratio: float = 0.1


@dataclass
class HFLanguageModelSchema(LanguageModelSchema):
    model: HFCausalLMSchema = field(default_factory=HFCausalLMSchema)  # type: ignore[assignment]


@dataclass
class ByteDataSchema:
    _target_: str = "gasloc_lightning.data.ByteDataModule"
    source: str = MISSING  # "stdlib", a path, "hf:<hub name>" or "hf:<json|csv|text|parquet>:<local files>"
    block_size: int = MISSING
    batch_size: int = 32
    val_fraction: float = 0.05
    val_batches: Optional[int] = None
    cache_dir: Optional[str] = None
    seed: int = 0
    num_workers: int = 0
    samples_per_epoch: Optional[int] = None
    hf_split: str = "train"
    hf_text_field: str = "text"


# ------------------------------------------------------------------ trainer and the whole run
@dataclass
class TrainerSchema:
    """The subset of ``lightning.pytorch.Trainer`` arguments the app exposes."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    precision: Any = "32-true"
    max_steps: int = MISSING
    val_check_interval: Any = None
    check_val_every_n_epoch: Optional[int] = None
    limit_val_batches: Any = None
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 1
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    enable_checkpointing: bool = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    use_distributed_sampler: bool = False
    deterministic: Any = False
    benchmark: Optional[bool] = None
    default_root_dir: Optional[str] = None


@dataclass
class TrainSchema:
    """The composed run: one node per group plus the few values several groups share."""

    strategy: Any = MISSING
    topology: Any = MISSING
    network: Any = None
    model: Any = MISSING
    data: Any = MISSING
    trainer: Any = MISSING
    logger: Optional[Dict[str, Any]] = None
    callbacks: Optional[Dict[str, Any]] = None
    seed: int = 0
    # H, shared by gasloc, diloco and local so a sweep over strategies keeps it: an int, one int per
    # rank, or "auto" (H_i by speed; needs a network). Validated by the strategy.
    inner_steps: Any = 50
    overlap: bool = False  # gasloc: overlapped gossip (shared so scenario presets can set it for a sweep)
    cache_dir: str = "~/.cache/gasloc-lightning"
    output_dir: str = MISSING
    ckpt_path: Optional[str] = None  # resume: Trainer.fit(ckpt_path=...), a checkpoint directory or file


@dataclass
class NetlabSchema:
    """The ``netlab`` node of ``gasloc-netlab`` (documented in ``conf/netlab/default.yaml``)."""

    mode: str = "elastic"
    bandwidth_scale: float = 0.01
    faults: List[str] = field(default_factory=list)
    flap_period_s: float = 1.0
    majority_quorum: bool = True
    lighthouse_port: int = 29510
    clock_bytes: Optional[int] = None
    clock_repeats: int = 3
    train_port: int = 29500
    timeout_s: float = 1800.0


_SCHEMAS: dict[tuple[str, str], type] = {
    ("schema", "train"): TrainSchema,
    ("schema/strategy", "gasloc"): GASLoCStrategySchema,
    ("schema/strategy", "diloco"): DiLoCoStrategySchema,
    ("schema/strategy", "ddp"): DDPStrategySchema,
    ("schema/strategy", "two_level"): TwoLevelStrategySchema,
    ("schema/topology", "topology"): TopologySchema,
    ("schema/topology", "bandwidth_aware"): BandwidthAwareTopologySchema,
    ("schema/topology", "two_level"): TwoLevelTopologySchema,
    ("schema/model", "language_model"): LanguageModelSchema,
    ("schema/model", "hf_language_model"): HFLanguageModelSchema,
    ("schema/optimizer", "adamw"): AdamWSchema,
    ("schema/optimizer", "sgd"): SGDSchema,
    ("schema/data", "bytes"): ByteDataSchema,
    ("schema/trainer", "trainer"): TrainerSchema,
}


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; done on import)."""
    store = ConfigStore.instance()
    for (group, name), node in _SCHEMAS.items():
        store.store(group=group, name=name, node=node)


def check_choices(cfg: DictConfig) -> None:
    """Refuse choice-valued strings outside their allowed values, naming the key."""
    strategy = cfg.strategy
    start_method = strategy.get("start_method")
    if start_method not in START_METHODS:
        raise ValueError(f"strategy.start_method must be one of {START_METHODS}, got {start_method!r}")
    outer_form = strategy.get("outer_form", "anchored")
    if outer_form not in OUTER_FORMS:
        raise ValueError(f"strategy.outer_form must be one of {OUTER_FORMS}, got {outer_form!r}")
    # A sparse codec is checked (error feedback, consensus step) by the strategy or the simulator's rounds; the
    # elastic strategies refuse it themselves.
    check_codec(strategy.get("message_codec") or "float32", allow_sparse=True, argument="strategy.message_codec")


register_schemas()
