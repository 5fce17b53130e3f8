"""The static model's readers (revtriton/sass.py) on SASS and TTGIR text, checked by hand.

No compilation here (tests/test_static.py compiles): hand-written snippets for each rule of the
loop finder and the TTGIR facts, and one real sm_90 main loop (tests/data/) whose counts were
verified by reading it.
"""
import os

import pytest

from revtriton import sass

DATA = os.path.join(os.path.dirname(__file__), "data")


def _sass(lines):
    """A cuobjdump-like listing from (address, instruction) pairs."""
    return "\n".join(f"        /*{addr:04x}*/                   {text} ;   /* 0x0000 */" for addr, text in lines)


def test_real_hopper_matmul_loop_counted_by_hand():
    """tests/data/anchor_matmul_128x128x64_sm90.sass: the main loop of perf/anchors.py's matmul,
    128x128x64 tile, 8 warps, compiled for sm_90 (triton 3.9). Read by hand: the body runs from
    0x19b0 (branch target) to the `@P0 BRA 0x19b0` at 0x2040, i.e. (0x2040 - 0x19b0) / 16 + 1 = 106
    instructions, with four HGMMA.64x128x16 (one warpgroup's 64 rows x 128 columns x 16 of K
    each: 64 of K per iteration) and no MUFU. Two warpgroups (8 warps): tensor cycles
    4 x 2*64*128*16 x 2 / 4096 = 512; issue cycles 106 x 8 / 4 = 212; ratio 212 / 512."""
    with open(os.path.join(DATA, "anchor_matmul_128x128x64_sm90.sass")) as f:
        instructions = sass.parse_sass(f.read())
    (loop,) = sass.main_loops(instructions)
    assert (loop.start, loop.end) == (0x19B0, 0x2040)
    assert loop.instructions == 106
    assert loop.tensor_ops == ("HGMMA.64x128x16.F32.BF16",) * 4
    assert loop.mufu == 0
    cycles = loop.cycles(warps=8, arch=90)
    assert cycles["tensor_cycles"] == 512 and cycles["issue_cycles"] == 212
    assert cycles["ratio"] == pytest.approx(212 / 512)


def test_loop_rules():
    listing = _sass([
        (0x00, "MOV R1, R2"),
        # loop A: predicated backward branch with HGMMA, one MUFU and a forward branch to a stub
        (0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"),
        (0x20, "MUFU.EX2 R3, R3"),
        (0x30, "@!P1 BRA 0x200"),
        (0x40, "FADD R3, R3, R4"),
        (0x50, "@P0 BRA 0x10"),
        # a backward branch without tensor work: not a main loop
        (0x60, "IADD3 R5, R5, 0x1, RZ"),
        (0x70, "@P2 BRA 0x60"),
        # outer loop around an inner tensor loop: only the inner counts
        (0x80, "MOV R6, RZ"),
        (0x90, "HMMA.16816.F32.BF16 R8, R12, R14, R8"),
        (0xA0, "@P3 BRA 0x90"),
        (0xB0, "@P4 BRA 0x80"),
        (0xC0, "EXIT"),
        # out-of-line barrier-wait stub: unconditional backward branch with an HGMMA-free body,
        # and one that would enclose HGMMA: neither is a loop
        (0x200, "SYNCS.PHASECHK.TRANS64 P1, [R0], RZ"),
        (0x210, "BRA 0x40"),
        (0x220, "BRA 0x10"),
        (0x230, "BRA 0x230"),
    ])
    loops = sass.main_loops(sass.parse_sass(listing))
    assert [(loop.start, loop.end) for loop in loops] == [(0x10, 0x50), (0x90, 0xA0)]
    a, inner = loops
    assert (a.instructions, a.mufu, a.tensor_flops) == (5, 1, 2 * 64 * 64 * 16)
    c = a.cycles(warps=4, arch=90)
    # one warpgroup: tensor 131072 / 4096 = 32; issue 5 x 4 / 4 = 5; MUFU 1 x 8 x 4 / 4 = 8 (> issue)
    assert (c["tensor_cycles"], c["issue_cycles"], c["mufu_cycles"]) == (32, 5, 8)
    assert c["ratio"] == 8 / 32
    # sm_80: HMMA.16816 is per warp, 4096 FLOP; A100 does 2048 a cycle per SM: 2 cycles x 4 warps
    c80 = inner.cycles(warps=4, arch=80)
    assert (c80["tensor_cycles"], c80["issue_cycles"]) == (8, 2)


def test_pt_predicate_is_unconditional():
    listing = _sass([(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"), (0x20, "@PT BRA 0x10")])
    assert sass.main_loops(sass.parse_sass(listing)) == []


TTGIR = """\
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 64, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 8]}>
module {
  tt.func public @k() {
    %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<64x64xf32, #mma>) : i32 {
      %a = ttg.async_copy_global_to_local %p, %buf : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16>
      %g = tt.load %gp : tensor<32x!tt.ptr<f32>, #blocked1>
      %d = ttng.warp_group_dot %x, %y, %acc {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x32xbf16> * !ttg.memdesc<32x64xbf16> -> tensor<64x64xf32, #mma>
      %w:3 = ttng.warp_group_dot_wait %d, %x, %y {pendings = 1 : i32} : tensor<64x64xf32, #mma>
      scf.yield %w#0 : tensor<64x64xf32, #mma>
    } loc(#loc1)
    scf.for %j = %c0 to %n step %c1 : i32 {
      scf.for %k = %c0 to %n step %c1 : i32 {
        %b = tt.load %bp, %mask : tensor<64x32x!tt.ptr<bf16>, #blocked>
        %e = tt.dot %b, %c, %acc2, inputPrecision = tf32 : tensor<64x32xbf16, #dot0> * tensor<32x16xbf16, #dot1> -> tensor<64x16xf32, #mma1>
        scf.yield
      }
      scf.yield
    }
    tt.return
  }
}
"""


def test_ttgir_facts():
    facts = sass.parse_ttgir(TTGIR)
    wgmma, mma_sync = facts.dots
    assert (wgmma.op, wgmma.rows, wgmma.mma_version, wgmma.warps_m) == ("ttng.warp_group_dot", 64, 3, 8)
    assert wgmma.replicated  # 8 warps x 16 rows > 64 rows: two warpgroups compute the same rows
    assert (mma_sync.mma_version, mma_sync.warps_m, mma_sync.replicated) == (2, 4, False)
    assert facts.wait_pendings == (1,)
    first, inner = facts.dot_loops
    assert (first.dots, first.async_loads, first.sync_tile_loads, first.pipelined) == (1, 1, 0, True)
    # the inner loop holds the dot (not the outer one); its 2-D tile load is synchronous
    assert (inner.dots, inner.async_loads, inner.sync_tile_loads, inner.pipelined) == (1, 0, 1, False)
