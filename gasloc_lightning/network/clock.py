"""SimulatedClock: a worker's simulated time, advanced by inner steps, exchanges and all-reduces; Throttle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gasloc_lightning.network.model import NetworkModel, Pair, _HasMixingWeights, _pair
from gasloc_lightning.network.validation import _non_negative, _finite

def check_static_membership(network: NetworkModel) -> None:
    """Refuse a network with preemption for an engine whose workers all stay for the whole run."""
    if network.preemption is not None:
        raise ValueError(
            f"the network has preemption ({network.preemption!r}): workers that leave and come back need elastic "
            "membership, which this engine does not have (every worker stays for the whole run). Simulate it "
            "with gasloc-sim (network=preemption), or run gasloc-elastic with 'elastic.chaos=[term:W@S,"
            "restart:W@S2]'; or drop it: network.preemption=null")


class SimulatedClock:
    """The simulated time of one rank, in seconds, advanced by compute and communication.

    Every rank keeps its own clock. Inner steps advance it by ``NetworkModel.step_time``; an
    exchange needs the peers' clocks, which they send with their payload (as float64: both
    ends of a pair must compute bit-identical completion times); an all-reduce needs the
    largest clock. All methods return the new time.

    Args:
        network: the modelled network and compute.
        rank: this worker's rank in [0, n).
        membership: ``"static"`` (every worker stays: a network with ``preemption`` is refused) or ``"elastic"``
            (an engine that honours the network's preemption, such as the simulator's churn).
    """

    def __init__(self, network: NetworkModel, *, rank: int, membership: str = "static") -> None:
        if not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel, got {type(network).__name__}")
        if membership not in ("static", "elastic"):
            raise ValueError(f"membership must be 'static' or 'elastic', got {membership!r}")
        if membership == "static":
            check_static_membership(network)
        self._network = network
        self._rank = network._rank(rank)
        self._time = 0.0
        self._compute_time = 0.0
        self._steps = 0  # inner steps taken: the index of the next step's jitter
        self._posted_at: float | None = None

    def __repr__(self) -> str:
        return f"SimulatedClock(rank={self._rank}, time={self._time!r})"

    @property
    def time(self) -> float:
        """Simulated seconds since the start of training (logged as ``sim_time``)."""
        return self._time

    @property
    def compute_time(self) -> float:
        """Simulated seconds spent computing; ``time - compute_time`` went to communication and waiting."""
        return self._compute_time

    @property
    def pending(self) -> bool:
        """Whether an exchange is posted and not yet completed."""
        return self._posted_at is not None

    def advance_compute(self, steps: int = 1) -> float:
        """Run ``steps`` inner steps: ``time += steps * step_time(rank)``.

        Args:
            steps: inner steps taken, >= 0.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        network, first = self._network, self._steps
        if network.compute_jitter is None:
            elapsed = steps * network.step_time(self._rank)
        else:
            elapsed = sum(network.step_time(self._rank, step) for step in range(first, first + steps))
        self._steps += steps
        self._time += elapsed
        self._compute_time += elapsed
        return self._time

    def exchange(
        self, *, peer_clocks: Mapping[int, float], pairs: Iterable[Pair], nbytes: float | None = None
    ) -> float:
        """A blocking gossip exchange with this round's peers (``post_exchange`` + ``complete_exchange``).

        Args:
            peer_clocks: ``{peer: its clock when it posted}`` for every peer of this rank;
                empty when the rank sits out the round.
            pairs: every exchange of the round, as every rank computes it (see ``round_pairs``).
            nbytes: bytes each side sends; default the network's ``message_bytes()``.
        """
        self.post_exchange()
        return self.complete_exchange(peer_clocks=peer_clocks, pairs=pairs, nbytes=nbytes)

    def post_exchange(self) -> float:
        """Start an exchange now; returns the clock to send to the peers with the payload."""
        if self._posted_at is not None:
            raise ValueError("an exchange is already pending: call complete_exchange first")
        self._posted_at = self._time
        return self._time

    def complete_exchange(
        self, *, peer_clocks: Mapping[int, float], pairs: Iterable[Pair], nbytes: float | None = None
    ) -> float:
        """Finish the posted exchange: ``time = max(time, latest end of this rank's exchanges)``.

        The exchange with peer j ends at ``max(own clock at post, j's clock at post) +
        pairwise_time`` for both; compute done since the post overlaps it.

        Args:
            peer_clocks: ``{peer: its clock at post}`` for every peer of this rank.
            pairs: every exchange of the round, as every rank computes it.
            nbytes: bytes each side sends; default the network's ``message_bytes()``.
        """
        if self._posted_at is None:
            raise ValueError("no exchange is pending: call post_exchange first")
        end = self._exchange_end(self._posted_at, peer_clocks, pairs, nbytes)
        self._posted_at = None
        self._time = max(self._time, end)
        return self._time

    def all_reduce(self, *, max_clock: float, nbytes: float | None = None, ranks: Sequence[int] | None = None) -> float:
        """An all-reduce (DiLoCo's per round): ``time = max clock + all_reduce_time(nbytes, ranks)``.

        Args:
            max_clock: the largest clock over the taking part ranks when the all-reduce starts.
            nbytes: bytes of the reduced vector; default the network's ``message_bytes()``.
            ranks: the ranks taking part (default all; the live ones under churn).
        """
        start = max(self._time, _finite("max_clock", max_clock))
        self._time = start + self._network.all_reduce_time(self._nbytes(nbytes), ranks)
        return self._time

    def ddp_step(self, *, nbytes: float | None = None) -> float:
        """One DDP step: every rank computes, then a gradient all-reduce at the largest clock.

        DDP synchronises every step, so all clocks are equal between steps and the largest
        compute end is this clock plus the slowest rank's step time: no clocks need sending.
        The all-reduce is not overlapped with the backward pass (an upper bound).

        Args:
            nbytes: gradient bytes; default the network's ``message_bytes()``.
        """
        network, step = self._network, self._steps  # every rank is at the same step under DDP
        slowest = max(network.step_time(r, step) for r in range(network.world_size))
        self._compute_time += network.step_time(self._rank, step)
        self._steps += 1
        self._time += slowest + network.all_reduce_time(self._nbytes(nbytes))
        return self._time

    def follow(self, time: float) -> float:
        """Take another clock's time (a rank that shares its worker's leader's clock)."""
        self._time = max(self._time, _finite("time", time))
        return self._time

    def state_dict(self) -> dict[str, Any]:
        """The clock, for checkpoints."""
        return {
            "rank": self._rank,
            "time": self._time,
            "compute_time": self._compute_time,
            "posted_at": self._posted_at,
            "steps": self._steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a clock saved by :meth:`state_dict` on the same rank."""
        if state["rank"] != self._rank:
            raise ValueError(f"state_dict is of rank {state['rank']}, this clock is rank {self._rank}")
        self._time = _finite("time", state["time"])
        self._compute_time = _finite("compute_time", state["compute_time"])
        self._steps = int(state.get("steps", 0))  # clocks saved before the jitter had no step count
        posted = state["posted_at"]
        self._posted_at = None if posted is None else _finite("posted_at", posted)

    def _nbytes(self, nbytes: float | None) -> float:
        return self._network.message_bytes() if nbytes is None else _non_negative("nbytes", nbytes)

    def _exchange_end(
        self, start: float, peer_clocks: Mapping[int, float], pairs: Iterable[Pair], nbytes: float | None
    ) -> float:
        """Latest end of this rank's exchanges that start at ``start`` (``start`` itself if none)."""
        flows = self._network.concurrent_flows(pairs)
        size, end = self._nbytes(nbytes), start
        for peer, clock in sorted(peer_clocks.items()):
            pair = _pair(self._network, (self._rank, peer))
            if pair not in flows:
                raise ValueError(f"peer_clocks has peer {peer}, but pairs has no exchange {pair}")
            ready = max(start, _finite(f"peer_clocks[{peer}]", clock))
            end = max(end, ready + self._network.pairwise_time(self._rank, peer, size, flows[pair]))
        return end


class Throttle:
    """Optional real throttling, for demos: sleep for the modelled time a clock spends off compute.

    Each call sleeps ``scale`` x the growth, since the last call, of ``clock.time -
    clock.compute_time``: the simulated seconds this worker spent communicating or waiting for
    slower peers. Compute is not slept (the proxy model computes for real), nor is a transfer
    that overlap hid under compute. ``scale`` 0 never sleeps.

    Args:
        clock: the worker's simulated clock.
        scale: real seconds per simulated second, >= 0 (``NetworkModel.throttle``).
        sleep: the sleeping function (``time.sleep``; tests pass a recorder).
    """

    def __init__(self, clock: SimulatedClock, scale: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self._clock, self._scale, self._sleep = clock, _non_negative("scale", scale), sleep
        self._seen = clock.time - clock.compute_time
        self.slept = 0.0  # real seconds asked of ``sleep`` so far

    def __call__(self) -> float:
        """Sleep for the new time off compute; returns the real seconds slept now."""
        off_compute = self._clock.time - self._clock.compute_time
        seconds = self._scale * max(0.0, off_compute - self._seen)
        self._seen = off_compute
        if seconds > 0.0:
            self._sleep(seconds)
            self.slept += seconds
        return seconds


def round_pairs(topology: _HasMixingWeights, world_size: int, round_index: int) -> list[Pair]:
    """Every exchange of round t as sorted ``(i, j)`` pairs, i < j: identical on every rank.

    Args:
        topology: the gossip graph (a :class:`gasloc_lightning.topology.Topology`).
        world_size: n.
        round_index: t.
    """
    pairs = set()
    for i in range(world_size):
        for j in topology.mixing_weights(i, world_size, round_index):
            pairs.add((min(i, j), max(i, j)))
    return sorted(pairs)


