"""What member authentication costs per quorum change: the attest-and-agree of ``comm/member_auth.py``.

Not a timed test. Member authentication runs once per quorum (a quorum change: a join, a leave, a reported failure),
right after torchft has configured the quorum's gloo group over the quorum's rendezvous store. So its cost is put
next to that rendezvous: for each quorum size n, n members (threads of this process, each with its own store
client, as every worker has) alternately (a) build a gloo group of n ranks over a fresh prefix of one ``TCPStore``
(what torchft's ``configure`` does at every quorum change) and (b) run ``verify_members`` with every member holding
the secret (nobody is waited for: the last member to attest decides at once). The output is the median of each and
their ratio (a ratio measured within one run holds on a noisy machine, an absolute time does not).

Over a real network the agreement costs store round trips, not bytes: each member writes its attestation (1),
looks for a decision and for the others' attestations (2 per look, looks 10 ms apart doubling to 200 ms while
members are missing), then the deciding member reads each attestation (2 per member) and writes the decision with
``compare_set`` (1); the others read it (2). A member absent (no secret, or dead since the quorum's group was
configured) costs a wait of ``gossip_timeout`` instead (``docs/security.md``).

Usage::

    .venv/bin/python benchmarks/member_auth.py                 # n = 2, 4, 8; 20 repeats
    .venv/bin/python benchmarks/member_auth.py --sizes 2 4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from gasloc_lightning.comm.member_auth import MemberAuthenticator, verify_members

SECRET = b"benchmark-secret"


def _clients(port: int, n: int) -> list[TCPStore]:
    return [TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
            for _ in range(n)]


def _rendezvous(clients: list[TCPStore], prefix: str) -> float:
    """A gloo group of len(clients) ranks over ``prefix``: torchft's configure at a quorum change."""
    n = len(clients)
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        groups = list(pool.map(lambda rank: ProcessGroupGloo(PrefixStore(prefix, clients[rank]), rank, n,
                                                             timedelta(seconds=30)), range(n)))
    elapsed = time.perf_counter() - start
    del groups
    return elapsed


def _agree(clients: list[TCPStore], prefix: str, quorum_id: int) -> float:
    n = len(clients)
    members = tuple(f"worker_{rank:04d}:{quorum_id:08x}" for rank in range(n))
    authenticator = MemberAuthenticator(SECRET)
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        checks = list(pool.map(lambda rank: verify_members(
            PrefixStore(prefix, clients[rank]), quorum_id=quorum_id, members=members, index=rank,
            authenticator=authenticator, timeout=30.0), range(n)))
    elapsed = time.perf_counter() - start
    assert all(check.admitted == tuple(range(n)) for check in checks), checks
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print(f"{'members':>7} {'rendezvous ms':>14} {'agreement ms':>13} {'agreement / rendezvous':>23}")
    quorum = 0
    for n in args.sizes:
        clients = _clients(master.port, n)
        rendezvous, agreement = [], []
        for _ in range(args.repeats):  # alternated: both see the same load
            quorum += 1
            rendezvous.append(_rendezvous(clients, f"/q{quorum}/pg"))
            agreement.append(_agree(clients, f"/q{quorum}/pg", quorum))
        r, a = statistics.median(rendezvous) * 1e3, statistics.median(agreement) * 1e3
        print(f"{n:>7} {r:>14.1f} {a:>13.1f} {a / r:>23.2f}")


if __name__ == "__main__":
    main()
