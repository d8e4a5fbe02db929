"""Models each GASLoC worker trains: a byte-level GPT or a Hugging Face causal LM, in one LightningModule."""

from gasloc_lightning.models.gpt import GPT, PRESETS, GPTConfig
from gasloc_lightning.models.hf import HFCausalLM, HFCausalLMConfig
from gasloc_lightning.models.lm import LanguageModel, parameter_groups, warmup_cosine_factor

__all__ = [
    "GPT", "GPTConfig", "HFCausalLM", "HFCausalLMConfig", "LanguageModel", "PRESETS", "parameter_groups",
    "warmup_cosine_factor",
]
