"""Launch limits the kernels cannot check themselves: grid dimensions.

A grid with more than 2^31 - 1 programs along x (65535 along y or z) does not launch. The
launchers call :func:`check_grid` with the grid they are about to use and raise a clear error
naming the kernel and the number (CPU-testable with ``meta`` tensors: no memory, no kernel).
The attention kernels fold batch x heads into x and compute batch / head / block offsets in
64 bits (kernels/attention.py), so neither a batch nor a packed buffer past 2^31 elements
reaches a limit there.
"""
from __future__ import annotations

MAX_GRID_X = 2 ** 31 - 1
MAX_GRID_YZ = 65535


def check_grid(kernel: str, grid: tuple) -> None:
    """Raise if a launch grid exceeds the hardware's limits (x < 2^31, y and z <= 65535)."""
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if grid[0] > MAX_GRID_X:
        raise ValueError(f"{kernel}: grid x = {grid[0]} programs > {MAX_GRID_X}, the hardware limit; "
                         f"split the batch (micro-batches)")
    for axis, size in zip("yz", grid[1:]):
        if size > MAX_GRID_YZ:
            raise ValueError(f"{kernel}: grid {axis} = {size} programs > {MAX_GRID_YZ}, the hardware limit")
