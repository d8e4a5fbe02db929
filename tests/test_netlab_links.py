"""Each lab link's measured throughput as the launcher's TensorBoard series, without root: the htb counters
parsed from ``tc -s class show``, turned into Mbit/s per direction over a window, and written as
``launcher/link_<a>_to_<b>_mbit_s``. (A real lab run logs it too: ``tests/test_netlab_lab.py``, marker ``netlab``.)"""

from __future__ import annotations

import pytest

from gasloc_lightning.app.run_tensorboard import LauncherSeries
from gasloc_lightning.netlab.lab import class_of_site
from gasloc_lightning.netlab.link_meter import LinkMeter, class_bytes

# As iproute2 6.1 prints it in a site of a two-site lab (site 0 -> site 1 is class 1:b)
TC_OUTPUT = """class htb 1:1 root prio 0 rate 10Gbit ceil 10Gbit burst 0b cburst 0b 
 Sent 378 bytes 5 pkt (dropped 0, overlimits 0 requeues 0) 
 backlog 0b 0p requeues 0
 lended: 5 borrowed: 0 giants: 0
 tokens: 14 ctokens: 14

class htb 1:b root leaf 8049: prio 0 rate 8Mbit ceil 8Mbit burst 1600b cburst 1600b 
 Sent 313934 bytes 211 pkt (dropped 13, overlimits 23 requeues 0) 
 backlog 0b 0p requeues 0
 lended: 25 borrowed: 0 giants: 0
 tokens: -886 ctokens: -886
"""


def test_the_bytes_of_each_htb_class_are_read_from_tc_output():
    assert class_bytes(TC_OUTPUT) == {"1:1": 378, "1:b": 313934}
    assert class_of_site(1) == "1:b"


class _Counters:
    """Stand-in for the sites' counters: ``sent[(a, b)]`` bytes so far, and a clock the test moves."""

    def __init__(self) -> None:
        self.now, self.sent = 0.0, {(0, 1): 0, (1, 0): 0}

    def clock(self) -> float:
        return self.now

    def read(self, site: int) -> dict[int, int]:
        return {b: sent for (a, b), sent in self.sent.items() if a == site}


def test_each_directed_link_gets_its_mbit_per_s_over_a_window_of_every_s():
    counters = _Counters()
    meter = LinkMeter(sites=2, read=counters.read, every_s=5.0, clock=counters.clock)
    assert meter.poll() is None, "the first read only opens the window"
    counters.now, counters.sent = 2.0, {(0, 1): 1_000_000, (1, 0): 10_000}
    assert meter.poll() is None, "less than every_s since the last read"
    counters.now, counters.sent = 5.0, {(0, 1): 2_500_000, (1, 0): 25_000}
    assert meter.poll() == pytest.approx({(0, 1): 4.0, (1, 0): 0.04})  # 2.5 MB in 5 s = 4 Mbit/s
    counters.now, counters.sent = 10.0, {(0, 1): 1_000, (1, 0): 25_000}  # a class rebuilt: its counter restarted
    assert meter.poll() == {(0, 1): 0.0, (1, 0): 0.0}
    with pytest.raises(ValueError, match="every_s"):
        LinkMeter(sites=2, read=counters.read, every_s=0)


def test_the_links_throughput_is_a_launcher_series_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series = LauncherSeries(tmp_path / "launcher")
    series.links({(0, 1): 4.0, (1, 0): 0.5}, 10)
    series.links({(0, 1): 3.0, (1, 0): 0.25}, 20)
    series.close()
    events = EventAccumulator(str(tmp_path / "launcher"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("launcher/link_0_to_1_mbit_s")] == [(10, 4.0), (20, 3.0)]
    assert [(e.step, e.value) for e in events.Scalars("launcher/link_1_to_0_mbit_s")] == [(10, 0.5), (20, 0.25)]
    LauncherSeries(None).links({(0, 1): 1.0}, 1)  # no TensorBoard: nothing, no error


def test_a_failed_read_waits_for_the_next_window_and_is_warned_once(tmp_path, caplog):
    from gasloc_lightning.app.netlab import _log_links
    from gasloc_lightning.netlab.shell import LabError

    counters, reads = _Counters(), []

    def failing(site: int) -> dict[int, int]:
        reads.append(counters.now)
        raise LabError("`tc ...` did not run: timed out")

    meter = LinkMeter(sites=2, read=failing, every_s=5.0, clock=counters.clock)
    series = type("Series", (), {"log_dir": str(tmp_path), "links": lambda self, rates, step: None})()
    with caplog.at_level("DEBUG", logger="gasloc_lightning.app.netlab"):
        for now in (0.0, 0.2, 0.4, 4.8, 5.0, 5.2, 10.0):  # the launcher polls every 0.2 s
            counters.now = now
            _log_links(meter, series, 0)
    assert reads == [0.0, 5.0, 10.0], "one read per window of every_s, not one per poll"
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "counters" in r.getMessage()]
    assert len(warnings) == 1, warnings
