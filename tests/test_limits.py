"""Launch limits the interpreter cannot show: int32 offsets and grid dimensions (revtriton.ops.limits).

Shapes that would overflow are built on the ``meta`` device (no memory) and the launchers run
inside ``aot.recording_launches`` (no kernel): a shape that fits records its launches, one past a
limit raises a clear error before anything launches.
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


def test_max_element_offset():
    t = torch.empty(4, 5, 6, device="meta")
    assert limits.max_element_offset(t) == 4 * 5 * 6 - 1
    assert limits.max_element_offset(t[:, ::2]) == 3 * 30 + 2 * 12 + 5
    assert limits.max_element_offset(torch.empty(0, 7, device="meta")) == 0


def test_llama3_shapes_fit_and_the_overflowing_batch_is_refused():
    # LLaMA-3-8B: 32 query heads, 8 KV heads, head dim 128, 8192 tokens: packed qkv is 6144 wide,
    # 8192 * 6144 = 50.3M elements a sequence; int32 offsets overflow from batch 43 on.
    with aot.recording_launches() as launches:
        q, k, v = _qkv(42, 8192, 32, 8, 128)
        fused_attention.attention_fwd(q, k, v, causal=True)
    assert [launch.kernel_name for launch in launches] == ["attention_fwd_kernel"]
    with aot.recording_launches() as launches:
        q, k, v = _qkv(43, 8192, 32, 8, 128)
        with pytest.raises(ValueError, match=r"attention_fwd: q .* int32 .* batch of at most 42"):
            fused_attention.attention_fwd(q, k, v, causal=True)
    assert launches == []


def test_backward_refuses_overflow_before_launching():
    with aot.recording_launches() as launches:
        q, k, v = _qkv(43, 8192, 32, 8, 128)
        o = torch.empty_like(q)
        lse = torch.empty(43, 32, 8192, device="meta")
        with pytest.raises(ValueError, match="attention_bwd: .* int32"):
            fused_attention.attention_bwd(q, k, v, o, lse, torch.empty_like(o), causal=True)
    assert launches == []


def test_grid_y_limit():
    # ViT-B: 12 heads; the backward's grid rows are batch x (kv heads + heads) = 24 a sample.
    # 197 tokens x 64 = 12608 elements a head row: offsets fit long before the grid does.
    heads, tokens = 12, 197
    ok = 65535 // (2 * heads)
    with aot.recording_launches() as launches:
        q, k, v = _qkv(ok, tokens, heads, heads, 64)
        fused_attention.attention_bwd(q, k, v, torch.empty_like(q), torch.empty(ok, heads, tokens, device="meta"),
                                      torch.empty_like(q), causal=False)
    assert [launch.kernel_name for launch in launches] == ["attention_bwd_delta_kernel", "attention_bwd_kernel"]
    grid = launches[1].grid_size({"BLOCK_FIXED": 64})
    assert grid[1] == ok * 2 * heads <= 65535
    with aot.recording_launches() as launches:
        q, k, v = _qkv(ok + 1, tokens, heads, heads, 64)
        with pytest.raises(ValueError, match=rf"grid y = {(ok + 1) * 2 * heads} .* batch of at most {ok}"):
            fused_attention.attention_bwd(q, k, v, torch.empty_like(q),
                                          torch.empty(ok + 1, heads, tokens, device="meta"), torch.empty_like(q),
                                          causal=False)
    assert launches == []
    # the forward's grid rows are batch x heads (short sequences: the offsets stay small)
    with pytest.raises(ValueError, match=rf"attention_fwd: grid y = {(65535 // heads + 1) * heads}"):
        with aot.recording_launches():
            fused_attention.attention_fwd(*_qkv(65535 // heads + 1, 16, heads, heads, 16), causal=False)


def test_check_grid_messages():
    limits.check_grid("k", (2 ** 31 - 1, 65535, 65535))
    with pytest.raises(ValueError, match="grid z = 65536"):
        limits.check_grid("k", (1, 1, 65536))
    with pytest.raises(ValueError, match="grid x"):
        limits.check_grid("k", (2 ** 31,))
