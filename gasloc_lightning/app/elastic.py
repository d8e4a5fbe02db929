"""``gasloc-elastic``: a local launcher of elastic GASLoC for demos and tests.

Usage::

    gasloc-elastic experiment=demo elastic.workers=4 'elastic.chaos=[kill:2@40]'
    gasloc-elastic experiment=demo 'elastic.chaos=[kill:2@30,restart:2@50,stall:1@60:5]'
    gasloc-elastic experiment=demo elastic.method=diloco        # DiLoCo on the same engine
    gasloc-elastic experiment=demo 'elastic.chaos=[term:2@40]'  # worker 2 leaves cleanly (SIGTERM)
    gasloc-elastic experiment=demo 'elastic.chaos=[lighthouse@40]'  # the lighthouse dies; back once all wait for it
    gasloc-elastic experiment=demo output_dir=RUN elastic.resume=true  # after Ctrl-C: each worker from its checkpoint

It composes the same config as ``gasloc-train`` plus the ``elastic`` group (``conf/elastic/default.yaml``),
starts a torchft lighthouse (unless ``elastic.lighthouse=HOST:PORT``), starts ``elastic.workers`` worker
processes (:mod:`gasloc_lightning.app.elastic_worker`, one folder ``<run dir>/worker_<W>/`` each, with
the usual ``summary.json``), runs the chaos schedule against the workers' progress, prints a line
whenever the quorum size changes and a table at the end, and writes ``elastic_summary.json``.

Everything listens on ``elastic.bind`` (127.0.0.1 unless the user names another address; a wildcard needs
``elastic.advertise``). The run's secret reaches the workers only through their environment
(``GASLOC_ELASTIC_SECRET``: the launcher's own if set, else a new one per run); it is never written or printed.

Ctrl-C or SIGTERM makes every worker *leave*: it finishes its round, leaves the quorum and checkpoints its replica
in ``worker_<W>/checkpoints/left``; ``elastic.resume=true`` with the same ``output_dir`` starts each worker from its
own. A second signal, an error or the end of the run stops what is left by pid (the lighthouse last). The workers
and the lighthouse also exit by themselves if the launcher is killed (parent-death signal; see
:func:`~gasloc_lightning.strategies.launcher.exit_with_parent`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.app.config import TrainSchema, check_choices, config_dir
from gasloc_lightning.app.forked_workers import (WORKER_MODULE, WORKER_STARTS, ForkedWorker, start_forked_worker,
                                                 stop_fork_server)
from gasloc_lightning.app.elastic_worker import HOLD_FILE_ENV, LEAVE_CHECKPOINT, PROGRESS_FILE, read_progress, ready_file
from gasloc_lightning.app.compare_elastic import CSV_INCARNATION_PREFIX
from gasloc_lightning.app.live_status import LiveStatus, as_int
from gasloc_lightning.utils.records import dash
from gasloc_lightning.app.run_tensorboard import LauncherSeries, place_worker_tensorboard, tensorboard_nodes
from gasloc_lightning.app.split import SPLIT_EXIT_CODE, SplitRunError, model_groups, raise_if_split
from gasloc_lightning.app.summary import SUMMARY_FILE
from gasloc_lightning.app.train import check_budget
from gasloc_lightning.app.torchft_lighthouse import lighthouse_program
from gasloc_lightning.comm.endpoints import Endpoint, host_port
from gasloc_lightning.comm.lighthouse_watch import DOWN_MARK
from gasloc_lightning.comm.membership import lighthouse_reachable
from gasloc_lightning.comm.quorum_floor import is_split_quorum, quorum_floor, split_warning
from gasloc_lightning.comm.wire import SECRET_ENV, new_secret
from gasloc_lightning.strategies.launcher import set_parent_death_signal, terminate

log = logging.getLogger(__name__)

ELASTIC_SUMMARY_FILE = "elastic_summary.json"
LOOPBACK = "127.0.0.1"
_STOP_GRACE_S = 5.0
_LEAVE_MARGIN_S = 30.0  # after leave_grace_s: the end of the fit and the checkpoint write
_POLL_S = 0.2
_LIGHTHOUSE_START_S = 60.0  # a failure deadline: on a loaded 2-core machine it took 11-18 s (13 s in a lab namespace)
STATUSES = ("finished", "left", "killed", "stopped", "refused", "failed")


@dataclass
class ElasticSchema:
    """The ``elastic`` node (documented in ``conf/elastic/default.yaml``)."""

    workers: int = 4
    method: str = "gasloc"
    lighthouse: str | None = None
    lighthouse_port: int | None = None
    bind: str = LOOPBACK
    advertise: str | None = None
    min_workers: int | None = None
    max_workers: int | None = None
    allow_split_quorum: bool = False
    chaos: list[str] = field(default_factory=list)
    random_chaos: int = 0
    chaos_seed: int = 0
    join_timeout_ms: int = 15000
    heartbeat_timeout_ms: int = 2000
    connect_timeout: float = 10.0
    quorum_timeout: float = 120.0
    gossip_timeout: float = 10.0
    transfer_timeout: float = 60.0
    first_quorum_delay: float = 1.0
    cpu_threads: int = 1
    worker_start: str = "forkserver"
    leave_grace_s: float = 60.0
    member_auth: bool = True  # docs/security.md
    message_auth: bool | None = None
    resume: bool = False
    end_grace_s: float = 30.0
    timeout_s: float = 1800.0
    lighthouse_timeout: float = 30.0
    lighthouse_wait: float = 60.0
    status: bool = True
    status_every_s: float = 5.0


@dataclass
class ElasticAppSchema(TrainSchema):
    elastic: ElasticSchema = field(default_factory=ElasticSchema)


ConfigStore.instance().store(group="schema", name="elastic_app", node=ElasticAppSchema)


# ------------------------------------------------------------------ chaos schedule
LIGHTHOUSE = -1  # the ``worker`` of a lighthouse event


@dataclass(frozen=True)
class ChaosEvent:
    """``kill:W@STEP`` (SIGKILL), ``term:W@STEP`` (SIGTERM: W leaves cleanly), ``restart:W@STEP``,
    ``stall:W@STEP:SECONDS`` or ``stall:W@STEP-UNTIL`` (SIGSTOP; SIGCONT after SECONDS, or once the furthest live
    worker reaches step UNTIL: a window in steps spans the others' round boundaries however fast the machine is),
    or ``lighthouse@STEP[:SECONDS]`` (SIGKILL the lighthouse; restart it on the same address SECONDS later, or
    without SECONDS once every running worker says it waits for it); STEP is the furthest live worker's step."""

    action: str
    worker: int
    step: int
    seconds: float = 0.0
    until_step: int | None = None  # a stall's end in steps instead of seconds

    def __str__(self) -> str:
        if self.action == "lighthouse":
            return f"lighthouse@{self.step}" + (f":{self.seconds:g}" if self.seconds else "")
        if self.action != "stall":
            return f"{self.action}:{self.worker}@{self.step}"
        window = f":{self.seconds:g}" if self.until_step is None else f"-{self.until_step}"
        return f"{self.action}:{self.worker}@{self.step}{window}"


_EVENT = re.compile(r"^(kill|term|restart|stall):(\d+)@(\d+)(?::(\d+(?:\.\d+)?)|-(\d+))?$")
_LIGHTHOUSE_EVENT = re.compile(r"^lighthouse@(\d+)(?::(\d+(?:\.\d+)?))?$")


def parse_chaos(entries: list[str], workers: int) -> list[ChaosEvent]:
    """Parse and check a chaos schedule (sorted by step, in the given order within a step)."""
    events = []
    for entry in entries:
        lighthouse = _LIGHTHOUSE_EVENT.match(str(entry).strip())
        if lighthouse is not None:
            events.append(ChaosEvent("lighthouse", LIGHTHOUSE, int(lighthouse.group(1)),
                                     float(lighthouse.group(2) or 0.0)))
            continue
        match = _EVENT.match(str(entry).strip())
        if match is None:
            raise ValueError(f"elastic.chaos entry {entry!r}: expected kill:W@STEP, term:W@STEP, restart:W@STEP, "
                             "stall:W@STEP:SECONDS, stall:W@STEP-UNTIL or lighthouse@STEP[:SECONDS]")
        action, worker, step = match.group(1), int(match.group(2)), int(match.group(3))
        seconds, until = match.group(4), match.group(5)
        if worker >= workers:
            raise ValueError(f"elastic.chaos entry {entry!r}: worker {worker} does not exist (elastic.workers={workers})")
        if (action == "stall") != (seconds is not None or until is not None):
            raise ValueError(f"elastic.chaos entry {entry!r}: only stall takes :SECONDS or -UNTIL, and it needs one")
        if until is not None and int(until) <= step:
            raise ValueError(f"elastic.chaos entry {entry!r}: UNTIL must be after STEP")
        events.append(ChaosEvent(action, worker, step, float(seconds or 0.0), None if until is None else int(until)))
    return sorted(events, key=lambda event: event.step)


def random_chaos(events: int, workers: int, max_steps: int, min_workers: int, seed: int) -> list[ChaosEvent]:
    """A seeded schedule of ``events`` kills and restarts (``events`` even: every killed worker comes back).

    Events fall between 10% and 80% of ``max_steps``; at most ``workers - min_workers`` workers are down
    at once, and the same seed always gives the same schedule.
    """
    if events < 0 or events % 2:
        raise ValueError(f"elastic.random_chaos must be an even number >= 0 (kills and their restarts), got {events}")
    if events and workers - min_workers < 1:
        raise ValueError(f"elastic.random_chaos needs elastic.workers > elastic.min_workers, got {workers} and {min_workers}")
    rng = random.Random(seed)
    low, high = max(1, max_steps // 10), (8 * max_steps) // 10
    gap = (high - low) // max(events, 1)  # one event per slot of the window, so no two fall on one step
    if events and gap < 2:
        raise ValueError(f"elastic.random_chaos={events} does not fit between steps {low} and {high}")
    steps = [low + index * gap + rng.randrange(gap // 2 + 1) for index in range(events)]
    down: list[int] = []
    schedule = []
    kills_left = events // 2
    for index, step in enumerate(steps):
        left = len(steps) - index
        can_kill = kills_left > 0 and len(down) < workers - min_workers and left > len(down) + 1
        if down and (not can_kill or rng.random() < 0.5):
            schedule.append(ChaosEvent("restart", down.pop(rng.randrange(len(down))), step))
        else:
            worker = rng.choice([w for w in range(workers) if w not in down])
            down.append(worker)
            kills_left -= 1
            schedule.append(ChaosEvent("kill", worker, step))
    return schedule


# ------------------------------------------------------------------ addresses
def launcher_endpoint(elastic: DictConfig) -> Endpoint:
    """Where the lighthouse and the workers listen (``elastic.bind``) and are reached (``elastic.advertise``)."""
    try:
        return Endpoint(bind=elastic.bind, advertise=elastic.advertise)
    except ValueError as error:
        raise ValueError(f"elastic.bind={elastic.bind!r}, elastic.advertise={elastic.advertise!r}: {error}") from None


def _local_address(endpoint: Endpoint) -> str:
    """Where this machine reaches a service of ``endpoint`` (on loopback for a wildcard bind)."""
    if not endpoint.is_wildcard:
        return endpoint.bind
    return "::1" if ":" in endpoint.bind else LOOPBACK


def free_port(bind: str = LOOPBACK) -> int:
    """A port that is free on ``bind`` right now (probed there, not on every interface)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((bind, 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------ processes
def lighthouse_command(port: int, min_workers: int, join_timeout_ms: int, heartbeat_timeout_ms: int, *,
                       bind: str = LOOPBACK) -> list[str]:
    """The lighthouse's command line (torchft's, started without importing torch: see ``app.torchft_lighthouse``),
    listening on ``bind:port`` only."""
    return [*lighthouse_program(), "--bind", host_port(bind, port), "--min_replicas", str(min_workers),
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
            "--quorum_tick_ms", "50"]


def _start_process(command: list[str], log_path: Path, env: dict[str, str], **popen: Any) -> subprocess.Popen:
    """Start ``command`` in its own session (Ctrl-C in the terminal reaches the launcher only), its output appended
    to ``log_path``. The launcher's handle on the log is closed at once: the child holds its own."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                **popen)


WorkerProcess = subprocess.Popen | ForkedWorker  # a worker: forked from the preloaded server, or a fresh interpreter


@dataclass
class WorkerRecord:
    """One worker slot across its incarnations (the launcher's view)."""

    worker: int
    output_dir: Path
    config_path: Path
    process: WorkerProcess | None = None
    incarnations: int = 0
    applied: int = 0  # steps computed by earlier incarnations
    joined: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    exit_steps: list[int] = field(default_factory=list)  # each incarnation's own step when it ended
    stalled_until: float | None = None  # a stall's end: a monotonic time ...
    stalled_until_step: int | None = None  # ... or the furthest live worker's step
    spare: WorkerProcess | None = None  # the next incarnation, started ahead and held until its restart
    spare_release: Path | None = None  # the file whose creation releases the spare
    spawned: int = 0  # processes started for this slot (spares included)
    ended_by: str | None = None  # the launcher ended this incarnation: "killed" (chaos) or "stopped"
    leaving: bool = False  # SIGTERM sent: it finishes its round, then leaves
    exit_code: int | None = None
    final: dict[str, Any] = field(default_factory=dict)  # the last incarnation's progress when it ended
    resume_from: Path | None = None  # the founding incarnation's ckpt_path (elastic.resume)

    def progress(self) -> dict[str, Any]:
        return read_progress(self.output_dir) or {}

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def spare_building(self) -> bool:
        """Its next incarnation is started and still building (neither ready to be released nor exited)."""
        return self.spare is not None and self.spare.poll() is None and not ready_file(self.spare_release).exists()

    @property
    def stalled(self) -> bool:
        return self.stalled_until is not None or self.stalled_until_step is not None

    @property
    def checkpoint(self) -> Path:
        """Where this worker's replica is after a clean leave."""
        return self.output_dir / LEAVE_CHECKPOINT


class ProcessPlacement(Protocol):
    """Where the launcher's processes run, when not all on this host's own network (``gasloc-netlab`` puts each in
    its site's network namespace). Without one, everything runs here and listens on ``elastic.bind``."""

    def lighthouse_command(self, command: list[str]) -> list[str]:
        """The lighthouse's command line, placed (e.g. wrapped in ``ip netns exec``; it must keep its pid)."""

    def worker_command(self, command: list[str], worker: int) -> list[str]:
        """Worker ``worker``'s command line, placed (its own bind/advertise overrides appended)."""

    def reachable(self, address: str) -> bool:
        """Whether ``HOST:PORT`` (the started lighthouse) accepts connections where the workers run."""


class ElasticInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM stopped ``gasloc-elastic``; the workers left (see the printed checkpoints)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def end_grace_s(progress: dict[str, Any], elastic: Any, *, max_steps: int) -> float:
    """How long after the first worker finished the run a worker with this progress may still run.

    One that trained to the last step holds a final model: it is in the end-of-fit average, or it is handing
    that average to a member that heals from it, which it waits for up to ``elastic.transfer_timeout`` (no
    collective follows that heal). Stopping it at ``end_grace_s`` would kill the holder of the final model, so
    it gets ``transfer_timeout`` more; its own deadlines end that wait. Any other worker gets ``end_grace_s``.
    """
    trained_to_the_end = (max_steps > 0 and progress.get("state") == "running"
                          and int(progress.get("step") or 0) >= max_steps)  # max_steps -1: no last step to know
    return elastic.end_grace_s + (elastic.transfer_timeout if trained_to_the_end else 0.0)


class ElasticRun:
    """Starts the lighthouse and the workers, runs the chaos schedule, and stops all of it by pid.

    Args:
        cfg: the composed ``gasloc-elastic`` config.
        on_poll: called with this run at every poll of :meth:`watch` (e.g. to sample :meth:`live_pids`).
        placement: where the lighthouse and the workers run (default: here, on ``elastic.bind``).
    """

    def __init__(self, cfg: DictConfig, on_poll: Callable[[ElasticRun], None] | None = None,
                 placement: ProcessPlacement | None = None) -> None:
        self.cfg = cfg
        self.elastic = cfg.elastic
        self.run_dir = Path(cfg.output_dir)
        self.endpoint = launcher_endpoint(self.elastic)
        self.events = chaos_schedule(cfg)
        self.lighthouse: subprocess.Popen | None = None
        self.address = self.elastic.lighthouse
        self._lighthouse_port: int | None = None
        self._outage: _LighthouseOutage | None = None  # a lighthouse chaos event in progress
        self.workers: list[WorkerRecord] = []
        self._last_quorum: int | None = None
        self.quorum_history: list[dict[str, Any]] = []  # each change of the quorum size: time_s, step, quorum_size
        self.started_pids: list[int] = []  # every process this launcher started, for the record and for tests
        self._first_finish: float | None = None  # when the first worker finished the run
        self._started = time.monotonic()
        self._on_poll = on_poll
        self.placement = placement
        self._secret_given = bool(os.environ.get(SECRET_ENV))
        self._secret = os.environ.get(SECRET_ENV) or new_secret()  # only ever in the workers' environment
        self.interrupted = False
        self.series = LauncherSeries.for_run(cfg)  # <output_dir>/tensorboard/launcher with logger=tensorboard
        self.live = LiveStatus(max_steps=max(1, int(cfg.trainer.max_steps)), every_s=self.elastic.status_every_s,
                               show=bool(self.elastic.status), on_status=self.series.status)

    def live_pids(self) -> list[int]:
        """The processes this launcher started that are running now: workers, held spares and the lighthouse."""
        processes = [record.process for record in self.workers] + [record.spare for record in self.workers]
        processes.append(self.lighthouse)
        return [process.pid for process in processes if process is not None and process.poll() is None]

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for line in quorum_lines(self.elastic):
            print(line, flush=True)
        print(f"secret: {'from ' + SECRET_ENV if self._secret_given else 'a new one for this run'} "
              "(the workers get it in their environment)", flush=True)
        if self.address is None:
            self._start_lighthouse()
        for worker in range(self.elastic.workers):
            self.workers.append(self._write_worker_config(worker))
        if self.elastic.resume:
            self._find_checkpoints()
        for record in self.workers:
            self._spawn(record, held=True, founder=True)
        self._release_together()
        for record in self.workers:
            self._prepare_spare(record, self.events)

    def _find_checkpoints(self) -> None:
        """``elastic.resume``: each worker with a ``checkpoints/left`` of an earlier run starts from it."""
        for record in self.workers:
            if record.checkpoint.exists():
                record.resume_from = record.checkpoint
                step = record.progress().get("step")
                print(f"worker {record.worker} resumes from {record.checkpoint} (left at step {step})", flush=True)
            else:
                print(f"worker {record.worker}: no {LEAVE_CHECKPOINT}: it joins from a peer", flush=True)
        if not any(record.resume_from for record in self.workers):
            raise FileNotFoundError(f"elastic.resume=true: no worker_<W>/{LEAVE_CHECKPOINT} under {self.run_dir} "
                                    "(give the output_dir of the interrupted run)")

    def _release_together(self) -> None:
        """Start barrier: every first worker builds its trainer, then all are released at once, so the first
        quorum holds all of them (otherwise the first ones ready form it with ``min_workers`` and the rest
        join a round late). A worker that exits while building is released too (and reaped as failed)."""
        deadline = time.monotonic() + self.elastic.timeout_s
        waiting = list(self.workers)
        while waiting:
            waiting = [r for r in waiting if r.spare_building]
            if time.monotonic() > deadline:
                raise TimeoutError(f"gasloc-elastic: workers {[r.worker for r in waiting]} were not ready within "
                                   f"elastic.timeout_s={self.elastic.timeout_s:g}s")
            time.sleep(0.05)
        for record in self.workers:
            self._release_spare(record)

    def _prepare_spare(self, record: WorkerRecord, pending: list[ChaosEvent]) -> None:
        """A worker due to be restarted gets its next process now, held after its imports and set-up, so the
        restart joins at its step instead of seconds later (the seconds of importing torch are not the point)."""
        if record.spare is None and any(e.action == "restart" and e.worker == record.worker for e in pending):
            self._spawn(record, held=True)

    def _start_lighthouse(self) -> None:
        bind = self.endpoint.bind
        port = self._lighthouse_port = self._lighthouse_port or self.elastic.lighthouse_port or free_port(bind)
        command = lighthouse_command(port, min_workers_of(self.elastic), self.elastic.join_timeout_ms,
                                     self.elastic.heartbeat_timeout_ms, bind=bind)
        if self.placement is not None:
            command = self.placement.lighthouse_command(command)
        env = {key: value for key, value in os.environ.items() if key != SECRET_ENV}  # it has no use for it
        # The parent-death signal: a SIGKILLed launcher takes its lighthouse with it. It fires when the thread that
        # started the child ends, and this thread outlives the lighthouse (stop() ends it first).
        self.lighthouse = _start_process(command, self.run_dir / "lighthouse.log", {**env, "RUST_LOG": "info"},
                                         preexec_fn=functools.partial(set_parent_death_signal, os.getpid()))
        self.started_pids.append(self.lighthouse.pid)
        self.address = self.endpoint.address(port)
        local = host_port(_local_address(self.endpoint), port)
        deadline = time.monotonic() + _LIGHTHOUSE_START_S
        reachable = functools.partial(lighthouse_reachable, timeout=0.5) if self.placement is None \
            else self.placement.reachable
        while not reachable(local):
            if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not start on {host_port(bind, port)} "
                                   f"(see {self.run_dir / 'lighthouse.log'})")
            time.sleep(0.1)
        print(f"lighthouse {self.address} bind={host_port(bind, port)} pid={self.lighthouse.pid} "
              f"min_workers={min_workers_of(self.elastic)}", flush=True)

    def _write_worker_config(self, worker: int) -> WorkerRecord:
        output_dir = self.run_dir / f"worker_{worker}"
        output_dir.mkdir(parents=True, exist_ok=True)
        cfg = worker_config(self.cfg, worker, self.address, str(output_dir))
        path = output_dir / "worker_config.yaml"
        OmegaConf.save(cfg, path)
        return WorkerRecord(worker=worker, output_dir=output_dir, config_path=path)

    @property
    def _forks_workers(self) -> bool:
        """Forked from the preloaded server: asked for, here (no placement wraps the command), and on CPU (a fork
        server that had initialised CUDA could not give it to its forks; not measured on a GPU: exec there)."""
        accelerator = str(OmegaConf.select(self.cfg, "trainer.accelerator", default="cpu"))
        return self.placement is None and self.elastic.worker_start == "forkserver" and accelerator == "cpu"

    def _spawn(self, record: WorkerRecord, held: bool = False, founder: bool = False) -> None:
        """Start the worker's next incarnation (``held``: it builds everything, then waits for its release).

        Only the first workers (``founder``) wait ``elastic.first_quorum_delay`` before their first quorum, so all
        of them make it, and only they resume from a checkpoint (``elastic.resume``); a restart asks at once (the
        running workers' next quorum takes it in) and takes a peer's state."""
        record.spawned += 1
        hold_file = record.output_dir / f"release.{record.spawned}"  # its own: the next spare must not take it back
        hold_file.unlink(missing_ok=True)
        env = {**os.environ, "GASLOC_LAUNCHER_PID": str(os.getpid()), "RUST_LOG": "warn",
               "OMP_NUM_THREADS": str(self.elastic.cpu_threads), SECRET_ENV: self._secret}
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # each worker is its own world
            env.pop(key, None)
        if held:
            env[HOLD_FILE_ENV] = str(hold_file)
        arguments = [str(record.config_path)]
        if record.spawned > 1 and OmegaConf.select(self.cfg, "logger.csv.version", default=None) is not None:
            # Lightning's CSVLogger deletes the metrics.csv it finds in its folder: a restart (or a spare) writes
            # its own, csv/incarnation_<k>/metrics.csv, and gasloc-compare reads them all in order
            arguments.append(f"logger.csv.version={CSV_INCARNATION_PREFIX}{record.spawned}")
        if founder:  # the worker config says 0, right for a restart
            arguments.append(f"strategy.first_quorum_delay={self.elastic.first_quorum_delay}")
            if record.resume_from is not None:
                arguments.append(f"ckpt_path={record.resume_from}")
        log_path = record.output_dir / "worker.log"
        if self._forks_workers:
            process: WorkerProcess = start_forked_worker(arguments, log_path, env)
        else:
            command = [sys.executable, "-m", WORKER_MODULE, *arguments]
            if self.placement is not None:
                command = self.placement.worker_command(command, record.worker)
            process = _start_process(command, log_path, env)
        self.started_pids.append(process.pid)
        if held:
            record.spare, record.spare_release = process, hold_file
            return
        self._start_incarnation(record, process)

    def _release_spare(self, record: WorkerRecord) -> None:
        (record.output_dir / "progress.json").unlink(missing_ok=True)
        record.spare_release.touch()
        process, record.spare = record.spare, None
        self._start_incarnation(record, process)

    def _start_incarnation(self, record: WorkerRecord, process: WorkerProcess) -> None:
        record.process = process
        record.incarnations += 1
        record.ended_by, record.leaving, record.exit_code, record.final = None, False, None, {}
        print(f"worker {record.worker} started pid={record.process.pid} (incarnation {record.incarnations})", flush=True)

    # ---------------------------------------------------------------- watch
    def watch(self) -> None:
        """Poll the workers until every one that should finish has exited; fire chaos events on the way.

        A restart of a worker that is still leaving (``term``) waits until it has exited; a kill or term of a worker
        due to restart waits until the restart's spare is built."""
        pending = list(self.events)
        waiting: list[ChaosEvent] = []  # restarts of workers still leaving
        while True:
            step = self.furthest_step()
            while pending and step >= pending[0].step and not self._spare_building(pending[0]):
                event = pending.pop(0)
                if not self._fire(event, step, pending):
                    waiting.append(event)
            self._resume_stalled(step)
            self._restart_lighthouse_when_due()
            self._report_quorum(step)
            self._reap()
            for event in [e for e in waiting if not self.workers[e.worker].running]:
                waiting.remove(event)
                self._fire(event, step, pending)
            self._stop_latecomers()
            if self._on_poll is not None:
                self._on_poll(self)
            # After the reap: once every worker has exited, this look sees their last records (their final val
            # loss), so the last status line is the run's end.
            self.live.update({record.worker: _as_seen(record) for record in self.workers})
            if not any(record.running for record in self.workers):
                if pending or waiting:
                    raise RuntimeError(f"every worker has exited with chaos events left: "
                                       f"{[str(e) for e in waiting + pending]}")
                return
            if time.monotonic() - self._started > self.elastic.timeout_s:
                raise TimeoutError(f"gasloc-elastic: the run exceeded elastic.timeout_s={self.elastic.timeout_s:g}s")
            if self._outage is None and self.lighthouse is not None and self.lighthouse.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with code {self.lighthouse.returncode}")
            time.sleep(_POLL_S)

    # ---------------------------------------------------------------- lighthouse chaos
    def _kill_lighthouse(self, event: ChaosEvent) -> None:
        """SIGKILL the lighthouse; :meth:`_restart_lighthouse_when_due` starts it again on the same address."""
        if self.lighthouse is None or self.lighthouse.poll() is not None:
            print("  the lighthouse is not running: lighthouse event skipped", flush=True)
            return
        self.lighthouse.kill()
        self.lighthouse.wait()
        marks = {record.worker: _log_size(record.output_dir / "worker.log") for record in self.workers}
        self._outage = _LighthouseOutage(event=event, since=time.monotonic(), log_marks=marks)
        print(f"lighthouse killed (pid {self.lighthouse.pid}); it restarts on {self.address} "
              + (f"in {event.seconds:g}s" if event.seconds else "once every running worker waits for it"), flush=True)

    def _restart_lighthouse_when_due(self) -> None:
        """Restart the killed lighthouse on its address once its event's SECONDS have passed, or (no SECONDS) once
        every running worker has logged that it waits for it (a stalled one is not waited for)."""
        outage = self._outage
        if outage is None:
            return
        if outage.event.seconds:
            due = time.monotonic() - outage.since >= outage.event.seconds
        else:
            running = [record for record in self.workers if record.running and not record.stalled]
            due = all(_logged_since(record.output_dir / "worker.log", outage.log_marks.get(record.worker, 0),
                                    DOWN_MARK) for record in running)
        if due:
            self._outage = None
            self._start_lighthouse()
            print(f"lighthouse restarted after {time.monotonic() - outage.since:.1f}s down", flush=True)

    def furthest_step(self) -> int:
        """The furthest training step any running worker has reported."""
        steps = [as_int(record.progress().get("step")) or 0 for record in self.workers if record.running]
        return max(steps, default=0)

    def _spare_building(self, event: ChaosEvent) -> bool:
        """Whether ``event`` kills or ends a worker whose restart's spare is still building: it then waits (and the
        events after it), so that the restart joins at its step however slow the machine is."""
        return event.action in ("kill", "term") and self.workers[event.worker].spare_building

    def _fire(self, event: ChaosEvent, step: int, pending: list[ChaosEvent]) -> bool:
        """Apply ``event``; False if it must wait (a restart of a worker that is still leaving)."""
        self.series.event(f"chaos {event} at step {step}", step)
        if event.action == "lighthouse":
            print(f"chaos {event} at step {step}", flush=True)
            self._kill_lighthouse(event)
            return True
        record = self.workers[event.worker]
        if event.action == "restart" and record.running and record.leaving:
            print(f"chaos {event} at step {step}: waits for worker {event.worker} to leave", flush=True)
            return False
        print(f"chaos {event} at step {step}", flush=True)
        if event.action == "restart":
            self._restart(record, pending)
        elif not record.running:
            print(f"  worker {event.worker} is not running: {event.action} skipped", flush=True)
        elif event.action == "kill":
            self._end(record, "killed", left_at=step)
        elif event.action == "term":
            self._ask_to_leave(record)
        else:
            record.process.send_signal(signal.SIGSTOP)
            if event.until_step is None:
                record.stalled_until = time.monotonic() + event.seconds
            else:
                record.stalled_until_step = event.until_step
        return True

    def _restart(self, record: WorkerRecord, pending: list[ChaosEvent]) -> None:
        if record.running:
            print(f"  worker {record.worker} is still running: restart skipped", flush=True)
            return
        self._reap_one(record)  # it may have exited since the last poll: account for it before its spare replaces it
        if record.spare is not None:
            self._release_spare(record)
        else:
            self._spawn(record)
        self._prepare_spare(record, pending)

    def _ask_to_leave(self, record: WorkerRecord) -> None:
        """SIGTERM (SIGCONT first: a stopped process cannot act on it): the worker finishes its round and leaves."""
        record.process.send_signal(signal.SIGCONT)
        record.process.send_signal(signal.SIGTERM)
        record.stalled_until = record.stalled_until_step = None
        record.leaving = True

    def _end(self, record: WorkerRecord, why: str, left_at: int | None = None) -> None:
        """SIGKILL the worker's running incarnation (``why``: "killed" by chaos or "stopped" by the launcher)."""
        record.ended_by = why
        record.process.kill()
        record.process.wait()
        self._reap_one(record, left_at)

    def _reap(self) -> None:
        for record in self.workers:
            self._reap_one(record)

    def _reap_one(self, record: WorkerRecord, left_at: int | None = None) -> None:
        """Account for an incarnation that has exited (once): its steps, its final progress, its status."""
        if record.process is None or record.exit_code is not None or record.process.poll() is None:
            return
        record.exit_code = record.process.returncode
        progress = record.final = record.progress()
        record.applied += as_int(progress.get("applied")) or 0
        record.joined.append(progress.get("first_step"))
        own_step = as_int(progress.get("step")) or 0
        record.left.append(own_step if left_at is None else left_at)
        record.exit_steps.append(own_step)
        if progress.get("state") == "left":
            where = progress.get("checkpoint") or "no checkpoint: it abandoned its round"
            print(f"worker {record.worker} left at step {own_step} ({where})", flush=True)
        elif record.ended_by is None and record.exit_code != 0:
            print(f"worker {record.worker} failed (exit {record.exit_code}): {progress.get('error')}", flush=True)

    def _resume_stalled(self, step: int) -> None:
        """SIGCONT each stalled worker whose window has ended (``step``: the furthest live worker's)."""
        for record in self.workers:
            timed_out = record.stalled_until is not None and time.monotonic() >= record.stalled_until
            reached = record.stalled_until_step is not None and step >= record.stalled_until_step
            if timed_out or reached:
                if record.running:
                    record.process.send_signal(signal.SIGCONT)
                    print(f"worker {record.worker} resumed (SIGCONT)", flush=True)
                record.stalled_until = record.stalled_until_step = None

    def _report_quorum(self, step: int) -> None:
        sizes = [as_int(record.progress().get("quorum_size")) for record in self.workers if record.running]
        sizes = [size for size in sizes if size]
        if not sizes:
            return
        size = max(sizes)
        if size != self._last_quorum:
            print(f"step {step}: quorum size {size} (live workers {sum(r.running for r in self.workers)})", flush=True)
            self._last_quorum = size
            self.quorum_history.append({"time_s": round(time.monotonic() - self._started, 3), "step": step,
                                        "quorum_size": size})

    def _stop_latecomers(self) -> None:
        """Once a worker has finished the run is over: one still waiting to join would wait for its quorum_timeout,
        and so would one left out of the last quorums (its exchange failed as a peer died): after
        ``elastic.end_grace_s`` it is stopped too, as having outlived the run, not as failed. (A worker that left
        has not finished the run.)"""
        if not any(record.exit_code == 0 and record.final.get("state") == "done" for record in self.workers):
            return
        if self._first_finish is None:
            self._first_finish = time.monotonic()
        since_end_s = time.monotonic() - self._first_finish
        for record in self.workers:
            if not record.running:
                continue
            progress = record.progress()
            late = progress.get("state") in (None, "starting")
            grace_s = end_grace_s(progress, self.elastic, max_steps=int(self.cfg.trainer.max_steps))
            if late or since_end_s > grace_s:
                why = "arrived after the run ended" if late else f"still running {grace_s:g}s after the end"
                print(f"worker {record.worker} {why}: stopped", flush=True)
                self._end(record, "stopped")

    # ---------------------------------------------------------------- stop and report
    def leave(self) -> None:
        """Every running worker leaves: SIGTERM; each finishes its round, leaves the quorum and checkpoints its
        replica. What still runs ``elastic.leave_grace_s`` plus a margin for the checkpoint later is SIGKILLed."""
        leaving = [record for record in self.workers if record.running]
        wait_s = self.elastic.leave_grace_s + _LEAVE_MARGIN_S
        print(f"stopping: workers {[r.worker for r in leaving]} finish their round and leave (up to {wait_s:g}s)",
              flush=True)
        for record in leaving:
            self._ask_to_leave(record)
        deadline = time.monotonic() + wait_s
        while any(record.running for record in leaving) and time.monotonic() < deadline:
            self._reap()
            time.sleep(_POLL_S)
        self._reap()
        for record in leaving:
            if record.running:
                print(f"worker {record.worker} did not leave within {wait_s:g}s: killed", flush=True)
                self._end(record, "stopped")

    def stop(self) -> None:
        """Stop every process this launcher started and that still runs, by pid: the workers and held spares first
        (SIGCONT, SIGTERM, then SIGKILL), the lighthouse last (the workers may still be committing their round).
        The live line and the TensorBoard series are closed after, each on its own: a closed pipe or a full disk
        there must not leave a process running nor skip the run's summary."""
        try:
            running = [record for record in self.workers if record.running]
            for record in running:
                record.ended_by = record.ended_by or "stopped"
            spares = [record.spare for record in self.workers if record.spare is not None]
            terminate([record.process for record in running] + spares, _STOP_GRACE_S)
            self._reap()
            if self.lighthouse is not None:
                terminate([self.lighthouse], _STOP_GRACE_S)
        finally:
            for name, view in (("live status", self.live), ("TensorBoard series", self.series)):
                try:
                    view.close()  # the last status line stays; the summary table prints below it
                except Exception as error:  # noqa: BLE001 - a view's failure must not stop the summary
                    log.warning("closing the %s failed: %r", name, error)

    def clean_up(self) -> None:
        """Remove the launcher's hand-over files (spare releases, their ready marks) and torn progress writes."""
        for record in self.workers:
            for pattern in ("release.*", f"{PROGRESS_FILE}.*.partial"):
                for path in record.output_dir.glob(pattern):
                    path.unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        rows = []
        for record in self.workers:
            final, progress = _final_summary(record.output_dir), record.final
            status = worker_status(record, final.get("val_loss"))
            rows.append({
                "worker": record.worker, "status": status, "exit_code": record.exit_code,
                "incarnations": record.incarnations, "applied_steps": record.applied, "final_step": final.get("step"),
                "joined": record.joined, "left": record.left, "exit_steps": record.exit_steps,
                "val_loss": final.get("val_loss"), "finished": status == "finished",
                "model_checksum": progress.get("model_checksum"), "failed_exchanges": progress.get("failed_exchanges"),
                "failed_collectives": progress.get("failed_collectives"), "checkpoint": progress.get("checkpoint"),
                "final_checkpoint": progress.get("final_checkpoint"),
                "resumed_from": None if record.resume_from is None else str(record.resume_from),
            })
        return {"lighthouse": self.address, "bind": self.endpoint.bind, "chaos": [str(e) for e in self.events],
                "interrupted": self.interrupted, "workers": rows, "pids": self.started_pids,
                "quorum_history": self.quorum_history,
                "models": [{"checksum": g.checksum, "workers": list(g.workers)} for g in model_groups(rows)],
                "lighthouse_pid": None if self.lighthouse is None else self.lighthouse.pid}


@dataclass
class _LighthouseOutage:
    """A lighthouse killed by chaos: when, and how long each worker's log was then (its later lines tell whether
    the worker waits for the lighthouse)."""

    event: ChaosEvent
    since: float
    log_marks: dict[int, int]


def _as_seen(record: WorkerRecord) -> dict[str, Any]:
    """A worker's progress for the live status: one whose process has exited (a kill cannot update its file) is not
    live, whatever its file last said."""
    progress = record.progress()
    if not record.running and progress.get("state") in ("running", "starting"):
        return {**progress, "state": "exited"}
    return progress


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _logged_since(path: Path, offset: int, mark: str) -> bool:
    """Whether ``mark`` appears in the log at ``path`` after byte ``offset``."""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            return mark.encode() in log_file.read()
    except OSError:
        return False


def worker_status(record: WorkerRecord, val_loss: float | None) -> str:
    """How a worker's last incarnation ended: one of :data:`STATUSES`.

    ``finished``: exit 0 with a final validation loss; ``left``: it left after SIGTERM (not a failure); ``killed``: by
    a chaos kill; ``stopped``: by the launcher (it arrived after the run ended, outlived it by ``end_grace_s``,
    did not leave in time, or never started), or it exited 0 without a final validation (it joined as the run
    ended); ``refused``: surplus past ``max_workers``; ``failed``: anything else.
    """
    state = record.final.get("state")
    if state == "left":
        return "left"
    if record.ended_by is not None:
        return record.ended_by
    if record.process is None or record.exit_code is None:
        return "stopped"
    if state == "refused" or record.exit_code == 3:
        return "refused"
    if record.exit_code == 0:
        return "finished" if val_loss is not None else "stopped"
    return "failed"


def _final_summary(output_dir: Path) -> dict[str, Any]:
    try:
        summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return summary.get("final", {})


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'worker':>6} {'status':>8} {'exit':>5} {'applied':>8} {'final_step':>10} {'joined':>12} {'left':>12} "
          f"{'val_loss':>9} {'failed x/c':>10}")
    for row in summary["workers"]:
        loss = "-" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        failed = f"{dash(row['failed_exchanges'])}/{dash(row['failed_collectives'])}"
        print(f"{row['worker']:>6} {row['status']:>8} {str(row['exit_code']):>5} {row['applied_steps']:>8} "
              f"{str(row['final_step']):>10} {','.join(map(str, row['joined'])):>12} "
              f"{','.join(map(str, row['left'])):>12} {loss:>9} {failed:>10}", flush=True)


# ------------------------------------------------------------------ worker configs
_GASLOC_KEYS = ("inner_steps", "outer_lr", "outer_momentum", "outer_form", "seed", "consensus_every",
                "bucket_cap_mb", "on_nonfinite", "max_skipped_rounds")
_DILOCO_KEYS = ("message_codec", "overlap", "fragments", "fragment_sync_delay", "fragment_update_alpha")


def worker_config(cfg: DictConfig, worker: int, lighthouse: str, output_dir: str) -> DictConfig:
    """The fully resolved config of worker ``worker``: the composed run with an elastic strategy node,
    one device, and data shard ``worker`` of ``elastic.workers``. It holds no secret."""
    elastic = cfg.elastic
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("elastic")
    run = OmegaConf.create(plain)
    run.output_dir = output_dir
    run = OmegaConf.create(OmegaConf.to_container(run, resolve=True))
    if tensorboard_nodes(run):  # one TensorBoard for the whole run; output_dir is read only then (it may be unset)
        place_worker_tensorboard(run, run_dir=cfg.output_dir, worker=worker)
    strategy = {key: run.strategy[key] for key in _GASLOC_KEYS if key in run.strategy}
    topology = run.strategy.get("topology", run.topology)
    if is_two_level(topology):  # its regions' list is indexed by worker id: scaled to the launched workers
        strategy["_target_"] = "gasloc_lightning.strategies.elastic_two_level.ElasticTwoLevelStrategy"
        strategy["topology"] = two_level_node(topology, elastic.workers)
        strategy.pop("outer_form", None)  # the region step is DiLoCo's, the crossing anchored
        if strategy.get("outer_momentum") is None:
            strategy.pop("outer_momentum", None)  # DiLoCo's 0.9 inside a region
    elif elastic.method == "gasloc":
        strategy["_target_"] = "gasloc_lightning.strategies.elastic.ElasticGASLoCStrategy"
        strategy["topology"] = topology
    else:
        strategy["_target_"] = "gasloc_lightning.strategies.elastic.ElasticDiLoCoStrategy"
        if strategy.get("outer_momentum") is None:
            strategy.pop("outer_momentum", None)  # DiLoCo's 0.9
        if str(run.strategy.get("_target_", "")).endswith("DiLoCoStrategy"):  # strategy=diloco: its codec and
            # overlap apply (quantized mean), and what the elastic DiLoCo cannot run is refused, not dropped
            strategy.update({key: run.strategy[key] for key in _DILOCO_KEYS if key in run.strategy})
    strategy.update(
        lighthouse=lighthouse, worker_id=worker, min_workers=min_workers_of(elastic),
        max_workers=max_workers_of(elastic), allow_split_quorum=bool(elastic.allow_split_quorum),
        connect_timeout=elastic.connect_timeout,
        quorum_timeout=elastic.quorum_timeout, gossip_timeout=elastic.gossip_timeout,
        transfer_timeout=elastic.transfer_timeout, first_quorum_delay=0.0, cpu_threads=elastic.cpu_threads,
        bind=elastic.bind, advertise=elastic.advertise, leave_grace_s=elastic.leave_grace_s,
        lighthouse_timeout=elastic.lighthouse_timeout, lighthouse_wait=elastic.lighthouse_wait,
        member_auth=elastic.member_auth, message_auth=elastic.message_auth,
    )
    run.strategy = strategy
    run.trainer.devices = 1
    run.trainer.num_nodes = 1
    run.data.rank, run.data.world_size = worker, elastic.workers
    if run.data.get("_target_") == "gasloc_lightning.data.ByteDataModule":
        run.data._target_ = "gasloc_lightning.app.elastic_worker.SharedValidationData"
    return run


def is_two_level(topology: Any) -> bool:
    """Whether a topology node builds a two-level topology (``topology=two_level`` or ``hierarchical``)."""
    return hasattr(topology, "get") and str(topology.get("_target_", "")).startswith(
        "gasloc_lightning.topology.regions.TwoLevelTopology")


def two_level_node(topology: Any, workers: int) -> dict[str, Any]:
    """A two-level topology node for the workers: regions from a clustered network's sizes are scaled to the launched
    workers (the list is indexed by worker id), not to ``trainer.devices``."""
    node = dict(OmegaConf.to_container(topology, resolve=True) if isinstance(topology, DictConfig) else topology)
    if node.get("sizes"):
        node["scale_to"] = workers
    return node


def chaos_schedule(cfg: DictConfig) -> list[ChaosEvent]:
    """``elastic.chaos`` and the ``elastic.random_chaos`` seeded events, in firing order."""
    elastic = cfg.elastic
    drawn = random_chaos(elastic.random_chaos, elastic.workers, cfg.trainer.max_steps, min_workers_of(elastic),
                         elastic.chaos_seed)
    return sorted([*parse_chaos(list(elastic.chaos), elastic.workers), *drawn], key=lambda event: event.step)


def max_workers_of(elastic: DictConfig) -> int:
    """The most workers the run allows: ``elastic.max_workers``, else ``elastic.workers``."""
    return elastic.max_workers or elastic.workers


def min_workers_of(elastic: DictConfig) -> int:
    """``elastic.min_workers``, or a majority of :func:`max_workers_of` when unset (``null``); a smaller one is refused
    without ``elastic.allow_split_quorum`` (see :mod:`gasloc_lightning.comm.quorum_floor`)."""
    return quorum_floor(elastic.min_workers, max_workers_of(elastic), allow_split_quorum=elastic.allow_split_quorum,
                        prefix="elastic.")


def quorum_lines(elastic: DictConfig) -> list[str]:
    """What the run's quorum floor is and why, as the launcher prints it (a warning first, when it can split)."""
    floor, allowed = min_workers_of(elastic), max_workers_of(elastic)
    workers = f"{allowed} workers" if allowed == elastic.workers else f"elastic.max_workers={allowed}"
    if is_split_quorum(floor, allowed):
        return [f"warning: {split_warning(floor, allowed, prefix='elastic.')}",
                f"quorum: min_workers={floor}, NOT a majority of {workers}"]
    how = "a majority" if elastic.min_workers is None else "at least a majority"
    return [f"quorum: min_workers={floor}, {how} of {workers} (one side of a partition trains, the other waits)"]


def check_elastic(cfg: DictConfig) -> None:
    """Refuse elastic settings that cannot work, naming the key."""
    elastic = cfg.elastic
    if elastic.method not in ("gasloc", "diloco"):
        raise ValueError(f"elastic.method must be 'gasloc' or 'diloco', got {elastic.method!r}")
    if elastic.worker_start not in WORKER_STARTS:
        raise ValueError(f"elastic.worker_start must be one of {WORKER_STARTS}, got {elastic.worker_start!r}")
    if elastic.workers < 1:
        raise ValueError(f"elastic.workers must be >= 1, got {elastic.workers}")
    if not elastic.status_every_s > 0:
        raise ValueError(f"elastic.status_every_s must be > 0, got {elastic.status_every_s}")
    if elastic.max_workers is not None and elastic.max_workers < elastic.workers:
        raise ValueError(f"elastic.max_workers={elastic.max_workers} is below elastic.workers={elastic.workers}: the "
                         "surplus workers would be refused at their first quorum")
    min_workers = min_workers_of(elastic)
    if min_workers > elastic.workers:
        why = f" (a majority of elastic.max_workers={elastic.max_workers})" if elastic.min_workers is None else ""
        raise ValueError(f"elastic.min_workers={min_workers}{why} exceeds elastic.workers={elastic.workers}: no quorum "
                         "could form; start more workers or lower elastic.max_workers")
    if elastic.leave_grace_s < 0:
        raise ValueError(f"elastic.leave_grace_s must be >= 0 seconds, got {elastic.leave_grace_s:g}")
    if elastic.lighthouse is None and not elastic.join_timeout_ms > 1000 * elastic.gossip_timeout:
        raise ValueError(
            f"elastic.join_timeout_ms={elastic.join_timeout_ms} must exceed elastic.gossip_timeout="
            f"{elastic.gossip_timeout:g}s: a worker whose exchange or all-reduce with a dead peer times out asks "
            "for the next quorum up to gossip_timeout after the others, and the lighthouse would form it without it"
        )
    launcher_endpoint(elastic)
    for key in ("lighthouse_timeout", "lighthouse_wait"):
        if not elastic[key] > 0:
            raise ValueError(f"elastic.{key} must be > 0 seconds, got {elastic[key]}")
    if elastic.lighthouse is not None and any(event.action == "lighthouse" for event in chaos_schedule(cfg)):
        raise ValueError("elastic.chaos: lighthouse@STEP needs the lighthouse the launcher starts (elastic.lighthouse="
                         f"{elastic.lighthouse!r} is not)")
    target = cfg.strategy.get("_target_", "").rsplit(".", 1)[-1]
    if target not in ("GASLoCStrategy", "DiLoCoStrategy", "TwoLevelStrategy"):
        raise ValueError("gasloc-elastic builds its strategy from strategy=gasloc, diloco or two_level settings")
    topology = cfg.strategy.get("topology", cfg.get("topology"))
    two_level = is_two_level(topology)
    if (target == "TwoLevelStrategy" or two_level) and (elastic.method != "gasloc" or not two_level
                                                        or target == "DiLoCoStrategy"):
        raise ValueError("the two-level round in gasloc-elastic: topology=two_level or hierarchical with "
                         f"strategy=gasloc or two_level and elastic.method=gasloc (got strategy {target}, "
                         f"elastic.method={elastic.method!r}, topology {'two-level' if two_level else 'not two-level'})")
    if two_level:  # its regions: checked here, not in every worker
        try:
            instantiate(two_level_node(topology, elastic.workers))
        except Exception as error:  # noqa: BLE001 - Hydra wraps the topology's own error
            raise ValueError(f"topology: {getattr(error, '__cause__', None) or error}") from None
    chaos_schedule(cfg)


# ------------------------------------------------------------------ entry point
class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


def run_elastic(cfg: DictConfig, on_poll: Callable[[ElasticRun], None] | None = None,
                placement: ProcessPlacement | None = None) -> dict[str, Any]:
    """Run a composed ``gasloc-elastic`` config to the end; returns (and writes) the per-worker summary.

    Args:
        cfg: the composed config (``elastic/app``).
        on_poll: called with the :class:`ElasticRun` at every poll while the workers run.
        placement: where the lighthouse and the workers run (default: here; see :class:`ProcessPlacement`).

    Raises:
        ElasticInterrupted: Ctrl-C or SIGTERM (in the main thread): the workers left, each with its checkpoint.
        RuntimeError: a worker failed or was refused (named, with its error).
        SplitRunError: the finished workers ended on more than one model (each named, and the merge command).
    """
    check_choices(cfg)
    check_budget(cfg.trainer)
    check_elastic(cfg)
    run = ElasticRun(cfg, on_poll=on_poll, placement=placement)
    signum: int | None = None
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        try:
            run.start()
            run.watch()
        except (_Terminated, KeyboardInterrupt) as error:
            signum = signal.SIGTERM if isinstance(error, _Terminated) else signal.SIGINT
            run.interrupted = True
            try:
                run.leave()
            except (_Terminated, KeyboardInterrupt):
                print("a second signal: stopping the workers now", flush=True)
    finally:
        run.stop()
        stop_fork_server()  # its workers are stopped: a later run forks from a server with the code of its time
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        run.clean_up()
        summary = run.summary()
        (run.run_dir / ELASTIC_SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    if signum is not None:
        _print_resume(summary, run.run_dir)
        raise ElasticInterrupted(signum, f"gasloc-elastic: interrupted by {signal.Signals(signum).name}; the workers "
                                         f"left (resume with elastic.resume=true output_dir={run.run_dir})")
    raise_if_failed(run, summary)
    raise_if_split(summary, run.run_dir, prefix="gasloc-elastic: ")
    return summary


def raise_if_failed(run: ElasticRun, summary: dict[str, Any], prefix: str = "gasloc-elastic: ") -> None:
    """A worker that failed or was refused fails the run, with each one's error (one that left, was killed by chaos
    or was stopped by the launcher does not); ``prefix`` starts the message."""
    failed = [row["worker"] for row in summary["workers"] if row["status"] in ("failed", "refused")]
    if failed:
        errors = "; ".join(f"worker {worker}: {_recorded_error(run.workers[worker])}" for worker in failed)
        raise RuntimeError(f"{prefix}worker(s) {failed} failed ({errors}); see their worker.log under {run.run_dir}")


def _recorded_error(record: WorkerRecord) -> str:
    """The error a worker recorded in its progress file, or what is known when it died before recording one."""
    error = (record.final or {}).get("error")
    if error:
        return str(error)
    code = record.exit_code
    if isinstance(code, int) and code < 0:
        return f"killed by {signal.Signals(-code).name} before it recorded an error (see its worker.log)"
    return (f"exit code {code} before it recorded an error (see its worker.log; if it has none, the launcher's own "
            "output: a script that calls run_elastic needs an `if __name__ == '__main__':` guard, as with any "
            "multiprocessing start other than fork)")


def _print_resume(summary: dict[str, Any], run_dir: Path) -> None:
    """Where each worker's checkpoint is, and the command that resumes the run from them."""
    print("interrupted: the workers left; their checkpoints:", flush=True)
    for row in summary["workers"]:
        where = row["checkpoint"] or f"none ({row['status']}: it joins from a peer on resume)"
        print(f"  worker {row['worker']}: {where}", flush=True)
    # without the chaos schedule: its steps are behind the resumed workers, so every event would fire at once
    overrides = [o for o in _task_overrides()
                 if not o.lstrip("+~").startswith(("output_dir=", "elastic.resume=", "elastic.chaos=",
                                                   "elastic.random_chaos="))]
    command = shlex.join(["gasloc-elastic", *overrides, f"output_dir={run_dir}", "elastic.resume=true"])
    print(f"resume with: {command}", flush=True)


def _task_overrides() -> list[str]:
    """The command line's overrides (none when the config was composed in-process)."""
    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="elastic/app")
def main(cfg: DictConfig) -> None:
    """Console entry point ``gasloc-elastic`` (exit status 128 + the signal's number when interrupted; 3 when the
    run ended on more than one model)."""
    try:
        run_elastic(cfg)
    except SplitRunError as split:
        print(split, file=sys.stderr, flush=True)
        raise SystemExit(SPLIT_EXIT_CODE) from None
    except ElasticInterrupted as interrupted:
        print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(128 + interrupted.signum) from None


if __name__ == "__main__":
    main()
