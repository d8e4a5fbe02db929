"""The simulator's churn is the elastic mode's: down workers compute nothing and their data stands still, a joiner
restarts its sampler and pulls the elastic state, collectives run over the live set, gamma holds at every live
size, and every tensor lives on ``sim.device``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from dist_utils import write_text_corpus
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.sim import ChurnSchedule, WorkerClocks, resolve_outer_momentum_for_sizes
from gasloc_lightning.topology import build_topology

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _cfg(corpus: Path, tmp_path: Path, overrides: list[str]):
    quick = ["experiment=demo", "trainer.max_steps=8", "trainer.val_check_interval=8", "inner_steps=2",
             f"data.source={corpus}", "data.val_fraction=0.25", "data.batch_size=2", "data.val_batches=1",
             f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "sim.workers=4",
             "sim.progress_every=0", "strategy=gasloc", "topology=complete"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=quick + overrides)


def test_a_down_worker_draws_no_batch_and_a_joiner_restarts_its_sampler(corpus, tmp_path):
    simulator, _ = sim_app.build(_cfg(corpus, tmp_path, []))
    fresh, _ = sim_app.build(_cfg(corpus, tmp_path / "fresh", []))
    batches, reference = simulator.batches, fresh.batches
    first = reference.next_batch()[0]  # (4, B, T): every worker's first batch
    second = reference.next_batch()[0]
    assert torch.equal(batches.next_batch([0, 1, 3])[0], first[[0, 1, 3]])  # worker 2 is down: its stream stands
    assert torch.equal(batches.next_batch([2])[0][0], first[2])  # ... so it goes on with its own first batch
    assert torch.equal(batches.next_batch([0, 1, 3])[0], second[[0, 1, 3]])
    batches.restart(0)  # a fresh process: its shard's sampler starts again
    assert torch.equal(batches.next_batch([0])[0][0], first[0])


def test_down_replicas_compute_nothing_and_the_live_ones_step_as_if_alone(corpus, tmp_path):
    simulator, _ = sim_app.build(_cfg(corpus, tmp_path, []))
    replicas = simulator.replicas
    x, y = simulator.batches.next_batch()
    before = replicas.gather().clone()
    full = replicas.losses(x, y)
    losses = replicas.train_step(x[[0, 2]], y[[0, 2]], 0, rows=[0, 2])
    assert losses.shape == (2,) and torch.allclose(losses, full[[0, 2]])
    changed = (replicas.gather() != before).any(dim=1)
    assert changed[0] and changed[2]
    for state in replicas.optimizer.state.values():  # a down worker's moments saw no gradient
        assert torch.count_nonzero(state["exp_avg"][1]) == 0 and torch.count_nonzero(state["exp_avg"][3]) == 0


def test_churn_runs_only_the_live_steps_and_joiners_pull_five_model_copies(corpus, tmp_path):
    simulator, _ = sim_app.build(_cfg(corpus, tmp_path, ["network=two_clusters"]))
    numel = simulator.replicas.numel
    simulator.churn = ChurnSchedule.replay(workers=4, live_by_round=[[0, 1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 1, 2, 3]])
    computed, train_step = [], simulator.replicas.train_step

    def counting(x, y, step_in_round, rows=None):
        computed.append(x.shape[0])
        return train_step(x, y, step_in_round, rows=rows)

    simulator.replicas.train_step = counting
    result = simulator.run()
    assert sum(computed) == 2 * 4 + 2 * 3 + 2 * 3 + 2 * 4  # H = 2 steps per round, times the live workers
    batch, block = simulator.batches.batch_size, simulator.batches.block_size
    assert result["tokens"] == sum(computed) * batch * block  # the down worker's tokens are not counted
    assert result["final"]["progress/tokens"] == result["tokens"]
    assert result["joins"] == 1
    state_bytes = simulator.join_state_bytes(0)
    # the elastic mode's state: live point, round start, anchor, AdamW's two moments (float32) and step counts
    assert 5 * 4 * numel <= state_bytes < 5 * 4 * numel + 4096
    assert float(simulator.rounds.bytes_sent[0] - simulator.rounds.bytes_sent[1]) == pytest.approx(state_bytes)
    compute = [clock.compute_time for clock in simulator.clocks.clocks]
    assert compute[3] == pytest.approx(compute[0] / 2)  # away two rounds of four: half the compute time


def test_the_live_set_all_reduces_and_a_joiner_waits_for_its_state():
    network = NetworkModel.clusters(sizes=[2, 2], intra_gbps=100.0, intra_latency_s=0.0, inter_gbps=1.0,
                                    inter_latency_s=0.03)
    clocks = WorkerClocks(network, 4)
    clocks.all_reduce([0, 1])  # worker 2 and 3 are down: the ring stays inside cluster 0
    assert clocks.times()[0] == pytest.approx(network.all_reduce_time(network.message_bytes(), ranks=[0, 1]))
    assert clocks.times()[0] < network.all_reduce_time(network.message_bytes())
    clocks.join(2, 0, state_fraction=5.0)
    assert clocks.times()[2] == pytest.approx(clocks.times()[0] + network.pairwise_time(0, 2, 5 * network.message_bytes()))


def test_gamma_is_the_smallest_default_over_live_sizes_and_every_size_is_checked(corpus, tmp_path):
    ring = build_topology("ring")
    gamma = resolve_outer_momentum_for_sizes(ring, [4, 16, 64], None, "anchored", False, 1.0)
    assert gamma == min(ring.default_outer_momentum(m, "anchored") for m in (4, 16, 64))
    with pytest.raises(ValueError, match="7 workers are live|no valid 'exponential' topology"):
        resolve_outer_momentum_for_sizes(build_topology("exponential"), [7, 8], None, "anchored", False, 1.0)
    with pytest.raises(ValueError, match="exponential"):  # the app: a drawn schedule reaching 7 of 8 live workers
        sim_app.build(_cfg(corpus, tmp_path, ["topology=exponential", "sim.workers=8", "sim.down_fraction=0.3",
                                              "sim.mean_downtime_rounds=1", "sim.churn_seed=1"]))


def test_replayed_membership_names_joiners_and_their_source():
    schedule = ChurnSchedule.replay(workers=4, live_by_round=[[0, 1, 2, 3], [0, 1, 2], [1, 2, 3]])
    assert [e.live for e in schedule.events] == [(0, 1, 2, 3), (0, 1, 2), (1, 2, 3)]
    assert schedule.events[1].left == (3,) and schedule.events[2].joins == {3: 1} and schedule.events[2].left == (0,)
    assert schedule.live_sizes() == [3, 4]
    with pytest.raises(ValueError, match=r"live_by_round\[1\]"):
        ChurnSchedule.replay(workers=4, live_by_round=[[0], [5]])


def test_sim_device_that_is_absent_is_refused(corpus, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="sim.device='cuda' but no CUDA device"):
        sim_app.build(_cfg(corpus, tmp_path, ["sim.device=cuda"]))
    with pytest.raises(ValueError, match="sim.device='tpu'"):
        sim_app.build(_cfg(corpus, tmp_path, ["sim.device=tpu"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_simulator_runs_on_cuda_with_churn_and_matches_cpu(corpus, tmp_path):
    churn = ["sim.down_fraction=0.3", "sim.mean_downtime_rounds=1", "sim.churn_seed=1", "network=two_clusters"]
    losses = {}
    for device in ("cpu", "cuda"):
        simulator, _ = sim_app.build(_cfg(corpus, tmp_path / device, [f"sim.device={device}", *churn]))
        assert simulator.replicas.gather().device.type == device
        losses[device] = simulator.run()["final"]["val/loss"]
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
