"""Communication: flat layouts of the exchanged tensors, the point-to-point transport, and the exchange.

Nothing here imports Lightning; only :mod:`~gasloc_lightning.comm.transport` talks to a process group.
"""

from gasloc_lightning.comm.exchange import MESSAGE_DTYPES, CorrectionExchange
from gasloc_lightning.comm.flat import FlatLayout, all_finite
from gasloc_lightning.comm.transport import GossipTimeoutError, GossipTransport, PendingExchange, TrafficCounters

__all__ = [
    "MESSAGE_DTYPES",
    "CorrectionExchange",
    "FlatLayout",
    "GossipTimeoutError",
    "GossipTransport",
    "PendingExchange",
    "TrafficCounters",
    "all_finite",
]
