"""Message codecs through their public API: round trips within the documented error bounds, wire sizes,
stacked rows, in-place decoding, edge blocks, non-finite input, argument errors and determinism."""

from __future__ import annotations

import math

import pytest
import torch

from gasloc_lightning.algorithm.codecs import CODECS, DEFAULT_BLOCK_SIZE, MessageCodec, build_codec

LOSSY = tuple(name for name in CODECS if name != "float32")
BLOCK_CODECS = ("int8", "fp8", "int4", "int2")
# 5: an odd block, so packed bytes of int4/int2 straddle two blocks.
BLOCK_SIZES = (DEFAULT_BLOCK_SIZE, 5)
VALUE_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5, "int2": 0.25}  # per element


def sample(*shape: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude sweeps 1e-3..1e3 along the row, so blocks differ in scale."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-3, 3, shape[-1]) if shape[-1] > 1 else torch.ones(1)
    return torch.randn(*shape, generator=generator) * magnitude


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each element's block absmax, shaped like x (a zero-padded reference, independent of the codec)."""
    numel = x.shape[-1]
    blocks = math.ceil(numel / block_size)
    padded = x.new_zeros(*x.shape[:-1], blocks * block_size)
    padded[..., :numel] = x.abs()
    absmax = padded.unflatten(-1, (blocks, block_size)).amax(dim=-1)
    return absmax.repeat_interleave(block_size, dim=-1)[..., :numel]


def error_bound(name: str, x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The per-element bound of the module docstring, plus float32 rounding."""
    absmax = block_absmax(x, block_size)
    bounds = {
        "float32": torch.zeros_like(x),
        "bfloat16": 2.0**-8 * x.abs(),
        "int8": absmax / 254,
        "fp8": 2.0**-4 * x.abs() + 2.0**-10 * absmax / 448,
        "int4": absmax / 14,
        "int2": absmax / 3,
    }
    return bounds[name] + 2.0**-20 * absmax


def round_trip(codec: MessageCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wire = codec.new_wire(x.shape[-1], *x.shape[:-1])
    codec.encode(x, wire)
    return wire, codec.decode(wire, torch.empty_like(x))


def expected_wire_numel(name: str, numel: int, block_size: int) -> int:
    if name == "float32":
        return 4 * numel
    if name == "bfloat16":
        return 2 * numel
    return math.ceil(numel * VALUE_BYTES[name]) + 4 * math.ceil(numel / block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_round_trip_within_bound(name, block_size):
    codec = build_codec(name, block_size=block_size)
    for numel in (1, block_size - 1, block_size + 1, 10_000):
        if numel < 1:
            continue
        x = sample(numel, seed=numel)
        _, decoded = round_trip(codec, x)
        error = (decoded - x).abs()
        assert (error <= error_bound(name, x, block_size)).all(), (name, numel, error.max())
        if name == "float32":
            assert torch.equal(decoded, x)


@pytest.mark.parametrize("name", LOSSY)
def test_bound_is_reached(name):
    """The bounds are not loose: random data comes close to them, so a codec that loses more fails above."""
    x = sample(10_000, seed=1)
    _, decoded = round_trip(build_codec(name), x)
    ratio = (decoded - x).abs() / error_bound(name, x, DEFAULT_BLOCK_SIZE)
    assert ratio.max() > 0.5


@pytest.mark.parametrize("name, values, decoded", [
    ("int8", [127.0, -63.5, 0.4, 0.6], [127.0, -64.0, 0.0, 1.0]),  # s = 1, ties to even
    ("int4", [7.0, 0.5, 1.5, -2.4], [7.0, 0.0, 2.0, -2.0]),  # s = 1, ties to even
    ("int2", [3.0, -3.0, 0.0, 1.0, -1.0, 2.9], [3.0, -3.0, 1.0, 1.0, -1.0, 3.0]),  # s = 2, ties upwards
])
def test_documented_levels(name, values, decoded):
    x = torch.tensor(values)
    _, result = round_trip(build_codec(name, block_size=len(values)), x)
    assert result.tolist() == decoded


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_stacked_rows_are_independent_messages(name, block_size):
    codec = build_codec(name, block_size=block_size)
    numel = 2 * block_size + 3
    x = sample(3, numel, seed=2)
    x[1] *= 1e4  # rows of different scales: a shared scale would show
    wire, decoded = round_trip(codec, x)
    for row in range(3):
        row_wire, row_decoded = round_trip(codec, x[row].clone())
        assert torch.equal(wire[row], row_wire)
        assert torch.equal(decoded[row], row_decoded)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_wire_numel(name, block_size):
    codec = build_codec(name, block_size=block_size)
    for numel in (1, 2, 3, 4, 5, block_size - 1, block_size, block_size + 1, 10_001):
        if numel < 1:
            continue
        assert codec.wire_numel(numel) == expected_wire_numel(name, numel, block_size)
    wire = codec.new_wire(7, 2, 3)
    assert wire.dtype == torch.uint8 and wire.shape == (2, 3, codec.wire_numel(7))


def test_default_byte_ratios():
    """The ratios of the module docstring, for a numel that is a multiple of the block."""
    numel = DEFAULT_BLOCK_SIZE * 1024
    ratio = {name: build_codec(name).wire_numel(numel) / (4 * numel) for name in CODECS}
    assert ratio["float32"] == 1.0 and ratio["bfloat16"] == 0.5
    assert ratio["int8"] == ratio["fp8"] == pytest.approx(0.2578, abs=1e-4) and ratio["int8"] <= 0.27
    assert ratio["int4"] == pytest.approx(0.1328, abs=1e-4) and ratio["int4"] <= 0.14
    assert ratio["int2"] == pytest.approx(0.0703, abs=1e-4)


@pytest.mark.parametrize("name", CODECS)
def test_decoded_in_place_equals_decode_of_wire(name):
    codec = build_codec(name, block_size=5)
    original = sample(2, 23, seed=3)
    wire, decoded = round_trip(codec, original)
    x = original.clone()
    in_place_wire = codec.new_wire(23, 2)
    assert codec.encode(x, in_place_wire, decoded=x) is x
    assert torch.equal(in_place_wire, wire)
    assert torch.equal(x, decoded)
    separate = torch.empty_like(original)
    assert codec.encode(original, codec.new_wire(23, 2), decoded=separate) is separate
    assert torch.equal(separate, decoded)
    assert codec.encode(original, codec.new_wire(23, 2)) is None


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_zero_constant_and_outlier_blocks(name):
    block_size = 8
    zeros = torch.zeros(block_size)
    constant = torch.full((block_size,), -3.7)
    outlier = sample(block_size, seed=4)
    outlier[3] = 1e6
    plain = sample(block_size, seed=5)
    x = torch.cat([zeros, constant, outlier, plain, plain[:3]])  # the last block is partial
    _, decoded = round_trip(build_codec(name, block_size=block_size), x)
    blocks = decoded.split(block_size)
    assert torch.equal(blocks[0], zeros)
    torch.testing.assert_close(blocks[1], constant, rtol=1e-6, atol=0)
    assert blocks[2][3].item() == pytest.approx(1e6, rel=1e-6)
    assert ((decoded - x).abs() <= error_bound(name, x, block_size)).all()  # the outlier stays in its block
    assert torch.equal(blocks[3], round_trip(build_codec(name, block_size=block_size), plain)[1])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", CODECS)
def test_non_finite_input_stays_in_its_block(name, value):
    block_size = 5
    x = sample(4 * block_size, seed=6)
    x[block_size] = value  # first element of block 1; with int4/int2 its byte holds block 0's values too
    _, decoded = round_trip(build_codec(name, block_size=block_size), x)
    blocks = decoded.split(block_size)
    assert not torch.isfinite(blocks[1]).all()
    others = torch.cat([decoded[:block_size], decoded[2 * block_size:]])
    expected = torch.cat([x[:block_size], x[2 * block_size:]])
    assert torch.isfinite(others).all()
    bound = torch.cat([error_bound(name, x[:block_size], block_size),
                       error_bound(name, x[2 * block_size:], block_size)])
    assert ((others - expected).abs() <= bound).all()
    if name in BLOCK_CODECS:
        assert not torch.isfinite(blocks[1]).any()  # the documented behaviour: the whole block


@pytest.mark.parametrize("name", CODECS)
def test_same_input_same_bytes(name):
    """Every byte is written (padding included): wires that started different end identical."""
    codec = build_codec(name, block_size=5)
    x = sample(2, 23, seed=7)
    first, second = codec.new_wire(23, 2).fill_(0), codec.new_wire(23, 2).fill_(255)
    codec.encode(x, first)
    codec.encode(x.clone(), second)
    assert torch.equal(first, second)


def test_codec_attributes():
    for name in CODECS:
        codec = build_codec(name, block_size=64)
        assert isinstance(codec, MessageCodec)
        assert (codec.name, codec.block_size, codec.lossless) == (name, 64, name == "float32")
    assert build_codec("int8").block_size == DEFAULT_BLOCK_SIZE


@pytest.mark.parametrize("kwargs, argument", [
    (dict(name="int3"), "name"),
    (dict(name="Int8"), "name"),
    (dict(name="int8", block_size=0), "block_size"),
    (dict(name="int4", block_size=-2), "block_size"),
    (dict(name="int2", block_size=2.5), "block_size"),
    (dict(name="fp8", block_size=True), "block_size"),
])
def test_build_codec_rejects(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        build_codec(**kwargs)


def test_encode_and_decode_reject_mismatched_tensors():
    codec = build_codec("int4", block_size=5)
    x = sample(2, 11)
    wire = codec.new_wire(11, 2)
    with pytest.raises(ValueError, match="numel"):
        codec.wire_numel(0)
    with pytest.raises(ValueError, match="x must be float32"):
        codec.encode(x.double(), wire)
    with pytest.raises(ValueError, match="wire must be uint8"):
        codec.encode(x, codec.new_wire(20, 2))
    with pytest.raises(ValueError, match="wire must be uint8"):
        codec.encode(x, wire.to(torch.int8))
    with pytest.raises(ValueError, match="decoded must"):
        codec.encode(x, wire, decoded=torch.empty(11))
    with pytest.raises(ValueError, match="out must be float32"):
        codec.decode(wire, torch.empty(2, 11, dtype=torch.float16))
    with pytest.raises(ValueError, match="wire must be uint8"):
        codec.decode(wire, torch.empty(2, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", CODECS)
def test_cuda_round_trip_and_decode_matches_cpu(name):
    codec = build_codec(name, block_size=5)
    x = sample(2, 1001, seed=8).cuda()
    wire, decoded = round_trip(codec, x)
    assert wire.device == x.device and decoded.device == x.device
    assert ((decoded - x).abs() <= error_bound(name, x, 5)).all()
    assert torch.equal(codec.decode(wire.cpu(), torch.empty(2, 1001)), decoded.cpu())  # same bits everywhere
