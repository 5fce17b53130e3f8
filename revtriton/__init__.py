"""revtriton: reversible transformer blocks for LLM and ViT training, with Triton kernels."""
from .convert import revify
from .engine import ReversibleBlock, ReversibleStack
from .halves import (CouplingHalf, GenericHalf, LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU,
                     as_half)
from .models import (GPTConfig, RevGPT, RevMViT, RevViT, rev_gpt, rev_llama, rev_mvit, rev_vit, to_reversible,
                     to_stored_activations)
from .schedules import ScheduleTrace

__version__ = "0.1.0"

__all__ = ["revify", "ReversibleBlock", "ReversibleStack", "CouplingHalf", "GenericHalf", "LayerNormAttention",
           "LayerNormMLP", "RMSNormAttention", "RMSNormSwiGLU", "as_half", "GPTConfig", "RevGPT", "RevMViT", "RevViT",
           "rev_gpt", "rev_llama", "rev_mvit", "rev_vit", "to_reversible", "to_stored_activations", "ScheduleTrace"]
