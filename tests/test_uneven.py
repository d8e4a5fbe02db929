"""Uneven workers and links: per-rank H_i, bfloat16 messages, overlapped gossip (real gloo, forked workers)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from dist_utils import RecordParameters, TinyRegressor, load_ranks
from gasloc_lightning import GASLoCStrategy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def run(tmp_path, strategy, model=None, devices=2, max_steps=9, perturb=0.0):
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False, limit_val_batches=0, default_root_dir=tmp_path,
               callbacks=[RecordParameters(str(tmp_path), perturb)]).fit(model or TinyRegressor())
    return load_ranks(tmp_path, devices)


def gossip_only(**kwargs):
    """Inner lr 0, eta 1, gamma 0: only the exchange moves the replicas."""
    return GASLoCStrategy(outer_lr=1.0, outer_momentum=0.0, start_method="fork", gossip_timeout=60.0, **kwargs)


def test_per_rank_inner_steps_keep_rounds_aligned(tmp_path, fresh_port):
    records = run(tmp_path, GASLoCStrategy(inner_steps=[3, 1], start_method="fork", gossip_timeout=60.0))
    assert [r["rounds_at_fit_end"] for r in records] == [3, 3]  # round length max(H_i) = 3 on both
    history, rounds = records[1]["history"], records[1]["rounds"]
    moved = [not torch.equal(history[k], history[k - 1]) for k in range(1, len(history))]
    # rank 1 (H_1 = 1) applies only the first step of each round; the third step of a round moves by the exchange
    assert moved == [True, False, True] * 3
    assert rounds == records[0]["rounds"]


def test_inner_steps_per_rank_must_match_the_world_size():
    with pytest.raises(ValueError, match="inner_steps has 3 values"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=GASLoCStrategy(inner_steps=[1, 2, 3]), logger=False)


def test_bfloat16_messages_halve_the_bytes_and_keep_the_mean(tmp_path, fresh_port):
    model = TinyRegressor(inner_lr=0.0, optimizer="sgd")
    records = run(tmp_path, gossip_only(inner_steps=3, message_dtype="bfloat16", consensus_every=0),
                  model=model, devices=4, perturb=0.5)
    history = torch.stack([r["history"] for r in records])  # (ranks, records, P)
    mean = history.mean(0)
    assert ((mean - mean[0]).norm(dim=1) <= 1e-6 * mean[0].norm()).all()
    spread = ((history - mean) ** 2).sum(dim=(0, 2))
    assert spread[-1] < 0.5 * spread[0]
    for record in records:
        assert record["bytes_sent"] == 3 * record["exchanged_numel"] * 2  # 3 rounds, one peer, 2 bytes each


def test_complete_topology_refuses_overlap_and_bfloat16():
    for kwargs in ({"overlap": True}, {"message_dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="point-to-point gossip"):
            pl.Trainer(accelerator="cpu", devices=2, logger=False,
                       strategy=GASLoCStrategy(topology="complete", **kwargs))


def test_ranks_per_worker_behave_as_one_worker(tmp_path, fresh_port):
    """4 ranks, 2 per worker: DDP inside a worker (identical replicas), gossip between the 2 workers."""
    strategy = GASLoCStrategy(inner_steps=3, ranks_per_worker=2, start_method="fork", gossip_timeout=60.0)
    records = run(tmp_path, strategy, devices=4)
    history = torch.stack([r["history"] for r in records])  # (ranks, records, P)
    assert torch.equal(history[0], history[1]) and torch.equal(history[2], history[3])
    assert not torch.allclose(history[0, 2], history[2, 2])  # mid-round: the two workers differ
    assert torch.allclose(history[0, 3], history[2, 3], atol=1e-6)  # after the pairwise round: averaged
    assert records[0]["bytes_sent"] > 0 and records[1]["bytes_sent"] == 0  # only the leader exchanges


def test_ranks_must_divide_into_workers():
    with pytest.raises(ValueError, match="not divisible by ranks_per_worker=2"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=GASLoCStrategy(ranks_per_worker=2), logger=False)
