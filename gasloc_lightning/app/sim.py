"""``gasloc-sim``: the Hydra app that simulates n workers in one process over the same ``conf/`` tree.

Usage::

    gasloc-sim experiment=demo strategy=gasloc                 # the demo's 4 workers, in one process
    gasloc-sim experiment=demo sim.workers=256 trainer.max_steps=50
    gasloc-sim experiment=demo sim.workers=64 sim.down_fraction=0.1     # churn
    gasloc-sim experiment=demo sim.workers=64 network=preemption        # churn from the preset
    gasloc-sim experiment=demo sim.workers=64 network=jitter            # or many_sites, two_clusters, cloud_mix

Presets, strategies (gasloc, diloco, local), topologies, networks and models are gasloc-train's;
``sim.*`` adds the worker count, churn and progress. The job writes ``summary.json`` and
``csv/metrics.csv`` as gasloc-train does (the strategy record carries ``engine: sim``), so
``gasloc-compare`` reads both kinds of run side by side; with ``logger=tensorboard`` the same rows also go to
``<output_dir>/tensorboard``. At each validation the spread across the n replicas is logged too (min, median
and max of each replica's own validation loss, ``spread/val_loss_*``, and ``comm/consensus_distance``). Bad
input (a worker count the topology cannot have, an unstable gamma, a run that does not fit in memory, a churn
schedule that empties the quorum) is refused before any step.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.algorithm.fragments import resolve_points
from gasloc_lightning.algorithm.streaming import fragment_bounds
from gasloc_lightning.app.config import TrainSchema, check_choices, config_dir
from gasloc_lightning.app.run_tensorboard import tensorboard_nodes
from gasloc_lightning.app.summary import SUMMARY_FILE, SUMMARY_FORMAT, count_rounds
from gasloc_lightning.app.train import check_budget
from gasloc_lightning.models.lm import warmup_cosine_factor
from gasloc_lightning.sim import (ChurnSchedule, CohortReplicas, DiLoCoRounds, GossipRounds, ShardedBatches, Simulator,
                                  StackedReplicas, TwoLevelRounds, WorkerClocks, check_memory, estimate_bytes,
                                  resolve_outer_momentum, resolve_outer_momentum_for_sizes)
from gasloc_lightning.topology import build_topology
from gasloc_lightning.topology.regions import TwoLevelTopology

log = logging.getLogger(__name__)
_FLUSH_S = 5.0  # the most seconds a TensorBoard row waits in memory (the default, 120 s, lags a live run)

METRICS_CSV = "csv/metrics.csv"


@dataclass
class SimSchema:
    """The ``sim`` node: what only the simulator needs.

    workers: n replicas. progress_every: rounds between two progress lines (0: none).
    down_fraction, mean_downtime_rounds, min_live, churn_seed: the churn schedule (down_fraction 0: none).
    max_memory_gb: refuse runs estimated above this (null: 80% of the available memory).
    threads: torch threads (null: torch's default). attention_math: batched math attention kernel.
    device: where every replica, batch and round tensor lives: cpu, cuda or cuda:<i> (refused when absent).
    shared_validation: validate on a single-worker run's windows, as gasloc-elastic does (false: the union of
    every worker's validation windows, as the strategies' consensus evaluation).
    A network with preemption (network=preemption) gives the churn schedule instead of down_fraction.
    live_by_round: a recorded membership to replay, the live worker ids of every round (for instance the quorums
    of a gasloc-elastic run); replaces down_fraction. Rounds past the list keep its last live set.
    also_networks: other ``network=`` presets on which the same run is timed (``sim.also_networks=[jitter,
    many_sites]``): each validation also records ``val/sim_time/<preset>``. The training is the run's own (its
    ``network=`` gives the topology's clusters and H_i): one run answers "how long on each of these"; a preset
    with preemption is refused there (its churn would change the training).
    """

    workers: int = 4
    progress_every: int = 10
    down_fraction: float = 0.0
    mean_downtime_rounds: float = 5.0
    min_live: int = 2
    churn_seed: int = 0
    max_memory_gb: Optional[float] = None
    threads: Optional[int] = None
    attention_math: bool = True
    device: str = "cpu"
    shared_validation: bool = False
    live_by_round: Optional[List[List[int]]] = None
    also_networks: List[str] = field(default_factory=list)


@dataclass
class SimAppSchema(TrainSchema):
    sim: SimSchema = field(default_factory=SimSchema)


ConfigStore.instance().store(group="schema", name="sim_app", node=SimAppSchema)


class MetricsTable:
    """Rows of metrics by step, written as one CSV (a column per metric, as Lightning's CSVLogger) and, given
    ``tensorboard_dir``, also as TensorBoard scalars as they come (``logger=tensorboard``).

    Args:
        tensorboard_dir: the TensorBoard run folder (None: CSV only).
    """

    def __init__(self, tensorboard_dir: Path | None = None) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self.tensorboard_dir = tensorboard_dir
        self._writer: Any = None  # opened at the first row: a config build() refuses leaves no event file

    def __call__(self, step: int, row: dict[str, float]) -> None:
        self.rows.setdefault(step, {}).update(row)
        if self._writer is None and self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # only runs that ask for TensorBoard import it

            # rows come at each validation: flushed within seconds, not TensorBoard's default 120 s
            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), flush_secs=_FLUSH_S)
        if self._writer is not None:
            for name, value in row.items():
                self._writer.add_scalar(name, float(value), step)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = sorted({key for row in self.rows.values() for key in row})
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=["step", *columns])
            writer.writeheader()
            for step in sorted(self.rows):
                writer.writerow({"step": step, **self.rows[step]})

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tensorboard_dir(cfg: DictConfig) -> Path | None:
    """Where the run's TensorBoard logger writes (``<save_dir>/<name>/<version>``), or None without one."""
    keys = tensorboard_nodes(cfg)
    if not keys:
        return None
    node = cfg.logger[keys[0]]
    return Path(str(node.save_dir)) / str(node.get("name") or "") / str(node.get("version") or "")


def _strategy_kind(cfg: DictConfig) -> str:
    target = cfg.strategy._target_.rsplit(".", 1)[-1]
    if target == "TwoLevelStrategy":  # its topology node (two_level or hierarchical) selects the two-level rounds
        return "gasloc"
    if target not in ("GASLoCStrategy", "DiLoCoStrategy"):
        raise ValueError(f"gasloc-sim simulates strategy=gasloc, gossip, local and diloco, not {target}")
    return "diloco" if target == "DiLoCoStrategy" else "gasloc"


def _inner_steps(cfg: DictConfig, network: Any, workers: int) -> list[int]:
    """H_i of every worker: one H, a list of one H_i per worker, or "auto" (by speed in the network)."""
    steps = cfg.strategy.inner_steps
    if steps == "auto":
        if network is None:
            raise ValueError("strategy.inner_steps=auto needs a network model (network=...) for the speeds")
        return list(network.auto_inner_steps(cfg.strategy.fastest_inner_steps))
    if isinstance(steps, int) and not isinstance(steps, bool):
        steps = [steps] * workers
    steps = list(steps)
    if len(steps) != workers or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in steps):
        raise ValueError(f"strategy.inner_steps={steps!r} must be an int >= 1, 'auto', or one int >= 1 per worker "
                         f"(sim.workers={workers})")
    return steps


def _topology(cfg: DictConfig) -> Any:
    node = cfg.strategy.topology
    if isinstance(node, str):
        return build_topology(node, seed=cfg.strategy.seed)
    return hydra.utils.instantiate(node, _convert_="all")


def _network(cfg: DictConfig, workers: int) -> Any:
    node = cfg.strategy.get("network")
    return None if node is None else _build_network(node, workers)


def _build_network(node: DictConfig, workers: int) -> Any:
    """A ``network/`` preset's model, checked for this run's ``workers``."""
    network = hydra.utils.instantiate(node, _convert_="all")
    network.check_world_size(workers)
    return network


def _also_networks(cfg: DictConfig, network: Any, workers: int) -> dict[str, Any]:
    """The presets of ``sim.also_networks``, built for this run's size and checked: the same run is timed on
    each. A preset is read from ``conf/network/`` and resolved against this run's config (its size)."""
    names = list(cfg.sim.get("also_networks") or [])
    if not names:
        return {}
    if network is None:
        raise ValueError(f"sim.also_networks={names} times the run on other networks alongside its own: give the "
                         "run's network too (network=...)")
    if network.preemption is not None:
        raise ValueError(f"sim.also_networks={names}: this run's network has preemption, and its churn would not "
                         "happen on those networks: time them alongside a run without it")
    presets = config_dir() / "network"
    available = sorted(path.stem for path in presets.glob("*.yaml"))
    root = copy.deepcopy(cfg)  # the presets' interpolations (sim.workers, seed) resolve against this run
    OmegaConf.set_struct(root, False)
    built = {}
    for name in names:
        if name not in available:
            raise ValueError(f"sim.also_networks: no network preset {name!r} (available: {available})")
        root["_also_network"] = OmegaConf.load(presets / f"{name}.yaml")
        model = _build_network(root["_also_network"], workers)
        if model.preemption is not None:
            raise ValueError(f"sim.also_networks: {name} has preemption; its churn would change the training, so "
                             f"it cannot be timed alongside another network's run: run it as network={name}")
        built[name] = model
    return built


def build(cfg: DictConfig, metrics: MetricsTable | None = None) -> tuple[Simulator, dict[str, Any]]:
    """Check everything, then build the simulator of a composed config; returns it and the run record's parts.

    Args:
        cfg: the composed config (``conf/sim/app.yaml``).
        metrics: receives the metric rows (None: dropped).
    """
    check_choices(cfg)
    check_budget(cfg.trainer)
    kind, workers = _strategy_kind(cfg), cfg.sim.workers
    if workers < 1:
        raise ValueError(f"sim.workers must be >= 1, got {workers}")
    if cfg.strategy.get("ranks_per_worker", 1) != 1:
        raise ValueError("strategy.ranks_per_worker > 1 (DDP inside a worker) is not simulated; use 1")
    network = _network(cfg, workers)
    also = _also_networks(cfg, network, workers)
    device = _device(cfg.sim.device)
    per_worker = _inner_steps(cfg, network, workers)
    inner_steps = max(per_worker)  # a round lasts max_i H_i loop steps
    strategy = cfg.strategy
    record: dict[str, Any] = {"name": kind, "topology": "complete", "inner_steps": inner_steps,
                              "outer_lr": float(strategy.outer_lr), "outer_form": "nesterov", "engine": "sim"}
    churn = _churn(cfg, network, workers, count_rounds(cfg.trainer.max_steps, inner_steps))
    topology = _topology(cfg) if kind == "gasloc" else None
    two_level = _two_level_rule(cfg, topology, churn, per_worker) if isinstance(topology, TwoLevelTopology) else None
    if two_level is not None:
        gamma = two_level.region_momentum
        record.update(name="hierarchical_diloco" if two_level.cross_mean else "two_level", topology=topology.name,
                      outer_form="two_level", regions=list(topology.regions.sizes),
                      cross_every=two_level.cross_every, cross_lr=two_level.cross_lr,
                      cross_momentum=two_level.cross_momentum, cross_overlap=two_level.cross_overlap,
                      cross_delayed_weight=two_level.cross_delayed_weight, cross_codec=topology.cross_codec)
    elif kind == "gasloc":
        sizes = [workers] if churn is None else sorted({workers, *churn.live_sizes()})
        gamma = resolve_outer_momentum_for_sizes(topology, sizes, strategy.outer_momentum, strategy.outer_form,
                                                 strategy.overlap, strategy.delayed_weight)
        resolve_outer_momentum(topology, workers, gamma, strategy.outer_form, strategy.overlap,
                               strategy.delayed_weight)  # the graph of all n, even if churn never reaches it
        record.update(name="local" if topology.name == "local" else "gasloc", topology=topology.name,
                      outer_form=strategy.outer_form)
    else:
        gamma = float(strategy.outer_momentum)
    record["outer_momentum"] = gamma
    pl.seed_everything(cfg.seed, workers=True)  # the model's initial weights, as gasloc-train draws them
    model = hydra.utils.instantiate(cfg.model, _convert_="all")
    model.model.to(device)  # every replica, and so every round tensor, lives where the module does
    gpt = model.model.config
    estimated = estimate_bytes(workers=workers, parameters=model.model.num_parameters(),
                               batch_size=cfg.data.batch_size, block_size=cfg.data.block_size, n_layer=gpt.n_layer,
                               n_embd=gpt.n_embd, n_head=gpt.n_head, vocab_size=gpt.vocab_size)
    limit = None if cfg.sim.max_memory_gb is None else int(cfg.sim.max_memory_gb * 2**30)
    check_memory(estimated, limit)
    if cfg.sim.threads is not None:
        torch.set_num_threads(cfg.sim.threads)
    decay = model.hparams.max_steps if model.hparams.max_steps is not None else cfg.trainer.max_steps
    schedule = functools.partial(warmup_cosine_factor, warmup_steps=model.hparams.warmup_steps, max_steps=decay,
                                 min_lr_ratio=model.hparams.min_lr_ratio)
    optimizer = hydra.utils.instantiate(cfg.model.optimizer, _convert_="all")
    clip = cfg.trainer.gradient_clip_val
    if len(set(per_worker)) == 1:
        replicas: Any = StackedReplicas(module=model.model, workers=workers, optimizer_factory=optimizer,
                                        lr_schedule=schedule, gradient_clip_val=clip)
    else:
        replicas = CohortReplicas(module=model.model, inner_steps=per_worker, optimizer_factory=optimizer,
                                  lr_schedule=schedule, gradient_clip_val=clip)
    clocks = WorkerClocks(network, workers, also=also)
    if two_level is not None:
        rounds: Any = TwoLevelRounds(initial=replicas.gather(), topology=topology, rule=two_level, clocks=clocks)
    elif kind == "gasloc":
        rounds = GossipRounds(initial=replicas.gather(), topology=topology, outer_lr=strategy.outer_lr,
                                   outer_momentum=gamma, outer_form=strategy.outer_form, overlap=strategy.overlap,
                                   delayed_weight=strategy.delayed_weight, message_codec=strategy.message_codec,
                                   error_feedback=strategy.get("error_feedback", False),
                                   consensus_step=strategy.get("consensus_step"), clocks=clocks,
                                   **_streaming(strategy, inner_steps, per_worker, model.model, overlap=False))
    else:
        rounds = DiLoCoRounds(initial=replicas.gather(), outer_lr=strategy.outer_lr, outer_momentum=gamma, clocks=clocks,
                              message_codec=strategy.get("message_codec", "float32"),
                              error_feedback=strategy.get("error_feedback", False),
                              error_feedback_decay=strategy.get("error_feedback_decay", 1.0),
                              **_streaming(strategy, inner_steps, per_worker, model.model,
                                           overlap=strategy.get("overlap", False)))
    data_node = cfg.data
    batches = ShardedBatches(
        lambda rank, world_size: hydra.utils.instantiate(data_node, rank=rank, world_size=world_size, _convert_="all"),
        workers, shared_validation=cfg.sim.shared_validation, device=device)
    simulator = Simulator(replicas=replicas, rounds=rounds, clocks=clocks, batches=batches, inner_steps=inner_steps,
                          max_steps=cfg.trainer.max_steps, val_check_interval=cfg.trainer.val_check_interval,
                          consensus_every=strategy.consensus_every, churn=churn,
                          progress_every=cfg.sim.progress_every, attention_math=cfg.sim.attention_math,
                          metrics=metrics, on_nonfinite=strategy.on_nonfinite,
                          max_skipped_rounds=strategy.max_skipped_rounds)
    parts = {"strategy": record, "model": model, "estimated_bytes": estimated, "churn": churn}
    return simulator, parts


def _two_level_rule(cfg: DictConfig, topology: TwoLevelTopology, churn: Any, per_worker: list[int]) -> Any:
    """``topology=two_level`` (or ``hierarchical``): the two-level rule, its region step from ``strategy.outer_lr`` /
    ``outer_momentum`` (null: DiLoCo's 0.9), checked for stability; the options it does not take are refused."""
    strategy = cfg.strategy
    unsupported = {"strategy.overlap": strategy.get("overlap", False),
                   "strategy.error_feedback": strategy.get("error_feedback"),
                   "strategy.message_codec": strategy.get("message_codec", "float32") != "float32",
                   "strategy.fragments": strategy.get("fragments", 1) != 1, "churn": churn is not None,
                   "per-worker inner_steps": len(set(per_worker)) > 1,
                   "strategy.outer_form": strategy.get("outer_form", "anchored") != "anchored"}
    refused = sorted(name for name, used in unsupported.items() if used)
    if refused:
        raise ValueError(f"topology two_level does not take {refused} yet: its round exchanges float32 whole "
                         "models, every worker at the same H (to overlap the crossing with compute: "
                         "topology.cross_overlap=true)")
    momentum = 0.9 if strategy.outer_momentum is None else float(strategy.outer_momentum)
    rule = topology.rule(region_lr=float(strategy.outer_lr), region_momentum=momentum)
    topology.check_rule(rule)
    return rule


def _streaming(strategy: DictConfig, inner_steps: int, per_worker: list[int], module: torch.nn.Module,
               overlap: bool) -> dict[str, Any]:
    """The rounds' fragment arguments, as the strategies resolve them (none when the round is not streamed);
    ``overlap``: DiLoCo's (a delay of one step), never GASLoC's (a whole-model round late)."""
    fragments, delay = strategy.get("fragments", 1), strategy.get("fragment_sync_delay", 0)
    alpha = strategy.get("fragment_update_alpha", 0.0)
    if fragments == 1 and not delay and not alpha and not overlap:
        return {}
    if len(set(per_worker)) > 1:
        raise ValueError("fragments, fragment_sync_delay, fragment_update_alpha and overlap need one inner_steps "
                         "for every worker")
    sizes = [p.numel() for p in module.parameters() if p.requires_grad]
    return {"points": resolve_points(inner_steps, fragments, delay, overlap),
            "bounds": fragment_bounds(sizes, fragments), "fragment_update_alpha": alpha}


def _device(name: str) -> torch.device:
    """``sim.device``, refused with the reason when it is not there."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"sim.device={name!r} is not a device: use cpu, cuda or cuda:<index>") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"sim.device={name!r} but no CUDA device is available here: use sim.device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"sim.device={name!r} but only {torch.cuda.device_count()} CUDA devices are visible")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"sim.device={name!r}: the simulator runs on cpu or cuda")
    return device


def _churn(cfg: DictConfig, network: Any, workers: int, rounds: int) -> ChurnSchedule | None:
    sim = cfg.sim
    preemption = None if network is None else network.preemption
    if sim.live_by_round is not None:
        if preemption is not None or sim.down_fraction != 0:
            raise ValueError("sim.live_by_round replays a membership: give no other churn (sim.down_fraction=0, "
                             "network.preemption=null)")
        recorded = [list(live) for live in sim.live_by_round]
        recorded += [recorded[-1]] * max(0, rounds - len(recorded)) if recorded else []
        return ChurnSchedule.replay(workers=workers, live_by_round=recorded[:rounds], min_live=sim.min_live)
    if preemption is not None and sim.down_fraction != 0:
        raise ValueError(f"the network has preemption ({preemption!r}) and sim.down_fraction={sim.down_fraction} "
                         "also asks for churn: give one (network.preemption=null, or sim.down_fraction=0)")
    if preemption is not None:
        return ChurnSchedule.from_preemption(preemption, workers=workers, rounds=rounds)
    if sim.down_fraction == 0:
        return None
    return ChurnSchedule(workers=workers, rounds=rounds, down_fraction=sim.down_fraction,
                         mean_downtime_rounds=sim.mean_downtime_rounds, min_live=sim.min_live, seed=sim.churn_seed)


def _optimizer_record(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    record: dict[str, Any] = {"name": type(optimizer).__name__}
    for key, value in optimizer.defaults.items():
        if isinstance(value, (int, float, str, bool, tuple, list)):
            record[key] = list(value) if isinstance(value, tuple) else value
    return record


def _record(cfg: DictConfig, simulator: Simulator, parts: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    model, workers = parts["model"], simulator.workers
    datamodule = hydra.utils.instantiate(cfg.data, rank=0, world_size=workers, _convert_="all")
    data = {k: datamodule.hparams.get(k) for k in ("source", "block_size", "batch_size", "val_fraction", "val_batches")}
    data["sha256"] = datamodule.fingerprint.get("sha256")
    steps = result["steps"]
    tokens = result["tokens"]  # the live workers' batches: under churn, fewer than steps x workers x B x T
    worker_steps = tokens // (simulator.batches.batch_size * simulator.batches.block_size)  # the live ones
    final = result["final"]
    return {
        "format": SUMMARY_FORMAT,
        "strategy": parts["strategy"],
        "world_size": workers,
        "model": dict(model.hparams.get("model", {})),
        "parameters": model.model.num_parameters(),
        "optimizer": _optimizer_record(simulator.replicas.optimizer),
        "schedule": {k: model.hparams.get(k) for k in ("warmup_steps", "max_steps", "min_lr_ratio")},
        "data": data,
        "budget": {"max_steps": cfg.trainer.max_steps, "steps": steps, "tokens_per_step": tokens // steps,
                   "tokens": tokens, "rounds": result["rounds"]},
        "final": {"val_loss": final.get("val/loss"), "val_ppl": final.get("val/ppl"), "val_loss_local": None,
                  "step": steps},
        "bytes_sent": result["bytes_sent"],
        "bytes_received": result["bytes_sent"],
        "unigram_entropy_val": datamodule.unigram_entropy("val"),
        "wall_time_s": round(result["wall_time_s"], 3),
        "seed": cfg.seed,
        "metrics_csv": METRICS_CSV,
        "sim": {"workers": workers, "goodput": result["goodput"], "estimated_bytes": parts["estimated_bytes"],
                "down_fraction": cfg.sim.down_fraction if parts["churn"] is None else parts["churn"].down_fraction,
                "joins": result["joins"], "device": str(cfg.sim.device), "worker_steps_per_s": worker_steps / result["wall_time_s"],
                "sim_time_max": max(simulator.clocks.times()) if simulator.clocks.enabled else None,
                "sim_time_max_also": {name: max(times) for name, times in simulator.clocks.times_also().items()}},
    }


def simulate(cfg: DictConfig) -> float | None:
    """Run one simulated job of a composed config; returns the final consensus validation loss."""
    table = MetricsTable(tensorboard_dir(cfg))
    try:
        simulator, parts = build(cfg, metrics=table)
        log.info("simulating strategy=%s workers=%d steps=%d H=%d estimated_bytes=%d", parts["strategy"]["name"],
                 simulator.workers, simulator.max_steps, simulator.inner_steps, parts["estimated_bytes"])
        result = simulator.run()
    finally:
        table.close()
    output = Path(cfg.output_dir)
    table.write(output / METRICS_CSV)
    record = _record(cfg, simulator, parts, result)
    (output / SUMMARY_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    log.info("finished val_loss=%s worker_steps_per_s=%.1f summary=%s", record["final"]["val_loss"],
             record["sim"]["worker_steps_per_s"], output / SUMMARY_FILE)
    return record["final"]["val_loss"]


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="sim/app")
def main(cfg: DictConfig) -> float | None:
    """Console entry point ``gasloc-sim``."""
    return simulate(cfg)


if __name__ == "__main__":
    main()
