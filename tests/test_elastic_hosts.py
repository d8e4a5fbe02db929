"""The "Several machines" instructions of docs/elastic.md, run as written, with two "hosts" on one machine.

A lighthouse started by hand with ``--bind 127.0.0.1:PORT``; one worker config written by ``worker_config`` (what
``gasloc-elastic`` writes as ``worker_<W>/worker_config.yaml``); two workers "on host A", bound to and advertising
127.0.0.2, and two "on host B" on 127.0.0.3, each started as ``python -m gasloc_lightning.app.elastic_worker
CONFIG KEY=VALUE...`` with the doc's overrides and the run's secret in its environment only. While they train, the
listening sockets of every process are sampled from /proc: a worker listens on its own host's address and nowhere
else, the lighthouse on its bind only. Then all four finish on one model, and the secret is in no file they wrote.

Tiny GPT, H = 5, 40 steps, 4 workers on CPU.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from app_utils import CONF, clean_env, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import free_port, worker_config  # noqa: E402
from gasloc_lightning.app.elastic_worker import read_progress  # noqa: E402
from gasloc_lightning.comm.membership import lighthouse_reachable  # noqa: E402
from gasloc_lightning.comm.wire import SECRET_ENV  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV, terminate  # noqa: E402
from net_utils import listening_sockets  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MAX_STEPS = 40
WORKERS = 4
LIGHTHOUSE_HOST = "127.0.0.1"
HOSTS = {"127.0.0.2": (0, 1), "127.0.0.3": (2, 3)}  # host A, host B
FAST = [
    "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", f"trainer.max_steps={MAX_STEPS}",
    f"trainer.val_check_interval={MAX_STEPS}", "trainer.enable_progress_bar=false", "data.batch_size=4",
    "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", f"elastic.workers={WORKERS}",
    "elastic.min_workers=2", "elastic.allow_split_quorum=true", "elastic.gossip_timeout=3",
    "elastic.quorum_timeout=20",
]
# Keys of the worker config that hold the worker's folder (worker_config resolves ${output_dir} into the last three).
FOLDER_KEYS = ("output_dir", "trainer.default_root_dir", "logger.csv.save_dir", "callbacks.run_summary.output_dir")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()  # once, not by 4 racing workers
    return path


def _write_worker_config(tmp_path: Path, cache_dir: Path) -> Path:
    """What a user copies to every host: a worker config as gasloc-elastic writes it (its lighthouse is overridden)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app",
                      overrides=[*FAST, f"output_dir={tmp_path / 'run'}", f"cache_dir={cache_dir}"])
    path = tmp_path / "worker_config.yaml"
    OmegaConf.save(worker_config(cfg, 0, "127.0.0.1:9", str(tmp_path / "run" / "worker_0")), path)
    return path


def _start_lighthouse(port: int, log: Path) -> subprocess.Popen:
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    command = [str(binary), "--bind", f"{LIGHTHOUSE_HOST}:{port}", "--min_replicas", "2",
               "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "1500"]
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 10
    while not lighthouse_reachable(f"{LIGHTHOUSE_HOST}:{port}", timeout=0.2) and time.monotonic() < deadline:
        time.sleep(0.05)
    return process


def _worker_command(config: Path, port: int, host: str, worker: int, folder: Path) -> list[str]:
    """docs/elastic.md, "Several machines", step 3: the command for worker W on a host, plus its own folder."""
    return [
        sys.executable, "-m", "gasloc_lightning.app.elastic_worker", str(config),
        f"strategy.lighthouse={LIGHTHOUSE_HOST}:{port}", f"strategy.bind={host}", f"strategy.advertise={host}",
        f"strategy.worker_id={worker}", f"data.rank={worker}", f"data.world_size={WORKERS}",
        "strategy.first_quorum_delay=5", *(f"{key}={folder}" for key in FOLDER_KEYS),
    ]


def _start_worker(command: list[str], folder: Path, secret: str) -> subprocess.Popen:
    folder.mkdir(parents=True)
    # The secret through the environment only; the launcher pid: a worker never outlives this test.
    env = {**clean_env(), SECRET_ENV: secret, "OMP_NUM_THREADS": "1", LAUNCHER_PID_ENV: str(os.getpid())}
    with open(folder / "worker.log", "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _sample_until_exit(workers: list[subprocess.Popen], lighthouse: subprocess.Popen, seen: dict[int, set],
                       deadline: float) -> None:
    """Every 0.2 s until the workers have exited: what each process listens on (``seen``, by pid)."""
    while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
        for process in [lighthouse, *workers]:
            try:
                seen[process.pid].update(listening_sockets(process.pid))
            except OSError:  # it exited meanwhile
                pass
        time.sleep(0.2)


def _tail(folder: Path) -> str:
    log = folder / "worker.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no worker.log)"


@pytest.mark.timeout(240)
def test_workers_on_two_hosts_listen_on_their_own_address_only_and_finish_on_one_model(tmp_path, cache_dir):
    secret = secrets.token_hex(32)  # as docs/security.md says to make one
    config = _write_worker_config(tmp_path, cache_dir)
    stored = OmegaConf.load(config)
    for key in ("strategy.lighthouse", "strategy.bind", "strategy.advertise", "strategy.worker_id", "data.rank",
                "data.world_size", "strategy.first_quorum_delay", *FOLDER_KEYS):
        assert OmegaConf.select(stored, key, default=KeyError) is not KeyError, f"the worker config has no {key}"

    port = free_port(LIGHTHOUSE_HOST)
    lighthouse = _start_lighthouse(port, tmp_path / "lighthouse.log")
    workers: dict[int, subprocess.Popen] = {}
    hosts, folders = {lighthouse.pid: LIGHTHOUSE_HOST}, {}
    started = time.monotonic()
    try:
        assert lighthouse.poll() is None, (tmp_path / "lighthouse.log").read_text()
        for host, ids in HOSTS.items():
            for worker in ids:
                folders[worker] = tmp_path / f"host_{host}" / f"worker_{worker}"
                command = _worker_command(config, port, host, worker, folders[worker])
                workers[worker] = _start_worker(command, folders[worker], secret)
                hosts[workers[worker].pid] = host
        seen: dict[int, set] = {pid: set() for pid in hosts}
        _sample_until_exit(list(workers.values()), lighthouse, seen, deadline=started + 180)
        codes = {worker: process.poll() for worker, process in workers.items()}
        elapsed = time.monotonic() - started
    finally:
        terminate([*workers.values(), lighthouse], grace_s=10.0)
    everyone = [*workers.values(), lighthouse]
    alive = [p.pid for p in everyone if p.returncode is None or Path(f"/proc/{p.pid}").exists()]
    assert not alive, f"processes left running: {alive}"

    logs = "\n".join(f"--- worker {w}:\n{_tail(folder)}" for w, folder in folders.items())
    assert codes == {worker: 0 for worker in folders}, f"exit codes {codes} after {elapsed:.0f}s\n{logs}"
    for pid, sockets in seen.items():
        role = "the lighthouse" if pid == lighthouse.pid else f"the worker on {hosts[pid]}"
        assert sockets, f"{role} (pid {pid}) was never seen listening: nothing was sampled"
        elsewhere = sorted(s for s in sockets if s[0] != hosts[pid])
        assert not elsewhere, f"{role} (pid {pid}) listens beyond its own address {hosts[pid]}: {elsewhere}"

    progress = {worker: read_progress(folder) or {} for worker, folder in folders.items()}
    assert {w: p.get("state") for w, p in progress.items()} == {w: "done" for w in folders}, progress
    assert {w: p.get("step") for w, p in progress.items()} == {w: MAX_STEPS for w in folders}, progress
    checksums = {p.get("model_checksum") for p in progress.values()}
    assert len(checksums) == 1 and None not in checksums, f"the workers ended on different models: {progress}"
    assert all((folder / "summary.json").exists() for folder in folders.values()), "a worker wrote no summary.json"

    written = [path for path in tmp_path.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]
    assert not written, f"the secret was written to {written}"
