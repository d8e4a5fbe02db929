"""Topologies by name: TOPOLOGIES and build_topology."""

from __future__ import annotations




from gasloc_lightning.topology.base import Topology, TopologyError
from gasloc_lightning.topology.random_graphs import OnePeerTopology, TwoPeerTopology
from gasloc_lightning.topology.fixed import RingTopology, TorusTopology, ExponentialTopology, CompleteTopology, CustomTopology, LocalTopology
from gasloc_lightning.topology.bandwidth_aware import BandwidthAwareTopology

TOPOLOGIES: dict[str, type[Topology]] = {
    cls.name: cls
    for cls in (
        OnePeerTopology,
        TwoPeerTopology,
        RingTopology,
        TorusTopology,
        ExponentialTopology,
        CompleteTopology,
        CustomTopology,
        LocalTopology,
        BandwidthAwareTopology,
    )
}


def build_topology(spec: str | Topology, seed: int = 0) -> Topology:
    """A topology from its name (case-insensitive) or a :class:`Topology`, passed through.

    Args:
        spec: one of :data:`TOPOLOGIES` (except ``custom`` and ``bandwidth_aware``, which need
            their edges or network: build a :class:`CustomTopology` or
            :class:`BandwidthAwareTopology` and pass it) or a Topology instance.
        seed: shared seed of the random schedules (ignored for an instance).
    """
    if isinstance(spec, Topology):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"topology must be a name or a Topology, got {type(spec).__name__}")
    name = spec.strip().lower().replace("-", "_")
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {spec!r}; valid names: {sorted(TOPOLOGIES)}")
    if TOPOLOGIES[name] is CustomTopology:
        raise TopologyError("topology 'custom' needs its edges: pass CustomTopology(edges=...), not a name")
    if TOPOLOGIES[name] is BandwidthAwareTopology:
        raise TopologyError(
            "topology 'bandwidth_aware' needs its network: pass BandwidthAwareTopology(bandwidth=... or "
            "clusters=...) or BandwidthAwareTopology.from_clusters(sizes), not a name"
        )
    return TOPOLOGIES[name](seed=seed)
