"""``gasloc-netlab``: training across sites that are network namespaces, over shaped links, with real link faults.

Usage (as root; see ``docs/netlab.md``)::

    gasloc-netlab experiment=demo network=two_clusters elastic.workers=4 'netlab.faults=[partition:1@40:15]'
    gasloc-netlab experiment=demo network=cloud_mix elastic.workers=4 'netlab.faults=[flap:2@30:6]'
    gasloc-netlab experiment=demo network=two_clusters netlab.mode=train strategy=diloco trainer.devices=8
    gasloc-netlab experiment=demo network=two_clusters netlab.mode=clock

It composes ``gasloc-elastic``'s config plus ``netlab`` (``conf/netlab/default.yaml``), builds the lab of the
``network=`` preset (:mod:`gasloc_lightning.netlab`), then in

- ``elastic`` mode runs ``gasloc-elastic`` in it (:func:`~gasloc_lightning.app.elastic.run_elastic` with a
  :class:`~gasloc_lightning.netlab.placement.SitePlacement`: the lighthouse in site 0, each worker in its site,
  binding and advertising the site's address) and fires ``netlab.faults`` as the workers' step passes theirs;
- ``train`` mode runs ``gasloc-train``'s static strategy, one process per rank (``trainer.devices`` ranks,
  ``trainer.num_nodes=N`` x 1 device each, started as torchrun would), each in its site;
- ``clock`` mode times DiLoCo's and GASLoC's round communication across the sites next to the network clock's
  prediction (:mod:`gasloc_lightning.netlab.clock_check`).

On success, error, Ctrl-C or SIGTERM every process is stopped by pid and every namespace removed (with its links).
Not root, or no iproute2: one line saying so, exit status 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.app.config import NetlabSchema, config_dir
from gasloc_lightning.app.elastic import ElasticAppSchema, ElasticInterrupted, ElasticRun, run_elastic
from gasloc_lightning.netlab import FaultSchedule, Lab, LabError, check_can_build, parse_faults, plan_lab
from gasloc_lightning.netlab.clock_check import busiest_round, measure, median, predict_allreduce, predict_gossip
from gasloc_lightning.netlab.lab import SITE_DEVICE
from gasloc_lightning.netlab.placement import SitePlacement
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV, terminate

MODES = ("elastic", "train", "clock")
NETLAB_SUMMARY_FILE = "netlab_summary.json"
_POLL_S = 0.2


@dataclass
class NetlabAppSchema(ElasticAppSchema):
    netlab: NetlabSchema = field(default_factory=NetlabSchema)


ConfigStore.instance().store(group="schema", name="netlab_app", node=NetlabAppSchema)


class _Signalled(Exception):
    """SIGTERM or SIGHUP reached gasloc-netlab."""


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise (as Ctrl-C does), so the lab's ``finally`` removes everything."""
    def handler(signum: int, frame: Any) -> None:
        raise _Signalled(f"signal {signum}")

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def network_of(cfg: DictConfig) -> NetworkModel:
    """The ``network=`` preset, built; a clear error without one."""
    if cfg.get("network") is None:
        raise ValueError("the lab needs a network preset: network=two_clusters, network=cloud_mix, ...")
    network = instantiate(cfg.network)
    if not isinstance(network, NetworkModel):
        raise ValueError(f"network= must build a NetworkModel, got {type(network).__name__}")
    return network


def check_netlab(cfg: DictConfig) -> None:
    """Refuse netlab settings that cannot work, naming the key."""
    if cfg.netlab.mode not in MODES:
        raise ValueError(f"netlab.mode must be one of {MODES}, got {cfg.netlab.mode!r}")
    if cfg.netlab.faults and cfg.netlab.mode != "elastic":
        raise ValueError("netlab.faults are fired in netlab.mode=elastic only (they follow the workers' steps)")


def run_netlab(cfg: DictConfig) -> dict[str, Any]:
    """Build the lab of ``cfg``'s preset, run its mode in it, remove the lab; returns (and writes) the summary."""
    check_netlab(cfg)
    network = network_of(cfg)
    workers = {"elastic": cfg.elastic.workers, "train": cfg.trainer.devices, "clock": network.world_size}
    plan = plan_lab(network, workers=int(workers[cfg.netlab.mode]), bandwidth_scale=cfg.netlab.bandwidth_scale)
    faults = parse_faults(list(cfg.netlab.faults), plan.sites)
    check_can_build()
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with _signals_raise(), Lab(plan) as lab:
        _print_plan(lab)
        if cfg.netlab.mode == "elastic":
            result = _elastic(cfg, lab, faults)
        elif cfg.netlab.mode == "train":
            result = _train(cfg, lab, run_dir)
        else:
            result = _clock(cfg, network, lab, run_dir)
    summary = {"mode": cfg.netlab.mode, "prefix": lab.prefix, "addresses": list(plan.addresses),
               "worker_sites": list(plan.worker_sites), "rates_mbit": [list(r) for r in plan.rates_mbit], **result}
    (run_dir / NETLAB_SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"netlab: removed namespaces {lab.prefix}-* (and their links)", flush=True)
    return summary


def _print_plan(lab: Lab) -> None:
    plan = lab.plan
    for site, address in enumerate(plan.addresses):
        rates = ", ".join(f"->{b}: {rate:g} Mbit/s" for b, rate in enumerate(plan.rates_mbit[site]) if b != site)
        print(f"netlab: site {site} {lab.site_namespace(site)} {address} workers {plan.workers_in(site)} ({rates})",
              flush=True)


# ------------------------------------------------------------------ elastic
def _elastic(cfg: DictConfig, lab: Lab, faults: list) -> dict[str, Any]:
    elastic_cfg = _without_netlab(cfg)
    elastic_cfg.elastic.bind = lab.plan.addresses[0]
    elastic_cfg.elastic.advertise = None
    elastic_cfg.elastic.lighthouse_port = cfg.elastic.lighthouse_port or cfg.netlab.lighthouse_port
    majority = cfg.elastic.workers // 2 + 1
    if cfg.netlab.majority_quorum and cfg.elastic.min_workers < majority:
        # Two sides of a partition can each hold min_workers <= W/2 and each form quorums of their own (torchft's
        # lighthouse keeps no side out): they train apart and end on two models. A majority keeps it to one side.
        print(f"netlab: elastic.min_workers {cfg.elastic.min_workers} -> {majority}, a majority of the "
              f"{cfg.elastic.workers} workers (netlab.majority_quorum=true): one side of a partition trains",
              flush=True)
        elastic_cfg.elastic.min_workers = majority
    schedule = FaultSchedule(faults, lab, flap_period_s=cfg.netlab.flap_period_s)

    def on_poll(run: ElasticRun) -> None:
        schedule.poll(max((r.progress().get("step") or 0 for r in run.workers if r.running), default=0))

    try:
        summary = run_elastic(elastic_cfg, on_poll=on_poll, placement=SitePlacement(lab))
    finally:
        schedule.lift_all()
    finished = [row for row in summary["workers"] if row["status"] == "finished"]
    checksums = sorted({row["model_checksum"] for row in finished})
    print(f"netlab: {len(finished)} of {len(summary['workers'])} workers finished at steps "
          f"{sorted({row['final_step'] for row in finished})} on {len(checksums)} model(s)", flush=True)
    return {"faults": schedule.fired, "workers": summary["workers"], "models": len(checksums)}


def _without_netlab(cfg: DictConfig) -> DictConfig:
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("netlab")
    return OmegaConf.create(plain)


# ------------------------------------------------------------------ train (static strategies)
def _train(cfg: DictConfig, lab: Lab, run_dir: Path) -> dict[str, Any]:
    """One ``gasloc-train`` process per rank in its site, as torchrun starts them: ``trainer.num_nodes=N`` of one
    device, ``NODE_RANK``/``LOCAL_RANK``/``MASTER_ADDR`` in the environment, gloo bound to the site's link."""
    world, plan = int(cfg.trainer.devices), lab.plan
    # The lab's links replace the simulated network (~network), whose clock would count one rank per process.
    overrides = [o for o in _task_overrides() if not o.startswith(("netlab.", "elastic.", "output_dir=", "network=",
                                                                   "trainer.devices=", "trainer.num_nodes="))]
    base = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    processes: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        for rank in range(world):
            env = {**base, "MASTER_ADDR": plan.addresses[0], "MASTER_PORT": str(cfg.netlab.train_port),
                   "WORLD_SIZE": str(world), "NODE_RANK": str(rank), "LOCAL_RANK": "0", "RANK": str(rank),
                   "GLOO_SOCKET_IFNAME": SITE_DEVICE, LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "gasloc_lightning.app.train", *overrides, f"output_dir={run_dir}",
                       "trainer.devices=1", f"trainer.num_nodes={world}", "~network", "strategy.start_method=popen", "hydra.output_subdir=null",
                       f"hydra.run.dir={run_dir}"]
            with open(run_dir / f"rank_{rank}.log", "ab") as log_file:
                processes.append(subprocess.Popen(lab.wrap(command, plan.worker_sites[rank]), env=env,
                                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True))
        codes = _wait_all(processes, cfg.netlab.timeout_s)
    finally:
        terminate(processes, 5.0)
    wall_s = time.monotonic() - started
    print(f"netlab: {world} ranks exited {codes} after {wall_s:.1f}s", flush=True)
    if any(code != 0 for code in codes):
        raise RuntimeError(f"rank(s) {[r for r, c in enumerate(codes) if c != 0]} failed; see "
                           f"{run_dir}/rank_<R>.log")
    return {"wall_s": wall_s, "exit_codes": codes}


def _wait_all(processes: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Wait for every process; the first failure or the timeout ends the wait (the caller stops the rest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return codes
        time.sleep(_POLL_S)
    raise TimeoutError(f"gasloc-netlab: the ranks ran past netlab.timeout_s={timeout_s:g}s")


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# ------------------------------------------------------------------ clock
def _clock(cfg: DictConfig, network: NetworkModel, lab: Lab, run_dir: Path) -> dict[str, Any]:
    scale, repeats = cfg.netlab.bandwidth_scale, cfg.netlab.clock_repeats
    nbytes = int(cfg.netlab.clock_bytes or 4 * _parameters(cfg))
    preset = _preset_name(cfg)
    rows = []
    full, bandwidth, ring = predict_allreduce(network, nbytes, scale)
    seconds = measure(lab, pattern="allreduce", nbytes=nbytes, pairs=[], repeats=repeats, folder=run_dir / "clock")
    rows.append({"preset": preset, "pattern": "allreduce (DiLoCo)", "nbytes": nbytes, "predicted": full,
                 "predicted_bw": bandwidth, "predicted_ring_bw": ring, "measured": median(seconds), "repeats": seconds})
    round_index, pairs = busiest_round(network, instantiate(cfg.topology))
    full, bandwidth = predict_gossip(network, pairs, nbytes, scale)
    for pattern, order in (("gossip", "send first, as the engines"), ("gossip_recv_first", "recv first")):
        seconds = measure(lab, pattern=pattern, nbytes=nbytes, pairs=pairs, repeats=repeats, folder=run_dir / "clock")
        rows.append({"preset": preset, "pattern": f"gossip (GASLoC round {round_index}, {len(pairs)} pairs, {order})",
                     "nbytes": nbytes, "predicted": full, "predicted_bw": bandwidth, "predicted_ring_bw": None,
                     "measured": median(seconds), "repeats": seconds})
    print("| preset | pattern | bytes | model (s) | model, no latency (s) | ring, no latency (s) | measured (s) | "
          "measured / model, no latency |")
    for row in rows:
        ring_text = "-" if row["predicted_ring_bw"] is None else f"{row['predicted_ring_bw']:.2f}"
        print(f"| {row['preset']} | {row['pattern']} | {row['nbytes']} | {row['predicted']:.2f} | "
              f"{row['predicted_bw']:.2f} | {ring_text} | {row['measured']:.2f} | "
              f"{row['measured'] / row['predicted_bw']:.2f} |", flush=True)
    return {"clock": rows, "bandwidth_scale": scale}


def _parameters(cfg: DictConfig) -> int:
    module = instantiate(cfg.model)
    return sum(p.numel() for p in module.parameters())


def _preset_name(cfg: DictConfig) -> str:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get("network"))
    return "network"


# ------------------------------------------------------------------ entry point
@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="netlab/app")
def main(cfg: DictConfig) -> None:
    """Console entry point ``gasloc-netlab`` (2: the lab cannot be built; 128 + signal: interrupted)."""
    try:
        run_netlab(cfg)
    except (LabError, ValueError) as error:
        print(f"gasloc-netlab: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except ElasticInterrupted as interrupted:
        print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(128 + interrupted.signum) from None
    except (RuntimeError, TimeoutError) as error:  # a worker or rank failed: named, with where its log is
        print(f"gasloc-netlab: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except (KeyboardInterrupt, _Signalled) as interrupted:
        print(f"gasloc-netlab: interrupted ({interrupted or 'SIGINT'}); the lab is removed", file=sys.stderr,
              flush=True)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
