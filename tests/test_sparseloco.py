"""Sparse messages with error feedback in the engines: DiLoCo's all-gathered top-k mean (SparseLoCo,
``strategy=sparseloco``) and top-k gossip with its damped consensus step.

- The mean is preserved: what the workers sent plus their residuals is what they meant to send (float64).
- SparseLoCo in the simulator's round equals a float64 oracle of its rule on a tiny quadratic.
- The multi-process mean (an all-gather on real gloo ranks) is bitwise the simulator's.
- The configs compose and run in gasloc-sim; what is not wired is refused by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from dist_utils import write_text_corpus
from gasloc_lightning import DiLoCoStrategy, GASLoCStrategy
from gasloc_lightning.algorithm.round import SPARSE_CONSENSUS_STEP, GossipRound
from gasloc_lightning.algorithm.sparse_mean import SparseMessages, all_gather_bytes
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.comm.transport import GossipTransport
from gasloc_lightning.sim import DiLoCoRounds, WorkerClocks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("threads_safe_to_fork")]


# ---------------------------------------------------------------------------- the mean is preserved
def test_the_mean_is_preserved_under_top_k_with_error_feedback():
    """sum over workers and rounds of what was sent, plus the residuals, is the sum of the true messages."""
    workers, numel, rounds = 4, 500, 20
    messages = SparseMessages("topk-0.02-int2", numel, rows=workers)
    generator = torch.Generator().manual_seed(3)
    true_sum = torch.zeros(numel, dtype=torch.float64)
    sent_sum = torch.zeros(numel, dtype=torch.float64)
    for _ in range(rounds):
        deltas = torch.randn(workers, numel, generator=generator)
        true_sum += deltas.double().sum(dim=0)
        wires = messages.encode_rows(deltas, range(workers))
        mean = messages.mean(wires, torch.empty(numel))
        sent_sum += workers * mean.double()
    residuals = sum(messages.residual(i).double() for i in range(workers))
    scale = true_sum.abs().max()
    assert (sent_sum + residuals - true_sum).abs().max() <= 1e-5 * scale
    assert (sent_sum - true_sum).abs().max() > 0.01 * scale  # the residuals hold a real share of it


def test_the_residuals_resume_from_a_state_dict_and_refuse_another_run():
    messages = SparseMessages("topk-0.1-int4", 50, rows=2)
    messages.encode_rows(torch.randn(2, 50, generator=torch.Generator().manual_seed(0)), [0, 1])
    resumed = SparseMessages("topk-0.1-int4", 50, rows=2)
    resumed.load_state_dict(messages.state_dict())
    assert all(torch.equal(resumed.residual(i), messages.residual(i)) for i in range(2))
    assert messages.residual(0).abs().sum() > 0
    with pytest.raises(ValueError, match="2 error-feedback residuals, this run needs 3"):
        SparseMessages("topk-0.1-int4", 50, rows=3).load_state_dict(messages.state_dict())
    with pytest.raises(ValueError, match="codec"):
        SparseMessages("topk-0.2-int4", 50, rows=2).load_state_dict(messages.state_dict())


# ---------------------------------------------------------------------------- SparseLoCo against an oracle
def _oracle_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |x| kept (ties: the lowest index), the rest zero; float64."""
    order = sorted(range(x.numel()), key=lambda j: (-abs(float(x[j])), j))[:k]
    kept = torch.zeros_like(x)
    kept[order] = x[order]
    return kept


def test_sparseloco_in_the_simulator_equals_a_float64_oracle_on_a_quadratic():
    """Each worker takes H gradient steps on 0.5 ||x - c_i||^2, then SparseLoCo's round:
    a_i = beta e_i + Delta_i, m_i = topk(a_i), e_i = a_i - m_i, theta -= eta mean_i m_i (no momentum)."""
    workers, numel, steps, lr, eta, beta, density = 4, 40, 3, 0.3, 0.8, 0.9, 0.25
    k = int(density * numel)
    generator = torch.Generator().manual_seed(11)
    targets = torch.randn(workers, numel, generator=generator, dtype=torch.float64)
    start = torch.randn(numel, generator=generator, dtype=torch.float64)
    rounds = DiLoCoRounds(initial=start.float().expand(workers, numel).clone(), outer_lr=eta, outer_momentum=0.0,
                          clocks=WorkerClocks(None, workers), message_codec=f"topk-{density}-float32",
                          error_feedback=True, error_feedback_decay=beta)
    flat = start.float().expand(workers, numel).clone()
    theta, residual = start.clone(), torch.zeros(workers, numel, dtype=torch.float64)
    for t in range(5):
        points = theta.expand(workers, numel).clone()
        for _ in range(steps):
            flat -= lr * (flat - targets.float())
            points -= lr * (points - targets)
        rounds.communicate(flat, t, live=range(workers))
        accumulated = beta * residual + (theta - points)
        sent = torch.stack([_oracle_topk(accumulated[i], k) for i in range(workers)])
        residual = accumulated - sent
        theta = theta - eta * sent.mean(dim=0)
        assert torch.allclose(flat.double(), theta.expand(workers, numel), rtol=0, atol=1e-5), f"round {t}"
    for i in range(workers):
        assert torch.allclose(rounds.sparse.residual(i).double(), residual[i], rtol=0, atol=1e-5)
    assert (theta - start).abs().max() > 0.1  # it moved


# ---------------------------------------------------------------------------- multi-process: real gloo
NUMEL, CODEC, ROUNDS = 1001, "topk-0.05-int4", 3


def _deltas(world_size: int, round_index: int) -> torch.Tensor:
    return torch.randn(world_size, NUMEL, generator=torch.Generator().manual_seed(100 + round_index)) * 1e-2


def _rank(rank: int, world_size: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        transport = GossipTransport(NUMEL, torch.device("cpu"), timeout=30.0)
        messages = SparseMessages(CODEC, NUMEL, decay=0.95)
        means = []
        for t in range(ROUNDS):
            wire = messages.new_wires(1)[0]
            messages.encode(_deltas(world_size, t)[rank], wire)
            means.append(transport.all_gather_sparse_mean(wire, messages, torch.empty(NUMEL)).numpy().tobytes())
        queue.put((rank, means, messages.residual().numpy().tobytes(), transport.counters.bytes_sent))
    finally:
        dist.destroy_process_group()


def _fork_ranks(world_size: int, port: int) -> list:
    context = mp.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(r, world_size, port, queue)) for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        return sorted(queue.get(timeout=90) for _ in range(world_size))
    finally:
        for process in processes:  # stopped by pid, on success and on failure
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


@pytest.mark.distributed
def test_the_all_gathered_sparse_mean_is_the_simulators_bits(fresh_port, one_torch_thread):
    world_size = 2
    results = _fork_ranks(world_size, fresh_port())
    stacked = SparseMessages(CODEC, NUMEL, rows=world_size, decay=0.95)
    for t in range(ROUNDS):
        wires = stacked.encode_rows(_deltas(world_size, t), range(world_size))
        expected = stacked.mean(wires, torch.empty(NUMEL)).numpy().tobytes()
        for rank, means, _, _ in results:
            assert means[t] == expected, f"rank {rank}, round {t}"
    for rank, _, residual, bytes_sent in results:
        assert residual == stacked.residual(rank).numpy().tobytes()
        assert bytes_sent == ROUNDS * all_gather_bytes(stacked.wire_bytes, world_size)  # one wire to the other rank


# ---------------------------------------------------------------------------- gossip: the damped step
def test_top_k_gossip_takes_a_damped_step_and_keeps_the_mean():
    """Stacked rows on a ring of 4: each correction is s times the undamped one, and the mean is preserved."""
    workers, numel = 4, 200
    points = torch.randn(workers, numel, generator=torch.Generator().manual_seed(2))
    neighbours = {i: sorted({(i - 1) % workers, (i + 1) % workers}) for i in range(workers)}
    corrections = {}
    for step in (1.0, None):
        round_ = GossipRound(points, numel, outer_lr=1.0, outer_momentum=0.0, message_codec="topk-0.1-int8",
                             error_feedback=True, consensus_step=step)
        flat = points.clone()
        round_.begin(flat)
        wires = {(i, j): wire.clone() for i in range(workers)
                 for j, wire in zip(neighbours[i], round_.messages(neighbours[i], row=i))}
        for i in range(workers):
            round_.correct([(1 / 3, wires[(j, i)]) for j in neighbours[i]], row=i, peers=neighbours[i])
            round_.apply_correction(flat, row=i)
        corrections[step] = round_.correction.clone()
        round_.finish(flat)
        assert torch.allclose(flat.mean(dim=0), points.mean(dim=0), atol=1e-6)
    assert torch.allclose(corrections[None], SPARSE_CONSENSUS_STEP * corrections[1.0], rtol=1e-5, atol=1e-7)
    assert corrections[1.0].abs().max() > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(message_codec="topk-0.1-int8", error_feedback=True, consensus_step=0.0), "consensus_step"),
    (dict(message_codec="topk-0.1-int8", error_feedback=True, consensus_step=1.5), "consensus_step"),
    (dict(message_codec="float32", consensus_step=0.5), "consensus_step=0.5 needs a round that mixes by correction"),
    (dict(message_codec="topk-0.1-int8"), "only with error_feedback=True"),
])
def test_gossip_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GossipRound(torch.zeros(2, 10), 10, outer_lr=0.7, outer_momentum=0.0, **kwargs)


# ---------------------------------------------------------------------------- refusals of DiLoCo's options
@pytest.mark.parametrize("kwargs, match", [
    (dict(message_codec="topk-0.01-int2", error_feedback=True, fragments=2), "fragments"),
    (dict(message_codec="topk-0.01-int2", error_feedback=True, overlap=True), "overlap"),
    (dict(message_codec="float32", error_feedback=True), "error_feedback=True needs a lossy message_codec"),
    (dict(message_codec="int8", error_feedback_decay=0.9), "error_feedback_decay applies only"),
    (dict(message_codec="topk-0.01-int2", error_feedback=True, error_feedback_decay=0.0), "error_feedback_decay"),
])
def test_diloco_refuses_what_the_sparse_mean_does_not_support(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoStrategy(**kwargs)
    with pytest.raises(ValueError, match=match):
        DiLoCoRounds(initial=torch.zeros(2, 10), outer_lr=0.7, outer_momentum=0.0, clocks=WorkerClocks(None, 2),
                     **{k: v for k, v in kwargs.items() if k not in ("fragments", "overlap")},
                     **({"points": object()} if "fragments" in kwargs or "overlap" in kwargs else {}))


def test_the_strategies_take_top_k_with_error_feedback():
    diloco = DiLoCoStrategy(message_codec="topk-0.01-int2", error_feedback=True, error_feedback_decay=0.95,
                            outer_momentum=0.0)
    assert (diloco.error_feedback, diloco.error_feedback_decay) == (True, 0.95)
    gasloc = GASLoCStrategy(message_codec="topk-0.01-int4", error_feedback=True, topology="ring")
    assert gasloc.consensus_step is None  # resolved to SPARSE_CONSENSUS_STEP by the round


# ---------------------------------------------------------------------------- the configs run in gasloc-sim
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _compose(corpus: Path, tmp_path: Path, overrides: list[str]):
    quick = ["experiment=demo", "trainer.max_steps=4", "trainer.val_check_interval=2", "inner_steps=2",
             f"data.source={corpus}", "data.val_fraction=0.25", "data.batch_size=4", "data.val_batches=1",
             f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "sim.workers=4",
             "sim.progress_every=0"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=quick + overrides)


def test_sparseloco_and_top_k_gossip_run_in_the_simulator_at_a_fiftieth_of_the_bytes(corpus, tmp_path):
    bytes_sent = {}
    for name, overrides in {
        "diloco": ["strategy=diloco"],
        "sparseloco": ["strategy=sparseloco"],
        "ring": ["strategy=gasloc", "topology=ring"],
        "ring_topk": ["strategy=gasloc", "topology=ring", "strategy.message_codec=topk-0.01-int4",
                      "strategy.error_feedback=true"],
    }.items():
        simulator, _ = sim_app.build(_compose(corpus, tmp_path / name, overrides))
        simulator.train()
        simulator.finish()
        bytes_sent[name] = float(simulator.rounds.bytes_sent.sum())
        assert torch.isfinite(simulator.replicas.flat).all(), name
    assert 0 < bytes_sent["sparseloco"] <= 0.05 * bytes_sent["diloco"]
    assert 0 < bytes_sent["ring_topk"] <= 0.05 * bytes_sent["ring"]
