"""``gasloc-elastic``: a local launcher of elastic GASLoC for demos and tests.

Usage::

    gasloc-elastic experiment=demo elastic.workers=4 'elastic.chaos=[kill:2@40]'
    gasloc-elastic experiment=demo 'elastic.chaos=[kill:2@30,restart:2@50,stall:1@60:5]'
    gasloc-elastic experiment=demo elastic.method=diloco        # DiLoCo on the same engine

It composes the same config as ``gasloc-train`` plus the ``elastic`` group (``conf/elastic/default.yaml``),
starts a torchft lighthouse (unless ``elastic.lighthouse=HOST:PORT``), starts ``elastic.workers`` worker
processes (:mod:`gasloc_lightning.app.elastic_worker`, one folder ``<run dir>/worker_<W>/`` each, with
the usual ``summary.json``), runs the chaos schedule against the workers' progress, prints a line
whenever the quorum size changes and a table at the end, and writes ``elastic_summary.json``.

Everything it starts is stopped by pid when it ends, fails, or gets Ctrl-C / SIGTERM; the workers
also exit by themselves if the launcher is killed (:func:`~gasloc_lightning.strategies.launcher.exit_with_parent`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from gasloc_lightning.app.config import TrainSchema, check_choices, config_dir
from gasloc_lightning.app.elastic_worker import HOLD_FILE_ENV, read_progress, ready_file
from gasloc_lightning.app.summary import SUMMARY_FILE
from gasloc_lightning.app.train import check_budget
from gasloc_lightning.comm.membership import lighthouse_reachable

log = logging.getLogger(__name__)

ELASTIC_SUMMARY_FILE = "elastic_summary.json"
_STOP_GRACE_S = 5.0
_POLL_S = 0.2


@dataclass
class ElasticSchema:
    """The ``elastic`` node (documented in ``conf/elastic/default.yaml``)."""

    workers: int = 4
    method: str = "gasloc"
    lighthouse: str | None = None
    lighthouse_port: int | None = None
    min_workers: int = 2
    max_workers: int | None = None
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
    end_grace_s: float = 30.0
    timeout_s: float = 1800.0


@dataclass
class ElasticAppSchema(TrainSchema):
    elastic: ElasticSchema = field(default_factory=ElasticSchema)


ConfigStore.instance().store(group="schema", name="elastic_app", node=ElasticAppSchema)


# ------------------------------------------------------------------ chaos schedule
@dataclass(frozen=True)
class ChaosEvent:
    """``kill:W@STEP``, ``restart:W@STEP`` or ``stall:W@STEP:SECONDS``; STEP is the furthest live worker's step."""

    action: str
    worker: int
    step: int
    seconds: float = 0.0

    def __str__(self) -> str:
        suffix = f":{self.seconds:g}" if self.action == "stall" else ""
        return f"{self.action}:{self.worker}@{self.step}{suffix}"


_EVENT = re.compile(r"^(kill|restart|stall):(\d+)@(\d+)(?::(\d+(?:\.\d+)?))?$")


def parse_chaos(entries: list[str], workers: int) -> list[ChaosEvent]:
    """Parse and check a chaos schedule (sorted by step, in the given order within a step)."""
    events = []
    for entry in entries:
        match = _EVENT.match(str(entry).strip())
        if match is None:
            raise ValueError(f"elastic.chaos entry {entry!r}: expected kill:W@STEP, restart:W@STEP or stall:W@STEP:SECONDS")
        action, worker, step, seconds = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if worker >= workers:
            raise ValueError(f"elastic.chaos entry {entry!r}: worker {worker} does not exist (elastic.workers={workers})")
        if (action == "stall") != (seconds is not None):
            raise ValueError(f"elastic.chaos entry {entry!r}: only stall takes :SECONDS, and it needs it")
        events.append(ChaosEvent(action, worker, step, float(seconds or 0.0)))
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


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def lighthouse_command(port: int, min_workers: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> list[str]:
    """The ``torchft_lighthouse`` command line (the CLI next to this Python, else on PATH)."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    binary = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    if binary is None:
        raise RuntimeError("torchft_lighthouse not found: install the elastic extra (pip install 'gasloc-lightning[elastic]')")
    return [binary, "--bind", f"[::]:{port}", "--min_replicas", str(min_workers), "--join_timeout_ms",
            str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--quorum_tick_ms", "50"]


@dataclass
class WorkerRecord:
    """One worker slot across its incarnations (the launcher's view)."""

    worker: int
    output_dir: Path
    config_path: Path
    process: subprocess.Popen | None = None
    incarnations: int = 0
    applied: int = 0  # steps computed by earlier incarnations
    joined: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    exit_steps: list[int] = field(default_factory=list)  # each incarnation's own step when it ended
    stalled_until: float | None = None
    spare: subprocess.Popen | None = None  # the next incarnation, started ahead and held until its restart
    spare_release: Path | None = None  # the file whose creation releases the spare
    spawned: int = 0  # processes started for this slot (spares included)
    killed: bool = False
    exit_code: int | None = None

    def progress(self) -> dict[str, Any]:
        return read_progress(self.output_dir) or {}

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class ElasticRun:
    """Starts the lighthouse and the workers, runs the chaos schedule, and stops all of it by pid.

    Args:
        cfg: the composed ``gasloc-elastic`` config.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.elastic = cfg.elastic
        self.run_dir = Path(cfg.output_dir)
        self.events = chaos_schedule(cfg)
        self.lighthouse: subprocess.Popen | None = None
        self.address = self.elastic.lighthouse
        self.workers: list[WorkerRecord] = []
        self._last_quorum: int | None = None
        self.started_pids: list[int] = []  # every process this launcher started, for the record and for tests
        self._first_finish: float | None = None  # when the first worker finished the run
        self._started = time.monotonic()

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.address is None:
            self._start_lighthouse()
        for worker in range(self.elastic.workers):
            record = self._write_worker_config(worker)
            self.workers.append(record)
            self._spawn(record, held=True, founder=True)
        self._release_together()
        for record in self.workers:
            self._prepare_spare(record, self.events)

    def _release_together(self) -> None:
        """Start barrier: every first worker builds its trainer, then all are released at once, so the first
        quorum holds all of them (otherwise the first ones ready form it with ``min_workers`` and the rest
        join a round late). A worker that exits while building is released too (and reaped as failed)."""
        deadline = time.monotonic() + self.elastic.timeout_s
        waiting = list(self.workers)
        while waiting:
            waiting = [r for r in waiting if r.spare.poll() is None and not ready_file(r.spare_release).exists()]
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
        port = self.elastic.lighthouse_port or free_port()
        command = lighthouse_command(port, self.elastic.min_workers, self.elastic.join_timeout_ms,
                                     self.elastic.heartbeat_timeout_ms)
        log_file = open(self.run_dir / "lighthouse.log", "ab")
        self.lighthouse = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                           env={**os.environ, "RUST_LOG": "info"}, start_new_session=True)
        self.started_pids.append(self.lighthouse.pid)
        self.address = f"{socket.gethostname()}:{port}"
        deadline = time.monotonic() + 10.0
        while not lighthouse_reachable(self.address, timeout=0.5):
            if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not start on port {port} (see {self.run_dir / 'lighthouse.log'})")
            time.sleep(0.1)
        print(f"lighthouse {self.address} pid={self.lighthouse.pid} min_workers={self.elastic.min_workers}", flush=True)

    def _write_worker_config(self, worker: int) -> WorkerRecord:
        output_dir = self.run_dir / f"worker_{worker}"
        output_dir.mkdir(parents=True, exist_ok=True)
        cfg = worker_config(self.cfg, worker, self.address, str(output_dir))
        path = output_dir / "worker_config.yaml"
        OmegaConf.save(cfg, path)
        return WorkerRecord(worker=worker, output_dir=output_dir, config_path=path)

    def _spawn(self, record: WorkerRecord, held: bool = False, founder: bool = False) -> None:
        """Start the worker's next incarnation (``held``: it builds everything, then waits for its release).

        Only the first workers (``founder``) wait ``elastic.first_quorum_delay`` before their first quorum, so all
        of them make it; a restart asks at once (the running workers' next quorum takes it in)."""
        record.spawned += 1
        hold_file = record.output_dir / f"release.{record.spawned}"  # its own: the next spare must not take it back
        hold_file.unlink(missing_ok=True)
        env = {**os.environ, "GASLOC_LAUNCHER_PID": str(os.getpid()), "RUST_LOG": "warn",
               "OMP_NUM_THREADS": str(self.elastic.cpu_threads)}
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # each worker is its own world
            env.pop(key, None)
        if held:
            env[HOLD_FILE_ENV] = str(hold_file)
        log_file = open(record.output_dir / "worker.log", "ab")
        command = [sys.executable, "-m", "gasloc_lightning.app.elastic_worker", str(record.config_path)]
        if founder:  # the worker config says 0, right for a restart
            command.append(f"strategy.first_quorum_delay={self.elastic.first_quorum_delay}")
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
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

    def _start_incarnation(self, record: WorkerRecord, process: subprocess.Popen) -> None:
        record.process = process
        record.incarnations += 1
        record.killed = False
        record.exit_code = None
        print(f"worker {record.worker} started pid={record.process.pid} (incarnation {record.incarnations})", flush=True)

    # ---------------------------------------------------------------- watch
    def watch(self) -> None:
        """Poll the workers until every one that should finish has exited; fire chaos events on the way."""
        pending = list(self.events)
        while True:
            step = self._furthest_step()
            while pending and step >= pending[0].step:
                self._fire(pending.pop(0), step, pending)
            self._resume_stalled()
            self._report_quorum(step)
            self._reap()
            self._stop_latecomers()
            if not any(record.running for record in self.workers) and not pending:
                self._reap()
                return
            if not any(record.running for record in self.workers) and pending:
                raise RuntimeError(f"every worker has exited with chaos events left: {[str(e) for e in pending]}")
            if time.monotonic() - self._started > self.elastic.timeout_s:
                raise TimeoutError(f"gasloc-elastic: the run exceeded elastic.timeout_s={self.elastic.timeout_s:g}s")
            if self.lighthouse is not None and self.lighthouse.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with code {self.lighthouse.returncode}")
            time.sleep(_POLL_S)

    def _furthest_step(self) -> int:
        steps = [record.progress().get("step") or 0 for record in self.workers if record.running]
        return max(steps, default=0)

    def _fire(self, event: ChaosEvent, step: int, pending: list[ChaosEvent]) -> None:
        record = self.workers[event.worker]
        print(f"chaos {event} at step {step}", flush=True)
        if event.action == "restart":
            if record.running:
                print(f"  worker {event.worker} is still running: restart skipped", flush=True)
                return
            if record.spare is not None:
                self._release_spare(record)
            else:
                self._spawn(record)
            self._prepare_spare(record, pending)
            return
        if not record.running:
            print(f"  worker {event.worker} is not running: {event.action} skipped", flush=True)
            return
        if event.action == "kill":
            self._account_exit(record, step)
            record.killed = True
            record.process.send_signal(signal.SIGKILL)
            record.process.wait()
        else:
            record.process.send_signal(signal.SIGSTOP)
            record.stalled_until = time.monotonic() + event.seconds

    def _account_exit(self, record: WorkerRecord, step: int) -> None:
        progress = record.progress()
        record.applied += int(progress.get("applied") or 0)
        record.joined.append(progress.get("first_step"))
        record.left.append(step)
        record.exit_steps.append(int(progress.get("step") or 0))

    def _resume_stalled(self) -> None:
        for record in self.workers:
            if record.stalled_until is not None and time.monotonic() >= record.stalled_until:
                if record.running:
                    record.process.send_signal(signal.SIGCONT)
                    print(f"worker {record.worker} resumed (SIGCONT)", flush=True)
                record.stalled_until = None

    def _report_quorum(self, step: int) -> None:
        sizes = [record.progress().get("quorum_size") for record in self.workers if record.running]
        sizes = [size for size in sizes if size]
        if not sizes:
            return
        size = max(sizes)
        if size != self._last_quorum:
            print(f"step {step}: quorum size {size} (live workers {sum(r.running for r in self.workers)})", flush=True)
            self._last_quorum = size

    def _reap(self) -> None:
        for record in self.workers:
            if record.process is None or record.exit_code is not None or record.process.poll() is None:
                continue
            record.exit_code = record.process.returncode
            if not record.killed:
                progress = record.progress()
                self._account_exit(record, int(progress.get("step") or 0))
                if record.exit_code != 0:
                    print(f"worker {record.worker} failed (exit {record.exit_code}): {progress.get('error')}", flush=True)

    def _stop_latecomers(self) -> None:
        """Once a worker has finished the run is over: one still waiting to join would wait for its quorum_timeout,
        and so would one left out of the last quorums (its exchange failed as a peer died): after
        ``elastic.end_grace_s`` it is stopped too, as having outlived the run, not as failed."""
        if not any(record.exit_code == 0 for record in self.workers):
            return
        if self._first_finish is None:
            self._first_finish = time.monotonic()
        overdue = time.monotonic() - self._first_finish > self.elastic.end_grace_s
        for record in self.workers:
            if not record.running:
                continue
            late = record.progress().get("state") in (None, "starting")
            if late or overdue:
                why = "arrived after the run ended" if late else f"still running {self.elastic.end_grace_s:g}s after the end"
                print(f"worker {record.worker} {why}: stopped", flush=True)
                record.killed = True
                record.process.kill()
                record.process.wait()
                self._account_exit(record, int(record.progress().get("step") or 0))
                record.exit_code = record.process.returncode

    # ---------------------------------------------------------------- stop and report
    def stop(self) -> None:
        """Stop every process this launcher started and that still runs: SIGCONT, SIGTERM, then SIGKILL."""
        processes = [record.process for record in self.workers if record.running]
        processes += [record.spare for record in self.workers if record.spare is not None and record.spare.poll() is None]
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            processes.append(self.lighthouse)
        for process in processes:
            process.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def summary(self) -> dict[str, Any]:
        rows = []
        for record in self.workers:
            final = _final_summary(record.output_dir)
            rows.append({
                "worker": record.worker, "exit_code": record.exit_code, "incarnations": record.incarnations,
                "applied_steps": record.applied, "final_step": final.get("step"), "joined": record.joined,
                "left": record.left, "exit_steps": record.exit_steps, "val_loss": final.get("val_loss"),
                # ran to the end and validated (a restart that arrived as the run ended exits 0 without a loss)
                "finished": record.exit_code == 0 and final.get("val_loss") is not None,
            })
        return {"lighthouse": self.address, "chaos": [str(e) for e in self.events], "workers": rows,
                "pids": self.started_pids}


def _final_summary(output_dir: Path) -> dict[str, Any]:
    try:
        summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return summary.get("final", {})


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'worker':>6} {'exit':>5} {'applied':>8} {'final_step':>10} {'joined':>12} {'left':>12} {'val_loss':>9}")
    for row in summary["workers"]:
        loss = "-" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        print(f"{row['worker']:>6} {str(row['exit_code']):>5} {row['applied_steps']:>8} {str(row['final_step']):>10} "
              f"{','.join(map(str, row['joined'])):>12} {','.join(map(str, row['left'])):>12} {loss:>9}", flush=True)


# ------------------------------------------------------------------ worker configs
_GASLOC_KEYS = ("inner_steps", "outer_lr", "outer_momentum", "outer_form", "seed", "consensus_every",
                "bucket_cap_mb", "on_nonfinite", "max_skipped_rounds")


def worker_config(cfg: DictConfig, worker: int, lighthouse: str, output_dir: str) -> DictConfig:
    """The fully resolved config of worker ``worker``: the composed run with an elastic strategy node,
    one device, and data shard ``worker`` of ``elastic.workers``."""
    elastic = cfg.elastic
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("elastic")
    run = OmegaConf.create(plain)
    run.output_dir = output_dir
    run = OmegaConf.create(OmegaConf.to_container(run, resolve=True))
    strategy = {key: run.strategy[key] for key in _GASLOC_KEYS if key in run.strategy}
    if elastic.method == "gasloc":
        strategy["_target_"] = "gasloc_lightning.strategies.elastic.ElasticGASLoCStrategy"
        strategy["topology"] = run.strategy.get("topology", run.topology)
    else:
        strategy["_target_"] = "gasloc_lightning.strategies.elastic.ElasticDiLoCoStrategy"
        if strategy.get("outer_momentum") is None:
            strategy.pop("outer_momentum", None)  # DiLoCo's 0.9
    strategy.update(
        lighthouse=lighthouse, worker_id=worker, min_workers=elastic.min_workers,
        max_workers=elastic.max_workers or elastic.workers, connect_timeout=elastic.connect_timeout,
        quorum_timeout=elastic.quorum_timeout, gossip_timeout=elastic.gossip_timeout,
        transfer_timeout=elastic.transfer_timeout, first_quorum_delay=0.0, cpu_threads=elastic.cpu_threads,
    )
    run.strategy = strategy
    run.trainer.devices = 1
    run.trainer.num_nodes = 1
    run.data.rank, run.data.world_size = worker, elastic.workers
    if run.data.get("_target_") == "gasloc_lightning.data.ByteDataModule":
        run.data._target_ = "gasloc_lightning.app.elastic_worker.SharedValidationData"
    return run


def chaos_schedule(cfg: DictConfig) -> list[ChaosEvent]:
    """``elastic.chaos`` and the ``elastic.random_chaos`` seeded events, in firing order."""
    elastic = cfg.elastic
    drawn = random_chaos(elastic.random_chaos, elastic.workers, cfg.trainer.max_steps, elastic.min_workers,
                         elastic.chaos_seed)
    return sorted([*parse_chaos(list(elastic.chaos), elastic.workers), *drawn], key=lambda event: event.step)


def check_elastic(cfg: DictConfig) -> None:
    """Refuse elastic settings that cannot work, naming the key."""
    elastic = cfg.elastic
    if elastic.method not in ("gasloc", "diloco"):
        raise ValueError(f"elastic.method must be 'gasloc' or 'diloco', got {elastic.method!r}")
    if elastic.workers < 1:
        raise ValueError(f"elastic.workers must be >= 1, got {elastic.workers}")
    if not 1 <= elastic.min_workers <= elastic.workers:
        raise ValueError(f"elastic.min_workers must lie in [1, elastic.workers={elastic.workers}], got {elastic.min_workers}")
    if elastic.lighthouse is None and not elastic.join_timeout_ms > 1000 * elastic.gossip_timeout:
        raise ValueError(
            f"elastic.join_timeout_ms={elastic.join_timeout_ms} must exceed elastic.gossip_timeout="
            f"{elastic.gossip_timeout:g}s: a worker whose exchange or all-reduce with a dead peer times out asks "
            "for the next quorum up to gossip_timeout after the others, and the lighthouse would form it without it"
        )
    if cfg.strategy.get("_target_", "").rsplit(".", 1)[-1] not in ("GASLoCStrategy", "DiLoCoStrategy"):
        raise ValueError("gasloc-elastic builds its strategy from strategy=gasloc or strategy=diloco settings")
    chaos_schedule(cfg)


# ------------------------------------------------------------------ entry point
class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


def run_elastic(cfg: DictConfig) -> dict[str, Any]:
    """Run a composed ``gasloc-elastic`` config to the end; returns (and writes) the per-worker summary."""
    check_choices(cfg)
    check_budget(cfg.trainer)
    check_elastic(cfg)
    run = ElasticRun(cfg)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        run.start()
        run.watch()
    finally:
        run.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary = run.summary()
    (run.run_dir / ELASTIC_SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    failed = [r.worker for r in run.workers if r.exit_code not in (0, None) and not r.killed]
    if failed:
        raise RuntimeError(f"gasloc-elastic: worker(s) {failed} failed; see their worker.log under {run.run_dir}")
    return summary


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="elastic/app")
def main(cfg: DictConfig) -> None:
    """Console entry point ``gasloc-elastic``."""
    run_elastic(cfg)


if __name__ == "__main__":
    main()
