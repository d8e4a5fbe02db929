"""Top-k gossip with per-edge error feedback (CHOCO copies): does the disagreement contract, and with which step?

Gossip alone (no training, no outer momentum) on a ring of n workers: every round each worker sends each
neighbour the top-k encoding of the difference between its point and that neighbour's public copy of it
(``EdgeCopies`` of ``algorithm/round.py``), then moves by ``step * sum_j w_ij (x_ji - x_ij)``. The round module
uses step = 1 and refuses sparse codecs; this script measures why, and which damped step (CHOCO's consensus
step size) works. Prints the spread ``||theta - mean|| / ||theta(0) - mean||`` after each checkpoint round, and
the largest drift of the mean (it must stay at float32 rounding for every step).

    python benchmarks/topk_gossip.py            # about 2.6 minutes of CPU (one thread)
"""

from __future__ import annotations

import argparse

import torch

from gasloc_lightning.algorithm.codecs import build_codec
from gasloc_lightning.algorithm.round import EdgeCopies


def gossip(codec_name: str, step: float, *, workers: int, numel: int, rounds: int, seed: int) -> tuple[list[float], float]:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=generator).expand(workers, numel).clone()
    points = start + 0.1 * torch.randn(workers, numel, generator=generator)
    copies = EdgeCopies(start, build_codec(codec_name))
    neighbours = {i: sorted({(i - 1) % workers, (i + 1) % workers}) for i in range(workers)}
    weight = 1.0 / 3.0
    spread0 = float((points - points.mean(0)).norm())
    mean0, drift, spreads = points.mean(0).clone(), 0.0, []
    for t in range(1, rounds + 1):
        wires = {(i, j): copies.encode(points[i], i, j).clone() for i in range(workers) for j in neighbours[i]}
        correction = torch.zeros_like(points)
        for j in range(workers):
            for i in neighbours[j]:
                received = copies.decode(wires[(i, j)], j, i)  # j's copy of i's point
                correction[j] += weight * (received - copies.sent(j, i))
        points += step * correction
        drift = max(drift, float((points.mean(0) - mean0).abs().max()))
        if t in checkpoints(rounds):
            spreads.append(float((points - points.mean(0)).norm()) / spread0)
    return spreads, drift


def checkpoints(rounds: int) -> tuple[int, ...]:
    return tuple(sorted({rounds // 8, rounds // 4, rounds // 2, rounds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"ring of {args.workers}, P = {args.numel}, seed {args.seed}; spread after rounds {checkpoints(args.rounds)}")
    print("| codec | step | spread | max mean drift |")
    print("|---|---|---|---|")
    for codec in ("int8", "topk-0.3-int8", "topk-0.1-int8", "topk-0.01-int8"):
        for step in (1.0, 0.5, 0.2, 0.05):
            spreads, drift = gossip(codec, step, workers=args.workers, numel=args.numel, rounds=args.rounds,
                                    seed=args.seed)
            print(f"| {codec} | {step} | {' / '.join(f'{s:.2g}' for s in spreads)} | {drift:.1e} |")


if __name__ == "__main__":
    main()
