"""Flash attention kernels, the QKV GEMM and the fused norm+attention half, under the interpreter."""
import math

import pytest
import torch

from revtriton.ops import fused_attention as fa
from revtriton.ops.dispatch import count_launches, force_triton

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def rel_err(actual, expected):
    """max |a - e| / max |e|; the denominator is floored at 1 because some exact gradients are ~0
    (one-token attention has dq = dk = 0) and every tensor here has O(1) entries."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1.0)).item()


def packed_qkv(batch, tokens, heads, kv_heads, head_dim, dtype):
    """q, k, v as strided views into one packed [B, T, H + 2 KV, D] buffer (the QKV GEMM's layout)."""
    qkv = torch.randn(batch, tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
    return qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads], qkv[:, :, heads + kv_heads:]


# --------------------------------------------------------------------------------------------
# Flash attention forward / backward


@pytest.mark.parametrize("tokens", [1, 17, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rope", [False, True])
def test_attention_matches_reference_fp32_gqa(seeded, tokens, causal, rope):
    q, k, v = packed_qkv(2 if tokens < 128 else 1, tokens, 4, 2, 32, torch.float32)
    o, lse = fa.attention_fwd(q, k, v, causal=causal)
    ref_o, ref_lse = fa.attention_fwd_reference(q, k, v, causal=causal)
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(lse, ref_lse) <= 1e-5

    do = torch.randn_like(o)
    tables = fa.rope_tables(tokens, 32, 10000.0, q.device) if rope else None
    grads = fa.attention_bwd(q, k, v, o, lse, do, causal=causal, rope=tables)
    ref_grads = fa.attention_bwd_reference(q, k, v, do, causal=causal, rope=tables)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 1e-5, f"d{name}: {rel_err(g, r)}"


@pytest.mark.parametrize("tokens,causal,heads,kv_heads,head_dim", [
    (17, True, 4, 2, 32), (128, False, 4, 2, 32), (33, True, 2, 2, 64), (20, False, 2, 1, 128)])
def test_attention_matches_reference_fp16(seeded, tokens, causal, heads, kv_heads, head_dim):
    q, k, v = packed_qkv(1, tokens, heads, kv_heads, head_dim, torch.float16)
    o, lse = fa.attention_fwd(q, k, v, causal=causal)
    ref_o, ref_lse = fa.attention_fwd_reference(q.float(), k.float(), v.float(), causal=causal)
    assert o.dtype == torch.float16
    assert rel_err(o, ref_o) <= 1e-2 and rel_err(lse, ref_lse) <= 1e-2
    do = torch.randn_like(o)
    grads = fa.attention_bwd(q, k, v, o, lse, do, causal=causal)
    ref_grads = fa.attention_bwd_reference(q.float(), k.float(), v.float(), do.float(), causal=causal)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == torch.float16
        assert rel_err(g, r) <= 1e-2, f"d{name}: {rel_err(g, r)}"


def test_attention_backward_is_deterministic_and_writes_into_packed_buffers(seeded):
    q, k, v = packed_qkv(1, 40, 4, 2, 32, torch.float32)
    o, lse = fa.attention_fwd(q, k, v, causal=True)
    do = torch.randn_like(o)
    dqkv = torch.full((1, 40, 8, 32), float("nan"))
    fa.attention_bwd(q, k, v, o, lse, do, causal=True, dq=dqkv[:, :, :4], dk=dqkv[:, :, 4:6], dv=dqkv[:, :, 6:])
    again = torch.cat(fa.attention_bwd(q, k, v, o, lse, do, causal=True), dim=2)
    assert torch.equal(dqkv, again)


def test_attention_launches(seeded):
    q, k, v = packed_qkv(1, 17, 2, 2, 16, torch.float32)
    with count_launches() as fwd:
        o, lse = fa.attention_fwd(q, k, v, causal=False)
    with count_launches() as bwd:
        fa.attention_bwd(q, k, v, o, lse, torch.randn_like(o), causal=False)
    assert sum(fwd.values()) == 1 and sum(bwd.values()) == 2


def test_attention_bad_inputs():
    q, k, v = packed_qkv(1, 8, 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="head dim 48"):
        fa.attention_fwd(*packed_qkv(1, 8, 2, 2, 48, torch.float32), causal=False)
    with pytest.raises(ValueError, match="kv_heads"):
        fa.attention_fwd(*packed_qkv(1, 8, 4, 3, 32, torch.float32), causal=False)
    with pytest.raises(ValueError, match="batch, tokens, heads, head_dim"):
        fa.attention_fwd(q[0], k[0], v[0], causal=False)
    with pytest.raises(TypeError, match="share"):
        fa.attention_fwd(q, k.half(), v, causal=False)
    with pytest.raises(ValueError, match="unit stride"):
        fa.attention_fwd(q.transpose(2, 3), k.transpose(2, 3), v.transpose(2, 3), causal=False)
