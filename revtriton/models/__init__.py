"""Model presets built on the reversible engine: RevViT, RevMViT, RevGPT (GPT-2 and LLaMA styles)."""
from .common import StoredActivationStack, count_parameters, to_reversible, to_stored_activations
from .gpt import GPT_PRESETS, GPTConfig, RevGPT, rev_gpt, rev_llama
from .hf import hf_config, rev_causal_lm
from .mvit import MVIT_PRESETS, PoolingAttention, RevMViT, StageTransition, rev_mvit
from .vit import VIT_PRESETS, RevViT, rev_vit, rev_vit_base, rev_vit_large, rev_vit_small, rev_vit_tiny

__all__ = [
    "GPT_PRESETS", "GPTConfig", "MVIT_PRESETS", "PoolingAttention", "RevGPT", "RevMViT", "RevViT",
    "StageTransition", "StoredActivationStack", "VIT_PRESETS", "count_parameters", "hf_config", "rev_causal_lm",
    "rev_gpt", "rev_llama",
    "rev_mvit", "rev_vit", "rev_vit_base", "rev_vit_large", "rev_vit_small", "rev_vit_tiny", "to_reversible",
    "to_stored_activations",
]
