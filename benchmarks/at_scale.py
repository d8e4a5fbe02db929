"""What GASLoC does at scale: the measurements behind docs/at_scale.md.

Parts (``--part``):

- ``acceleration``: rounds for gossip alone (no gradients) to bring the consensus distance down by
  1e-3, for n = 16 ... 1024 on ring, two_peer, one_peer and exponential; plain gossip (gamma = 0)
  against the outer momentum (anchored, and post_mix where the graph allows it) with gamma tuned per
  graph and n on a grid refined twice around its best value. Rounds come from the project's consensus rate rho
  (``Topology.consensus_rate``: the asymptotic per-round contraction of the disagreement), as
  ``ln(1e3) / (2 ln(1 / rho))`` (the distance is a square); at n <= 64 they are also measured
  directly with the simulator's own round (``GossipRounds``, random start, eta = 1). The exponent
  of n is a least-squares fit of log(rounds) on log(n).
- ``quality``, ``churn``: ``gasloc-sim`` runs of the demo preset (tiny GPT, stdlib bytes) at equal
  tokens per worker; final consensus validation loss (mean and sd over ``--seeds``), and goodput under churn.
- ``h1``: the paper's H = 1 claim at scale (``experiment=paper_h1``): gossip against GASLoC on one_peer
  with fair partners (both with the same tuned inner AdamW; GASLoC's inner SGD, whose outer momentum is
  Nesterov's, against gossip with Nesterov SGD, and with heavy-ball SGD), the tuned values chosen on
  ``--tuning-seed`` and reported on the held-out ``--seeds``.
- ``plots``: one figure of questions 2 to 5 from the JSON files the other parts wrote to ``--out``.
- ``networks``: two_clusters and cloud_mix scaled to ``--workers`` (clusters in proportion, the
  presets' links): the simulated time at which GASLoC reaches DiLoCo's final loss.

Usage::

    python benchmarks/at_scale.py --part acceleration --out benchmarks/results/at_scale
    python benchmarks/at_scale.py --part quality --workers 16 --steps 100 --out benchmarks/results/at_scale
    python benchmarks/at_scale.py --part h1 --workers 64 --steps 200 --seeds 1 2 3 --out docs/at_scale
    python benchmarks/at_scale.py --part networks --workers 64 --rounds 6 --inner-steps 10 --out docs/at_scale

Results go to ``<out>/<part>_n<workers>.json`` (``<out>/acceleration.json`` and its plot for ``acceleration``).
Each run (a ``gasloc-sim`` run, or one graph and n of ``acceleration``) is recorded as it finishes under
``<out>/runs/<part>_n<workers>/``; before each the script prints ``run k of N (m done): <run> | ETA h:mm:ss``,
and a rerun of the same command reads back the runs recorded with the same settings instead of running them
again (an interrupted part resumes where it stopped; delete that folder to start over).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gasloc_lightning.sim import GossipRounds, WorkerClocks
from gasloc_lightning.topology import build_topology
from gasloc_lightning.utils.progress import ScriptProgress
from gasloc_lightning.utils.records import write_json_atomically
import sim_runs
from sim_runs import describe, seeded, slug, time_to_reach, tuned_on

SIZES = (16, 32, 64, 128, 256, 512, 1024)
GRAPHS = ("ring", "two_peer", "one_peer", "exponential")
GAMMAS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998)
REDUCTION = 1e-3
REFINEMENTS = 2  # finer gamma searches around the coarse grid's best (see tuned)


class RunRecords:
    """A part's runs, each recorded in ``folder`` as it finishes and read back, not rerun, when a later session
    asks for the same run with the same settings (the part resumes); and the part's progress lines.

    Args:
        folder: where the records go (``<out>/runs/<part>_n<workers>``); ``None``: none kept (progress only).
        total: the runs the part will ask for (its plan; the count grows if the plan was short).
    """

    def __init__(self, folder: Path | None, total: int) -> None:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.progress = ScriptProgress(total=total)

    def run(self, key: str, settings: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``'s result for the run named ``key``, recorded with ``settings`` (anything JSON: what makes
        the run the same run); a record of ``key`` with other settings is run again and replaced."""
        path = None if self.folder is None else self.folder / f"{slug(key)}.json"
        if path is not None and path.is_file():
            record = json.loads(path.read_text())
            if record.get("settings") == json.loads(json.dumps(settings)):
                self.progress.done()  # kept from an earlier session: counted, not timed
                print(f"    {key}: recorded", flush=True)
                return record["result"]
        print(self.progress.start(key), flush=True)
        result = compute()
        if path is not None:
            write_json_atomically(path, {"settings": settings, "result": result}, indent=1, default=str)
        self.progress.done()
        return json.loads(json.dumps(result, default=str))  # as a resumed session reads it back

    def sim(self, work: Path) -> Callable[..., dict]:
        """A ``runner`` for :func:`sim_runs.seeded` and :func:`sim_runs.tuned_on` (and a stand-in for
        :func:`sim_runs.run_sim`) whose runs are recorded, keyed by their folder under ``work``."""
        def runner(overrides: list[str], out: Path, experiment: str = "demo") -> dict:
            key = str(out.relative_to(work))
            return self.run(key, {"overrides": list(overrides), "experiment": experiment},
                            lambda: sim_runs.run_sim(list(overrides), out, experiment))
        return runner


def _records(out: Path | None, part: str, total: int) -> RunRecords:
    """The part's records under ``out`` (``None``: none kept, for a call from code)."""
    return RunRecords(None if out is None else out / "runs" / part, total)


def rounds_from_rate(rate: float) -> float:
    if rate <= 0.0:
        return 1.0
    if rate >= 1.0:
        return math.inf
    return math.log(1.0 / REDUCTION) / (2.0 * math.log(1.0 / rate))


def _rate(graph: str, n: int, gamma: float, form: str) -> float | None:
    try:
        return float(build_topology(graph).consensus_rate(n, gamma, form))
    except (ValueError, NotImplementedError):
        return None


def tuned(graph: str, n: int, form: str, refinements: int = REFINEMENTS) -> dict:
    """The best gamma (fewest rounds) for one graph, n and form: the coarse grid, then ``refinements``
    times 9 evenly spaced values between the best value's two neighbours, so the optimum is not read off
    a grid step (the rounds blow up on one side of it as gamma nears 1)."""
    best = {"gamma": None, "rate": None, "rounds": math.inf}

    def consider(gamma: float) -> None:
        nonlocal best
        rate = _rate(graph, n, gamma, form)
        if rate is not None and rounds_from_rate(rate) < best["rounds"]:
            best = {"gamma": gamma, "rate": rate, "rounds": rounds_from_rate(rate)}

    grid = [*GAMMAS, 1.0]
    for gamma in grid[1:-1]:
        consider(gamma)
    for _ in range(refinements if best["gamma"] is not None else 0):
        index = grid.index(best["gamma"])
        low, high = grid[index - 1], grid[index + 1]
        grid = sorted({low + (high - low) * k / 10 for k in range(11)} | {best["gamma"]})
        for gamma in grid[1:-1]:
            consider(gamma)
    return best


def measured_rounds(graph: str, n: int, gamma: float, form: str = "anchored", cap: int = 4000, seed: int = 0) -> int:
    """Rounds of the simulator's own gossip round until the consensus distance is 1e-3 of its start."""
    start = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).double()
    rounds = GossipRounds(initial=start.float(), topology=build_topology(graph), outer_lr=1.0, outer_momentum=gamma,
                          outer_form=form, clocks=WorkerClocks(None, n))
    points = start.float().clone()
    initial = float((points - points.mean(0)).pow(2).sum())
    live = list(range(n))
    for t in range(cap):
        rounds.communicate(points, t, live)
        if float((points - points.mean(0)).pow(2).sum()) <= REDUCTION * initial:
            return t + 1
    return cap


def exponent(sizes: list[int], rounds: list[float]) -> float | None:
    pairs = [(math.log(n), math.log(r)) for n, r in zip(sizes, rounds) if math.isfinite(r) and r > 0]
    if len(pairs) < 2:
        return None
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x in xs)


def _acceleration_row(graph: str, n: int) -> dict:
    plain = rounds_from_rate(_rate(graph, n, 0.0, "anchored"))
    if plain == 1.0 and build_topology(graph).schedule_period(n):  # rate 0: exact after one period
        plain = float(build_topology(graph).schedule_period(n))
    row = {"n": n, "plain": plain, "anchored": tuned(graph, n, "anchored"),
           "post_mix": tuned(graph, n, "post_mix") if graph in ("ring", "exponential") else None}
    if n <= 64:
        row["measured_plain"] = measured_rounds(graph, n, 0.0)
        gamma = row["anchored"]["gamma"]
        row["measured_anchored"] = None if gamma is None else measured_rounds(graph, n, gamma)
    return row


def acceleration(sizes: tuple[int, ...], out: Path | None = None) -> dict:
    result: dict = {"reduction": REDUCTION, "sizes": list(sizes), "graphs": {}}
    plan = [(graph, n) for graph in GRAPHS for n in sizes if not (graph == "exponential" and n & (n - 1))]
    records = _records(out, "acceleration", len(plan))
    for graph in GRAPHS:
        rows = []
        for n in sizes:
            if (graph, n) not in plan:
                continue
            row = records.run(f"{graph}_n{n}", {"graph": graph, "n": n, "reduction": REDUCTION,
                                                "gammas": list(GAMMAS), "refinements": REFINEMENTS},
                              lambda: _acceleration_row(graph, n))
            rows.append(row)
            print(graph, n, row["plain"], row["anchored"], row["post_mix"], flush=True)
        ns = [r["n"] for r in rows]
        fits = {"plain": exponent(ns, [r["plain"] for r in rows]),
                "anchored": exponent(ns, [r["anchored"]["rounds"] for r in rows])}
        if graph in ("ring", "exponential"):
            fits["post_mix"] = exponent(ns, [r["post_mix"]["rounds"] for r in rows])
        result["graphs"][graph] = {"rows": rows, "exponent_of_n": fits}
    return result


def plot_acceleration(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6))
    axes = figure.add_subplot(1, 1, 1)
    for graph, data in result["graphs"].items():
        ns = [r["n"] for r in data["rows"]]
        line = axes.plot(ns, [r["plain"] for r in data["rows"]], "o-", label=f"{graph} plain")[0]
        axes.plot(ns, [r["anchored"]["rounds"] for r in data["rows"]], "s--", color=line.get_color(),
                  label=f"{graph} anchored (tuned gamma)")
        if data["rows"][0].get("post_mix"):
            axes.plot(ns, [r["post_mix"]["rounds"] for r in data["rows"]], "^:", color=line.get_color(),
                      label=f"{graph} post_mix (tuned gamma)")
    axes.set(xscale="log", yscale="log", xlabel="workers n", ylabel="rounds to cut the consensus distance by 1e-3")
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=120)


# The paper's H = 1 claim with fair partners: each side has one momentum and the same inner optimizer.
# AdamW: gossip's lr is tuned here (betas from docs/results/tuned.json, one_peer), and GASLoC takes the same
# AdamW, then its outer momentum is tuned. SGD: GASLoC (plain inner SGD, outer momentum 0.9, which is
# Nesterov's: docs/algorithm.md) against gossip with Nesterov SGD and with heavy-ball SGD (momentum 0.9),
# each lr tuned here; plain gossip SGD (no momentum anywhere: the former, unfair, partner) is a reference.
_ADAMW_BETAS = "model.optimizer.betas=[0.8,0.95]"
_GASLOC_H1 = ["strategy=gasloc", "inner_steps=1", "strategy.outer_lr=1.0"]
_SGD = ["model/optimizer=sgd"]
_H1_METHODS = {
    "gossip_adamw": ["strategy=gossip", "topology=one_peer", _ADAMW_BETAS],  # + the tuned lr
    "gasloc_adamw": [*_GASLOC_H1, "topology=one_peer", _ADAMW_BETAS],  # + gossip's lr, + the tuned outer momentum
    "gossip_sgd_plain": ["strategy=gossip", "topology=one_peer", *_SGD, "model.optimizer.lr=1.0"],
    "gossip_sgd_momentum": ["strategy=gossip", "topology=one_peer", *_SGD, "model.optimizer.momentum=0.9"],  # + lr
    "gossip_sgd_nesterov": ["strategy=gossip", "topology=one_peer", *_SGD, "model.optimizer.momentum=0.9",
                            "model.optimizer.nesterov=true"],  # + lr
    "gasloc_sgd": [*_GASLOC_H1, "topology=one_peer", *_SGD, "model.optimizer.lr=0.3", "strategy.outer_momentum=0.9"],
}
_H1_TUNING = {  # tuned on the tuning seed (not reported); the chosen value joins the method's overrides
    "gossip_adamw": {f"lr={lr}": [f"model.optimizer.lr={lr}"] for lr in (0.003, 0.006, 0.012)},
    "gasloc_adamw": {f"gamma={g}": [f"strategy.outer_momentum={g}"] for g in (0.1, 0.3, 0.5, 0.7)},
    "gossip_sgd_momentum": {f"lr={lr}": [f"model.optimizer.lr={lr}"] for lr in (0.03, 0.1, 0.3, 1.0)},
    "gossip_sgd_nesterov": {f"lr={lr}": [f"model.optimizer.lr={lr}"] for lr in (0.03, 0.1, 0.3, 1.0)},
}
_H1_SAME_AS = {"gasloc_adamw": "gossip_adamw"}  # takes that method's tuned values before its own tuning
_H1_PAIRS = (("AdamW", "gasloc_adamw", "gossip_adamw"),  # (label, GASLoC, its gossip partner): the figure
             ("SGD /\nNesterov", "gasloc_sgd", "gossip_sgd_nesterov"),
             ("SGD /\nheavy ball", "gasloc_sgd", "gossip_sgd_momentum"),
             ("SGD /\nplain", "gasloc_sgd", "gossip_sgd_plain"))


def h1_bars(runs: dict[str, dict]) -> list[tuple[str, float, float, int]]:
    """Panel 3's bars: (label, mean, sd, seeds) of GASLoC's paired per-seed ratio to each gossip partner of
    :data:`_H1_PAIRS` that ``runs`` (an h1 record's) holds."""
    bars = []
    for label, gasloc, gossip in _H1_PAIRS:
        if gasloc in runs and gossip in runs:
            ratios = paired_ratios(runs[gasloc], runs[gossip])
            bars.append((label, *mean_sd(ratios), len(ratios)))
    return bars


def h1(workers: int, steps: int, seeds: tuple[int, ...], tuning_seed: int = 0, out: Path | None = None) -> dict:
    """Claim (1) at scale: H = 1, gossip against GASLoC with fair partners (see ``_H1_METHODS``), each tuned
    value chosen on ``tuning_seed`` and every method reported on the held-out ``seeds``."""
    if not seeds:
        raise ValueError("h1 needs at least one held-out seed")
    if tuning_seed in seeds:
        raise ValueError(f"the tuning seed {tuning_seed} cannot be one of the held-out seeds {list(seeds)} "
                         f"(e.g. --seeds 1 2 3 with --tuning-seed 0)")
    base = [f"sim.workers={workers}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    runs, tuning, chosen = {}, {}, {}
    total = sum(map(len, _H1_TUNING.values())) + len(_H1_METHODS) * len(seeds)
    records = _records(out, f"h1_n{workers}", total)
    with tempfile.TemporaryDirectory() as tmp:
        runner = records.sim(Path(tmp))
        for name, extra in _H1_METHODS.items():
            extra = [*extra, *chosen.get(_H1_SAME_AS.get(name), [])]
            if name in _H1_TUNING:
                best, losses = tuned_on(_H1_TUNING[name], base + extra, Path(tmp) / name, tuning_seed, "paper_h1",
                                        runner=runner)
                tuning[name] = {"tuning_seed": tuning_seed, "losses": losses, "chosen": best}
                chosen[name] = _H1_TUNING[name][best]
                extra = [*extra, *chosen[name]]
                print(name, "tuned on seed", tuning_seed, losses, "->", best, flush=True)
            runs[name] = seeded(base + extra, Path(tmp) / name, seeds, experiment="paper_h1", runner=runner)
            print(describe(name, runs[name]), flush=True)
    return {"workers": workers, "steps": steps, "tuning_seed": tuning_seed, "seeds": list(seeds), "tuning": tuning,
            "runs": runs}


def _scaled_network(name: str, workers: int) -> list[str]:
    """two_clusters or cloud_mix with ``workers`` workers: the presets' links, clusters scaled in proportion."""
    if name == "two_clusters":
        return ["network=two_clusters", f"network.sizes=[{workers // 2},{workers - workers // 2}]"]
    a, b = workers // 2, workers // 4
    speeds = [1.0] * a + [0.7] * b + [0.5] * (workers - a - b)
    return ["network=cloud_mix", f"network.sizes=[{a},{b},{workers - a - b}]",
            f"network.speeds=[{','.join(map(str, speeds))}]"]


def networks(workers: int, rounds: int, inner_steps: int, out: Path | None = None) -> dict:
    """Simulated time to reach DiLoCo's final loss on scaled two_clusters and cloud_mix networks.

    DiLoCo runs ``rounds`` rounds; GASLoC gets 1.5x its steps, validating every round.
    """
    result: dict = {"workers": workers, "rounds": rounds, "inner_steps": inner_steps, "networks": {}}
    records = _records(out, f"networks_n{workers}", 2 * 3)  # 2 networks x 3 methods
    with tempfile.TemporaryDirectory() as tmp:
        runner = records.sim(Path(tmp))
        for network in ("two_clusters", "cloud_mix"):
            base = [f"sim.workers={workers}", f"inner_steps={inner_steps}", f"trainer.val_check_interval={inner_steps}",
                    *_scaled_network(network, workers)]
            diloco_steps = rounds * inner_steps
            gasloc_steps = (3 * rounds // 2) * inner_steps
            methods = {
                "diloco": ["strategy=diloco", f"trainer.max_steps={diloco_steps}"],
                "gasloc_one_peer": ["strategy=gasloc", "topology=one_peer", f"trainer.max_steps={gasloc_steps}"],
                "gasloc_bw_spread_overlap_bf16": [
                    "strategy=gasloc", "topology=bandwidth_aware", "topology.schedule=spread", "overlap=true",
                    "strategy.message_codec=bfloat16", "strategy.outer_momentum=0.7",
                    f"trainer.max_steps={gasloc_steps}"],
            }
            runs = {}
            for name, extra in methods.items():
                runs[name] = runner(base + extra, Path(tmp) / f"{network}_{name}")
                print(network, name, runs[name]["val_loss"], runs[name]["trace"][-1], flush=True)
            target = runs["diloco"]["val_loss"]
            reference = time_to_reach(runs["diloco"]["trace"], target)
            for run in runs.values():
                reached = time_to_reach(run["trace"], target)
                run["time_to_diloco_loss"] = reached
                run["ratio_to_diloco"] = None if reached is None or not reference else reached / reference
            result["networks"][network] = runs
    return result


def quality(workers: int, steps: int, seeds: tuple[int, ...], out: Path | None = None) -> dict:
    base = [f"sim.workers={workers}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
    runs = {}
    records = _records(out, f"quality_n{workers}", 5 * len(seeds))
    with tempfile.TemporaryDirectory() as tmp:
        runner = records.sim(Path(tmp))
        for name, extra in (("diloco", ["strategy=diloco"]), ("one_peer", ["strategy=gasloc", "topology=one_peer"]),
                            ("two_peer", ["strategy=gasloc", "topology=two_peer"]),
                            ("ring", ["strategy=gasloc", "topology=ring"]),
                            ("exponential", ["strategy=gasloc", "topology=exponential"])):
            runs[name] = seeded(base + extra, Path(tmp) / name, seeds, runner=runner)
            print(describe(name, runs[name]), flush=True)
    return {"workers": workers, "steps": steps, "seeds": list(seeds), "runs": runs}


def churn(workers: int, steps: int, seeds: tuple[int, ...], out: Path | None = None) -> dict:
    base = [f"sim.workers={workers}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
            "strategy=gasloc", "topology=one_peer", "sim.mean_downtime_rounds=3", "sim.min_live=2"]
    runs = {}
    fractions = (0.0, 0.05, 0.1, 0.2)
    records = _records(out, f"churn_n{workers}", len(fractions) * len(seeds))
    with tempfile.TemporaryDirectory() as tmp:
        runner = records.sim(Path(tmp))
        for fraction in fractions:
            runs[str(fraction)] = seeded(base + [f"sim.down_fraction={fraction}"], Path(tmp) / str(fraction), seeds,
                                         runner=runner)
            print(describe(f"{fraction:.0%} down", runs[str(fraction)]), flush=True)
    return {"workers": workers, "steps": steps, "seeds": list(seeds), "runs": runs}


def paired_ratios(run: dict, reference: dict) -> list[float]:
    """Per-seed ratios of ``run``'s final loss to ``reference``'s on the same seed (one ratio for a one-seed record)."""
    if "seeds" not in run or "seeds" not in reference:
        return [run["val_loss"] / reference["val_loss"]]
    common = sorted(set(run["seeds"]) & set(reference["seeds"]), key=int)
    if not common:
        raise ValueError("the two runs share no seed: their losses cannot be paired")
    return [run["seeds"][seed]["val_loss"] / reference["seeds"][seed]["val_loss"] for seed in common]


def mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and sample sd of ``values`` (sd 0 for one value: a probe, drawn without a bar)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def plot_summary(folder: Path, path: Path) -> None:
    """Quality vs n, H = 1 at n = 64, networks at n = 64 and churn, from the parts' JSON files in ``folder``."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(14, 3.8))
    axes = figure.subplots(1, 4)
    sizes = [n for n in (16, 64, 256) if (folder / f"quality_n{n}.json").is_file()]
    quality = {n: json.loads((folder / f"quality_n{n}.json").read_text())["runs"] for n in sizes}
    for name in ("one_peer", "two_peer", "ring", "exponential"):
        means, sds = zip(*(mean_sd(paired_ratios(quality[n][name], quality[n]["diloco"])) for n in sizes))
        axes[0].errorbar(sizes, means, yerr=sds, fmt="o-", capsize=3, label=name)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    seeds = ", ".join(f"{n}: {len(paired_ratios(quality[n]['diloco'], quality[n]['diloco']))}" for n in sizes)
    axes[0].set(xscale="log", xlabel=f"workers n (seeds {seeds})", ylabel="val loss / DiLoCo's (paired, mean ± sd)",
                title="2. quality vs n (50 steps)")
    axes[0].set_xticks(sizes, [str(n) for n in sizes])
    axes[0].minorticks_off()
    axes[0].legend(fontsize=7)
    if (folder / "h1_n64.json").is_file():
        bars = h1_bars(json.loads((folder / "h1_n64.json").read_text())["runs"])
        labels, means, sds, seeds = zip(*bars) if bars else ((), (), (), ())
        axes[1].bar(range(len(bars)), [m - 1.0 for m in means], bottom=1.0, yerr=sds, capsize=3,
                    color=["C1" if m < 1.0 else "C0" for m in means])
        axes[1].set_xticks(range(len(bars)), labels, fontsize=6)
        axes[1].axhline(1.0, color="grey", lw=0.8)
        counts = "/".join(str(n) for n in sorted(set(seeds))) or "no"
        axes[1].set(ylabel=f"GASLoC / gossip val loss (paired, ± sd, {counts} seeds)",
                    title="3. H = 1, n = 64 (< 1: GASLoC ahead)")
    if (folder / "networks_n64.json").is_file():
        networks = json.loads((folder / "networks_n64.json").read_text())["networks"]
        for index, (network, runs) in enumerate(networks.items()):
            for name, run in runs.items():
                times = [t for _, _, t in run["trace"]]
                losses = [loss for _, loss, _ in run["trace"]]
                axes[2].plot(times, losses, ["-", "--"][index], label=f"{network} {name}", lw=1)
        axes[2].set(xscale="log", xlabel="simulated s", ylabel="val loss", title="4. networks at n = 64", ylim=(2.5, 3.3))
        axes[2].legend(fontsize=5)
    for n in (16, 64):
        if (folder / f"churn_n{n}.json").is_file():
            runs = json.loads((folder / f"churn_n{n}.json").read_text())["runs"]
            shares = sorted(runs, key=float)
            means, sds = zip(*(mean_sd(paired_ratios(runs[k], runs[shares[0]])) for k in shares))
            seeds = len(paired_ratios(runs[shares[0]], runs[shares[0]]))
            axes[3].errorbar([100 * float(k) for k in shares], means, yerr=sds, fmt="o-", capsize=3,
                             label=f"n = {n} ({seeds} seeds)")
    axes[3].axhline(1.0, color="grey", lw=0.8)
    axes[3].set(xlabel="% of workers down", ylabel="val loss / no churn (paired, mean ± sd)", title="5. churn (one_peer)")
    axes[3].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("acceleration", "quality", "churn", "h1", "networks", "plots"), required=True)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6, help="networks: DiLoCo's rounds (GASLoC gets 1.5x)")
    parser.add_argument("--inner-steps", type=int, default=10, help="networks: H")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="quality, churn, h1: seeds run per configuration (h1: the held-out seeds)")
    parser.add_argument("--tuning-seed", type=int, default=0, help="h1: the seed its tuned values are chosen on")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/at_scale"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "plots":  # from the other parts' results in --out
        plot_summary(args.out, args.out / "at_scale.png")
        return
    if args.part == "acceleration":
        result = acceleration(tuple(n for n in SIZES if n <= args.max_n), args.out)
        plot_acceleration(result, args.out / "acceleration.png")
    elif args.part == "quality":
        result = quality(args.workers, args.steps, tuple(args.seeds), args.out)
    elif args.part == "h1":
        try:
            result = h1(args.workers, args.steps, tuple(args.seeds), args.tuning_seed, args.out)
        except ValueError as error:  # h1 checks its seeds before any run
            parser.error(str(error))
    elif args.part == "networks":
        result = networks(args.workers, args.rounds, args.inner_steps, args.out)
    else:
        result = churn(args.workers, args.steps, tuple(args.seeds), args.out)
    name = args.part if args.part == "acceleration" else f"{args.part}_n{args.workers}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
