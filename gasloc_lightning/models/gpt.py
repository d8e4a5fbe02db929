"""A compact byte-level GPT: the model every GASLoC worker trains locally.

One readable file in the spirit of nanoGPT: a dataclass config, pre-LayerNorm transformer
blocks, causal self-attention through ``F.scaled_dot_product_attention`` and an output head
tied to the token embedding. Tying matters for the gossip transport: the shared matrix is a
single ``nn.Parameter``, so ``model.parameters()`` yields it once and it is sent once.

Token arithmetic of the presets (vocabulary = 256 bytes, so embeddings are small):

- ``tiny``: 2 layers x 64 dims, block 64 -> about 0.12M parameters; seconds per epoch on a CPU.
- ``small``: 6 layers x 384 dims, block 256 -> about 10.8M parameters.
- ``gpt2_125m``: the GPT-2 small *body* (12 layers, 12 heads, 768 dims, block 1024). GPT-2's
  124M count includes a 50257 x 768 token embedding (38.6M); with 256 byte tokens the same body
  has about 86M parameters (85M of them outside the embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PRESETS: dict[str, dict[str, int]] = {
    # 12 * n_layer * n_embd^2 = 98k in the blocks + (256 + 64) * 64 = 20k in the embeddings
    "tiny": {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64},
    # 12 * 6 * 384^2 = 10.6M in the blocks + (256 + 256) * 384 = 0.2M in the embeddings
    "small": {"block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384},
    # 12 * 12 * 768^2 = 84.9M in the blocks + (256 + 1024) * 768 = 1.0M in the embeddings
    "gpt2_125m": {"block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768},
}


@dataclass
class GPTConfig:
    """Shape of a GPT.

    Args:
        vocab_size: number of token ids; 256 for raw bytes.
        block_size: longest sequence the position embedding covers (T <= block_size).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream (C).
        dropout: dropout probability on attention weights and residual branches, in [0, 1).
        bias: whether Linear and LayerNorm layers carry a bias.
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be a bool, got {self.bias!r}")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named configuration from :data:`PRESETS`.

        Args:
            name: one of ``"tiny"``, ``"small"``, ``"gpt2_125m"``.
            overrides: fields to change from the preset (e.g. ``dropout=0.1``).
        """
        if name not in PRESETS:
            raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wide with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))  # (B, T, 4C)
        return self.dropout(self.proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer mapping token ids to next-token logits.

    Args:
        config: the model's shape; see :class:`GPTConfig`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, counted and sent once
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer)
        # so the stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits.

        Args:
            idx: (B, T) long tensor of token ids with T <= ``config.block_size``.

        Returns:
            (B, T, vocab_size) logits; position t predicts token t + 1.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"idx has T={T} tokens, more than block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def shard_blocks(self) -> list[nn.Module]:
        """The units FSDP shards on their own (see :mod:`gasloc_lightning.models.sharding`): the blocks."""
        return list(self.blocks)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (the tied head/embedding matrix counts once).

        Args:
            exclude_embeddings: leave out the token and position embeddings, the usual
                convention when comparing model sizes across vocabularies.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.wte.weight.numel() + self.wpe.weight.numel()
        return total
