"""Communication graphs of GASLoC: who gossips with whom in round t, and with which weights.

A topology is a pure function of (rank, world size n, round t, shared seed): every rank
computes the same graph without communicating, and no process group (or GPU) is needed to
build or query one. Mixing with the round's symmetric weights w_ij = w_ji > 0 is
``(W v)_i = v_i - sum_j w_ij (v_i - v_j)``, so W = I - L is symmetric and doubly stochastic
(ALGORITHM.md, "Notation" and "Topologies").

Named topologies (``build_topology(name)``; ``custom`` and ``bandwidth_aware`` need their
edges or network, so build their class and pass the object):

===============  ==========================================================  ============
name             graph of round t                                            n
===============  ==========================================================  ============
one_peer         uniformly random perfect matching, w = 1/2; odd n: one      any
                 rank sits out
two_peer         ring over a fresh random permutation, w = 1/4               >= 3
ring             fixed ring, w = 1/4 per edge                                any
torus            fixed 2-D torus r x c (most square), w = 1/8 per edge       composite
exponential      hypercube dimension exchange i <-> i XOR 2^(t mod log2 n),  power of two
                 w = 1/2
complete         w = 1/n to everyone: an all-reduce mean (exactly DiLoCo)    any
custom           fixed user-given weighted edges (``CustomTopology``)        as given
bandwidth_aware  random matching, w = 1/2, mostly inside clusters of fast    as given
                 links, across at a set rate (``BandwidthAwareTopology``)
local            no communication at all (a baseline)                        any
===============  ==========================================================  ============

Edges that coincide (ring with n = 2, torus with r = 2 or c = 2) have their weights summed,
so the row sums and the spectrum stay those of the general case; every named graph is
positive semidefinite. World size 1 is accepted by every topology and means no peers.

Default outer momentum gamma (``default_outer_momentum``) for the default anchored form, with
the consensus rate it gives (per-round contraction of the disagreement, no gradients; < 1 is
stable) at n = 16 / 64:

===============  ==============  =============  =============================================
topology         gamma           rate 16 / 64   why
===============  ==============  =============  =============================================
one_peer         0.9             0.873 / 0.892  DiLoCo's value. ALGORITHM.md measured the
two_peer         0.9             0.744 / 0.767  anchored form stable for every gamma <= 0.95
ring             0.9             0.930 / 0.986  on one_peer (n = 8..1024), two_peer and ring
torus            0.9             0.822 / 0.913  (n <= 64); torus: exact rates as listed.
complete         0.9             0 / 0          Exactly DiLoCo's outer Nesterov step.
exponential      0.9 (n <= 16)   0.949 / -      Stable for any gamma < 1 up to n = 16, but
                 0.7 (n >= 32)   - / 0.949      only up to 0.848 (n = 32), 0.786 (n = 64),
                                                falling to 0.707: ALGORITHM.md caps gamma at
                                                0.7 there.
custom           0.9 if stable                  else 0.9 x its largest stable gamma.
bandwidth_aware  0.9             0.852 / 0.884  Two clusters of 8 / 32, slow_link_rate 0.2.
                                                Singleton clusters idle through every fast
                                                round and lower it (0.664 for 6 singletons).
local            0.0             1 / 1          Nothing keeps the replicas together anyway.
===============  ==============  =============  =============================================

Whenever 0.9 is not stable (any topology, e.g. the post_mix form on a random graph), the
default becomes 0.9 x the largest stable gamma, rounded down to 3 decimals, which keeps a
margin inside the stability region.

With ``overlap=True`` (the exchange folded in one round late, see
:mod:`gasloc_lightning.algorithm.stability`) the same rule keeps 0.9 for every named topology at
n = 2 .. 16 (its rate rises a little, e.g. one_peer at n = 16 from 0.873 to 0.910); the
hypercube of 64 and bandwidth_aware with two clusters of 4 (largest stable gamma 0.875) get
0.9 x their limit.
"""


from gasloc_lightning.topology.bandwidth_aware import BANDWIDTH_AWARE_SCHEDULES, BandwidthAwareTopology
from gasloc_lightning.topology.base import Topology, TopologyError
from gasloc_lightning.topology.fixed import (
    CompleteTopology,
    CustomTopology,
    ExponentialTopology,
    LocalTopology,
    RingTopology,
    TorusTopology,
    torus_shape,
)
from gasloc_lightning.topology.random_graphs import OnePeerTopology, TwoPeerTopology
from gasloc_lightning.topology.registry import TOPOLOGIES, build_topology

__all__ = [
    "BANDWIDTH_AWARE_SCHEDULES",
    "BandwidthAwareTopology",
    "CompleteTopology",
    "CustomTopology",
    "ExponentialTopology",
    "LocalTopology",
    "OnePeerTopology",
    "RingTopology",
    "TOPOLOGIES",
    "Topology",
    "TopologyError",
    "TorusTopology",
    "TwoPeerTopology",
    "build_topology",
    "torus_shape",
]
