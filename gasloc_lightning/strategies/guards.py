"""Guards against non-finite points: a worker's own point before it is sent, and its peers' messages.

A non-finite point never leaves a worker. With ``on_nonfinite="skip_round"`` the worker discards
its local steps of the round (the strategy restores the round-start parameters and exchanged
buffers) and still takes part in the exchange, so peers never wait; ``"raise"`` stops at once.
A non-finite message from a peer is dropped: the worker keeps its own point for that share.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from torch import Tensor

from gasloc_lightning.comm.flat import all_finite
from gasloc_lightning.strategies.schedule import check_positive_int

log = logging.getLogger(__name__)

OnNonFinite = Literal["skip_round", "raise"]


class NonFiniteGuard:
    """Decides what happens to non-finite points, and counts it.

    Args:
        on_nonfinite: ``"skip_round"`` or ``"raise"``.
        max_skipped_rounds: consecutive skipped rounds after which the worker stops with an error.
    """

    def __init__(self, on_nonfinite: OnNonFinite = "skip_round", max_skipped_rounds: int = 3) -> None:
        if on_nonfinite not in ("skip_round", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip_round' or 'raise', got {on_nonfinite!r}")
        check_positive_int("max_skipped_rounds", max_skipped_rounds)
        self.on_nonfinite = on_nonfinite
        self.max_skipped_rounds = max_skipped_rounds
        self.skipped_rounds = 0
        self.consecutive_skips = 0
        self.rejected_exchanges = 0
        self._warned_peers: set[int] = set()

    def local_point_is_usable(self, message: Tensor, where: str) -> bool:
        """True when ``message`` is finite; False when the round must be discarded; raises per the policy."""
        return self.record_local_point(all_finite(message), where)

    def record_local_point(self, finite: bool, where: str) -> bool:
        """As :meth:`local_point_is_usable`, for a point whose finiteness was checked elsewhere (a fused pass)."""
        if finite:
            self.consecutive_skips = 0
            return True
        if self.on_nonfinite == "raise":
            raise FloatingPointError(f"{where}: the local parameters are not finite (on_nonfinite='raise')")
        self.consecutive_skips += 1
        self.skipped_rounds += 1
        if self.consecutive_skips > self.max_skipped_rounds:
            raise FloatingPointError(
                f"{where}: the local parameters were not finite for {self.consecutive_skips} consecutive rounds "
                f"(max_skipped_rounds={self.max_skipped_rounds}); lower the learning rate or check the data"
            )
        log.warning("%s: non-finite local parameters, round discarded (restarting from the round start)", where)
        return False

    def accept(
        self, received: list[tuple[float, Tensor]], peers: list[int], where: str
    ) -> list[tuple[float, Tensor]]:
        """Drop non-finite messages: the worker keeps its own point for that peer's share this round."""
        accepted = []
        for (weight, message), peer in zip(received, peers):
            if all_finite(message):
                accepted.append((weight, message))
            else:
                self.reject(peer, where)
        return accepted

    def reject(self, peer: int, where: str) -> None:
        """Count a non-finite message from ``peer`` that was dropped (warned once per peer)."""
        self.rejected_exchanges += 1
        if peer not in self._warned_peers:
            self._warned_peers.add(peer)
            log.warning(
                "%s: rejected a non-finite message from peer %d (kept its own point for that share; the "
                "replicas' mean moves this round); further rejections are counted in comm/rejected_exchanges",
                where, peer,
            )

    def state_dict(self) -> dict[str, int]:
        return {
            "skipped_rounds": self.skipped_rounds,
            "consecutive_skips": self.consecutive_skips,
            "rejected_exchanges": self.rejected_exchanges,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_rounds = int(state.get("skipped_rounds", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.rejected_exchanges = int(state.get("rejected_exchanges", 0))
