"""The lab for real (marker ``netlab``; needs root and iproute2, skipped with the reason otherwise).

- the lab: shaped links both ways, a partition cuts a site off and its end restores it, and closing it leaves
  no namespace (so no link: every link lives in one) and no process;
- a flap during a transfer: a gloo exchange across the sites outlives its link going down and up;
- a two-site elastic run with a partition and a rejoin, through ``gasloc-netlab``: 3 workers (2 + 1), a majority
  quorum (2), the lone site cut from step 15 until the others reach step 30 (a window in steps, so it spans round
  boundaries however loaded the machine); exit 0, every worker at ``max_steps`` on one model, the cut-off worker
  healed from a peer;
- "Several machines" of docs/elastic.md, as written, across the lab's real addresses: a lighthouse started by
  hand in site 0, four workers started by hand in two sites, each bound to and advertising its site's address;
- SIGTERM to ``gasloc-netlab`` mid-run: every namespace and process of the lab is gone afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from omegaconf import OmegaConf  # noqa: E402

from app_utils import clean_env, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import worker_config  # noqa: E402
from gasloc_lightning.app.elastic_worker import read_progress  # noqa: E402
from gasloc_lightning.comm.wire import SECRET_ENV  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402
from gasloc_lightning.netlab import (FaultSchedule, Lab, LabPlan,  # noqa: E402
                                    lab_namespaces, parse_faults, remove_namespaces, why_no_lab)
from gasloc_lightning.netlab.clock_check import measure  # noqa: E402
from gasloc_lightning.netlab.shell import run  # noqa: E402
from gasloc_lightning.strategies.launcher import LAUNCHER_PID_ENV, terminate  # noqa: E402


@contextlib.contextmanager
def _lab_process(command: list[str], **popen: object) -> Iterator[subprocess.Popen]:
    """A ``gasloc-netlab`` process that is stopped (with time to remove its lab) and whose namespaces are swept
    when the block ends, also when the test fails or times out."""
    process = subprocess.Popen(command, env=clean_env(), **popen)
    try:
        yield process
    finally:
        terminate([process], 60.0)
        remove_namespaces([name for name in lab_namespaces() if name.startswith(f"glab-{process.pid}-")])


_NO_LAB = why_no_lab()  # makes nothing that outlives the check (a thread's own namespace)
# xdist: one lab at a time (test_netlab.py checks that a probe leaves the machine's namespaces as they were).
pytestmark = [pytest.mark.netlab, pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("netlab"),
              pytest.mark.skipif(_NO_LAB is not None, reason=_NO_LAB or "")]

TWO_SITES = LabPlan(addresses=("10.213.0.1", "10.213.0.2"), worker_sites=(0, 1), rates_mbit=((0.0, 8.0), (8.0, 0.0)))
MAX_STEPS = 60
FAST = [
    "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", f"trainer.max_steps={MAX_STEPS}",
    f"trainer.val_check_interval={MAX_STEPS}", "trainer.enable_progress_bar=false", "data.batch_size=4",
    "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=4",
    "elastic.gossip_timeout=3", "elastic.quorum_timeout=60", "elastic.heartbeat_timeout_ms=1500",
]
FOLDER_KEYS = ("output_dir", "trainer.default_root_dir", "logger.csv.save_dir", "callbacks.run_summary.output_dir")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=path).prepare_data()
    return path


def _ours(prefix: str) -> list[str]:
    return [name for name in lab_namespaces() if name.startswith(prefix)]


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()
            and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]


@pytest.mark.timeout(60)
def test_links_are_shaped_a_partition_cuts_a_site_off_and_close_leaves_nothing():
    lab = Lab(TWO_SITES)
    with lab:
        assert sorted(_ours(lab.prefix)) == sorted([lab.backbone, lab.site_namespace(0), lab.site_namespace(1)])
        for site in (0, 1):
            classes = run("tc", "-n", lab.site_namespace(site), "class", "show", "dev", "wan")
            assert "rate 8Mbit" in classes, classes
        server = subprocess.Popen(lab.wrap([sys.executable, "-c", _ECHO_SERVER], 1), start_new_session=True)
        try:
            assert _wait(lambda: lab.reachable(0, "10.213.0.2", 5001)), "site 1 is not reachable from site 0"
            lab.set_link(1, up=False)
            assert not lab.reachable(0, "10.213.0.2", 5001, timeout=1.0), "a partitioned site is still reachable"
            lab.set_link(1, up=True)
            assert _wait(lambda: lab.reachable(0, "10.213.0.2", 5001)), "the site did not come back"
        finally:
            terminate([server], 2.0)
    assert _ours(lab.prefix) == [], "namespaces left after close"
    assert lab.namespaces == []
    lab.close()  # twice is harmless


_ECHO_SERVER = ("import socket\ns = socket.create_server(('10.213.0.2', 5001))\nwhile True:\n"
                "    s.accept()[0].close()\n")


def _wait(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(200)
def test_a_flap_during_a_transfer_delays_it_and_the_exchange_still_completes(tmp_path):
    folder = tmp_path / "probe"
    with Lab(TWO_SITES) as lab:
        schedule = FaultSchedule(parse_faults(["flap:1@1:3"], 2), lab, flap_period_s=0.4, report=lambda line: None)
        stop = threading.Event()

        def flapper() -> None:  # once both ranks exchange: rank 0's log shows a first transfer done, 19 to come
            log = folder / "rank_0.log"
            _wait(lambda: stop.is_set() or (log.exists() and "repeat 1/" in log.read_text()), 120)
            while not stop.is_set() and not schedule.done:
                schedule.poll(1)
                time.sleep(0.05)

        thread = threading.Thread(target=flapper)
        thread.start()
        try:
            seconds = measure(lab, pattern="gossip", nbytes=1_000_000, pairs=[(0, 1)], repeats=20, folder=folder,
                              timeout_s=150)
        finally:
            stop.set()
            thread.join()
            schedule.lift_all()
        assert len(seconds) == 20 and all(s > 0 for s in seconds)
        assert any("flap:1@1:3" in line for line in schedule.fired), schedule.fired
        assert "state UP" in run("ip", "-n", lab.backbone, "link", "show", "s1")


@pytest.mark.timeout(400)
def test_two_site_elastic_run_with_a_partition_every_worker_ends_on_one_model(tmp_path, cache_dir):
    """Workers 0, 1 in site 0 (with the lighthouse), worker 2 in site 1; min_workers a majority (2). Site 1 is cut
    from step 15 until the furthest worker reaches step 30: the window is in the run's steps (seen in the workers'
    progress), not in seconds, so the cut spans at least one round boundary on any machine (a seconds window could
    fall inside one round's compute and cut nothing). Site 0 trains through it; worker 2 cannot form a quorum alone,
    waits, comes back and heals from a peer; all three end at max_steps on one model. Its output (a pipe) carries
    the live status lines, and its TensorBoard (logger=tensorboard) each worker's run and the launcher's, with each
    link's measured throughput."""
    output = tmp_path / "run"
    # 300 steps, not 60: the lift comes at the launcher's poll once a worker passes step 30, and the cut-off worker
    # must rejoin before the others end. On an idle machine site 0 went from 15 to 60 within one poll, and worker 2
    # was stopped after the end (seen in a fresh clone's suite).
    steps = 300
    base = [o for o in FAST if not o.startswith(("trainer.max_steps=", "trainer.val_check_interval="))]
    command = [sys.executable, "-m", "gasloc_lightning.app.netlab", *base, f"trainer.max_steps={steps}",
               f"trainer.val_check_interval={steps}", "elastic.workers=3",
               "elastic.quorum_timeout=120", "network=two_clusters", "netlab.faults=[partition:1@15-30]",
               "logger=tensorboard", f"output_dir={output}", f"cache_dir={cache_dir}",
               f"hydra.run.dir={tmp_path / 'hydra'}"]
    with _lab_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        stdout, stderr = process.communicate(timeout=380)
    tail = stdout[-4000:] + stderr[-3000:]
    assert process.returncode == 0, tail
    assert "quorum: min_workers=2, a majority of 3 workers" in stdout, tail
    assert "workers [2]" in stdout.split("netlab: site 1 ")[1].splitlines()[0], tail
    assert "netlab: fault partition:1@15-30 at step" in stdout and "link down until step 30" in stdout, tail
    assert "lifted: site 1's link restored" in stdout, tail
    summary = json.loads((output / "netlab_summary.json").read_text())
    assert _ours(summary["prefix"]) == [], "lab namespaces left"
    rows = json.loads((output / "elastic_summary.json").read_text())
    assert _alive(rows["pids"]) == [], "lab processes left"
    assert [w["status"] for w in rows["workers"]] == ["finished"] * 3, tail
    assert [w["final_step"] for w in rows["workers"]] == [steps] * 3, tail
    assert len({w["model_checksum"] for w in rows["workers"]}) == 1, rows["workers"]
    assert summary["models"] == 1
    cut_off = read_progress(output / "worker_2")
    assert cut_off["healed_rounds"] and cut_off["applied"] < steps, cut_off  # it missed rounds, then healed
    _assert_live_view(stdout, output, steps)


def _assert_live_view(stdout: str, output: Path, steps: int = MAX_STEPS) -> None:
    """gasloc-netlab prints the live status as gasloc-elastic does, and logs each link's Mbit/s in both directions
    (bytes crossed the link: some sample is > 0) next to the workers' runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    status = [line for line in stdout.splitlines() if line.startswith("status: step ")]
    assert status and f"step {steps}/{steps}" in status[-1], status[-3:]
    board = output / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["launcher", "worker_0", "worker_1", "worker_2"]
    launcher = EventAccumulator(str(board / "launcher"))
    launcher.Reload()
    for tag in ("launcher/link_0_to_1_mbit_s", "launcher/link_1_to_0_mbit_s"):
        rates = [event.value for event in launcher.Scalars(tag)]
        assert rates and max(rates) > 0, (tag, rates)


@pytest.mark.timeout(300)
def test_several_machines_instructions_run_across_the_labs_real_addresses(tmp_path, cache_dir):
    """docs/elastic.md "Several machines", steps 1-3 as written, each host a site of the lab."""
    from hydra import compose, initialize_config_dir
    from app_utils import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app", overrides=[*FAST, f"output_dir={tmp_path / 'run'}",
                                                             f"cache_dir={cache_dir}"])
    config = tmp_path / "worker_config.yaml"
    OmegaConf.save(worker_config(cfg, 0, "127.0.0.1:9", str(tmp_path / "run" / "worker_0")), config)
    secret = secrets.token_hex(32)
    plan = LabPlan(addresses=TWO_SITES.addresses, worker_sites=(0, 0, 1, 1), rates_mbit=TWO_SITES.rates_mbit)
    lh = "10.213.0.1:29510"
    env = {**clean_env(), SECRET_ENV: secret, "OMP_NUM_THREADS": "1", LAUNCHER_PID_ENV: str(os.getpid())}
    processes: list[subprocess.Popen] = []
    folders = {w: tmp_path / f"site_{plan.worker_sites[w]}" / f"worker_{w}" for w in range(4)}
    with Lab(plan) as lab:
        try:
            binary = str(Path(sys.executable).parent / "torchft_lighthouse")
            lighthouse = [binary, "--bind", lh, "--min_replicas", "3", "--join_timeout_ms", "40000",
                          "--heartbeat_timeout_ms", "5000"]
            processes.append(subprocess.Popen(lab.wrap(lighthouse, 0), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, start_new_session=True))
            # 60 s: a failure deadline (the lighthouse took 13 s to listen in a namespace on the loaded machine)
            assert _wait(lambda: lab.reachable(1, "10.213.0.1", 29510), 60), "the lighthouse is unreachable from site 1"
            for worker, folder in folders.items():
                address = plan.address_of_worker(worker)
                folder.mkdir(parents=True)
                command = [sys.executable, "-m", "gasloc_lightning.app.elastic_worker", str(config),
                           f"strategy.lighthouse={lh}", f"strategy.bind={address}", f"strategy.advertise={address}",
                           f"strategy.worker_id={worker}", f"data.rank={worker}", "data.world_size=4",
                           "strategy.first_quorum_delay=5", *(f"{key}={folder}" for key in FOLDER_KEYS)]
                with open(folder / "worker.log", "ab") as log_file:
                    processes.append(subprocess.Popen(lab.wrap(command, plan.worker_sites[worker]), env=env,
                                                      stdout=log_file, stderr=subprocess.STDOUT,
                                                      start_new_session=True))
            workers = processes[1:]
            deadline = time.monotonic() + 240
            while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
                time.sleep(0.5)
            codes = [p.poll() for p in workers]
        finally:
            terminate(processes, 5.0)
        pids = [p.pid for p in processes]
        prefix = lab.prefix
    assert _ours(prefix) == [] and _alive(pids) == []
    logs = "\n".join((folder / "worker.log").read_text(errors="replace")[-1500:] for folder in folders.values())
    assert codes == [0, 0, 0, 0], logs
    progress = [read_progress(folder) for folder in folders.values()]
    assert [p["step"] for p in progress] == [MAX_STEPS] * 4, progress
    assert len({p["model_checksum"] for p in progress}) == 1, progress
    assert "bind=10.213.0.2" in (folders[3] / "worker.log").read_text(), "worker 3 did not bind its site's address"
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.timeout(200)
def test_sigterm_mid_run_leaves_no_namespace_and_no_process(tmp_path, cache_dir):
    output = tmp_path / "run"
    command = [sys.executable, "-m", "gasloc_lightning.app.netlab", *FAST, "trainer.max_steps=100000",
               "trainer.val_check_interval=100000", "network=two_clusters", "elastic.leave_grace_s=5",
               f"output_dir={output}", f"cache_dir={cache_dir}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    with _lab_process(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      start_new_session=True) as process:
        # mid-run: every worker has trained a round (an event, not 2 s after their start)
        assert _wait(lambda: all((read_progress(output / f"worker_{w}") or {}).get("step", 0) >= 5 for w in range(4)),
                     150)
        prefix = next(name for name in lab_namespaces() if name.startswith(f"glab-{process.pid}-")).rsplit("-", 1)[0]
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=150)
    assert process.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert _ours(prefix) == [], out[-3000:]
    rows = json.loads((output / "elastic_summary.json").read_text())
    assert _alive(rows["pids"]) == [], out[-3000:]
    assert "interrupted by SIGTERM" in out, out[-3000:]
