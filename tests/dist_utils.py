"""Module-level models and callbacks for multi-process tests (anything that crosses a spawn lives here)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(pl.LightningModule):
    """A small MLP with a BatchNorm (float buffers mixed, an integer buffer left local) and rank-specific data.

    No bias before the BatchNorm: its true gradient is zero, and Adam would turn float noise into lr-sized steps.
    """

    def __init__(self, inner_lr: float = 0.05, optimizer: str = "adamw", batches: int = 64, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def compute_loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.compute_loss(batch), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.inner_lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.inner_lr)

    def _data(self, split_seed: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(self.hparams.seed * 1000 + split_seed * 100 + self.global_rank)
        x = torch.randn(self.hparams.batches * 4, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True) * (1 + self.global_rank) + 0.1 * torch.randn(len(x), 1, generator=generator)
        return TensorDataset(x, y)

    def train_dataloader(self):
        return DataLoader(self._data(0), batch_size=4, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self._data(1), batch_size=16)


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


class RecordParameters(Callback):
    """Every rank saves its flat parameters after each optimizer step and at train end."""

    def __init__(self, out_dir: str, perturb: float = 0.0):
        self.out_dir = out_dir
        self.perturb = perturb
        self.history: list[torch.Tensor] = []
        self.rounds: list[int] = []

    def on_train_start(self, trainer, pl_module):
        if self.perturb:
            generator = torch.Generator().manual_seed(99 + trainer.global_rank)
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(self.perturb * torch.randn(p.shape, generator=generator))
        self.history.append(flat_parameters(pl_module))
        self.rounds.append(trainer.strategy.round_index)

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.history.append(flat_parameters(pl_module))
        self.rounds.append(trainer.strategy.round_index)

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        record = {
            "history": torch.stack(self.history),
            "rounds": self.rounds,
            "final": flat_parameters(pl_module),
            "bytes_sent": strategy.bytes_sent,
            "bytes_received": strategy.bytes_received,
            "round_index": strategy.round_index,
            "exchanged_numel": strategy.layout.numel,
            "global_step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "sim_time": strategy.sim_time,
        }
        self._record = record

    def on_fit_end(self, trainer, pl_module):
        """After GASLoCCallback's end of fit (final round, averaging)."""
        self._record["after_fit"] = flat_parameters(pl_module)
        self._record["rounds_at_fit_end"] = trainer.strategy.round_index
        self._record["sim_time_at_fit_end"] = trainer.strategy.sim_time
        self._record["throttled_seconds"] = trainer.strategy.throttled_seconds
        torch.save(self._record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "reduce_scatter", "barrier",
                "batch_isend_irecv", "reduce", "gather", "scatter", "all_to_all")


class CountCollectives(Callback):
    """Counts torch.distributed calls between optimizer steps, writing them per rank."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.per_step: list[dict[str, int]] = []
        self._counts: dict[str, int] = {}
        self._originals: dict = {}

    def on_train_start(self, trainer, pl_module):
        for name in _COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._counting(name, original))

    def _counting(self, name, original):
        def wrapper(*args, **kwargs):
            self._counts[name] = self._counts.get(name, 0) + 1
            return original(*args, **kwargs)
        return wrapper

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.per_step.append({"round": trainer.strategy.round_index, **self._counts})
        self._counts = {}

    def on_train_end(self, trainer, pl_module):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        torch.save(self.per_step, Path(self.out_dir) / f"collectives{trainer.global_rank}.pt")


def load_ranks(out_dir, world_size: int, prefix: str = "rank") -> list:
    return [torch.load(Path(out_dir) / f"{prefix}{r}.pt", weights_only=False) for r in range(world_size)]


class ManualRegressor(TinyRegressor):
    """Manual optimization with one optimizer: the strategy still counts one step per ``opt.step()``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.compute_loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        return loss


class ScheduledRegressor(TinyRegressor):
    """An inner LR scheduler stepped every optimizer step."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.inner_lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PerRankWeights(TinyRegressor):
    """Each rank sets its own weights in ``setup`` (as a per-rank checkpoint would) and records what it evaluates."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def setup(self, stage):
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * (self.global_rank + 1))
        self.before = flat_parameters(self)

    def on_validation_start(self):
        self.evaluated = flat_parameters(self)

    def on_validation_end(self):  # module hooks run after every callback's: the replica is back
        record = {"before": self.before, "evaluated": self.evaluated, "after": flat_parameters(self)}
        torch.save(record, Path(self.out_dir) / f"validate{self.global_rank}.pt")


def write_text_corpus(directory: Path, files: int = 12, size: int = 6000) -> Path:
    """A small deterministic text folder for LM tests (no stdlib scan, no download)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "gossip", "round", "peer", "model", "train", "loss"]
    for i in range(files):
        picks = torch.randint(len(words), (size // 6,), generator=generator).tolist()
        (directory / f"doc{i}.txt").write_text(" ".join(words[k] for k in picks))
    return directory


class SaveFinalState(Callback):
    """Every rank saves its replica and the strategy's state when training ends (before end-of-fit averaging)."""

    def __init__(self, out_dir: str, tag: str):
        self.out_dir, self.tag = out_dir, tag

    def on_train_end(self, trainer, pl_module):
        record = {"params": [p.detach().clone() for p in pl_module.parameters()],
                  "strategy": trainer.strategy.strategy_state_dict(), "global_step": trainer.global_step,
                  "optimizer": trainer.optimizers[0].state_dict()}
        torch.save(record, Path(self.out_dir) / f"{self.tag}{trainer.global_rank}.pt")


class SleepOnRank(Callback):
    """Rank ``rank`` stalls (sleeps) or dies (exits) at a chosen point."""

    def __init__(self, rank: int, at_step: int | None = None, seconds: float = 0.0, exit_code: int | None = None,
                 during_validation: bool = False):
        self.rank, self.at_step, self.seconds = rank, at_step, seconds
        self.exit_code, self.during_validation = exit_code, during_validation

    def _act(self):
        if self.exit_code is not None:
            os._exit(self.exit_code)
        time.sleep(self.seconds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and self.at_step is not None and trainer.global_step == self.at_step:
            self._act()

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank and self.during_validation and trainer.global_step > 0:
            self._act()


class CorruptMessages(Callback):
    """Rank ``rank`` sends NaN-filled messages (its own replica stays finite)."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank != self.rank:
            return
        transport = trainer.strategy.transport
        post = transport.post

        def corrupt_post(message, peers, round_index, clock=None):
            if isinstance(message, torch.Tensor):
                return post(torch.full_like(message, float("nan")), peers, round_index, clock)
            return post([torch.full_like(m, float("nan")) for m in message], peers, round_index, clock)

        transport.post = corrupt_post


class PoisonOneBatch(TinyRegressor):
    """Rank 1's loss becomes NaN at the chosen steps (its parameters go non-finite)."""

    def __init__(self, poison_steps=(4,), **kwargs):
        super().__init__(**kwargs)
        self.poison_steps = set(poison_steps)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.trainer.global_step in self.poison_steps:
            loss = loss * float("nan")
        return loss


class RankDependentWidth(TinyRegressor):
    """Rank 1 builds a wider first layer: the model signatures differ."""

    def configure_model(self):
        if self.global_rank == 1:
            self.net[0] = nn.Linear(8, 16 + 1, bias=False)
            self.net[1] = nn.BatchNorm1d(17)
            self.net[3] = nn.Linear(17, 1)


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step`` (on every rank, as Lightning requires)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
