"""Member authentication against a client of the quorum's rendezvous store that holds no secret and is no member:
torch's TCPStore lets any client list, read, delete and overwrite every key (issue 34's review, attacks
split_admitted, split_abort and silent_alone). Honest members must never reach gloo with different views of the
agreement (gloo aborts a process that receives a message longer than its posted receive), and a disagreement, or
a worker left alone, is reported every time, never trained through quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import json
import pytest

from gasloc_lightning.comm.elastic_transport import ElasticTransport
from gasloc_lightning.comm.member_auth import MemberAuthenticator, MemberCheck, attest
from gasloc_lightning.comm.membership import Quorum

SECRET = b"the-run-secret-of-16+"
MEMBERS = ("worker_0000:aaa", "worker_0001:bbb", "worker_0002:ccc")
_SCRIPT = Path(__file__).parent / "scripts" / "split_abort.py"


@pytest.fixture
def store_server():
    from gasloc_lightning.comm.endpoints import Endpoint, listening_store

    # The test gets the port only: pytest keeps a test's fixture values until after its teardown, so a store handed
    # to the test would outlive it, with its libuv thread (conftest fails a module that leaves threads).
    held = [listening_store(Endpoint(), timeout=5)]
    yield SimpleNamespace(port=held[0].port)
    held.clear()


def _client(port: int, prefix: str | None = None):
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    return store if prefix is None else PrefixStore(prefix, store)


def _transport(rank: int, port: int, quorum_id: int, *, gossip_timeout: float) -> ElasticTransport:
    membership = SimpleNamespace(name=f"worker_{rank:04d}", min_workers=2, gossip_timeout=gossip_timeout,
                                 quorum=None, process_group=SimpleNamespace(quorum_store=None))
    transport = ElasticTransport(4, membership, member_auth=MemberAuthenticator(SECRET))
    _join(transport, rank, port, quorum_id)
    return transport


def _join(transport: ElasticTransport, rank: int, port: int, quorum_id: int) -> None:
    """The next quorum (torchft: a fresh store prefix per quorum); the member attests as its group is configured."""
    membership = transport.membership
    membership.quorum = Quorum(quorum_id=quorum_id, members=MEMBERS, index=rank, max_step=quorum_id, healed=False)
    membership.process_group.quorum_store = _client(port, f"run/torchft/{quorum_id}/0")
    store = membership.process_group.quorum_store
    attest(store, quorum_id=quorum_id, members=MEMBERS, index=rank, authenticator=transport.member_auth)
    # a TCPStore set gets no reply: a read on the same connection returns once the store has taken it
    store.get(transport.member_auth.key_name(quorum_id=quorum_id, members=MEMBERS, index=rank))


def _delete_member_keys(port: int) -> int:
    attacker = _client(port)  # no secret, not a member: a raw client of the same store
    keys = [key for key in attacker.list_keys() if "gasloc-member/" in key]
    for key in keys:
        attacker.delete_key(key)
    return len(keys)


@pytest.mark.timeout(60)
def test_a_store_client_that_deletes_the_decision_makes_every_disagreeing_member_report_every_time(store_server):
    """split_admitted + silent_alone: members 0 and 1 agree on everyone; the attacker deletes every member-auth
    key; member 2 comes later and decides alone (validly signed). Before its next exchange each of 0 and 1 finds
    the decision it agreed on gone or replaced: tampering, reported, its exchanges fail; member 2, alone, reports
    in every quorum of the same members, not only the first."""
    transports = {0: _transport(0, store_server.port, 7, gossip_timeout=30.0),
                  1: _transport(1, store_server.port, 7, gossip_timeout=30.0),
                  2: _transport(2, store_server.port, 7, gossip_timeout=0.2)}
    for quorum_id in (7, 8):  # the same members meet again: the attack repeats
        if quorum_id != 7:
            for rank, transport in transports.items():
                _join(transport, rank, store_server.port, quorum_id)
        assert transports[0].admitted() == transports[1].admitted() == (0, 1, 2)
        assert [transports[rank].take_error() for rank in (0, 1)] == [None, None]
        assert _delete_member_keys(store_server.port) >= 4  # three attestations and the decision (and older)
        assert transports[2].admitted() == (2,)  # it waited for attestations that were deleted: alone
        assert "no attestation in time" in str(transports[2].take_error())
        for rank in (0, 1):  # the next exchange's look at the agreement
            assert transports[rank].admitted() == (rank,)
            assert "tampered" in str(transports[rank].take_error())
            assert transports[rank].tampered_agreements == quorum_id - 6
            assert transports[rank].gloo_tag(0) != transports[2].gloo_tag(0)  # views differ: never matched in gloo


@pytest.mark.timeout(120)
def test_members_split_by_a_store_client_fail_their_all_reduce_and_report_it_and_no_process_aborts():
    """split_abort on real gloo in a subprocess: before the fix, rank 1 ran a ring of two while ranks 0 and 2 ran
    a ring of three on the same tags, and gloo aborted rank 2's process (SIGABRT) on an oversized chunk.
    Then again with the read-back disabled (an attacker that swaps the decision back and forth between the
    members' reads): the agreement-derived tags alone keep the rings apart."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    process = subprocess.Popen([sys.executable, str(_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        out, err = process.communicate(timeout=100)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0 and out.rstrip().endswith("survived"), (process.returncode, out, err[-2000:])
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for mode, tampered in (("read-back", [1, 0, 1]), ("tags-only", [0, 0, 0])):
        ranks = [line for line in lines if line["mode"] == mode]
        assert [rank["admitted"] for rank in ranks] == [[0, 1, 2], [1, 2], [0, 1, 2]], mode  # the attack split them
        assert all(rank["all_reduce"] == "ElasticCollectiveError" and rank["reported"] for rank in ranks), ranks
        assert [rank["tampered"] for rank in ranks] == tampered, mode


def test_agreements_that_differ_in_anything_use_different_gloo_tags():
    from gasloc_lightning.comm.member_auth import tag_base

    def check(decision: bytes, admitted=(0, 1, 2), quorum_id: int = 7) -> int:
        return tag_base(MemberCheck(quorum_id=quorum_id, admitted=admitted, refused=(),
                                    decision=decision).digest(MEMBERS))

    one = check(b"d1")
    assert one == check(b"d1") and 1 << 24 <= one < 1 << 31
    assert len({one, check(b"d2"), check(b"d1", (1, 2)), check(b"d1", quorum_id=8)}) == 4


def test_a_signed_but_malformed_decision_is_refused_not_raised():
    authenticator = MemberAuthenticator(SECRET)
    for body in (b"\xff", b"x", b"1,,2", b"-1,2", b"2,1", b"9"):
        mac = authenticator._mac("decision", 7, *MEMBERS, body)  # signed: what a dishonest member could write
        assert authenticator.open_decision(mac + body, quorum_id=7, members=MEMBERS) is None


def test_a_secret_shorter_than_16_bytes_is_refused_naming_the_variable():
    """Anyone who lists the store reads MACs made with the secret: a short one could be guessed offline."""
    from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy

    with pytest.raises(ValueError, match="GASLOC_ELASTIC_SECRET.*at least 16"):
        ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, secret="s" * 15)
    ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, secret="s" * 16)
