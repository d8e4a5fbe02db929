"""What the simulator refuses before any step: graphs without n, unstable gamma, runs that cannot fit.

The topology checks are the strategy's own: :meth:`~gasloc_lightning.topology.Topology.resolve_momentum` (the
topology's default gamma, and a consensus rate below 1), which ``GASLoCStrategy.check_configuration`` calls too.
"""

from __future__ import annotations

import os

from gasloc_lightning.topology import Topology, TopologyError

# Model-size float32 tensors per replica: parameters, gradients, two AdamW moments, round start and
# anchor, and (overlap or bfloat16 messages) the correction and the point in flight.
_STATE_COPIES = 8


def resolve_outer_momentum(
    topology: Topology, workers: int, requested: float | None, outer_form: str, overlap: bool, delayed_weight: float
) -> float:
    """gamma for ``workers``: the requested value, or the topology's default; refused when unstable.

    Raises:
        ValueError: the topology cannot have ``workers`` workers, or gamma does not contract.
    """
    try:
        return topology.resolve_momentum(workers, requested, outer_form, overlap, delayed_weight=delayed_weight)
    except TopologyError as error:
        raise ValueError(f"sim.workers={workers} has no valid {topology.name!r} topology: {error}") from error


def resolve_outer_momentum_for_sizes(
    topology: Topology, sizes: list[int], requested: float | None, outer_form: str, overlap: bool,
    delayed_weight: float,
) -> float:
    """gamma for every live-set size in ``sizes`` (a churn schedule's): the requested value, or the smallest of the
    topology's defaults; refused unless it contracts at every size, as the elastic mode checks every quorum size.

    Raises:
        ValueError: the topology cannot have one of the sizes, or gamma does not contract at one of them.
    """
    sizes = sorted({m for m in sizes if m > 1})
    if not sizes:
        return 0.0 if requested is None else float(requested)
    gammas = [resolve_outer_momentum(topology, m, requested, outer_form, overlap, delayed_weight) for m in sizes]
    gamma = min(gammas)
    for m in sizes:  # the smallest default must contract at every size too (the topology's own rules apply)
        try:
            topology.resolve_momentum(m, gamma, outer_form, overlap, delayed_weight=delayed_weight)
        except ValueError as error:
            raise ValueError(f"under churn {m} workers are live in some round: {error}") from error
    return gamma


def estimate_bytes(*, workers: int, parameters: int, batch_size: int, block_size: int, n_layer: int,
                   n_embd: int, n_head: int, vocab_size: int) -> int:
    """Rough peak bytes of one simulated step: model-size state per replica plus the activations kept
    for the backward pass of every replica's batch (float32)."""
    tokens = workers * batch_size * block_size
    per_layer = 16 * n_embd + 3 * n_head * block_size  # residual, qkv, MLP, attention scores and probabilities
    activations = tokens * (n_layer * per_layer + 3 * vocab_size + 4 * n_embd)
    return 4 * (workers * parameters * _STATE_COPIES + activations)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (or the physical memory where that file is missing)."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(estimated: int, limit: int | None = None) -> None:
    """Refuse, with the estimate, a run needing more than ``limit`` bytes (default: 80% of what is available)."""
    limit = int(0.8 * available_bytes()) if limit is None else limit
    if estimated > limit:
        raise ValueError(
            f"the simulation needs about {estimated / 2**30:.2f} GiB ({estimated:,} bytes) but {limit / 2**30:.2f} GiB "
            f"may be used: lower sim.workers, data.batch_size or the model size"
        )
