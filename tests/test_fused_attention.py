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


# --------------------------------------------------------------------------------------------
# QKV projection (norm prologue, bias + RoPE epilogue)


def _stats(x, norm, eps=1e-6):
    from revtriton.ops.gemm import row_stats_reference

    return row_stats_reference(x, norm=norm, eps=eps)


@pytest.mark.parametrize("norm,rope,bias,dtype", [
    ("layer", False, True, torch.float32), ("rms", True, False, torch.float32), ("layer", True, True, torch.float32),
    ("rms", False, True, torch.float16), ("layer", True, False, torch.float16)])
def test_qkv_projection_matches_reference(seeded, norm, rope, bias, dtype):
    batch, tokens, heads, kv_heads, head_dim = 2, 17, 4, 2, 16
    dim = heads * head_dim
    n_out = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(batch * tokens, dim) * 2 + 0.5
    stats = _stats(x, norm)
    gamma = 1 + 0.2 * torch.randn(dim)
    beta = 0.2 * torch.randn(dim) if norm == "layer" else None
    w = (torch.randn(n_out, dim) / dim**0.5).to(dtype)
    b = (0.2 * torch.randn(n_out)).to(dtype) if bias else None
    tables = fa.rope_tables(tokens, head_dim, 500.0, x.device) if rope else None
    kwargs = dict(norm=norm, heads=heads, kv_heads=kv_heads, tokens=tokens, rope=tables)
    got = fa.qkv_projection(x, stats, gamma, beta, w, b, **kwargs)
    want = fa.qkv_projection_reference(x, stats, gamma, beta, w, b, **kwargs)
    assert got.dtype == dtype
    assert rel_err(got, want) <= TOL[dtype]
    if rope:  # the rotation really happened (q/k heads differ from the unrotated projection, v does not)
        plain = fa.qkv_projection_reference(x, stats, gamma, beta, w, b, **{**kwargs, "rope": None})
        qk = (heads + kv_heads) * head_dim
        assert rel_err(got[:, :qk], plain[:, :qk]) > 1e-2 and rel_err(got[:, qk:], plain[:, qk:]) <= TOL[dtype]


# --------------------------------------------------------------------------------------------
# The fused half against the reference path


def make_half_params(dim, heads, kv_heads, norm, bias, dtype=torch.float32):
    head_dim = dim // heads
    n_out = (heads + 2 * kv_heads) * head_dim
    p = dict(norm_weight=1 + 0.2 * torch.randn(dim, dtype=dtype),
             norm_bias=0.2 * torch.randn(dim, dtype=dtype) if norm == "layer" else None,
             w_qkv=torch.randn(n_out, dim, dtype=dtype) / dim**0.5,
             b_qkv=0.2 * torch.randn(n_out, dtype=dtype) if bias else None,
             w_proj=torch.randn(dim, dim, dtype=dtype) / dim**0.5,
             b_proj=0.2 * torch.randn(dim, dtype=dtype) if bias else None)
    return {k: (v.requires_grad_(True) if v is not None else None) for k, v in p.items()}


def couple_both_ways(res, x, sign, frac_bits, params, g, **kwargs):
    """(stream, grads) on the Triton path (forced, interpreter) and on the reference path."""
    from revtriton.ops.attention import norm_attention_couple

    args = (params["norm_weight"], params["norm_bias"], params["w_qkv"], params["b_qkv"], params["w_proj"],
            params["b_proj"])
    leaves = [t for t in (res, x, *args) if t is not None and t.requires_grad]
    out = []
    for triton_path in (True, False):
        with force_triton(triton_path):
            with count_launches() as fwd:
                stream, port = norm_attention_couple(res, x, sign, frac_bits, *args, **kwargs)
            with count_launches() as bwd:
                grads = torch.autograd.grad(port, leaves, g)
        out.append((stream, grads, sum(fwd.values()), sum(bwd.values())))
    return out


CASES = [  # tokens, causal, heads, kv_heads, rope_theta, norm, bias
    (1, False, 4, 2, None, "layer", True),
    (1, True, 4, 2, 10000.0, "rms", False),
    (17, False, 4, 2, 10000.0, "rms", False),
    (17, True, 4, 2, None, "layer", True),
    (128, True, 4, 2, 10000.0, "rms", False),
    (128, False, 4, 4, None, "layer", True),
]


@pytest.mark.parametrize("tokens,causal,heads,kv_heads,rope_theta,norm,bias", CASES)
def test_fused_half_float_matches_reference(seeded, tokens, causal, heads, kv_heads, rope_theta, norm, bias):
    batch, dim = (2, 64) if tokens < 128 else (1, 64)
    params = make_half_params(dim, heads, kv_heads, norm, bias)
    x = torch.randn(batch, tokens, dim, requires_grad=True)
    res = torch.randn(batch, tokens, dim, requires_grad=True)
    row_scale = torch.tensor([2.0, 0.0][:batch])[:, None].expand(batch, tokens) if batch == 2 else None
    g = torch.randn(batch, tokens, dim)
    (s, grads, nf, nb), (s_ref, grads_ref, _, _) = couple_both_ways(
        res, x, -1, None, params, g, heads=heads, kv_heads=kv_heads, causal=causal, rope_theta=rope_theta,
        norm=norm, eps=1e-6, row_scale=row_scale)
    assert nf <= 4 and nb <= 7, (nf, nb)
    assert rel_err(s, s_ref) <= 1e-5
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("tokens,causal,heads,kv_heads,rope_theta,norm,bias", CASES[1:4])
def test_fused_half_exact_matches_reference(seeded, tokens, causal, heads, kv_heads, rope_theta, norm, bias):
    batch, dim, frac_bits = 2, 64, 16
    params = make_half_params(dim, heads, kv_heads, norm, bias)
    x = torch.randn(batch, tokens, dim, requires_grad=True)
    res = torch.randint(-2**24, 2**24, (batch, tokens, dim), dtype=torch.int32)
    g = torch.randn(batch, tokens, dim)
    (s, grads, nf, nb), (s_ref, grads_ref, _, _) = couple_both_ways(
        res, x, 1, frac_bits, params, g, heads=heads, kv_heads=kv_heads, causal=causal, rope_theta=rope_theta,
        norm=norm, eps=1e-6, row_scale=None)
    assert s.dtype == torch.int32 and nf <= 4 and nb <= 7
    # Same value up to the rounding of last-bit differences in H (~1e-6 relative, i.e. ~0.1 grid
    # steps at 2^16): at most one grid step apart, and only for a few elements.
    assert (s - s_ref).abs().max().item() <= 1
    assert (s != s_ref).float().mean().item() < 0.1
    for got, want in zip(grads, grads_ref):
        assert rel_err(got, want) <= 1e-5
    # The exact inverse: subtracting the same half gives back res bitwise.
    from revtriton.ops.attention import norm_attention_couple

    args = [params[k] for k in ("norm_weight", "norm_bias", "w_qkv", "b_qkv", "w_proj", "b_proj")]
    with force_triton(), torch.no_grad():
        back, port = norm_attention_couple(s, x, -1, frac_bits, *args, heads=heads, kv_heads=kv_heads,
                                           causal=causal, rope_theta=rope_theta, norm=norm)
    assert port is None and torch.equal(back, res)


def test_fused_half_keeps_nothing_without_grad(seeded):
    from revtriton.ops.attention import norm_attention_couple

    params = make_half_params(32, 2, 2, "layer", True)
    x, res = torch.randn(1, 9, 32), torch.randn(1, 9, 32)
    args = [params[k].detach() for k in ("norm_weight", "norm_bias", "w_qkv", "b_qkv", "w_proj", "b_proj")]
    with force_triton():
        stream, port = norm_attention_couple(res, x, 1, None, *args, heads=2, causal=False)
    assert port is None and stream.grad_fn is None
