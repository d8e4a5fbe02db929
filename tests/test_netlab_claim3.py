"""``python -m gasloc_lightning.netlab.claim3``: it says which run of how many is going, its ETA and what is
recorded, and a second session resumes from the runs the first one recorded (on stand-in runs: no lab)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gasloc_lightning.netlab import claim3


def _stand_in(ran: list[str], fail_at: int | None = None):
    """A ``gasloc-netlab`` in the run's place: writes the run's metrics.csv (loss falling with the step); the run
    number ``fail_at`` is interrupted (Ctrl-C) instead."""
    def run(command: list[str], log_file) -> int:
        if fail_at is not None and len(ran) == fail_at:
            raise KeyboardInterrupt
        folder = Path(next(arg for arg in command if arg.startswith("output_dir=")).split("=", 1)[1])
        steps = int(next(arg for arg in command if arg.startswith("trainer.max_steps=")).split("=", 1)[1])
        ran.append(folder.name)
        rows = ["step,progress/wall_time_s,val/loss"]
        rows += [f"{s},{s * 0.5},{5.0 - 0.01 * s}" for s in range(10, steps + 1, 10)]
        (folder / "csv").mkdir(parents=True)
        (folder / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
        return 0
    return run


def test_claim3_prints_which_run_of_how_many_and_resumes_from_what_is_recorded(tmp_path, monkeypatch, capsys):
    argv = ["--seeds", "0", "--steps", "20", "--methods", "diloco", "gasloc one_peer+overlap",
            "streaming diloco (F=4, overlap, int4)", "--out", str(tmp_path)]
    ran: list[str] = []
    monkeypatch.setattr(claim3, "_run_to_the_end", _stand_in(ran, fail_at=2))
    with pytest.raises(KeyboardInterrupt):  # the third run is interrupted
        claim3.main(argv)
    first = capsys.readouterr().out
    assert "run 1 of 3 (0 done): seed 0 diloco" in first and "| ETA -" in first
    assert "run 3 of 3 (2 done): seed 0 streaming diloco (F=4, overlap, int4)" in first  # ETA from the two done
    assert ran == ["diloco", "gasloc_one_peer"]

    ran.clear()
    monkeypatch.setattr(claim3, "_run_to_the_end", _stand_in(ran))
    claim3.main(argv)
    second = capsys.readouterr().out
    assert ran == ["streaming"], "the recorded runs ran again"
    assert "seed 0 diloco: recorded in" in second and "run 3 of 3 (2 done)" in second
    results = json.loads((tmp_path / "claim3.json").read_text())
    assert [r["method"] for r in results] == ["diloco", "gasloc one_peer+overlap",
                                              "streaming diloco (F=4, overlap, int4)"]
    assert results[0]["ratio"] == 1.0


def test_a_record_of_other_settings_is_not_read_back(tmp_path, monkeypatch):
    ran: list[str] = []
    monkeypatch.setattr(claim3, "_run_to_the_end", _stand_in(ran))
    claim3.main(["--seeds", "0", "--steps", "20", "--methods", "diloco", "--out", str(tmp_path)])
    (tmp_path / "seed0" / "diloco" / "csv" / "metrics.csv").unlink()
    (tmp_path / "seed0" / "diloco" / "csv").rmdir()
    claim3.main(["--seeds", "0", "--steps", "30", "--methods", "diloco", "--out", str(tmp_path)])
    assert ran == ["diloco", "diloco"], "a run of 20 steps was read back for 30"


def test_a_run_recorded_under_another_spelling_of_the_same_folder_is_still_recorded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = Path("runs")
    command = claim3.run_command("diloco", 0, 20, 1.0, relative)
    folder = claim3.run_folder(relative, "diloco", 0)
    folder.mkdir(parents=True)
    (folder / claim3.RECORD_FILE).write_text(json.dumps({"command": command[1:], "curve": [[1, 0.5, 3.0]]}))
    absolute = tmp_path / "runs"  # the same folder, named absolutely by a later session
    assert claim3.recorded(claim3.run_folder(absolute, "diloco", 0),
                           claim3.run_command("diloco", 0, 20, 1.0, absolute)) == [(1, 0.5, 3.0)]


@pytest.mark.parametrize("name", list(claim3.METHODS))
def test_every_method_composes_in_the_lab_and_the_two_level_ones_take_the_sites_as_regions(name):
    """Each method's command composes as gasloc-netlab composes it (train mode, two_clusters), and a two-level one
    gets the lab's sites as its regions (its region means inside a site, its crossings on the shaped link)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import gasloc_lightning.app.netlab as netlab_app
    from app_utils import CONF
    from gasloc_lightning.netlab import plan_lab

    overrides = [*claim3.BASE, *claim3.METHODS[name][1], "seed=0", "trainer.max_steps=10"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="netlab/app", overrides=overrides)
    plan = plan_lab(instantiate(cfg.network), workers=8, bandwidth_scale=0.002)
    regions = netlab_app.region_overrides(cfg, plan, overrides)
    assert bool(regions) == ("topology=two_level" in overrides or "topology=hierarchical" in overrides)
    if regions:
        assert regions == ["topology.regions=[0,0,0,0,1,1,1,1]"]
