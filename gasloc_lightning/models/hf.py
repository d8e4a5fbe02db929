"""Hugging Face causal LMs as the network a GASLoC worker trains: built from a config, never downloaded.

:class:`HFCausalLMConfig` names an architecture (a transformers ``model_type`` such as
``"gpt2"`` or ``"llama"``, or a local ``config.json``) plus keyword overrides, and
:class:`HFCausalLM` builds it with ``AutoModelForCausalLM.from_config``: random initialisation,
no weights and no hub access. The wrapper maps (B, T) byte ids to (B, T, V) logits like
:class:`~gasloc_lightning.models.GPT`, so :class:`~gasloc_lightning.models.LanguageModel` trains
it with the same loss, optimizer groups and schedule, under any strategy.

Bytes are the tokens: the vocabulary is 256 and the model has no special tokens (``bos``,
``eos`` and ``pad`` ids are cleared unless an override sets them). ``transformers`` is an
optional dependency (``pip install 'gasloc-lightning[hf]'``), imported only when a model is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _transformers() -> Any:
    try:
        import transformers  # optional dependency, imported only when a model is built
    except ImportError as error:
        raise ImportError(
            "model=hf_causal_lm needs the optional 'transformers' package: pip install 'gasloc-lightning[hf]'"
        ) from error
    return transformers


@dataclass
class HFCausalLMConfig:
    """A transformers causal LM, as a config (random init; nothing is downloaded).

    Args:
        model_type: a transformers model type ("gpt2", "llama", "mistral", ...) whose config class
            supplies the defaults; with ``config_path`` it must match the file's ``model_type``
            or be None.
        config_path: a local ``config.json``, or a folder holding one (e.g. a checkpoint folder
            copied from the hub beforehand). Only the architecture is read, never weights.
        overrides: config fields to set on top (e.g. ``{"n_layer": 2, "n_embd": 64}``); a key
            the config class does not know is an error.
        block_size: T, the longest sequence trained on; at most the config's positions.
        vocab_size: V, always set on the config (256: bytes).
    """

    model_type: str | None = None
    config_path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    block_size: int = 256
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.model_type is None and self.config_path is None:
            raise ValueError("model_type or config_path must be given (e.g. model_type='gpt2')")
        for name in ("block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"overrides must be a mapping of config fields, got {self.overrides!r}")
        self.overrides = dict(self.overrides)
        if self.config_path is not None:
            self.config_path = os.fspath(self.config_path)

    def transformers_config(self) -> Any:
        """The ``transformers.PretrainedConfig`` this describes (validated)."""
        transformers = _transformers()
        stored = self._stored_fields()
        model_type = stored.pop("model_type", None) or self.model_type
        if self.model_type is not None and model_type != self.model_type:
            raise ValueError(
                f"model_type={self.model_type!r} but {self.config_path} holds a {model_type!r} config"
            )
        if model_type not in transformers.CONFIG_MAPPING:
            raise ValueError(
                f"model_type must be a transformers model type (e.g. 'gpt2', 'llama'), got {model_type!r}"
            )
        config_class = transformers.CONFIG_MAPPING[model_type]
        known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(f"overrides has fields a {model_type!r} config does not know: {unknown}")
        cleared = {name: None for name in _SPECIAL_TOKENS}
        config = config_class(**{**stored, **cleared, **self.overrides, "vocab_size": self.vocab_size})
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and self.block_size > positions:
            raise ValueError(f"block_size={self.block_size} exceeds the config's {positions} positions")
        return config

    def _stored_fields(self) -> dict[str, Any]:
        if self.config_path is None:
            return {}
        path = Path(self.config_path).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"config_path: no config.json at {path}")
        return json.loads(path.read_text())


class HFCausalLM(nn.Module):
    """A transformers causal LM with the GPT's interface: (B, T) ids -> (B, T, V) logits.

    Args:
        config: the architecture (see :class:`HFCausalLMConfig`).
    """

    def __init__(self, config: HFCausalLMConfig) -> None:
        super().__init__()
        self.config = config
        self.network = _transformers().AutoModelForCausalLM.from_config(config.transformers_config())

    def shard_blocks(self) -> list[nn.Module]:
        """The decoder layers (the classes transformers names in ``_no_split_modules``), sharded one by one."""
        names = set(getattr(self.network, "_no_split_modules", None) or ())
        # by the classes' whole lineage: once sharded, a layer's class is FSDP2's subclass of it
        return [module for module in self.network.modules()
                if any(cls.__name__ in names for cls in type(module).__mro__)]

    def forward(self, idx: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.config.block_size}")
        return self.network(input_ids=idx, use_cache=False).logits  # (B, T, V)
