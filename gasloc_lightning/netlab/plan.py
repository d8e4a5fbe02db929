"""The lab's plan, from a network preset: which site each worker sits in, each site's address, each link's rate.

Pure arithmetic on a :class:`~gasloc_lightning.network.NetworkModel` (no root, no namespaces), so it is tested
anywhere. One site per cluster of the model. Worker ``w`` of ``W`` takes the site of the model's rank
``floor(w * n / W)`` (n: the model's world size), so ``elastic.workers=4`` on ``two_clusters`` (4 + 4) puts
workers 0-1 in site 0 and 2-3 in site 1. The link from site a to site b is shaped to the model's
``bandwidth(a, b) x bandwidth_scale``: the model's Gbit/s are data-centre rates this machine cannot move, so the
lab runs them slower by one factor, and the measured seconds compare to the model's at ``nbytes / scale``.
Latency is not emulated (the kernel here has no ``netem``): see ``docs/netlab.md``. A preset with per-site
uplinks (``many_sites``, ``NetworkModel.sites``) also gets each site's uplink, shared by all its flows.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from gasloc_lightning.network import NetworkModel

SUBNET = ipaddress.ip_network("10.213.0.0/24")  # inside the lab's own namespaces only
MBIT_PER_GBIT = 1000.0


@dataclass(frozen=True)
class LabPlan:
    """What the lab builds.

    Args:
        addresses: the IP of every site (site i is ``SUBNET``'s host i + 1).
        worker_sites: the site of every worker.
        rates_mbit: ``rates_mbit[a][b]``: the shaped rate from site a to site b, Mbit/s (diagonal unused).
        uplinks_mbit: each site's uplink, Mbit/s, shared by every flow leaving (and entering) the site; None:
            no uplinks, every site pair has its own link (``two_clusters``, ``cloud_mix``).
    """

    addresses: tuple[str, ...]
    worker_sites: tuple[int, ...]
    rates_mbit: tuple[tuple[float, ...], ...]
    uplinks_mbit: tuple[float, ...] | None = None

    @property
    def sites(self) -> int:
        return len(self.addresses)

    def workers_in(self, site: int) -> list[int]:
        return [w for w, s in enumerate(self.worker_sites) if s == site]

    def address_of_worker(self, worker: int) -> str:
        return self.addresses[self.worker_sites[worker]]


def plan_lab(network: NetworkModel, *, workers: int, bandwidth_scale: float) -> LabPlan:
    """The lab for ``workers`` workers on ``network``'s sites (its clusters), links at ``bandwidth_scale``.

    Args:
        network: the preset (``network=two_clusters``, ...), built.
        workers: W, >= 1.
        bandwidth_scale: lab Mbit/s per model Mbit/s, in (0, 1].
    """
    if not isinstance(network, NetworkModel):
        raise ValueError(f"network must be a NetworkModel (a network= preset), got {type(network).__name__}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not 0 < bandwidth_scale <= 1:
        raise ValueError(f"netlab.bandwidth_scale must lie in (0, 1], got {bandwidth_scale!r}")
    n, k = network.world_size, network.num_clusters
    if k > SUBNET.num_addresses - 2:
        raise ValueError(f"the lab holds at most {SUBNET.num_addresses - 2} sites, the preset has {k}")
    sites = tuple(network.cluster_of(math.floor(w * n / workers)) for w in range(workers))
    if len(set(sites)) < k:
        missing = sorted(set(range(k)) - set(sites))
        raise ValueError(f"elastic.workers={workers} leaves site(s) {missing} of the {k}-site preset empty: "
                         f"use at least {k} workers")
    first = [next(r for r in range(n) if network.cluster_of(r) == c) for c in range(k)]
    rates = tuple(tuple(0.0 if a == b else _mbit(network, first[a], first[b]) * bandwidth_scale
                        for b in range(k)) for a in range(k))
    addresses = tuple(str(SUBNET[1 + site]) for site in range(k))
    uplinks = _uplinks(rates) if getattr(network, "uplinks", False) else None
    return LabPlan(addresses=addresses, worker_sites=sites, rates_mbit=rates, uplinks_mbit=uplinks)


def _uplinks(rates: tuple[tuple[float, ...], ...]) -> tuple[float, ...] | None:
    """Each site's uplink from a ``NetworkModel.sites`` preset, whose pair rate is ``min(uplink_a, uplink_b)``: the
    fastest pair of each site. Exact for every site but the fastest, which gets the second fastest's uplink (its
    own is not in the model's pair table); a single site pair has no sharing to shape."""
    k = len(rates)
    if k < 3:
        return None
    return tuple(max(rates[a][b] for b in range(k) if b != a) for a in range(k))


def _mbit(network: NetworkModel, i: int, j: int) -> float:
    bytes_per_s, _ = network.link(i, j)
    return bytes_per_s * 8 / 1e6
