"""Seeded random matchings and permutations shared by the random topologies (every rank draws the same)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor


from gasloc_lightning.topology.base import _DTYPE

def _add_edge(weights: dict[int, float], peer: int, weight: float) -> None:
    # Coinciding edges (ring of 2, torus with a side of 2) add up, keeping row sums as usual.
    weights[peer] = weights.get(peer, 0.0) + weight


@lru_cache(maxsize=16)
def _shuffled_ranks(tag: str, seed: int, world_size: int, round_index: int) -> tuple[int, ...]:
    # A string seed is hashed with sha512, so every process draws the same permutation
    # without communicating (and independently of PYTHONHASHSEED).
    ranks = list(range(world_size))
    random.Random(f"gasloc:{tag}:{seed}:{world_size}:{round_index}").shuffle(ranks)
    return tuple(ranks)


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

