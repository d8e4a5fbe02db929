"""gasloc-netlab without root: the plan from a preset, fault parsing and scheduling, config, errors.

The lab itself (namespaces, links, runs) is tested in ``tests/test_netlab_lab.py`` (marker ``netlab``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from app_utils import CONF
import gasloc_lightning.netlab.lab as lab_module
from gasloc_lightning.netlab import FaultSchedule, LabError, LabPlan, check_can_build, parse_faults, plan_lab
from gasloc_lightning.network import NetworkModel


def _preset(name: str, devices: int = 8) -> NetworkModel:
    import gasloc_lightning.app.netlab  # noqa: F401  (registers the netlab_app schema)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="netlab/app", overrides=[f"network={name}", f"trainer.devices={devices}",
                                                           "output_dir=unused"])
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
