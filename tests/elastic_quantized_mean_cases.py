"""The elastic DiLoCo's quantized mean: real torchft memberships (threads, a real lighthouse, real gloo).

- its bits are :class:`~gasloc_lightning.algorithm.round.EncodedMean`'s on the same inputs (int8 and int4, with and
  without message tags);
- it is posted and waited on: a member computes after posting while its mean waits for a late member (observed by
  events: the late member posts only once the first one has computed; a blocking mean could not get there);
- a member that dies before its part fails the mean on every other member, counted once as a failed round
  exchange, as the float32 all-reduce does;
- the elastic DiLoCo takes int8/int4 (and overlap with them) and still refuses what it cannot do.
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from gasloc_lightning.algorithm.round import EncodedMean  # noqa: E402
from gasloc_lightning.app.elastic import free_port, lighthouse_command  # noqa: E402
from gasloc_lightning.comm.elastic_encoded_mean import ElasticEncodedMean, QuantizedRoundMean  # noqa: E402
from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport  # noqa: E402
from gasloc_lightning.comm.encoded_mean import EncodedAllReduce  # noqa: E402
from gasloc_lightning.comm.flat import FlatLayout  # noqa: E402
from gasloc_lightning.comm.membership import ElasticMembership, lighthouse_reachable  # noqa: E402
from gasloc_lightning.comm.message_auth import MessageAuthenticator  # noqa: E402
from gasloc_lightning.strategies.elastic import ElasticDiLoCoStrategy, ElasticGASLoCStrategy  # noqa: E402

HOST = "127.0.0.1"
SECRET = b"test-run-secret-16"
NUMEL = 1000  # not a multiple of 3 members x the codec's block: padded chunks
GATE = 60.0  # a failure deadline only


@contextlib.contextmanager
def _quorum_of_three():
    """A lighthouse of min 3 and three joined memberships (a quorum of 3), stopped by pid and shut down."""
    port = free_port()
    process = subprocess.Popen(lighthouse_command(port, 3, 200, 1000), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    members: list[ElasticMembership] = []
    try:
        deadline = time.monotonic() + GATE
        while not lighthouse_reachable(f"{HOST}:{port}", timeout=0.2):
            assert process.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.05)
        for worker in range(3):
            members.append(ElasticMembership(
                lighthouse=f"{HOST}:{port}", worker_id=worker, min_workers=3, state_dict=dict, load_state_dict=print,
                connect_timeout=10, quorum_timeout=30, gossip_timeout=10, transfer_timeout=10, secret=SECRET))
            members[-1].connect()
        quorums = _in_threads(lambda member: member.join(), members)
        assert [q.size for q in quorums] == [3, 3, 3]
        yield sorted(members, key=lambda member: member.quorum.index)
    finally:
        for member in members:
            member.shutdown()
        process.kill()
        process.wait()
        # A failed collective's error (kept by its transport, and holding the transport in its traceback) is a
        # reference cycle around the closed gloo group: collected here, where gloo's loop threads are, never in a
        # child forked later (conftest fails a module whose threads end only at a garbage collection).
        gc.collect()


@pytest.fixture(scope="module")
def quorum_of_three():
    """One quorum for the tests that leave it whole (a join costs seconds on a loaded machine)."""
    with _quorum_of_three() as members:
        yield members


@pytest.fixture
def doomed_quorum():
    """A quorum of its own, for a test that kills a member."""
    with _quorum_of_three() as members:
        yield members


def _in_threads(function, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return [future.result(timeout=GATE) for future in [pool.submit(function, item) for item in items]]


def _vectors(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, NUMEL, generator=generator) * torch.logspace(-3, 0, NUMEL)  # blocks of unequal scales


def test_the_elastic_quantized_mean_has_encoded_means_bits_with_and_without_tags(quorum_of_three):
    members = quorum_of_three
    for codec, tagged, seed in (("int8", False, 0), ("int4", True, 1)):
        vectors = _vectors(seed)
        means = [ElasticEncodedMean(ElasticTransport(
            NUMEL, member, message_auth=MessageAuthenticator(SECRET) if tagged else None), codec) for member in members]
        results = _in_threads(lambda i: means[i].mean(vectors[i].clone(), round_index=0), range(3))
        expected = EncodedMean(codec, NUMEL, 3).mean(vectors)
        for result, mean in zip(results, means):
            assert torch.equal(result, expected), codec
            assert mean.transport.failed_exchanges == 0 and mean.transport.counters.exchanges == 1
            assert mean.transport.counters.bytes_sent == EncodedAllReduce(codec, NUMEL, 3, torch.device("cpu")).volume


def test_a_member_computes_while_its_posted_mean_waits_for_a_late_member(quorum_of_three):
    """Member 1 posts only once member 0 has posted and then computed; member 0's mean cannot end before that."""
    members, vectors = quorum_of_three, _vectors(2)
    means = [ElasticEncodedMean(ElasticTransport(NUMEL, member), "int4") for member in members]
    computed = threading.Event()
    seen_in_flight = []

    def member(i: int) -> torch.Tensor:
        if i == 1 and not computed.wait(GATE):
            raise TimeoutError("member 0 never computed after posting: its post blocked on the late member")
        pending = means[i].post(vectors[i].clone(), round_index=0)
        if i == 0:
            seen_in_flight.append(not means[0].done(pending))  # member 1 has not posted: it cannot have ended
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # the step computed under the mean
            computed.set()
        return means[i].wait(pending)

    results = _in_threads(member, range(3))
    expected = EncodedMean("int4", NUMEL, 3).mean(vectors)
    assert seen_in_flight == [True]
    assert all(torch.equal(result, expected) for result in results)


def test_a_member_that_dies_before_its_part_fails_the_mean_on_every_other_member_as_float32_does(doomed_quorum):
    members = doomed_quorum
    transports = [ElasticTransport(NUMEL, member) for member in members]
    for transport in transports:
        transport.timeout = 5.0  # the failure deadline of a member that hangs instead of closing
    means = [ElasticEncodedMean(transport, "int8") for transport in transports]
    members[2].shutdown()  # dies before posting: its connections close

    def survivor(i: int) -> tuple[str, str]:
        outcome = []
        for run in (lambda: means[i].mean(torch.ones(NUMEL), round_index=0),
                    lambda: transports[i].all_reduce_mean(torch.ones(NUMEL), round_exchange=True)):
            try:
                run()
                outcome.append("ok")
            except ElasticCollectiveError:
                outcome.append("failed")
        return tuple(outcome)

    assert _in_threads(survivor, range(2)) == [("failed", "failed")] * 2
    for transport in transports[:2]:
        assert transport.failed_exchanges == 2 and transport.failed_collectives == 0  # once each, as exchanges
        assert transport.take_error() is not None and transport.counters.exchanges == 0


def _elastic(cls, **arguments):
    return cls(lighthouse=f"{HOST}:29510", worker_id=0, secret="s" * 16, **arguments)


@pytest.mark.parametrize("arguments, message", [
    ({"message_codec": "int2"}, "message_codec='int2'.*no zero level"),
    ({"message_codec": "topk:0.1"}, "message_codec"),
    ({"message_codec": "float16"}, "message_codec"),
    ({"overlap": True}, "overlaps only a quantized mean"),
    ({"message_codec": "int8", "fragments": 2}, "fragments must be 1"),
    ({"message_codec": "int8", "fragment_sync_delay": 1}, "fragment_sync_delay"),
])
def test_the_elastic_diloco_refuses_what_it_cannot_run(arguments, message):
    with pytest.raises(ValueError, match=message):
        _elastic(ElasticDiLoCoStrategy, **arguments)


def test_the_elastic_diloco_takes_int8_and_int4_with_overlap_and_gossip_still_refuses_codecs():
    for codec in ("int8", "int4"):
        strategy = _elastic(ElasticDiLoCoStrategy, message_codec=codec, overlap=True)
        assert (strategy.message_codec, strategy.overlap) == (codec, True)
        assert (strategy._message_codec, strategy._overlap) == ("float32", False)  # the gossip round's own
    with pytest.raises(ValueError, match="float32"):
        _elastic(ElasticGASLoCStrategy, message_codec="int8")
    with pytest.raises(ValueError, match="overlap"):
        _elastic(ElasticGASLoCStrategy, overlap=True)


class _FakeTransport:
    """A quorum whose mean is the identity (one member's view): what QuantizedRoundMean decides, not the wire."""

    def __init__(self) -> None:
        self.membership = SimpleNamespace(quorum=SimpleNamespace(quorum_id=1, members=("a", "b")))
        self.exact = 0

    def all_reduce_mean(self, tensor, *, round_exchange=False):
        self.exact += 1
        return tensor


def test_the_first_round_of_every_quorum_is_exact_then_quantized_rounds_follow():
    transport = _FakeTransport()
    rounds = QuantizedRoundMean(transport, "int8", num_parameters=4)
    assert not rounds.quantized
    rounds.apply(torch.ones(4), torch.zeros(4), 0)
    assert transport.exact == 1 and rounds.quantized  # the members met: the next round may be quantized
    transport.membership.quorum.quorum_id = 2  # a new quorum (a join, a failure, a departure)
    assert not rounds.quantized
    rounds.apply(torch.full((4,), float("nan")), torch.zeros(4), 1)
    assert transport.exact == 2 and not rounds.quantized  # a rejected (non-finite) mean: the next is exact again


def test_the_elastic_diloco_posts_after_step_h_minus_1_and_applies_after_step_h():
    """The strategy's two points, with a recorder in place of the quorum's mean: one post per round, after step
    H - 1, of u_i from that step's point (the point moves on at step H); the apply at the round's mean."""
    strategy = _elastic(ElasticDiLoCoStrategy, message_codec="int8", overlap=True, inner_steps=4)
    strategy.check_configuration(1)
    module = torch.nn.Linear(3, 2)
    strategy._layout = FlatLayout(module)
    strategy._init_outer_state()
    calls = []

    class Recorder:
        def post(self, message, round_start, round_index):
            calls.append(("post", message.clone(), round_index))
            return True

        def apply(self, message, round_start, round_index):
            calls.append(("apply", None, round_index))
            return message

    strategy._quantized_mean = Recorder()
    params = strategy.layout.num_parameter_elements
    for step in (1, 2, 3):
        strategy._after_inner_step(step)
    at_h_minus_1 = strategy.layout.read()[:params].clone()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(1.0)  # step H moves the point
    strategy._after_inner_step(4)
    strategy._round_mean_of(strategy.layout.read().clone())
    assert [name for name, _, _ in calls] == ["post", "apply"]
    assert torch.equal(calls[0][1], strategy._round.outer.message(at_h_minus_1))
