"""Coupling halves: the protocol, the generic half and the transformer halves."""
from .base import CouplingHalf, GenericHalf, as_half
from .transformer import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU

__all__ = ["CouplingHalf", "GenericHalf", "as_half", "LayerNormAttention", "LayerNormMLP", "RMSNormAttention",
           "RMSNormSwiGLU"]
