"""Render a run's TensorBoard scalars as one PNG laid out like TensorBoard's scalar dashboard.

There is no browser on the machine the README's figure was made on, so this draws the run's own event files
(read with TensorBoard's ``EventAccumulator``, as ``tensorboard --logdir`` reads them) with matplotlib: one panel
per series, titled with its tag, one line per TensorBoard run (``worker_<W>``, ``launcher``) in a fixed colour,
the runs listed on the left as TensorBoard's run selector does. It is a rendering of the event files, not a
screenshot of TensorBoard.

Usage::

    python benchmarks/tensorboard_view.py <output_dir>/tensorboard --out docs/live_view_tensorboard.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_TAGS = ("train/loss", "val/loss", "comm/consensus_distance", "comm/bytes_sent",
                "launcher/quorum_size", "launcher/live_workers", "launcher/bytes_in_per_s", "launcher/events")
_COLOURS = ("#425066", "#12b5cb", "#e52592", "#f9ab00", "#9334e6", "#7cb342", "#ff7043", "#1a73e8")


def read_scalars(board: Path, tags: tuple[str, ...]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{tag: {run: [(step, value), ...]}}`` for every run folder under ``board`` that logged the tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[str, list[tuple[int, float]]]] = {tag: {} for tag in tags}
    for run in sorted(p for p in board.iterdir() if p.is_dir()):
        events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in set(tags) & set(events.Tags()["scalars"]):
            series[tag][run.name] = [(event.step, event.value) for event in events.Scalars(tag)]
    return {tag: runs for tag, runs in series.items() if runs}


def render(series: dict[str, dict[str, list[tuple[int, float]]]], out: Path, title: str) -> None:
    from matplotlib.figure import Figure

    runs = sorted({run for by_run in series.values() for run in by_run})
    colour = {run: _COLOURS[i % len(_COLOURS)] for i, run in enumerate(runs)}
    columns = 3
    rows = -(-len(series) // columns)
    figure = Figure(figsize=(12.5, 2.6 * rows + 0.5), facecolor="#f5f6f7")
    grid = figure.add_gridspec(rows, columns + 1, width_ratios=[0.55] + [1.0] * columns, wspace=0.28, hspace=0.55)
    selector = figure.add_subplot(grid[:, 0])
    selector.axis("off")
    selector.text(0.0, 1.0, "Runs", fontsize=10, fontweight="bold", va="top", transform=selector.transAxes)
    for i, run in enumerate(runs):
        y = 0.94 - 0.06 * i
        selector.add_patch(_square(figure, colour[run], y, selector))
        selector.text(0.14, y, run, fontsize=9, va="center", transform=selector.transAxes)
    for index, (tag, by_run) in enumerate(series.items()):
        axes = figure.add_subplot(grid[index // columns, 1 + index % columns], facecolor="white")
        for run, points in by_run.items():
            steps, values = zip(*points)
            axes.plot(steps, values, color=colour[run], linewidth=1.2, marker="o" if len(points) < 15 else None,
                      markersize=3)
        axes.set_title(tag, fontsize=9, loc="left")
        axes.tick_params(labelsize=7)
        axes.grid(True, color="#e0e0e0", linewidth=0.6)
        for side in ("top", "right"):
            axes.spines[side].set_visible(False)
    figure.suptitle(title, fontsize=10, x=0.01, ha="left")
    figure.savefig(out, dpi=80)


def _square(figure, colour: str, y: float, axes):
    from matplotlib.patches import Rectangle

    return Rectangle((0.0, y - 0.015), 0.09, 0.03, color=colour, transform=axes.transAxes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("board", type=Path, help="the run's TensorBoard folder (<output_dir>/tensorboard)")
    parser.add_argument("--out", type=Path, default=Path("tensorboard_view.png"))
    parser.add_argument("--tags", nargs="+", default=list(DEFAULT_TAGS))
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    series = read_scalars(args.board, tuple(args.tags))
    if not series:
        raise SystemExit(f"no scalars of {args.tags} under {args.board}")
    render(series, args.out, args.title or f"Scalars of {args.board} (rendered from its event files)")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB): {len(series)} series", flush=True)


if __name__ == "__main__":
    main()
