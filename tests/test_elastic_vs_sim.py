"""One churn schedule through both engines: elastic mode (real worker processes, a real torchft lighthouse, the
gasloc-elastic launcher) and the simulator, which replays the membership the elastic run recorded.

Worker 3 of 4 leaves with notice (SIGTERM: it finishes its round and leaves), then comes back as a fresh process
that takes a live peer's state; when it comes back depends on the machine (process start, the lighthouse's
quorum), so the simulator does not guess it: it replays the quorums the elastic run recorded
(``sim.live_by_round``). With the same membership, data shards, initial weights and the same round (GASLoC over
the complete graph, the engine of the elastic DiLoCo), both must end on the same validation loss: the simulator's
down worker computes nothing and draws no data, its joiner restarts its sampler and takes the peer's point,
outer state and optimizer state, as the elastic worker does.
"""

from __future__ import annotations


import pytest

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402

from app_utils import CONF, shared_cache_dir  # noqa: E402
from gasloc_lightning.app import sim as sim_app  # noqa: E402
from gasloc_lightning.app.elastic import run_elastic  # noqa: E402
from gasloc_lightning.data import ByteDataModule  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

H, STEPS, WORKERS = 5, 150, 4  # the term waits for the restart's spare to be built: it rejoins within a few rounds
COMMON = ["model=tiny", "data=stdlib", "trainer=cpu", f"inner_steps={H}", f"trainer.max_steps={STEPS}",
          f"trainer.val_check_interval={STEPS}", "data.batch_size=4", "data.val_batches=1", "strategy=gasloc",
          "topology=complete", "strategy.consensus_every=0"]
ELASTIC = ["trainer.enable_progress_bar=false", "callbacks.lr_monitor=null", f"elastic.workers={WORKERS}",
           "elastic.min_workers=2", "elastic.allow_split_quorum=true", "elastic.heartbeat_timeout_ms=1500",
           "elastic.join_timeout_ms=5000",
           "elastic.gossip_timeout=3", "elastic.quorum_timeout=20", "elastic.timeout_s=240", "elastic.method=gasloc",
           "elastic.chaos=[term:3@10,restart:3@30]"]


def live_by_round(rows: list[dict], rounds: int) -> list[list[int]]:
    """The members of every round from the launcher's record: worker w is in round r when one of its incarnations
    joined at or before the round's first step and left after it."""
    members = []
    for r in range(rounds):
        start = r * H
        members.append([row["worker"] for row in rows
                        if any(joined is not None and joined <= start < left
                               for joined, left in zip(row["joined"], row["left"]))])
    return members


@pytest.mark.timeout(420)
def test_the_same_churn_through_elastic_mode_and_the_simulator_ends_on_the_same_loss(tmp_path_factory):
    cache = shared_cache_dir(tmp_path_factory)
    ByteDataModule(source="stdlib", block_size=64, cache_dir=cache).prepare_data()
    out = tmp_path_factory.mktemp("elastic")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="elastic/app",
                      overrides=[*COMMON, *ELASTIC, f"output_dir={out}", f"cache_dir={cache}"])
    summary = run_elastic(cfg)
    rows = sorted(summary["workers"], key=lambda row: row["worker"])
    assert all(row["exit_code"] == 0 and row["final_step"] == STEPS for row in rows), rows
    assert rows[3]["incarnations"] == 2 and rows[3]["joined"][1] is not None, "worker 3 never came back"
    membership = live_by_round(rows, STEPS // H)
    assert [3 in live for live in membership].count(False) >= 2, membership  # it was away for some rounds
    assert membership[-1] == [0, 1, 2, 3], membership
    elastic_loss = rows[0]["val_loss"]
    assert len({row["val_loss"] for row in rows}) == 1  # one consensus

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sim_cfg = compose(config_name="sim/app", overrides=[
            *COMMON, f"sim.workers={WORKERS}", "sim.shared_validation=true", "sim.progress_every=0",
            f"sim.live_by_round={membership}".replace(" ", ""), f"cache_dir={cache}",
            f"output_dir={tmp_path_factory.mktemp('sim')}"])
    simulator, parts = sim_app.build(sim_cfg)
    result = simulator.run()
    sim_loss = result["final"]["val/loss"]
    assert result["joins"] == 1 and parts["churn"].live_sizes() == [3, 4]
    print(f"membership={membership} elastic_loss={elastic_loss} sim_loss={sim_loss} "
          f"relative_gap={abs(sim_loss / elastic_loss - 1):.2e}")
    assert abs(sim_loss / elastic_loss - 1) < 0.005, (sim_loss, elastic_loss)
