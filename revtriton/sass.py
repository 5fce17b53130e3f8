"""Read a compiled kernel: SASS main loops, an issue model, and TTGIR facts (pure text analysis).

Used by the static performance model (perf/static.py) on kernels compiled ahead of time for
sm_90 / sm_80 by :mod:`revtriton.aot`; no GPU is involved. Everything here parses the text that
``cuobjdump -sass`` and Triton's TTGIR print, so it is tested on hand-written snippets.

SASS model (DESIGN.md section 7). A *main loop* is a predicated backward branch whose body holds
tensor-core instructions (HGMMA on sm_90, HMMA on sm_80); unconditional backward branches are
barrier-wait stubs or the trailing self-loop, not loops. Only the innermost such loops count.
Per iteration of a main loop, on one SM:

    issue cycles  = instructions x warps / 4            (four schedulers, one instruction a cycle)
    MUFU cycles   = MUFU instructions x 8 x warps / 4   (16 lanes a cycle: 8 cycles a warp instruction)
    tensor cycles = sum over HGMMA of 2*M*N*K x warpgroups / 4096     (sm_90 dense bf16 / fp16)
                  = HMMA count x 2*m*n*k x warps / 2048                (sm_80, per-warp HMMA)
    ratio         = max(issue, MUFU) / tensor

A ratio <= 0.8 leaves the tensor cores busy; > 1 means the loop is issue-bound. The body is the
address range of the branch, so rarely taken side paths inside it are counted (an upper bound),
and out-of-line stubs outside it are not.
"""
from __future__ import annotations

import dataclasses
import re

# Dense bf16/fp16 tensor-core FLOP per SM per cycle.
TENSOR_FLOP_PER_CYCLE = {90: 4096, 80: 2048}
SCHEDULERS_PER_SM = 4
MUFU_CYCLES_PER_WARP_INSTRUCTION = 8

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@(!?)(U?P\w+)\s+")
_BRANCH_TARGET = re.compile(r"^BRA(?:\.\w+)*\s+(?:`?\(?)?(0x[0-9a-f]+)")
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)")
_HMMA_SHAPE = re.compile(r"^HMMA\.(16)(8)(\d+)")  # m16 n8 k8 / k16: "1688", "16816"


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str | None  # "P0", "!P4", ...; None when unpredicated (or @PT)
    opcode: str             # with modifiers: "HGMMA.64x128x16.F32.BF16"
    text: str

    @property
    def mnemonic(self) -> str:
        return self.opcode.split(".")[0]


def parse_sass(sass: str) -> list[Instruction]:
    """The instructions of a ``cuobjdump -sass`` listing, in address order (one function)."""
    out = []
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        address, text = int(m.group(1), 16), m.group(2).strip()
        predicate = None
        p = _PREDICATE.match(text)
        if p is not None:
            text = text[p.end():]
            if p.group(2) != "PT" or p.group(1):
                predicate = p.group(1) + p.group(2)
        opcode = text.split()[0] if text else ""
        out.append(Instruction(address, predicate, opcode, text))
    return out


def tensor_op_flops(opcode: str) -> int:
    """FLOPs of one tensor-core instruction: per warpgroup for HGMMA, per warp for HMMA; 0 otherwise."""
    m = _HGMMA_SHAPE.match(opcode)
    if m:
        mm, nn, kk = map(int, m.groups())
        return 2 * mm * nn * kk
    m = _HMMA_SHAPE.match(opcode)
    if m:
        mm, nn, kk = map(int, m.groups())
        return 2 * mm * nn * kk
    return 0


@dataclasses.dataclass(frozen=True)
class MainLoop:
    start: int            # address of the first body instruction (the branch target)
    end: int              # address of the backward branch
    instructions: int
    mufu: int
    tensor_ops: tuple     # opcodes of the HGMMA / HMMA instructions in the body
    tensor_flops: int     # per warpgroup (HGMMA) or per warp (HMMA), summed over the body

    def cycles(self, warps: int, arch: int) -> dict:
        """Issue, MUFU and tensor cycles of one iteration on one SM, and their ratio."""
        issue = self.instructions * warps / SCHEDULERS_PER_SM
        mufu = self.mufu * MUFU_CYCLES_PER_WARP_INSTRUCTION * warps / SCHEDULERS_PER_SM
        units = warps / 4 if arch >= 90 else warps  # HGMMA is per warpgroup, HMMA per warp
        tensor = self.tensor_flops * units / TENSOR_FLOP_PER_CYCLE[90 if arch >= 90 else 80]
        return {"issue_cycles": issue, "mufu_cycles": mufu, "tensor_cycles": tensor,
                "ratio": max(issue, mufu) / tensor if tensor else float("inf")}


def main_loops(instructions: list[Instruction]) -> list[MainLoop]:
    """Innermost predicated backward branches whose bodies hold tensor-core instructions."""
    loops = []
    for i, ins in enumerate(instructions):
        if ins.mnemonic != "BRA" or ins.predicate is None:
            continue
        m = _BRANCH_TARGET.match(ins.text)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target > ins.address:
            continue
        body = [x for x in instructions if target <= x.address <= ins.address]
        tensor = tuple(x.opcode for x in body if tensor_op_flops(x.opcode))
        if not tensor:
            continue
        loops.append(MainLoop(target, ins.address, len(body), sum(x.mnemonic == "MUFU" for x in body), tensor,
                              sum(tensor_op_flops(op) for op in tensor)))
    # Keep the innermost: drop a loop that encloses another tensor loop.
    return [a for a in loops
            if not any(b is not a and a.start <= b.start and b.end <= a.end and (b.start, b.end) != (a.start, a.end)
                       for b in loops)]


# ---------------------------------------------------------------- TTGIR

_MMA_LAYOUT = re.compile(r"^#(\w+)\s*=\s*#ttg\.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\]")
_DOT_RESULT = re.compile(r"(ttng\.warp_group_dot|tt\.dot)\s.*->\s*tensor<(\d+)x(\d+)x\w+,\s*#(\w+)>")
_WAIT_PENDINGS = re.compile(r"ttng\.warp_group_dot_wait\b.*\{pendings = (\d+)")
_SYNC_TILE_LOAD = re.compile(r"=\s*tt\.load\s.*:\s*tensor<\d+x\d+x")
_ASYNC_LOAD = re.compile(r"ttg\.async_copy_global_to_local|ttng\.async_tma_copy_global_to_local|"
                         r"ttng\.async_tma_gather")


@dataclasses.dataclass(frozen=True)
class DotFacts:
    op: str            # "ttng.warp_group_dot" (wgmma) or "tt.dot"
    rows: int          # rows of the tile the dot computes
    cols: int
    mma_version: int   # 3 = wgmma (sm_90), 2 = mma.sync, 0 = not a tensor-core layout
    warps_m: int       # warps along the rows (warpsPerCTA[0])

    @property
    def replicated(self) -> bool:
        """Warps along M x 16 rows exceed the tile: two warps (groups) compute the same rows."""
        return self.mma_version in (2, 3) and self.warps_m * 16 > self.rows


@dataclasses.dataclass(frozen=True)
class LoopFacts:
    dots: int
    async_loads: int
    sync_tile_loads: int  # 2-D tt.load (synchronous global -> registers) in the loop body

    @property
    def pipelined(self) -> bool:
        return self.async_loads > 0 and self.sync_tile_loads == 0


@dataclasses.dataclass(frozen=True)
class TtgirFacts:
    dots: tuple          # DotFacts of every dot in the kernel
    wait_pendings: tuple  # pendings of every warp_group_dot_wait
    dot_loops: tuple     # LoopFacts of every innermost scf.for holding a dot

    def as_dict(self) -> dict:
        return {"dots": [dataclasses.asdict(d) for d in self.dots], "wait_pendings": list(self.wait_pendings),
                "dot_loops": [dataclasses.asdict(loop) for loop in self.dot_loops]}


def _loop_bodies(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line indices of every scf.for region, by brace depth."""
    regions, stack, depth = [], [], 0
    for i, line in enumerate(lines):
        code = line.split(" loc(")[0] if " loc(" in line else line
        opens, closes = code.count("{"), code.count("}")
        # attribute dictionaries ({pendings = 0 : i32}) open and close on one line: net change only
        if "scf.for" in code and code.rstrip().endswith("{"):
            stack.append((i, depth))
        depth += opens - closes
        while stack and depth <= stack[-1][1]:
            start, _ = stack.pop()
            regions.append((start, i))
    return regions


def parse_ttgir(ttgir: str) -> TtgirFacts:
    lines = ttgir.splitlines()
    layouts = {}
    for line in lines:
        m = _MMA_LAYOUT.match(line.strip())
        if m:
            layouts[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    dots = []
    dot_lines = []
    for i, line in enumerate(lines):
        m = _DOT_RESULT.search(line)
        if m is None:
            continue
        version, warps_m = layouts.get(m.group(4), (0, 0))
        dots.append(DotFacts(m.group(1), int(m.group(2)), int(m.group(3)), version, warps_m))
        dot_lines.append(i)
    pendings = tuple(int(m.group(1)) for m in map(_WAIT_PENDINGS.search, lines) if m)
    loops = []
    regions = _loop_bodies(lines)
    for start, end in regions:
        if not any(start < d < end for d in dot_lines):
            continue
        if any(s > start and e < end and any(s < d < e for d in dot_lines) for s, e in regions):
            continue  # an inner loop holds the dot
        body = lines[start + 1:end]
        loops.append(LoopFacts(sum(start < d < end for d in dot_lines),
                               sum(bool(_ASYNC_LOAD.search(line)) for line in body),
                               sum(bool(_SYNC_TILE_LOAD.search(line)) for line in body)))
    return TtgirFacts(tuple(dots), pendings, tuple(loops))
