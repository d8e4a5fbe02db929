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

On success, error, Ctrl-C, SIGTERM or SIGHUP every process is stopped by pid and every namespace removed (with its
links); exit status 128 + the signal's number. In elastic mode a fault still in force is lifted first and the workers
leave, each with its checkpoint, and the ``gasloc-netlab ... elastic.resume=true`` command that resumes the run in
the lab is printed. Every setting is checked before anything is built; a bad one, not root, or no iproute2: one
line saying so, exit status 2.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.app.config import NetlabSchema, check_choices, config_dir
from gasloc_lightning.app.elastic import (ELASTIC_SUMMARY_FILE, ElasticAppSchema, ElasticInterrupted, ElasticRun,
                                          check_elastic, is_two_level, max_workers_of, print_table,
                                          raise_if_failed)
from gasloc_lightning.app.run_tensorboard import LauncherSeries
from gasloc_lightning.app.split import SPLIT_EXIT_CODE, SplitRunError, raise_if_split
from gasloc_lightning.app.train import check_budget
from gasloc_lightning.comm.quorum_floor import majority
from gasloc_lightning.netlab import (Fault, FaultSchedule, Lab, LabError, LabPlan, check_can_build, parse_faults,
                                     plan_lab)
from gasloc_lightning.netlab.clock_check import busiest_round, measure, median, predict_allreduce, predict_gossip
from gasloc_lightning.netlab.lab import SITE_DEVICE
from gasloc_lightning.netlab.link_meter import LinkMeter
from gasloc_lightning.netlab.placement import SitePlacement
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV, terminate

log = logging.getLogger(__name__)
MODES = ("elastic", "train", "clock")
NETLAB_SUMMARY_FILE = "netlab_summary.json"
_POLL_S = 0.2
# Not passed on to the ranks of train mode: the lab's own settings, and what the lab sets for each rank itself.
_NOT_FOR_RANKS = ("netlab", "elastic", "network", "output_dir", "trainer.devices", "trainer.num_nodes")
# Not repeated by the resume command (netlab.faults: only those not fired yet, added back).
_NOT_FOR_RESUME = ("output_dir", "elastic.resume", "elastic.chaos", "elastic.random_chaos", "netlab.faults")


@dataclass
class NetlabAppSchema(ElasticAppSchema):
    netlab: NetlabSchema = field(default_factory=NetlabSchema)


ConfigStore.instance().store(group="schema", name="netlab_app", node=NetlabAppSchema)


class _Signalled(Exception):
    """SIGTERM or SIGHUP reached gasloc-netlab (``signum``: which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signum_of(interrupted: BaseException) -> int:
    return interrupted.signum if isinstance(interrupted, _Signalled) else signal.SIGINT


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise (as Ctrl-C does), so the lab's ``finally`` removes everything."""
    def handler(signum: int, frame: Any) -> None:
        raise _Signalled(signum)

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
    """Refuse netlab settings that cannot work, naming the key (before anything is built)."""
    netlab = cfg.netlab
    if netlab.mode not in MODES:
        raise ValueError(f"netlab.mode must be one of {MODES}, got {netlab.mode!r}")
    if netlab.faults and netlab.mode != "elastic":
        raise ValueError("netlab.faults are fired in netlab.mode=elastic only (they follow the workers' steps)")
    _check_int("netlab.clock_repeats", netlab.clock_repeats, "the median of no repeat is nothing")
    if netlab.clock_bytes is not None:
        _check_int("netlab.clock_bytes", netlab.clock_bytes, "null: the model's parameters x 4")
    for key in ("timeout_s", "flap_period_s"):
        if not netlab[key] > 0:
            raise ValueError(f"netlab.{key} must be > 0 seconds, got {netlab[key]!r}")
    every_s = cfg.elastic.status_every_s  # every mode reads the links' counters (and shows status) this often
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s > 0:
        raise ValueError(f"elastic.status_every_s must be > 0 seconds, got {every_s!r} (every mode reads the "
                         "links' counters this often)")
    if netlab.mode == "train":
        _check_port("netlab.train_port", netlab.train_port, "rank 0's store must listen where the others look")
    if netlab.mode == "elastic":
        _check_lab_lighthouse(cfg)


def _check_lab_lighthouse(cfg: DictConfig) -> None:
    if cfg.elastic.lighthouse is not None:
        raise ValueError(f"elastic.lighthouse={cfg.elastic.lighthouse!r} cannot be used in the lab: gasloc-netlab "
                         "starts its own lighthouse in site 0 (on netlab.lighthouse_port), and the sites reach no "
                         "address outside the lab; drop elastic.lighthouse")
    _check_port("netlab.lighthouse_port", cfg.netlab.lighthouse_port,
                "0 (any free port) cannot work: the launcher would look for a free port outside site 0")
    if cfg.elastic.lighthouse_port:
        _check_port("elastic.lighthouse_port", cfg.elastic.lighthouse_port, "it overrides netlab.lighthouse_port")


def _check_int(key: str, value: Any, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an int >= 1, got {value!r} ({hint})")


def _check_port(key: str, value: Any, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{key} must be a port in [1, 65535], got {value!r} ({hint})")


def run_netlab(cfg: DictConfig) -> dict[str, Any]:
    """Build the lab of ``cfg``'s preset, run its mode in it, remove the lab; returns (and writes) the summary.

    Every setting is checked before the lab is built (a bad one raises ``ValueError`` naming its key).
    """
    check_netlab(cfg)
    network = network_of(cfg)
    workers = {"elastic": cfg.elastic.workers, "train": cfg.trainer.devices, "clock": network.world_size}
    plan = plan_lab(network, workers=int(workers[cfg.netlab.mode]), bandwidth_scale=cfg.netlab.bandwidth_scale)
    faults = parse_faults(list(cfg.netlab.faults), plan.sites)
    elastic_cfg = _elastic_config(cfg, plan) if cfg.netlab.mode == "elastic" else None
    check_can_build()
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with _signals_raise(), Lab(plan) as lab:
        _print_plan(lab)
        if elastic_cfg is not None:
            result = _elastic(cfg, elastic_cfg, lab, faults)
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


def _override_key(override: str) -> str:
    """``++netlab.faults=[...]`` -> ``netlab.faults``; ``~network`` -> ``network``."""
    return override.lstrip("+~").split("=", 1)[0]


def _is_under(override: str, keys: tuple[str, ...]) -> bool:
    key = _override_key(override)
    return any(key == k or key.startswith(f"{k}.") for k in keys)


# ------------------------------------------------------------------ elastic
def _elastic_config(cfg: DictConfig, plan: LabPlan) -> DictConfig:
    """gasloc-elastic's config in the lab, checked as gasloc-elastic checks it: no ``netlab`` node, the lighthouse on
    site 0's address and the lab's port and, with ``netlab.majority_quorum``, a ``min_workers`` below a majority
    raised to it (unless ``elastic.allow_split_quorum=true`` asks for the split quorum by name)."""
    elastic_cfg = _without_netlab(cfg)
    elastic_cfg.elastic.bind = plan.addresses[0]
    elastic_cfg.elastic.advertise = None
    elastic_cfg.elastic.lighthouse_port = cfg.elastic.lighthouse_port or cfg.netlab.lighthouse_port
    elastic = cfg.elastic
    floor = majority(max_workers_of(elastic))
    if (cfg.netlab.majority_quorum and not elastic.allow_split_quorum and elastic.min_workers is not None
            and elastic.min_workers < floor):
        # Two sides of a partition can each hold min_workers <= W/2 and each form quorums of their own (torchft's
        # lighthouse keeps no side out): they train apart and end on two models. A majority keeps it to one side.
        print(f"netlab: elastic.min_workers {elastic.min_workers} -> {floor}, a majority of "
              f"{max_workers_of(elastic)} workers (netlab.majority_quorum=true): one side of a partition trains",
              flush=True)
        elastic_cfg.elastic.min_workers = floor
    topology = elastic_cfg.get("topology") or {}
    if is_two_level(topology) and topology.get("regions") is None:  # the lab's sites are the regions (any sizes: the
        elastic_cfg.topology.regions = list(plan.worker_sites)      # elastic round mixes the regions' points)
    check_choices(elastic_cfg)
    check_budget(elastic_cfg.trainer)
    check_elastic(elastic_cfg)
    return elastic_cfg


def _elastic(cfg: DictConfig, elastic_cfg: DictConfig, lab: Lab, faults: list[Fault]) -> dict[str, Any]:
    def poll(run: ElasticRun) -> None:
        schedule.poll(run.furthest_step())
        _log_links(meter, run.series, run.furthest_step())

    run = ElasticRun(elastic_cfg, on_poll=poll, placement=SitePlacement(lab))
    meter = LinkMeter.of_lab(lab, every_s=cfg.elastic.status_every_s)
    schedule = FaultSchedule(faults, lab, flap_period_s=cfg.netlab.flap_period_s,
                             report=lambda text: _report_fault(run, text))
    signum, summary = run_in_lab(run, schedule)
    print_table(summary)
    if signum is not None:
        _print_resume(summary, run.run_dir, schedule.unfired)
        raise ElasticInterrupted(signum, f"gasloc-netlab: interrupted by {signal.Signals(signum).name}; the "
                                         "workers left (resume with the gasloc-netlab command above)")
    raise_if_failed(run, summary, prefix="")  # main() says gasloc-netlab
    finished = [row for row in summary["workers"] if row["status"] == "finished"]
    checksums = sorted({row["model_checksum"] for row in finished})
    print(f"netlab: {len(finished)} of {len(summary['workers'])} workers finished at steps "
          f"{sorted({row['final_step'] for row in finished})} on {len(checksums)} model(s)", flush=True)
    raise_if_split(summary, run.run_dir)  # main() says gasloc-netlab
    return {"faults": schedule.fired, "workers": summary["workers"], "models": len(checksums)}


def _log_links(meter: LinkMeter, series: LauncherSeries, step: int) -> None:
    """With logger=tensorboard, each link's measured throughput goes to the launcher's series (read from the
    links' tc counters every ``elastic.status_every_s``); a failed read is skipped, never fatal, and logged once
    (the next failures at debug level: a warning every window would bury the run's output)."""
    if series.log_dir is None:
        return
    try:
        rates = meter.poll()
    except LabError as error:
        level = logging.WARNING if meter.failures == 1 else logging.DEBUG
        log.log(level, "netlab: could not read the links' counters (skipped while it fails): %s", error)
        return
    if rates is not None:
        series.links(rates, step)


def _report_fault(run: ElasticRun, text: str) -> None:
    """A fault action goes to the log and, with logger=tensorboard, to the launcher's event series."""
    print(text, flush=True)
    run.series.event(text, run.furthest_step())


def run_in_lab(run: ElasticRun, schedule: FaultSchedule) -> tuple[int | None, dict[str, Any]]:
    """Run an elastic launcher to its end with faults on the lab's links; the summary, also written to the run.

    The steps of :func:`~gasloc_lightning.app.elastic.run_elastic` (start and watch; on Ctrl-C, SIGTERM or SIGHUP
    every worker leaves; then stop what still runs, clean up, write the summary) and one more: every link is
    restored before the workers are asked to leave and before the launcher stops them (its SIGTERM asks them to
    leave too). A worker behind a partition can then finish its round and checkpoint, instead of waiting out
    ``elastic.leave_grace_s`` and being killed. The resume command is the caller's to print (gasloc-netlab's, not
    gasloc-elastic's).

    Args:
        run: the launcher, not started yet, placed in the lab; its ``on_poll`` polls ``schedule``.
        schedule: the faults on the lab's links.

    Returns:
        The signal that interrupted the run (None: it ran to its end), and the summary.
    """
    signum: int | None = None
    try:
        try:
            run.start()
            run.watch()
        except (KeyboardInterrupt, _Signalled) as interrupted:
            signum = _signum_of(interrupted)
            run.interrupted = True
            schedule.lift_all()
            _leave(run)
    finally:
        schedule.lift_all()
        run.stop()
        run.clean_up()
        summary = run.summary()
        (run.run_dir / ELASTIC_SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return signum, summary


def _leave(run: ElasticRun) -> None:
    try:
        run.leave()
    except (KeyboardInterrupt, _Signalled):
        print("a second signal: stopping the workers now", flush=True)


def _print_resume(summary: dict[str, Any], run_dir: Path, unfired: list[Fault]) -> None:
    print("interrupted: the workers left; their checkpoints:", flush=True)
    for row in summary["workers"]:
        where = row["checkpoint"] or f"none ({row['status']}: it joins from a peer on resume)"
        print(f"  worker {row['worker']}: {where}", flush=True)
    print(f"resume in the lab with: {lab_resume_command(_task_overrides(), run_dir, unfired)}", flush=True)


def lab_resume_command(overrides: list[str], run_dir: Path | str, unfired: list[Fault]) -> str:
    """The ``gasloc-netlab`` command that resumes an interrupted elastic lab run from its workers' checkpoints.

    The same command line (so the same network preset, lab and training settings) with the run's
    ``output_dir`` and ``elastic.resume=true``. Chaos is dropped, as gasloc-elastic drops it (its steps are behind
    the resumed workers, so every event would fire at once), and so are the faults that fired: only ``unfired``
    ones are kept.

    Args:
        overrides: the interrupted run's command-line overrides (Hydra's task overrides).
        run_dir: the interrupted run's ``output_dir``, holding ``worker_<W>/checkpoints/left``.
        unfired: the faults whose step had not come yet.
    """
    kept = [override for override in overrides if not _is_under(override, _NOT_FOR_RESUME)]
    faults = [f"netlab.faults=[{','.join(str(fault) for fault in unfired)}]"] if unfired else []
    return shlex.join(["gasloc-netlab", *kept, *faults, f"output_dir={run_dir}", "elastic.resume=true"])


def _without_netlab(cfg: DictConfig) -> DictConfig:
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("netlab")
    return OmegaConf.create(plain)


# ------------------------------------------------------------------ train (static strategies)
def _train(cfg: DictConfig, lab: Lab, run_dir: Path) -> dict[str, Any]:
    """One ``gasloc-train`` process per rank in its site, as torchrun starts them: ``trainer.num_nodes=N`` of one
    device, ``NODE_RANK``/``LOCAL_RANK``/``MASTER_ADDR`` in the environment, gloo bound to the site's link."""
    world, plan = int(cfg.trainer.devices), lab.plan
    overrides = rank_overrides(_task_overrides())
    base = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    processes: list[subprocess.Popen] = []
    started = time.monotonic()
    # no step is shared by the ranks here: the links' series are logged against the seconds since the start
    series, meter = LauncherSeries.for_run(cfg), LinkMeter.of_lab(lab, every_s=cfg.elastic.status_every_s)
    try:
        for rank in range(world):
            env = {**base, "MASTER_ADDR": plan.addresses[0], "MASTER_PORT": str(cfg.netlab.train_port),
                   "WORLD_SIZE": str(world), "NODE_RANK": str(rank), "LOCAL_RANK": "0", "RANK": str(rank),
                   "GLOO_SOCKET_IFNAME": SITE_DEVICE, LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "gasloc_lightning.app.train", *overrides, *region_overrides(cfg, plan, overrides),
                       f"output_dir={run_dir}",
                       "trainer.devices=1", f"trainer.num_nodes={world}", "~network", "strategy.start_method=popen",
                       "hydra.output_subdir=null", f"hydra.run.dir={run_dir}"]
            with open(run_dir / f"rank_{rank}.log", "ab") as log_file:
                processes.append(subprocess.Popen(lab.wrap(command, plan.worker_sites[rank]), env=env,
                                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True))
        codes = _wait_all(processes, cfg.netlab.timeout_s,
                          on_poll=lambda: _log_links(meter, series, int(time.monotonic() - started)))
    finally:
        terminate(processes, 5.0)
        series.close()
    wall_s = time.monotonic() - started
    print(f"netlab: {world} ranks exited {codes} after {wall_s:.1f}s", flush=True)
    if any(code != 0 for code in codes):
        raise RuntimeError(f"rank(s) {[r for r, c in enumerate(codes) if c != 0]} failed; see "
                           f"{run_dir}/rank_<R>.log")
    return {"wall_s": wall_s, "exit_codes": codes}


def region_overrides(cfg: DictConfig, plan: Any, overrides: list[str]) -> list[str]:
    """``topology.regions=[...]``, each rank's site, for a two-level topology (``topology=two_level`` or
    ``hierarchical``) that would take its regions from the network: the ranks run without the network
    (``~network``), and the lab's sites are the regions. Nothing when the user's ``overrides`` give the regions
    (``topology.regions``, ``topology.bandwidth`` or ``topology.sizes``): the ranks get those."""
    topology = cfg.get("topology") or {}
    if "TwoLevelTopology" not in str(topology.get("_target_", "")):
        return []
    if any(_is_under(override, ("topology.regions", "topology.bandwidth", "topology.sizes")) for override in overrides):
        return []
    sites = list(plan.worker_sites)
    counts = sorted({sites.count(site) for site in set(sites)})
    if len(counts) != 1:
        raise ValueError(f"{topology.get('_target_')}: the lab's sites hold {[sites.count(s) for s in sorted(set(sites))]} "
                         "ranks; the two-level strategy needs regions of equal sizes (give trainer.devices a multiple "
                         "of the sites, or topology.regions)")
    return [f"topology.regions=[{','.join(str(site) for site in sites)}]"]


def rank_overrides(overrides: list[str]) -> list[str]:
    """The command-line overrides a rank of train mode gets: gasloc-train's own, in any Hydra form (``key=``,
    ``+key=``, ``++key=``, ``~key``).

    Left out: ``netlab.*`` and ``elastic.*`` (gasloc-train has no such nodes: ``~`` of them fails there, ``+``/``++``
    would add stray ones), ``network`` and its keys (the lab's links replace the simulated network, ``~network``,
    whose clock would count one rank per process), and what the lab sets per rank (``output_dir``,
    ``trainer.devices``, ``trainer.num_nodes``).

    Args:
        overrides: gasloc-netlab's command-line overrides (Hydra's task overrides).
    """
    return [override for override in overrides if not _is_under(override, _NOT_FOR_RANKS)]


def _wait_all(processes: list[subprocess.Popen], timeout_s: float,
              on_poll: Callable[[], None] | None = None) -> list[int | None]:
    """Wait for every process; the first failure or the timeout ends the wait (the caller stops the rest).
    ``on_poll``: called at every poll."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return codes
        if on_poll is not None:
            on_poll()
        time.sleep(_POLL_S)
    raise TimeoutError(f"the ranks ran past netlab.timeout_s={timeout_s:g}s: stopped")


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# ------------------------------------------------------------------ clock
def _clock(cfg: DictConfig, network: NetworkModel, lab: Lab, run_dir: Path) -> dict[str, Any]:
    scale, deadline = cfg.netlab.bandwidth_scale, time.monotonic() + cfg.netlab.timeout_s
    nbytes = int(cfg.netlab.clock_bytes or 4 * _parameters(cfg))
    preset = _preset_name(cfg)
    rows = []
    full, bandwidth, ring = predict_allreduce(network, nbytes, scale)
    seconds = _measure_by(deadline, cfg, lab, run_dir, pattern="allreduce", nbytes=nbytes, pairs=[])
    rows.append({"preset": preset, "pattern": "allreduce (DiLoCo)", "nbytes": nbytes, "predicted": full,
                 "predicted_bw": bandwidth, "predicted_ring_bw": ring, "measured": median(seconds), "repeats": seconds})
    round_index, pairs = busiest_round(network, instantiate(cfg.topology))
    full, bandwidth = predict_gossip(network, pairs, nbytes, scale)
    for pattern, order in (("gossip", "send first, as the engines"), ("gossip_recv_first", "recv first")):
        seconds = _measure_by(deadline, cfg, lab, run_dir, pattern=pattern, nbytes=nbytes, pairs=pairs)
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


def _measure_by(deadline: float, cfg: DictConfig, lab: Lab, run_dir: Path, **pattern: Any) -> list[float]:
    """One clock probe within what is left of ``netlab.timeout_s`` (``measure`` stops its probes by pid)."""
    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError("no time left for the next pattern")
        return measure(lab, repeats=cfg.netlab.clock_repeats, folder=run_dir / "clock", timeout_s=left, **pattern)
    except TimeoutError as error:
        if time.monotonic() < deadline:
            raise
        raise TimeoutError(f"clock mode ran past netlab.timeout_s={cfg.netlab.timeout_s:g}s ({error})") from None


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
    """Console entry point ``gasloc-netlab``: 2, a setting or the lab cannot work; 1, a worker, rank or probe failed or
    ran past its timeout; 3, the elastic run ended on more than one model; 128 + the signal's number, interrupted
    (Ctrl-C 130, SIGTERM 143, SIGHUP 129)."""
    try:
        run_netlab(cfg)
    except (LabError, ValueError, FileNotFoundError) as error:  # FileNotFoundError: elastic.resume with nothing left
        print(f"gasloc-netlab: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except ElasticInterrupted as interrupted:
        print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(128 + interrupted.signum) from None
    except SplitRunError as split:  # the run ended on several models: each named, and the merge command
        print(f"gasloc-netlab: {split}", file=sys.stderr, flush=True)
        raise SystemExit(SPLIT_EXIT_CODE) from None
    except (RuntimeError, TimeoutError) as error:  # a worker or rank failed: named, with where its log is
        print(f"gasloc-netlab: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except (KeyboardInterrupt, _Signalled) as interrupted:
        signum = _signum_of(interrupted)
        print(f"gasloc-netlab: interrupted by {signal.Signals(signum).name}; the lab is removed", file=sys.stderr,
              flush=True)
        raise SystemExit(128 + signum) from None


if __name__ == "__main__":
    main()
