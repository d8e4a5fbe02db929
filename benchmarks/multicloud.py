"""Across clouds, which method reaches the loss first? Every scenario, at n workers, in simulated time.

For each scenario (a network preset scaled to n workers) and each method, on equal steps:

- **Methods.** ``ddp`` (modelled in the simulator as parameter averaging after every step: DiLoCo with
  H = 1, eta = 1, gamma = 0, the same bytes per step as DDP's gradient all-reduce), ``diloco`` (plain),
  ``streaming_diloco`` (4 fragments, overlap, int4 pseudo-gradients), and GASLoC's best forms:
  ``gasloc_one_peer`` (overlap), ``gasloc_bw_spread`` (bandwidth-aware spread schedule, overlap),
  ``gasloc_compressed`` (one_peer, overlap, int8 or int4 messages) and ``gasloc_streamed`` (one_peer,
  4 fragments, each exchange under one step of compute). Across regions (issue 31): ``hierarchical`` (hierarchical
  DiLoCo: an exact mean inside each region every round, and across regions every K rounds, waited, delayed or
  through torchft's int4 quantized all-reduce), ``sparseloco`` (top-k 1% at 2 bits with error feedback) and
  ``two_level`` (two-level GASLoC: the delayed, int4, shard-parallel gossip between regions).
- **The DiLoCo family** (plain, Streaming, hierarchical, SparseLoCo): each held-out seed also gives every method's
  time over the fastest family member's on that seed (``family_ratios``), the ratio issue 31's map is made of.
- **Protocol.** Each method's outer step (eta, gamma) and, where it has a choice, its codec are tuned
  on the tuning seed (0) by the metric below; the chosen configuration then runs on the held-out seeds
  (1 and 2), and only those are reported.
- **Metric.** Every method runs ``1.5 x steps`` steps and validates every round. The target is plain
  DiLoCo's validation loss at ``steps`` on the same seed; a method's time is the simulated time of its
  first validation at or below the target, reported as a ratio to plain DiLoCo's time (< 1: faster;
  None: never reached). Goodput (useful compute / wall time) comes from the simulator.
- **One run, several clocks.** Where a scenario changes only the clock (two_clusters, cloud_mix, many_sites,
  jitter), each configuration and seed runs once, timed on every such scenario (``sim.also_networks``);
  preemption (churn) and the bandwidth-aware schedule (drawn from the clusters) run per scenario. Under
  preemption GASLoC's overlapped forms run without overlap (the simulator refuses overlap with churn).
- **H in the grid.** ``--inner-steps-grid 10 20 50`` crosses every method's grid with those H (labels ``H=20,...``);
  each run validates at its own round ends (every H steps: a consensus evaluation is a collective, so no method
  is charged one mid-round). Without it every method runs ``--inner-steps``.
- **Regions.** Scenarios that differ only by the clock share runs; two-level methods (their regions come from
  the network's sites) share them only between scenarios of one site layout (``SITE_LAYOUT``: two_clusters at
  10 Gbit/s, 1 Gbit/s and 100 Mbit/s share; many_sites' three bandwidths share).
- **Large n.** ``--tuned-from 64`` skips the tuning and runs the held-out seeds with the configurations
  chosen at 64 workers (the tables say so); ``--methods`` runs a subset (plain DiLoCo, the reference, always
  runs; the tables name the methods left out).

Usage::

    python benchmarks/multicloud.py --workers 8 --out docs/multicloud
    python benchmarks/multicloud.py --workers 64 --scenarios two_clusters jitter --out docs/multicloud
    python benchmarks/multicloud.py --workers 256 --tuned-from 64 --out docs/multicloud
    python benchmarks/multicloud.py --workers 256 --tuned-from 64 --methods diloco streaming_diloco gasloc_streamed
    python benchmarks/multicloud.py --plot --out docs/multicloud     # the figure from the JSON files there
    python benchmarks/multicloud.py --markdown --out docs/multicloud # their tables, as in docs/multicloud.md

Results: ``<out>/multicloud_n<workers>.json`` (one per n, merged by scenario) and ``<out>/multicloud.png``.
Every ``gasloc-sim`` run is kept in ``<out>/runs/n<workers>/`` once it ends, and a rerun reads those back: an
interrupted session resumes where it stopped. Before its first run a session counts the runs it will ask for and
those already recorded; each run then starts with ``run k of N (m done): <name> | ETA h:mm:ss``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sim_runs import SimRunError, run_sim, slug, time_to_reach

from gasloc_lightning.utils.progress import ScriptProgress
from gasloc_lightning.utils.records import write_json_atomically

SCENARIOS = ("two_clusters", "cloud_mix", "many_sites", "jitter", "preemption",
             # issue 31's bandwidth sweep across regions (only the links between sites differ)
             "two_clusters_10g", "two_clusters_100m", "many_sites_fast", "many_sites_slow")
TARGET_STEPS_SHARE = 1.0 / 1.5  # the target is plain DiLoCo's loss at 2/3 of every run's steps


@dataclass(frozen=True)
class Method:
    """A method's fixed overrides and its tuning grid (label -> overrides; empty: nothing to tune)."""

    overrides: tuple[str, ...]
    grid: dict[str, tuple[str, ...]] = field(default_factory=dict)
    inner_steps: int | None = None  # None: the scenario's H


def _outer_grid(points: tuple[tuple[float, float], ...]) -> dict[str, tuple[str, ...]]:
    return {f"eta={eta},gamma={gamma}": (f"strategy.outer_lr={eta}", f"strategy.outer_momentum={gamma}")
            for eta, gamma in points}


_DILOCO_OUTER = _outer_grid(((1.0, 0.3), (0.7, 0.5), (0.7, 0.9)))
_REGION_OUTER = _outer_grid(((0.7, 0.9), (0.7, 0.5)))  # the region step's (DiLoCo's inside a region)
_GASLOC_OUTER = _outer_grid(((0.7, 0.5), (0.7, 0.7), (1.0, 0.3)))
_ONE_PEER = ("strategy=gasloc", "topology=one_peer")


def _codec_grid(outer: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """A compressed method's grid: int8 or int4 messages, each with the first two points of its outer grid. Every
    method with a codec to choose (Streaming DiLoCo's pseudo-gradients, GASLoC's compressed messages) is tuned on
    this same grid."""
    return {f"{codec},{label}": (f"strategy.message_codec={codec}", *overrides)
            for codec in ("int8", "int4") for label, overrides in list(outer.items())[:2]}

METHODS = {
    "ddp": Method(("strategy=diloco", "strategy.outer_lr=1.0", "strategy.outer_momentum=0.0"), inner_steps=1),
    "diloco": Method(("strategy=diloco",), _DILOCO_OUTER),
    "streaming_diloco": Method(("strategy=diloco", "strategy.fragments=4", "strategy.overlap=true"),
                               _codec_grid(_DILOCO_OUTER)),
    "gasloc_one_peer": Method((*_ONE_PEER, "overlap=true"), _GASLOC_OUTER),
    "gasloc_bw_spread": Method(("strategy=gasloc", "topology=bandwidth_aware", "topology.schedule=spread",
                                "overlap=true"), _GASLOC_OUTER),
    "gasloc_compressed": Method((*_ONE_PEER, "overlap=true"), _codec_grid(_GASLOC_OUTER)),
    "gasloc_streamed": Method((*_ONE_PEER, "strategy.fragments=4", "strategy.fragment_sync_delay=1"), _GASLOC_OUTER),
    # hierarchical DiLoCo (strategy=gasloc: gasloc-sim runs the two-level round from the topology): its crossing
    # waited in float32, delayed (beta 0.5), through torchft's int4 quantized all-reduce, or both (DiLoCoX's
    # delayed compressed step); K rounds between crossings
    "hierarchical": Method(("strategy=gasloc", "topology=hierarchical"), {
        f"K={k},{form},{label}": (f"topology.cross_every={k}", *extra, *outer)
        for k in (2, 4, 8) for form, extra in (("f32", ()), ("delayed", ("topology.cross_overlap=true",)),
                                               ("int4", ("topology.cross_codec=int4",)),
                                               ("delayed_int4", ("topology.cross_overlap=true",
                                                                 "topology.cross_codec=int4")))
        for label, outer in list(_REGION_OUTER.items())[:1]}),
    "sparseloco": Method(("strategy=sparseloco",), {f"eta={eta}": (f"strategy.outer_lr={eta}",) for eta in (2.0, 3.0)}),
    # two-level GASLoC: the delayed, shard-parallel gossip between regions (beta 0.5, gamma_g 0), int4 across
    "two_level": Method(("strategy=gasloc", "topology=two_level", "topology.cross_overlap=true"), {
        f"K={k},{codec},{label}": (f"topology.cross_every={k}", f"topology.cross_codec={codec}", *outer)
        for k in (2, 4, 8) for codec in ("int4", "int8") for label, outer in list(_REGION_OUTER.items())[:1]}),
}
DEFAULT_METHODS = ("ddp", "diloco", "streaming_diloco", *("gasloc_one_peer", "gasloc_bw_spread", "gasloc_compressed",
                                                            "gasloc_streamed"))
DILOCO_FAMILY = ("diloco", "streaming_diloco", "hierarchical", "sparseloco")  # issue 31's ratios are to the best
REGION_SHAPED = ("hierarchical", "two_level")  # their regions come from the network's sites
# Which scenarios have the same sites (and so the same regions): two-level runs are shared only within one layout.
SITE_LAYOUT = {"two_clusters": "two_clusters", "two_clusters_10g": "two_clusters", "two_clusters_100m": "two_clusters",
               "many_sites": "many_sites", "many_sites_fast": "many_sites", "many_sites_slow": "many_sites"}


DEFAULT_SCENARIOS = SCENARIOS[:5]  # the bandwidth sweep is asked for by name (issue 31's protocol)
CLOCK_ONLY = ("two_clusters", "cloud_mix", "many_sites", "jitter",  # the network changes only the clock there
              "two_clusters_10g", "two_clusters_100m", "many_sites_fast", "many_sites_slow")
GASLOC_FORMS = ("gasloc_one_peer", "gasloc_bw_spread", "gasloc_compressed", "gasloc_streamed")
NOISY = ("jitter", "preemption")  # their noise or churn follows the run's seed: each held-out seed is a draw
MIN_NOISE_DRAWS = 3
CLUSTER_SHAPED = ("gasloc_bw_spread",)  # its schedule is drawn from the scenario's clusters: one run per scenario


def scenario_overrides(scenario: str) -> list[str]:
    """The ``network=`` preset; every preset scales itself to ``sim.workers`` (clusters and sites in proportion)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    return [f"network={scenario}"]


class SharedRuns:
    """Runs ``gasloc-sim`` once per method, grid point and seed for all the scenarios of ``together`` (those
    where only the clock depends on the network): the first scenario is the run's ``network=``, the others are
    timed alongside (``sim.also_networks``), which gives the same times as running there (tested). Churn
    (preemption) and the cluster-shaped schedule change the training: they run per scenario."""

    def __init__(self, together: tuple[str, ...], folder: Path, work: Path | None = None,
                 progress: ScriptProgress | None = None) -> None:
        self.together, self.folder, self.work = together, folder, work or folder / "work"
        self.progress = progress  # says which run of how many starts, its ETA and what is recorded
        self._runs: dict[tuple[str, ...], dict] = {}

    def recorded(self, overrides: list[str], name: str) -> dict | None:
        """The run kept in ``folder/<name>.json`` if it was run with the same overrides, else None."""
        kept = self.folder / f"{name}.json"
        if kept.is_file():
            run = json.loads(kept.read_text())
            if run.get("overrides") == list(overrides):
                return run
        return None

    def _run_sim(self, overrides: list[str], name: str) -> dict:
        """One ``gasloc-sim`` run, kept in ``folder/<name>.json`` (its summary and traces) once it ends: a run
        found there with the same overrides is read back, not rerun, so an interrupted benchmark resumes."""
        run = self.recorded(overrides, name)
        if run is not None:
            print(f"    {name}: recorded", flush=True)
            return run
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.progress is not None:
            print(f"    {self.progress.start(name)}", flush=True)
        run = run_sim(list(overrides), self.work / name)
        _write(self.folder / f"{name}.json", {**run, "overrides": list(overrides)})
        if self.progress is not None:
            self.progress.done()
        return json.loads((self.folder / f"{name}.json").read_text())  # as read back on a resume: lists, not tuples

    def sharing(self, scenario: str, method: str) -> tuple[str, ...]:
        """The scenarios whose runs of ``method`` are ``scenario``'s: every clock-only one, or for a two-level
        method those of the same site layout; () where it runs alone (churn, the cluster-shaped schedule)."""
        if scenario not in self.together or method in CLUSTER_SHAPED:
            return ()
        if method in REGION_SHAPED:
            layout = SITE_LAYOUT.get(scenario)
            group = tuple(name for name in self.together if layout is not None and SITE_LAYOUT.get(name) == layout)
        else:
            group = self.together
        return group if len(group) > 1 else ()

    def shares(self, scenario: str, method: str) -> bool:
        return bool(self.sharing(scenario, method))

    def run(self, scenario: str, method: str, overrides: list[str], name: str) -> dict:
        """``overrides`` without the network: this scenario's run (its ``trace`` on this scenario's clock)."""
        group = self.sharing(scenario, method)
        if not group:
            return self._run_sim([*overrides, *scenario_overrides(scenario)], slug(f"{scenario}_{name}"))
        key = (group, tuple(overrides))
        if key not in self._runs:
            first, *others = group
            also = f"sim.also_networks=[{','.join(others)}]"
            self._runs[key] = self._run_sim([*overrides, *scenario_overrides(first), also],
                                            slug(f"shared_{'_'.join(group)}_{name}"))
        run = self._runs[key]
        trace = run["trace"] if scenario == group[0] else run["also_traces"][scenario]
        return {**run, "trace": trace}


class PlannedRuns(SharedRuns):
    """Runs nothing: notes every run a session would ask for (name -> overrides), answering with stand-in results
    (every method reaches the target together), so the session's run count is known before its first run."""

    def __init__(self, together: tuple[str, ...], folder: Path) -> None:
        super().__init__(together, folder, folder / "work")
        self.planned: dict[str, list[str]] = {}

    def _run_sim(self, overrides: list[str], name: str) -> dict:
        self.planned.setdefault(name, list(overrides))
        steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=", 1)[1])
        trace = [(1, 1.0, 1.0), (steps, 1.0, float(steps))]
        return {"trace": trace, "also_traces": {name: trace for name in self.together[1:]}, "val_loss": 1.0,
                "goodput": 1.0, "bytes_sent": 0}

    def planned_progress(self) -> ScriptProgress:
        """The session's progress: every planned run, those recorded already counted as done. An estimate where
        real results change what runs (a method a scenario cannot run; which of GASLoC's forms is best)."""
        kept = sum(self.recorded(overrides, name) is not None for name, overrides in self.planned.items())
        return ScriptProgress(total=len(self.planned), recorded=kept)


def grid_edges(labels: list[str], chosen: str) -> list[str]:
    """The hyperparameters of grid point ``chosen`` that sit at an end of the values its grid tried (``labels``:
    ``H=20,K=4,int4,eta=0.7,gamma=0.9``; a numeric ``key=value`` tried at three or more values, so that an inside
    exists): the protocol widens a grid until no chosen point is on an edge, and the tables flag those that still
    are."""
    def numeric(label: str) -> dict[str, float]:
        values = {}
        for part in label.split(","):
            key, _, value = part.partition("=")
            try:
                values[key] = float(value)
            except ValueError:
                continue
        return values

    tried: dict[str, set[float]] = {}
    for label in labels:
        for key, value in numeric(label).items():
            tried.setdefault(key, set()).add(value)
    return [key for key, value in numeric(chosen).items()
            if len(tried.get(key, ())) > 2 and value in (min(tried[key]), max(tried[key]))]


def tuning_key(score: dict) -> tuple[float, float]:
    """The order a method's grid points are chosen by: time to the target (never reached last), then final loss."""
    return (math.inf if score["time_to_target"] is None else score["time_to_target"], score["val_loss"])


class Scenario:
    """One scenario at n workers: tune each of ``methods`` on the tuning seed, then run the held-out seeds.

    Under churn (preemption) the simulator refuses overlap for gossip (a leaving worker's correction in flight
    would have no owner): GASLoC's overlapped forms run without it there."""

    def __init__(self, name: str, workers: int, steps: int, inner_steps: int, runs: SharedRuns,
                 methods: tuple[str, ...] = tuple(METHODS), inner_steps_grid: tuple[int, ...] = (),
                 points: dict[str, tuple[str, ...]] | None = None, batch_size: int | None = None):
        self.name, self.runs, self.inner_steps = name, runs, inner_steps
        self.methods, self.inner_steps_grid = methods, tuple(inner_steps_grid)
        self.points = dict(points or {})  # method -> parts every kept grid label has (``--points``)
        self.steps = 3 * steps // 2
        self.target_step = steps
        batch = [] if batch_size is None else [f"data.batch_size={batch_size}"]  # None: the experiment's
        self.base = [f"sim.workers={workers}", f"trainer.max_steps={self.steps}", *batch,
                     f"trainer.val_check_interval={inner_steps}"]

    def grid(self, method: str) -> dict[str, tuple[str, ...]]:
        """``method``'s grid (label -> overrides; ``{"default": ()}`` without one), crossed with
        ``inner_steps_grid`` (labels ``H=20,...``) unless the method fixes its own H (DDP)."""
        spec = METHODS[method]
        grid = spec.grid or {"default": ()}
        if self.inner_steps_grid and spec.inner_steps is None:
            grid = {f"H={h},{label}" if spec.grid else f"H={h}": (f"inner_steps={h}", *extra)
                    for h in self.inner_steps_grid for label, extra in grid.items()}
        parts = self.points.get(method, ())
        return {label: extra for label, extra in grid.items() if set(parts) <= set(label.split(","))}

    def run(self, method: str, overrides: tuple[str, ...], seed: int, label: str) -> dict:
        spec = METHODS[method]
        fixed = [o for o in spec.overrides if not (self.name == "preemption" and o == "overlap=true")]
        own = [o.split("=", 1)[1] for o in overrides if o.startswith("inner_steps=")]
        if own:  # a grid point's own H: validated at its own round ends (a consensus evaluation is a collective)
            base = [*self.base[:-1], f"trainer.val_check_interval={own[0]}"]
            return self.runs.run(self.name, method, [*base, *fixed, *overrides, f"seed={seed}"],
                                 f"{method}_{label}_seed{seed}")
        inner_steps = f"inner_steps={spec.inner_steps or self.inner_steps}"
        return self.runs.run(self.name, method, [*self.base, inner_steps, *fixed, *overrides, f"seed={seed}"],
                             f"{method}_{label}_seed{seed}")

    def target(self, diloco_run: dict) -> tuple[float, float]:
        """Plain DiLoCo's (loss, simulated time) at the target step: what every method must reach."""
        return loss_at(diloco_run["trace"], self.target_step)

    def score(self, run: dict, target: tuple[float, float]) -> dict:
        reached = time_to_reach(run["trace"], target[0])
        return {"val_loss": run["val_loss"], "goodput": run["goodput"], "bytes_sent": run["bytes_sent"],
                "time_to_target": reached, "ratio": None if reached is None else reached / target[1]}

    def tune(self, seed: int, given: dict[str, dict] | None = None, outer: str | None = None) -> dict[str, dict]:
        """Each method's chosen grid point on ``seed``: plain DiLoCo by its loss at the target step, the
        others by their time to that loss (then by final loss); then GASLoC's best form, the one of its forms
        whose chosen point is first on this seed (:func:`best_form`).

        Args:
            given: choices made elsewhere (method -> its tuning entry, with the reason under ``given``): not
                rerun; plain DiLoCo's choice, if given, still runs on ``seed`` for the target unless its entry
                gives it (``target``: [loss, simulated time]).
            outer: run only the grid points whose outer step is this label (e.g. ``eta=0.7,gamma=0.5``), every
                codec of it; None: the whole grid.
        """
        given = dict(given or {})
        chosen: dict[str, dict] = {}
        if "diloco" in given:
            chosen["diloco"] = {key: value for key, value in given["diloco"].items() if key != "target"}
            target = tuple(given["diloco"]["target"]) if "target" in given["diloco"] else \
                self.target(self.run("diloco", tuple(given["diloco"]["overrides"]), seed, run_label(given["diloco"])))
        else:
            diloco_grid = self.grid("diloco")
            if not diloco_grid:
                raise ValueError(f"--points {','.join(self.points['diloco'])} leaves plain DiLoCo, the reference, no "
                                 f"grid point (its labels: {list(METHODS['diloco'].grid)})")
            diloco = {label: self.run("diloco", extra, seed, label) for label, extra in diloco_grid.items()}
            best = min(diloco, key=lambda label: self.target(diloco[label])[0])
            chosen["diloco"] = {"label": best, "overrides": diloco_grid[best],
                                "edges": grid_edges(list(diloco), best),
                                **({"points": sorted(self.points["diloco"])} if "diloco" in self.points else {}),
                                "losses": {label: self.target(run)[0] for label, run in diloco.items()}}
            target = self.target(diloco[best])
        for method in self.methods:
            if method == "diloco":
                continue
            if method in given:
                chosen[method] = given[method]
                continue
            spec = METHODS[method]
            grid = {label: extra for label, extra in self.grid(method).items()
                    if outer is None or not spec.grid or label.endswith(outer)}
            if not grid:  # --outer or --points name a point this method's grid does not have
                why = f"the outer step {outer}" if self.grid(method) else ",".join(self.points.get(method, ()))
                chosen[method] = {"error": f"no grid point of {method} has {why}"}
                print(f"  {method}: not tuned: {chosen[method]['error']}", flush=True)
                continue
            scores, errors = {}, {}
            for label, extra in grid.items():
                try:
                    scores[label] = self.score(self.run(method, extra, seed, label), target)
                except SimRunError as error:  # a point the scenario cannot run (it says why): reported, not fatal
                    errors[label] = error.reason
            if not scores:
                chosen[method] = {"error": next(iter(errors.values()))}
                print(f"  {method}: cannot run here: {chosen[method]['error']}", flush=True)
                continue
            label = min(scores, key=lambda k: tuning_key(scores[k]))
            chosen[method] = {"label": label, "overrides": grid[label], "scores": scores,
                              "edges": grid_edges(list(scores), label), **({"errors": errors} if errors else {}),
                              **({"points": sorted(self.points[method])} if method in self.points else {})}
            print(f"  tuned {method}: {label}", flush=True)
        if "gasloc_best" in given:
            chosen["gasloc_best"] = given["gasloc_best"]
        else:
            form = best_form(chosen)
            if form is not None:
                chosen["gasloc_best"] = {"form": form, "seed": seed}
        return chosen

    def held_out(self, chosen: dict[str, dict], seeds: tuple[int, ...], forms: str = "all") -> dict[str, dict]:
        """The chosen configurations on ``seeds``; ``forms="best"`` runs only GASLoC's best form (chosen on the
        tuning seed) of its forms."""
        best = chosen.get("gasloc_best", {}).get("form")
        runnable = [method for method in self.methods if "error" not in chosen.get(method, {"error": ""})
                    and (forms == "all" or method not in GASLOC_FORMS or method == best)]
        return self._held_out(chosen, runnable, seeds)

    def _held_out(self, chosen: dict[str, dict], runnable: list[str], seeds: tuple[int, ...]) -> dict[str, dict]:
        results: dict[str, dict] = {method: {"seeds": {}} for method in runnable}
        for seed in seeds:
            diloco = self.run("diloco", chosen["diloco"]["overrides"], seed, run_label(chosen["diloco"]))
            target = self.target(diloco)
            for method in runnable:
                run = diloco if method == "diloco" else self.run(method, tuple(chosen[method]["overrides"]), seed,
                                                                 run_label(chosen[method]))
                results[method]["seeds"][str(seed)] = {**self.score(run, target), "target_loss": target[0],
                                                       "diloco_time": target[1]}
        return summarised(results)


def loss_at(trace: list, step: int) -> tuple[float, float]:
    """(loss, simulated time) of a trace's last validation at or before ``step``."""
    _, loss, sim_time = max((p for p in trace if p[0] <= step), key=lambda p: p[0])
    return loss, sim_time


def run_label(entry: dict) -> str:
    """The name a chosen configuration's runs are kept under: its grid label (``int8,eta=0.7,gamma=0.5``), so two
    scenarios sharing runs that chose different points of one method keep both records (one name for both made
    the second overwrite the first's record); ``default`` for a method without a grid."""
    return entry.get("label") or "default"


def best_form(chosen: dict[str, dict]) -> str | None:
    """GASLoC's best form on the tuning seed: of the forms tuned there, the one whose chosen point comes first
    by :func:`tuning_key` (time to the target, then final loss); None if no form was tuned. Chosen before any
    held-out seed runs, so the held-out seeds report what a user would have picked ahead."""
    scored = {form: chosen[form]["scores"][chosen[form]["label"]] for form in GASLOC_FORMS
              if form in chosen and "scores" in chosen[form]}
    return min(scored, key=lambda form: tuning_key(scored[form])) if scored else None


def summarised(results: dict[str, dict]) -> dict[str, dict]:
    """``results`` (method -> per-seed scores) with each seed's ``family_ratio`` (its time over the fastest
    DiLoCo-family method's among ``results`` on that seed; None where it, or every family method, never reached
    the target) and each method's summary. Run again on merged results: the family is every method recorded."""
    seeds = {seed for result in results.values() for seed in result["seeds"]}
    for seed in seeds:
        scores = {method: result["seeds"][seed] for method, result in results.items() if seed in result["seeds"]}
        times = [s["time_to_target"] for m, s in scores.items()
                 if m in DILOCO_FAMILY and s["time_to_target"] is not None]
        fastest = min(times) if times else None
        for score in scores.values():
            reached = score["time_to_target"]
            score["family_ratio"] = None if reached is None or fastest is None else reached / fastest
    for result in results.values():
        result |= _summary(list(result["seeds"].values()))
    return results


def _mean_of(values: list[float | None]) -> float | None:
    """The mean, or None unless every seed has a value (one seed that never reached it is not averaged away)."""
    return statistics.mean(values) if values and all(v is not None for v in values) else None


def _summary(per_seed: list[dict]) -> dict:
    ratios = [s["ratio"] for s in per_seed]
    family = [s.get("family_ratio") for s in per_seed]
    return {"ratio_mean": _mean_of(ratios), "ratios": ratios, "family_ratio_mean": _mean_of(family),
            "family_ratios": family, "goodput_mean": statistics.mean(s["goodput"] for s in per_seed),
            "val_loss_mean": statistics.mean(s["val_loss"] for s in per_seed)}


def tuned_at(out: Path, workers: int, scenario: str) -> dict:
    """The record of ``scenario`` at another n (``--tuned-from``): its ``tuning`` is what runs at this n."""
    path = out / f"multicloud_n{workers}.json"
    scenarios = json.loads(path.read_text())["scenarios"] if path.is_file() else {}
    if scenario not in scenarios:
        raise FileNotFoundError(f"--tuned-from {workers}: {path} has no {scenario} (run it at n = {workers} first)")
    return scenarios[scenario]


def check_methods(methods: tuple[str, ...]) -> tuple[str, ...]:
    """``methods`` in the order of :data:`METHODS`; plain DiLoCo (the reference of every ratio) must be one."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "diloco" not in methods:
        raise ValueError(f"methods must be among {list(METHODS)} and include diloco (every ratio is to plain "
                         f"DiLoCo's time), got {list(methods)}")
    return tuple(method for method in METHODS if method in methods)


_PROTOCOL = ("steps", "target_step", "inner_steps", "inner_steps_grid", "tuning_seed", "held_out_seeds",
             "tuned_at_workers")


_REFERENCE_RTOL = 1e-4  # real multi-process runs (n = 8) differ run to run in the last digits of a loss


def _same_reference(previous: dict, current: dict) -> bool:
    """Whether both records' ratios are to the same plain DiLoCo runs (its setting, target loss and time)."""
    if previous.get("tuning", {}).get("diloco", {}).get("label") != current["tuning"]["diloco"].get("label"):
        return False
    old = previous.get("results", {}).get("diloco", {}).get("seeds", {})
    new = current["results"]["diloco"]["seeds"]
    return set(old) == set(new) and all(math.isclose(old[seed][key], new[seed][key], rel_tol=_REFERENCE_RTOL)
                                        for seed in new for key in ("target_loss", "diloco_time"))


def merged(previous: dict | None, current: dict, workers: int) -> dict:
    """``current`` (a scenario's record at ``workers``), keeping the methods of ``previous`` that were not tried
    now when both followed the same protocol against the same plain DiLoCo runs (a rerun with other
    ``--methods``); otherwise ``current`` replaces it all."""
    if previous is None:
        return current
    previous = {"tuned_at_workers": workers, **previous}  # records written before the key existed were tuned here
    if any(previous.get(key) != current.get(key) for key in _PROTOCOL) or not _same_reference(previous, current):
        print("  the previous record followed another protocol or reference: replaced", flush=True)
        return current
    kept = [method for method in previous.get("tuning", {}) if method in METHODS and method not in current["tuning"]]
    if kept:
        print(f"  kept from the previous run of this protocol: {', '.join(kept)}", flush=True)
    order = [*METHODS, "gasloc_best"]
    tuning = {**{m: previous["tuning"][m] for m in kept}, **current["tuning"]}
    if "gasloc_best" not in current["tuning"] and "gasloc_best" in previous["tuning"]:
        tuning["gasloc_best"] = previous["tuning"]["gasloc_best"]
    results = {**{m: previous["results"][m] for m in kept if m in previous.get("results", {})},
               **current["results"]}
    results = summarised(dict(sorted(results.items(), key=lambda item: order.index(item[0]))))
    return {**current, "results": results,
            "tuning": dict(sorted(tuning.items(), key=lambda item: order.index(item[0]))),
            "not_run": [method for method in METHODS if method not in tuning]}


def tuned_choices(out: Path, tuned_from: int, scenarios: tuple[str, ...], methods: tuple[str, ...],
                  seeds: tuple[int, ...], steps: int, inner_steps: int,
                  batch_size: int | None = None) -> dict[str, tuple[dict, dict]]:
    """``--tuned-from``: each scenario's (protocol, chosen configurations) from the record at ``tuned_from``
    workers, every scenario checked before any run (same steps, H and batch, a tuning seed not held out here)."""
    choices = {}
    for name in scenarios:
        source = tuned_at(out, tuned_from, name)
        where = f"--tuned-from {tuned_from}: {name}"
        if (source.get("target_step"), source.get("inner_steps")) != (steps, inner_steps):
            raise ValueError(f"{where} was tuned with --steps {source.get('target_step')} --inner-steps "
                             f"{source.get('inner_steps')}, not {steps} and {inner_steps}")
        if source.get("batch_size") != batch_size:
            raise ValueError(f"{where} was tuned with --batch-size {source.get('batch_size')}, not {batch_size}")
        if source["tuning_seed"] in seeds:
            raise ValueError(f"{where} was tuned on seed {source['tuning_seed']}, which cannot be a held-out seed "
                             f"here ({list(seeds)})")
        missing = [method for method in methods if method not in source["tuning"]]
        if missing:
            raise ValueError(f"{where} there has no tuning for {missing} (rerun it)")
        protocol = {"tuning_seed": source["tuning_seed"], "tuned_at_workers": source.get("tuned_at_workers", tuned_from),
                    **({"inner_steps_grid": source["inner_steps_grid"]} if "inner_steps_grid" in source else {})}
        chosen = {method: source["tuning"][method] for method in methods}
        if "gasloc_best" in source["tuning"]:
            chosen["gasloc_best"] = source["tuning"]["gasloc_best"]
        choices[name] = (protocol, chosen)
    return choices


def _write(path: Path, record: dict) -> None:
    """Replace ``path`` whole: an interrupted write leaves the previous record, not a truncated one."""
    write_json_atomically(path, record, indent=2, default=str)


def check_noise_draws(scenarios: tuple[str, ...], seeds: tuple[int, ...]) -> None:
    """Jitter's noise and preemption's churn follow the run's seed: each held-out seed is one draw, and a
    scenario with noise is reported over at least :data:`MIN_NOISE_DRAWS` of them."""
    noisy = [name for name in scenarios if name in NOISY]
    if noisy and len(set(seeds)) < MIN_NOISE_DRAWS:
        raise ValueError(f"{noisy} draw their noise or churn from the run's seed: give at least {MIN_NOISE_DRAWS} "
                         f"held-out seeds (--seeds), got {list(seeds)}")


def run_scenarios(workers: int, scenarios: tuple[str, ...], steps: int, inner_steps: int, tuning_seed: int,
        seeds: tuple[int, ...], out: Path, tuned_from: int | None = None,
        methods: tuple[str, ...] = tuple(METHODS), given: dict[str, dict] | None = None, outer: str | None = None,
        forms: str = "all", inner_steps_grid: tuple[int, ...] = (), dry_run: bool = False,
        points: dict[str, tuple[str, ...]] | None = None, batch_size: int | None = None) -> None:
    """Tune (or take ``--tuned-from``) and run the held-out seeds of every scenario; each scenario's record is
    written to ``<out>/multicloud_n<workers>.json`` as it ends and every run's trace to ``<out>/runs/n<workers>/``
    (a rerun reads the runs it finds there: the benchmark resumes where it stopped).

    Args:
        given: ``{scenario: {method: tuning entry}}`` chosen elsewhere (``--given``), not rerun.
        outer: tune only the grid points of this outer step (``--outer``).
        forms: ``"best"``: of GASLoC's forms only the best one on the tuning seed runs the held-out seeds.
        inner_steps_grid: the H every method's grid is crossed with (``--inner-steps-grid``; empty: ``inner_steps``).
        dry_run: list the runs the session would ask for (those recorded marked) and run nothing.
        points: ``{method: parts}``: only the grid points whose label has every part (``--points``).
        batch_size: every worker's batch (``--batch-size``; None: the experiment's).
    """
    methods = check_methods(methods)
    choices = None if tuned_from is None else tuned_choices(out, tuned_from, scenarios, methods, seeds, steps,
                                                            inner_steps, batch_size)
    check_noise_draws(scenarios, seeds)
    path = out / f"multicloud_n{workers}.json"
    together, folder = tuple(name for name in scenarios if name in CLOCK_ONLY), out / "runs" / f"n{workers}"

    def session(runs: SharedRuns, name: str) -> tuple[Scenario, dict, dict, dict]:
        scenario = Scenario(name, workers, steps, inner_steps, runs, methods, inner_steps_grid, points, batch_size)
        if choices is None:
            protocol = {"tuning_seed": tuning_seed, "tuned_at_workers": workers}
            chosen = scenario.tune(tuning_seed, (given or {}).get(name), outer)
        else:
            protocol, chosen = choices[name]
        return scenario, protocol, chosen, scenario.held_out(chosen, seeds, forms)

    plan = PlannedRuns(together, folder)
    with contextlib.redirect_stdout(io.StringIO()):  # the plan's stand-in tuning says nothing
        for name in scenarios:
            session(plan, name)
    progress = plan.planned_progress()
    print(f"{progress.total} gasloc-sim runs at n = {workers}, {progress.recorded} recorded already in {folder}",
          flush=True)
    if dry_run:  # a lower bound: the held-out runs grow where scenarios sharing runs choose different points
        print("(at least: held-out runs are shared only where the scenarios choose the same point)", flush=True)
        for name, overrides in plan.planned.items():
            print(f"  {'recorded' if plan.recorded(overrides, name) else 'to run':8s}  {name}", flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = SharedRuns(together, folder, Path(tmp), progress)
        for name in scenarios:
            print(f"{name} at n = {workers}", flush=True)
            scenario, protocol, chosen, results = session(runs, name)
            current = {"steps": scenario.steps, "target_step": steps, "inner_steps": inner_steps, **protocol,
                       **({"inner_steps_grid": list(inner_steps_grid)} if inner_steps_grid else {}),
                       **({"batch_size": batch_size} if batch_size is not None else {}),
                       "held_out_seeds": list(seeds), "tuning": chosen,
                       "not_run": [method for method in METHODS if method not in methods], "results": results}
            # read again: another invocation (other scenarios, run alongside) may have written its own since
            record = json.loads(path.read_text()) if path.is_file() else {"workers": workers, "scenarios": {}}
            record["scenarios"][name] = merged(record["scenarios"].get(name), current, workers)
            _print_table(name, results)
            _write(path, record)  # after every scenario


def _print_table(name: str, results: dict[str, dict]) -> None:
    print(f"  {'method':20s} {'time / diloco':>14s}  {'per seed':>18s} {'goodput':>8s} {'val loss':>9s}")
    for method, result in results.items():
        mean = "never" if result["ratio_mean"] is None else f"{result['ratio_mean']:.3f}"
        seeds = ", ".join("never" if r is None else f"{r:.3f}" for r in result["ratios"])
        print(f"  {method:20s} {mean:>14s}  {seeds:>18s} {result['goodput_mean']:8.3f} {result['val_loss_mean']:9.4f}")


def _records(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("multicloud_n*.json")), key=lambda r: r["workers"])


def _cell(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


def markdown(out: Path) -> str:
    """One table per scenario and n from the JSON files in ``out``: each method's time to plain DiLoCo's loss
    as a ratio (mean over the held-out seeds, then each seed), goodput, final loss and its tuned setting."""
    lines = []
    for record in _records(out):
        for name, scenario in record["scenarios"].items():
            seeds = ", ".join(map(str, scenario["held_out_seeds"]))
            family = any(method in scenario["results"] for method in DILOCO_FAMILY if method not in ("diloco",
                                                                                                 "streaming_diloco"))
            tuned_at = scenario.get("tuned_at_workers", record["workers"])
            where = "" if tuned_at == record["workers"] else f" at n = {tuned_at} (not retuned here)"
            lines += [f"### {name}, n = {record['workers']}", "",
                      f"{scenario['steps']} steps"
                      + (f" of batch {scenario['batch_size']}" if "batch_size" in scenario else "")
                      + (f", H tuned over {scenario['inner_steps_grid']}" if "inner_steps_grid" in scenario
                         else f", H = {scenario['inner_steps']}") + f", target: plain DiLoCo's loss at step "
                      f"{scenario['target_step']}; tuned on seed {scenario['tuning_seed']}{where}, held-out seeds {seeds}.",
                      *([f"Not run here (left out with --methods): {', '.join(scenario['not_run'])}."] if scenario.get("not_run")
                        else []),
                      *([f"GASLoC's best form on seed {scenario['tuning_seed']}: {scenario['tuning']['gasloc_best']['form']}"
                         + (f" ({scenario['tuning']['gasloc_best']['given']})" if "given" in scenario['tuning']['gasloc_best']
                            else "") + "."] if "gasloc_best" in scenario["tuning"] else []),
                      "", "| method | time / DiLoCo (mean) | per seed | goodput | final val loss | tuned |"
                      + (" time / best DiLoCo-family, per seed |" if family else ""),
                      "|---|---|---|---|---|---|" + ("---|" if family else "")]
            for method, result in scenario["results"].items():
                per_seed = ", ".join(_cell(r) for r in result["ratios"])
                tuned = scenario["tuning"][method].get("label", "")
                edges = scenario["tuning"][method].get("edges")
                tuned += f" (edge: {', '.join(edges)})" if edges else ""
                lines.append(f"| {method} | {_cell(result['ratio_mean'])} | {per_seed} | {result['goodput_mean']:.3f} "
                             f"| {result['val_loss_mean']:.4f} | {tuned} |"
                             + (f" {', '.join(_cell(r) for r in result.get('family_ratios', []))} |" if family else ""))
            for method, chosen in scenario["tuning"].items():
                tail = " |" if family else ""
                if method in METHODS and method not in scenario["results"] and "error" not in chosen:
                    lines.append(f"| {method} | not run on the held-out seeds | | | | {chosen.get('label', '')} |"
                                 + tail)
                if "error" in chosen:
                    lines.append(f"| {method} | cannot run here | | | | {chosen['error']} |{tail}")
            lines.append("")
    return "\n".join(lines)


def never_height(records: list[dict]) -> float:
    """Where a seed that never reached the target is drawn: above every measured ratio of every record."""
    ratios = [ratio for record in records for scenario in record["scenarios"].values()
              for result in scenario.get("results", {}).values() for ratio in result.get("ratios", [])
              if ratio is not None]
    return 1.5 * max(ratios, default=10.0)


def plot(out: Path) -> None:
    """Each held-out seed's ratio per method (x: never reached), one panel per scenario, one colour per n."""
    from matplotlib.figure import Figure

    records = _records(out)
    scenarios = [name for name in SCENARIOS if any(name in record["scenarios"] for record in records)]
    methods = list(METHODS)
    never_at = never_height(records)
    shifts = [0.3 * (i - (len(records) - 1) / 2) / max(len(records) - 1, 1) for i in range(len(records))]
    figure = Figure(figsize=(4 * max(len(scenarios), 1), 4.2))
    for axes, scenario in zip(figure.subplots(1, len(scenarios), squeeze=False)[0], scenarios):
        for shift, record in zip(shifts, records):
            results = record["scenarios"].get(scenario, {}).get("results", {})
            points = [(index + shift, ratio) for index, method in enumerate(methods)
                      for ratio in results.get(method, {}).get("ratios", [])]
            reached = [(x, r) for x, r in points if r is not None]
            color = axes.plot(*zip(*reached), "o", label=f"n = {record['workers']}")[0].get_color() if reached \
                else None
            never = [x for x, r in points if r is None]
            if never:
                axes.plot(never, [never_at] * len(never), "x", color=color)
        axes.axhline(1.0, color="grey", lw=0.8)
        axes.set_xticks(range(len(methods)), [m.replace("_", "\n") for m in methods], fontsize=6)
        axes.set(title=scenario, ylabel="time to plain DiLoCo's loss / DiLoCo's (x: never)", yscale="log")
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "multicloud.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(DEFAULT_SCENARIOS),
                        help=f"default: {' '.join(DEFAULT_SCENARIOS)} (the bandwidth sweep is asked for by name)")
    parser.add_argument("--steps", type=int, default=60, help="plain DiLoCo's steps: the target (runs get 1.5x)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--inner-steps-grid", type=int, nargs="+", default=[], metavar="H",
                        help="cross every method's grid with these H (issue 31's protocol: 10 20 50); each run "
                             "validates at its own round ends")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="every worker's batch (default: the experiment's, 16); 4 makes a run about 2.4x cheaper "
                             "at n = 64, what lets issue 31's 600-step protocol fit the machine")
    parser.add_argument("--tuning-seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                        help="held-out seeds, reported (jitter and preemption: one noise draw each, at least 3)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/multicloud"))
    parser.add_argument("--tuned-from", type=int, default=None, metavar="N",
                        help="no tuning: run the held-out seeds with the configurations chosen at N workers "
                             "(from multicloud_n<N>.json in --out); for sizes where tuning is too costly")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(DEFAULT_METHODS),
                        help="a subset of the methods (diloco, the reference, must be one of them); default: "
                             f"{' '.join(DEFAULT_METHODS)} (issue 31's are asked for by name)")
    parser.add_argument("--given", type=Path, default=None,
                        help="JSON {scenario: {method: tuning entry}}: choices made elsewhere, not rerun (each says "
                             "why under 'given')")
    parser.add_argument("--outer", default=None, metavar="LABEL",
                        help="tune only the grid points of this outer step (e.g. eta=0.7,gamma=0.5), every codec")
    parser.add_argument("--forms", choices=("all", "best"), default="all",
                        help="best: only GASLoC's best form on the tuning seed runs the held-out seeds")
    parser.add_argument("--points", nargs="+", default=[], metavar="METHOD=PART[,PART...]",
                        help="tune only the grid points of METHOD whose label has every PART (e.g. "
                             "hierarchical=K=4,delayed_int4): a cut grid, recorded with the results")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the gasloc-sim runs this session would ask for (recorded ones marked), run none")
    parser.add_argument("--plot", action="store_true", help="only draw the figure from the JSON files in --out")
    parser.add_argument("--markdown", action="store_true", help="only print the tables of the JSON files in --out")
    args = parser.parse_args(argv)
    if args.tuned_from is None and args.tuning_seed in args.seeds:
        parser.error("--tuning-seed must not be one of the held-out --seeds")
    if args.tuned_from is not None and args.tuning_seed != parser.get_default("tuning_seed"):
        parser.error("--tuning-seed has no use with --tuned-from (the source's tuning seed is the one recorded)")
    if args.steps < 2 * max([args.inner_steps, *args.inner_steps_grid]) or args.workers < 2:
        parser.error("--steps must cover at least two rounds of every H (2 x --inner-steps and of the "
                     "--inner-steps-grid) and --workers must be >= 2")
    if any(args.steps % h for h in args.inner_steps_grid):
        parser.error("--steps must be a multiple of every H of --inner-steps-grid (the target is validated at a "
                     "round's end)")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if "diloco" not in args.methods:
        parser.error("--methods must include diloco: every ratio is to plain DiLoCo's time")
    if args.tuned_from is not None and (args.points or args.inner_steps_grid):
        parser.error("--points and --inner-steps-grid shape a tuning: with --tuned-from the source's choices run")
    if args.dry_run and (args.plot or args.markdown):
        parser.error("--dry-run lists runs: not with --plot or --markdown")
    points: dict[str, tuple[str, ...]] = {}
    uncut = Scenario("", 2, args.steps, args.inner_steps, runs=None, inner_steps_grid=tuple(args.inner_steps_grid))
    for item in args.points:
        method, _, text = item.partition("=")
        parts = tuple(text.split(","))
        if method not in args.methods or method in points or not all(parts):
            parser.error(f"--points takes METHOD=PART[,PART...] once per method of --methods ({args.methods}), "
                         f"got {item!r}")
        labels = [set(label.split(",")) for label in uncut.grid(method)]
        if not any(set(parts) <= label for label in labels):
            parser.error(f"--points {item}: no grid point of {method} has every part (its labels: "
                         f"{list(uncut.grid(method))})")
        points[method] = parts
    if args.markdown:
        print(markdown(args.out))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot:
        run_scenarios(args.workers, tuple(args.scenarios), args.steps, args.inner_steps, args.tuning_seed,
                      tuple(args.seeds), args.out, args.tuned_from, tuple(args.methods),
                      None if args.given is None else json.loads(args.given.read_text()), args.outer, args.forms,
                      tuple(args.inner_steps_grid), args.dry_run, points, args.batch_size)
        if args.dry_run:
            return
    plot(args.out)


if __name__ == "__main__":
    main()
