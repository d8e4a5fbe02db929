"""The simulator against the real thing: the same composed config trained by ``gasloc-train``'s
multi-process strategy (n forked ranks on real gloo process groups) and by ``gasloc-sim`` in one
process must reach the same parameters on every worker after a few rounds, with the same bytes sent
by every worker and, with a modelled network, the same simulated clock on every worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dist_utils import RecordParameters, load_ranks, write_text_corpus
from gasloc_lightning.app import sim as sim_app
from gasloc_lightning.app import train as train_app
from gasloc_lightning.app.config import config_dir
from gasloc_lightning.sim import StackedReplicas

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, H = 6, 2  # 3 rounds

# Two data centres of 2 workers each (the preset's links: 100 Gbit/s inside, 1 Gbit/s and 30 ms between).
TWO_CLUSTERS = ("network=two_clusters", "network.sizes=[2,2]")


@dataclass(frozen=True)
class Case:
    """One configuration trained by both engines.

    overrides: Hydra overrides on top of the common ones. workers: n, ranks and replicas.
    chunk_size: replicas per forward/backward pass in the simulator (None: its default, one chunk here).
    """

    overrides: tuple[str, ...]
    workers: int = 4
    chunk_size: int | None = None


CASES = {
    "one_peer": Case(("strategy=gasloc", "topology=one_peer")),
    "two_peer": Case(("strategy=gasloc", "topology=two_peer")),
    "ring": Case(("strategy=gasloc", "topology=ring")),
    "exponential": Case(("strategy=gasloc", "topology=exponential")),
    "complete": Case(("strategy=gasloc", "topology=complete")),
    "post_mix": Case(("strategy=gasloc", "topology=ring", "strategy.outer_form=post_mix")),
    "bf16": Case(("strategy=gasloc", "topology=one_peer", "strategy.message_codec=bfloat16")),
    "int8": Case(("strategy=gasloc", "topology=one_peer", "strategy.message_codec=int8")),
    "int4": Case(("strategy=gasloc", "topology=one_peer", "strategy.message_codec=int4")),
    "overlap": Case(("strategy=gasloc", "topology=one_peer", "overlap=true")),
    "overlap_bf16": Case(("strategy=gasloc", "topology=one_peer", "overlap=true", "strategy.message_codec=bfloat16")),
    "diloco": Case(("strategy=diloco",)),
    "local": Case(("strategy=local",)),
    "uneven_h": Case(("strategy=gasloc", "topology=one_peer", "inner_steps=[2,1,2,1]")),  # H_i: cohorts
    # Odd n: one worker sits out each round's matching and keeps its point (and its clock).
    "odd_n": Case(("strategy=gasloc", "topology=one_peer", "network=uniform_fast", "network.world_size=3"),
                  workers=3),
    # Several simulator chunks (3 + 1 replicas): the replicas must not see each other through the batching.
    "chunks": Case(("strategy=gasloc", "topology=one_peer"), chunk_size=3),
    # With a modelled network: the simulated clocks too.
    "one_peer_network": Case(("strategy=gasloc", "topology=one_peer", *TWO_CLUSTERS)),
    "bandwidth_aware": Case(("strategy=gasloc", "topology=bandwidth_aware", *TWO_CLUSTERS)),
    "overlap_network": Case(("strategy=gasloc", "topology=one_peer", "overlap=true", *TWO_CLUSTERS)),
    "int8_network": Case(("strategy=gasloc", "topology=ring", "strategy.message_codec=int8", *TWO_CLUSTERS)),
    "complete_network": Case(("strategy=gasloc", "topology=complete", *TWO_CLUSTERS)),
    "diloco_network": Case(("strategy=diloco", *TWO_CLUSTERS)),
    # A straggler at half speed with H_i by speed (inner_steps=auto: H = [2, 2, 2, 1]).
    "straggler_auto_h": Case(("strategy=gasloc", "topology=one_peer", "network=straggler", "network.world_size=4",
                              "network.speeds=[1.0,1.0,1.0,0.5]", "inner_steps=auto",
                              "strategy.fastest_inner_steps=2")),
}


def _compose(tmp_path: Path, case: Case):
    corpus = write_text_corpus(tmp_path / "corpus")
    common = [
        "experiment=demo", f"trainer.devices={case.workers}", f"trainer.max_steps={STEPS}", f"inner_steps={H}",
        "trainer.limit_val_batches=0", "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=null",
        "trainer.enable_progress_bar=false", f"data.source={corpus}", "data.val_fraction=0.25",
        f"cache_dir={tmp_path / 'cache'}", "strategy.start_method=fork", "strategy.consensus_every=0",
        f"output_dir={tmp_path / 'out'}", f"sim.workers={case.workers}", "sim.progress_every=0",
        "model.warmup_steps=2",
        # The fused attention kernel, as each rank runs it: closer inputs to the bfloat16 rounding (with the
        # batched math kernel the float32 cases agree to about 5e-7, and a few bfloat16 roundings flip).
        "sim.attention_math=false",
    ]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("sim/app", overrides=common + list(case.overrides))


def _multi_process(cfg, out: Path, workers: int) -> list[dict]:
    out.mkdir()
    with train_app.isolated_job():
        trainer, model, datamodule = train_app.build(cfg)
        trainer.callbacks.append(RecordParameters(str(out)))
        trainer.fit(model, datamodule=datamodule)
    return load_ranks(out, workers)


def _simulate(cfg, chunk_size: int | None):
    simulator, _ = sim_app.build(cfg)
    if chunk_size is not None:
        # Not a config option: the app keeps StackedReplicas' default, which it reads at every pass.
        assert isinstance(simulator.replicas, StackedReplicas)
        simulator.replicas.chunk_size = chunk_size
    simulator.train()
    simulator.finish()  # the last delayed correction is folded in before the strategy's last batch-end hook
    return simulator


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulator_matches_the_multi_process_strategy(case, tmp_path, fresh_port):
    spec = CASES[case]
    cfg = _compose(tmp_path, spec)
    ranks = _multi_process(cfg, tmp_path / "ranks", spec.workers)
    simulator = _simulate(cfg, spec.chunk_size)
    assert simulator.round_index == ranks[0]["round_index"] == STEPS // H
    for rank, record in enumerate(ranks):
        expected, actual = record["final"], simulator.replicas.flat[rank].double()
        assert (actual - expected).norm() <= 1e-5 * expected.norm(), f"{case}: worker {rank}"
        assert (expected - record["history"][0]).norm() > 1e-3  # it trained
    consensus = simulator.consensus_point().double()
    assert (consensus - ranks[0]["after_fit"]).norm() <= 1e-5 * consensus.norm()  # the end-of-fit average
    assert [float(b) for b in simulator.rounds.bytes_sent] == [float(r["bytes_sent"]) for r in ranks], case
    _check_clocks(case, simulator, ranks)


def _check_clocks(case: str, simulator, ranks: list[dict]) -> None:
    """Each worker's simulated time at the end of fit (after any exchange in flight), where there is a network."""
    clocked = simulator.clocks.enabled
    assert all((record["sim_time_at_fit_end"] is not None) == clocked for record in ranks), case
    if not clocked:
        return
    times = simulator.clocks.times()
    for rank, record in enumerate(ranks):
        expected = record["sim_time_at_fit_end"]
        assert times[rank] == pytest.approx(expected, rel=1e-9, abs=0.0), f"{case}: worker {rank} sim_time"
        assert expected > STEPS * 0.5  # the presets' 0.5 s steps, and some communication
