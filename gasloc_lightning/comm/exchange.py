"""Gossip written as a correction: low-precision messages and one-round-delayed (overlapped) mixing.

Plain gossip moves worker i to ``theta_i' = u_i - sum_j w_ij (u_i - u_j)``. Written as a correction
of the exchanged message m (m = u, or its bfloat16 rounding),

    theta_i' = u_i + C_i,        C_i = sum_j w_ij (m_j - m_i),

two variants follow with no change to the outer step:

- ``message_dtype=torch.bfloat16``: m_i = bf16(u_i) halves the bytes. Worker i uses its own
  *rounded* message in C_i, so C_i is antisymmetric per pair and the replicas' mean is still
  preserved exactly; only the disagreement sees the rounding.
- ``overlap=True``: the exchange of round t is posted and the next inner phase starts at once;
  its correction is folded in at the end of round t+1, scaled by the delayed weight beta, and
  the point posted is the one the worker moves to, *with* the correction just folded in::

      p_i(t)     = u_i(t) + beta C_i(t-1)          (the live point, and the message of round t)
      C_i(t-1)   = sum_j w_ij(t-1) (m_j(t-1) - m_i(t-1)),   m = p (or its bfloat16 rounding).

  The delayed term is antisymmetric per pair, so the mean is preserved (rejected messages
  excepted). Sending p rather than u matters: a correction already applied is then never
  measured (and applied) a second time. With no gradients and gamma = 0 a mode lambda of W
  contracts by exactly lambda per round, as without overlap, and beta = 1 (the default) is
  stable for every gamma < 1 on every named topology up to n = 16 (the exceptions and their
  limits are in :mod:`gasloc_lightning.algorithm.stability`; sending u instead made a lambda = 0 mode
  follow d(t+1) = d(t) - d(t-1), which never contracts).

Buffers: one float32 correction C (model size; with overlap and float32 messages it also holds the
point in flight), the low-precision send buffer if any, and the transport's receive buffers.
Nothing in flight may be written: the strategy calls :meth:`drain` before it reuses the message
buffer or the receive buffers (evaluation, checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from gasloc_lightning.comm.transport import GossipTransport, PendingExchange

MESSAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Accept = Callable[[list[tuple[float, Tensor]], list[int]], list[tuple[float, Tensor]]]


def wire_message(point: Tensor, message_dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """The message m_i put on the wire for ``point``: the point itself (float32) or its rounding.

    Args:
        point: the float32 point sent (u_i, or p_i with overlap).
        message_dtype: float32 or bfloat16.
        out: send buffer of ``message_dtype`` (allocated when None and a rounding is needed).
    """
    if message_dtype == torch.float32:
        return point
    return point.to(message_dtype) if out is None else out.copy_(point)


def gossip_correction(
    sent: Tensor, received: Sequence[tuple[float, Tensor]], scale: float, out: Tensor
) -> Tensor:
    """``out = scale * sum_j w_ij (m_j - m_i)``: the correction C_i (times beta) of one exchange.

    Pure math shared by :class:`CorrectionExchange` (one worker, messages from the transport) and
    the single-process simulator (one row of the stacked messages per worker).

    Args:
        sent: m_i, this worker's message as it went on the wire (float32 or bfloat16).
        received: ``(w_ij, m_j)`` of every accepted peer message.
        scale: beta with overlap, 1 otherwise.
        out: float32 destination; may be ``sent`` itself (the point in flight lives there).
    """
    total = sum(weight for weight, _ in received)
    if sent is out:  # C = -beta sum_j w_ij m_i first, in place
        out.mul_(-scale * total)
    else:
        out.copy_(sent).mul_(-scale * total)
    for weight, incoming in received:
        out.add_(incoming, alpha=scale * weight)  # + beta sum_j w_ij m_j
    return out


class CorrectionExchange:
    """Posts this worker's message and turns what comes back into the correction C_i.

    Args:
        transport: the point-to-point transport (its receive buffers have ``message_dtype``).
        numel: elements of one message.
        message_dtype: dtype on the wire (float32 or bfloat16).
        overlap: fold each exchange in one round late instead of waiting for it.
        delayed_weight: beta in (0, 1], the scale of a delayed correction (overlap only).
        accept: filters received messages (drops non-finite ones); gets ``(received, peers)``.
    """

    def __init__(
        self,
        transport: GossipTransport,
        numel: int,
        message_dtype: torch.dtype,
        overlap: bool,
        accept: Accept,
        delayed_weight: float = 1.0,
    ) -> None:
        if not 0.0 < delayed_weight <= 1.0:
            raise ValueError(f"delayed_weight must lie in (0, 1], got {delayed_weight}")
        self.transport, self.overlap, self.message_dtype = transport, overlap, message_dtype
        self._scale = delayed_weight if overlap else 1.0
        self._accept = accept
        self.correction = torch.zeros(numel, dtype=torch.float32, device=transport.device)
        self.ready = False  # `correction` holds a term not yet applied
        self._send = None if message_dtype == torch.float32 else torch.empty(numel, dtype=message_dtype,
                                                                              device=transport.device)
        self._pending: PendingExchange | None = None
        self._sent: Tensor | None = None
        self.completed: PendingExchange | None = None  # the last drained exchange (its peers' clocks)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def exchange(
        self, message: Tensor, peers: Mapping[int, float], round_index: int, clock: float | None = None
    ) -> Tensor | None:
        """Without overlap: send ``message`` (u), wait, and return this exchange's correction C.

        ``message`` must stay untouched until drained. None when nothing came back (no peers, or
        every message rejected): the worker keeps u.
        """
        if self.overlap:
            raise RuntimeError("exchange() is the synchronous path; with overlap use fold_and_post()")
        self._post(message, peers, round_index, clock)
        self.drain()
        return self.take()

    def fold_and_post(
        self, message: Tensor, peers: Mapping[int, float], round_index: int, clock: float | None = None
    ) -> Tensor:
        """With overlap: fold the previous exchange into ``message`` (u) and post the result.

        Returns the point p = u + beta C(t-1) this worker moves to now, which is also what is in
        flight: read it, never write it, until the next :meth:`drain`. It is ``message`` itself
        when there is nothing to fold in; otherwise it lives in this object's correction buffer.
        """
        if not self.overlap:
            raise RuntimeError("fold_and_post() needs overlap=True; use exchange()")
        self.drain()
        correction = self.take()
        point = message if correction is None else correction.add_(message)
        self._post(point, peers, round_index, clock)
        return point

    def _post(self, message: Tensor, peers: Mapping[int, float], round_index: int, clock: float | None) -> None:
        wire = wire_message(message, self.message_dtype, out=self._send)
        self._sent = wire
        self._pending = self.transport.post(wire, peers, round_index, clock)

    def drain(self) -> None:
        """Wait for the exchange in flight (if any) and compute its correction into ``self.correction``."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self.completed = pending
        received = self._accept(self.transport.complete(pending), sorted(pending.peers))
        if self.ready:
            raise RuntimeError("a correction was drained before the previous one was applied")
        gossip_correction(self._sent, received, self._scale, out=self.correction)
        self._sent = None
        self.ready = bool(received)

    def take(self) -> Tensor | None:
        """The correction to apply now (consumed), or None."""
        if not self.ready:
            return None
        self.ready = False
        return self.correction

    def state_dict(self) -> dict:
        """After :meth:`drain`: the unapplied correction, so a resumed run folds it in at the same round."""
        if self._pending is not None:
            raise RuntimeError("drain() the exchange in flight before saving its state")
        completed = None
        if self.completed is not None:
            completed = {"round_index": self.completed.round_index, "peers": self.completed.peers,
                         "peer_clocks": self.completed.peer_clock_values()}
        return {"ready": self.ready, "correction": self.correction.clone() if self.ready else None,
                "completed": completed}

    def load_state_dict(self, state: Mapping) -> None:
        self.ready = bool(state["ready"])
        if self.ready:
            self.correction.copy_(state["correction"])
        completed = state.get("completed")
        self.completed = None if completed is None else PendingExchange(
            round_index=completed["round_index"], peers=dict(completed["peers"]),
            peer_clocks={p: torch.tensor([c], dtype=torch.float64) for p, c in completed["peer_clocks"].items()},
        )
