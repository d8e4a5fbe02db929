"""Uneven networks and workers: simulated time for each method to reach DiLoCo's final validation loss.

For every scenario of ``conf/network/`` (uniform fast, two clusters, a straggler, a cloud mix)
this trains, with 8 CPU workers and a tiny byte-level GPT on the embedded stdlib corpus:

    ddp, diloco, gasloc (one_peer), gasloc + overlap, and on clustered networks gasloc with
    bandwidth-aware peers: the concentrated schedule (blocking), and the spread schedule (one
    pair across per round on average) with overlap, in float32 and in bfloat16

DiLoCo runs for ``--rounds`` rounds of H steps; every other method gets 1.5x DiLoCo's tokens.
Validation runs every round (every H steps for DDP) and, as in ``gasloc-train``, evaluates the
average of the replicas (the model a run delivers); the table also shows the final mean of the
replicas' own losses (``val/loss_local``). The simulated clock models the scenario's
network with a 1B-parameter fp32 model (the training itself uses the tiny proxy). For each
method it prints the simulated time at which the validation loss first reaches DiLoCo's final
loss (linear interpolation between validations; "not reached" when it never does) and the ratio
to DiLoCo's own time. Ratios, not wall-clock: the wall time of this machine is noise.

    python benchmarks/heterogeneous.py                  # all scenarios, H = 50
    python benchmarks/heterogeneous.py --scenarios two_clusters --rounds 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

from gasloc_lightning import DiLoCoStrategy, GASLoCCallback, GASLoCStrategy, SimulatedClockCallback
from gasloc_lightning.strategies.baselines import CpuThreads
from gasloc_lightning.data import ByteDataModule
from gasloc_lightning.models.lm import LanguageModel
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.topology import BandwidthAwareTopology

CONF = Path(__file__).resolve().parents[1] / "conf" / "network"
# gamma of the overlapped methods. Chosen on two_clusters (seed 0, H = 50, spread + overlap + bf16)
# among 0.7 / 0.8 / 0.9: 0.463x / 0.505x / 0.58x DiLoCo's time. The one-round delay adds to the
# momentum's own lag, and the lower gamma also agrees faster (consensus rate 0.856 vs 0.939).
OVERLAP_MOMENTUM = 0.7
SCENARIOS = ("uniform_fast", "two_clusters", "straggler", "cloud_mix")
WORKERS = 8


class ValidationTrace(Callback):
    """Rank 0 writes (step, sim_time, val/loss, val/loss_local or None) at every validation.

    sim_time is the largest clock over the workers (they differ under gossip).
    """

    def __init__(self, path: str, clock_callback: SimulatedClockCallback | None = None):
        self.path, self.clock_callback, self.points = path, clock_callback, []

    def _sim_time(self, trainer) -> float:
        """The latest clock over the workers: the consensus model needs every worker's round."""
        mine = self.clock_callback.clock.time if self.clock_callback is not None else trainer.strategy.sim_time
        return float(trainer.strategy.reduce(torch.tensor(mine, dtype=torch.float64), reduce_op="max"))

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        metrics = trainer.callback_metrics
        local = float(metrics["val/loss_local"]) if "val/loss_local" in metrics else None
        self.points.append((trainer.global_step, self._sim_time(trainer), float(metrics["val/loss"]), local))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.points))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_network(name: str) -> NetworkModel:
    return instantiate(OmegaConf.load(CONF / f"{name}.yaml"))


def methods(network: NetworkModel, inner_steps: int, overlap_momentum: float | None = OVERLAP_MOMENTUM) -> dict[str, dict]:
    """name -> strategy factory arguments; bandwidth-aware peers only where there are clusters.

    The spread schedule puts one pair across clusters per round on average (slow-link rate 2 / n).
    Overlapped methods use ``overlap_momentum`` as gamma (None: the topology's default, 0.9).
    """
    uneven = len(set(network.speeds)) > 1
    steps = {"inner_steps": "auto", "fastest_inner_steps": inner_steps} if uneven else {"inner_steps": inner_steps}
    overlap = {"overlap": True, "outer_momentum": overlap_momentum}
    table = {
        "ddp": {"kind": "ddp"},
        "diloco": {"kind": "diloco", **steps},
        "gasloc": {"kind": "gasloc", "topology": "one_peer", **steps},
        "gasloc+overlap": {"kind": "gasloc", "topology": "one_peer", **overlap, **steps},
    }
    if network.num_clusters > 1:
        spread = {"kind": "gasloc", "topology": "bandwidth_aware", "schedule": "spread", **overlap, **steps}
        table["gasloc/bw-aware"] = {"kind": "gasloc", "topology": "bandwidth_aware", **steps}
        table["gasloc/bw-spread+overlap"] = spread
        table["gasloc/bw-spread+overlap+bf16"] = {**spread, "message_codec": "bfloat16"}
    return table


def make_strategy(spec: dict, network: NetworkModel, seed: int = 0):
    spec = dict(spec)
    kind = spec.pop("kind")
    common = {"start_method": "fork", "network": network, "gossip_timeout": 600.0, "consensus_every": 0}
    if kind == "diloco":
        return DiLoCoStrategy(**common, **spec)
    common["seed"] = seed  # the peers' schedule
    if spec.get("topology") == "bandwidth_aware":
        clusters = [network.cluster_of(rank) for rank in range(network.world_size)]
        schedule = spec.pop("schedule", "concentrated")
        rate = 2.0 / network.world_size if schedule == "spread" else 0.2
        spec["topology"] = BandwidthAwareTopology(clusters=clusters, slow_link_rate=rate, schedule=schedule, seed=seed)
    return GASLoCStrategy(**common, **spec)


def train(spec: dict, network: NetworkModel, steps: int, inner_steps: int, workdir: Path, name: str,
          seed: int = 0) -> list:
    """One run; ``seed`` sets the initial weights, the data order and the peers' schedule."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    trace_path = workdir / (name.replace("/", "_").replace("+", "_") + ".json")
    clock = SimulatedClockCallback(network) if spec["kind"] == "ddp" else None
    strategy = DDPStrategy(start_method="fork") if spec["kind"] == "ddp" else make_strategy(spec, network, seed)
    evaluate = [] if clock else [GASLoCCallback(evaluate="consensus", average_at_end=False)]
    callbacks = [ValidationTrace(str(trace_path), clock), CpuThreads(), *evaluate] + ([clock] if clock else [])
    pl.seed_everything(seed)
    model = LanguageModel(model="tiny", warmup_steps=20, max_steps=steps,
                          optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95)))
    data = ByteDataModule(source="stdlib", block_size=64, batch_size=16, val_batches=4, seed=seed,
                          cache_dir=workdir.parent / "cache")
    trainer = pl.Trainer(accelerator="cpu", devices=WORKERS, strategy=strategy, max_steps=steps,
                         val_check_interval=inner_steps, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
                         default_root_dir=workdir)
    trainer.fit(model, data)
    return json.loads(trace_path.read_text())


def time_to_reach(points: list, target: float) -> float | None:
    """Simulated time of the first validation at or below ``target``, interpolated linearly."""
    previous = None
    for _, sim_time, loss, _ in points:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return sim_time
            (t0, l0), (t1, l1) = previous, (sim_time, loss)
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
        previous = (sim_time, loss)
    return None


def run_scenario(
    name: str, rounds: int, inner_steps: int, workdir: Path, only: list[str] | None = None,
    overlap_momentum: float | None = None, seed: int = 0,
) -> list[dict]:
    network = load_network(name)
    table = {m: spec for m, spec in methods(network, inner_steps, overlap_momentum).items()
             if only is None or m in only or m == "diloco"}
    diloco_steps = rounds * inner_steps
    traces = {"diloco": train(table["diloco"], network, diloco_steps, inner_steps, workdir, f"{name}-{seed}-diloco",
                              seed)}
    target = traces["diloco"][-1][2]
    longer = math.ceil(1.5 * diloco_steps / inner_steps) * inner_steps
    for method, spec in table.items():
        if method != "diloco":
            traces[method] = train(spec, network, longer, inner_steps, workdir, f"{name}-{seed}-{method}", seed)
    reference = time_to_reach(traces["diloco"], target)
    rows = []
    for method, points in traces.items():
        reached = time_to_reach(points, target)
        rows.append({"scenario": name, "seed": seed, "method": method, "final_loss": points[-1][2], "final_local_loss": points[-1][3],
                     "time_to_target": reached, "ratio": None if reached is None else reached / reference,
                     "trace": points})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'scenario':<14}{'seed':>5} {'method':<31}{'final val loss':>15}{'(local)':>9}{'sim s to target':>17}"
          f"{'vs diloco':>11}")
    for row in rows:
        reached = "not reached" if row["time_to_target"] is None else f"{row['time_to_target']:.0f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        local = "-" if row["final_local_loss"] is None else f"{row['final_local_loss']:.4f}"
        print(f"{row['scenario']:<14}{row['seed']:>5} {row['method']:<31}{row['final_loss']:>15.4f}{local:>9}"
              f"{reached:>17}{ratio:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--rounds", type=int, default=12, help="DiLoCo's rounds; the others get 1.5x its tokens")
    parser.add_argument("--inner-steps", type=int, default=50, help="H (of the fastest worker)")
    parser.add_argument("--overlap-momentum", type=float, default=OVERLAP_MOMENTUM,
                        help=f"gamma of the overlapped methods (default {OVERLAP_MOMENTUM}, tuned; -1: topology default)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                        help="seeds (weights, data order, peers); gamma of the overlapped methods was chosen on 0")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="run only these methods (DiLoCo, the reference, always runs)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    args.overlap_momentum = None if args.overlap_momentum < 0 else args.overlap_momentum
    start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="gasloc-hetero-")) / "runs"
    workdir.mkdir(parents=True)
    rows = []
    for scenario in args.scenarios:
        for seed in args.seeds:
            rows += run_scenario(scenario, args.rounds, args.inner_steps, workdir, args.methods, args.overlap_momentum,
                                 seed)
        print_rows([r for r in rows if r["scenario"] == scenario])
    print(f"\nAll scenarios ({WORKERS} workers, H = {args.inner_steps}, DiLoCo {args.rounds} rounds, others 1.5x "
          f"tokens; wall {time.monotonic() - start:.0f} s):")
    print_rows(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
