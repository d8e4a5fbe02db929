"""NetworkModel: per-link bandwidth and latency, per-worker speed, modelled model size and step time."""

from __future__ import annotations

import math

from collections.abc import Iterable, Sequence
from typing import Protocol

from gasloc_lightning.network.jitter import ComputeJitter
from gasloc_lightning.network.preemption import Preemption
from gasloc_lightning.network.validation import _positive, _non_negative, _positive_finite, _positive_int, _rows, _table, _cluster_assignment, _membership, _cluster_table, _speeds, _sequence

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
        compute_jitter: per-step noise and transient slowdowns of the step time
            (:class:`~gasloc_lightning.network.ComputeJitter`); None: every step takes ``step_time(rank)``.
        preemption: workers that leave and come back (:class:`~gasloc_lightning.network.Preemption`); only
            engines with elastic membership honour it (the simulator); a static strategy's clock refuses it.
        uplinks: the off-diagonal links are each cluster's own uplink to a backbone (:meth:`sites`): every
            exchange leaving a cluster shares that cluster's uplink, whichever cluster it goes to. False: each
            pair of clusters has its own link.
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
        compute_jitter: ComputeJitter | None = None,
        preemption: Preemption | None = None,
        uplinks: bool = False,
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
        if compute_jitter is not None and not isinstance(compute_jitter, ComputeJitter):
            raise ValueError(f"compute_jitter must be a ComputeJitter or None, got {type(compute_jitter).__name__}")
        if preemption is not None and not isinstance(preemption, Preemption):
            raise ValueError(f"preemption must be a Preemption or None, got {type(preemption).__name__}")
        if not isinstance(uplinks, bool):
            raise ValueError(f"uplinks must be a bool, got {uplinks!r}")
        self._jitter, self._preemption, self._uplinks = compute_jitter, preemption, uplinks

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
        compute_jitter: ComputeJitter | None = None,
        preemption: Preemption | None = None,
    ) -> NetworkModel:
        """Every pair of the n workers joined by the same link; one cluster.

        Args:
            world_size: n, >= 1.
            bandwidth_gbps: every link's bandwidth, Gbit/s, > 0.
            latency_s: every link's latency, seconds, >= 0.
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle, compute_jitter, preemption: as for
                the class.
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
            compute_jitter=compute_jitter,
            preemption=preemption,
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
        scale_to: int | None = None,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
        compute_jitter: ComputeJitter | None = None,
        preemption: Preemption | None = None,
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
            scale_to: the preset scaled to this many ranks (None: as described): every cluster of ``sizes``
                grows or shrinks in proportion (:func:`scaled_sizes`), and ``speeds`` follow (the rank at
                position p of a cluster of m takes the speed of position ``p * m0 // m`` of the described one).
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle, compute_jitter, preemption: as for
                the class.
        """
        sizes, speeds = _scaled(sizes, assignment, speeds, scale_to)
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
            compute_jitter=compute_jitter,
            preemption=preemption,
        )

    @classmethod
    def sites(
        cls,
        *,
        sizes: Sequence[int],
        uplink_gbps: Sequence[float],
        uplink_latency_s: float | Sequence[float],
        intra_gbps: float | Sequence[float],
        intra_latency_s: float | Sequence[float],
        scale_to: int | None = None,
        speeds: Sequence[float] | None = None,
        model_parameters: int = DEFAULT_MODEL_PARAMETERS,
        bytes_per_parameter: int = 4,
        step_time_s: float = DEFAULT_STEP_TIME_S,
        throttle: float = 0.0,
        compute_jitter: ComputeJitter | None = None,
        preemption: Preemption | None = None,
    ) -> NetworkModel:
        """k sites, each with its own WAN uplink to a shared backbone (the backbone itself never limits).

        Between sites a and b a message crosses a's uplink and b's: bandwidth ``min(uplink_a, uplink_b)``,
        latency ``uplink_latency_a + uplink_latency_b``; every exchange leaving a site shares that site's
        uplink (``uplinks=True``), whichever site it goes to.

        Args:
            sizes: workers per site, each >= 1 (contiguous rank blocks).
            uplink_gbps: each site's uplink bandwidth, Gbit/s, > 0.
            uplink_latency_s: each site's latency to the backbone (one value or one per site), seconds.
            intra_gbps, intra_latency_s: links inside a site (one value or one per site).
            scale_to, speeds, model_parameters, bytes_per_parameter, step_time_s, throttle, compute_jitter,
                preemption: as for :meth:`clusters`.
        """
        sizes, speeds = _scaled(sizes, None, speeds, scale_to)
        k = len(sizes)
        up = _sequence("uplink_gbps", uplink_gbps)
        if len(up) != k:
            raise ValueError(f"uplink_gbps must have one bandwidth per site ({k}), got {uplink_gbps!r}")
        up = [_positive(f"uplink_gbps[{a}]", b) for a, b in enumerate(up)]
        lat = [uplink_latency_s] * k if not isinstance(uplink_latency_s, Sequence) else _sequence(
            "uplink_latency_s", uplink_latency_s)
        if len(lat) != k:
            raise ValueError(f"uplink_latency_s must be a number or one latency per site ({k}), got {uplink_latency_s!r}")
        lat = [_non_negative(f"uplink_latency_s[{a}]", x) for a, x in enumerate(lat)]
        members = _membership(sizes, None, None)
        bandwidth = _cluster_table("intra_gbps", intra_gbps, "uplink_gbps",
                                   [[min(up[a], up[b]) for b in range(k)] for a in range(k)], k)
        latency = _cluster_table("intra_latency_s", intra_latency_s, "uplink_latency_s",
                                 [[lat[a] + lat[b] for b in range(k)] for a in range(k)], k)
        return cls(
            bandwidth_gbps=bandwidth,
            latency_s=latency,
            clusters=members,
            speeds=speeds,
            model_parameters=model_parameters,
            bytes_per_parameter=bytes_per_parameter,
            step_time_s=step_time_s,
            throttle=throttle,
            compute_jitter=compute_jitter,
            preemption=preemption,
            uplinks=True,
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
        compute_jitter: ComputeJitter | None = None,
        preemption: Preemption | None = None,
    ) -> NetworkModel:
        """A dedicated link per pair of workers, from n x n symmetric matrices (diagonal ignored).

        Every rank is its own cluster, so no two exchanges share a link.

        Args:
            bandwidth_gbps: n x n, Gbit/s, > 0 off the diagonal.
            latency_s: n x n, seconds, >= 0 off the diagonal.
            speeds, model_parameters, bytes_per_parameter, step_time_s, throttle, compute_jitter, preemption: as for
                the class.
        """
        return cls(
            bandwidth_gbps=bandwidth_gbps,
            latency_s=latency_s,
            speeds=speeds,
            model_parameters=model_parameters,
            bytes_per_parameter=bytes_per_parameter,
            step_time_s=step_time_s,
            throttle=throttle,
            compute_jitter=compute_jitter,
            preemption=preemption,
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
    def compute_jitter(self) -> ComputeJitter | None:
        """Per-step noise and slowdowns of the step time (None: none)."""
        return self._jitter

    @property
    def preemption(self) -> Preemption | None:
        """Workers that leave and come back (None: every worker stays)."""
        return self._preemption

    @property
    def uplinks(self) -> bool:
        """Whether the off-diagonal links are each cluster's own uplink (shared by everything leaving it)."""
        return self._uplinks

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

    def message_bytes(self, element_size: float | None = None) -> int:
        """Bytes of one modelled model message.

        Args:
            element_size: bytes per element of the message on the wire (2 for bf16 messages, about 1.03 for
                int8 with its per-block scales); default ``bytes_per_parameter``.
        """
        if element_size is None:
            return self._model_parameters * self._bytes_per_parameter
        if isinstance(element_size, bool) or not isinstance(element_size, (int, float)) or not element_size > 0:
            raise ValueError(f"element_size must be a number of bytes > 0, got {element_size!r}")
        return math.ceil(self._model_parameters * element_size)

    def step_time(self, rank: int, step: int | None = None) -> float:
        """Modelled time of one inner step on ``rank``: ``step_time_s / speeds[rank]``, times the jitter of
        step ``step`` (counted from 0 on that rank) when the network has :attr:`compute_jitter`.

        Args:
            rank: the worker.
            step: which of the rank's inner steps (None: the jitter-free time).
        """
        base = self._step_time_s / self._speeds[self._rank(rank)]
        if step is None or self._jitter is None:
            return base
        return base * self._jitter.factor(rank, step)

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
        """Flows sharing each exchange's bottleneck: its inter-cluster link (with ``uplinks``: the busier of the
        two clusters' uplinks) or either end's NIC.

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
        leaving = [0] * self.num_clusters  # uplinks: exchanges through each cluster's uplink
        for (a, b), count in links.items():
            leaving[a] += count
            leaving[b] += count
        flows = {}
        for i, j in pairs:
            a, b = sorted((self.cluster_of(i), self.cluster_of(j)))
            shared = links.get((a, b), 1) if not self._uplinks or a == b else max(leaving[a], leaving[b])
            flows[(i, j)] = max(degree[i], degree[j], shared)
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

    def hierarchical_all_reduce_time(self, nbytes: float, ranks: Sequence[int] | None = None) -> float:
        """Reduce-scatter inside clusters, all-reduce across clusters, all-gather inside.

        The inside stages take the slowest cluster's ``(m_c - 1)`` steps of ``nbytes / m_c``
        each; the middle stage is a ring all-reduce of all of ``nbytes`` across the k
        clusters (the clusters' concurrent shard rings share each inter-cluster link).

        Args:
            nbytes: bytes of the vector every rank contributes, >= 0.
            ranks: the ranks taking part (default all; the live ones under churn).
        """
        nbytes = _non_negative("nbytes", nbytes)
        members = self._members(ranks)
        inside = max(self._ring_step_time(m, nbytes / len(m)) * (len(m) - 1) for m in members)
        k = len(members)
        leaders = [m[0] for m in members]
        across = 2 * (k - 1) * self._ring_step_time(leaders, nbytes / k) if k > 1 else 0.0
        return 2 * inside + across

    def all_reduce_time(self, nbytes: float, ranks: Sequence[int] | None = None) -> float:
        """The cheaper of the ring and the hierarchical all-reduce of ``nbytes`` over ``ranks`` (default all)."""
        return min(self.ring_all_reduce_time(nbytes, ranks), self.hierarchical_all_reduce_time(nbytes, ranks))

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

    def _members(self, ranks: Sequence[int] | None = None) -> list[list[int]]:
        members: list[list[int]] = [[] for _ in range(self.num_clusters)]
        chosen = range(self.world_size) if ranks is None else sorted({self._rank(r) for r in ranks})
        for rank in chosen:
            members[self._clusters[rank]].append(rank)
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


def _pair(network: NetworkModel, pair: object) -> Pair:
    ends = _sequence("pair", pair)
    if len(ends) != 2:
        raise ValueError(f"a pair must be two ranks (i, j), got {pair!r}")
    i, j = network._rank(ends[0]), network._rank(ends[1])
    if i == j:
        raise ValueError(f"a pair must join two different ranks, got ({i}, {j})")
    return (min(i, j), max(i, j))


def scaled_sizes(sizes: Sequence[int], world_size: int) -> list[int]:
    """``sizes`` scaled in proportion to sum to ``world_size`` (largest remainder, every cluster keeps >= 1).

    Args:
        sizes: the described clusters' sizes, each >= 1.
        world_size: the ranks to spread, >= len(sizes).
    """
    blocks = [_positive_int(f"sizes[{c}]", s) for c, s in enumerate(_sequence("sizes", sizes))]
    n = _positive_int("scale_to", world_size)
    if n < len(blocks):
        raise ValueError(f"scale_to={n} cannot hold the preset's {len(blocks)} clusters (one rank each at least)")
    total = sum(blocks)
    exact = [n * b / total for b in blocks]
    out = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(blocks)), key=lambda c: (-(exact[c] - math.floor(exact[c])), c))
    for c in by_remainder[: max(0, n - sum(out))]:
        out[c] += 1
    while sum(out) > n:  # only when the floor of 1 pushed a small cluster up: take from the largest
        out[max(range(len(out)), key=lambda c: out[c])] -= 1
    return out


def _scaled(sizes: Sequence[int] | None, assignment: Sequence[int] | None, speeds: Sequence[float] | None,
            scale_to: int | None) -> tuple[Sequence[int] | None, Sequence[float] | None]:
    """``sizes`` and per-rank ``speeds`` of a preset scaled to ``scale_to`` ranks (unchanged when None or equal)."""
    if scale_to is None:
        return sizes, speeds
    if sizes is None or assignment is not None:
        raise ValueError("scale_to needs the clusters given as sizes (contiguous rank blocks), not an assignment")
    old = [_positive_int(f"sizes[{c}]", s) for c, s in enumerate(_sequence("sizes", sizes))]
    new = scaled_sizes(old, scale_to)
    if new == old or speeds is None:
        return new, speeds
    values = _sequence("speeds", speeds)
    if len(values) != sum(old):
        raise ValueError(f"speeds must have one factor per described worker ({sum(old)}), got {len(values)}")
    starts = [sum(old[:c]) for c in range(len(old))]
    scaled = [values[starts[c] + p * old[c] // new[c]] for c in range(len(old)) for p in range(new[c])]
    return new, scaled
