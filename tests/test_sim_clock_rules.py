"""The simulator's clock rules that a real run could measure (issue 35), each against the rule it replaced:

- Streaming DiLoCo's quantized mean is posted at the prepare point and waited on where the fragment lands (it
  hides under the compute between them, as the float32 mean does), not blocking at the post;
- a validation is stamped over the workers that trained the round, not the ones that join after it;
- the consensus evaluation is a full-model all-reduce over those workers, posted and not waited on by
  training: the stamp is when it ends;
- a scenario's noise (jitter) and churn (preemption) follow the run's seed unless pinned.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir

from dist_utils import write_text_corpus
from gasloc_lightning.algorithm.fragments import resolve_points
from gasloc_lightning.algorithm.streaming import fragment_bounds
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.sim import DiLoCoRounds, WorkerClocks

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _cfg(overrides: list[str], corpus: Path | None = None, tmp_path: Path | None = None):
    quick = [] if corpus is None else [
        "trainer.max_steps=4", "trainer.val_check_interval=2", "inner_steps=2", f"data.source={corpus}",
        "data.val_fraction=0.25", "data.batch_size=2", "data.val_batches=1", f"cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'out'}", "sim.progress_every=0"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=["experiment=demo", *quick, *overrides])


def _validations(out: Path) -> dict[int, float]:
    record = json.loads((out / "summary.json").read_text())
    with (out / record["metrics_csv"]).open() as file:
        return {int(r["step"]) + 1: float(r["val/sim_time"]) for r in csv.DictReader(file) if r.get("val/loss")}


@pytest.mark.parametrize("codec", ["int4", "float32"])
def test_the_quantized_streamed_mean_hides_under_compute_until_its_fragment_lands(codec):
    """H = 4, two fragments, overlap (tau = 1): fragment 0 leaves after step 1 and lands after step 2. With a
    transfer shorter than a step, the step between hides it whole: no worker's clock moves at the post, and
    at the landing the clocks are the compute's (the old rule blocked the int4 mean at the post)."""
    network = NetworkModel.uniform(world_size=4, bandwidth_gbps=100.0, latency_s=1e-3, model_parameters=10**8,
                                   step_time_s=0.5)
    clocks = WorkerClocks(network, 4)
    initial = torch.zeros(4, 8)
    rounds = DiLoCoRounds(initial=initial, outer_lr=0.7, outer_momentum=0.5, clocks=clocks, message_codec=codec,
                          points=resolve_points(4, 2, overlap=True), bounds=fragment_bounds([4, 4], 2))
    live = [0, 1, 2, 3]
    flat = initial + torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    clocks.advance_compute(live)
    assert not rounds.after_step(flat, 1, live)  # fragment 0 leaves: posted
    assert clocks.times() == [0.5] * 4
    (end,) = rounds._in_flight[0][2]
    assert 0.5 < end < 1.0  # its all-reduce would end inside the next step
    clocks.advance_compute(live)
    assert rounds.after_step(flat, 2, live)  # fragment 0 lands: waited on, already over
    assert clocks.times() == [1.0] * 4


def test_a_validation_is_stamped_over_the_workers_that_trained_the_round(corpus, tmp_path):
    """Worker 3 is away in round 0 and joins at its end: it pulls five model copies, so its clock lies far past
    the others'. The validation at that boundary is of round 0, trained by workers 0-2: its stamp is theirs
    (the old rule took the joiner's clock)."""
    cfg = _cfg(["sim.workers=4", "strategy=local", "network=uniform_fast", "network.world_size=4",
                "sim.live_by_round=[[0,1,2],[0,1,2,3]]"], corpus, tmp_path)
    sim_app.simulate(cfg)
    network = hydra.utils.instantiate(cfg.network, _convert_="all")
    stamps = _validations(tmp_path / "out")
    after_round_0 = 2 * network.step_time(0) + network.all_reduce_time(network.message_bytes(), ranks=[0, 1, 2])
    joiner = 2 * network.step_time(0) + network.pairwise_time(0, 3, 5 * network.message_bytes())
    assert joiner > after_round_0
    assert stamps[2] == pytest.approx(after_round_0, rel=1e-12)


def test_the_consensus_is_an_all_reduce_posted_at_the_validation_and_not_waited_on(corpus, tmp_path):
    """No communication in training (local), one worker at half speed: the consensus all-reduce starts at the
    latest clock, the straggler's, and the stamp is when it ends; training does not wait for it, so worker 0's
    clock stays its compute (the old rule stamped the latest clock, as if the consensus cost nothing)."""
    cfg = _cfg(["sim.workers=8", "strategy=local", "network=straggler"], corpus, tmp_path)
    sim_app.simulate(cfg)
    network = hydra.utils.instantiate(cfg.network, _convert_="all")
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    with (tmp_path / "out" / record["metrics_csv"]).open() as file:
        worker_0 = {int(r["step"]) + 1: float(r["sim_time"]) for r in csv.DictReader(file) if r.get("sim_time")}
    consensus = network.all_reduce_time(network.message_bytes())
    stamps = _validations(tmp_path / "out")
    assert sorted(stamps) == [2, 4]
    for step, stamp in stamps.items():
        assert worker_0[step] == pytest.approx(step * network.step_time(0))  # no barrier: compute only
        assert stamp == pytest.approx(2 * worker_0[step] + consensus, rel=1e-12)


@pytest.mark.parametrize("preset, node", [("jitter", "compute_jitter"), ("preemption", "preemption")])
def test_a_scenarios_noise_and_churn_follow_the_runs_seed_unless_pinned(preset, node):
    """The old presets pinned seed 0: every run's seed drew the same noise and churn."""
    drawn = [hydra.utils.instantiate(_cfg([f"network={preset}", "sim.workers=8", f"seed={seed}"]).network,
                                     _convert_="all") for seed in (1, 2)]
    assert [getattr(model, node).seed for model in drawn] == [1, 2]
    pinned = _cfg([f"network={preset}", "sim.workers=8", "seed=2", f"network.{node}.seed=0"])
    assert getattr(hydra.utils.instantiate(pinned.network, _convert_="all"), node).seed == 0
