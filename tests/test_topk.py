"""The top-k codec and error feedback through their public API: which entries are kept (ties by index),
their values, the wire size, the spelling, corrupted wires, and the mean under error feedback (float64)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from gasloc_lightning import DiLoCoStrategy, GASLoCStrategy

from gasloc_lightning.algorithm.codecs import CODECS, TopKCodec, build_codec
from gasloc_lightning.algorithm.error_feedback import ErrorFeedback, mean_of_wires
from gasloc_lightning.algorithm.round import EncodedMean, GossipRound, check_codec, wire_format
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.sim import DiLoCoRounds, WorkerClocks
from gasloc_lightning.strategies.elastic import ElasticDiLoCoStrategy, ElasticGASLoCStrategy


def sample(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator)


def round_trip(codec, x):
    wire = codec.new_wire(x.shape[-1], *x.shape[:-1])
    codec.encode(x, wire)
    return wire, codec.decode(wire, torch.empty_like(x))


def reference_kept(row: torch.Tensor, k: int) -> list[int]:
    """The k largest |x| of a row, ties to the lowest index, NaN first: a plain sort, independent of the codec."""
    key = lambda i: (0 if row[i].isnan() else 1, -abs(float(row[i])), i)  # noqa: E731
    return sorted(sorted(range(row.numel()), key=key)[:k])


@pytest.mark.parametrize("numel, density", [(1, 0.01), (100, 0.01), (1000, 0.07), (1001, 0.25), (50, 1.0)])
def test_kept_entries_round_trip_exactly_and_the_rest_is_zero(numel, density):
    codec = build_codec(f"topk-{density}-float32")
    x = sample(numel, seed=numel)
    _, decoded = round_trip(codec, x)
    kept = reference_kept(x, codec.kept(numel))
    assert len(kept) == max(1, round(density * numel + 0.4999))
    assert decoded.nonzero().flatten().tolist() == kept
    assert torch.equal(decoded[kept], x[kept])  # float32 values: the kept entries bit for bit


@pytest.mark.parametrize("values", ["bfloat16", "int8", "fp8", "int4", "int2"])
def test_kept_values_are_the_dense_codec_of_the_kept_entries(values):
    codec = build_codec(f"topk-0.05-{values}", block_size=16)
    x = sample(3, 997, seed=1) * torch.logspace(-2, 2, 997)
    _, decoded = round_trip(codec, x)
    dense = build_codec(values, block_size=16)
    for row in range(3):
        kept = reference_kept(x[row], codec.kept(997))
        assert (decoded[row] != 0).sum() <= len(kept)  # a value may round to 0; nothing outside is sent
        _, expected = round_trip(dense, x[row, kept].contiguous())
        assert torch.equal(decoded[row, kept], expected)
        assert not decoded[row].index_fill(0, torch.tensor(kept), 0).any()


@pytest.mark.parametrize("values", ["int8", "int4", "int2", "float32"])
def test_wire_is_at_most_five_hundredths_of_float32_at_one_percent(values):
    codec = build_codec(f"topk-0.01-{values}")
    for numel in (1_000, 100_000, 1_048_576):
        k = codec.kept(numel)
        assert codec.wire_numel(numel) == 4 * k + build_codec(values).wire_numel(k)
        ratio = codec.wire_numel(numel) / (4 * numel)
        assert ratio <= (0.05 if values != "float32" else 0.021), (numel, ratio)
    assert build_codec("topk-0.01-int2").wire_numel(128_000) / (4 * 128_000) == pytest.approx(0.0107, abs=1e-4)
    assert build_codec("topk-0.01-int8").wire_numel(128_000) / (4 * 128_000) == pytest.approx(0.0126, abs=1e-4)


def test_ties_go_to_the_lowest_index_and_nan_ranks_first():
    codec = build_codec("topk-0.3-float32")  # k = 3 of 10
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0, 0.0, 2.0, -1.0])
    _, decoded = round_trip(codec, x)
    assert decoded.nonzero().flatten().tolist() == [1, 2, 4]  # five entries tie at |2|: the first three
    x[9] = float("nan")
    _, decoded = round_trip(codec, x)
    assert decoded.isnan().nonzero().flatten().tolist() == [9]
    assert (decoded != 0).nonzero().flatten().tolist() == [1, 2, 9]
    ones = torch.ones(2, 64)
    ones[1, 40:] = -1.0  # all tie: the first k of every row
    _, decoded = round_trip(build_codec("topk-0.1-int4"), ones)
    assert decoded.ne(0).nonzero()[:, 1].tolist() == list(range(7)) * 2


def test_same_input_same_bytes_and_stacked_rows_are_single_messages():
    codec = build_codec("topk-0.05-int2", block_size=5)
    x = sample(3, 301, seed=2).round(decimals=1)  # many ties
    x[1] *= 1e3
    first, second = codec.new_wire(301, 3).fill_(0), codec.new_wire(301, 3).fill_(255)
    codec.encode(x, first)
    codec.encode(x.clone(), second)
    assert torch.equal(first, second)
    for row in range(3):
        wire, decoded = round_trip(codec, x[row].clone())
        assert torch.equal(first[row], wire)
        assert torch.equal(codec.decode(first, torch.empty(3, 301))[row], decoded)


def test_decoded_alongside_encoding_is_what_peers_decode():
    codec = build_codec("topk-0.1-int4")
    x = sample(2, 200, seed=3)
    wire = codec.new_wire(200, 2)
    own = codec.encode(x.clone(), wire, decoded=x)  # in place, as the round does
    assert own is x and torch.equal(own, codec.decode(wire, torch.empty(2, 200)))


def test_a_corrupted_wire_decodes_to_nan_instead_of_raising():
    codec = build_codec("topk-0.1-int8")
    wire, decoded = round_trip(codec, sample(2, 100, seed=4))
    bad = wire.clone()
    bad[0, :4] = 255  # row 0's first index becomes -1
    bad[1, 4:8] = bad[1, :4]  # row 1's indices are no longer increasing
    out = codec.decode(bad, torch.empty(2, 100))
    assert out.isnan().all()
    bad[1] = wire[1]
    out = codec.decode(bad, torch.empty(2, 100))
    assert out[0].isnan().all() and torch.equal(out[1], decoded[1])  # rows stay independent


@pytest.mark.parametrize("spelling, density, values", [
    ("topk", 0.01, "int4"),
    ("topk-0.03", 0.03, "int4"),
    ("topk-0.01-int2", 0.01, "int2"),
    ("topk-1e-3-int8", 0.001, "int8"),
    ("topk-1-fp8", 1.0, "fp8"),
])
def test_spellings_build_a_codec_whose_name_rebuilds_it(spelling, density, values):
    codec = build_codec(spelling)
    assert isinstance(codec, TopKCodec) and codec.sparse and not codec.lossless
    assert (codec.density, codec.values.name) == (density, values)
    again = build_codec(codec.name)
    assert (again.name, again.density, again.values.name) == (codec.name, density, values)
    assert check_codec(spelling, allow_sparse=True) == spelling
    assert wire_format(spelling, 1000) == (codec.wire_numel(1000), torch.uint8)
    assert not any(build_codec(name).sparse for name in CODECS)


@pytest.mark.parametrize("spelling, match", [
    ("topk-0", r"density must be a number in \(0, 1\]"),
    ("topk-1.5-int4", r"density must be a number in \(0, 1\]"),
    ("topk-nan", "density"),
    ("topk-", "density"),
    ("topk-int2", "density"),
    ("topk-0.01-int3", "topk-<density>-<values>"),
    ("topk-0.01-topk", "topk-<density>-<values>"),
    ("topk0.01", "topk-<density>-<values>"),
])
def test_bad_spellings_are_refused_by_name(spelling, match):
    with pytest.raises(ValueError, match=match):
        build_codec(spelling)
    with pytest.raises(ValueError, match="message_codec"):
        check_codec(spelling)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(density=0.0), "density"), (dict(density=True), "density"), (dict(density="0.1"), "density"),
    (dict(values="int3"), "values"), (dict(block_size=0), "block_size"),
])
def test_constructor_arguments_are_validated_by_name(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        TopKCodec(**kwargs)


def test_the_round_refuses_top_k_where_it_would_drop_most_of_the_message():
    with pytest.raises(ValueError, match="only with error_feedback=True"):
        GossipRound(torch.zeros(100), 100, outer_lr=0.7, outer_momentum=0.5, message_codec="topk-0.1-int4")
    with pytest.raises(ValueError, match="all-gather"):
        EncodedMean("topk-0.1-int4", 100, 2)


# ---------------------------------------------------------------------------- refused where not wired
# Top-k runs with error feedback in gasloc-train and gasloc-sim (tests/test_sparseloco.py); without error
# feedback, and in the elastic mode, each entry point must say so when it is built, not at setup or at the
# first round.

ELASTIC = r"is a sparse \(top-k\) codec, which the elastic mode does not take.*strategy=sparseloco"


def test_check_codec_refuses_sparse_codecs_unless_allowed_naming_the_argument():
    with pytest.raises(ValueError, match="strategy.message_codec='topk-0.1' " + ELASTIC):
        check_codec("topk-0.1", argument="strategy.message_codec")
    assert check_codec("int4") == "int4"


@pytest.mark.parametrize("build", [
    lambda: ElasticGASLoCStrategy(lighthouse="127.0.0.1:1", worker_id=0, message_codec="topk"),
    lambda: ElasticDiLoCoStrategy(lighthouse="127.0.0.1:1", worker_id=0, message_codec="topk-0.01-int2"),
], ids=["elastic", "elastic_diloco"])
def test_the_elastic_strategies_refuse_top_k_at_construction(build):
    with pytest.raises(ValueError, match="message_codec='topk[^']*' " + ELASTIC):
        build()


@pytest.mark.parametrize("build", [
    lambda: GASLoCStrategy(message_codec="topk"),
    lambda: DiLoCoStrategy(message_codec="topk-0.01-int2"),
    lambda: DiLoCoRounds(initial=torch.zeros(2, 10), outer_lr=0.7, outer_momentum=0.9, clocks=WorkerClocks(None, 2),
                         message_codec="topk-0.1-int4"),
], ids=["gasloc", "diloco", "sim_diloco_rounds"])
def test_top_k_without_error_feedback_is_refused_at_construction(build):
    with pytest.raises(ValueError, match="message_codec='topk[^']*' is sparse.*error_feedback=True"):
        build()


@pytest.mark.parametrize("strategy, codec", [("gasloc", "topk"), ("diloco", "topk-0.01-int2")])
def test_gasloc_sim_refuses_top_k_without_error_feedback_before_any_data(strategy, codec, tmp_path):
    overrides = ["experiment=demo", f"strategy={strategy}", f"strategy.message_codec={codec}",
                 f"data.source={tmp_path / 'missing.txt'}", f"cache_dir={tmp_path}", f"output_dir={tmp_path}"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("sim/app", overrides=overrides)
    with pytest.raises(ValueError, match=f"message_codec='{codec}' is sparse.*error_feedback=True"):
        sim_app.build(cfg)


# ---------------------------------------------------------------------------- error feedback


def run_feedback(spelling, workers=4, numel=400, rounds=25, decay=1.0, seed=5):
    """n workers, each with its residual, sending a stream of messages; returns everything in float64."""
    codec = build_codec(spelling, block_size=8)
    feedback = [ErrorFeedback(codec, numel, decay=decay) for _ in range(workers)]
    generator = torch.Generator().manual_seed(seed)
    true_sum = torch.zeros(workers, numel, dtype=torch.float64)
    sent_sum = torch.zeros(workers, numel, dtype=torch.float64)
    worst_step = 0.0
    for t in range(rounds):
        messages = torch.randn(workers, numel, generator=generator) * (1 + t % 3)
        wires = []
        for i, state in enumerate(feedback):
            before = state.residual.double().clone()
            wire = state.new_wire()
            sent = state.encode(messages[i], wire)
            # one round: m + e' = beta e + Delta, up to the float32 rounding of the two additions
            step = (sent.double() + state.residual.double()) - (decay * before + messages[i].double())
            worst_step = max(worst_step, float(step.abs().max() / (before.abs().max() + messages[i].abs().max())))
            true_sum[i] += messages[i].double()
            sent_sum[i] += sent.double()
            wires.append(wire)
        mean = mean_of_wires(codec, torch.stack(wires), torch.empty(numel))
        assert torch.equal(mean, torch.stack([codec.decode(w, torch.empty(numel)) for w in wires]).sum(0) / workers)
    residuals = torch.stack([state.residual.double() for state in feedback])
    return true_sum, sent_sum, residuals, worst_step


@pytest.mark.parametrize("spelling", ["topk-0.01-int2", "topk-0.01-int4", "topk-0.05-int8", "topk-0.01-float32"])
def test_the_mean_is_preserved_under_top_k_with_error_feedback(spelling):
    """sum_i (sum_t m_i(t) + e_i(T)) = sum_i sum_t Delta_i(t): what the codec drops is sent later, never lost."""
    true_sum, sent_sum, residuals, worst_step = run_feedback(spelling)
    assert worst_step <= 2.0**-22  # per round: one float32 rounding each of a = e + Delta and e' = a - m
    scale = float(true_sum.abs().max())
    assert float((sent_sum.sum(0) + residuals.sum(0) - true_sum.sum(0)).abs().max()) <= 1e-6 * scale
    assert float(residuals.abs().max()) > 0.1 * scale / 25  # the test has teeth: much is still held back
    assert float((sent_sum.sum(0) - true_sum.sum(0)).abs().max()) > 1e-2 * scale  # ... so without e it fails


def test_without_feedback_the_dropped_part_is_lost():
    _, sent_sum, residuals, _ = run_feedback("topk-0.01-int4", decay=0.5)
    true_sum, sent_full, residual_full, _ = run_feedback("topk-0.01-int4")
    error = lambda sent, residual: float((sent.sum(0) + residual.sum(0) - true_sum.sum(0)).abs().max())  # noqa: E731
    assert error(sent_sum, residuals) > 1e3 * error(sent_full, residual_full)  # a decayed residual forgets


def test_error_feedback_on_stacked_rows_and_its_state_round_trips():
    codec = build_codec("topk-0.1-int4")
    stacked = ErrorFeedback(codec, 64, rows=3)
    singles = [ErrorFeedback(codec, 64) for _ in range(3)]
    for t in range(4):
        messages = sample(3, 64, seed=t)
        wire = stacked.new_wire()
        sent = stacked.encode(messages, wire)
        for i, single in enumerate(singles):
            one = single.new_wire()
            assert torch.equal(single.encode(messages[i].clone(), one), sent[i]) and torch.equal(one, wire[i])
    resumed = ErrorFeedback(codec, 64, rows=3)
    resumed.load_state_dict(stacked.state_dict())
    assert torch.equal(resumed.residual, stacked.residual)
    with pytest.raises(ValueError, match="codec"):
        ErrorFeedback(build_codec("topk-0.2-int4"), 64, rows=3).load_state_dict(stacked.state_dict())
    with pytest.raises(ValueError, match="another model"):
        ErrorFeedback(codec, 65, rows=3).load_state_dict(stacked.state_dict())


@pytest.mark.parametrize("kwargs, argument", [
    (dict(codec=build_codec("float32"), numel=4), "lossy"),
    (dict(codec=build_codec("topk"), numel=0), "numel"),
    (dict(codec=build_codec("topk"), numel=4, rows=0), "rows"),
    (dict(codec=build_codec("topk"), numel=4, decay=0.0), "decay"),
    (dict(codec=build_codec("topk"), numel=4, decay=1.5), "decay"),
])
def test_error_feedback_arguments_are_validated_by_name(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ErrorFeedback(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spelling", ["topk-0.05-int2", "topk-0.01-int8", "topk-0.3-float32"])
def test_cuda_keeps_the_same_entries_and_bytes_as_cpu(spelling):
    codec = build_codec(spelling, block_size=5)
    x = sample(2, 1001, seed=8).round(decimals=1)  # ties at the threshold
    wire, decoded = round_trip(codec, x.cuda())
    cpu_wire, cpu_decoded = round_trip(codec, x)
    assert torch.equal(wire.cpu(), cpu_wire) and torch.equal(decoded.cpu(), cpu_decoded)
