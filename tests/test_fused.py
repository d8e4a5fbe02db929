"""The fused round (``algorithm/fused.py``): eager and compiled kernels against OuterState.message / mix / finish.

The compiled tests share one compiled graph per function (one thread count, one module fixture): the first
run on a machine pays inductor's cold compile (20-40 s on 2 cores), later runs hit its disk cache.
"""

from __future__ import annotations

import logging
import os

import lightning.pytorch as pl
import pytest
import torch

from dist_utils import PoisonOneBatch, RecordParameters, TinyRegressor, load_ranks
from gasloc_lightning import GASLoCStrategy
from gasloc_lightning.algorithm import fused
from gasloc_lightning.algorithm.outer import OuterState, mix

# One thread count for the whole module: dynamo guards on it, a change recompiles.
# xdist: one worker compiles the kernels once for the module.
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread"), pytest.mark.xdist_group("fused")]

ETA, GAMMA, WEIGHT = 0.7, 0.5, 0.5


def vectors(numel: int, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    names = ("local_end", "round_start", "anchor", "received")
    return {name: torch.randn(numel, generator=generator).to(device) for name in names}


def todays_round(v: dict, eta: float, gamma: float, weight: float) -> tuple[torch.Tensor, ...]:
    """The reference: OuterState.message, mix, OuterState.finish and the copy back, as round.py runs them."""
    outer = OuterState(v["round_start"], eta, gamma)
    outer.anchor.copy_(v["anchor"])
    point = v["local_end"].clone()
    outer.message(point)
    mix(point, [(weight, v["received"])], out=outer.mixed_destination())
    point.copy_(outer.finish(point, outer.mixed_destination()))
    return point, outer.round_start, outer.anchor


def fused_round(v: dict, eta: float, gamma: float, weight: float, compiled: bool) -> tuple[bool, tuple]:
    point, round_start, anchor = v["local_end"].clone(), v["round_start"].clone(), v["anchor"].clone()
    finite = fused.fused_message(point, round_start, anchor, eta, gamma, compiled=compiled)
    fused.fused_pair_finish(point, v["received"], weight, round_start, anchor, gamma, compiled=compiled)
    return finite, (point, round_start, anchor)


def relative_difference(result: tuple, reference: tuple) -> float:
    """max |result - reference| / max |reference| over the point, the round start and the anchor."""
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(result, reference))


def child_processes() -> set[int]:
    me = str(os.getpid())
    children = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]  # after "pid (comm)": state, ppid
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if parent == me:
            children.add(int(entry))
    return children


@pytest.fixture(scope="module")
def compiled_kernels(one_torch_thread):
    """Compile both kernels once (skip when torch.compile does not work here); the child processes before."""
    before = child_processes() if os.path.isdir("/proc") else set()
    if not fused.warm_up("cpu"):
        pytest.skip("torch.compile (inductor) does not work on this machine: the fused round runs eagerly")
    return before


@pytest.mark.parametrize("numel", [1, 2, 7, 4099])
def test_eager_is_todays_round_bit_for_bit(numel):
    v = vectors(numel, seed=numel)
    finite, result = fused_round(v, ETA, GAMMA, WEIGHT, compiled=False)
    assert finite
    for got, expected in zip(result, todays_round(v, ETA, GAMMA, WEIGHT)):
        assert torch.equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("numel", "eta", "gamma", "weight"),  # 1 element runs eagerly (dynamo specializes it)
                         [(1, 0.7, 0.5, 0.5), (2, 1.0, 0.0, 0.25), (7, 0.3, 0.9, 0.75), (65_537, 1.3, 0.6, 0.5)])
def test_compiled_matches_todays_round(compiled_kernels, numel, eta, gamma, weight):
    v = vectors(numel, seed=numel)
    finite, result = fused_round(v, eta, gamma, weight, compiled=True)
    assert finite
    assert relative_difference(result, todays_round(v, eta, gamma, weight)) <= 1e-6


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_local_point_is_reported(request, compiled, bad):
    if compiled:
        request.getfixturevalue("compiled_kernels")
    v = vectors(4099)
    v["local_end"][1234] = bad
    finite, _ = fused_round(v, ETA, GAMMA, WEIGHT, compiled=compiled)
    assert not finite


@pytest.mark.slow
def test_new_scalars_and_sizes_reuse_the_compiled_graphs(compiled_kernels):
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for numel, eta, gamma, weight in [(10_001, 0.2, 0.8, 0.3), (33, 1.1, 0.0, 1.0)]:
        v = vectors(numel, seed=numel)
        _, result = fused_round(v, eta, gamma, weight, compiled=True)
        assert relative_difference(result, todays_round(v, eta, gamma, weight)) <= 1e-6
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="lists child processes through /proc")
def test_compiling_leaves_no_child_process(compiled_kernels):
    assert child_processes() <= compiled_kernels


def test_enabled_by_size_and_environment(monkeypatch):
    monkeypatch.delenv(fused.FUSED_ROUND_ENV, raising=False)
    assert not fused.enabled(fused.MIN_COMPILED_NUMEL - 1)
    compiler_works = fused.enabled(fused.MIN_COMPILED_NUMEL)
    assert not fused.enabled(10 * fused.MIN_COMPILED_NUMEL, device="cuda")  # eager is faster there
    monkeypatch.setenv(fused.FUSED_ROUND_ENV, "1")
    assert fused.enabled(2) == compiler_works
    assert fused.enabled(2, device="cuda") == compiler_works
    assert not fused.enabled(1)  # dynamo specializes sizes 0 and 1: those always run eagerly
    monkeypatch.setenv(fused.FUSED_ROUND_ENV, "0")
    assert not fused.enabled(10 * fused.MIN_COMPILED_NUMEL)
    monkeypatch.setenv(fused.FUSED_ROUND_ENV, "yes")
    with pytest.raises(ValueError, match=fused.FUSED_ROUND_ENV):
        fused.enabled(2)


def test_a_compile_failure_warns_once_and_stays_eager(monkeypatch, caplog):
    def no_compiler(kernel, **options):
        def fail(*args):
            raise RuntimeError("no C++ compiler")
        return fail

    # A fresh process state (the private seam), so the real compiled kernels of other tests are untouched.
    monkeypatch.setattr(fused, "_STATE", fused._CompileState())
    monkeypatch.delenv(fused.FUSED_ROUND_ENV, raising=False)
    if not fused.enabled(fused.MIN_COMPILED_NUMEL):
        pytest.skip("no torch.compile here: nothing to fall back from")
    monkeypatch.setattr(torch, "compile", no_compiler)
    v = vectors(513)
    with caplog.at_level(logging.WARNING, logger=fused.__name__):
        for _ in range(2):
            finite, result = fused_round(v, ETA, GAMMA, WEIGHT, compiled=True)
    assert finite
    assert all(torch.equal(a, b) for a, b in zip(result, todays_round(v, ETA, GAMMA, WEIGHT)))
    assert len(caplog.records) == 1 and "torch.compile failed" in caplog.records[0].getMessage()
    assert not fused.enabled(10 * fused.MIN_COMPILED_NUMEL)
    assert not fused.warm_up()


def test_arguments_are_checked():
    v = vectors(8)
    with pytest.raises(ValueError, match="anchor"):
        fused.fused_message(v["local_end"], v["round_start"], v["anchor"][:4], ETA, GAMMA)
    with pytest.raises(ValueError, match="received"):
        fused.fused_pair_finish(v["local_end"], v["received"].double(), WEIGHT, v["round_start"], v["anchor"], GAMMA)
    with pytest.raises(ValueError, match="weight"):
        fused.fused_pair_finish(v["local_end"], v["received"], 1.5, v["round_start"], v["anchor"], GAMMA)
    with pytest.raises(ValueError, match="outer_momentum"):
        fused.fused_message(v["local_end"], v["round_start"], v["anchor"], ETA, 1.0)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_matches_todays_round_on_cuda():
    v = vectors(1_000_003, device="cuda")
    finite, result = fused_round(v, ETA, GAMMA, WEIGHT, compiled=True)
    assert finite
    assert relative_difference(result, todays_round(v, ETA, GAMMA, WEIGHT)) <= 1e-6
    v["local_end"][17] = float("nan")
    assert not fused_round(v, ETA, GAMMA, WEIGHT, compiled=True)[0]


# ---------------------------------------------------------------------- in the strategy, on real gloo ranks
class _RecordFused(pl.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save({"fused": trainer.strategy.fused_round}, os.path.join(self.out, f"fused{trainer.global_rank}.pt"))


def _fit_two_ranks(tmp_path, fresh_port, monkeypatch, forced: str, model) -> list[dict]:
    monkeypatch.setenv(fused.FUSED_ROUND_ENV, forced)  # the forked ranks read it when their round is built
    fresh_port()
    out = tmp_path / f"fused_{forced}"
    out.mkdir()
    strategy = GASLoCStrategy(inner_steps=3, start_method="fork", gossip_timeout=120.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[RecordParameters(str(out)), _RecordFused(str(out))])
    trainer.fit(model)
    records = load_ranks(out, 2)
    for rank, record in enumerate(records):
        record["fused"] = torch.load(out / f"fused{rank}.pt")["fused"]
    return records


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_strategy_with_fused_rounds_follows_the_eager_strategy(tmp_path, fresh_port, monkeypatch, one_torch_thread):
    if not fused.enabled(fused.MIN_COMPILED_NUMEL):
        pytest.skip("no torch.compile here")
    eager = _fit_two_ranks(tmp_path, fresh_port, monkeypatch, "0", TinyRegressor())
    compiled = _fit_two_ranks(tmp_path, fresh_port, monkeypatch, "1", TinyRegressor())
    for a, b in zip(eager, compiled):
        assert not a["fused"] and b["fused"]
        assert (a["final"] - b["final"]).norm() <= 1e-5 * a["final"].norm()
        assert (a["final"] - a["history"][0]).norm() > 1e-3  # it trained


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_non_finite_point_discards_the_round_with_fused_rounds(tmp_path, fresh_port, monkeypatch, one_torch_thread):
    """The fused message checks finiteness in its own pass; the guard still restores the round start and the
    worker still sends (no peer waits), as on the eager path (test_reliability)."""
    if not fused.enabled(fused.MIN_COMPILED_NUMEL):
        pytest.skip("no torch.compile here")
    records = _fit_two_ranks(tmp_path, fresh_port, monkeypatch, "1", PoisonOneBatch(poison_steps=(4,)))
    assert all(record["fused"] for record in records)
    assert not torch.isfinite(records[1]["history"][5]).all()  # poisoned after step 5
    assert all(torch.isfinite(record["after_fit"]).all() for record in records)
    assert all(record["rounds_at_fit_end"] == 3 for record in records)
