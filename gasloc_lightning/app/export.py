"""``gasloc-export``: average the replicas of a per-rank checkpoint into one standard checkpoint."""

from __future__ import annotations

import argparse

from gasloc_lightning.plugins.per_rank import CheckpointFormatError, export_consensus


def main(argv: list[str] | None = None) -> int:
    """``gasloc-export CKPT_DIR [CKPT_DIR ...] OUT.ckpt [--trust-checkpoint-code]``: average the replicas into one
    checkpoint (several directories: one weight each, e.g. the models of an elastic run that split)."""
    parser = argparse.ArgumentParser(prog="gasloc-export", description=export_consensus.__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", nargs="+",
                        help="a per-rank checkpoint directory written by GASLoC or DiLoCo (path or URL); several are "
                             "merged with one weight each (each one's replicas averaged first)")
    parser.add_argument("output", help="path or URL of the single-file consensus checkpoint to write")
    parser.add_argument(
        "--trust-checkpoint-code", action="store_true",
        help="load files that a safe load refuses (torch.load(weights_only=False)): this runs code stored in the "
             "checkpoint, so use it only for files you trust",
    )
    args = parser.parse_args(argv)
    try:
        report = export_consensus(args.checkpoint_dir, args.output, weights_only=not args.trust_checkpoint_code)
    except CheckpointFormatError as error:
        parser.exit(2, f"gasloc-export: error: {error}\n")
    print(
        f"averaged {report['replicas']} replicas ({report['world_size']} rank files"
        f"{'' if report['directories'] == 1 else ', ' + str(report['directories']) + ' directories, one weight each'}) "
        f"into {args.output} "
        f"(consensus distance averaged away: {report['consensus_distance']:.6g})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
