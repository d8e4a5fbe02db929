"""gasloc-netlab without root: the plan from a preset, fault parsing and scheduling, config, errors.

The lab itself (namespaces, links, runs) is tested in ``tests/test_netlab_lab.py`` (marker ``netlab``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from app_utils import CONF
import gasloc_lightning.app.netlab as netlab_app
from gasloc_lightning.app.elastic import worker_config
import gasloc_lightning.netlab.lab as lab_module
from gasloc_lightning.netlab import (Fault, FaultSchedule, LabError, LabPlan, check_can_build, parse_faults,
                                     plan_lab, why_no_lab)
from gasloc_lightning.netlab.shell import netns_names
from gasloc_lightning.network import NetworkModel


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def _preset(name: str, devices: int = 8) -> NetworkModel:
    cfg = _compose("netlab/app", [f"network={name}", f"trainer.devices={devices}", "output_dir=unused"])
    return instantiate(cfg.network)


def test_two_clusters_gives_two_sites_with_the_scaled_inter_site_rate_both_ways():
    plan = plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.01)
    assert plan.addresses == ("10.213.0.1", "10.213.0.2")
    assert plan.worker_sites == (0, 0, 1, 1)
    assert plan.rates_mbit == ((0.0, 10.0), (10.0, 0.0))  # 1 Gbit/s x 0.01


def test_cloud_mix_gives_three_sites_with_per_pair_rates():
    plan = plan_lab(_preset("cloud_mix"), workers=8, bandwidth_scale=0.01)
    assert plan.sites == 3 and plan.worker_sites == (0, 0, 0, 0, 1, 1, 2, 2)
    assert plan.rates_mbit[0][1] == pytest.approx(100.0) and plan.rates_mbit[0][2] == pytest.approx(10.0)
    assert plan.rates_mbit[1][2] == pytest.approx(20.0) and plan.rates_mbit[2][1] == pytest.approx(20.0)


def test_too_few_workers_for_the_sites_and_a_bad_scale_are_refused():
    with pytest.raises(ValueError, match="leaves site"):
        plan_lab(_preset("cloud_mix"), workers=2, bandwidth_scale=0.01)
    with pytest.raises(ValueError, match="bandwidth_scale"):
        plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.0)


@pytest.mark.parametrize("entry, message", [
    ("partition:1@40", "expected"), ("cut:1@40:5", "expected"), ("partition:2@40:5", "site 2 does not exist"),
    ("slow:1@40:5", "needs it"), ("flap:1@40:5:3", "only slow"), ("partition:1@40:0", "> 0"),
    ("partition:1@40-40", "UNTIL must be a later step"), ("partition:1@40-30", "UNTIL must be a later step"),
    ("partition:1@40-50:5", "only slow"),
])
def test_bad_fault_entries_are_refused_naming_the_entry(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_faults([entry], sites=2)


class _Links:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_link(self, site: int, up: bool) -> None:
        self.calls.append(("link", site, up))

    def throttle(self, site: int, mbit: float | None) -> None:
        self.calls.append(("throttle", site, mbit))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_partition_fires_at_its_step_and_lifts_after_its_seconds():
    links, clock = _Links(), _Clock()
    schedule = FaultSchedule(parse_faults(["partition:1@40:15"], 2), links, report=lambda line: None, clock=clock)
    schedule.poll(39)
    assert links.calls == []
    schedule.poll(41)
    assert links.calls == [("link", 1, False)]
    clock.now = 14.9
    schedule.poll(60)
    assert links.calls == [("link", 1, False)]
    clock.now = 15.0
    schedule.poll(60)
    assert links.calls == [("link", 1, False), ("link", 1, True)] and schedule.done
    assert any("partition:1@40:15 at step 41" in line for line in schedule.fired)


def test_a_step_window_holds_until_the_run_reaches_its_step_however_long_that_takes():
    """``partition:1@15-30``: cut at step 15, restored at step 30 and not before, whatever the clock says (a
    seconds window can fall inside one round's compute; a step window spans the rounds it names)."""
    links, clock = _Links(), _Clock()
    lines: list[str] = []
    faults = parse_faults(["partition:1@15-30", "slow:1@15-20:2"], 2)
    assert [str(fault) for fault in faults] == ["partition:1@15-30", "slow:1@15-20:2"]
    schedule = FaultSchedule(faults, links, report=lines.append, clock=clock)
    schedule.poll(16)
    assert links.calls == [("link", 1, False), ("throttle", 1, 2.0)]
    assert "netlab: fault partition:1@15-30 at step 16: site 1's link down until step 30" in lines
    clock.now = 1e6  # a day later, still at step 29: still cut
    schedule.poll(29)
    assert links.calls == [("link", 1, False), ("throttle", 1, 2.0), ("throttle", 1, None)]
    schedule.poll(30)
    assert links.calls[-1] == ("link", 1, True) and schedule.done


def test_a_flap_toggles_every_period_and_ends_with_the_link_up():
    links, clock = _Links(), _Clock()
    schedule = FaultSchedule(parse_faults(["flap:0@1:3"], 2), links, flap_period_s=1.0, report=lambda line: None,
                             clock=clock)
    for now in (0.0, 1.0, 2.0, 3.0):
        clock.now = now
        schedule.poll(5)
    assert links.calls == [("link", 0, False), ("link", 0, True), ("link", 0, False), ("link", 0, True)]
    assert schedule.done


def test_slow_caps_then_restores_and_lift_all_restores_a_fault_still_held():
    links, clock = _Links(), _Clock()
    schedule = FaultSchedule(parse_faults(["slow:1@0:10:2.5", "partition:0@0:100"], 2), links,
                             report=lambda line: None, clock=clock)
    schedule.poll(0)
    schedule.lift_all()
    assert links.calls == [("throttle", 1, 2.5), ("link", 0, False), ("throttle", 1, None), ("link", 0, True)]
    assert schedule.done


def test_not_root_is_one_clear_error(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root"):
        check_can_build()


def test_help_runs_from_a_base_install_and_names_the_netlab_group():
    result = subprocess.run([sys.executable, "-m", "gasloc_lightning.app.netlab", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "netlab: app, default" in result.stdout


def test_a_plan_refuses_what_is_not_a_network_model():
    with pytest.raises(ValueError, match="NetworkModel"):
        plan_lab(object(), workers=2, bandwidth_scale=0.1)  # type: ignore[arg-type]
    assert LabPlan(addresses=("a",), worker_sites=(0,), rates_mbit=((0.0,),)).workers_in(0) == [0]


def test_many_sites_gets_each_sites_uplink_shared_by_its_flows():
    plan = plan_lab(_preset("many_sites"), workers=8, bandwidth_scale=0.01)
    assert plan.sites == 4 and plan.worker_sites == (0, 0, 1, 1, 2, 2, 3, 3)
    assert plan.rates_mbit[2][3] == pytest.approx(10.0)  # min(2, 1) Gbit/s x 0.01
    assert plan.uplinks_mbit == pytest.approx((50.0, 50.0, 20.0, 10.0))  # site 0's own 100 is not in the pairs
    assert plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.01).uplinks_mbit is None


class _FakeIp:
    """``ip``/``tc`` as a set of namespaces; interrupts (as a Ctrl-C would) right after one named add, or
    times out every delete once (as a hung ``ip`` would)."""

    def __init__(self, interrupt_after_adding: str | None = None, slow_deletes: bool = False):
        self.namespaces: set[str] = set()
        self.interrupt_after_adding, self.slow_deletes = interrupt_after_adding, slow_deletes

    def run(self, *args: str, check: bool = True) -> str:
        if args[:3] == ("ip", "netns", "add"):
            self.namespaces.add(args[3])
            if args[3].endswith(self.interrupt_after_adding or "\0"):
                raise KeyboardInterrupt
        elif args[:3] == ("ip", "netns", "del"):
            if self.slow_deletes:
                self.slow_deletes = False
                raise lab_module.LabError("`ip netns del` did not run: timed out")
            if args[3] not in self.namespaces and check:
                raise lab_module.LabError(f"no namespace {args[3]}")
            self.namespaces.discard(args[3])
        return ""

    def names(self) -> list[str]:
        return sorted(self.namespaces)


@pytest.mark.parametrize("fake", [_FakeIp(interrupt_after_adding="-s1"), _FakeIp(slow_deletes=True)],
                         ids=["interrupted-add", "a-delete-times-out"])
def test_close_removes_every_namespace_of_the_run_even_after_an_interrupted_add_or_a_failed_step(monkeypatch, fake):
    monkeypatch.setattr(lab_module, "run", fake.run)
    monkeypatch.setattr(lab_module, "netns_names", fake.names)
    monkeypatch.setattr(lab_module, "check_can_build", lambda: None)
    lab = lab_module.Lab(plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.01), prefix="glab-1-abcd")
    fake.namespaces.add("glab-2-beef-bb")  # another run's: not ours to remove
    if fake.interrupt_after_adding:
        with pytest.raises(KeyboardInterrupt):
            lab.build()
    else:
        lab.build()
        lab.close()  # the first delete fails (logged); the sweep of the run's prefix still takes every namespace
    assert fake.names() == ["glab-2-beef-bb"]


# ------------------------------------------------------------------ overlapping faults
@pytest.mark.parametrize("entries", [["partition:1@40:15", "flap:1@40:5"], ["flap:1@40:5", "partition:1@40:15"],
                                     ["slow:1@40:5:1", "slow:1@40:9:2"]])
def test_faults_whose_windows_overlap_on_one_site_are_refused_naming_both(entries):
    with pytest.raises(ValueError, match=rf"{entries[0]}.*{entries[1]}|{entries[1]}.*{entries[0]}"):
        parse_faults(entries, sites=2)


@pytest.mark.parametrize("entries", [["partition:1@40:15", "slow:1@40:5:1"], ["partition:1@40:15", "flap:1@60:5"],
                                     ["partition:1@40:5", "partition:0@40:5"]])
def test_faults_that_do_not_certainly_overlap_are_accepted(entries):
    assert len(parse_faults(entries, sites=2)) == 2


def test_faults_that_overlap_at_run_time_compose_instead_of_undoing_each_other():
    links, clock = _Links(), _Clock()
    schedule = FaultSchedule(parse_faults(["partition:1@40:15", "flap:1@41:3", "slow:0@40:10:5", "slow:0@41:3:2"], 2),
                             links, flap_period_s=1.0, report=lambda line: None, clock=clock)
    for now, step in ((0.0, 40), (0.0, 41), (1.0, 42), (2.0, 43), (3.0, 44), (4.0, 45), (10.0, 50), (15.0, 60)):
        clock.now = now
        schedule.poll(step)
    # the flap's up phases and its end do not open the partitioned link; the lower cap holds while both are in force
    assert [c for c in links.calls if c[0] == "link"] == [("link", 1, False), ("link", 1, True)]
    assert [c for c in links.calls if c[0] == "throttle"] == [("throttle", 0, 5.0), ("throttle", 0, 2.0),
                                                              ("throttle", 0, 5.0), ("throttle", 0, None)]
    assert schedule.done


# ------------------------------------------------------------------ slow: the queue follows the rate
def test_slow_resizes_each_class_queue_for_the_capped_rate_and_back(monkeypatch):
    commands: list[tuple[str, ...]] = []
    monkeypatch.setattr(lab_module, "run", lambda *args, check=True: commands.append(args) or "")
    monkeypatch.setattr(lab_module, "check_can_build", lambda: None)
    lab = lab_module.Lab(LabPlan(addresses=("10.213.0.1", "10.213.0.2"), worker_sites=(0, 1),
                                 rates_mbit=((0.0, 100.0), (100.0, 0.0))), prefix="glab-1-abcd")

    def queues() -> list[str]:
        limits = [c[c.index("limit") + 1] for c in commands if "bfifo" in c]
        commands.clear()
        return limits

    lab.build()
    built = queues()
    assert built == ["625000", "625000"]  # 50 ms of 100 Mbit/s, each direction
    lab.throttle(1, 20.0)
    assert queues() == ["125000", "125000"]  # 50 ms of 20 Mbit/s: not 1.25 s as the built queue would hold
    lab.throttle(1, 1.0)
    assert queues() == ["65536", "65536"]  # the 64 KiB floor
    lab.throttle(1, None)
    assert queues() == built and lab.rates_mbit() == [[0.0, 100.0], [100.0, 0.0]]
    with pytest.raises(ValueError, match="mbit"):
        lab.throttle(1, 0.0)


# ------------------------------------------------------------------ settings refused before anything is built
class _NoNamespacesLab(lab_module.Lab):
    """The lab without namespaces: nothing is built or removed, and each command runs as is, here."""

    def build(self) -> None:
        pass

    def close(self) -> None:
        pass


class _MustNotBuild(lab_module.Lab):
    def build(self) -> None:
        raise AssertionError("a bad setting reached the lab")


@pytest.mark.parametrize("overrides, key", [
    (["elastic.lighthouse=10.0.0.1:29510"], "elastic.lighthouse="),
    (["netlab.lighthouse_port=0"], "netlab.lighthouse_port"),
    (["elastic.lighthouse_port=70000"], "elastic.lighthouse_port"),
    (["netlab.mode=clock", "netlab.clock_repeats=0"], "netlab.clock_repeats"),
    (["netlab.mode=clock", "netlab.clock_bytes=0"], "netlab.clock_bytes"),
    (["netlab.timeout_s=0"], "netlab.timeout_s"),
    (["netlab.flap_period_s=0"], "netlab.flap_period_s"),
    (["netlab.mode=train", "netlab.train_port=0"], "netlab.train_port"),
    (["netlab.mode=train", "elastic.status_every_s=0"], "elastic.status_every_s"),
    (["netlab.mode=clock", "elastic.status_every_s=-1"], "elastic.status_every_s"),
    (["netlab.faults=[partition:1@40:15,flap:1@40:5]"], "partition:1@40:15' and 'flap:1@40:5"),
    (["elastic.min_workers=9"], "elastic.min_workers"),  # gasloc-elastic's own checks, before the lab too
])
def test_bad_settings_are_refused_naming_the_key_before_the_lab_is_built(monkeypatch, tmp_path, overrides, key):
    monkeypatch.setattr(netlab_app, "Lab", _MustNotBuild)
    monkeypatch.setattr(netlab_app, "check_can_build", lambda: None)
    cfg = _compose("netlab/app", ["network=two_clusters", "elastic.workers=4", "trainer.devices=4",
                                  f"output_dir={tmp_path}", *overrides])
    with pytest.raises(ValueError, match=key):
        netlab_app.run_netlab(cfg)


# ------------------------------------------------------------------ clock mode obeys netlab.timeout_s
_SLEEPER = ("import os, sys, time\n"
            "args = sys.argv[1:]\n"
            "open(os.path.join(os.environ['NETLAB_TEST_PIDS'], str(os.getpid())), 'w').close()\n"
            "if '--port-file' in args:\n"
            "    open(args[args.index('--port-file') + 1], 'w').write('1')\n"
            "time.sleep(120)\n")


class _SleepingLab(_NoNamespacesLab):
    def wrap(self, command: list[str], site: int) -> list[str]:
        return [sys.executable, "-c", _SLEEPER, *command]  # a probe that never ends


def test_clock_mode_stops_its_probes_by_pid_at_netlab_timeout_s_and_says_so(monkeypatch, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("NETLAB_TEST_PIDS", str(pids))
    monkeypatch.setattr(netlab_app, "Lab", _SleepingLab)
    monkeypatch.setattr(netlab_app, "check_can_build", lambda: None)
    cfg = _compose("netlab/app", ["network=two_clusters", "trainer.devices=8", "netlab.mode=clock",
                                  "netlab.timeout_s=3", "netlab.clock_bytes=1000", f"output_dir={tmp_path / 'run'}"])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="netlab.timeout_s=3"):
        netlab_app.run_netlab(cfg)
    assert time.monotonic() - started < 20
    started_pids = [int(path.name) for path in pids.iterdir()]
    assert len(started_pids) == 8  # every rank of two_clusters started, then stopped
    assert [pid for pid in started_pids if Path(f"/proc/{pid}").exists()] == []


# ------------------------------------------------------------------ exit status: 128 + the signal
def _main_signalled(argv: list[str], signum: int) -> None:
    """In a forked child: gasloc-netlab's entry point, with a lab whose build is interrupted by ``signum``."""
    class _SignalledLab(_NoNamespacesLab):
        def build(self) -> None:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises before this ends

    netlab_app.Lab = _SignalledLab
    netlab_app.check_can_build = lambda: None
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a job started with & ignores it)
    sys.argv = argv
    netlab_app.main()


@pytest.mark.parametrize("mode, signum, status", [("train", signal.SIGTERM, 143), ("clock", signal.SIGTERM, 143),
                                                  ("train", signal.SIGINT, 130), ("clock", signal.SIGHUP, 129)])
def test_an_interrupted_run_exits_128_plus_the_signal_in_every_mode(tmp_path, mode, signum, status):
    argv = ["gasloc-netlab", "network=two_clusters", f"netlab.mode={mode}", "trainer.devices=4",
            f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}", "hydra.output_subdir=null"]
    child = multiprocessing.get_context("fork").Process(target=_main_signalled, args=(argv, signum))
    child.start()
    child.join(60)
    assert child.exitcode == status


# ------------------------------------------------------------------ elastic mode: links back before the leave
class _FakeRun:
    """An elastic launcher that records what it is asked to do; its watch fires the faults, then is interrupted
    (or ends with a fault still in force)."""

    def __init__(self, events: list, run_dir: Path, schedule: FaultSchedule, interrupt: bool) -> None:
        self.events, self.run_dir, self.schedule, self.interrupt = events, run_dir, schedule, interrupt
        self.interrupted = False

    def start(self) -> None:
        self.events.append("start")

    def watch(self) -> None:
        self.schedule.poll(50)
        if self.interrupt:
            raise KeyboardInterrupt

    def leave(self) -> None:
        self.events.append("leave")

    def stop(self) -> None:
        self.events.append("stop")

    def clean_up(self) -> None:
        pass

    def summary(self) -> dict:
        return {"workers": [], "interrupted": self.interrupted}


class _RecordingLinks(_Links):
    def __init__(self, events: list) -> None:
        self.calls = events


@pytest.mark.parametrize("interrupt", [True, False], ids=["interrupted", "ended"])
def test_links_are_restored_before_the_workers_leave_or_are_stopped(tmp_path, interrupt):
    events: list = []
    schedule = FaultSchedule(parse_faults(["partition:1@40:600", "slow:0@40:600:1", "flap:1@500:5"], 2),
                             _RecordingLinks(events), report=lambda line: None)
    signum, summary = netlab_app.run_in_lab(_FakeRun(events, tmp_path, schedule, interrupt), schedule)
    restored = [("throttle", 0, None), ("link", 1, True)]
    fired = [("link", 1, False), ("throttle", 0, 1.0)]
    assert sorted(events[1:3]) == sorted(fired)
    assert sorted(events[3:5]) == sorted(restored)
    assert events[5:] == (["leave", "stop"] if interrupt else ["stop"])
    assert signum == (signal.SIGINT if interrupt else None) and summary["interrupted"] == interrupt
    assert json.loads((tmp_path / "elastic_summary.json").read_text()) == summary
    assert [str(fault) for fault in schedule.unfired] == ["flap:1@500:5"]


def test_the_resume_line_is_a_gasloc_netlab_command_with_the_same_settings(tmp_path):
    overrides = ["experiment=demo", "network=cloud_mix", "elastic.workers=4", "netlab.bandwidth_scale=0.02",
                 "netlab.faults=[partition:1@40:15,slow:2@90:10:1]", "elastic.chaos=[kill:2@30]",
                 "++output_dir=/old/run", "elastic.resume=false"]
    command = netlab_app.lab_resume_command(overrides, tmp_path, [Fault("slow", 2, 90, 10.0, 1.0)])
    args = shlex.split(command)
    assert args == ["gasloc-netlab", "experiment=demo", "network=cloud_mix", "elastic.workers=4",
                    "netlab.bandwidth_scale=0.02", "netlab.faults=[slow:2@90:10:1]", f"output_dir={tmp_path}",
                    "elastic.resume=true"]
    cfg = _compose("netlab/app", args[1:])  # it composes as gasloc-netlab's config
    assert cfg.elastic.resume and cfg.netlab.bandwidth_scale == 0.02 and list(cfg.elastic.chaos) == []
    assert [str(f) for f in parse_faults(list(cfg.netlab.faults), 3)] == ["slow:2@90:10:1"]
    assert "netlab.faults" not in netlab_app.lab_resume_command(overrides, tmp_path, [])


# ------------------------------------------------------------------ train mode: what the ranks get
def test_rank_overrides_drop_the_labs_keys_in_every_hydra_form_and_compose_in_gasloc_train():
    overrides = ["model=tiny", "++trainer.max_steps=7", "++netlab.timeout_s=60", "~netlab.faults",
                 "+netlab.extra=1", "++elastic.workers=3", "network=cloud_mix", "network.bandwidth_scale=2",
                 "++trainer.devices=8", "+output_dir=x", "trainer.num_nodes=2", "netlab.mode=train"]
    kept = netlab_app.rank_overrides(overrides)
    assert kept == ["model=tiny", "++trainer.max_steps=7"]
    cfg = _compose("train", [*kept, "trainer.devices=1", "trainer.num_nodes=8", "~network"])  # as each rank's
    assert "netlab" not in cfg and "elastic" not in cfg and cfg.trainer.max_steps == 7


def test_a_two_level_topology_gets_the_labs_sites_as_its_regions_and_composes_in_gasloc_train():
    """The ranks run without the network (``~network``), from which two_level would take its regions: the lab gives
    each rank's site instead, unless the user named the regions."""
    plan = plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.01)
    lab_cfg = _compose("netlab/app", ["netlab.mode=train", "network=two_clusters", "strategy=two_level",
                                      "topology=two_level", "trainer.devices=4"])
    regions = netlab_app.region_overrides(lab_cfg, plan, ["strategy=two_level", "topology=two_level"])
    assert regions == [f"topology.regions=[{','.join(map(str, plan.worker_sites))}]"] and len(set(plan.worker_sites)) == 2
    cfg = _compose("train", ["strategy=two_level", "topology=two_level", *regions, "trainer.devices=1",
                             "trainer.num_nodes=4", "~network"])  # as each rank's
    assert list(cfg.topology.regions) == list(plan.worker_sites)
    for given in ("topology.regions=[a,a,b,b]", "topology.sizes=[2,2]", "++topology.bandwidth=[[1,1],[1,1]]"):
        assert netlab_app.region_overrides(lab_cfg, plan, ["topology=two_level", given]) == []  # the user's own
    assert netlab_app.region_overrides(_compose("netlab/app", ["netlab.mode=train", "strategy=diloco"]), plan,
                                       []) == []
    uneven = plan_lab(_preset("two_clusters"), workers=3, bandwidth_scale=0.01)
    with pytest.raises(ValueError, match="regions of equal sizes"):
        netlab_app.region_overrides(lab_cfg, uneven, ["topology=two_level"])


# ------------------------------------------------------------------ the lab probe makes nothing
def _system_namespaces() -> tuple[bool, list[str]]:
    return Path("/run/netns").exists(), (netns_names() if os.geteuid() == 0 else [])


@pytest.mark.xdist_group("netlab")  # compares the machine's namespaces before and after: no lab may run beside it
def test_why_no_lab_says_why_and_leaves_nothing_behind(monkeypatch):
    before = _system_namespaces()
    reason = why_no_lab()
    assert reason is None or "namespaces" in reason or "root" in reason or "iproute2" in reason
    assert _system_namespaces() == before
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert "needs root" in why_no_lab()


def test_in_elastic_mode_a_two_level_topology_gets_the_labs_sites_as_its_regions_and_each_worker_its_site():
    plan = plan_lab(_preset("two_clusters"), workers=4, bandwidth_scale=0.01)
    lab_cfg = _compose("netlab/app", ["netlab.mode=elastic", "network=two_clusters", "topology=two_level",
                                      "elastic.workers=4"])
    elastic_cfg = netlab_app._elastic_config(lab_cfg, plan)
    assert list(elastic_cfg.topology.regions) == list(plan.worker_sites) and len(set(plan.worker_sites)) == 2
    for worker, site in enumerate(plan.worker_sites):
        node = worker_config(elastic_cfg, worker, "127.0.0.1:1", "unused").strategy
        assert node["_target_"].endswith("ElasticTwoLevelStrategy") and node["topology"]["regions"][worker] == site
    given = netlab_app._elastic_config(_compose("netlab/app", [
        "netlab.mode=elastic", "network=two_clusters", "topology=two_level", "elastic.workers=4",
        "topology.regions=[a,b,a,b]"]), plan)
    assert list(given.topology.regions) == ["a", "b", "a", "b"]  # the user's own
