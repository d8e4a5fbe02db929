"""No silent split (issue 32): a majority quorum by default, a split quorum only by name, and a run that ends on
two models says so.

- the rule (:mod:`gasloc_lightning.comm.quorum_floor`): ``min_workers`` defaults to a majority of ``max_workers``; a
  smaller one is refused naming ``allow_split_quorum``, and accepted with it, with a warning that names the risk;
- the same rule in ``ElasticGASLoCStrategy``/``ElasticDiLoCoStrategy`` and in ``gasloc-elastic``'s config (which
  says what quorum it uses, and passes the opt-out on to its workers);
- the split report: finished workers grouped by checksum, each group named, and a merge command;
- ``gasloc-elastic`` end to end with stand-in workers (no torch in them: they write what a worker writes at its end,
  two models between them): the launcher exits 3 naming both groups, and its printed ``gasloc-export`` command runs
  and writes the average of the two models.
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from hydra import compose, initialize_config_dir  # noqa: E402

from app_utils import CONF, clean_env  # noqa: E402
from gasloc_lightning.app import elastic as elastic_app  # noqa: E402
from gasloc_lightning.app.elastic import check_elastic, min_workers_of, quorum_lines, worker_config  # noqa: E402
from gasloc_lightning.app.split import SPLIT_EXIT_CODE, merge_command, model_groups, split_report  # noqa: E402
from gasloc_lightning.comm.quorum_floor import SplitQuorumWarning, majority, quorum_floor  # noqa: E402
from gasloc_lightning.comm.membership import lighthouse_reachable  # noqa: E402
from gasloc_lightning.plugins.per_rank_io import PerRankCheckpointIO  # noqa: E402
from gasloc_lightning.strategies.elastic import ElasticDiLoCoStrategy, ElasticGASLoCStrategy  # noqa: E402

HOST = "127.0.0.1"


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize(("workers", "floor"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (8, 5)])
def test_the_default_floor_is_a_majority_that_two_sides_cannot_both_hold(workers, floor):
    assert majority(workers) == floor
    assert quorum_floor(None, workers, allow_split_quorum=False) == floor
    assert 2 * floor > workers >= 2 * (floor - 1)


def test_a_minority_floor_is_refused_naming_the_opt_out_and_taken_with_it():
    with pytest.raises(ValueError, match=r"elastic.min_workers=2 is not a majority of 4 .*elastic.allow_split_quorum"):
        quorum_floor(2, 4, allow_split_quorum=False, prefix="elastic.")
    assert quorum_floor(2, 4, allow_split_quorum=True) == 2
    assert quorum_floor(4, 4, allow_split_quorum=False) == 4  # above a majority: no question asked
    with pytest.raises(ValueError, match=r"min_workers must be null .* \[1, max_workers=4\], got 5"):
        quorum_floor(5, 4, allow_split_quorum=True)


@pytest.mark.parametrize("strategy_class", [ElasticGASLoCStrategy, ElasticDiLoCoStrategy])
def test_the_strategies_default_to_a_majority_and_take_a_minority_only_by_name_with_a_warning(strategy_class):
    settings = {"lighthouse": f"{HOST}:29510", "worker_id": 0, "max_workers": 4, "secret": "s" * 16}
    assert strategy_class(**settings).min_workers == 3
    with pytest.raises(ValueError, match=r"min_workers=2 is not a majority of 4 .*allow_split_quorum"):
        strategy_class(**settings, min_workers=2)
    with pytest.warns(SplitQuorumWarning, match=r"two models"):
        assert strategy_class(**settings, min_workers=2, allow_split_quorum=True).min_workers == 2


# ------------------------------------------------------------------ gasloc-elastic's config
def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="elastic/app", overrides=["experiment=demo", *overrides,
                                                             "output_dir=/nonexistent"])


def test_gasloc_elastic_uses_a_majority_of_its_workers_says_so_and_its_workers_get_it():
    cfg = _compose(["elastic.workers=4"])
    check_elastic(cfg)
    assert min_workers_of(cfg.elastic) == 3
    assert quorum_lines(cfg.elastic) == ["quorum: min_workers=3, a majority of 4 workers (one side of a partition "
                                         "trains, the other waits)"]
    strategy = worker_config(cfg, 1, f"{HOST}:9", "/nonexistent/worker_1").strategy
    assert (strategy.min_workers, strategy.max_workers, strategy.allow_split_quorum) == (3, 4, False)
    assert min_workers_of(_compose(["elastic.workers=4", "elastic.max_workers=6"]).elastic) == 4


def test_gasloc_elastic_refuses_a_minority_quorum_naming_the_opt_out_and_warns_with_it():
    with pytest.raises(ValueError, match=r"elastic.min_workers=2 is not a majority of 4 workers .*"
                                         r"pass elastic.allow_split_quorum=true"):
        check_elastic(_compose(["elastic.workers=4", "elastic.min_workers=2"]))
    cfg = _compose(["elastic.workers=4", "elastic.min_workers=2", "elastic.allow_split_quorum=true"])
    check_elastic(cfg)
    warning, line = quorum_lines(cfg.elastic)
    assert warning.startswith("warning: elastic.min_workers=2 is not a majority of 4 workers")
    assert "two models" in warning
    assert line == "quorum: min_workers=2, NOT a majority of 4 workers"
    strategy = worker_config(cfg, 0, f"{HOST}:9", "/nonexistent/worker_0").strategy
    assert (strategy.min_workers, strategy.allow_split_quorum) == (2, True)
    with pytest.raises(ValueError, match=r"elastic.min_workers=4 \(a majority of elastic.max_workers=6\) exceeds "
                                         r"elastic.workers=3"):
        check_elastic(_compose(["elastic.workers=3", "elastic.max_workers=6"]))


# ------------------------------------------------------------------ the split report
def _row(worker: int, checksum: float | None, status: str = "finished", loss: float = 3.0) -> dict:
    return {"worker": worker, "status": status, "model_checksum": checksum, "val_loss": loss,
            "final_checkpoint": f"/run/worker_{worker}/checkpoints/final"}


def test_finished_workers_are_grouped_by_their_model_and_two_groups_are_reported_with_a_merge_command():
    rows = [_row(0, 1.5, loss=2.5), _row(1, 1.5), _row(2, -7.25, loss=2.75), _row(3, 1.5),
            _row(4, 9.0, status="stopped")]
    groups = model_groups(rows)
    assert [(g.workers, g.checksum, g.val_loss) for g in groups] == [((0, 1, 3), 1.5, 2.5), ((2,), -7.25, 2.75)]
    report = split_report(groups, "/run")
    assert "the run ended on 2 models" in report
    assert "model 0: workers [0, 1, 3] checksum 1.5 val_loss 2.5000" in report
    assert "model 1: workers [2] checksum -7.25 val_loss 2.7500" in report
    assert ("gasloc-export /run/worker_0/checkpoints/final /run/worker_2/checkpoints/final /run/merged.ckpt"
            in report)
    assert len(model_groups([_row(0, 1.5), _row(1, 1.5), _row(2, 4.0, status="left")])) == 1
    no_checkpoint = model_groups([_row(0, 1.0), {**_row(1, 2.0), "final_checkpoint": None}])
    assert merge_command(no_checkpoint, "/run/merged.ckpt") is None
    assert "nothing to merge" in split_report(no_checkpoint, "/run")


# ------------------------------------------------------------------ the launcher, end to end (stand-in workers)
_STAND_IN = """
import json, os, pathlib, sys, time
folder, checksum, checkpoint = pathlib.Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
# Training before the barrier is released: a stand-in that had not yet written its progress when another one
# finished was stopped as having arrived after the run ended (seen once beside a busy loop: a model named with
# one worker, not two).
(folder / "progress.json").write_text(json.dumps({"pid": os.getpid(), "state": "running", "step": 0}))
hold = os.environ.get("GASLOC_ELASTIC_HOLD_FILE")
if hold:  # the launcher's start barrier, as a real worker takes it
    pathlib.Path(hold + ".ready").touch()
    while not os.path.exists(hold):
        time.sleep(0.02)
loss = 4.0 + checksum
(folder / "summary.json").write_text(json.dumps({"final": {"val_loss": loss, "step": 10}}))
(folder / "progress.json").write_text(json.dumps({
    "pid": os.getpid(), "state": "done", "step": 10, "applied": 10, "first_step": 0, "quorum_size": 2,
    "failed_exchanges": 0, "failed_collectives": 0, "val_loss": loss, "model_checksum": checksum,
    "final_checkpoint": checkpoint}))
"""


class _StandInWorkers:
    """Runs the launcher's lighthouse as it is, and a stand-in for every worker: workers 0-1 end on one model,
    2-3 on another (``checkpoints[i]``: model i's final checkpoint)."""

    def __init__(self, script: Path, checkpoints: list[Path]) -> None:
        self.script, self.checkpoints = script, checkpoints

    def lighthouse_command(self, command: list[str]) -> list[str]:
        return command

    def worker_command(self, command: list[str], worker: int) -> list[str]:
        model = worker // 2
        folder = Path(command[3]).parent  # [python, -m, module, <worker folder>/worker_config.yaml, ...]
        return [sys.executable, str(self.script), str(folder), str(float(model + 1)), str(self.checkpoints[model])]

    def reachable(self, address: str) -> bool:
        return lighthouse_reachable(address, timeout=0.5)


def _final_checkpoint(path: Path, value: float) -> Path:
    """A worker's final checkpoint as the elastic worker writes it (a per-rank directory of one rank)."""
    state = {"layer.weight": torch.full((2, 3), value), "layer.steps": torch.tensor(7)}
    PerRankCheckpointIO().save_checkpoint(
        {"state_dict": state, "global_step": 10, "epoch": 0, "gasloc": {"rank": 0, "world_size": 1, "save_id": "s"}},
        path)
    return path


@pytest.mark.timeout(120)
def test_gasloc_elastic_exits_3_naming_both_models_and_its_merge_command_averages_them(tmp_path, capsys,
                                                                                        monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    checkpoints = [_final_checkpoint(tmp_path / f"model_{m}", value) for m, value in enumerate((1.0, 4.0))]
    cfg = _compose(["elastic.workers=4", "elastic.min_workers=2", "elastic.allow_split_quorum=true",
                    "elastic.timeout_s=90"])
    cfg.output_dir = str(tmp_path / "run")
    monkeypatch.setattr(elastic_app, "run_elastic",
                        functools.partial(elastic_app.run_elastic, placement=_StandInWorkers(script, checkpoints)))
    with pytest.raises(SystemExit) as exit_:
        elastic_app.main(cfg)  # the console entry point, on this config
    assert exit_.value.code == SPLIT_EXIT_CODE
    out, err = capsys.readouterr()
    assert "warning: elastic.min_workers=2 is not a majority of 4 workers" in out
    assert "gasloc-elastic: the run ended on 2 models" in err
    assert "model 0: workers [0, 1] checksum 1.0" in err and "model 1: workers [2, 3] checksum 2.0" in err
    summary = json.loads((tmp_path / "run" / "elastic_summary.json").read_text())
    assert summary["models"] == [{"checksum": 1.0, "workers": [0, 1]}, {"checksum": 2.0, "workers": [2, 3]}]
    assert [row["status"] for row in summary["workers"]] == ["finished"] * 4

    command = shlex.split(err.split("merge them (each model one weight) with: ")[1].splitlines()[0])
    assert command[0] == "gasloc-export"
    subprocess.run([sys.executable, "-m", "gasloc_lightning.app.export", *command[1:]], check=True, env=clean_env(),
                   timeout=60)
    merged = torch.load(tmp_path / "run" / "merged.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(merged["layer.weight"], torch.full((2, 3), 2.5))  # (1 + 4) / 2: one weight per model
    assert int(merged["layer.steps"]) == 7



def test_gasloc_netlab_exits_3_on_a_split_naming_the_groups(monkeypatch, capsys):
    """``gasloc-netlab``'s elastic path raises the same split (``raise_if_split`` after its table); its entry point
    turns it into exit 3, not the 1 of a failed worker."""
    from gasloc_lightning.app import netlab as netlab_app
    from gasloc_lightning.app.split import SplitRunError

    groups = model_groups([_row(0, 1.0), _row(1, 1.0), _row(2, 2.0), _row(3, 2.0)])

    def split(cfg):
        raise SplitRunError(split_report(groups, "/run"), groups)

    monkeypatch.setattr(netlab_app, "run_netlab", split)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="netlab/app", overrides=["experiment=demo", "network=two_clusters"])
    with pytest.raises(SystemExit) as exit_:
        netlab_app.main(cfg)
    assert exit_.value.code == SPLIT_EXIT_CODE
    err = capsys.readouterr().err
    assert "gasloc-netlab: the run ended on 2 models" in err and "workers [2, 3]" in err and "gasloc-export" in err


def test_gasloc_export_gives_each_directory_one_weight_whatever_its_replicas(tmp_path):
    """A directory of 2 replicas (0 and 2: its model is 1) and one of 1 replica (4): the merge is (1 + 4) / 2."""
    from gasloc_lightning.app.export import main as export_main

    io = PerRankCheckpointIO()
    for rank, value in enumerate((0.0, 2.0)):
        state = {"layer.weight": torch.full((2, 3), value), "layer.steps": torch.tensor(7)}
        io.save_checkpoint({"state_dict": state, "global_step": 4, "epoch": 0,
                            "gasloc": {"rank": rank, "world_size": 2, "save_id": "two"}}, tmp_path / "two")
    _final_checkpoint(tmp_path / "one", 4.0)
    assert export_main([str(tmp_path / "two"), str(tmp_path / "one"), str(tmp_path / "merged.ckpt")]) == 0
    merged = torch.load(tmp_path / "merged.ckpt", weights_only=True)
    assert torch.equal(merged["state_dict"]["layer.weight"], torch.full((2, 3), 2.5))
    assert merged["gasloc_export"]["replicas"] == 3 and merged["gasloc_export"]["world_size"] == 3
