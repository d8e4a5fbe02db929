"""The one round module every engine calls (``algorithm/round.py``): pure tensors, checked against the formulas."""

from __future__ import annotations

import pytest
import torch

from gasloc_lightning.algorithm.codecs import CODECS
from gasloc_lightning.algorithm.round import DiLoCoRound, EncodedMean, GossipRound, wire_format


def make_round(point, num_parameters=None, **kwargs):
    defaults = dict(outer_lr=0.7, outer_momentum=0.5)
    defaults.update(kwargs)
    return GossipRound(point.clone(), point.shape[-1] if num_parameters is None else num_parameters, **defaults)


def pair_round(a, b, **kwargs):
    """Two workers A and B, one exchange each way with weight 1/2; returns their new points."""
    rounds = [make_round(torch.zeros_like(a), **kwargs), make_round(torch.zeros_like(b), **kwargs)]
    points = [a.clone(), b.clone()]
    wires = [r.begin(p).clone() for r, p in zip(rounds, points)]
    for me, (r, p) in enumerate(zip(rounds, points)):
        received = [(0.5, wires[1 - me])]
        if r.by_correction:
            assert r.correct(received) == []
            r.apply_correction(p)
        else:
            assert r.mix(p, received) == []
        r.finish(p)
    return points, rounds


def test_exact_float32_round_is_the_gossip_formula():
    # zero start and anchor, eta = 0.7, gamma = 0.5: u = 1.5 * 0.7 * thetaH, theta' = (u_a + u_b) / 2
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 6.0, -1.0])
    (pa, pb), (ra, _) = pair_round(a, b)
    expected = 1.05 * (a + b) / 2
    assert torch.allclose(pa, expected) and torch.allclose(pb, expected)
    assert torch.allclose(ra.outer.round_start, expected)
    assert torch.allclose(ra.outer.anchor, expected / 1.5)  # x' = (theta' + gamma x) / (1 + gamma), x = 0


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "float32"])
def test_a_lossy_codec_keeps_the_pair_mean_exactly_and_stays_near_the_exact_round(codec):
    torch.manual_seed(0)
    a, b = torch.randn(1000), torch.randn(1000)
    (pa, pb), _ = pair_round(a, b, message_codec=codec)
    (ea, eb), _ = pair_round(a, b)
    assert torch.allclose(pa + pb, ea + eb, atol=1e-5)  # the mean is preserved whatever the codec loses
    tolerance = {"bfloat16": 2e-2, "int8": 3e-2, "fp8": 0.15, "int4": 0.4, "int2": 1.5}[codec]
    assert (pa - ea).abs().max() < tolerance
    assert not torch.equal(pa, ea)  # the codec did lose something


def test_buffers_are_mixed_without_momentum():
    a = torch.tensor([1.0, 2.0, 10.0])  # two parameters, one buffer
    b = torch.tensor([3.0, 4.0, 20.0])
    rounds = [make_round(torch.zeros(3), num_parameters=2), make_round(torch.zeros(3), num_parameters=2)]
    points = [a.clone(), b.clone()]
    wires = [r.begin(p).clone() for r, p in zip(rounds, points)]
    for me in range(2):
        rounds[me].mix(points[me], [(0.5, wires[1 - me])])
        rounds[me].finish(points[me])
    assert torch.equal(points[0][2:], torch.tensor([15.0]))  # the buffer: a plain average
    assert torch.allclose(points[0][:2], 1.05 * torch.tensor([2.0, 3.0]))


def test_overlap_folds_the_previous_correction_into_the_next_point():
    r = make_round(torch.zeros(2), outer_lr=1.0, outer_momentum=0.0, overlap=True, delayed_weight=0.5)
    point = torch.tensor([0.0, 2.0])
    wire = r.begin(point)
    assert torch.equal(wire, point) and wire.data_ptr() != point.data_ptr()  # a copy stays in flight
    r.hold(point)
    r.finish(point)
    r.correct([(0.5, torch.tensor([4.0, 4.0]))])  # C = beta w (m_peer - m_self) = 0.25 ([4, 4] - [0, 2])
    assert torch.equal(r.correction, torch.tensor([1.0, 0.5]))
    point = torch.tensor([1.0, 1.0])
    second = r.begin(point)
    assert torch.equal(point, torch.tensor([2.0, 1.5])) and torch.equal(second, point)  # p = u + C, and it is sent


def test_a_non_finite_message_is_rejected_and_its_share_left_out():
    for codec in ("float32", "int8"):
        r = make_round(torch.zeros(4), message_codec=codec)
        point = torch.ones(4)
        r.begin(point)
        bad_wire = r.begin(torch.full((4,), float("nan"))) if codec == "int8" else torch.full((4,), float("inf"))
        r = make_round(torch.zeros(4), message_codec=codec)
        point = torch.ones(4)
        r.begin(point)
        received = [(0.5, bad_wire.clone())]
        rejected = r.correct(received) if r.by_correction else r.mix(point, received)
        assert rejected == [0]
        if r.by_correction:
            r.apply_correction(point)
        r.finish(point)
        assert torch.isfinite(point).all() and torch.allclose(point, torch.full((4,), 1.05))


def test_stacked_rows_compute_what_each_worker_computes():
    torch.manual_seed(1)
    start = torch.randn(3, 50)
    points = start + 0.1 * torch.randn(3, 50)
    for codec, overlap in (("float32", False), ("int8", False), ("bfloat16", True)):
        stacked = GossipRound(start.clone(), 50, outer_lr=0.7, outer_momentum=0.5, message_codec=codec, overlap=overlap)
        single = [GossipRound(start[i].clone(), 50, outer_lr=0.7, outer_momentum=0.5, message_codec=codec,
                              overlap=overlap) for i in range(3)]
        flat = points.clone()
        flat_rows = [row.clone() for row in points]
        peers = {0: {1: 0.5}, 1: {0: 0.5}, 2: {}}
        for _ in range(3):  # with overlap the first correction is folded into the second round
            wire = stacked.begin(flat)
            rows = [single[i].begin(p) for i, p in enumerate(flat_rows)]
            for i in range(3):
                received = [(w, wire[j]) for j, w in peers[i].items()]
                mine = [(w, rows[j]) for j, w in peers[i].items()]
                if overlap:
                    stacked.correct(received, row=i), stacked.hold(flat, row=i)
                    single[i].correct(mine), single[i].hold(flat_rows[i])
                elif stacked.by_correction:
                    stacked.correct(received, row=i), stacked.apply_correction(flat, row=i)
                    single[i].correct(mine), single[i].apply_correction(flat_rows[i])
                else:
                    stacked.mix(flat, received, row=i)
                    single[i].mix(flat_rows[i], mine)
            stacked.finish(flat)
            for i in range(3):
                single[i].finish(flat_rows[i])
                assert torch.allclose(flat[i], flat_rows[i], atol=1e-6), (codec, overlap, i)


@pytest.mark.parametrize("codec", CODECS)
def test_wire_format_counts_what_goes_out(codec):
    r = make_round(torch.zeros(1000), message_codec=codec)
    wire = r.begin(torch.randn(1000))
    numel, dtype = wire_format(codec, 1000)
    assert (wire.numel(), wire.dtype) == (numel, dtype)
    assert r.wire_bytes == wire.numel() * wire.element_size()
    ratio = r.wire_bytes / 4000
    limit = {"float32": 1.0, "bfloat16": 0.5, "int8": 0.27, "fp8": 0.27, "int4": 0.14, "int2": 0.08}[codec]
    assert ratio <= limit


def test_invalid_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="message_codec"):
        make_round(torch.zeros(4), message_codec="int3")
    with pytest.raises(ValueError, match="delayed_weight"):
        make_round(torch.zeros(4), overlap=True, delayed_weight=0.0)
    with pytest.raises(ValueError, match="num_parameters"):
        make_round(torch.zeros(4), num_parameters=5)
    with pytest.raises(RuntimeError, match="exact float32 path"):
        r = make_round(torch.zeros(4), message_codec="int8")
        r.mix(torch.zeros(4), [])


def test_checkpoint_of_a_pending_correction_round_trips():
    r = make_round(torch.zeros(3), overlap=True)
    point = torch.ones(3)
    r.begin(point)
    r.hold(point)
    r.finish(point)
    r.correct([(0.5, torch.tensor([3.0, 3.0, 3.0]))])
    other = make_round(torch.zeros(3), overlap=True)
    other.load_state_dict(r.state_dict())
    assert torch.equal(other.correction, r.correction) and bool(other.ready)
    with pytest.raises(ValueError, match="pending correction"):
        make_round(torch.zeros(3)).load_state_dict(r.state_dict())


def test_diloco_round_is_nesterov_sgd_on_the_mean_pseudo_gradient():
    start = torch.tensor([1.0, -1.0])
    r = DiLoCoRound(start, outer_lr=0.7, outer_momentum=0.9)
    reference = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for local in (torch.tensor([0.5, -0.5]), torch.tensor([0.2, 0.1])):
        delta = r.pseudo_gradient(local.clone())
        new = r.step(delta)
        reference.grad = reference.detach() - local
        optimizer.step()
        assert torch.equal(new, reference.detach())


def gossip_rounds(codec, error_feedback, rounds=30, workers=4, numel=512, seed=0):
    """Pure gossip on a ring of stacked workers (eta = 1, gamma = 0: the outer step is the identity),
    from a common start (the public copies' origin) moved apart by some training."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=generator).expand(workers, numel).clone()  # every worker starts equal
    points = start + 0.1 * torch.randn(workers, numel, generator=generator)  # ... and has trained since
    r = GossipRound(start, numel, outer_lr=1.0, outer_momentum=0.0, message_codec=codec,
                    error_feedback=error_feedback)
    flat = points.clone()
    ring = {i: sorted({(i - 1) % workers, (i + 1) % workers}) for i in range(workers)}
    for _ in range(rounds):
        r.begin(flat)
        wires = {}
        for i in range(workers):
            wires.update({(i, j): w for j, w in zip(ring[i], r.messages(ring[i], row=i))})
        for i in range(workers):
            received = [(1 / 3, wires[(j, i)]) for j in ring[i]]
            if r.by_correction:
                assert r.correct(received, row=i, peers=ring[i]) == []
                r.apply_correction(flat, row=i)
            else:
                r.mix(flat, received, row=i)
        r.finish(flat)
    return points, flat, r


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_error_feedback_reaches_the_consensus_that_plain_low_bit_gossip_misses(codec):
    points, exact, _ = gossip_rounds("float32", False)
    _, plain, _ = gossip_rounds(codec, False)
    _, feedback, r = gossip_rounds(codec, True)
    mean = points.mean(dim=0)
    for result in (plain, feedback):
        assert torch.allclose(result.mean(dim=0), mean, atol=1e-5)  # the mean is preserved either way
    spread = lambda x: float((x - x.mean(dim=0)).norm())  # noqa: E731
    assert spread(exact) < 1e-3 * spread(points)
    # int4 with feedback reaches the exact gossip's consensus; int2 (no zero level) gets there more slowly
    assert spread(feedback) < {"int4": 1e-3, "int2": 0.5}[codec] * spread(points)
    assert spread(plain) > 5 * spread(feedback)  # plain low-bit gossip stalls at its quantization noise
    assert r.copies.num_copies == 4 * 2 * 2  # 4 workers x 2 neighbours x (sent, received)


def test_error_feedback_copies_agree_at_both_ends_of_an_edge():
    _, _, r = gossip_rounds("int4", True, rounds=5)
    for i in range(4):
        for j in ((i - 1) % 4, (i + 1) % 4):
            assert torch.equal(r.copies.sent(i, j), r.copies._received_copy(j, i))


def test_error_feedback_needs_a_lossy_codec():
    with pytest.raises(ValueError, match="error_feedback"):
        make_round(torch.zeros(4), error_feedback=True)


def test_a_corrupted_error_feedback_message_stops_the_run_instead_of_shifting_the_mean_forever():
    start = torch.zeros(2, 256)
    r = GossipRound(start, 256, outer_lr=1.0, outer_momentum=0.0, message_codec="int4", error_feedback=True)
    flat = torch.randn(2, 256)
    r.begin(flat)
    wire = r.messages([1], row=0)[0].clone()
    wire[-4:] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # the last block's float32 scale becomes NaN
    with pytest.raises(FloatingPointError, match="error_feedback off"):
        r.correct([(0.5, wire)], row=1, peers=[0])


def test_error_feedback_state_keeps_the_copies_origin():
    _, _, r = gossip_rounds("int4", True, rounds=2)
    state = r.state_dict()
    other = GossipRound(torch.zeros(4, 512), 512, outer_lr=1.0, outer_momentum=0.0, message_codec="int4",
                        error_feedback=True)
    other.load_state_dict(state)
    assert torch.equal(other.copies.origin, r.copies.origin)
    assert torch.equal(other.copies.sent(0, 1), r.copies.sent(0, 1))


def test_diloco_refuses_a_codec_without_a_zero_level():
    with pytest.raises(ValueError, match="int2"):
        EncodedMean("int2", 100, 2)
