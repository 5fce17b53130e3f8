"""Coupling halves: the protocol, the generic half, the transformer halves and the adapter."""
from .adapter import Adapter
from .base import CouplingHalf, GenericHalf, as_half
from .transformer import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU

__all__ = ["Adapter", "CouplingHalf", "GenericHalf", "as_half", "LayerNormAttention", "LayerNormMLP", "RMSNormAttention",
           "RMSNormSwiGLU"]
