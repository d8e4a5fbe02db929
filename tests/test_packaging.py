"""A plain (non-editable) install runs the apps from any folder: the wheel carries conf/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_runs_gasloc_train_outside_the_checkout(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   capture_output=True, timeout=240)
    (wheel,) = wheels.glob("gasloc_lightning-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    # The installed copy comes first on the path; the editable checkout's finder only answers after it.
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import gasloc_lightning.app.config as c; print(c.config_dir())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(target)
    job = subprocess.run([sys.executable, "-m", "gasloc_lightning.train", "--cfg", "job", "experiment=demo"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "inner_steps: 5" in job.stdout and "_target_: gasloc_lightning.GASLoCStrategy" in job.stdout
