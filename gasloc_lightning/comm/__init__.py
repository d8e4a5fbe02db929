"""Communication: flat layouts of the exchanged tensors and the point-to-point transport.

Nothing here imports Lightning; only the transports (:mod:`~gasloc_lightning.comm.transport`, its quantized mean
:mod:`~gasloc_lightning.comm.encoded_mean`, the elastic one) talk to a process group.
"""

from gasloc_lightning.comm.flat import FlatLayout, all_finite
from gasloc_lightning.comm.transport import GossipTimeoutError, GossipTransport, PendingExchange, TrafficCounters

__all__ = [
    "FlatLayout",
    "GossipTimeoutError",
    "GossipTransport",
    "PendingExchange",
    "TrafficCounters",
    "all_finite",
]
