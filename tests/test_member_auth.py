"""Member and message authentication on tensors, over an in-process mailbox standing in for gloo's point to point.

The mailbox delivers each send to the matching (source, destination, tag) receive, like gloo; a receive waits at
most the timeout it is given, then fails. Ranks run in threads. What a rank was ever sent is recorded, so a test
can show that a refused member received nothing of the others' models.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from gasloc_lightning.comm.elastic_transport import ElasticCollectiveError, ElasticTransport
from gasloc_lightning.comm.member_auth import NONCE_TAG, RESPONSE_TAG, MemberAuthenticator, verify_members
from gasloc_lightning.comm.membership import Quorum
from gasloc_lightning.comm.message_auth import MessageAuthenticator, context
from gasloc_lightning.comm.ring import UnauthenticMessageError, ring_all_reduce_sum

SECRET = b"the-run-secret"
MEMBERS = ("worker_0000:a", "worker_0001:b", "worker_0002:c")


class _Done:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class _Receive:
    def __init__(self, box: queue.Queue, buffer: torch.Tensor) -> None:
        self.box, self.buffer = box, buffer

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            data = self.box.get(timeout=timeout.total_seconds() if timeout else 5.0)
        except queue.Empty:
            raise RuntimeError("timed out") from None
        if data.numel() != self.buffer.numel() or data.dtype != self.buffer.dtype:
            raise RuntimeError("size mismatch")
        self.buffer.copy_(data)
        return True


class Mailbox:
    """Point-to-point messages between in-process ranks; ``sent[rank]`` is everything ever sent to ``rank``."""

    def __init__(self) -> None:
        self.boxes: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.sent: dict[int, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
        self.lock = threading.Lock()
        self.tamper = None  # (source, destination, tag, tensor) -> tensor

    def group(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(send=lambda tensors, peer, tag: self._send(rank, peer, tag, tensors[0]),
                               recv=lambda tensors, peer, tag: self._recv(peer, rank, tag, tensors[0]))

    def _box(self, source: int, destination: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes[(source, destination, tag)]

    def _send(self, source: int, destination: int, tag: int, tensor: torch.Tensor) -> _Done:
        data = tensor.detach().clone()
        if self.tamper is not None:
            data = self.tamper(source, destination, tag, data)
        with self.lock:
            self.sent[destination].append((source, tag, data))
        self._box(source, destination, tag).put(data)
        return _Done()

    def _recv(self, source: int, destination: int, tag: int, buffer: torch.Tensor) -> _Receive:
        return _Receive(self._box(source, destination, tag), buffer)


def _run(ranks, fn):
    with ThreadPoolExecutor(len(ranks)) as pool:
        return [future.result(timeout=30) for future in [pool.submit(fn, rank) for rank in ranks]]


def _verify(mailbox: Mailbox, secrets_by_rank: dict[int, bytes], timeout: float = 5.0):
    def one(rank):
        return verify_members(mailbox.group(rank), quorum_id=7, members=MEMBERS, index=rank,
                              authenticator=MemberAuthenticator(secrets_by_rank[rank]), timeout=timeout)
    return _run(sorted(secrets_by_rank), one)


def test_members_with_the_secret_admit_each_other_and_refuse_one_without_it():
    mailbox = Mailbox()
    checks = _verify(mailbox, {0: SECRET, 1: SECRET, 2: b"a-guess"})
    assert [check.admitted for check in checks[:2]] == [(0, 1), (0, 1)]
    assert [check.refused for check in checks[:2]] == [(2,), (2,)]
    assert checks[2].admitted == (2,)  # the intruder cannot tell the honest members' answers apart either
    assert checks[0].unanswered == ()  # it answered, wrongly


def test_a_silent_member_is_refused_once_the_deadline_passes():
    mailbox = Mailbox()  # rank 2 never answers
    checks = _verify(mailbox, {0: SECRET, 1: SECRET}, timeout=0.5)
    assert [(check.admitted, check.refused, check.unanswered) for check in checks] == [((0, 1), (2,), (2,))] * 2


def test_an_answer_relayed_from_another_member_or_another_quorum_is_refused():
    """The intruder (rank 2) replays to rank 1 the answer rank 0 gave it, for the nonce rank 1 sent it: bound to
    prover and verifier, it proves nothing."""
    mailbox = Mailbox()
    intruder = mailbox.group(2)

    def relay():
        nonces = {}
        for peer in (0, 1):
            nonces[peer] = torch.zeros(32, dtype=torch.uint8)
            intruder.recv([nonces[peer]], peer, NONCE_TAG).wait(timedelta(seconds=5))
        intruder.send([nonces[1]], 0, NONCE_TAG)  # asks rank 0 to answer rank 1's challenge
        intruder.send([nonces[0]], 1, NONCE_TAG)
        answer_of_0 = torch.zeros(32, dtype=torch.uint8)
        intruder.recv([answer_of_0], 0, RESPONSE_TAG).wait(timedelta(seconds=5))
        intruder.send([answer_of_0], 1, RESPONSE_TAG)
        intruder.send([answer_of_0], 0, RESPONSE_TAG)

    thread = threading.Thread(target=relay)
    thread.start()
    checks = _verify(mailbox, {0: SECRET, 1: SECRET})
    thread.join(timeout=10)
    assert [check.refused for check in checks] == [(2,), (2,)]
    honest = MemberAuthenticator(SECRET)
    nonce_a, nonce_b = honest.nonce(), honest.nonce()
    answer = honest.answer(quorum_id=7, prover=MEMBERS[0], verifier=MEMBERS[1], verifier_nonce=nonce_a,
                           prover_nonce=nonce_b)
    assert not honest.check(answer, quorum_id=8, prover=MEMBERS[0], verifier=MEMBERS[1], verifier_nonce=nonce_a,
                            prover_nonce=nonce_b)


@pytest.mark.parametrize("tagged", [False, True], ids=["plain", "tagged"])
def test_a_ring_over_the_admitted_members_sums_identically_and_sends_the_refused_one_nothing(tagged):
    mailbox = Mailbox()
    auth = MessageAuthenticator(SECRET, leaf_bytes=16) if tagged else None
    values = {0: torch.arange(11, dtype=torch.float32), 1: torch.full((11,), 0.1), 3: torch.linspace(-1, 1, 11)}

    def one(rank):
        return ring_all_reduce_sum(mailbox.group(rank), values[rank].clone(), ring=(0, 1, 3), rank=rank,
                                   deadline=time.monotonic() + 5, authenticator=auth,
                                   use=context("all-reduce", 7, 1))

    results = _run([0, 1, 3], one)
    expected = values[0] + values[1] + values[3]
    assert all(torch.equal(result, results[0]) for result in results)  # the same bits everywhere
    assert torch.allclose(results[0], expected)
    assert mailbox.sent[2] == []  # rank 2, not in the ring, was sent nothing


def test_a_tampered_ring_chunk_is_refused():
    mailbox = Mailbox()
    auth = MessageAuthenticator(SECRET)

    def flip(source, destination, tag, data):
        return data + 1 if (source, data.dtype) == (0, torch.float32) else data

    mailbox.tamper = flip

    def one(rank):
        try:
            ring_all_reduce_sum(mailbox.group(rank), torch.ones(8), ring=(0, 1), rank=rank,
                                deadline=time.monotonic() + 1, authenticator=auth, use=b"x")
        except UnauthenticMessageError:
            return "refused"
        except RuntimeError:  # its neighbour stopped at the refused chunk: this hop timed out
            return "failed"
        return "summed"

    assert _run([0, 1], one) == ["failed", "refused"]  # rank 1 got rank 0's altered chunk: refused, never added


def test_a_message_tag_binds_key_bytes_and_use_and_streams_in_pieces():
    auth = MessageAuthenticator(SECRET, leaf_bytes=8, threads=2)
    message = torch.randn(10)
    tag = auth.tag(message, b"use")
    assert auth.verify(message, b"use", tag)
    assert not auth.verify(message, b"other use", tag)
    assert not MessageAuthenticator(b"guess", leaf_bytes=8).verify(message, b"use", tag)
    altered = message.clone()
    altered[9] += 1e-6
    assert not auth.verify(altered, b"use", tag)
    builder = auth.builder()
    for piece in (message[:4], message[4:8], message[8:]):  # 16 bytes each but the last: whole leaves
        builder.update(piece)
    assert builder.seal(b"use") == tag
    assert MessageAuthenticator(SECRET, algorithm="blake2b").tag(message, b"use") != tag
    with pytest.raises(ValueError, match="algorithm"):
        MessageAuthenticator(SECRET, algorithm="md5")
    with pytest.raises(ValueError, match="leaf_bytes"):
        MessageAuthenticator(SECRET, leaf_bytes=6)


def _elastic_transport(mailbox: Mailbox, rank: int, secret: bytes, *, tagged: bool, members=MEMBERS):
    quorum = Quorum(quorum_id=7, members=members, index=rank, max_step=3, healed=False)
    membership = SimpleNamespace(quorum=quorum, process_group=mailbox.group(rank), gossip_timeout=1.0,
                                 name=members[rank].split(":")[0])
    return ElasticTransport(6, membership, member_auth=MemberAuthenticator(secret),
                            message_auth=MessageAuthenticator(secret) if tagged else None)


def test_gossip_with_a_refused_member_sends_it_nothing_and_mixes_in_nothing_of_it():
    mailbox = Mailbox()
    transports = {0: _elastic_transport(mailbox, 0, SECRET, tagged=True),
                  1: _elastic_transport(mailbox, 1, SECRET, tagged=True)}

    def one(rank):
        transport = transports[rank]
        assert transport.admitted() == (0, 1)
        pending = transport.post(torch.full((6,), float(rank)), {1 - rank: 0.5, 2: 0.25}, round_index=3)
        return transport.complete(pending)

    thread = threading.Thread(target=lambda: _verify(mailbox, {2: b"a-guess"}, timeout=2))
    thread.start()
    outcomes = _run([0, 1], one)
    thread.join(timeout=10)
    for rank, (received, completed) in enumerate(outcomes):
        assert completed == [1 - rank] and torch.all(received[0][1] == float(1 - rank))
        assert transports[rank].refused_members == 1 and transports[rank].failed_exchanges == 1
    assert {tag for _, tag, _ in mailbox.sent[2]} <= {NONCE_TAG, RESPONSE_TAG}  # challenges only, no model


def test_a_gossip_message_whose_tag_fails_is_dropped_and_counted():
    mailbox = Mailbox()
    members = MEMBERS[:2]
    transports = {rank: _elastic_transport(mailbox, rank, SECRET, tagged=True, members=members) for rank in (0, 1)}
    mailbox.tamper = lambda source, destination, tag, data: data * 2 if (source, tag) == (0, 1000) else data

    def one(rank):
        pending = transports[rank].post(torch.full((6,), 1.0 + rank), {1 - rank: 0.5}, round_index=3)
        return transports[rank].complete(pending)

    outcomes = _run([0, 1], one)
    assert outcomes[0][1] == [1] and outcomes[1] == ([], [])  # rank 1 dropped rank 0's altered message
    assert transports[1].unauthentic_messages == 1 and transports[1].failed_exchanges == 1
    assert "tag" in str(transports[1].take_error())


def test_an_all_reduce_with_a_refused_member_averages_the_admitted_ones_over_a_tagged_ring():
    mailbox = Mailbox()
    transports = {rank: _elastic_transport(mailbox, rank, SECRET, tagged=True) for rank in (0, 1)}
    thread = threading.Thread(target=lambda: _verify(mailbox, {2: b"a-guess"}, timeout=2))
    thread.start()
    means = _run([0, 1], lambda rank: transports[rank].all_reduce_mean(torch.full((6,), 2.0 * rank),
                                                                       round_exchange=True))
    thread.join(timeout=10)
    assert torch.equal(means[0], means[1]) and torch.all(means[0] == 1.0)  # the mean of two, not of three
    assert {tag for _, tag, _ in mailbox.sent[2]} <= {NONCE_TAG, RESPONSE_TAG}
    mailbox.tamper = lambda source, destination, tag, data: data + 1 if data.dtype == torch.float32 else data
    with pytest.raises(ElasticCollectiveError):
        _run([0, 1], lambda rank: transports[rank].all_reduce_mean(torch.ones(6), round_exchange=True))
    assert transports[0].unauthentic_messages + transports[1].unauthentic_messages >= 1


@pytest.mark.parametrize("arguments, message", [({"member_auth": None}, "member_auth"),
                                                ({"message_auth": "yes"}, "message_auth")])
def test_the_strategy_validates_its_authentication_options(arguments, message):
    from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy

    with pytest.raises(ValueError, match=message):
        ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, secret="s", **arguments)


def test_a_member_that_does_not_answer_is_refused_and_reported_so_the_next_quorum_challenges_again():
    mailbox = Mailbox()  # rank 2 is stalled: it never answers
    transports = {rank: _elastic_transport(mailbox, rank, SECRET, tagged=False) for rank in (0, 1)}
    assert _run([0, 1], lambda rank: transports[rank].admitted()) == [(0, 1), (0, 1)]
    assert all("no answer to the member challenge from worker_0002" in str(t.take_error()) for t in transports.values())


# ---------------------------------------------------------------- on real gloo (torchft's reconfigurable group)
# The mailbox above fails one receive alone; on gloo a wait that times out closes every connection of the group
# ("Application timeout caused pair closure"), so these run the challenge on the group the workers use.


@pytest.fixture
def gloo_groups():
    """``make(n)``: ``n`` BoundProcessGroupGloo ranks of one fresh group on 127.0.0.1 (configured in threads, as
    ranks must rendezvous together); every group is closed at the end."""
    from torch.distributed import TCPStore

    from gasloc_lightning.comm.endpoints import BoundProcessGroupGloo, Endpoint

    made = []

    def make(n: int) -> list:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
        groups = [BoundProcessGroupGloo(endpoint=Endpoint(), timeout=timedelta(seconds=20)) for _ in range(n)]
        made.append((store, groups))
        address = f"127.0.0.1:{store.port}/quorum/{len(made)}"
        _run(range(n), lambda rank: groups[rank].configure(address, f"r{rank}", rank, n))
        return groups

    yield make
    for _, groups in made:
        for group in groups:
            group.close()


def _gloo_transport(group, rank: int, secret: bytes, members=MEMBERS, *, quorum_id: int = 7):
    quorum = Quorum(quorum_id=quorum_id, members=members, index=rank, max_step=3, healed=False)
    membership = SimpleNamespace(quorum=quorum, process_group=group, gossip_timeout=1.0, min_workers=1,
                                 name=members[rank].split(":")[0])
    return ElasticTransport(6, membership, member_auth=MemberAuthenticator(secret))


def _answer_late(group, rank: int, peers: list[int]) -> None:
    """The silent member finally posts the challenge's first step (what the honest members left pending), so no
    wait is still pending when the test process exits."""
    works = []
    for peer in peers:
        works += [group.recv([torch.zeros(32, dtype=torch.uint8)], peer, NONCE_TAG),
                  group.send([torch.zeros(32, dtype=torch.uint8)], peer, NONCE_TAG)]
    for work in works:
        work.wait(timedelta(seconds=10))
    deadline = time.monotonic() + 10
    while any(t.name.startswith("member-auth-wait") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded failure deadline: the honest members' leftover waits end on those messages


@pytest.mark.timeout(60)
def test_on_gloo_a_silent_member_leaves_the_honest_ones_admitting_and_averaging_with_each_other(gloo_groups):
    groups = gloo_groups(3)  # rank 2 joined the group (it is in the quorum) and never answers
    transports = {rank: _gloo_transport(groups[rank], rank, SECRET) for rank in (0, 1)}

    def one(rank):
        admitted = transports[rank].admitted()
        return admitted, transports[rank].all_reduce_mean(torch.full((6,), 2.0 * rank)).tolist()

    try:
        outcomes = _run([0, 1], one)
    finally:
        _answer_late(groups[2], 2, [0, 1])
    assert [admitted for admitted, _ in outcomes] == [(0, 1), (0, 1)]
    assert [mean for _, mean in outcomes] == [[1.0] * 6] * 2  # the mean of the two honest members
    assert [transports[rank].failed_collectives for rank in (0, 1)] == [0, 0]
    assert all("no answer to the member challenge from worker_0002" in str(t.take_error()) for t in transports.values())


@pytest.mark.timeout(60)
def test_on_gloo_a_silent_member_is_reported_once_per_member_set_not_every_quorum(gloo_groups):
    first, second = gloo_groups(3), gloo_groups(3)
    transports = {rank: _gloo_transport(first[rank], rank, SECRET) for rank in (0, 1)}
    reported = []
    for quorum_id, groups in ((7, first), (8, second)):  # the same members meet again in a new quorum (new group)
        for rank in (0, 1):
            membership = transports[rank].membership
            membership.quorum = Quorum(quorum_id=quorum_id, members=MEMBERS, index=rank, max_step=3, healed=False)
            membership.process_group = groups[rank]
        try:
            assert _run([0, 1], lambda rank: transports[rank].admitted()) == [(0, 1), (0, 1)]
        finally:
            _answer_late(groups[2], 2, [0, 1])
        reported.append([transports[rank].take_error() is not None for rank in (0, 1)])
    assert reported == [[True, True], [False, False]]
    assert [transports[rank].refused_members for rank in (0, 1)] == [2, 2]  # still refused (and counted) each time


@pytest.mark.timeout(60)
def test_on_gloo_a_mean_over_this_worker_alone_is_a_counted_failure_and_the_final_average_does_not_complete(
        gloo_groups):
    from gasloc_lightning.comm.faults import FaultPoints
    from gasloc_lightning.comm.run_end import is_final
    from gasloc_lightning.strategies.final_average import FinalAverage

    groups = gloo_groups(2)  # two members that refuse each other (different secrets): each admits only itself
    members = MEMBERS[:2]
    transports = {rank: _gloo_transport(groups[rank], rank, secret, members)
                  for rank, secret in ((0, SECRET), (1, b"another-run"))}
    outcomes = {}

    def one(rank):
        transport = transports[rank]
        membership = transport.membership
        membership.quorum_timeout, membership.run_tag, commits = 0.0, 0, []
        membership.commit = lambda step, error: commits.append((step, error))
        membership.start_quorum = lambda: Quorum(  # the lighthouse's decision: the highest step committed
            quorum_id=8, members=members, index=rank, max_step=max(step for step, _ in commits), healed=False)

        def average_once() -> bool:  # as the elastic strategy's: completed = no new failed collective
            failures = transport.failed_collectives
            try:
                transport.all_reduce_mean(torch.full((6,), float(rank)))
            except ElasticCollectiveError:
                pass
            return transport.failed_collectives == failures

        done = FinalAverage(membership, average_once=average_once, restore_own=lambda: None,
                            take_error=transport.take_error, leaving=lambda: False, faults=FaultPoints(None, worker=membership.name, known=()),
                            quorum_formed=lambda: None).run(3)
        outcomes[rank] = (done, commits)

    _run([0, 1], one)
    for rank in (0, 1):
        done, commits = outcomes[rank]
        assert [step for step, _ in commits] == [3] and not is_final(commits[0][0])  # the final step never committed
        assert done is False and transports[rank].failed_collectives == 1
        assert "admitted" in str(commits[0][1])
