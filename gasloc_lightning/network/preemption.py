"""Preemption: workers that leave with notice and come back later (spot or preemptible machines).

A :class:`Preemption` is part of a network preset (``network=preemption``): it describes *who is
there*, not how fast the links are, so only an engine with elastic membership can honour it. The
simulator turns it into its churn schedule (:class:`gasloc_lightning.sim.ChurnSchedule`); the elastic
mode lives it (``gasloc-elastic 'elastic.chaos=[term:W@S,restart:W@S2]'``); the static strategies
keep every worker for the whole run, so their clock refuses a network that carries one (see
:class:`~gasloc_lightning.network.SimulatedClock`).

Semantics (the elastic mode's): a worker gets its notice during a round, finishes that round
(exchange included), and leaves at its end, so no peer loses an exchange; while away it computes
nothing and its data stream stands still; it comes back at a later round boundary as a fresh process
(its shard's sampler starts afresh) and takes the state of one live peer (point, outer state, inner
optimizer state), as ``gasloc-elastic`` heals a restarted worker.
"""

from __future__ import annotations

from gasloc_lightning.network.validation import _non_negative, _positive_finite, _positive_int


class Preemption:
    """A seeded leave/return process per worker, in rounds.

    Between two rounds each live worker leaves with probability ``p_leave`` and each absent one
    returns with probability ``1 / mean_downtime_rounds``, so that a fraction ``down_fraction`` of
    the workers is away in the stationary regime.

    Args:
        down_fraction: stationary share of workers away, in [0, 1).
        mean_downtime_rounds: mean rounds a preempted worker stays away, >= 1.
        min_live: the quorum: a schedule that ever leaves fewer workers is refused, >= 1.
        seed: seed of the schedule.
    """

    def __init__(self, *, down_fraction: float = 0.2, mean_downtime_rounds: float = 5.0, min_live: int = 2,
                 seed: int = 0) -> None:
        fraction = _non_negative("down_fraction", down_fraction)
        if not fraction < 1.0:
            raise ValueError(f"down_fraction must lie in [0, 1), got {down_fraction!r}")
        downtime = _positive_finite("mean_downtime_rounds", mean_downtime_rounds)
        if downtime < 1.0:
            raise ValueError(f"mean_downtime_rounds must be >= 1, got {mean_downtime_rounds!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.down_fraction, self.mean_downtime_rounds = fraction, downtime
        self.min_live, self.seed = _positive_int("min_live", min_live), seed

    def __repr__(self) -> str:
        return (f"Preemption(down_fraction={self.down_fraction}, mean_downtime_rounds={self.mean_downtime_rounds}, "
                f"min_live={self.min_live}, seed={self.seed})")
