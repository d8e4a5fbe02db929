"""A ring all-reduce (sum) over a chosen subset of a process group's ranks, point to point, each hop's chunk
optionally tagged with a keyed hash.

Why not gloo's own all-reduce: it runs over every rank of the group, so a quorum member refused by member
authentication (:mod:`~gasloc_lightning.comm.member_auth`) would receive partial sums of the others' models.
And a sum cannot carry the contributors' tags: a tag is checked per hop instead. Each hop's sender is a ring
neighbour that proved it knows the secret, and the chunk it sends is tagged for (collective, phase, step,
sender, receiver); the receiver adds or keeps a chunk only once its tag checks. So every byte that enters a
sum comes from a member that holds the secret (what such a member sends is trusted, as for a heal).

The algorithm is the bandwidth-optimal ring: a reduce-scatter (n - 1 steps, each rank ends owning the full
sum of one chunk) then an all-gather (n - 1 steps that forward the owned sums unchanged), so every member
ends with the same bits. Each rank sends and receives 2 (n - 1) / n of the tensor, as gloo's ring does; the
tags add 2 (n - 1) / n of the tensor hashed on each side per all-reduce (the sender's hash overlaps the send).

Nothing here imports Lightning.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gasloc_lightning.comm.message_auth import TAG_BYTES, MessageAuthenticator, context, tag_bytes, tag_tensor

__all__ = ["RING_CHUNK_TAG", "RING_TAG_TAG", "UnauthenticMessageError", "ring_all_reduce_sum", "wait_all"]

RING_CHUNK_TAG, RING_TAG_TAG = 1004, 1005  # defaults, clear of torchft's PGTransport tags (1, 2, 3+i); the elastic
# transport passes tags derived from the quorum's agreement instead (``ElasticTransport.gloo_tag``)


class UnauthenticMessageError(RuntimeError):
    """A received message's tag did not check: it was dropped, never used."""


def ring_all_reduce_sum(pg: Any, tensor: Tensor, *, ring: tuple[int, ...], rank: int, deadline: float,
                        authenticator: MessageAuthenticator | None = None, use: bytes = b"",
                        tags: tuple[int, int] = (RING_CHUNK_TAG, RING_TAG_TAG)) -> Tensor:
    """In-place sum of ``tensor`` over the ranks in ``ring`` (sorted, ``rank`` among them) of ``pg``.

    Args:
        pg: a process group with ``send``/``recv`` (torchft's reconfigurable gloo group).
        tensor: a contiguous 1-D CPU tensor, the same size on every rank of the ring.
        ring: the participating ranks; the others are never sent or read anything.
        rank: this process's rank in ``pg``.
        deadline: ``time.monotonic()`` by which the whole all-reduce must be done (then a ``RuntimeError``).
        authenticator: tags every chunk sent and checks every chunk received (``None``: no tags).
        use: what this all-reduce is (a :func:`~gasloc_lightning.comm.message_auth.context`), bound into the tags.
        tags: the gloo tags of the chunks and of their keyed tags. Members that disagree on the ring must use
            different ones (ElasticTransport derives them from the agreement): gloo aborts the process that
            receives a chunk longer than its posted receive, and chunk sizes follow from ``len(ring)``.

    Raises :class:`UnauthenticMessageError` on a tag that does not check, ``RuntimeError`` on a failed or late
    hop; ``tensor`` is then undefined (callers restore it).
    """
    n, position = len(ring), ring.index(rank)
    if n <= 1:
        return tensor
    bounds = [tensor.numel() * i // n for i in range(n + 1)]

    def chunk(i: int) -> Tensor:
        return tensor[bounds[i % n]:bounds[i % n + 1]]

    right, left = ring[(position + 1) % n], ring[(position - 1) % n]
    scratch = torch.empty(bounds[1] - bounds[0] + 1, dtype=tensor.dtype)  # the largest chunk
    for step in range(n - 1):  # reduce-scatter: chunk (position - step) leaves, (position - step - 1) arrives
        incoming = scratch[: chunk(position - step - 1).numel()]
        _hop(pg, chunk(position - step), incoming, right, left, deadline, authenticator,
             (use, "reduce", step), rank, tags)
        chunk(position - step - 1).add_(incoming)
    for step in range(n - 1):  # all-gather: the owned sums travel on unchanged
        _hop(pg, chunk(position + 1 - step), chunk(position - step), right, left, deadline, authenticator,
             (use, "gather", step), rank, tags)
    return tensor


def wait_all(works: list[Any], deadline: float) -> Exception | None:
    """Wait for every posted gloo operation under ``deadline``, even after one failed, so none is left half posted;
    returns the first failure (a timeout, a closed connection), or None."""
    failure = None
    for work in works:
        try:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception as error:  # noqa: BLE001 - a timeout, a closed connection
            failure = failure or error
    return failure


def _hop(pg: Any, outgoing: Tensor, incoming: Tensor, right: int, left: int, deadline: float,
         authenticator: MessageAuthenticator | None, where: tuple, me: int, tags: tuple[int, int]) -> None:
    """Send ``outgoing`` right and receive ``incoming`` from the left (each with its tag), under the deadline."""
    works = [pg.recv([incoming], left, tags[0]), pg.send([outgoing], right, tags[0])]
    tag_in = torch.zeros(TAG_BYTES, dtype=torch.uint8)
    if authenticator is not None:  # the sender hashes while its chunk is on the wire
        works.append(pg.recv([tag_in], left, tags[1]))
        tag_out = tag_tensor(authenticator.tag(outgoing, context(*where, me, right)))
        works.append(pg.send([tag_out], right, tags[1]))
    failure = wait_all(works, deadline)
    if failure is not None:
        raise RuntimeError(f"ring hop from rank {left} failed: {failure}") from failure
    if authenticator is not None and not authenticator.verify(incoming, context(*where, left, me), tag_bytes(tag_in)):
        raise UnauthenticMessageError(f"the chunk from rank {left} ({where[1]} step {where[2]}) failed its tag")
