"""Modelled network and compute, and a simulated clock per rank (issue 4, "uneven networks").

The proxy model that trains on the CPU is tiny, so wall-clock time says nothing about a real
run. :class:`NetworkModel` describes the run being modelled instead: per-link bandwidth and
latency (uniform, as clusters such as two data centres, or as a matrix), a compute speed
factor per worker, and a modelled model size and inner-step time. :class:`SimulatedClock`
turns that into a simulated time per rank, advanced as real training runs: by inner steps
(H, or the paper's H_i per worker) and by gossip exchanges or all-reduces. Everything is
pure Python float64 arithmetic, deterministic, and needs no process group.

Units: bandwidth in Gbit/s (1 Gbit/s = 1e9 / 8 bytes/s), latency and times in seconds,
sizes in bytes.

Cost models (all times in seconds; B a link's bytes/s, a its latency, N the message bytes):

* Pairwise exchange i <-> j (gossip): both directions at once on full-duplex links, so
  ``a + N / (B / f)`` where f counts the concurrent flows sharing the pair's bottleneck
  (:meth:`NetworkModel.concurrent_flows`): the number of the round's exchanges crossing the
  same inter-cluster link, or the number of peers either end talks to at once (two_peer
  sends two messages through one NIC), whichever is larger. Links inside a cluster sit on a
  non-blocking fabric: only the endpoints share.
* Ring all-reduce over m ranks: ``2 (m - 1)`` steps (reduce-scatter then all-gather), each
  moving N / m over every ring link at once, so a step costs the slowest link's
  ``a + N / (m B)``. The ring visits clusters contiguously (rank order within a cluster),
  so it crosses each inter-cluster link at most once per direction: no link is shared.
* Hierarchical all-reduce over k clusters of m_c ranks: a ring reduce-scatter inside every
  cluster (``m_c - 1`` steps of N / m_c on its links), then an all-reduce of the shards
  across clusters, then a ring all-gather inside (as the reduce-scatter). In the middle
  stage the m_c shard owners of a cluster each run a ring with their counterparts in the
  other clusters; those concurrent rings cross the same inter-cluster links and share their
  bandwidth, so together they cost one ring all-reduce of the full N across the k clusters:
  ``2 (k - 1)`` steps of ``a + N / (k B)`` on the slowest inter-cluster link of the ring.
  Clusters run the inside stages in parallel; the slowest cluster sets their time.
* All-reduce: the cheaper of the two, as a tuned collective library would choose.
* Clock rule of an exchange: it starts when both peers are ready (``max`` of their clocks,
  peers send theirs with the payload) and ends for both at start + cost; a rank with
  several peers finishes at the latest of its exchanges. An all-reduce ends for everyone
  at the largest clock + its cost. With overlap, an exchange posted at the end of a round
  runs while the next round computes: ``clock = max(clock, exchange end)`` on completion.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

# Bytes per second in one Gbit/s.
BYTES_PER_GBIT = 1e9 / 8
DEFAULT_MODEL_PARAMETERS = 1_000_000_000  # a 1B-parameter model
# Modelled inner-step time of that model at speed 1.0, by the 6 N D rule: 6 x 1e9 parameters
# x 262,144 tokens per step ~ 1.6e15 FLOP, on one 8 x H100 node at 40% MFU of 989 TFLOP/s
# each (~3.2e15 FLOP/s) ~ 0.5 s.
DEFAULT_STEP_TIME_S = 0.5

Pair = tuple[int, int]
Table = Sequence[Sequence[float]]


class _HasMixingWeights(Protocol):
    def mixing_weights(self, rank: int, world_size: int, round_index: int) -> dict[int, float]: ...


class NetworkModel:
    """Links between workers, their compute speeds, and the size and step time of the modelled model.

    Links are given between clusters: ``bandwidth_gbps[a][b]`` and ``latency_s[a][b]`` are the
    link from cluster a to cluster b, the diagonal the links inside a cluster. Prefer the
    constructors :meth:`uniform`, :meth:`clusters` and :meth:`from_matrix`.

    Args:
        bandwidth_gbps: k x k symmetric table, Gbit/s, > 0 (``math.inf`` allowed). Diagonal
            entries of single-rank clusters are never used and not checked.
        latency_s: k x k symmetric table, seconds, >= 0 and finite (same diagonal rule).
        clusters: cluster index in [0, k) of every rank; its length is the world size n.
            Default: one cluster per rank (the tables are then n x n rank-to-rank matrices).
        speeds: compute speed factor of every rank, > 0 (default 1.0 each); a rank at 0.5
            takes twice as long per inner step.
        model_parameters: parameters of the modelled model (default 1B), not the proxy's.
        bytes_per_parameter: bytes of one parameter in the messages (default 4, fp32).
        step_time_s: modelled inner-step time at speed 1.0 (default 0.5 s, see
            ``DEFAULT_STEP_TIME_S``).
        throttle: real seconds each worker sleeps per simulated second it spends off compute
            (communicating, or waiting for peers), >= 0. 0 (the default) never sleeps; 1 makes a
            run feel the modelled network in real time; e.g. 0.01 for a demo. See :class:`Throttle`.
    """

    def __init__(
        self,
        *,
        bandwidth_gbps: Table,
        latency_s: Table,
        clusters: Sequence[int] | None = None,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
    ) -> None:
        k = len(_rows("bandwidth_gbps", bandwidth_gbps))
        self._clusters = _cluster_assignment(clusters, k)
        used = {c for c in self._clusters if self._clusters.count(c) > 1}
        self._bandwidth = _table("bandwidth_gbps", bandwidth_gbps, k, used, _positive)
        self._latency = _table("latency_s", latency_s, k, used, _non_negative)
        self._speeds = _speeds(speeds, len(self._clusters))
        self._model_parameters = _positive_int("model_parameters", model_parameters)
        self._bytes_per_parameter = _positive_int("bytes_per_parameter", bytes_per_parameter)
        self._step_time_s = _positive_finite("step_time_s", step_time_s)
        self._throttle = _non_negative("throttle", throttle)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(
        cls,
        *,
        world_size: int,
        bandwidth_gbps: float,
        latency_s: float,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
    ) -> NetworkModel:
        """Every pair of the n workers joined by the same link; one cluster.

        Args:
            world_size: n, >= 1.
            bandwidth_gbps: every link's bandwidth, Gbit/s, > 0.
            latency_s: every link's latency, seconds, >= 0.
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle: as for the class.
        """
        n = _positive_int("world_size", world_size)
        return cls(
            bandwidth_gbps=[[_positive("bandwidth_gbps", bandwidth_gbps)]],
            latency_s=[[_non_negative("latency_s", latency_s)]],
            clusters=[0] * n,
            speeds=speeds,
            model_parameters=model_parameters,
            bytes_per_parameter=bytes_per_parameter,
            step_time_s=step_time_s,
            throttle=throttle,
        )

    @classmethod
    def clusters(
        cls,
        *,
        intra_gbps: float | Sequence[float],
        intra_latency_s: float | Sequence[float],
        inter_gbps: float | Table,
        inter_latency_s: float | Table,
        sizes: Sequence[int] | None = None,
        assignment: Sequence[int] | None = None,
        world_size: int | None = None,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
    ) -> NetworkModel:
        """Workers in k clusters (data centres): fast links inside, slower ones between.

        Give exactly one of ``sizes`` (contiguous rank blocks: ``[4, 4]`` puts ranks 0-3 in
        cluster 0 and 4-7 in cluster 1) or ``assignment`` (the cluster of every rank).

        Args:
            intra_gbps: bandwidth inside every cluster, or one value per cluster, Gbit/s.
            intra_latency_s: latency inside every cluster, or one value per cluster.
            inter_gbps: bandwidth between any two clusters, or a k x k symmetric table
                (diagonal ignored), Gbit/s.
            inter_latency_s: latency between clusters, a value or a k x k table.
            sizes: ranks per cluster, each >= 1.
            assignment: cluster index of every rank, using every index in [0, k).
            world_size: n, optional; when given it must equal the number of ranks described.
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle: as for the class.
        """
        members = _membership(sizes, assignment, world_size)
        k = max(members) + 1
        bandwidth = _cluster_table("intra_gbps", intra_gbps, "inter_gbps", inter_gbps, k)
        latency = _cluster_table("intra_latency_s", intra_latency_s, "inter_latency_s", inter_latency_s, k)
        return cls(
            bandwidth_gbps=bandwidth,
            latency_s=latency,
            clusters=members,
            speeds=speeds,
            model_parameters=model_parameters,
            bytes_per_parameter=bytes_per_parameter,
            step_time_s=step_time_s,
            throttle=throttle,
        )

    @classmethod
    def from_matrix(
        cls,
        *,
        bandwidth_gbps: Table,
        latency_s: Table,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
    ) -> NetworkModel:
        """A dedicated link per pair of workers, from n x n symmetric matrices (diagonal ignored).

        Every rank is its own cluster, so no two exchanges share a link.

        Args:
            bandwidth_gbps: n x n, Gbit/s, > 0 off the diagonal.
            latency_s: n x n, seconds, >= 0 off the diagonal.
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle: as for the class.
        """
        return cls(
            bandwidth_gbps=bandwidth_gbps,
            latency_s=latency_s,
            speeds=speeds,
            model_parameters=model_parameters,
            bytes_per_parameter=bytes_per_parameter,
            step_time_s=step_time_s,
            throttle=throttle,
        )

    def __repr__(self) -> str:
        return (
            f"NetworkModel(world_size={self.world_size}, num_clusters={self.num_clusters}, "
            f"model_parameters={self._model_parameters}, step_time_s={self._step_time_s})"
        )

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        """n, the number of workers."""
        return len(self._clusters)

    @property
    def num_clusters(self) -> int:
        """k, the number of clusters."""
        return len(self._bandwidth)

    @property
    def speeds(self) -> tuple[float, ...]:
        """Compute speed factor of every rank."""
        return self._speeds

    @property
    def model_parameters(self) -> int:
        """Parameters of the modelled model."""
        return self._model_parameters

    @property
    def bytes_per_parameter(self) -> int:
        """Bytes of one modelled parameter in a message."""
        return self._bytes_per_parameter

    @property
    def step_time_s(self) -> float:
        """Modelled inner-step time at speed 1.0."""
        return self._step_time_s

    @property
    def throttle(self) -> float:
        """Real seconds slept per simulated second off compute (0: never)."""
        return self._throttle

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless the model describes exactly ``world_size`` workers (call before training)."""
        if world_size != self.world_size:
            raise ValueError(
                f"the network model describes {self.world_size} workers but the run has world_size={world_size}"
            )

    # ------------------------------------------------------------------ links and compute
    def cluster_of(self, rank: int) -> int:
        """The cluster index of ``rank``."""
        return self._clusters[self._rank(rank)]

    def link(self, i: int, j: int) -> tuple[float, float]:
        """``(bytes_per_s, latency_s)`` of the link between ranks i != j."""
        a, b = self.cluster_of(i), self.cluster_of(j)
        if i == j:
            raise ValueError(f"a rank has no link to itself: i = j = {i}")
        return self._bandwidth[a][b] * BYTES_PER_GBIT, self._latency[a][b]

    def message_bytes(self, element_size: int | None = None) -> int:
        """Bytes of one modelled model message.

        Args:
            element_size: bytes per element of the message (2 for bf16 messages); default
                ``bytes_per_parameter``.
        """
        size = self._bytes_per_parameter if element_size is None else _positive_int("element_size", element_size)
        return self._model_parameters * size

    def step_time(self, rank: int) -> float:
        """Modelled time of one inner step on ``rank``: ``step_time_s / speeds[rank]``."""
        return self._step_time_s / self._speeds[self._rank(rank)]

    def auto_inner_steps(self, base_inner_steps: int) -> list[int]:
        """Inner steps H_i per rank in proportion to its speed, so every round takes the same time.

        The fastest rank takes ``base_inner_steps``; the others are rounded down (so none takes
        longer than the fastest) but take at least one step.

        Args:
            base_inner_steps: H of the fastest rank, >= 1.
        """
        base = _positive_int("base_inner_steps", base_inner_steps)
        fastest = max(self._speeds)
        # The epsilon keeps exact ratios such as 0.29 x 100 from rounding down to 28.
        return [max(1, math.floor(base * s / fastest + 1e-9)) for s in self._speeds]

    # ------------------------------------------------------------------ pairwise exchanges
    def pairwise_time(self, i: int, j: int, nbytes: float, concurrent_flows: int = 1) -> float:
        """Time of one exchange i <-> j: ``latency + nbytes / (bandwidth / concurrent_flows)``.

        Args:
            i, j: the two ranks.
            nbytes: bytes each side sends, >= 0.
            concurrent_flows: flows sharing the pair's bottleneck, >= 1 (see :meth:`concurrent_flows`).
        """
        bytes_per_s, latency = self.link(i, j)
        flows = _positive_int("concurrent_flows", concurrent_flows)
        return latency + _non_negative("nbytes", nbytes) * flows / bytes_per_s

    def shared_link_flows(self, pairs: Iterable[Pair]) -> dict[Pair, int]:
        """How many of a round's concurrent exchanges cross each inter-cluster link.

        Args:
            pairs: every exchange of the round, as rank pairs.

        Returns:
            ``{(cluster_a, cluster_b): count}`` with a < b; links nobody crosses are absent.
        """
        counts: dict[Pair, int] = {}
        for i, j in self._pairs(pairs):
            a, b = sorted((self.cluster_of(i), self.cluster_of(j)))
            if a != b:
                counts[(a, b)] = counts.get((a, b), 0) + 1
        return counts

    def concurrent_flows(self, pairs: Iterable[Pair]) -> dict[Pair, int]:
        """Flows sharing each exchange's bottleneck: its inter-cluster link or either end's NIC.

        Args:
            pairs: every exchange of the round, as rank pairs.

        Returns:
            ``{(i, j): count}`` with i < j, for every pair given.
        """
        pairs = self._pairs(pairs)
        links = self.shared_link_flows(pairs)
        degree = [0] * self.world_size
        for i, j in pairs:
            degree[i] += 1
            degree[j] += 1
        flows = {}
        for i, j in pairs:
            a, b = sorted((self.cluster_of(i), self.cluster_of(j)))
            flows[(i, j)] = max(degree[i], degree[j], links.get((a, b), 1))
        return flows

    # ------------------------------------------------------------------ all-reduce
    def ring_all_reduce_time(self, nbytes: float, ranks: Sequence[int] | None = None) -> float:
        """Ring all-reduce: ``2 (m - 1)`` steps of ``nbytes / m`` over the slowest ring link.

        Args:
            nbytes: bytes of the vector every rank contributes, >= 0.
            ranks: the ranks taking part (default all); the ring visits clusters contiguously.
        """
        nbytes = _non_negative("nbytes", nbytes)
        ring = sorted(range(self.world_size) if ranks is None else ranks, key=lambda r: (self.cluster_of(r), r))
        m = len(ring)
        if len(set(ring)) != m:
            raise ValueError(f"ranks must not repeat a rank, got {ranks!r}")
        if m <= 1:
            return 0.0
        return 2 * (m - 1) * self._ring_step_time(ring, nbytes / m)

    def hierarchical_all_reduce_time(self, nbytes: float) -> float:
        """Reduce-scatter inside clusters, all-reduce across clusters, all-gather inside.

        The inside stages take the slowest cluster's ``(m_c - 1)`` steps of ``nbytes / m_c``
        each; the middle stage is a ring all-reduce of all of ``nbytes`` across the k
        clusters (the clusters' concurrent shard rings share each inter-cluster link).

        Args:
            nbytes: bytes of the vector every rank contributes, >= 0.
        """
        nbytes = _non_negative("nbytes", nbytes)
        members = self._members()
        inside = max(self._ring_step_time(m, nbytes / len(m)) * (len(m) - 1) for m in members)
        k = len(members)
        leaders = [m[0] for m in members]
        across = 2 * (k - 1) * self._ring_step_time(leaders, nbytes / k) if k > 1 else 0.0
        return 2 * inside + across

    def all_reduce_time(self, nbytes: float) -> float:
        """The cheaper of the ring and the hierarchical all-reduce of ``nbytes``."""
        return min(self.ring_all_reduce_time(nbytes), self.hierarchical_all_reduce_time(nbytes))

    # ------------------------------------------------------------------ helpers
    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def _pairs(self, pairs: Iterable[Pair]) -> list[Pair]:
        """Validated pairs as (low, high); a pair may appear once."""
        out = [_pair(self, p) for p in pairs]
        if len(set(out)) != len(out):
            raise ValueError(f"pairs must not repeat an exchange, got {sorted(out)}")
        return out

    def _members(self) -> list[list[int]]:
        members: list[list[int]] = [[] for _ in range(self.num_clusters)]
        for rank, cluster in enumerate(self._clusters):
            members[cluster].append(rank)
        return [m for m in members if m]

    def _ring_step_time(self, ring: Sequence[int], chunk: float) -> float:
        """Slowest ``latency + chunk / bandwidth`` over the ring's links (0 for a single rank)."""
        worst = 0.0
        for pos, i in enumerate(ring):
            j = ring[(pos + 1) % len(ring)]
            if i != j:
                bytes_per_s, latency = self.link(i, j)
                worst = max(worst, latency + chunk / bytes_per_s)
        return worst


class SimulatedClock:
    """The simulated time of one rank, in seconds, advanced by compute and communication.

    Every rank keeps its own clock. Inner steps advance it by ``NetworkModel.step_time``; an
    exchange needs the peers' clocks, which they send with their payload (as float64: both
    ends of a pair must compute bit-identical completion times); an all-reduce needs the
    largest clock. All methods return the new time.

    Args:
        network: the modelled network and compute.
        rank: this worker's rank in [0, n).
    """

    def __init__(self, network: NetworkModel, *, rank: int) -> None:
        if not isinstance(network, NetworkModel):
            raise ValueError(f"network must be a NetworkModel, got {type(network).__name__}")
        self._network = network
        self._rank = network._rank(rank)
        self._time = 0.0
        self._compute_time = 0.0
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
        elapsed = steps * self._network.step_time(self._rank)
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

    def all_reduce(self, *, max_clock: float, nbytes: float | None = None) -> float:
        """An all-reduce (DiLoCo's per round): ``time = max clock + all_reduce_time(nbytes)``.

        Args:
            max_clock: the largest clock over all ranks when the all-reduce starts.
            nbytes: bytes of the reduced vector; default the network's ``message_bytes()``.
        """
        start = max(self._time, _finite("max_clock", max_clock))
        self._time = start + self._network.all_reduce_time(self._nbytes(nbytes))
        return self._time

    def ddp_step(self, *, nbytes: float | None = None) -> float:
        """One DDP step: every rank computes, then a gradient all-reduce at the largest clock.

        DDP synchronises every step, so all clocks are equal between steps and the largest
        compute end is this clock plus the slowest rank's step time: no clocks need sending.
        The all-reduce is not overlapped with the backward pass (an upper bound).

        Args:
            nbytes: gradient bytes; default the network's ``message_bytes()``.
        """
        network = self._network
        slowest = max(network.step_time(r) for r in range(network.world_size))
        self._compute_time += network.step_time(self._rank)
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
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a clock saved by :meth:`state_dict` on the same rank."""
        if state["rank"] != self._rank:
            raise ValueError(f"state_dict is of rank {state['rank']}, this clock is rank {self._rank}")
        self._time = _finite("time", state["time"])
        self._compute_time = _finite("compute_time", state["compute_time"])
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


# ---------------------------------------------------------------------- validation
def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(name: str, value: object) -> float:
    if not _is_number(value) or not value > 0:  # NaN fails too
        raise ValueError(f"{name} must be a number > 0 (math.inf allowed), got {value!r}")
    return float(value)


def _non_negative(name: str, value: object) -> float:
    if not _is_number(value) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _positive_finite(name: str, value: object) -> float:
    if not _is_number(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _finite(name: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _sequence(name: str, value: object) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _rows(name: str, table: object) -> list[list]:
    rows = [_sequence(f"{name}[{a}]", row) for a, row in enumerate(_sequence(name, table))]
    if not rows:
        raise ValueError(f"{name} must not be empty")
    return rows


def _table(name: str, table: Table, k: int, used_diagonal: set[int], check: Any) -> tuple[tuple[float, ...], ...]:
    """A validated k x k symmetric table; unused diagonal entries become NaN."""
    rows = _rows(name, table)
    if len(rows) != k or any(len(row) != k for row in rows):
        shape = f"{len(rows)} rows of lengths {[len(row) for row in rows]}"
        raise ValueError(f"{name} must be a {k} x {k} matrix (one row and column per cluster or rank), got {shape}")
    out = [[math.nan] * k for _ in range(k)]
    for a in range(k):
        for b in range(k):
            if a != b or a in used_diagonal:
                out[a][b] = check(f"{name}[{a}][{b}]", rows[a][b])
    for a in range(k):
        for b in range(a):
            if out[a][b] != out[b][a]:
                raise ValueError(f"{name} must be symmetric: [{a}][{b}] = {out[a][b]} but [{b}][{a}] = {out[b][a]}")
    return tuple(tuple(row) for row in out)


def _cluster_assignment(clusters: Sequence[int] | None, k: int) -> tuple[int, ...]:
    if clusters is None:
        return tuple(range(k))
    members = _sequence("clusters", clusters)
    if not members or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < k for c in members):
        raise ValueError(f"clusters must be a non-empty list of ints in [0, {k}) (k from the tables), got {clusters!r}")
    return tuple(members)


def _membership(sizes: Sequence[int] | None, assignment: Sequence[int] | None, world_size: int | None) -> list[int]:
    """Cluster of every rank, from block sizes or an explicit assignment."""
    if (sizes is None) == (assignment is None):
        raise ValueError("give exactly one of sizes (contiguous rank blocks) or assignment (cluster per rank)")
    if sizes is not None:
        blocks = [_positive_int(f"sizes[{c}]", s) for c, s in enumerate(_sequence("sizes", sizes))]
        members = [c for c, size in enumerate(blocks) for _ in range(size)]
    else:
        members = _sequence("assignment", assignment)
        k = len(set(members))
        if any(isinstance(c, bool) or not isinstance(c, int) for c in members) or set(members) != set(range(k)):
            raise ValueError(f"assignment must use every cluster index 0..k-1, got {assignment!r}")
    if not members:
        raise ValueError("sizes must not be empty")
    if world_size is not None and world_size != len(members):
        raise ValueError(f"the clusters hold {len(members)} ranks but world_size={world_size!r}")
    return members


def _cluster_table(intra_name: str, intra: object, inter_name: str, inter: object, k: int) -> list[list[object]]:
    """k x k table with the per-cluster intra values on the diagonal and the inter values off it."""
    diagonal = _sequence(intra_name, intra) if not _is_number(intra) else [intra] * k
    if len(diagonal) != k:
        raise ValueError(f"{intra_name} must be a number or one value per cluster ({k}), got {intra!r}")
    table = [[inter] * k for _ in range(k)] if _is_number(inter) else _rows(inter_name, inter)
    if len(table) != k or any(len(row) != k for row in table):
        raise ValueError(f"{inter_name} must be a number or a {k} x {k} matrix (one row per cluster), got {inter!r}")
    for c in range(k):
        table[c][c] = diagonal[c]
    return table


def _speeds(speeds: Sequence[float] | None, n: int) -> tuple[float, ...]:
    if speeds is None:
        return (1.0,) * n
    values = _sequence("speeds", speeds)
    if len(values) != n:
        raise ValueError(f"speeds must have one factor per worker ({n}), got {len(values)}")
    return tuple(_positive_finite(f"speeds[{r}]", s) for r, s in enumerate(values))


def _pair(network: NetworkModel, pair: object) -> Pair:
    ends = _sequence("pair", pair)
    if len(ends) != 2:
        raise ValueError(f"a pair must be two ranks (i, j), got {pair!r}")
    i, j = network._rank(ends[0]), network._rank(ends[1])
    if i == j:
        raise ValueError(f"a pair must join two different ranks, got ({i}, {j})")
    return (min(i, j), max(i, j))
