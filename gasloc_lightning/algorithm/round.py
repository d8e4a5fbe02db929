"""One communication round on flat float32 tensors, for every engine: pure math, no process group.

The static strategy (``strategies/gasloc.py``, ``strategies/diloco.py``), the elastic strategy
(``strategies/elastic.py``) and the simulator (``sim/rounds.py``) all run their rounds through the two
classes here; they only move the wire between workers (a process group, or rows of one tensor).

**GASLoC** (:class:`GossipRound`). A point is ``[ trainable parameters | exchanged buffers ]``: the outer
step acts on the first ``num_parameters`` elements, buffers are mixed without momentum. One round of
worker i (``docs/algorithm.md``):

1. :meth:`GossipRound.begin`: thetaH_i becomes u_i (z_i for ``post_mix``) in place
   (:meth:`~gasloc_lightning.algorithm.outer.OuterState.message`); with overlap the correction of the
   previous exchange is folded in, p_i = u_i + beta C_i(t-1); the point is encoded for the wire
   (:mod:`~gasloc_lightning.algorithm.codecs`) and its *decoded* value m_i is kept.
2. The engine sends the wire to this round's peers and receives theirs.
3. Either exact mixing (float32 messages, no overlap; :meth:`GossipRound.mix`),
   ``theta_i' = u_i - sum_j w_ij (u_i - u_j)``, or a correction (:meth:`GossipRound.correct`),
   ``C_i = beta sum_j w_ij (m_j - m_i)``: applied at once (:meth:`GossipRound.apply_correction`), or,
   with overlap, one round late (:meth:`GossipRound.hold` keeps p_i as this round's result).
   Each worker uses its own decoded message m_i, so C is antisymmetric per pair and the replicas' mean
   is preserved exactly whatever the codec loses.
4. :meth:`GossipRound.finish`: the outer state moves to theta_i' and the point takes it.

A message that decodes to non-finite values is rejected: the worker keeps its own point for that
peer's share (the methods return the rejected indices; the engine counts and logs them).

Shapes: one worker's point is ``(N,)``; the simulator stacks n workers as ``(n, P)`` rows (parameters
only, ``num_parameters == P``) and passes ``row=i`` to the per-worker steps (2 and 3), while 1 and 4
act on every row at once. Every update is elementwise, so a row computes exactly what a worker does.

**DiLoCo** (:class:`DiLoCoRound`): the pseudo-gradient Delta_i = theta - thetaH_i, its mean over
the workers (the engine's all-reduce), and an outer ``torch.optim.SGD(lr=eta, momentum=gamma,
nesterov=gamma > 0)`` step of the shared round start. With a lossy codec the mean is the one a
quantized all-reduce computes (:class:`EncodedMean`, as torchft's ``allreduce_quantized``): every
worker encodes its Delta in n chunks, the owner of chunk c decodes the n encodings, sums them in
worker order, divides by n and encodes that mean again, and every worker decodes every chunk's mean.
Every worker therefore ends with the same bits; the engines differ only in how the chunks travel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gasloc_lightning.algorithm import fused as fused_kernels
from gasloc_lightning.algorithm.codecs import MessageCodec, build_codec
from gasloc_lightning.algorithm.outer import OuterState, all_finite, mix, validate_outer_hyperparameters

Received = Sequence[tuple[float, Tensor]]


def check_codec(message_codec: str, *, allow_sparse: bool = False, argument: str = "message_codec") -> str:
    """Return ``message_codec``; raise ``ValueError`` naming ``argument`` when it is unknown or sparse.

    Every entry point that takes a codec (the strategies' constructors, the apps' config checks, the
    simulator's rounds) calls this, so a user learns at once, not at setup or at the first round.

    Args:
        message_codec: a codec name (see :func:`build_codec`).
        allow_sparse: accept a sparse (top-k) codec: the entry points that take one with error feedback
            (DiLoCo and gossip in ``gasloc-train`` and ``gasloc-sim``) pass True; the elastic mode does not.
        argument: the argument or config key to name in the error (``strategy.message_codec`` in a config).
    """
    try:
        sparse = build_codec(message_codec).sparse
    except ValueError as error:
        raise ValueError(f"{argument}={message_codec!r} is not a codec: {error}") from None
    if sparse and not allow_sparse:
        raise ValueError(f"{argument}={message_codec!r} is a sparse (top-k) codec, which the elastic mode does not "
                         "take: use it with error feedback in gasloc-train or gasloc-sim (strategy=sparseloco, or "
                         "strategy=gasloc with error_feedback=true); see docs/algorithm.md")
    return message_codec


#: The consensus step of a sparse codec by default. benchmarks/topk_gossip.py (ring of 4, P = 1000, seed 0,
#: topk-0.01-int8 with per-edge error feedback): only s = 0.05 contracted (spread 0.35 / 0.21 / 0.11 / 0.09 of
#: the start after 100 / 200 / 400 / 800 rounds); s = 0.2, 0.5 and 1 grew it (10, 50 and 4e4 after 800 rounds).
SPARSE_CONSENSUS_STEP = 0.05


def resolve_consensus_step(message_codec: str, consensus_step: float | None, *, error_feedback: bool) -> float:
    """Gossip's consensus step s for ``message_codec`` (None: the default); refuses a sparse codec without
    ``error_feedback`` (the rest of the point would be sent as zeros)."""
    sparse = build_codec(message_codec).sparse
    if sparse and not error_feedback:
        raise ValueError(f"message_codec={message_codec!r} is sparse: gossip takes it only with error_feedback=True "
                         "(per-edge public copies), or the rest of the point would be sent as zeros")
    if consensus_step is None:
        return SPARSE_CONSENSUS_STEP if sparse else 1.0
    if isinstance(consensus_step, bool) or not isinstance(consensus_step, (int, float)) or \
            not 0.0 < consensus_step <= 1.0:
        raise ValueError(f"consensus_step (s) must be None or lie in (0, 1], got {consensus_step!r}")
    return float(consensus_step)


def wire_format(message_codec: str, numel: int) -> tuple[int, torch.dtype]:
    """``(elements, dtype)`` of one message of ``numel`` float32 elements on the wire (a transport's buffers)."""
    check_codec(message_codec, allow_sparse=True)
    if message_codec == "float32":
        return numel, torch.float32
    if message_codec == "bfloat16":
        return numel, torch.bfloat16
    return build_codec(message_codec).wire_numel(numel), torch.uint8


def codec_bytes_per_element(message_codec: str, numel: int) -> float:
    """Bytes on the wire per element of a ``numel``-element message (what a network clock charges)."""
    wire_numel, dtype = wire_format(message_codec, numel)
    return wire_numel * dtype.itemsize / numel


class GossipRound:
    """GASLoC's round for one worker (a ``(N,)`` point) or n stacked workers (``(n, P)`` rows).

    Args:
        initial: the starting point(s): ``(N,)`` for one worker, ``(n, P)`` for stacked workers.
        num_parameters: elements of the point that are trainable parameters (the rest: exchanged buffers).
        outer_lr, outer_momentum, outer_form: eta, gamma and the form of the outer step.
        message_codec: how the message goes on the wire (``float32``, ``bfloat16``, ``int8``, ``fp8``,
            ``int4``, ``int2``; see :mod:`gasloc_lightning.algorithm.codecs`).
        overlap: fold each exchange in one round late instead of waiting for it.
        delayed_weight: beta in (0, 1], the scale of the late correction (overlap only).
        error_feedback: send each peer the encoded *difference* between the point and the public copy that
            peer holds of it (CHOCO-gossip, per edge; see :class:`EdgeCopies`), instead of the encoded point.
            Needs a lossy codec and edges that repeat (a fixed or periodic graph).
        consensus_step: s in (0, 1], the factor on every correction C_i (CHOCO's consensus step size). None:
            1 for dense codecs, :data:`SPARSE_CONSENSUS_STEP` for a sparse (top-k) one, which needs a damped
            step (benchmarks/topk_gossip.py). Only the rounds that mix by correction take s < 1.
        fused: run the exact round (float32, no overlap, anchored, one worker, one peer) as two fused
            kernels (:mod:`gasloc_lightning.algorithm.fused`); None: when that module says it pays (large
            vectors on CPU, ``GASLOC_FUSED_ROUND``). The results differ from the eager passes in the last bits.
    """

    def __init__(
        self,
        initial: Tensor,
        num_parameters: int,
        *,
        outer_lr: float,
        outer_momentum: float,
        outer_form: str = "anchored",
        message_codec: str = "float32",
        overlap: bool = False,
        delayed_weight: float = 1.0,
        error_feedback: bool = False,
        consensus_step: float | None = None,
        fused: bool | None = None,
    ) -> None:
        if initial.dim() not in (1, 2):
            raise ValueError(f"initial must be one point (N,) or stacked rows (n, P), got shape {tuple(initial.shape)}")
        numel = initial.shape[-1]
        if not 0 < num_parameters <= numel:
            raise ValueError(f"num_parameters must lie in [1, {numel}], got {num_parameters}")
        if initial.dim() == 2 and num_parameters != numel:
            raise ValueError("stacked rows carry parameters only: num_parameters must equal the row length")
        if not 0.0 < delayed_weight <= 1.0:
            raise ValueError(f"delayed_weight (beta) must lie in (0, 1], got {delayed_weight!r}")
        self.message_codec = check_codec(message_codec, allow_sparse=True)  # refused below, with the reason
        if error_feedback and message_codec == "float32":
            raise ValueError("error_feedback needs a lossy message_codec (int8, fp8, int4, int2, bfloat16)")
        self.consensus_step = resolve_consensus_step(message_codec, consensus_step, error_feedback=error_feedback)
        self.num_parameters, self.numel = int(num_parameters), int(numel)
        self.overlap = bool(overlap)
        self.by_correction = self.overlap or message_codec != "float32"
        if self.consensus_step != 1.0 and not self.by_correction:
            raise ValueError(f"consensus_step={consensus_step!r} needs a round that mixes by correction (a lossy "
                             "message_codec or overlap); the exact float32 mix takes the full step")
        self._scale = (float(delayed_weight) if self.overlap else 1.0) * self.consensus_step
        self.outer = OuterState(initial[..., :num_parameters], outer_lr, outer_momentum, outer_form)
        rows, device = tuple(initial.shape[:-1]), initial.device
        self._codec = None if message_codec in ("float32", "bfloat16") else build_codec(message_codec)
        self.correction = torch.zeros(*rows, numel, device=device) if self.by_correction else None
        self.ready = torch.zeros(rows, dtype=torch.bool, device="cpu")  # a correction not yet applied
        self._wire: Tensor | None = None
        self._own: Tensor | None = None  # the decoded own message (quantized codecs)
        self._scratch: Tensor | None = None  # one peer's decoded message (quantized codecs)
        if error_feedback:
            pass  # EdgeCopies keeps its own wires and scratch
        elif self._codec is not None:
            self._wire = self._codec.new_wire(numel, *rows, device=device)
            self._own = torch.empty(*rows, numel, device=device)
            self._scratch = torch.empty(numel, device=device)
        elif message_codec == "bfloat16" or self.overlap:
            self._wire = torch.empty(*rows, numel, dtype=self.wire_dtype, device=device)
        self._sent: Tensor | None = None  # m_i of the exchange in flight (float32 or bfloat16)
        self.copies = EdgeCopies(initial, build_codec(message_codec)) if error_feedback else None
        self._point: Tensor | None = None  # u (p) of this round, for the per-peer messages of error feedback
        self._outgoing: Tensor | None = None  # the wire every peer gets (without error feedback)
        fusable = outer_form == "anchored" and not self.by_correction and initial.dim() == 1
        if fused and not fusable:
            raise ValueError("fused=True needs the exact round: float32 messages, no overlap, the anchored form and "
                             "one worker's point")
        self.fused = fusable and (fused if fused is not None else fused_kernels.enabled(num_parameters,
                                                                                         device=device))
        self.message_finite: bool | None = None  # the fused message's own finite check (None: not checked)
        self._finished = False  # the fused mix already finished the outer step

    # ------------------------------------------------------------------ the wire
    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of the tensor on the wire (and of a transport's receive buffers)."""
        return wire_format(self.message_codec, self.numel)[1]

    @property
    def wire_numel(self) -> int:
        """Elements of one worker's wire tensor (scales included)."""
        return wire_format(self.message_codec, self.numel)[0]

    @property
    def wire_bytes(self) -> int:
        """Bytes of one worker's message on the wire."""
        return self.wire_numel * self.wire_dtype.itemsize

    @property
    def bytes_per_element(self) -> float:
        """Bytes on the wire per exchanged element (what a network clock charges)."""
        return codec_bytes_per_element(self.message_codec, self.numel)

    @property
    def mixed(self) -> Tensor:
        """Where the mixed parameters of this round go (the old round start is no longer needed)."""
        return self.outer.mixed_destination()

    # ------------------------------------------------------------------ steps 1 and 4: every row at once
    @torch.no_grad()
    def begin(self, point: Tensor, *, send: bool = True) -> Tensor | None:
        """Start the round on ``point`` (thetaH, overwritten with u or p); returns the wire to send.

        With ``send=False`` (a rank that does not exchange) nothing is encoded and None is returned.
        """
        if self.fused:
            outer = self.outer
            self.message_finite = fused_kernels.fused_message(
                point[: self.num_parameters], outer.round_start, outer.anchor, outer.outer_lr, outer.outer_momentum,
                compiled=True)
        else:
            self.outer.message(point[..., : self.num_parameters])
        if self.overlap and bool(self.ready.any()):
            if point.dim() == 1:
                point.add_(self.correction)
            else:
                rows = self.ready.nonzero().flatten().to(point.device)
                point.index_add_(0, rows, self.correction.index_select(0, rows))
            self.ready.zero_()
        if self.copies is not None:
            self._point = point
            return None
        return self._encode(point) if send else None

    def messages(self, peers: Sequence[int], row: int | None = None) -> list[Tensor]:
        """The wire for each peer (sorted ids), after :meth:`begin`: the same wire for all, or, with error
        feedback, each peer's encoded difference to its public copy (which this call advances)."""
        if self.copies is None:
            if self._outgoing is None:
                raise RuntimeError("messages() before begin()")
            return [self._outgoing if row is None else self._outgoing[row]] * len(peers)
        point = self._point if row is None else self._point[row]
        return [self.copies.encode(point, row, peer) for peer in peers]

    def _encode(self, point: Tensor) -> Tensor:
        if self._codec is not None:
            self._codec.encode(point, self._wire, decoded=self._own)
            self._sent, self._outgoing = self._own, self._wire
        elif self._wire is None:  # float32 without overlap: the point itself goes out
            self._sent = self._outgoing = point
        else:
            self._sent = self._outgoing = self._wire.copy_(point)
        return self._outgoing

    @torch.no_grad()
    def finish(self, point: Tensor) -> Tensor:
        """End the round: :attr:`mixed` holds theta' (parameters); the outer state and ``point`` take it."""
        if self._finished:  # the fused mix wrote theta' into the point and the outer state already
            self._finished = False
            return self.outer.round_start
        new_start = self.outer.finish(None, self.mixed)
        point[..., : self.num_parameters].copy_(new_start)
        return new_start

    # ------------------------------------------------------------------ steps 2-3: one worker (row)
    def _values(self, wire: Tensor) -> Tensor:
        """A received wire as numbers: itself (float32, bfloat16) or decoded into scratch."""
        if self._codec is None:
            return wire
        return self._codec.decode(wire, self._scratch)

    @torch.no_grad()
    def mix(self, point: Tensor, received: Received, row: int | None = None) -> list[int]:
        """Exact mixing (float32, no overlap): parameters into :attr:`mixed`, buffers in place.

        Returns the indices of ``received`` rejected as non-finite.
        """
        if self.by_correction:
            raise RuntimeError("mix() is the exact float32 path; this round mixes by correction()")
        accepted, rejected = [], []
        for k, (weight, wire) in enumerate(received):
            if all_finite(wire):
                accepted.append((weight, wire))
            else:
                rejected.append(k)
        n = self.num_parameters
        u = point if row is None else point[row]
        mixed = self.mixed if row is None else self.mixed[row]
        if self.fused and len(accepted) == 1:  # one pass: theta' into the point and the round start, x'
            (weight, other), outer = accepted[0], self.outer
            fused_kernels.fused_pair_finish(u[:n], other[:n], weight, outer.round_start, outer.anchor,
                                            outer.outer_momentum, compiled=True)
            self._finished = True
        else:
            mix(u[:n], [(w, r[:n]) for w, r in accepted], out=mixed)
        if self.numel > n:
            if row is not None:
                raise ValueError("stacked rows carry no buffers")
            mix(u[n:], [(w, r[n:]) for w, r in accepted], out=u[n:])
        return rejected

    @torch.no_grad()
    def correct(self, received: Received, row: int | None = None, peers: Sequence[int] | None = None) -> list[int]:
        """C_i = beta sum_j w_ij (m_j - m_i) from the peers' wires into :attr:`correction`.

        With error feedback m_j is the public copy of j's point that this worker holds, and m_i the copy
        j holds of this worker's (``peers``: the ids of ``received``'s senders, in order).
        Returns the indices of ``received`` rejected as non-finite (their share is left out).
        """
        if not self.by_correction:
            raise RuntimeError("correct() needs overlap or a lossy codec; this round mixes exactly")
        if self.copies is not None:
            if peers is None or len(peers) != len(received):
                raise ValueError("error feedback needs the peer id of every received message")
            return self._correct_from_copies(received, row, peers)
        if self._sent is None:
            raise RuntimeError("correct() before begin(): no message was sent")
        if bool(self.ready if row is None else self.ready[row]):
            raise RuntimeError("a correction was computed before the previous one was applied")
        out = self.correction if row is None else self.correction[row]
        own = self._sent if row is None else self._sent[row]
        total, rejected = 0.0, []
        for k, (weight, wire) in enumerate(received):
            values = self._values(wire)
            if not all_finite(values):
                rejected.append(k)
                continue
            if total == 0.0:
                out.copy_(values).mul_(self._scale * weight)
            else:
                out.add_(values, alpha=self._scale * weight)
            total += weight
        if total:
            out.add_(own, alpha=-self._scale * total)
        if row is None:
            self.ready.fill_(bool(total))
        else:
            self.ready[row] = bool(total)
        return rejected

    def _correct_from_copies(self, received: Received, row: int | None, peers: Sequence[int]) -> list[int]:
        if bool(self.ready if row is None else self.ready[row]):
            raise RuntimeError("a correction was computed before the previous one was applied")
        out = self.correction if row is None else self.correction[row]
        out.zero_()
        total, rejected = 0.0, []
        for k, ((weight, wire), peer) in enumerate(zip(received, peers)):
            theirs = self.copies.decode(wire, row, peer)
            if theirs is None:  # its sender advanced its copy of this edge: dropping it would shift the mean forever
                raise FloatingPointError(
                    f"a non-finite error-feedback message from peer {peer}: the two ends of that edge no longer "
                    "hold the same public copies, so the replicas' mean would drift every round. A worker never "
                    "sends one (its own point is checked first): the message was corrupted on the way. Turn "
                    "error_feedback off on an untrusted network.")
            out.add_(theirs, alpha=self._scale * weight).sub_(self.copies.sent(row, peer), alpha=self._scale * weight)
            total += weight
        if row is None:
            self.ready.fill_(bool(total))
        else:
            self.ready[row] = bool(total)
        return rejected

    @torch.no_grad()
    def apply_correction(self, point: Tensor, row: int | None = None) -> None:
        """Without overlap: theta' = u + C now (parameters into :attr:`mixed`, buffers in place)."""
        n = self.num_parameters
        u = point if row is None else point[row]
        mixed = self.mixed if row is None else self.mixed[row]
        ready = self.ready if row is None else self.ready[row]
        if not bool(ready):
            mixed.copy_(u[:n])
            return
        correction = self.correction if row is None else self.correction[row]
        torch.add(u[:n], correction[:n], out=mixed)
        if self.numel > n:
            u[n:].add_(correction[n:])
        if row is None:
            self.ready.fill_(False)
        else:
            self.ready[row] = False

    @torch.no_grad()
    def hold(self, point: Tensor, row: int | None = None) -> None:
        """With overlap: this round's result is the point p itself; its exchange is folded in next round."""
        n = self.num_parameters
        (self.mixed if row is None else self.mixed[row]).copy_((point if row is None else point[row])[:n])

    @torch.no_grad()
    def flush(self, point: Tensor) -> None:
        """End of training: fold a correction still pending into the point and the round start."""
        if self.correction is None or not bool(self.ready.any()):
            return
        if point.dim() == 1:
            point.add_(self.correction)
            self.outer.round_start.add_(self.correction[: self.num_parameters])
        else:
            rows = self.ready.nonzero().flatten().to(point.device)
            point.index_add_(0, rows, self.correction.index_select(0, rows))
            self.outer.round_start.index_add_(0, rows, self.correction.index_select(0, rows))
        self.ready.zero_()

    @torch.no_grad()
    def join(self, worker: int, source: int) -> None:
        """Stacked rows: a joining worker takes its source's outer state (round start and anchor)."""
        for buffer in (self.outer.round_start, self.outer.anchor):
            buffer[worker].copy_(buffer[source])
        self.ready[worker] = False

    def state_dict(self) -> dict:
        """The outer state and an unapplied correction (after the exchange in flight has completed)."""
        ready = bool(self.ready.any())
        state = {"outer": self.outer.state_dict(), "ready": ready,
                 "correction": self.correction.clone() if ready else None}
        if self.copies is not None:
            state["copies"] = self.copies.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer"])
        if self.copies is not None:
            if state.get("copies") is None:
                raise ValueError("the checkpoint has no error-feedback copies (error_feedback was off)")
            self.copies.load_state_dict(state["copies"])
        ready = bool(state.get("ready", False))
        if ready:
            if self.correction is None or state["correction"].shape != self.correction.shape:
                raise ValueError("the checkpoint holds a pending correction this round cannot take "
                                 "(overlap or the codec changed, or another model)")
            self.correction.copy_(state["correction"])
        self.ready.fill_(ready)


class EdgeCopies:
    """Error feedback for gossip on repeated edges: per-edge public copies (CHOCO-gossip, Koloskova et al. 2019).

    For each edge (i, j) both ends hold the same two copies: x_ij, what j knows of i's point, and x_ji,
    what i knows of j's. When the edge is active, i sends q = Q(u_i - x_ij) and both ends add the
    decoded q to x_ij (j symmetrically). Worker i then mixes with the copies,
    ``C_i = beta sum_j w_ij (x_ji - x_ij)``: antisymmetric per edge, since both ends hold identical
    copies (decoding is deterministic), so the replicas' mean is preserved exactly. The compressed
    quantity u_i - x_ij shrinks as the copy tracks the point, so 4 and 2 bits suffice where the point
    itself could not be sent with them. The copies start at the initial point, which every worker holds.

    Memory: two model copies per distinct neighbour (ring: 4, torus: 8, exponential: 2 log2 n), plus the
    initial point. Random matchings (``one_peer``, ``two_peer``, ``bandwidth_aware``) are refused by the
    engines: an edge recurs about once in n - 1 rounds, so a worker would keep 2 (n - 1) copies, each
    stale by n rounds of training.

    Args:
        initial: the starting point(s), ``(N,)`` or stacked ``(n, P)``.
        codec: the lossy codec of the differences.
    """

    def __init__(self, initial: Tensor, codec: MessageCodec) -> None:
        self.origin = initial.detach().to(torch.float32, copy=True)
        self.codec = codec
        self._sent: dict[tuple[int | None, int], Tensor] = {}  # (row, peer): x_ij
        self._received: dict[tuple[int | None, int], Tensor] = {}  # (row, peer): x_ji
        self._wires: dict[tuple[int | None, int], Tensor] = {}
        numel = self.origin.shape[-1]
        self._scratch = torch.empty(numel, device=self.origin.device)
        self.wire_dtype = wire_format(codec.name, numel)[1]

    def _start(self, row: int | None) -> Tensor:
        return self.origin if row is None else self.origin[row]

    def sent(self, row: int | None, peer: int) -> Tensor:
        """x_ij: the copy peer j holds of this worker's (row's) point."""
        key = (row, peer)
        if key not in self._sent:
            self._sent[key] = self._start(row).clone()
        return self._sent[key]

    def _received_copy(self, row: int | None, peer: int) -> Tensor:
        key = (row, peer)
        if key not in self._received:
            self._received[key] = self._start(row).clone()  # every row starts from the same point
        return self._received[key]

    @property
    def num_copies(self) -> int:
        """Model-size copies held now (both directions of every edge seen so far)."""
        return len(self._sent) + len(self._received)

    @torch.no_grad()
    def encode(self, point: Tensor, row: int | None, peer: int) -> Tensor:
        """The wire of Q(u_i - x_ij) for ``peer``; x_ij advances by its decoded value."""
        copy = self.sent(row, peer)
        key = (row, peer)
        if key not in self._wires:
            self._wires[key] = self.codec.new_wire(copy.numel(), device=copy.device)
        difference = torch.sub(point, copy, out=self._scratch)
        self.codec.encode(difference, self._wires[key], decoded=difference)
        copy.add_(difference)
        return self._wires[key].view(self.wire_dtype)  # bfloat16 travels as bfloat16, as without feedback

    @torch.no_grad()
    def decode(self, wire: Tensor, row: int | None, peer: int) -> Tensor | None:
        """Advance x_ji by the decoded wire from ``peer``; None (nothing changed) when it is not finite."""
        difference = self.codec.decode(wire.view(torch.uint8), self._scratch)
        if not all_finite(difference):
            return None
        return self._received_copy(row, peer).add_(difference)

    def state_dict(self) -> dict:
        return {"origin": self.origin.clone(),
                "sent": {f"{r}:{p}": t.clone() for (r, p), t in self._sent.items()},
                "received": {f"{r}:{p}": t.clone() for (r, p), t in self._received.items()}}

    def load_state_dict(self, state: dict) -> None:
        def key(text: str) -> tuple[int | None, int]:
            row, peer = text.split(":")
            return (None if row == "None" else int(row)), int(peer)

        if state["origin"].shape != self.origin.shape:
            raise ValueError("the error-feedback copies' origin does not fit this model")
        self.origin.copy_(state["origin"])  # copies of edges not yet active start from it
        for name, target in (("sent", self._sent), ("received", self._received)):
            target.clear()
            for text, tensor in state[name].items():
                if tensor.shape != self.origin.shape[-1:]:
                    raise ValueError(f"error-feedback copy {name}[{text}] does not fit this model")
                target[key(text)] = tensor.clone().to(self.origin.device)


class EncodedMean:
    """The arithmetic of a quantized all-reduce mean over n workers (reduce-scatter, then all-gather, encoded).

    A vector of ``numel`` elements is zero-padded to n chunks of ``chunk`` elements (a multiple of the
    codec's block), so every chunk's wire has the same size and no block straddles two chunks.

    Args:
        message_codec: a lossy codec name (``bfloat16``, ``int8``, ``fp8``, ``int4``, ``int2``).
        numel: elements of the averaged vector.
        workers: n.
    """

    def __init__(self, message_codec: str, numel: int, workers: int) -> None:
        if check_codec(message_codec, allow_sparse=True) == "float32":  # sparse: refused below, with the reason
            raise ValueError("EncodedMean is for lossy codecs; a float32 mean is a plain all-reduce")
        if message_codec == "int2":
            raise ValueError("message_codec='int2' has no zero level (0 decodes to +scale/2), so a mean of encoded "
                             "pseudo-gradients moves every parameter that did not move: use int4 or int8 for DiLoCo")
        if build_codec(message_codec).sparse:
            raise ValueError(f"message_codec={message_codec!r} is sparse: the owner of a chunk would re-encode the "
                             "mean and drop most of it. A sparse mean is an all-gather of the workers' encodings "
                             "with error feedback (algorithm/error_feedback.py), not a quantized all-reduce")
        if workers < 1 or numel < 1:
            raise ValueError(f"workers and numel must be >= 1, got {workers} and {numel}")
        self.codec = build_codec(message_codec)
        self.numel, self.workers = int(numel), int(workers)
        block = self.codec.block_size
        self.chunk = math.ceil(math.ceil(numel / workers) / block) * block
        self.chunk_wire = self.codec.wire_numel(self.chunk)

    @property
    def padded(self) -> int:
        return self.chunk * self.workers

    @torch.no_grad()
    def encode_chunks(self, vector: Tensor, padded: Tensor, wires: Tensor) -> Tensor:
        """One worker's vector into ``wires`` (n, chunk_wire): row c is chunk c's encoding.

        ``padded`` is a float32 scratch of :attr:`padded` elements (its tail stays zero).
        """
        padded[: self.numel].copy_(vector)
        padded[self.numel :].zero_()
        self.codec.encode(padded.view(self.workers, self.chunk), wires)
        return wires

    @torch.no_grad()
    def reduce_chunk(self, received: Tensor, out_wire: Tensor, scratch: Tensor, total: Tensor) -> Tensor:
        """The owner of a chunk: ``received`` (n, chunk_wire), row j from worker j, into the encoded mean.

        ``scratch`` and ``total`` are float32 buffers of :attr:`chunk` elements.
        """
        total.zero_()
        for row in received:  # in worker order, as every engine sums
            total.add_(self.codec.decode(row, scratch))
        total.div_(self.workers)
        self.codec.encode(total, out_wire)
        return out_wire

    @torch.no_grad()
    def decode_all(self, gathered: Tensor, padded: Tensor, out: Tensor) -> Tensor:
        """Every chunk's encoded mean (n, chunk_wire) into ``out`` (``numel`` elements)."""
        self.codec.decode(gathered, padded.view(self.workers, self.chunk))
        return out.copy_(padded[: self.numel])

    def mean(self, vectors: Tensor) -> Tensor:
        """All at once in one process (the simulator): the mean of the rows of ``vectors`` (n, numel)."""
        n = self.workers
        if vectors.shape != (n, self.numel):
            raise ValueError(f"vectors must be ({n}, {self.numel}), got {tuple(vectors.shape)}")
        device = vectors.device
        padded = torch.empty(self.padded, device=device)
        wires = self.codec.new_wire(self.chunk, n, n, device=device)  # [worker, chunk]
        for worker in range(n):
            self.encode_chunks(vectors[worker], padded, wires[worker])
        means = self.codec.new_wire(self.chunk, n, device=device)
        scratch, total = torch.empty(self.chunk, device=device), torch.empty(self.chunk, device=device)
        for chunk in range(n):
            self.reduce_chunk(wires[:, chunk], means[chunk], scratch, total)
        return self.decode_all(means, padded, torch.empty(self.numel, device=device))


class DiLoCoRound:
    """DiLoCo's outer step: the shared round start theta and its outer Nesterov SGD.

    Args:
        initial: the flat starting parameters (copied).
        outer_lr: eta of the outer SGD.
        outer_momentum: gamma, its Nesterov momentum (0 disables momentum).
    """

    def __init__(self, initial: Tensor, *, outer_lr: float, outer_momentum: float) -> None:
        validate_outer_hyperparameters(outer_lr, outer_momentum, "anchored")
        self.round_start = nn.Parameter(initial.detach().to(torch.float32, copy=True))
        self.optimizer = torch.optim.SGD([self.round_start], lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)

    @torch.no_grad()
    def pseudo_gradient(self, local_end: Tensor, out: Tensor | None = None) -> Tensor:
        """Delta = theta - thetaH (rows: every worker's), into ``out`` (default: over ``local_end``)."""
        return torch.sub(self.round_start, local_end, out=local_end if out is None else out)

    @torch.no_grad()
    def step(self, mean_pseudo_gradient: Tensor) -> Tensor:
        """The outer step with the workers' mean Delta; returns the new round start."""
        self.round_start.grad = mean_pseudo_gradient
        self.optimizer.step()
        self.round_start.grad = None
        return self.round_start.detach()

    @torch.no_grad()
    def reset(self, point: Tensor) -> None:
        """Move the round start to ``point`` (replicas averaged outside a round); momentum is kept."""
        self.round_start.copy_(point)

    def state_dict(self) -> dict:
        return {"round_start": self.round_start.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["round_start"].shape != self.round_start.shape:
            raise ValueError(f"outer state has {state['round_start'].numel()} elements, this model needs "
                             f"{self.round_start.numel()}: the checkpoint belongs to another model")
        with torch.no_grad():
            self.round_start.copy_(state["round_start"])
        self.optimizer.load_state_dict(state["optimizer"])
