"""Launch limits the kernels cannot check themselves: int32 offsets and grid dimensions.

A kernel that computes ``b * stride_b + t * stride_t`` in int32 wraps past 2^31 elements and reads
the wrong memory, silently; a grid with more than 65535 programs along y or z does not launch. The
launchers call these checks with the tensors and grid they are about to use and raise a clear
error naming the kernel, the number, and the largest batch that fits (CPU-testable with ``meta``
tensors: no memory, no kernel).
"""
from __future__ import annotations

import torch

INT32_MAX = 2 ** 31 - 1
MAX_GRID_X = 2 ** 31 - 1
MAX_GRID_YZ = 65535


def max_element_offset(t: torch.Tensor) -> int:
    """The largest element offset from ``t``'s first element that indexing ``t`` reaches."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def check_int32_offsets(kernel: str, batch: int, **tensors: torch.Tensor) -> None:
    """Raise if a kernel that indexes these tensors with int32 offsets would overflow."""
    for name, t in tensors.items():
        if t is None:
            continue
        span = max_element_offset(t)
        if span > INT32_MAX:
            per_sample = max(span // max(batch, 1), 1)
            raise ValueError(
                f"{kernel}: {name} {tuple(t.shape)} spans {span} elements, past the 2^31 - 1 this kernel can "
                f"address with int32 offsets; use a batch of at most {max(INT32_MAX // per_sample, 1)} "
                f"(micro-batches) for this shape")


def check_grid(kernel: str, grid: tuple, *, per_batch_y: int | None = None) -> None:
    """Raise if a launch grid exceeds the hardware's limits (x < 2^31, y and z <= 65535)."""
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if grid[0] > MAX_GRID_X:
        raise ValueError(f"{kernel}: grid x = {grid[0]} > {MAX_GRID_X}")
    for axis, size in zip("yz", grid[1:]):
        if size > MAX_GRID_YZ:
            hint = (f"; use a batch of at most {MAX_GRID_YZ // per_batch_y} for this shape"
                    if axis == "y" and per_batch_y else "")
            raise ValueError(f"{kernel}: grid {axis} = {size} programs > {MAX_GRID_YZ}, the hardware limit{hint}")
