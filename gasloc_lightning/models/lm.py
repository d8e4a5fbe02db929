"""The LightningModule each GASLoC worker trains: next-byte prediction with a GPT.

It is a plain automatic-optimization module: the inner optimizer and its schedule live here,
and the GASLoC strategy (local steps, gossip, outer momentum) wraps the optimizer step without
this module knowing about it. Nothing here talks to torch.distributed; validation metrics are
torchmetrics objects, which synchronise across ranks themselves when logged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, fields
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from gasloc_lightning.models.gpt import GPT, PRESETS, GPTConfig
from gasloc_lightning.models.hf import HFCausalLM, HFCausalLMConfig
from gasloc_lightning.models.sharding import is_sharded, shard_by_block

OptimizerFactory = Callable[[Iterable[Any]], Optimizer]


def warmup_cosine_factor(
    step: int, *, warmup_steps: int, max_steps: int | None, min_lr_ratio: float
) -> float:
    """Learning-rate multiplier at optimizer step ``step``.

    Linear warmup over ``warmup_steps`` steps, then a cosine decay from 1 to ``min_lr_ratio``
    reached at ``max_steps`` and held afterwards. With ``max_steps=None`` the rate stays
    constant after warmup.

    Args:
        step: number of optimizer steps already taken (0 for the first step).
        warmup_steps: length of the linear warmup.
        max_steps: step at which the decay ends, or None for no decay.
        min_lr_ratio: final multiplier of the decay.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps is None or max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_optimizer(params: Iterable[Any]) -> Optimizer:
    """AdamW(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1), the inner optimizer by default."""
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def parameter_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices of Linear layers) and an undecayed one.

    Biases, LayerNorm weights and embeddings (hence the tied output head) get no weight decay.
    The decayed group leaves ``weight_decay`` unset so the optimizer's own value applies.

    Args:
        model: the module whose parameters to group; tied parameters appear once.
    """
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.LayerNorm))}
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.dim() >= 2 and id(parameter) not in no_decay_ids:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ModelConfig = GPTConfig | HFCausalLMConfig


def _to_config(model: ModelConfig | dict | str) -> ModelConfig:
    if isinstance(model, (GPTConfig, HFCausalLMConfig)):
        return model
    if isinstance(model, str):
        return GPTConfig.preset(model)
    if isinstance(model, Mapping):  # a dict or an OmegaConf DictConfig (e.g. hparams from a checkpoint)
        kind = HFCausalLMConfig if {"model_type", "config_path"} & set(model) else GPTConfig
        unknown = set(model) - {field.name for field in fields(kind)}
        if unknown:
            raise ValueError(f"model has unknown {kind.__name__} fields {sorted(unknown)}")
        return kind(**model)
    raise ValueError(
        f"model must be a GPTConfig, an HFCausalLMConfig, a dict of the fields of either or one of "
        f"{sorted(PRESETS)}, got {model!r}"
    )


def _build_network(config: ModelConfig) -> nn.Module:
    return HFCausalLM(config) if isinstance(config, HFCausalLMConfig) else GPT(config)


class LanguageModel(pl.LightningModule):
    """Next-byte language model: a :class:`GPT` (or a Hugging Face causal LM) trained with cross-entropy.

    Batches are ``(x, y)`` pairs of (B, T) long tensors with ``y`` shifted one byte ahead.

    Logged metrics:
        - ``train/loss``: per-step cross-entropy (nats per byte), in the progress bar.
        - ``train/tokens``: bytes seen by THIS worker since the start of training (restored on
          resume). The global count is this times the world size, since every worker takes the
          same number of steps on equally sized batches.
        - ``val/loss``, ``val/ppl`` and ``test/loss``, ``test/ppl``: token-weighted mean
          cross-entropy and its exponential, synchronised across ranks.

    Args:
        model: a :class:`GPTConfig`, an :class:`HFCausalLMConfig` (any transformers causal LM,
            random init), a dict of the fields of either (one with ``model_type`` or
            ``config_path`` is a Hugging Face model), or a GPT preset name ("tiny", "small",
            "gpt2_125m").
        optimizer: builds the inner optimizer from parameter groups (a list of dicts, as torch
            optimizers accept), e.g. a Hydra ``_partial_: true`` node; None means AdamW(lr=3e-4,
            betas=(0.9, 0.95), weight_decay=0.1). It is not saved in the checkpoint's
            hyperparameters (a partial does not serialise): pass it again to
            ``load_from_checkpoint`` to resume with a custom optimizer.
        warmup_steps: optimizer steps of linear learning-rate warmup.
        max_steps: optimizer step at which the cosine decay reaches ``min_lr_ratio``; None takes
            ``trainer.max_steps``, and if that is -1 (unbounded) the rate is constant after warmup.
        min_lr_ratio: final learning rate as a fraction of the peak, in [0, 1].
    """

    def __init__(
        self,
        *,
        model: ModelConfig | dict | str = "tiny",
        optimizer: OptimizerFactory | None = None,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        config = _to_config(model)
        if optimizer is not None and not callable(optimizer):
            raise ValueError(f"optimizer must be callable or None, got {optimizer!r}")
        if not _is_int(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        # The config is stored as a plain dict so checkpoints load with weights_only=True.
        self.save_hyperparameters(
            {
                "model": asdict(config),
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "min_lr_ratio": min_lr_ratio,
            }
        )
        self.config = config
        self.model = _build_network(config)
        self._optimizer_factory = optimizer or default_optimizer
        self.tokens_seen = 0  # per worker; a plain int so gossip/averaging never touches it
        self.val_loss, self.val_ppl = MeanMetric(), Perplexity()
        self.test_loss, self.test_ppl = MeanMetric(), Perplexity()

    def configure_model(self) -> None:
        """With a device mesh from the strategy (a worker sharded over its ranks, ``intra_worker="fsdp"``), shard the
        network by block with FSDP2; without one, nothing (Lightning's ``configure_model`` convention)."""
        if self.device_mesh is None or is_sharded(self.model):
            return
        shard_by_block(self.model, self.model.shard_blocks(), self.device_mesh)

    def forward(self, idx: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        return self.model(idx)

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Mean next-byte cross-entropy of a batch (GASLoCCallback uses it for each replica's own loss)."""
        x, y = batch  # (B, T), (B, T)
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch  # (B, T)
        loss = self.compute_loss(batch)
        self.tokens_seen += x.numel()
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        # float64 keeps the count exact far past float32's 2^24.
        tokens = torch.tensor(float(self.tokens_seen), dtype=torch.float64)
        self.log("train/tokens", tokens, on_step=True, on_epoch=False, reduce_fx="max")
        return loss

    def on_validation_epoch_start(self) -> None:
        # A model that comes back from a launcher still holds the last evaluation's metric states;
        # without a reset, the next trainer.validate would average them into its own result.
        self.val_loss.reset()
        self.val_ppl.reset()

    def on_test_epoch_start(self) -> None:
        self.test_loss.reset()
        self.test_ppl.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_ppl, prefix="val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_ppl, prefix="test")

    def _evaluate(
        self, batch: tuple[Tensor, Tensor], loss_metric: MeanMetric, ppl_metric: Perplexity, prefix: str
    ) -> None:
        x, y = batch  # (B, T), (B, T)
        logits = self(x).float()  # (B, T, V); float32 so the metrics do not round in bf16
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss_metric.update(loss, weight=y.numel())  # token-weighted, so exp(loss) == ppl
        ppl_metric.update(logits, y)
        # Metric objects sync their states across ranks at compute(); sync_dist is for clarity.
        self.log(f"{prefix}/loss", loss_metric, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}/ppl", ppl_metric, on_step=False, on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self._optimizer_factory(parameter_groups(self.model))
        schedule = functools.partial(
            warmup_cosine_factor,
            warmup_steps=self.hparams.warmup_steps,
            max_steps=self._decay_steps(),
            min_lr_ratio=self.hparams.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _decay_steps(self) -> int | None:
        if self.hparams.max_steps is not None:
            return self.hparams.max_steps
        trainer_max_steps = self._trainer.max_steps if self._trainer is not None else -1
        return None if trainer_max_steps == -1 else trainer_max_steps

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
