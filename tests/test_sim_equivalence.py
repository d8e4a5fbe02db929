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

    @property
    def lossy(self) -> bool:
        """Whether messages go through a lossy codec (bfloat16, int8, int4, ...)."""
        return any(o.startswith(("strategy.message_codec=", "topology.cross_codec=")) and not o.endswith("=float32")
                   for o in self.overrides)


# Which strategy code each case reaches. A modelled network changes no training step (strategies/round_clock.py:
# it only keeps the clock), so a case with a network covers its case without one and adds the clock; the plain
# float32 cases of one_peer, complete, diloco and overlap are therefore not run apart from chunks (one_peer, 4
# workers), complete_network, diloco_network and overlap_network. Cases whose code path does not depend on the
# number of workers (a codec on a one-peer pair, local steps, per-worker H) run 2 ranks; graphs, error-feedback
# edges, regions and clusters keep 4.
CASES = {
    "two_peer": Case(("strategy=gasloc", "topology=two_peer")),
    "ring": Case(("strategy=gasloc", "topology=ring")),
    "exponential": Case(("strategy=gasloc", "topology=exponential")),
    "post_mix": Case(("strategy=gasloc", "topology=ring", "strategy.outer_form=post_mix")),
    "bf16": Case(("strategy=gasloc", "topology=one_peer", "strategy.message_codec=bfloat16"), workers=2),
    "int8": Case(("strategy=gasloc", "topology=one_peer", "strategy.message_codec=int8"), workers=2),
    # int4 on a ring with a network: a codec's fractional bytes per element (its block scales) in the clock.
    "int4": Case(("strategy=gasloc", "topology=ring", "strategy.message_codec=int4", *TWO_CLUSTERS)),
    # Error feedback (CHOCO's per-edge public copies): edges must repeat, so a fixed ring.
    "error_feedback": Case(("strategy=gasloc", "topology=ring", "strategy.message_codec=int8",
                            "strategy.error_feedback=true")),
    "overlap_bf16": Case(("strategy=gasloc", "topology=one_peer", "overlap=true", "strategy.message_codec=bfloat16"),
                         workers=2),
    # Two regions of 2 (DiLoCo inside, the cross step after rounds 2: one crossing in 3 rounds): region means on
    # subgroups and the shard-parallel crossing against the simulator's rows.
    "two_level": Case(("strategy=two_level", "topology=two_level", "topology.regions=[0,0,1,1]",
                       "topology.cross_every=2")),
    # The delayed crossing at every round: posted at rounds 0-2, landed at the next crossing and at the end of
    # training (folded in), on a process group of its own.
    "two_level_delayed": Case(("strategy=two_level", "topology=two_level", "topology.regions=[0,0,1,1]",
                               "topology.cross_every=1", "topology.cross_overlap=true")),
    # Hierarchical DiLoCo with an int8 crossing: each rank's shard of the change since the last mean, averaged by
    # the quantized all-reduce among rank l of both regions (a group per local index), from the strategy's round.
    "hierarchical_int8": Case(("strategy=two_level", "topology=hierarchical", "topology.regions=[0,0,1,1]",
                               "topology.cross_every=2", "topology.cross_codec=int8")),
    "local": Case(("strategy=local",), workers=2),
    "uneven_h": Case(("strategy=gasloc", "topology=one_peer", "inner_steps=[2,1]"), workers=2),  # H_i: cohorts
    # Odd n: one worker sits out each round's matching and keeps its point (and its clock).
    "odd_n": Case(("strategy=gasloc", "topology=one_peer", "network=uniform_fast", "network.world_size=3"),
                  workers=3),
    # One-peer gossip in float32 on 4 workers, in several simulator chunks (3 + 1 replicas): the replicas must not
    # see each other through the batching (every other case runs the simulator's single chunk).
    "chunks": Case(("strategy=gasloc", "topology=one_peer"), chunk_size=3),
    # With a modelled network: the simulated clocks too.
    "one_peer_network": Case(("strategy=gasloc", "topology=one_peer", *TWO_CLUSTERS)),
    "bandwidth_aware": Case(("strategy=gasloc", "topology=bandwidth_aware", *TWO_CLUSTERS)),
    "overlap_network": Case(("strategy=gasloc", "topology=one_peer", "overlap=true", *TWO_CLUSTERS)),
    "complete_network": Case(("strategy=gasloc", "topology=complete", *TWO_CLUSTERS)),
    "diloco_network": Case(("strategy=diloco", *TWO_CLUSTERS)),
    # DiLoCo's quantized all-reduce: its encoded chunks in the bytes, its element size in the clock.
    "diloco_int8_network": Case(("strategy=diloco", "strategy.message_codec=int8", *TWO_CLUSTERS)),
    # Streamed rounds (H = 2, F = 2: a fragment after each step), alpha keeping a share of the local steps, the
    # clock charging each fragment its share of the bytes.
    "fragments_network": Case(("strategy=gasloc", "topology=one_peer", "strategy.fragments=2",
                               "strategy.fragment_update_alpha=0.25", *TWO_CLUSTERS)),
    "streaming_diloco_int8_network": Case(("strategy=diloco", "strategy.fragments=2",
                                           "strategy.fragment_update_alpha=0.25", "strategy.message_codec=int8",
                                           *TWO_CLUSTERS)),
    # SparseLoCo: top-k 1% at 2 bits with error feedback, the mean an all-gather of the wires (bytes: (n - 1) wires).
    "sparseloco_network": Case(("strategy=sparseloco", "strategy.message_codec=topk-0.01-int2", *TWO_CLUSTERS)),
    # Top-k gossip with per-edge error feedback and the damped consensus step (default 0.05).
    "topk_ring": Case(("strategy=gasloc", "topology=ring", "strategy.message_codec=topk-0.05-int8",
                       "strategy.error_feedback=true")),
    # A straggler at half speed with H_i by speed (inner_steps=auto: H = [2, 1]).
    "straggler_auto_h": Case(("strategy=gasloc", "topology=one_peer", "network=straggler", "network.world_size=2",
                              "network.speeds=[1.0,0.5]", "inner_steps=auto", "strategy.fastest_inner_steps=2"),
                             workers=2),
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


@dataclass(frozen=True)
class Outcome:
    """What the two engines reached in one case, kept small (both tests read it; each case trains once).

    Per worker: parameter_error ||sim_i - strategy_i|| / ||strategy_i|| at the end of training, moved
    ||strategy_i - start||; bytes_sent and sim_time (None without a network) as (simulator, strategy).
    """

    rounds: tuple[int, int]
    parameter_error: list[float]
    moved: list[float]
    consensus_error: float  # the end-of-fit average
    bytes_sent: tuple[list[float], list[float]]
    sim_time: tuple[list[float] | None, list[float | None]]


_OUTCOMES: dict[str, Outcome] = {}


def _outcome(case: str, tmp_path: Path) -> Outcome:
    if case not in _OUTCOMES:
        _OUTCOMES[case] = _train_both(CASES[case], tmp_path)
    return _OUTCOMES[case]


def _train_both(case: Case, tmp_path: Path) -> Outcome:
    cfg = _compose(tmp_path, case)
    ranks = _multi_process(cfg, tmp_path / "ranks", case.workers)
    simulator = _simulate(cfg, case.chunk_size)
    finals = simulator.replicas.flat.double()  # (n, P)
    consensus = simulator.consensus_point().double()
    return Outcome(
        rounds=(simulator.round_index, ranks[0]["round_index"]),
        parameter_error=[float((finals[i] - r["final"]).norm() / r["final"].norm()) for i, r in enumerate(ranks)],
        moved=[float((r["final"] - r["history"][0]).norm()) for r in ranks],
        consensus_error=float((consensus - ranks[0]["after_fit"]).norm() / consensus.norm()),
        bytes_sent=([float(b) for b in simulator.rounds.bytes_sent], [float(r["bytes_sent"]) for r in ranks]),
        # At the end of fit: after the strategy's last exchange in flight completes (overlap).
        sim_time=(simulator.clocks.times() if simulator.clocks.enabled else None,
                  [r["sim_time_at_fit_end"] for r in ranks]),
    )


# Both engines run the same float32 local steps, but not bit for bit: the simulator's per-replica clipping
# sums the gradient norm in another order than torch's clip_grad_norm_, and vmap reduces the LayerNorm
# weights' gradients over the batch in another order; the replicas are ~1e-8 apart after a step. A lossy
# codec turns that into a whole rounding step wherever a message element lies that close to a rounding
# boundary. Measured: with bfloat16 gossip, each element that differed after the first round had one
# partner's message within ~1e-6 of a bfloat16 midpoint (some exactly on it); with DiLoCo's int8 mean,
# one-ulp noise on 15% of one engine's points moves ~60 elements of the mean by a step, as many as differ
# between the engines. Spread by the local steps, that leaves the workers 0.5-4e-5 apart after 3 rounds.
# So lossy cases get a tolerance of 1e-3 relative: 25 times what those flips leave, and far below what a wrong
# rule leaves (the own message not decoded, a copy out of step, a chunk summed twice: 1e-2 and more).
LOSSY_TOLERANCE = 1e-3


# Both tests of a case read one training of it (_OUTCOMES, per process): under xdist a group per case keeps them on
# one worker, or each worker that runs one of them trains the case again.
CASE_PARAMS = [pytest.param(case, marks=pytest.mark.xdist_group(f"sim_equivalence_{case}")) for case in sorted(CASES)]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_the_simulator_reaches_the_strategys_parameters(case, tmp_path, fresh_port):
    outcome = _outcome(case, tmp_path)
    tolerance = LOSSY_TOLERANCE if CASES[case].lossy else 1e-5
    assert outcome.rounds == (STEPS // H, STEPS // H), case
    for worker, (error, moved) in enumerate(zip(outcome.parameter_error, outcome.moved)):
        assert error <= tolerance, f"{case}: worker {worker}"
        assert moved > 1e-3, f"{case}: worker {worker} did not train"
    assert outcome.consensus_error <= tolerance, case


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_the_simulator_counts_the_strategys_bytes_and_simulated_time(case, tmp_path, fresh_port):
    outcome = _outcome(case, tmp_path)
    assert outcome.rounds == (STEPS // H, STEPS // H), case
    simulated_bytes, strategy_bytes = outcome.bytes_sent
    assert simulated_bytes == strategy_bytes, case  # per worker, exactly
    simulated_time, strategy_time = outcome.sim_time
    has_network = any(o.startswith("network=") for o in CASES[case].overrides)
    assert (simulated_time is not None) == has_network, case
    assert all((value is not None) == has_network for value in strategy_time), case
    if has_network:
        for worker, (simulated, expected) in enumerate(zip(simulated_time, strategy_time)):
            assert simulated == pytest.approx(expected, rel=1e-9, abs=0.0), f"{case}: worker {worker}"
            assert expected > STEPS * 0.5  # the presets' 0.5 s steps, and some communication
