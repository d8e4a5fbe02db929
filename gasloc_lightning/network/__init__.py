"""Modelled network and compute, and a simulated clock per rank.

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
* Sites (:meth:`NetworkModel.sites`): k sites, each with its own WAN uplink to a backbone; between
  sites a and b the bandwidth is ``min(uplink_a, uplink_b)`` and the latency the sum of theirs, and
  every exchange leaving a site shares that site's uplink.

Scenarios beyond links (the presets ``conf/network/<name>.yaml``):

* :class:`ComputeJitter` (``network=jitter``): every inner step's time times a heavy-tailed noise
  and transient 2-5x slowdowns of a few rounds, a pure function of (seed, rank, step).
* :class:`Preemption` (``network=preemption``): workers that leave with notice and come back; only
  the simulator's churn honours it, and a static strategy's clock refuses it.
* Cluster presets scale in proportion (``scale_to``, :func:`scaled_sizes`) to the run's worker count.
"""

from __future__ import annotations


from gasloc_lightning.network.clock import SimulatedClock, Throttle, round_pairs
from gasloc_lightning.network.jitter import ComputeJitter
from gasloc_lightning.network.model import BYTES_PER_GBIT, NetworkModel, scaled_sizes
from gasloc_lightning.network.preemption import Preemption

__all__ = ["BYTES_PER_GBIT", "ComputeJitter", "NetworkModel", "Preemption", "SimulatedClock", "Throttle",
           "round_pairs", "scaled_sizes"]
