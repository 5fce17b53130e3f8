"""Launch limits the interpreter cannot show: shapes past 2^31 elements and huge batches.

Shapes that would overflow 32-bit offsets or a grid's y dimension are built on the ``meta`` device
(no memory) and the launchers run inside ``aot.recording_launches`` (no kernel): they must record
their launches with every program in the grid's x dimension; a grid past the hardware's x limit
raises a clear error before anything launches.
"""
import pytest
import torch

from revtriton import aot
from revtriton.ops import fused_attention, limits


def _qkv(batch, tokens, heads, kv_heads, head_dim):
    """q, k, v as views into one packed [B*T, (H + 2 KV) * D] buffer, as the QKV GEMM writes them."""
    width = (heads + 2 * kv_heads) * head_dim
    packed = torch.empty(batch, tokens, width, device="meta", dtype=torch.bfloat16)
    q = packed[..., :heads * head_dim].view(batch, tokens, heads, head_dim)
    k = packed[..., heads * head_dim:(heads + kv_heads) * head_dim].view(batch, tokens, kv_heads, head_dim)
    v = packed[..., (heads + kv_heads) * head_dim:].view(batch, tokens, kv_heads, head_dim)
    return q, k, v


def _record_attention(batch, tokens, heads, kv_heads, head_dim, causal=True):
    with aot.recording_launches() as launches:
        q, k, v = _qkv(batch, tokens, heads, kv_heads, head_dim)
        o, lse = fused_attention.attention_fwd(q, k, v, causal=causal)
        fused_attention.attention_bwd(q, k, v, o, lse, torch.empty_like(o), causal=causal)
    return launches


def test_llama3_batch_past_int32_offsets_launches():
    # LLaMA-3-8B: 32 query heads, 8 KV heads, head dim 128, 8192 tokens: the packed qkv is 6144
    # wide, 50.3M elements a sequence; from batch 43 on it spans more than 2^31 elements, which the
    # earlier launchers refused (int32 offsets). Now they launch (the arithmetic: the next test).
    launches = _record_attention(43, 8192, 32, 8, 128)
    assert [launch.kernel_name for launch in launches] == [
        "attention_fwd_kernel", "attention_bwd_dq_kernel", "attention_bwd_dkdv_kernel"]


# Three sequences whose batch stride fits int32 but whose third starts past 2^31 elements: only
# 64-bit batch offsets reach it (int32 ones wrap to a wrong address, or crash). The storage is
# virtual (torch.empty of ~6 GB fp16; only the touched pages are committed), so it runs anywhere;
# a subprocess turns a crash into a failure.
_PAST_INT32 = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from revtriton.ops import fused_attention as fa
torch.manual_seed(0)
T, H, KV, D = 24, 2, 1, 16
row = (H + 2 * KV) * D
stride = (2 ** 30 // row + 1) * row  # < 2^31; sequence 2 starts at 2 * stride > 2^31
storage = torch.empty(2 * stride + T * row, dtype=torch.float16)
packed = storage.as_strided((3, T, H + 2 * KV, D), (stride, row, D, 1))
src = torch.randn(3, T, H + 2 * KV, D, dtype=torch.float16)
packed.copy_(src)
assert packed[2].storage_offset() > 2 ** 31
split = lambda t: (t[:, :, :H], t[:, :, H:H + KV], t[:, :, H + KV:])
q, k, v = split(packed)
o, lse = fa.attention_fwd(q, k, v, causal=True)
do = torch.randn_like(o)
tables = fa.rope_tables(T, D, 100.0, q.device)
grads = fa.attention_bwd(q, k, v, o, lse, do, causal=True, rope=tables)
rq, rk, rv = (t.float() for t in split(src))
ref_o, _ = fa.attention_fwd_reference(rq, rk, rv, causal=True)
ref = fa.attention_bwd_reference(rq, rk, rv, do.float(), causal=True, rope=tables)
errors = [(o.float() - ref_o).abs().max().item()] + [(g.float() - r).abs().max().item() for g, r in zip(grads, ref)]
print(errors)
sys.exit(0 if max(errors) < 2e-2 else 1)
"""


def test_sequences_past_2_31_elements_are_read_and_written_at_the_right_place():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PAST_INT32], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])


def test_huge_batch_fits_the_grid_x_dimension():
    # ViT-B: 12 heads, 197 tokens. The earlier backward put batch x (kv heads + heads) on grid y and
    # could not launch past batch 2730; every grid is one-dimensional now.
    batch, heads, tokens = 4096, 12, 197
    fwd, dq, dkdv = _record_attention(batch, tokens, heads, heads, 64, causal=False)
    assert fwd.grid_size({"BLOCK_M": 128}) == (2 * batch * heads, 1, 1)
    assert dq.grid_size({"BLOCK_FIXED": 64}) == (4 * batch * heads, 1, 1)
    assert dkdv.grid_size({"BLOCK_FIXED": 128}) == (2 * batch * heads, 1, 1)


def test_grid_past_the_x_limit_is_refused_before_launching():
    # 2^31 programs along x: one 16-token tile for each of 2^24 sequences x 128 heads
    with aot.recording_launches() as launches:
        q, k, v = _qkv(2 ** 24, 16, 128, 128, 16)
        with pytest.raises(ValueError, match=r"attention_fwd: grid x = 2147483648 .*micro-batches"):
            fused_attention.attention_fwd(q, k, v, causal=False)
    assert launches == []


def test_check_grid_messages():
    limits.check_grid("k", (2 ** 31 - 1, 65535, 65535))
    with pytest.raises(ValueError, match="grid z = 65536"):
        limits.check_grid("k", (1, 1, 65536))
    with pytest.raises(ValueError, match="grid x"):
        limits.check_grid("k", (2 ** 31,))


def test_host_arithmetic_matches_tritons():
    """The launchers' plain cdiv / next_power_of_2 (Triton's are constexpr functions, ~5 us a host
    call) give Triton's values, edge cases included (0, 1, powers of two and their neighbours)."""
    import triton

    from revtriton.kernels.configs import next_power_of_2
    from revtriton.ops.launches import cdiv

    values = list(range(0, 70)) + [255, 256, 257, 8077, 8192, 8193, 2**31 - 1, 2**31, 2**40 + 3]
    for n in values:
        assert next_power_of_2(max(n, 1)) == triton.next_power_of_2(max(n, 1)), n
        for d in (1, 3, 16, 64, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(0) == 1
