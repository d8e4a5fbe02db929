"""Message codecs: how a flat float32 message (the gossiped point u_i) goes on the wire and back.

A codec turns a float32 vector of P elements into ONE ``torch.uint8`` tensor of ``wire_numel(P)``
bytes (every process-group backend sends uint8, and the transport counts exactly what it sends), and
decodes such a wire back into float32. Stacked inputs ``(n, P)`` are n independent messages: row i of
the wire is byte for byte what encoding row i alone gives.

Wire layout of the block codecs: ``[ values | scales ]``. Every ``block_size`` consecutive elements
share one float32 scale (the last block of a row may be partial); the values are packed densely over
the whole row (the last byte of a packed row is padded with zero bits) and the scales follow as the
bytes of ``ceil(P / block_size)`` float32 numbers. The scale s of a block is absmax / L, with L its
largest level; the error bounds hold up to float32 rounding (about 1e-7 relative):

=========  ========================================  ==============  ==========================
codec      values (per element)                      scale           max abs error per block
=========  ========================================  ==============  ==========================
float32    the 4 bytes of x                          none            0 (lossless)
bfloat16   ``x.to(torch.bfloat16)`` (nearest even)   none            2^-8 |x| (relative)
int8       round(x / s) in [-127, 127], 1 byte       absmax / 127    absmax / 254
fp8        (x / s) as ``float8_e4m3fn``, 1 byte      absmax / 448    2^-4 |x| + 2^-10 s
int4       round(x / s) in [-7, 7], 4 bits           absmax / 7      absmax / 14
int2       s * {-1.5, -0.5, 0.5, 1.5}, 2 bits        absmax / 1.5    absmax / 3
=========  ========================================  ==============  ==========================

int2 has no zero level: it rounds to the nearest level with ties upwards (x = 0 decodes to +s/2
unless the whole block is zero). All rounding is deterministic (no stochastic rounding). A block of
zeros has scale 0 and decodes to exact zeros; a constant block decodes to its value up to the rounding
of s = c / L (the largest level times s).

Bytes on the wire relative to float32 (``wire_numel(P) / (4 P)``, P a multiple of ``block_size`` and
of 4) with the default ``block_size`` = 128: float32 1, bfloat16 2/4 = 0.5, int8 and fp8
(1 + 4/128) / 4 = 0.2578, int4 (0.5 + 4/128) / 4 = 0.1328, int2 (0.25 + 4/128) / 4 = 0.0703.

Non-finite input never raises: it makes its block's absmax, hence its scale, non-finite, and every
element of that block then decodes to NaN or +-inf (float32 and bfloat16 carry each non-finite value
through as itself; bfloat16 also rounds finite values past its largest, about 3.4e38, to inf). The
caller checks the decoded message for finiteness.

Decoding is exact integer-to-float conversion then one multiplication by the scale, so every device
decodes a given wire to the same bits; an engine may rely on its own ``decoded`` message being exactly
what its peers decode from its wire.

**Top-k** (:class:`TopKCodec`, named ``topk``, ``topk-<density>`` or ``topk-<density>-<values>``, e.g.
``topk-0.01-int2``): a sparse codec. Each row keeps its k = ceil(density P) entries of largest magnitude
(ties: the lowest index; NaN ranks above +-inf) and sends ``[ indices | values ]``: the k indices in
ascending order (int32; int64 beyond 2^31 - 1 elements) and the k values encoded by a dense codec above
(``values``, default int4, with one scale per ``block_size`` *kept* values: a ``block_size`` of at least k
is one scale per message). Every other entry decodes to exactly 0, so the codec is meant for a message
with error feedback (the dropped part is kept and sent later: ``algorithm/error_feedback.py`` for
DiLoCo-like means, :mod:`~gasloc_lightning.algorithm.sparse_mean` for SparseLoCo; gossip's per-edge copies with a
damped ``consensus_step``; docs/algorithm.md section 5d, which also lists where it is refused). At 1% density the wire is
0.0107x (int2) to 0.0126x (int8) float32's bytes; the indices are most of it. A wire whose indices are
out of range or not increasing (corrupted on the way) decodes to a row of NaN, never to an error, so
the caller's finiteness check rejects it.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from fractions import Fraction

import torch
from torch import Tensor

CODECS: tuple[str, ...] = ("float32", "bfloat16", "int8", "fp8", "int4", "int2")
# 128: int8 and int4 cost 0.258x and 0.133x float32 scales included (<= 0.27x and 0.14x), and an outlier
# coarsens only its own 128 elements.
DEFAULT_BLOCK_SIZE = 128
_SCALE_BYTES = 4  # float32 scales
TOPK = "topk"  # the sparse family: topk, topk-<density>, topk-<density>-<values>
# 1%: SparseLoCo's range is 1-3%. int4 values: a zero level (int2 has none) at 0.0113x float32's bytes.
DEFAULT_TOPK_DENSITY = 0.01
DEFAULT_TOPK_VALUES = "int4"


class MessageCodec(abc.ABC):
    """A float32 <-> uint8 wire codec for flat messages of shape ``(..., P)``; rows are independent.

    Args:
        block_size: elements sharing one scale (ignored by ``float32`` and ``bfloat16``).
    """

    name: str
    lossless: bool = False
    sparse: bool = False  # most entries decode to 0: usable only with error feedback

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size})"

    @abc.abstractmethod
    def wire_numel(self, numel: int) -> int:
        """Bytes of one encoded message of ``numel`` elements, scales included."""

    def new_wire(self, numel: int, *leading: int, device: torch.device | str | None = None) -> Tensor:
        """An uninitialised uint8 wire ``(*leading, wire_numel(numel))`` for ``numel``-element messages."""
        return torch.empty((*leading, self.wire_numel(numel)), dtype=torch.uint8, device=device)

    def encode(self, x: Tensor, wire: Tensor, decoded: Tensor | None = None) -> Tensor | None:
        """Write the wire of ``x``; optionally also its decoded value.

        Args:
            x: float32 ``(..., P)``; each row is one message.
            wire: uint8 ``(..., wire_numel(P))``, written (a buffer from :meth:`new_wire`, or rows of one).
            decoded: optional float32 ``(..., P)`` that receives ``decode(wire)``; it may alias ``x``
                (then x becomes its own decoded value, in place).

        Returns:
            ``decoded``, or ``None`` when it was not given.
        """
        _check_float(x, "x")
        _check_wire(wire, x, self.wire_numel(x.shape[-1]))
        if decoded is not None:
            _check_float(decoded, "decoded")
            if decoded.shape != x.shape or decoded.device != x.device:
                raise ValueError(f"decoded must have the shape and device of x {tuple(x.shape)} on "
                                 f"{x.device}, got {tuple(decoded.shape)} on {decoded.device}")
        # decoded is overwritten below anyway, so it serves as the scratch (no model-size allocation).
        self._encode(x, wire, scratch=decoded)
        if decoded is None:
            return None
        return self.decode(wire, decoded)  # the decoded message is by construction what peers decode

    def decode(self, wire: Tensor, out: Tensor) -> Tensor:
        """Decode uint8 ``(..., wire_numel(P))`` into float32 ``out`` ``(..., P)``; returns ``out``."""
        _check_float(out, "out")
        _check_wire(wire, out, self.wire_numel(out.shape[-1]))
        self._decode(wire, out)
        return out

    @abc.abstractmethod
    def _encode(self, x: Tensor, wire: Tensor, scratch: Tensor | None) -> None:
        """Write the wire of ``x``; ``scratch`` (like x, may be x itself) may be clobbered once x is read."""

    @abc.abstractmethod
    def _decode(self, wire: Tensor, out: Tensor) -> None: ...


class _CastCodec(MessageCodec):
    """The wire holds the bytes of x cast to a float dtype, elementwise (no scales)."""

    dtype: torch.dtype

    def wire_numel(self, numel: int) -> int:
        return _check_numel(numel) * self.dtype.itemsize

    def _encode(self, x: Tensor, wire: Tensor, scratch: Tensor | None) -> None:
        wire.view(self.dtype).copy_(x)

    def _decode(self, wire: Tensor, out: Tensor) -> None:
        out.copy_(wire.view(self.dtype))


class Float32Codec(_CastCodec):
    """The raw float32 bytes: lossless, 4 bytes per element."""

    name = "float32"
    dtype = torch.float32
    lossless = True


class BFloat16Codec(_CastCodec):
    """bfloat16, round to nearest even: 2 bytes per element, relative error <= 2^-8."""

    name = "bfloat16"
    dtype = torch.bfloat16


class _BlockCodec(MessageCodec):
    """Per-block absmax scaling: ``scale = absmax / max_level``; subclasses store ``x / scale``."""

    max_level: float
    bits: int  # per stored value

    def wire_numel(self, numel: int) -> int:
        return self._values_numel(numel) + _num_blocks(numel, self.block_size) * _SCALE_BYTES

    def _values_numel(self, numel: int) -> int:
        per_byte = 8 // self.bits
        return -(-_check_numel(numel) // per_byte)

    def _encode(self, x: Tensor, wire: Tensor, scratch: Tensor | None) -> None:
        values_numel = self._values_numel(x.shape[-1])
        scales = _absmax(x, self.block_size).div_(self.max_level)  # (..., blocks)
        divisors = torch.where(scales == 0, torch.ones_like(scales), scales)  # a zero block stays 0, not NaN
        scratch = torch.empty_like(x) if scratch is None else scratch
        scaled = _per_block(torch.div, x, divisors, scratch, self.block_size)  # last read of x
        self._store(scaled, wire[..., :values_numel])
        wire[..., values_numel:].copy_(scales.view(torch.uint8))

    def _decode(self, wire: Tensor, out: Tensor) -> None:
        values_numel = self._values_numel(out.shape[-1])
        scale_bytes = wire[..., values_numel:]
        # A copy (small): the scales may sit at any byte offset, and a float32 view needs 4-byte alignment.
        scales = torch.empty_like(scale_bytes, memory_format=torch.contiguous_format).copy_(scale_bytes)
        scales = scales.view(torch.float32)  # (..., blocks)
        self._load(wire[..., :values_numel], out)
        _per_block(torch.mul, out, scales, out, self.block_size)

    @abc.abstractmethod
    def _store(self, scaled: Tensor, values: Tensor) -> None:
        """Write ``scaled`` (x / scale, float32, may be overwritten) into the value bytes."""

    @abc.abstractmethod
    def _load(self, values: Tensor, out: Tensor) -> None:
        """Write the stored levels (x / scale, rounded) from the value bytes into ``out``."""


class Int8Codec(_BlockCodec):
    """Per-block absmax int8: ``round(x / s)`` in [-127, 127] with ``s = absmax / 127``."""

    name = "int8"
    max_level = 127.0
    bits = 8

    def _store(self, scaled: Tensor, values: Tensor) -> None:
        # The clamp matters only when s is subnormal (imprecise): a wrapped int8 would flip the sign.
        values.view(torch.int8).copy_(scaled.round_().clamp_(-127, 127))

    def _load(self, values: Tensor, out: Tensor) -> None:
        out.copy_(values.view(torch.int8))


class Fp8Codec(_BlockCodec):
    """Per-block scaled ``float8_e4m3fn`` (round to nearest even) with ``s = absmax / 448``."""

    name = "fp8"
    max_level = 448.0
    bits = 8

    def _store(self, scaled: Tensor, values: Tensor) -> None:
        # e4m3fn has no infinity, and devices differ past 448 (CPU saturates, others may give NaN): the
        # clamp makes float32 rounding noise above 448 land on 448 everywhere.
        values.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-448, 448))

    def _load(self, values: Tensor, out: Tensor) -> None:
        out.copy_(values.view(torch.float8_e4m3fn))


class _PackedCodec(_BlockCodec):
    """Levels ``code - offset`` with codes in [0, 2^bits), packed 8 // bits per byte, low bits first."""

    offset: float  # level = code - offset
    code_shift: int  # code = rounded integer + code_shift

    def _store(self, scaled: Tensor, values: Tensor) -> None:
        codes = torch.empty(scaled.shape, dtype=torch.int8, device=scaled.device)
        codes.copy_(self._round(scaled))  # small integers: exact
        codes = codes.view(torch.uint8).add_(self.code_shift)  # wraps modulo 256 into [0, 2^bits)
        # A NaN (non-finite block) casts to an arbitrary byte: the mask keeps it out of its neighbours'
        # bits, which may belong to another block when block_size is odd.
        codes.bitwise_and_((1 << self.bits) - 1)
        _pack(codes, values, self.bits)

    def _load(self, values: Tensor, out: Tensor) -> None:
        _unpack(values, out, self.bits)
        out.sub_(self.offset)

    @abc.abstractmethod
    def _round(self, scaled: Tensor) -> Tensor:
        """Round ``scaled`` in place to the signed integer ``code - code_shift``."""


class Int4Codec(_PackedCodec):
    """Per-block absmax int4: ``round(x / s)`` in [-7, 7] (15 levels) with ``s = absmax / 7``."""

    name = "int4"
    max_level = 7.0
    bits = 4
    offset = 7.0
    code_shift = 7

    def _round(self, scaled: Tensor) -> Tensor:
        return scaled.round_().clamp_(-7, 7)


class Int2Codec(_PackedCodec):
    """Per-block absmax int2: levels ``s * {-1.5, -0.5, 0.5, 1.5}`` with ``s = absmax / 1.5``.

    The nearest level of ``v = x / s`` is ``floor(v) + 0.5`` (ties upwards), clamped to the four levels.
    """

    name = "int2"
    max_level = 1.5
    bits = 2
    offset = 1.5
    code_shift = 2

    def _round(self, scaled: Tensor) -> Tensor:
        return scaled.floor_().clamp_(-2, 1)  # code = floor(v) + 2, decoded as code - 1.5


class TopKCodec(MessageCodec):
    """Top-k sparsification: the k = ceil(density P) largest-magnitude entries of each row, as indices plus
    values in a dense codec; every other entry decodes to exactly 0 (see the module docstring).

    Args:
        density: the kept share of the entries, in (0, 1] (taken as the decimal it prints as, so
            0.07 x 100 keeps 7).
        values: the dense codec of the kept values (one of :data:`CODECS`; int2 sends a kept exact zero
            as +scale/2, which only happens when a row has fewer than k non-zero entries).
        block_size: kept values sharing one scale (>= k: one scale per message).
    """

    sparse = True

    def __init__(self, density: float = DEFAULT_TOPK_DENSITY, values: str = DEFAULT_TOPK_VALUES,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__(block_size=block_size)
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if values not in _CODEC_CLASSES:
            raise ValueError(f"values must be one of {list(CODECS)}, got {values!r}")
        self.density = float(density)
        self._share = Fraction(repr(self.density))  # exact, so k does not depend on float rounding
        self.values = build_codec(values, block_size=block_size)
        self.name = f"{TOPK}-{self.density!r}-{values}"  # canonical: build_codec(name) rebuilds this codec

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density!r}, values={self.values.name!r}, block_size={self.block_size})"

    def kept(self, numel: int) -> int:
        """k, the entries kept of a ``numel``-element message: ceil(density numel), at least 1."""
        return max(1, math.ceil(self._share * _check_numel(numel)))

    def wire_numel(self, numel: int) -> int:
        k = self.kept(numel)
        return k * _index_dtype(numel).itemsize + self.values.wire_numel(k)

    def _encode(self, x: Tensor, wire: Tensor, scratch: Tensor | None) -> None:
        numel, k = x.shape[-1], self.kept(x.shape[-1])
        indices = _top_indices(x, k)  # (..., k), ascending
        index_bytes = k * _index_dtype(numel).itemsize
        wire[..., :index_bytes].copy_(indices.to(_index_dtype(numel)).view(torch.uint8))
        # The value codec writes into a contiguous wire of its own: a row's value bytes may sit at any offset.
        values_wire = self.values.new_wire(k, *x.shape[:-1], device=x.device)
        self.values.encode(torch.gather(x, -1, indices), values_wire)
        wire[..., index_bytes:].copy_(values_wire)

    def _decode(self, wire: Tensor, out: Tensor) -> None:
        numel, k = out.shape[-1], self.kept(out.shape[-1])
        index_bytes = k * _index_dtype(numel).itemsize
        indices = _aligned(wire[..., :index_bytes]).view(_index_dtype(numel)).long()  # (..., k)
        values = self.values.decode(_aligned(wire[..., index_bytes:]),
                                    torch.empty(*out.shape[:-1], k, device=out.device))
        in_range = ((indices >= 0) & (indices < numel)).all(dim=-1, keepdim=True)
        increasing = (indices[..., 1:] > indices[..., :-1]).all(dim=-1, keepdim=True)
        # A corrupted wire must not make scatter fail (or write out of bounds): its row decodes to NaN.
        valid = in_range & increasing  # (..., 1)
        out.zero_().scatter_(-1, torch.where(in_range, indices, 0), values)
        out.masked_fill_(~valid, math.nan)


_CODEC_CLASSES: dict[str, type[MessageCodec]] = {
    codec.name: codec for codec in (Float32Codec, BFloat16Codec, Int8Codec, Fp8Codec, Int4Codec, Int2Codec)
}
CODEC_SPELLINGS = (f"one of {list(CODECS)}, or {TOPK!r}, '{TOPK}-<density>' or '{TOPK}-<density>-<values>' "
                   f"(e.g. 'topk-0.01-int2')")


def build_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE) -> MessageCodec:
    """The codec called ``name``: one of :data:`CODECS`, or a top-k spelling (``topk``, ``topk-<density>``,
    ``topk-<density>-<values>``).

    Args:
        name: the codec's name.
        block_size: elements sharing one scale in the block codecs (int8, fp8, int4, int2); for top-k, kept
            values sharing one scale.
    """
    if isinstance(name, str) and (name == TOPK or name.startswith(f"{TOPK}-")):
        return _build_topk(name, block_size)
    if name not in _CODEC_CLASSES:
        raise ValueError(f"name must be {CODEC_SPELLINGS}, got {name!r}")
    return _CODEC_CLASSES[name](block_size=block_size)


def check_codec_name(name: str) -> str:
    """``name`` when it names a codec (see :func:`build_codec`); else ``ValueError`` naming the spellings."""
    build_codec(name)
    return name


def _build_topk(name: str, block_size: int) -> TopKCodec:
    if name == TOPK:
        return TopKCodec(block_size=block_size)
    options = name[len(TOPK) + 1:]  # "<density>" or "<density>-<values>"
    density_text, values = options, DEFAULT_TOPK_VALUES
    head, _, tail = options.rpartition("-")
    if tail in _CODEC_CLASSES:
        density_text, values = head, tail
    try:
        density = float(density_text)
    except ValueError:
        raise ValueError(f"name must be {CODEC_SPELLINGS}; {name!r} has no density (a number in (0, 1]) after "
                         f"'{TOPK}-'") from None
    if not math.isfinite(density):
        raise ValueError(f"the density in {name!r} must be a number in (0, 1], got {density_text!r}")
    try:
        return TopKCodec(density=density, values=values, block_size=block_size)
    except ValueError as error:
        raise ValueError(f"codec {name!r}: {error}") from None


def _check_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int >= 1, got {numel!r}")
    return numel


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _check_float(tensor: Tensor, argument: str) -> None:
    if tensor.dtype != torch.float32 or tensor.dim() < 1 or tensor.shape[-1] < 1:
        raise ValueError(f"{argument} must be float32 of shape (..., P) with P >= 1, got "
                         f"{tensor.dtype} {tuple(tensor.shape)}")


def _check_wire(wire: Tensor, message: Tensor, wire_numel: int) -> None:
    expected = (*message.shape[:-1], wire_numel)
    if wire.dtype != torch.uint8 or tuple(wire.shape) != expected or wire.device != message.device:
        raise ValueError(f"wire must be uint8 of shape {expected} on {message.device}, got "
                         f"{wire.dtype} {tuple(wire.shape)} on {wire.device}")


def _absmax(x: Tensor, block_size: int) -> Tensor:
    """Per-block max |x| ``(..., blocks)``; NaN propagates. No model-size temporary."""
    full = x.shape[-1] // block_size * block_size
    parts = []
    if full:
        parts.append(_max_magnitude(x[..., :full].unflatten(-1, (-1, block_size))))
    if full < x.shape[-1]:
        parts.append(_max_magnitude(x[..., full:].unsqueeze(-2)))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _max_magnitude(blocks: Tensor) -> Tensor:
    # amax and amin are two reads yet about 3x faster than one torch.aminmax over short rows on CPU
    # (torch 2.13); abs makes a zero block's result +0, never -0.
    return torch.maximum(blocks.amax(dim=-1).abs_(), blocks.amin(dim=-1).abs_())


def _per_block(op: Callable[..., Tensor], x: Tensor, scales: Tensor, out: Tensor, block_size: int) -> Tensor:
    """``out = op(x, scale of each element's block)``: full blocks as one (..., blocks, block) view, then
    the tail."""
    full = x.shape[-1] // block_size * block_size
    blocks = full // block_size
    if full:
        op(x[..., :full].unflatten(-1, (blocks, block_size)), scales[..., :blocks, None],
           out=out[..., :full].unflatten(-1, (blocks, block_size)))
    if full < x.shape[-1]:
        op(x[..., full:], scales[..., blocks:], out=out[..., full:])
    return out


def _pack(codes: Tensor, values: Tensor, bits: int) -> None:
    """Pack uint8 codes ``(..., P)`` below 2^bits into ``values`` ``(..., ceil(P * bits / 8))``; element k of
    each group of 8 // bits sits at bit k * bits."""
    per_byte = 8 // bits
    values.copy_(codes[..., 0::per_byte])  # the padding bits of a row's last byte stay 0
    for k in range(1, per_byte):
        part = codes[..., k::per_byte]
        values[..., :part.shape[-1]].bitwise_or_(part << (bits * k))


def _unpack(values: Tensor, out: Tensor, bits: int) -> None:
    """Inverse of :func:`_pack`, writing the codes as floats into ``out`` ``(..., P)``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    for k in range(per_byte):
        destination = out[..., k::per_byte]
        source = values[..., :destination.shape[-1]]
        destination.copy_((source >> (bits * k)) & mask if k else source & mask)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def _aligned(wire_bytes: Tensor) -> Tensor:
    """A contiguous copy of some wire bytes (a view as a wider dtype needs aligned, contiguous storage)."""
    return torch.empty_like(wire_bytes, memory_format=torch.contiguous_format).copy_(wire_bytes)


def _top_indices(x: Tensor, k: int) -> Tensor:
    """Indices ``(..., k)``, ascending, of each row's k largest |x|; ties go to the lowest index, NaN first.

    ``torch.topk`` picks among tied entries in an order no device promises, so it only gives the k-th
    largest magnitude here; which entries are kept is then decided by comparisons and, on a tie at that
    threshold, by index.
    """
    magnitude = x.abs().nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN kept, so a bad row decodes non-finite
    threshold = magnitude.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # (..., 1)
    above = magnitude > threshold
    tied = magnitude == threshold
    missing = k - above.sum(dim=-1, keepdim=True)  # tied entries to keep, lowest indices first
    if bool((tied.sum(dim=-1, keepdim=True) > missing).any()):
        tied &= tied.cumsum(dim=-1) <= missing
    return (above | tied).nonzero()[:, -1].view(*x.shape[:-1], k)
