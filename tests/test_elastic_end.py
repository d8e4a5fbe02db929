"""Lineages and the end of a run: diverged sides that meet end on one model; the end-of-fit average commits the
same way on every survivor, even when a member dies inside it; a worker that wakes after the end leaves, exit 0.

The membership tests drive real torchft memberships (threads, a real lighthouse, real gloo); the end-of-fit
test runs three real workers through ``gasloc-elastic`` and kills one at a fault point inside the average.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from app_utils import CONF, shared_cache_dir  # noqa: E402
from gasloc_lightning.app.elastic import ELASTIC_SUMMARY_FILE, free_port, lighthouse_command, run_elastic  # noqa: E402
from gasloc_lightning.app.elastic_worker import read_progress  # noqa: E402
from gasloc_lightning.comm.elastic_transport import ElasticTransport  # noqa: E402
from gasloc_lightning.comm.faults import FAULT_ENV, FaultPoints, InjectedFault  # noqa: E402
from gasloc_lightning.comm.lineage import (  # noqa: E402
    Lineage, LineageExchangeError, LineageTracker, gather_lineages, quorum_token)
from gasloc_lightning.comm.membership import (  # noqa: E402
    ElasticMembership,
    Quorum,
    RunEndedError,
    lighthouse_reachable,
)
from gasloc_lightning.comm.run_end import FINAL_STEP, final_step, parse_status_page, run_tag  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

HOST = "127.0.0.1"
SECRET = b"test-run-secret-of-16+"


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture
def lighthouse(request):
    """A ``torchft_lighthouse`` (min_replicas: the indirect parameter), stopped by pid."""
    port = free_port()
    process = subprocess.Popen(lighthouse_command(port, request.param, 200, 1000),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"{HOST}:{port}"
    try:
        deadline = time.monotonic() + 60  # a failure deadline: the lighthouse answers as soon as it listens
        while not lighthouse_reachable(address, timeout=0.2):
            assert process.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.05)
        yield address
    finally:
        process.kill()
        process.wait()


def _membership(address: str, worker_id: int, state: dict, **overrides) -> ElasticMembership:
    settings = dict(lighthouse=address, worker_id=worker_id, min_workers=1, state_dict=lambda: dict(state),
                    load_state_dict=state.update, connect_timeout=10, quorum_timeout=30, gossip_timeout=10,
                    transfer_timeout=10, secret=SECRET)
    return ElasticMembership(**{**settings, **overrides})


def _in_threads(function, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return [future.result(timeout=90) for future in [pool.submit(function, item) for item in items]]


def _fake_quorum(quorum_id: int, members: tuple[str, ...]) -> Quorum:
    return Quorum(quorum_id=quorum_id, members=members, index=0, max_step=10, healed=False)


# ---------------------------------------------------------------------------------------------- pure parts
def test_fault_points_are_named_checked_and_aimed_at_one_worker():
    spec = "final_average.after_reduce=fail@worker_0001, final_average.before_reduce=exit@worker_0002"
    points = FaultPoints(spec, worker="worker_0001", known=["final_average.after_reduce", "final_average.before_reduce"])
    points.hit("final_average.before_reduce")  # aimed at worker 2: nothing here
    with pytest.raises(InjectedFault, match="final_average.after_reduce on worker_0001"):
        points.hit("final_average.after_reduce")
    assert not FaultPoints(None, worker="worker_0001", known=["a"]).armed
    for bad in ("final_average.after_reduce", "nowhere=exit", "final_average.after_reduce=explode"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            FaultPoints(bad, worker="worker_0001", known=["final_average.after_reduce"])


def test_the_lighthouse_status_page_says_whether_the_run_ended():
    member = ('<div class="member">\n  <b>{id}</b> <br/>\n  Step: {step} <br/>\n  Manager: a <br/>\n</div>')
    page = ("Current quorum_id: 3 <br>\n<h3>Previous Quorum</h3>\nPrevious quorum id: 3 <br>\n"
            + member.format(id="worker_0000:ab", step=final_step(30, 7)) + member.format(id="worker_0001:cd", step=30)
            + "\n<h2>Heartbeats</h2>\n<li>worker_0002:ef: seen 0.1s ago</li>")
    last = parse_status_page(page)
    assert last is not None and last.ended(7) and last.names == ["worker_0000", "worker_0001"]
    assert not last.ended(8)  # another run's end on the same lighthouse
    assert last.steps["worker_0001:cd"] == 30
    assert not parse_status_page(page.replace(str(final_step(30, 7)), "31")).ended(7)
    assert parse_status_page("<h3>Previous Quorum</h3>\n<h2>Heartbeats</h2>") is None  # no quorum yet
    assert parse_status_page("something else entirely") is None
    assert final_step(0, 0) == FINAL_STEP > 10**12 and run_tag(b"a") != run_tag(b"b")


def test_lineages_name_the_quorum_that_committed_and_travel_as_plain_state():
    side_a = _fake_quorum(4, ("worker_0000:u1", "worker_0001:u2"))
    side_b = _fake_quorum(4, ("worker_0002:u3", "worker_0003:u4"))  # a restarted lighthouse reuses quorum ids
    assert quorum_token(side_a) != quorum_token(side_b)
    assert quorum_token(side_a) == quorum_token(_fake_quorum(4, side_a.members))
    tracker = LineageTracker()
    tracker.committed(7, side_a)
    other = LineageTracker()
    other.load_state_dict(tracker.state_dict())
    assert other.lineage == tracker.lineage == Lineage(7, quorum_token(side_a))
    other.load_state_dict(None)  # a checkpoint from before lineages: kept
    assert other.lineage.round == 7
    with pytest.raises(ValueError, match="lineage"):
        other.load_state_dict([7, -1])


class _HostileSum:
    """A stand-in for the transport's admitted-member sum in which member 2 (admitted: it may know the secret) adds
    ``rows`` (member-major, 3 columns) to the sum, as the intruder of the review did (round -= 2^62 on every row)."""

    def __init__(self, rows: list[list[int]]):
        self.rows = torch.tensor(rows, dtype=torch.int64)
        self.membership = type("Membership", (), {"name": "worker_0000"})()

    def all_reduce_sum(self, tensor):
        honest = torch.zeros_like(self.rows)
        honest[1] = torch.tensor([1, 10, 77])  # worker_0001's row, as an honest member writes it
        tensor.view(-1, 3).add_(honest + self.rows)  # this worker's own row is already in the tensor
        return (0, 1, 2)


@pytest.mark.parametrize("hostile", [
    pytest.param([[0, -(1 << 62), 0], [0, -(1 << 62), 0], [1, 5, 12345]], id="rounds-minus-2^62"),
    pytest.param([[0, 0, 0], [0, 0, 0], [1, -1, 12345]], id="negative-round"),
    pytest.param([[0, 0, 0], [0, 0, 0], [1, 11, 12345]], id="round-past-max_step"),
    pytest.param([[0, 0, 0], [0, 0, 0], [1, 10, -5]], id="negative-token"),
    pytest.param([[0, 0, 0], [0, 0, 0], [1, 10, 1 << 62]], id="token-of-63-bits"),
    pytest.param([[0, 0, 0], [1, 0, 0], [1, 10, 12345]], id="a-row-written-twice"),
    pytest.param([[0, 0, 0], [0, 0, 0], [0, 10, 12345]], id="a-row-not-written"),
])
def test_a_lineage_row_an_honest_member_cannot_write_is_refused_and_nothing_changes(hostile):
    quorum = Quorum(quorum_id=7, members=("worker_0000:a", "worker_0001:b", "worker_0002:c"), index=0, max_step=10,
                    healed=False)
    tracker = LineageTracker()
    tracker.committed(10, _fake_quorum(6, ("worker_0000:a", "worker_0001:b")))
    history, point = tracker.state_dict(), torch.ones(4)
    with pytest.raises(LineageExchangeError, match="member [012] gave"):
        tracker.reconcile(quorum, _HostileSum(hostile), point)
    assert tracker.state_dict() == history and tracker.merges == 0
    torch.testing.assert_close(point, torch.ones(4))
    assert tracker.needs_meeting(quorum)  # the next quorum meets again


def test_lineage_rows_an_honest_member_writes_pass():
    quorum = Quorum(quorum_id=7, members=("worker_0000:a", "worker_0001:b", "worker_0002:c"), index=0, max_step=10,
                    healed=False)
    mine = Lineage(10, quorum_token(_fake_quorum(6, ("worker_0000:a",))))
    lineages = gather_lineages(_HostileSum([[0, 0, 0], [0, 0, 0], [1, 0, (1 << 62) - 1]]), quorum, mine)
    assert lineages == (mine, Lineage(10, 77), Lineage(0, (1 << 62) - 1))


def test_a_heal_that_replaces_a_diverged_side_counts_as_a_merge_and_a_laggard_does_not(caplog):
    """The further side heals the side behind (torchft's rule); the healed worker tells a split from a mere lag by
    the healer's history: the healer committed the worker's last round under another token only after a split."""
    side_a = _fake_quorum(4, ("worker_0000:u1", "worker_0001:u2"))
    side_b = _fake_quorum(5, ("worker_0002:u3",))
    healer = LineageTracker()
    for round_index in range(1, 10):
        healer.committed(round_index, side_a)
    laggard, split, fresh = LineageTracker(), LineageTracker(), LineageTracker()
    laggard.committed(7, side_a)
    split.committed(7, side_b)
    results = {}
    for name, tracker in (("laggard", laggard), ("split", split), ("fresh", fresh)):
        before = tracker.lineage
        tracker.load_state_dict(healer.state_dict())  # the heal hands over the healer's lineage
        results[name] = tracker.healed(before, name)
        assert tracker.lineage == healer.lineage
    assert results == {"laggard": False, "split": True, "fresh": False}
    assert [laggard.merges, split.merges, fresh.merges] == [0, 1, 0]
    assert "lineage replaced worker=split" in caplog.text and "the further side wins" in caplog.text


# ---------------------------------------------------------------------------------------------- with a lighthouse
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lighthouse", [4], indirect=True)
def test_two_diverged_sides_meeting_in_one_quorum_are_averaged_into_one_model(lighthouse, caplog):
    """Two pairs trained apart to the same round (two sides of a split, here resumed from their own states): when
    all four meet in one quorum, nobody is behind, so torchft heals no one; the lineages differ, so the sides are
    averaged, every member ends on one model and one lineage, and the merge is logged and counted."""
    sides = {0: (1.0, _fake_quorum(5, ("worker_0000:a", "worker_0001:b"))),
             1: (3.0, _fake_quorum(6, ("worker_0002:c", "worker_0003:d")))}
    points, trackers, members, transports = [], [], [], []
    for worker in range(4):
        value, side_quorum = sides[worker // 2]
        points.append(torch.full((6,), value))
        tracker = LineageTracker()
        tracker.committed(10, side_quorum)
        trackers.append(tracker)
        members.append(_membership(lighthouse, worker, {"x": torch.zeros(1)}, start_step=10, min_workers=4))
        transports.append(ElasticTransport(6, members[-1]))
    try:
        for member in members:
            member.connect()
        quorums = _in_threads(lambda member: member.join(), members)
        assert all(q.size == 4 and q.max_step == 10 and not q.healed for q in quorums), quorums
        with caplog.at_level("WARNING", logger="gasloc_lightning.comm.lineage"):
            meetings = _in_threads(lambda w: trackers[w].reconcile(quorums[w], transports[w], points[w]), range(4))
        assert all(meeting.diverged and meeting.merged for meeting in meetings)
        assert sorted(map(sorted, meetings[0].groups.values())) == [["worker_0000", "worker_0001"],
                                                                     ["worker_0002", "worker_0003"]]
        for point in points:
            torch.testing.assert_close(point, torch.full((6,), 2.0))  # each side weighs its two members
        assert len({tracker.lineage for tracker in trackers}) == 1 and trackers[0].lineage.round == 10
        assert [tracker.merges for tracker in trackers] == [1, 1, 1, 1]
        assert "lineages merged" in caplog.text and "worker_0002,worker_0003" in caplog.text
        # the same quorum again holds one lineage: no further meeting, no collective
        assert all(trackers[w].reconcile(quorums[w], transports[w], points[w]) is None for w in range(4))
    finally:
        for member in members:
            member.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_the_source_of_a_heal_with_no_collective_after_it_waits_until_its_healer_has_the_state(lighthouse):
    """The end-of-fit decision: worker 0 holds the final step, worker 1 is behind and heals from it, and nothing
    follows. Worker 1's fetch is held until worker 0 has started waiting (events, not timers): worker 0's
    ``wait_for_healers`` returns only once worker 1 has the state, so worker 0 may then shut down safely."""
    source_state, healer_state = {"x": torch.full((3,), 5.0)}, {"x": torch.zeros(3)}
    source = _membership(lighthouse, 0, source_state, min_workers=2, start_step=8)
    healer = _membership(lighthouse, 1, healer_state, min_workers=2)
    source_waiting = threading.Event()
    try:
        for member in (source, healer):
            member.connect()
        source_wait_answered = source._transport.wait_answered

        def wait_answered(*args, **kwargs):
            source_waiting.set()
            return source_wait_answered(*args, **kwargs)

        healer_recv = healer._transport.recv_checkpoint

        def recv_checkpoint(*args, **kwargs):
            assert source_waiting.wait(timeout=60), "the source never waited for its healer"
            return healer_recv(*args, **kwargs)

        source._transport.wait_answered, healer._transport.recv_checkpoint = wait_answered, recv_checkpoint

        served_when_done: list[int] = []

        def decide(member: ElasticMembership) -> tuple[Quorum, bool]:
            quorum = member.start_quorum()
            done = member.wait_for_healers(quorum)
            if member is source:  # it leaves at once, as a finished worker does: the healer must have it by now
                served_when_done.append(member.heal_server_counters["served"])
                member.shutdown()
            return quorum, done

        (source_quorum, served), (healer_quorum, _) = _in_threads(decide, [source, healer])
        assert source_quorum.heals == 1 and healer_quorum.heals == 0 and healer_quorum.healed
        assert served and served_when_done == [1]
        torch.testing.assert_close(healer_state["x"], source_state["x"])
    finally:
        for member in (source, healer):
            member.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_a_worker_that_wakes_or_starts_after_the_end_learns_it_ended_instead_of_waiting(lighthouse):
    """Three workers train round 1; worker 2 then stalls (it asks nothing). Workers 0 and 1 commit their end-of-fit
    average and leave. Worker 2 wakes (its exchange failed) and a fourth worker starts late: each learns from the
    lighthouse that the run ended and raises RunEndedError, long before its quorum_timeout (60 s)."""
    members = [_membership(lighthouse, w, {"x": torch.zeros(1)}, min_workers=2, quorum_timeout=60) for w in range(3)]
    late = _membership(lighthouse, 3, {"x": torch.zeros(1)}, min_workers=2, quorum_timeout=60)
    try:
        for member in members:
            member.connect()
        assert {q.size for q in _in_threads(lambda member: member.join(), members)} == {3}
        for member in members:
            member.commit(1)

        def finish(member: ElasticMembership) -> Quorum:
            member.commit(final_step(1, member.run_tag))
            return member.start_quorum()

        decided = _in_threads(finish, members[:2])
        assert all(q.size == 2 and q.max_step == final_step(1, run_tag(SECRET)) for q in decided), decided
        for member in members[:2]:
            member.shutdown()
        start = time.monotonic()
        members[2].commit(1, RuntimeError("exchange failed: the peers are gone"))  # it wakes
        with pytest.raises(RunEndedError, match="run has ended without this worker"):
            members[2].start_quorum()
        late.connect()
        with pytest.raises(RunEndedError, match="worker_0000,worker_0001"):
            late.join()
        assert time.monotonic() - start < 30, "they waited for a quorum instead of reading the lighthouse"
    finally:
        for member in [*members, late]:
            member.shutdown()


# ---------------------------------------------------------------------------------------------- three real workers
FAST = [
    "model=tiny", "data=stdlib", "trainer=cpu", "inner_steps=5", "trainer.max_steps=40",
    "trainer.val_check_interval=40", "trainer.enable_progress_bar=false", "data.batch_size=4",
    "data.val_batches=1", "callbacks.lr_monitor=null", "strategy.consensus_every=0", "elastic.workers=3",
    "elastic.min_workers=2", "elastic.heartbeat_timeout_ms=1500", "elastic.join_timeout_ms=5000",
    "elastic.gossip_timeout=3", "elastic.quorum_timeout=20", "elastic.timeout_s=240",
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_member_dying_inside_the_end_of_fit_average_leaves_the_survivors_on_one_model(tmp_path, tmp_path_factory,
                                                                                         monkeypatch):
    """Fault points, not timers: right after the end-of-fit all-reduce, worker 2 dies and worker 1 loses the
    result (as when a death cuts the collective short on some members only), while worker 0 holds the average.
    Worker 0 and 1 must still end on one model: worker 1 takes the committed average from worker 0 in the quorum
    that decides it. (Before the decision quorum, worker 0 finished with the average and worker 1 averaged again
    alone, or waited for a quorum that never came: two models.)"""
    from hydra import compose, initialize_config_dir

    cache = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=cache).prepare_data()
    monkeypatch.setenv(FAULT_ENV, "final_average.after_reduce=exit@worker_0002,"
                                  "final_average.after_reduce=fail@worker_0001")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app", overrides=[*FAST, f"output_dir={tmp_path}", f"cache_dir={cache}"])
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[2\] failed"):  # it died, as injected
        run_elastic(cfg)
    rows = {row["worker"]: row for row in json.loads((tmp_path / ELASTIC_SUMMARY_FILE).read_text())["workers"]}
    assert rows[2]["exit_code"] == 86, rows[2]
    survivors = [read_progress(Path(tmp_path) / f"worker_{worker}") for worker in (0, 1)]
    assert all(rows[worker]["status"] == "finished" and rows[worker]["final_step"] == 40 for worker in (0, 1)), rows
    assert survivors[0]["model_checksum"] == survivors[1]["model_checksum"], survivors
    assert survivors[1]["healed_rounds"], "worker 1 did not take the committed average from worker 0"
    assert rows[0]["val_loss"] == rows[1]["val_loss"]
    log = (Path(tmp_path) / "worker_1" / "worker.log").read_text()
    assert "end-of-fit average committed" in log and "took it from a peer" in log


def test_a_worker_that_finds_the_run_ended_exits_0_and_the_launcher_reports_it_stopped(tmp_path, monkeypatch):
    """The app's side of a worker that wakes after the end: progress state ``ended``, exit 0, and ``gasloc-elastic``
    reports ``stopped`` (no final model), never ``failed``."""
    from omegaconf import OmegaConf

    from gasloc_lightning.app import elastic_worker
    from gasloc_lightning.app.elastic import WorkerRecord, worker_status

    class EndedTrainer:
        callbacks: list = []

        def fit(self, *args, **kwargs):
            raise RunEndedError("worker_0002: the run has ended without this worker")

    monkeypatch.setattr(elastic_worker, "build", lambda cfg: (EndedTrainer(), None, None))
    config = tmp_path / "worker_config.yaml"
    OmegaConf.save(OmegaConf.create({"output_dir": str(tmp_path / "worker_2")}), config)
    assert elastic_worker.run_worker(config) == 0
    progress = read_progress(tmp_path / "worker_2")
    assert progress["state"] == "ended" and "ended without this worker" in progress["error"]
    record = WorkerRecord(worker=2, output_dir=tmp_path / "worker_2", config_path=config, process=object(),
                          exit_code=0, final=progress)
    assert worker_status(record, val_loss=None) == "stopped"


def test_a_worker_that_died_before_recording_an_error_is_named_with_its_exit_code_and_where_to_look(tmp_path):
    from types import SimpleNamespace

    from gasloc_lightning.app.elastic import WorkerRecord, raise_if_failed

    records = {0: WorkerRecord(worker=0, output_dir=tmp_path / "worker_0", config_path=tmp_path / "c.yaml",
                               process=object(), exit_code=1, final={}),
               1: WorkerRecord(worker=1, output_dir=tmp_path / "worker_1", config_path=tmp_path / "c.yaml",
                               process=object(), exit_code=1, final={"error": "ValueError: bad batch"}),
               2: WorkerRecord(worker=2, output_dir=tmp_path / "worker_2", config_path=tmp_path / "c.yaml",
                               process=object(), exit_code=-9, final={})}
    summary = {"workers": [{"worker": w, "status": "failed"} for w in (0, 1, 2)]}
    with pytest.raises(RuntimeError) as raised:
        raise_if_failed(SimpleNamespace(workers=records, run_dir=tmp_path), summary)
    message = str(raised.value)
    assert "worker 0: exit code 1 before it recorded an error" in message and "__main__" in message
    assert "worker 1: ValueError: bad batch" in message and "None" not in message
    assert "worker 2: killed by SIGKILL before it recorded an error" in message
