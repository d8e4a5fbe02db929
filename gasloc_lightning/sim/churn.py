"""Churn: workers that leave and join on a seeded schedule, decided per round before training starts.

Between two rounds, each live worker leaves with probability ``p_leave`` and each absent worker
comes back with probability ``p_join = 1 / mean_downtime_rounds``, so that in the stationary regime a
fraction ``down_fraction = p_leave / (p_leave + p_join)`` of the workers is down. A round's graph is
the topology over its live workers (renumbered 0..m-1 in worker order), and a worker that joins takes
the state of a live peer (parameters, inner optimizer state, outer state and clock), drawn from the
same seeded generator. The whole schedule is drawn up front, so a schedule that ever leaves fewer
than ``min_live`` workers is refused before any step.

The semantics are the elastic mode's (``gasloc-elastic``), applied by :class:`~gasloc_lightning.sim.Simulator`:

* a worker leaves *with notice*: it finishes its round, exchange included, and is gone from the next
  round's live set, so no peer loses an exchange (SIGTERM in the elastic mode, a spot preemption notice);
* a down worker computes nothing: no forward or backward pass, no simulated compute time, and its data
  sampler does not advance;
* a joiner is a fresh process: its shard's sampler starts afresh, and it pulls the elastic mode's state
  from its source (live point, outer state: round start and anchor, inner optimizer state: AdamW's two
  moments), about 5 model copies in float32, charged to the source's bytes and to the joiner's clock
  (the source's time plus the transfer over their link);
* collectives (DiLoCo's all-reduce, the consensus) run over the live set, in bytes and in time;
* gamma must be stable for every live-set size the schedule reaches (the elastic mode, which cannot know
  the sizes ahead, checks every size in [max(2, min_workers), max_workers]).

A schedule comes from ``sim.down_fraction`` (drawn here), from a network's
:class:`~gasloc_lightning.network.Preemption` (``network=preemption``), or from a recorded membership
(:meth:`ChurnSchedule.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gasloc_lightning.network import Preemption


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
        self._check_quorum(min_live, f"down_fraction={down_fraction}, seed={seed}")

    @classmethod
    def from_preemption(cls, preemption: Preemption, *, workers: int, rounds: int) -> ChurnSchedule:
        """The schedule of a network's :class:`~gasloc_lightning.network.Preemption` (``network=preemption``)."""
        return cls(workers=workers, rounds=rounds, down_fraction=preemption.down_fraction,
                   mean_downtime_rounds=preemption.mean_downtime_rounds,
                   min_live=min(preemption.min_live, workers), seed=preemption.seed)

    @classmethod
    def replay(cls, *, workers: int, live_by_round: Sequence[Sequence[int]], min_live: int = 1) -> ChurnSchedule:
        """A given membership, round by round (for instance the quorums an elastic run recorded).

        A worker absent from round t-1 and present in round t joins before round t as a fresh process and takes
        the state of the lowest live worker that stays (after an all-reduce round every live worker holds the same
        state; with gossip, the elastic mode's choice of source is torchft's and may differ).

        Args:
            workers: n.
            live_by_round: the live workers of every round, each a non-empty set of ids in [0, n).
            min_live: the quorum every round must reach.
        """
        schedule = cls.__new__(cls)
        schedule.workers, schedule.rounds = workers, len(live_by_round)
        previous: set[int] | None = None
        events = []
        for t, members in enumerate(live_by_round):
            live = sorted({int(w) for w in members})
            if not live or live[0] < 0 or live[-1] >= workers:
                raise ValueError(f"live_by_round[{t}] must be a non-empty list of worker ids in [0, {workers}), "
                                 f"got {members!r}")
            stay = [w for w in live if previous is None or w in previous]
            if not stay:
                raise ValueError(f"live_by_round[{t}]: no worker of round {t - 1} stays, so no joiner has a source")
            joins = {} if previous is None else {w: stay[0] for w in live if w not in previous}
            left = () if previous is None else tuple(sorted(previous - set(live)))
            events.append(ChurnEvent(t, tuple(live), left, joins))
            previous = set(live)
        schedule.events = events
        schedule.down_fraction = 1.0 - schedule.goodput()
        schedule._check_quorum(min_live, "replayed")
        return schedule

    def _check_quorum(self, min_live: int, what: str) -> None:
        smallest = min((len(e.live) for e in self.events), default=self.workers)
        if smallest < min_live:
            at = next(e.round_index for e in self.events if len(e.live) == smallest)
            raise ValueError(
                f"the churn schedule ({what}) leaves {smallest} live workers in round {at}, below the quorum "
                f"min_live={min_live}: lower down_fraction or min_live"
            )

    def live_sizes(self) -> list[int]:
        """Every live-set size the schedule reaches, ascending (the sizes gamma must be stable for)."""
        return sorted({len(e.live) for e in self.events})

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
