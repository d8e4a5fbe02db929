"""The elastic launcher's processes placed in the lab: the lighthouse in site 0, each worker in its site.

:class:`SitePlacement` is what ``gasloc-elastic``'s ``ElasticRun`` takes as ``placement`` (its
``ProcessPlacement``): it wraps each command in ``ip netns exec <site>`` (the pid stays the command's, so the
launcher stops it by pid as usual) and makes each worker bind and advertise its site's address.
"""

from __future__ import annotations

from dataclasses import dataclass

from gasloc_lightning.netlab.lab import Lab


@dataclass(frozen=True)
class SitePlacement:
    """Processes of an elastic run in ``lab``'s sites (the lighthouse in ``lighthouse_site``)."""

    lab: Lab
    lighthouse_site: int = 0

    def lighthouse_command(self, command: list[str]) -> list[str]:
        return self.lab.wrap(command, self.lighthouse_site)

    def worker_command(self, command: list[str], worker: int) -> list[str]:
        address = self.lab.plan.address_of_worker(worker)
        placed = [*command, f"strategy.bind={address}", f"strategy.advertise={address}"]
        return self.lab.wrap(placed, self.lab.plan.worker_sites[worker])

    def reachable(self, address: str) -> bool:
        host, _, port = address.rpartition(":")
        return self.lab.reachable(self.lighthouse_site, host.strip("[]"), int(port))
