"""Churn: workers that leave and join on a seeded schedule, decided per round before training starts.

Between two rounds, each live worker leaves with probability ``p_leave`` and each absent worker
comes back with probability ``p_join = 1 / mean_downtime_rounds``, so that in the stationary regime a
fraction ``down_fraction = p_leave / (p_leave + p_join)`` of the workers is down. A round's graph is
the topology over its live workers (renumbered 0..m-1 in worker order), and a worker that joins takes
the state of a live peer (parameters, inner optimizer state, outer state and clock), drawn from the
same seeded generator. The whole schedule is drawn up front, so a schedule that ever leaves fewer
than ``min_live`` workers is refused before any step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChurnEvent:
    """Before round t: ``joins`` maps each joining worker to the live peer whose state it takes."""

    round_index: int
    live: tuple[int, ...]
    left: tuple[int, ...]
    joins: dict[int, int]


class ChurnSchedule:
    """A seeded leave/join schedule over ``workers`` workers and ``rounds`` rounds.

    Args:
        workers: n.
        rounds: rounds to draw.
        down_fraction: stationary share of workers down, in [0, 1).
        mean_downtime_rounds: mean rounds a worker stays away (>= 1).
        min_live: the quorum: fewer live workers in any round is refused.
        seed: seed of the schedule.
    """

    def __init__(self, *, workers: int, rounds: int, down_fraction: float = 0.0,
                 mean_downtime_rounds: float = 5.0, min_live: int = 2, seed: int = 0) -> None:
        if not 0.0 <= down_fraction < 1.0:
            raise ValueError(f"down_fraction must lie in [0, 1), got {down_fraction!r}")
        if not mean_downtime_rounds >= 1.0:
            raise ValueError(f"mean_downtime_rounds must be >= 1, got {mean_downtime_rounds!r}")
        if isinstance(min_live, bool) or not isinstance(min_live, int) or not 1 <= min_live <= workers:
            raise ValueError(f"min_live (the quorum) must be an int in [1, workers={workers}], got {min_live!r}")
        self.workers, self.rounds, self.down_fraction = workers, rounds, float(down_fraction)
        p_join = 1.0 / mean_downtime_rounds
        p_leave = down_fraction * p_join / (1.0 - down_fraction)
        self.events = self._draw(p_leave, p_join, seed)
        smallest = min((len(e.live) for e in self.events), default=workers)
        if smallest < min_live:
            at = next(e.round_index for e in self.events if len(e.live) == smallest)
            raise ValueError(
                f"the churn schedule (down_fraction={down_fraction}, seed={seed}) leaves {smallest} live workers "
                f"in round {at}, below the quorum min_live={min_live}: lower down_fraction or min_live"
            )

    def _draw(self, p_leave: float, p_join: float, seed: int) -> list[ChurnEvent]:
        generator = torch.Generator().manual_seed(seed)
        alive = torch.ones(self.workers, dtype=torch.bool)
        events = []
        for t in range(self.rounds):
            draws = torch.rand(self.workers, generator=generator)
            leaving = alive & (draws < p_leave) if t > 0 else torch.zeros_like(alive)
            joining = ~alive & (draws < p_join)
            stay = alive & ~leaving
            sources = stay.nonzero().flatten()
            joins = {}
            for worker in joining.nonzero().flatten().tolist():
                if len(sources):
                    pick = int(torch.randint(len(sources), (1,), generator=generator))
                    joins[worker] = int(sources[pick])
            alive = stay.clone()
            alive[list(joins)] = True
            events.append(ChurnEvent(t, tuple(alive.nonzero().flatten().tolist()),
                                     tuple(leaving.nonzero().flatten().tolist()), joins))
        return events

    def live(self, round_index: int) -> tuple[int, ...]:
        return self.events[round_index].live if round_index < len(self.events) else self.events[-1].live

    def goodput(self) -> float:
        """Share of worker-rounds done by live workers."""
        return sum(len(e.live) for e in self.events) / (self.workers * max(1, len(self.events)))
