"""A plain (non-editable) install runs the apps from any folder: the wheel carries conf/ and every
sub-package, and a base install (no extras) runs every console script without a traceback."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# Installed only through an extra: a base install has none of them.
OPTIONAL = ("tensorboard", "transformers", "datasets", "torchft", "nbclient", "nbformat", "ipykernel")


# xdist: one worker builds the wheel (a build writes into the checkout, so two at once would collide).
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """The package's wheel, built from the checkout and installed (without dependencies) into a folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels, target = tmp / "wheels", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   capture_output=True, timeout=240)
    (wheel,) = wheels.glob("gasloc_lightning-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    return target


def _base_closure(site: Path) -> set[str]:
    """Names of the distributions a base install pulls in: the wheel's requirements without extras, transitively."""
    (info,) = site.glob("gasloc_lightning-*.dist-info")
    todo = [Requirement(r) for r in metadata.PathDistribution(info).requires or []]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.distribution(req.name).requires or []]
        except metadata.PackageNotFoundError:
            pass  # not installed here: the scripts below would fail, and say which
    return seen


def _base_site(names: set[str], out: Path) -> Path:
    """A folder of links to exactly those installed distributions (their modules and metadata): a base install."""
    out.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (out / top).exists():
                (out / top).symlink_to(src)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_runs_gasloc_train_outside_the_checkout(wheel_site, tmp_path):
    target, elsewhere = wheel_site, tmp_path / "elsewhere"
    elsewhere.mkdir()
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


@pytest.mark.slow
def test_the_wheel_holds_every_sub_package(wheel_site):
    """`[tool.setuptools] packages` is a list: a sub-package missing from it is missing from every install."""
    def packages(root: Path) -> set[str]:
        return {p.parent.relative_to(root).as_posix() for p in (root / "gasloc_lightning").rglob("__init__.py")}

    missing = packages(ROOT) - packages(wheel_site)
    assert not missing, f"not in the wheel (add them to pyproject.toml's packages): {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_base_install_runs_every_console_script(wheel_site, tmp_path):
    """The wheel plus its dependencies without extras, and nothing else: each console script's --help exits 0
    without a traceback. Matplotlib is in the base install: gasloc-compare's plots are what users come for."""
    names = _base_closure(wheel_site)
    assert "matplotlib" in names, "gasloc-compare's plots need matplotlib in the base dependencies"
    assert not names & set(OPTIONAL), f"optional packages in the base install: {sorted(names & set(OPTIONAL))}"
    base = _base_site(names, tmp_path / "base")
    (info,) = wheel_site.glob("gasloc_lightning-*.dist-info")
    scripts = [ep for ep in metadata.PathDistribution(info).entry_points if ep.group == "console_scripts"]
    assert {"gasloc-train", "gasloc-sim", "gasloc-elastic", "gasloc-compare", "gasloc-demo", "gasloc-export"} <= {
        ep.name for ep in scripts}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # -S: no site-packages of this environment (nor the checkout's editable finder); only the wheel and the base.
    # One interpreter imports the scripts' modules once (torch and Lightning are the slow part), then forks a
    # child per script whose output goes to its own file.
    driver = f"""
import importlib, os, site, sys
site.addsitedir({str(wheel_site)!r}); site.addsitedir({str(base)!r})
scripts = {[(ep.name, ep.module, ep.attr) for ep in scripts]!r}
for name, module, attr in scripts:
    try:
        importlib.import_module(module)
    except BaseException:
        pass  # the child imports it again and reports the traceback
for name, module, attr in scripts:
    pid = os.fork()
    if pid == 0:
        fd = os.open(name + '.out', os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1); os.dup2(fd, 2)
        code = 1
        try:
            sys.argv = [name, '--help']
            code = getattr(importlib.import_module(module), attr)()
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback; traceback.print_exc()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))
    print(name, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
    run = subprocess.run([sys.executable, "-S", "-c", driver], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    codes = dict(line.split() for line in run.stdout.splitlines() if line.strip())
    failures = []
    for ep in scripts:
        out = (elsewhere / f"{ep.name}.out").read_text()
        if codes.get(ep.name) != "0" or "Traceback" in out:
            failures.append(f"{ep.name} --help: exit {codes.get(ep.name)}\n{out[-2000:]}")
        else:
            assert "usage" in out.lower() or "help" in out.lower(), f"{ep.name} --help printed no help:\n{out}"
    assert not failures, "\n\n".join(failures)
