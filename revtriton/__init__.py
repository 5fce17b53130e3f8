"""revtriton: reversible transformer blocks for LLM and ViT training, with Triton kernels."""
from .halves import (CouplingHalf, GenericHalf, LayerNormAttention, LayerNormMLP, RMSNormAttention,
                     RMSNormSwiGLU, as_half)

__version__ = "0.1.0"
from .engine import ReversibleBlock, ReversibleStack  # noqa: E402
from .schedules import ScheduleTrace  # noqa: E402
