"""Seeded random matchings and permutations shared by the random topologies (every rank draws the same).

Reproducibility: the draws of round t come from a ``torch.Generator`` (CPU, Mersenne Twister
mt19937) seeded with :func:`stream_seed`, a fixed integer formula (SplitMix64 chained over
(stream id, seed, n, t)); nothing depends on Python's ``random`` or string hashing, whose
streams are not specified across versions. ``tests/fixtures/matchings.json`` pins the first
rounds' matchings, so an upgrade of torch that changed them fails a test.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TypeVar

import torch
from torch import Tensor

from gasloc_lightning.topology.base import _DTYPE

T = TypeVar("T")

_MASK64 = (1 << 64) - 1
# One independent stream per kind of draw; the integers are part of the format: never renumber.
STREAM_IDS: dict[str, int] = {
    "one_peer": 1,
    "two_peer": 2,
    "bandwidth_aware": 3,
    "bandwidth_aware:spread": 4,
    "bandwidth_aware:block_orders": 5,
}


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def stream_seed(stream: str, seed: int, world_size: int, round_index: int) -> int:
    """The 64-bit seed of one round's draws: SplitMix64 folded over (stream id, seed, n, t).

    Args:
        stream: which draw (a key of ``STREAM_IDS``: "one_peer", "two_peer", ...).
        seed: the topology's shared seed (any int; negative ones are taken modulo 2^64).
        world_size: n.
        round_index: t.
    """
    if stream not in STREAM_IDS:
        raise ValueError(f"stream must be one of {sorted(STREAM_IDS)}, got {stream!r}")
    state = 0
    for part in (STREAM_IDS[stream], seed, world_size, round_index):
        state = _splitmix64(state ^ (part & _MASK64))
    return state


class RoundRandom:
    """The random draws of one round, identical on every rank (see :func:`stream_seed`)."""

    def __init__(self, stream: str, seed: int, world_size: int, round_index: int) -> None:
        self._generator = torch.Generator().manual_seed(stream_seed(stream, seed, world_size, round_index))

    def permutation(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self._generator).tolist()

    def shuffled(self, items: Sequence[T]) -> list[T]:
        return [items[i] for i in self.permutation(len(items))]

    def uniforms(self, count: int) -> list[float]:
        """``count`` draws from U[0, 1) in float64."""
        return torch.rand(count, generator=self._generator, dtype=torch.float64).tolist()

    def uniform(self) -> float:
        return self.uniforms(1)[0]

    def below(self, n: int) -> int:
        """A uniform integer in [0, n)."""
        return int(torch.randint(n, (1,), generator=self._generator))


def _add_edge(weights: dict[int, float], peer: int, weight: float) -> None:
    # Coinciding edges (ring of 2, torus with a side of 2) add up, keeping row sums as usual.
    weights[peer] = weights.get(peer, 0.0) + weight


@lru_cache(maxsize=16)
def _shuffled_ranks(stream: str, seed: int, world_size: int, round_index: int) -> tuple[int, ...]:
    return tuple(RoundRandom(stream, seed, world_size, round_index).permutation(world_size))


@lru_cache(maxsize=16)
def _matching_partners(seed: int, world_size: int, round_index: int) -> tuple[int, ...]:
    """partner[i] of a uniformly random perfect matching; partner[i] == i for the odd one out."""
    order = _shuffled_ranks("one_peer", seed, world_size, round_index)
    partners = list(range(world_size))
    for a, b in zip(order[0::2], order[1::2]):
        partners[a], partners[b] = b, a
    return tuple(partners)


@lru_cache(maxsize=16)
def _ring_neighbours(seed: int, world_size: int, round_index: int) -> tuple[tuple[int, int], ...]:
    """(previous, next) of each rank on a ring over a random permutation."""
    order = _shuffled_ranks("two_peer", seed, world_size, round_index)
    neighbours = [(0, 0)] * world_size
    for position, rank in enumerate(order):
        neighbours[rank] = (order[position - 1], order[(position + 1) % world_size])
    return tuple(neighbours)


def _matching_matrix(partners: Sequence[int], sparse: bool) -> Tensor:
    """W = (I + P) / 2 of a matching (P its involution; the odd one out keeps 1 on the diagonal).

    Entry for entry what Topology.mixing_matrix builds from the weights, only faster.
    """
    world_size = len(partners)
    if not sparse:
        identity = _identity(world_size)
        return 0.5 * (identity + identity[list(partners)])  # row i of P is e_partner(i)
    ranks = torch.arange(world_size)
    indices = torch.stack([torch.cat([ranks, ranks]), torch.cat([ranks, torch.tensor(partners)])])  # (2, 2n)
    values = torch.full((2 * world_size,), 0.5, dtype=_DTYPE)  # the odd one out's two halves add up
    shape = (world_size, world_size)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False).coalesce()


@lru_cache(maxsize=4)
def _identity(world_size: int) -> Tensor:
    return torch.eye(world_size, dtype=_DTYPE)

