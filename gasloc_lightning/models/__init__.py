"""Models trained by each GASLoC worker: a byte-level GPT and its LightningModule."""

from gasloc_lightning.models.gpt import GPT, PRESETS, GPTConfig
from gasloc_lightning.models.lm import LanguageModel, parameter_groups, warmup_cosine_factor

__all__ = ["GPT", "GPTConfig", "LanguageModel", "PRESETS", "parameter_groups", "warmup_cosine_factor"]
