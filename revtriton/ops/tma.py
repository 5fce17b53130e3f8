"""Tensor descriptors (TMA, sm_90): which operands a kernel may describe, and the scratch memory
that kernels building descriptors on the device need.

A descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the unit one
(the CUDA driver's cuTensorMapEncodeTiled rules). The bottom of the ops layer: ops/gemm.py and
ops/fused_attention.py import it.
"""
from __future__ import annotations

import torch

ALIGNMENT = 16  # bytes


def strides_tma_ready(t: torch.Tensor, element_size: int | None = None) -> bool:
    """Whether a row-major view's strides allow a descriptor (its base address is the other condition,
    :func:`tma_aligned`): what a launch plan works out once per call signature, leaving the address to
    each call. ``element_size``: the bytes of the dtype it will be cast to, if not its own."""
    size = t.element_size() if element_size is None else element_size
    return all((stride * size) % ALIGNMENT == 0 for stride in t.stride()[:-1])


def matrix_strides_tma_ready(element_size: int, stride_rows: int, stride_cols: int) -> bool:
    """Whether a matrix's strides can be described: one unit stride, the other a 16-byte multiple
    (the base address is the other condition: :func:`tma_aligned`)."""
    if 1 not in (stride_rows, stride_cols):
        return False
    other = stride_rows if stride_cols == 1 else stride_cols
    return (other * element_size) % ALIGNMENT == 0


def tma_aligned(t: torch.Tensor, offset: int = 0) -> bool:
    """Whether the data ``offset`` elements past ``t``'s start is 16-byte aligned."""
    return (t.data_ptr() + offset * t.element_size()) % ALIGNMENT == 0


def matrix_tma_ready(t: torch.Tensor, stride_rows: int, stride_cols: int, offset: int = 0) -> bool:
    """Whether a matrix read through (stride_rows, stride_cols) from ``offset`` elements past
    ``t``'s data can be described: one unit stride, the other a 16-byte multiple, an aligned base."""
    return matrix_strides_tma_ready(t.element_size(), stride_rows, stride_cols) and tma_aligned(t, offset)


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)  # the current device: the launch's


def ensure_descriptor_allocator(device: torch.device):
    """Kernels that build tensor descriptors on the device need scratch memory from an allocator
    Triton calls at launch; set one (torch's caching allocator) unless the user already did."""
    if device.type != "cuda":
        return
    import triton
    from triton.runtime import _allocation

    # (a context variable: the autograd engine's backward thread sets its own on its first launch)
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_descriptor_scratch)
