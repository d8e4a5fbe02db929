"""DiLoCo's mean of sparse messages with error feedback, and SparseLoCo's rule (arXiv 2508.15706).

Worker i keeps a residual e_i (:class:`~gasloc_lightning.algorithm.error_feedback.ErrorFeedback`) and,
at the end of every round, with its pseudo-gradient Delta_i = theta - thetaH_i:

    a_i = beta e_i + Delta_i,     m_i = D(E(a_i)),     e_i' = a_i - m_i,
    mean = (1/n) sum_i m_i        (decoded in worker order: every worker holds the same bits)

and the outer step moves the shared round start with that mean (``DiLoCoRound.step``). With the top-k
codec E keeps the k largest |a_i| (indices plus values at 2-8 bits): the mean is the sum of n sparse
vectors, so it travels as an all-gather of the n wires (``comm.transport.GossipTransport.all_gather_sparse_mean``;
the simulator stacks the same wires), never as a dense or quantized all-reduce, whose chunk owners would
re-encode the mean and drop most of it. With beta = 1 the identity ``sum_t m_i(t) + e_i(T) = sum_t Delta_i(t)``
holds: nothing is lost, only delayed. SparseLoCo's rule is this mean with beta = 0.95 and an outer SGD
*without* momentum (the decayed residual plays the part of the outer momentum): ``conf/strategy/sparseloco.yaml``.

Bytes: each worker sends its wire to the n - 1 others (a ring all-gather forwards n - 1 wires), so
``(n - 1) W`` per worker per round, W the wire of one message (:attr:`SparseMessages.wire_bytes`).

This module is pure arithmetic on flat float32 tensors (no process group); the engines move the wires.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gasloc_lightning.algorithm.codecs import build_codec
from gasloc_lightning.algorithm.error_feedback import ErrorFeedback, mean_of_wires

#: What a sparse DiLoCo round cannot take yet, each named by its option (checked by :func:`check_sparse_mean`).
STREAMED_OPTIONS = ("fragments", "fragment_sync_delay", "fragment_update_alpha", "overlap")


def check_sparse_mean(message_codec: str, *, error_feedback: bool, error_feedback_decay: float,
                      streamed: bool = False) -> bool:
    """Validate DiLoCo's message options; returns whether the mean is the all-gather of error-feedback wires.

    Args:
        message_codec: the codec name (already checked to be one).
        error_feedback: keep each worker's residual and send ``topk(Delta + e)``.
        error_feedback_decay: beta in (0, 1] on the residual (SparseLoCo: 0.95; 1: nothing is lost).
        streamed: whether the round is streamed by fragments (any of :data:`STREAMED_OPTIONS` set).
    """
    if isinstance(error_feedback_decay, bool) or not isinstance(error_feedback_decay, (int, float)) or \
            not 0.0 < error_feedback_decay <= 1.0:
        raise ValueError(f"error_feedback_decay (beta) must lie in (0, 1], got {error_feedback_decay!r}")
    codec = build_codec(message_codec)
    if codec.sparse and not error_feedback:
        raise ValueError(f"message_codec={message_codec!r} is sparse: without error_feedback=True the dropped "
                         "entries of every pseudo-gradient would be lost for good. Set error_feedback=True "
                         "(strategy=sparseloco does).")
    if not error_feedback:
        if error_feedback_decay != 1.0:
            raise ValueError("error_feedback_decay applies only with error_feedback=True")
        return False
    if codec.lossless:
        raise ValueError("error_feedback=True needs a lossy message_codec (a top-k codec such as 'topk-0.01-int2', "
                         "or int8, fp8, int4, int2, bfloat16): float32 drops nothing")
    if streamed:
        raise ValueError(f"error_feedback=True (the all-gather of sparse messages) with streamed rounds "
                         f"({', '.join(STREAMED_OPTIONS)}) is not supported yet: leave them at their defaults "
                         "(fragments=1, fragment_sync_delay=0, fragment_update_alpha=0, overlap=false)")
    return True


class SparseMessages:
    """Every worker's error feedback and the mean of their wires (one worker, or ``rows`` stacked workers).

    Args:
        message_codec: a lossy codec, usually top-k (``topk-0.01-int2``).
        numel: P, the elements of one pseudo-gradient.
        rows: n stacked workers (the simulator, each row its own residual); None: one worker.
        decay: beta in (0, 1] on the residual.
        device: where the residuals live.
    """

    def __init__(self, message_codec: str, numel: int, *, rows: int | None = None, decay: float = 1.0,
                 device: torch.device | str | None = None) -> None:
        self.codec = build_codec(message_codec)
        count = 1 if rows is None else rows
        # One residual per worker (not one stacked tensor): under churn only the live rows send.
        self._feedback = [ErrorFeedback(self.codec, numel, decay=decay, device=device) for _ in range(count)]
        self.rows, self.numel = rows, int(numel)
        self.wire_bytes = self.codec.wire_numel(numel)

    def residual(self, row: int | None = None) -> Tensor:
        """e_i: what worker ``row`` has not delivered yet."""
        return self._feedback[self._row(row)].residual

    def new_wires(self, count: int = 1) -> Tensor:
        """Uninitialised wires ``(count, W)`` (uint8)."""
        return self.codec.new_wire(self.numel, count, device=self._feedback[0].residual.device)

    @torch.no_grad()
    def encode(self, delta: Tensor, wire: Tensor, row: int | None = None) -> Tensor:
        """Worker ``row``: ``wire`` takes E(beta e + Delta) and e the dropped part; returns the decoded message."""
        return self._feedback[self._row(row)].encode(delta, wire)

    @torch.no_grad()
    def encode_rows(self, deltas: Tensor, rows: Sequence[int]) -> Tensor:
        """Stacked workers: the wires ``(len(rows), W)`` of ``deltas`` ``(len(rows), P)``, row k from worker rows[k]."""
        wires = self.new_wires(len(rows))
        for k, row in enumerate(rows):
            self.encode(deltas[k], wires[k], row=row)
        return wires

    @torch.no_grad()
    def mean(self, wires: Tensor, out: Tensor) -> Tensor:
        """The mean of the decoded wires ``(n, W)``, summed in worker order, into ``out`` (P,)."""
        return mean_of_wires(self.codec, wires, out)

    @torch.no_grad()
    def reset(self, row: int | None = None) -> None:
        """Forget worker ``row``'s residual (a joining worker: its old residual belongs to a stale round)."""
        self._feedback[self._row(row)].residual.zero_()

    def _row(self, row: int | None) -> int:
        if (row is None) != (self.rows is None):
            raise ValueError("row must be given for stacked workers and only for them")
        return 0 if row is None else row

    def state_dict(self) -> dict:
        return {"residuals": [feedback.state_dict() for feedback in self._feedback]}

    def load_state_dict(self, state: dict) -> None:
        residuals = state["residuals"]
        if len(residuals) != len(self._feedback):
            raise ValueError(f"the checkpoint holds {len(residuals)} error-feedback residuals, this run needs "
                             f"{len(self._feedback)}")
        for feedback, residual in zip(self._feedback, residuals):
            feedback.load_state_dict(residual)


def all_gather_bytes(wire_bytes: int, workers: int) -> int:
    """Bytes each worker sends in an all-gather of one ``wire_bytes`` wire per worker: (n - 1) W."""
    return max(0, workers - 1) * int(wire_bytes)


def all_gather_element_size(wire_bytes: int, numel: int, workers: int) -> float:
    """The bytes per element a ring all-reduce of ``numel`` elements must carry to cost what the all-gather of the
    wires costs: a network clock charges 2 (n - 1) / n of the vector, the all-gather moves (n - 1) W."""
    return workers * wire_bytes / (2 * numel) if workers > 1 else wire_bytes / numel
