"""The simulated clock of one worker, observing the rounds of a strategy (see :mod:`gasloc_lightning.network`).

The strategy reports events (an inner step, an exchange posted or completed, an all-reduce, a round
end); this object turns them into simulated time with :class:`~gasloc_lightning.network.SimulatedClock`
and, with the network's ``throttle``, sleeps for it. Training itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gasloc_lightning.network import NetworkModel, SimulatedClock, Throttle


class RoundClock:
    """Simulated time of one worker.

    Args:
        network: the modelled network over the workers.
        worker: this worker's index.
        device: where the clock tensors exchanged with peers live.
        links: parallel links a worker sends over: a worker sharded over k ranks sends 1/k of the model on each
            of k links at once (shard-to-shard exchanges, per-shard all-reduces), so a message takes 1/k the time.
    """

    def __init__(self, network: NetworkModel, *, worker: int, device: torch.device, links: int = 1) -> None:
        if isinstance(links, bool) or not isinstance(links, int) or links < 1:
            raise ValueError(f"links must be an int >= 1, got {links!r}")
        self._network = network
        self._device = device
        self._links = links
        self.clock = SimulatedClock(network, rank=worker)
        self._throttle = Throttle(self.clock, network.throttle)

    @property
    def time(self) -> float:
        return self.clock.time

    @property
    def throttled_seconds(self) -> float:
        return self._throttle.slept

    def on_inner_step(self) -> None:
        self.clock.advance_compute(1)

    def on_round_end(self) -> None:
        """Sleep for the simulated time not yet slept (with the network's ``throttle``)."""
        self._throttle()

    def on_post(self) -> float:
        """An exchange is posted now; returns the clock value that travels with the message."""
        return self.clock.post_exchange()

    def on_exchange_completed(
        self, peer_clocks: Mapping[int, float], pairs: Sequence[tuple[int, int]], element_size: float
    ) -> None:
        """The exchange posted last ended: advance to its end (peers' clocks came with it)."""
        if not self.clock.pending:
            return
        nbytes = self._network.message_bytes(element_size=element_size) / self._links
        self.clock.complete_exchange(peer_clocks=dict(peer_clocks), pairs=list(pairs), nbytes=nbytes)

    def on_all_reduce(self, group: dist.ProcessGroup | None = None, element_size: float | None = None) -> None:
        """An all-reduce round in simulated time: it starts at the largest clock (a collective).

        ``element_size``: bytes per element on the wire (a quantized all-reduce); default the network's.
        """
        latest = self.tensor()
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
        nbytes = self._network.message_bytes(element_size=element_size) / self._links
        self.clock.all_reduce(max_clock=float(latest.item()), nbytes=nbytes)

    def on_all_reduce_posted(self, group: dist.ProcessGroup | None = None, element_size: float | None = None,
                             fraction: float = 1.0) -> float:
        """An all-reduce of ``fraction`` of the model posted now, overlapped with compute: returns the simulated
        time it ends (it starts at the largest clock, a collective); :meth:`wait_until` it later."""
        latest = self.tensor()
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
        nbytes = self._network.message_bytes(element_size=element_size) * fraction / self._links
        return max(self.clock.time, float(latest.item())) + self._network.all_reduce_time(nbytes)

    def wait_until(self, end: float) -> None:
        """Wait (in simulated time) for a posted all-reduce that ends at ``end``."""
        self.clock.follow(end)

    def tensor(self) -> Tensor:
        return torch.tensor([self.clock.time], dtype=torch.float64, device=self._device)

    def follow(self, leader_time: Tensor) -> None:
        """A non-leader rank of a worker takes its leader's clock."""
        self.clock.follow(float(leader_time.item()))

    def state_dict(self) -> dict[str, Any]:
        return self.clock.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock.load_state_dict(state)
        self._throttle = Throttle(self.clock, self._network.throttle)  # sleep only for what follows
