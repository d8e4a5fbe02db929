"""Run by tests/test_member_auth_tamper.py in a subprocess of its own (a gloo abort must fail this process, not
pytest): three ranks of a real gloo group in threads, member and message authentication on, and a client of the
quorum's store without the secret that deletes the agreed decision and rank 0's attestation after ranks 0 and 2
agreed, so that rank 1 agrees on another set. Then every rank runs an all-reduce. Runs twice: with the read-back,
then with it disabled ("tags-only"). Prints one JSON line per mode and rank and "survived" at the end (an abort
never gets there)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
from torch.distributed import TCPStore

from gasloc_lightning.comm import elastic_transport
from gasloc_lightning.comm.elastic_transport import ElasticTransport
from gasloc_lightning.comm.endpoints import BoundProcessGroupGloo, Endpoint
from gasloc_lightning.comm.member_auth import MemberAuthenticator, attest
from gasloc_lightning.comm.membership import Quorum
from gasloc_lightning.comm.message_auth import MessageAuthenticator

SECRET, MEMBERS, QID = b"the-run-secret-of-16+", ("worker_0000:a", "worker_0001:b", "worker_0002:c"), 7


def main(mode: str) -> None:
    if mode == "tags-only":  # the read-back never sees the edit (an attacker that wins the timing race):
        # only the agreement-derived gloo tags keep the members' different rings apart
        elastic_transport.still_agreed = lambda *args, **kwargs: True
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    groups = [BoundProcessGroupGloo(endpoint=Endpoint(), timeout=timedelta(seconds=20)) for _ in range(3)]
    threads = [threading.Thread(target=groups[r].configure, args=(f"127.0.0.1:{store.port}/q/1", f"r{r}", r, 3))
               for r in range(3)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]

    def transport(rank):
        membership = SimpleNamespace(quorum=Quorum(quorum_id=QID, members=MEMBERS, index=rank, max_step=3,
                                                   healed=False),
                                     process_group=groups[rank], gossip_timeout=1.0, min_workers=2,
                                     name=f"worker_{rank:04d}")
        return ElasticTransport(600, membership, member_auth=MemberAuthenticator(SECRET),
                                message_auth=MessageAuthenticator(SECRET))

    transports = [transport(rank) for rank in range(3)]
    attacker = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=5))

    def member_keys():
        return {key for key in attacker.list_keys() if "gasloc-member/" in key}

    def seen(count: int) -> set:  # a TCPStore set gets no reply: wait until the store has taken it
        deadline = time.monotonic() + 20  # a failure deadline only
        while len(keys := member_keys()) < count:
            assert time.monotonic() < deadline, "the attestations never reached the store"
        return keys

    attest(groups[0].quorum_store, quorum_id=QID, members=MEMBERS, index=0, authenticator=transports[0].member_auth)
    first = seen(1)
    for rank in (1, 2):
        attest(groups[rank].quorum_store, quorum_id=QID, members=MEMBERS, index=rank,
               authenticator=transports[rank].member_auth)
    seen(3)
    admitted = {rank: transports[rank].admitted() for rank in (0, 2)}
    for key in member_keys():  # the decision (longer than an attestation) and rank 0's attestation go
        if len(attacker.get(key)) > 32 or key in first:
            attacker.delete_key(key)
    admitted[1] = transports[1].admitted()
    outcome = {}

    def reduce(rank):
        try:
            transports[rank].all_reduce_mean(torch.ones(600))
            outcome[rank] = "completed"
        except Exception as error:  # noqa: BLE001 - reported below
            outcome[rank] = type(error).__name__

    threads = [threading.Thread(target=reduce, args=(rank,)) for rank in range(3)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    for rank in range(3):
        error = transports[rank].take_error()
        print(json.dumps({"mode": mode, "rank": rank, "admitted": list(admitted[rank]), "all_reduce": outcome[rank],
                          "reported": None if error is None else str(error)[:200],
                          "tampered": transports[rank].tampered_agreements}), flush=True)
    for group in groups:
        group.close()


if __name__ == "__main__":
    for mode in ("read-back", "tags-only"):  # one interpreter for both (importing torch is the slow part)
        main(mode)
    print("survived", flush=True)
