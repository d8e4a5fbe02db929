"""Launched by `torchrun --nproc_per_node 2`: strategy="gasloc" by name (default H = 50), the multi-node path of docs/user_guide.md."""

import atexit
import sys

import lightning.pytorch as pl
import torch.distributed as dist

import gasloc_lightning  # noqa: F401  (registers strategy="gasloc")

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from dist_utils import RecordParameters, TinyRegressor  # noqa: E402

if __name__ == "__main__":
    out_dir = sys.argv[1]
    # Registered first, so it runs last (atexit is last in, first out): after the strategy's own exit handler.
    atexit.register(lambda: print(f"process group alive at exit: {dist.is_initialized()}", flush=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="gasloc", max_steps=150, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, use_distributed_sampler=False, limit_val_batches=0,
        callbacks=[RecordParameters(out_dir)], default_root_dir=out_dir,
    )
    trainer.fit(TinyRegressor())
    print(f"process group alive after fit: {dist.is_initialized()}", flush=True)  # usable until exit
