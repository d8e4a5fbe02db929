"""Member and message authentication on tensors, over an in-process mailbox standing in for gloo's point to point
and an in-process store standing in for the quorum's rendezvous store.

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
from torch.distributed import HashStore

from gasloc_lightning.comm.member_auth import MemberAuthenticator, MemberCheck, verify_members
from gasloc_lightning.comm.membership import Quorum
from gasloc_lightning.comm.message_auth import MessageAuthenticator, context
from gasloc_lightning.comm.ring import UnauthenticMessageError, ring_all_reduce_sum

SECRET = b"the-run-secret-of-16+"
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
        self.posted: list[tuple[str, int, int, int]] = []  # every (op, source, destination, tag) posted
        self.lock = threading.Lock()
        self.tamper = None  # (source, destination, tag, tensor) -> tensor
        self.store = HashStore()  # the quorum's rendezvous store, shared by every rank
        self.on_first_write: dict[int, object] = {}  # rank -> called at its first store write or send

    def group(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(send=lambda tensors, peer, tag: self._send(rank, peer, tag, tensors[0]),
                               recv=lambda tensors, peer, tag: self._recv(peer, rank, tag, tensors[0]),
                               quorum_store=_WatchedStore(self.store, lambda: self._wrote(rank)))

    def _wrote(self, rank: int) -> None:
        hook = self.on_first_write.pop(rank, None)
        if hook is not None:
            hook()

    def _box(self, source: int, destination: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes[(source, destination, tag)]

    def _send(self, source: int, destination: int, tag: int, tensor: torch.Tensor) -> _Done:
        self.posted.append(("send", source, destination, tag))
        self._wrote(source)
        data = tensor.detach().clone()
        if self.tamper is not None:
            data = self.tamper(source, destination, tag, data)
        with self.lock:
            self.sent[destination].append((source, tag, data))
        self._box(source, destination, tag).put(data)
        return _Done()

    def _recv(self, source: int, destination: int, tag: int, buffer: torch.Tensor) -> _Receive:
        self.posted.append(("recv", source, destination, tag))
        return _Receive(self._box(source, destination, tag), buffer)


class _WatchedStore:
    """A rank's view of the shared store that tells the test when the rank first writes to it."""

    def __init__(self, store: HashStore, on_write) -> None:
        self._store, self._on_write = store, on_write

    def set(self, key, value):
        self._on_write()
        return self._store.set(key, value)

    def compare_set(self, key, expected, desired):
        self._on_write()
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _run(ranks, fn):
    with ThreadPoolExecutor(len(ranks)) as pool:
        return [future.result(timeout=30) for future in [pool.submit(fn, rank) for rank in ranks]]


def _attested(store, secret: bytes, rank: int, members=MEMBERS, quorum_id: int = 7) -> bool:
    key = MemberAuthenticator(secret).key_name(quorum_id=quorum_id, members=members, index=rank)
    return store.check([key])


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 20  # a failure deadline only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _in_order(store, calls: list[tuple[int, bytes]], fn, members=MEMBERS):
    """Runs ``fn(rank)`` for each (rank, secret) in a thread of its own, each started once the ones before it have
    attested in ``store``: only the last can reach its deadline before the others attested, whatever the load."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {}
        for rank, secret in calls:
            futures[rank] = pool.submit(fn, rank)
            if (rank, secret) != calls[-1]:
                _wait_for(lambda: _attested(store, secret, rank, members) or futures[rank].done(), f"rank {rank}")
        return {rank: future.result(timeout=60) for rank, future in futures.items()}


def _verify(store, calls: list[tuple[int, bytes]], timeouts: dict[int, float] | None = None):
    """verify_members for each (rank, secret), in order (see _in_order): the last decides at its deadline (0.3 s),
    the others wait for that decision (30 s: a failure deadline only)."""
    secrets_by_rank = dict(calls)
    timeouts = timeouts or {rank: (0.3 if (rank, secret) == calls[-1] else 30.0) for rank, secret in calls}

    def one(rank):
        return verify_members(store, quorum_id=7, members=MEMBERS, index=rank,
                              authenticator=MemberAuthenticator(secrets_by_rank[rank]), timeout=timeouts[rank])
    return _in_order(store, calls, one)


def test_members_with_the_secret_admit_each_other_and_refuse_one_without_it():
    store = HashStore()
    checks = _verify(store, [(2, b"a-guess"), (0, SECRET), (1, SECRET)], timeouts={0: 30.0, 1: 0.3, 2: 0.3})
    assert [checks[rank].admitted for rank in (0, 1)] == [(0, 1), (0, 1)]
    assert [checks[rank].refused for rank in (0, 1)] == [(2,), (2,)]
    assert checks[2].admitted == (2,)  # the intruder cannot read the honest members' attestations either


def test_a_silent_member_is_refused_once_the_deadline_passes():
    checks = _verify(HashStore(), [(0, SECRET), (1, SECRET)])  # rank 2 never attests
    outcomes = [(check.admitted, check.refused, check.unanswered) for check in checks.values()]
    assert outcomes == [((0, 1), (2,), (2,))] * 2


def test_an_attestation_or_a_decision_proves_nothing_for_another_quorum_member_or_set():
    honest = MemberAuthenticator(SECRET)
    attestation = honest.attestation(quorum_id=7, members=MEMBERS, index=0)
    assert attestation != honest.attestation(quorum_id=8, members=MEMBERS, index=0)
    assert attestation != honest.attestation(quorum_id=7, members=MEMBERS, index=1)
    assert attestation != honest.attestation(quorum_id=7, members=MEMBERS[:2], index=0)
    assert attestation != MemberAuthenticator(b"a-guess").attestation(quorum_id=7, members=MEMBERS, index=0)
    decision = honest.seal_decision(quorum_id=7, members=MEMBERS, admitted=(0, 1))
    assert honest.open_decision(decision, quorum_id=7, members=MEMBERS) == (0, 1)
    assert honest.open_decision(decision, quorum_id=8, members=MEMBERS) is None  # replayed in another quorum
    assert honest.open_decision(decision[:-1] + b"2", quorum_id=7, members=MEMBERS) is None  # altered set
    assert honest.open_decision(b"x" * (1 << 20), quorum_id=7, members=MEMBERS) is None  # too long: unparsed


def test_a_decision_the_store_host_forged_admits_nobody_else():
    """The store's host (the quorum's first member) sees the key names: it can squat the decision with garbage, or
    with another quorum's genuine decision, and then the honest members exchange with nobody (no worse than a host
    that breaks the rendezvous), but it cannot get itself admitted."""
    honest = MemberAuthenticator(SECRET)
    for squatted in (b"x" * 40, honest.seal_decision(quorum_id=6, members=MEMBERS, admitted=(0, 1, 2))):
        store = HashStore()
        store.set(honest.key_name(quorum_id=7, members=MEMBERS), squatted)
        check = verify_members(store, quorum_id=7, members=MEMBERS, index=0, authenticator=honest, timeout=5.0)
        assert (check.admitted, check.refused) == ((0,), (1, 2))


def test_a_member_too_slow_for_one_members_deadline_but_not_anothers_leaves_them_one_admitted_set():
    """Defect (a) of the lab run: rank 2 (behind a slow link) arrives after rank 0's deadline and before rank 1's.
    Each member deciding alone, rank 0 held {0, 1} (or less) and rank 1 {0, 1, 2}: their rings differed. Agreed
    through one decision, every member admitted with rank 0 and rank 1 holds the same set, and rank 2, left out,
    exchanges with nobody (it reports; the next quorum agrees again). Ordered by events, not by sleeps: rank 2 starts
    only once rank 0's deadline has passed and it has returned."""
    mailbox = Mailbox()
    transports = {0: _elastic_transport(mailbox, 0, SECRET, tagged=False, gossip_timeout=0.2),
                  1: _elastic_transport(mailbox, 1, SECRET, tagged=False, gossip_timeout=30.0),
                  2: _elastic_transport(mailbox, 2, SECRET, tagged=False, gossip_timeout=30.0)}
    started = threading.Event()  # rank 1 began its challenge (a store write, or a send on the old gloo challenge)
    mailbox.on_first_write[1] = started.set
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(transports[1].admitted)
        assert started.wait(20)
        first = transports[0].admitted()  # returns at its (short) deadline: rank 2 has not begun
        slow = pool.submit(transports[2].admitted)
        admitted = {0: first, 1: one.result(timeout=60), 2: slow.result(timeout=60)}
    assert admitted[0] == admitted[1], admitted  # the same ring on both: no chunk between them can fail its tag
    assert admitted[0] == (0, 1) and admitted[2] == (2,), admitted  # left out by every member alike
    for rank, members in admitted.items():
        for peer in members:
            assert admitted[peer] == members, admitted  # whoever exchanges with a member holds its set


def test_member_authentication_posts_nothing_on_the_process_group_and_leaves_no_thread():
    """Defect (b) of the lab run: a challenge over gloo left a receive pending for a silent member, in a daemon thread;
    torn down, the group aborted the process (gloo::EnforceNotMet). The agreement runs over the store only."""
    mailbox = Mailbox()
    transports = {0: _elastic_transport(mailbox, 0, SECRET, tagged=False, gossip_timeout=30.0),
                  1: _elastic_transport(mailbox, 1, SECRET, tagged=False, gossip_timeout=0.3)}
    started = threading.Event()
    mailbox.on_first_write[0] = started.set
    threads = set(threading.enumerate())
    with ThreadPoolExecutor(1) as pool:  # rank 2 is silent
        first = pool.submit(transports[0].admitted)
        assert started.wait(20)
        admitted = {1: transports[1].admitted(), 0: first.result(timeout=60)}
    assert mailbox.posted == [] and mailbox.sent == {}  # not one send or receive on the group
    assert [t for t in threading.enumerate() if t not in threads and t.is_alive()] == []
    assert admitted == {0: (0, 1), 1: (0, 1)}


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
    auth.close()  # its hashing threads


def _elastic_transport(mailbox: Mailbox, rank: int, secret: bytes, *, tagged: bool, members=MEMBERS,
                       gossip_timeout: float = 1.0):
    quorum = Quorum(quorum_id=7, members=members, index=rank, max_step=3, healed=False)
    membership = SimpleNamespace(quorum=quorum, process_group=mailbox.group(rank), gossip_timeout=gossip_timeout,
                                 name=members[rank].split(":")[0])
    return ElasticTransport(6, membership, member_auth=MemberAuthenticator(secret),
                            message_auth=MessageAuthenticator(secret) if tagged else None)


def _honest_pair(mailbox: Mailbox, *, tagged: bool, members=MEMBERS) -> dict[int, ElasticTransport]:
    """Ranks 0 and 1 with the secret, admitted in order (see _in_order): rank 0 waits 30 s (a failure deadline),
    rank 1 decides at its own deadline with whoever attested by then; a rank 2, if any, is an intruder."""
    transports = {0: _elastic_transport(mailbox, 0, SECRET, tagged=tagged, members=members, gossip_timeout=30.0),
                  1: _elastic_transport(mailbox, 1, SECRET, tagged=tagged, members=members, gossip_timeout=0.3)}
    admitted = _in_order(mailbox.store, [(0, SECRET), (1, SECRET)], lambda rank: transports[rank].admitted(),
                         members=members)
    assert admitted == {0: (0, 1), 1: (0, 1)}
    return transports


def _intruder_attests(mailbox: Mailbox) -> MemberCheck:
    """Rank 2 without the secret does what an honest member would, with a guess."""
    return verify_members(mailbox.group(2).quorum_store, quorum_id=7, members=MEMBERS, index=2,
                          authenticator=MemberAuthenticator(b"a-guess"), timeout=0.2)


def test_gossip_with_a_refused_member_sends_it_nothing_and_mixes_in_nothing_of_it():
    mailbox = Mailbox()
    assert _intruder_attests(mailbox).admitted == (2,)
    transports = _honest_pair(mailbox, tagged=True)

    def one(rank):
        pending = transports[rank].post(torch.full((6,), float(rank)), {1 - rank: 0.5, 2: 0.25}, round_index=3)
        return transports[rank].complete(pending)

    outcomes = _run([0, 1], one)
    for rank, (received, completed) in enumerate(outcomes):
        assert completed == [1 - rank] and torch.all(received[0][1] == float(1 - rank))
        assert transports[rank].refused_members == 1 and transports[rank].failed_exchanges == 1
    assert mailbox.sent[2] == []  # nothing at all
    assert not [post for post in mailbox.posted if 2 in post[1:3]]


def test_a_gossip_message_whose_tag_fails_is_dropped_and_counted():
    mailbox = Mailbox()
    members = MEMBERS[:2]
    transports = _honest_pair(mailbox, tagged=True, members=members)
    gossip_tag = transports[0].gloo_tag(0)  # the message's tag (the next one carries its keyed tag)
    assert gossip_tag == transports[1].gloo_tag(0)  # one agreement, the same tags
    mailbox.tamper = lambda source, destination, tag, data: data * 2 if (source, tag) == (0, gossip_tag) else data

    def one(rank):
        pending = transports[rank].post(torch.full((6,), 1.0 + rank), {1 - rank: 0.5}, round_index=3)
        return transports[rank].complete(pending)

    outcomes = _run([0, 1], one)
    assert outcomes[0][1] == [1] and outcomes[1] == ([], [])  # rank 1 dropped rank 0's altered message
    assert transports[1].unauthentic_messages == 1 and transports[1].failed_exchanges == 1
    assert "tag" in str(transports[1].take_error())


def test_an_all_reduce_with_a_refused_member_averages_the_admitted_ones_over_a_tagged_ring():
    mailbox = Mailbox()
    _intruder_attests(mailbox)
    transports = _honest_pair(mailbox, tagged=True)
    means = _run([0, 1], lambda rank: transports[rank].all_reduce_mean(torch.full((6,), 2.0 * rank),
                                                                       round_exchange=True))
    assert torch.equal(means[0], means[1]) and torch.all(means[0] == 1.0)  # the mean of two, not of three
    assert mailbox.sent[2] == []
    mailbox.tamper = lambda source, destination, tag, data: data + 1 if data.dtype == torch.float32 else data
    with pytest.raises(ElasticCollectiveError):
        _run([0, 1], lambda rank: transports[rank].all_reduce_mean(torch.ones(6), round_exchange=True))
    assert transports[0].unauthentic_messages + transports[1].unauthentic_messages >= 1


@pytest.mark.parametrize("arguments, message", [({"member_auth": None}, "member_auth"),
                                                ({"message_auth": "yes"}, "message_auth")])
def test_the_strategy_validates_its_authentication_options(arguments, message):
    from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy

    with pytest.raises(ValueError, match=message):
        ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, secret="s" * 16, **arguments)


def test_a_member_that_does_not_attest_is_refused_and_reported_so_the_next_quorum_agrees_again():
    transports = _honest_pair(Mailbox(), tagged=False)  # rank 2 is stalled: it never attests
    assert all("agreed member set (no attestation in time): worker_0002" in str(t.take_error())
               for t in transports.values())


# ---------------------------------------------------------------- on real gloo (torchft's reconfigurable group)
# The agreement runs over the store the group was configured with; these show that a silent member leaves nothing
# pending on the group (each group is closed at the end with that member never having answered anything).


@pytest.fixture
def gloo_groups():
    """``make(n)``: ``n`` BoundProcessGroupGloo ranks of one fresh group on 127.0.0.1 (configured in threads, as
    ranks must rendezvous together); every group is closed at the end."""
    from torch.distributed import TCPStore

    from gasloc_lightning.comm.endpoints import BoundProcessGroupGloo, Endpoint

    made = []

    def make(n: int, on_configured=None) -> list:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
        groups = [BoundProcessGroupGloo(endpoint=Endpoint(), timeout=timedelta(seconds=20)) for _ in range(n)]
        for rank, group in enumerate(groups):
            group.on_configured = None if on_configured is None else on_configured(rank)
        made.append((store, groups))
        address = f"127.0.0.1:{store.port}/quorum/{len(made)}"
        _run(range(n), lambda rank: groups[rank].configure(address, f"r{rank}", rank, n))
        return groups

    yield make
    for _, groups in made:
        for group in groups:
            group.close()
    made.clear()  # the stores' last references: each one's server thread ends with it


def _gloo_transport(group, rank: int, secret: bytes, members=MEMBERS, *, quorum_id: int = 7,
                    gossip_timeout: float = 1.0):
    quorum = Quorum(quorum_id=quorum_id, members=members, index=rank, max_step=3, healed=False)
    membership = SimpleNamespace(quorum=quorum, process_group=group, gossip_timeout=gossip_timeout, min_workers=1,
                                 name=members[rank].split(":")[0])
    return ElasticTransport(6, membership, member_auth=MemberAuthenticator(secret))


def _admit_on_gloo(transports: dict, groups: list, quorum_id: int = 7) -> dict:
    """admitted() on ranks 0 then 1, rank 1 started once rank 0 attested (see _in_order)."""
    def attested():
        return _attested(groups[0].quorum_store, SECRET, 0, quorum_id=quorum_id)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(transports[0].admitted)
        _wait_for(lambda: attested() or first.done(), "rank 0's attestation")
        second = pool.submit(transports[1].admitted)
        return {0: first.result(timeout=60), 1: second.result(timeout=60)}


@pytest.mark.timeout(60)
def test_on_gloo_a_silent_member_leaves_the_honest_ones_admitting_and_averaging_with_each_other(gloo_groups):
    groups = gloo_groups(3)  # rank 2 joined the group (it is in the quorum) and never attests
    transports = {0: _gloo_transport(groups[0], 0, SECRET, gossip_timeout=30.0),
                  1: _gloo_transport(groups[1], 1, SECRET, gossip_timeout=0.3)}
    assert _admit_on_gloo(transports, groups) == {0: (0, 1), 1: (0, 1)}
    means = _run([0, 1], lambda rank: transports[rank].all_reduce_mean(torch.full((6,), 2.0 * rank)).tolist())
    assert means == [[1.0] * 6] * 2  # the mean of the two honest members
    assert [transports[rank].failed_collectives for rank in (0, 1)] == [0, 0]
    assert all("worker_0002" in str(t.take_error()) for t in transports.values())


@pytest.mark.timeout(60)
def test_on_gloo_members_attest_as_their_group_is_configured_so_a_late_first_exchange_is_not_late(gloo_groups):
    """Every member attests inside torchft's configure (ElasticMembership.on_quorum_group), before any heal: a member
    whose first exchange comes late (a joiner healing over a slow link) has attested long before, so the others
    decide with it at once, however short their deadline."""
    listeners = {}

    def membership(rank):
        quorum = Quorum(quorum_id=7, members=MEMBERS, index=rank, max_step=3, healed=False)
        return SimpleNamespace(quorum=quorum, gossip_timeout=0.3, min_workers=1, name=f"worker_{rank:04d}",
                               on_quorum_group=lambda listener: listeners.__setitem__(rank, listener))

    memberships = {rank: membership(rank) for rank in range(3)}
    transports = {rank: ElasticTransport(6, memberships[rank], member_auth=MemberAuthenticator(SECRET))
                  for rank in range(3)}
    groups = gloo_groups(3, on_configured=lambda rank: lambda store: listeners[rank](store, 7, MEMBERS, rank))
    assert all(_attested(groups[0].quorum_store, SECRET, rank) for rank in range(3))  # before any exchange
    for rank in range(3):
        memberships[rank].process_group = groups[rank]
    assert _run([0, 1], lambda rank: transports[rank].admitted()) == [(0, 1, 2), (0, 1, 2)]
    assert transports[2].admitted() == (0, 1, 2)  # later: it reads the same decision


@pytest.mark.timeout(60)
def test_on_gloo_a_silent_member_is_reported_once_per_member_set_not_every_quorum(gloo_groups):
    first, second = gloo_groups(3), gloo_groups(3)
    transports = {0: _gloo_transport(first[0], 0, SECRET, gossip_timeout=30.0),
                  1: _gloo_transport(first[1], 1, SECRET, gossip_timeout=0.3)}
    reported = []
    for quorum_id, groups in ((7, first), (8, second)):  # the same members meet again in a new quorum (new group)
        for rank in (0, 1):
            membership = transports[rank].membership
            membership.quorum = Quorum(quorum_id=quorum_id, members=MEMBERS, index=rank, max_step=3, healed=False)
            membership.process_group = groups[rank]
        assert _admit_on_gloo(transports, groups, quorum_id) == {0: (0, 1), 1: (0, 1)}
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
        assert commits[0][1] is not None  # reported: the next quorum agrees again
