"""GPU-only checks (compiled Triton kernels, real CUDA streams, bf16): run by perf/gpu_check.sh.

Skipped without a CUDA device. Run with TRITON_INTERPRET=0 (gpu_check.sh sets it).
"""
import copy
import json
from collections import Counter

import pytest
import torch
from torch import nn

from revtriton import (LayerNormAttention, LayerNormMLP, ReversibleBlock, ReversibleStack, RMSNormAttention,
                       RMSNormSwiGLU)
from revtriton.ops import backend
from revtriton.ops.dispatch import count_launches
from revtriton.ops.streams import to_fixed
from revtriton.profiling import peak_memory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HALVES = {
    "layernorm_mlp": lambda: LayerNormMLP(256, 512),
    "rmsnorm_swiglu": lambda: RMSNormSwiGLU(256, 512),
    "layernorm_attention": lambda: LayerNormAttention(256, 4),
    "layernorm_attention_causal": lambda: LayerNormAttention(256, 4, causal=True),
    "rmsnorm_attention_gqa_rope": lambda: RMSNormAttention(256, 4, kv_heads=2),
    "rmsnorm_attention_hd128": lambda: RMSNormAttention(256, 2),
    "rmsnorm_attention_hd80_gqa": lambda: RMSNormAttention(320, 4, kv_heads=2),  # a padded head dim
    "layernorm_attention_hd256": lambda: LayerNormAttention(512, 2),
}
# fp32 operands go through TF32 tensor cores in tl.dot; bf16 has 8 mantissa bits.
TOL = {torch.float32: 1e-2, torch.bfloat16: 4e-2}


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def vit_block(dim=256, heads=4, drop_path=0.1):
    return ReversibleBlock(LayerNormAttention(dim, heads, drop_path=drop_path),
                           LayerNormMLP(dim, 2 * dim, drop_path=drop_path))


def llama_block(dim=256, heads=4, drop_path=0.0):
    return ReversibleBlock(RMSNormAttention(dim, heads, kv_heads=2, drop_path=drop_path),
                           RMSNormSwiGLU(dim, 2 * dim, drop_path=drop_path))


@pytest.mark.parametrize("name", list(HALVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_fused_half_matches_reference(name, dtype):
    half = HALVES[name]().cuda()
    x = torch.randn(2, 100, half.dim, device="cuda")
    res, g = torch.randn_like(x), torch.randn_like(x)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16)

    xf = x.clone().requires_grad_()
    with autocast:
        stream, port = half.couple(res, xf, -1)  # CUDA: the fused kernels
    torch.autograd.backward(port, g)
    fused = [xf.grad] + [p.grad.clone() for p in half.parameters()]
    half.zero_grad(set_to_none=True)

    xr = x.clone().requires_grad_()
    with autocast:
        h = half(xr)  # the pure-torch reference
    torch.autograd.backward(h, -g.to(h.dtype))
    reference = [xr.grad] + [p.grad for p in half.parameters()]

    assert stream.dtype == res.dtype
    assert rel(res - stream, h) <= TOL[dtype]
    for a, b in zip(fused, reference):
        assert rel(a, b) <= TOL[dtype]


@pytest.mark.parametrize("make_block", [vit_block, llama_block], ids=["vit", "llama"])
def test_exact_fused_stack_inverts_bitwise_and_recomputes_deterministically(make_block):
    stack = ReversibleStack([make_block() for _ in range(12)]).cuda().eval()
    s1 = to_fixed(torch.randn(2, 197, 256, device="cuda"), 16)
    s2 = to_fixed(torch.randn(2, 197, 256, device="cuda"), 16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        r1, r2 = stack.inverse(*stack.forward_streams(s1, s2))
    assert torch.equal(r1, s1) and torch.equal(r2, s2)
    # Training step under bf16 autocast with drop-path: the checksum guard raises on any recompute
    # that differs from the forward (a non-deterministic kernel or config).
    stack.train()
    x = torch.randn(2, 197, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = stack(x)
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_fused_stack_gradients_match_reference_path(exact):
    torch.manual_seed(0)
    stack = ReversibleStack([vit_block() for _ in range(4)], exact=exact).eval()
    cpu_stack = copy.deepcopy(stack)  # CPU tensors take the pure-torch reference
    stack.cuda()
    x = torch.randn(2, 64, 256)
    grads = []
    for model, device, path in ((stack, "cuda", "triton"), (cpu_stack, "cpu", "torch")):
        xi = x.to(device).requires_grad_()
        with backend.use_backend(path):  # this module's fixture pins "triton", which CPU tensors cannot run
            model(xi).square().mean().backward()
        grads.append([xi.grad.cpu()] + [p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads):
        assert rel(a, b) <= TOL[torch.float32]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
@pytest.mark.parametrize("depth", [1, 2, 5, 8])
def test_pareprop_on_cuda_streams_equals_sequential(exact, depth):
    torch.manual_seed(depth)
    base = ReversibleStack([vit_block() for _ in range(depth)], exact=exact).cuda().train()
    x = torch.randn(4, 197, 256, device="cuda", requires_grad=True)
    results = []
    for schedule in ("sequential", "pareprop"):
        base.schedule = schedule
        base.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(123)  # same drop-path draws
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = base(x)
        out.float().square().mean().backward()
        results.append([x.grad.clone()] + [p.grad.clone() for p in base.parameters()])
    for a, b in zip(*results):
        if exact:
            assert torch.equal(a, b)
        else:
            assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("schedule, lanes", [("sequential", 1), ("pareprop", 2)])
def test_backward_kernels_land_on_the_schedule_streams(tmp_path, schedule, lanes):
    """Autograd runs a backward op on its forward op's stream: PaReprop's gradient kernels must spread
    over both lanes (on one rebuild stream they would queue behind the next rebuild)."""
    stack = ReversibleStack([vit_block() for _ in range(4)], schedule=schedule).cuda().train()
    x = torch.randn(4, 197, 256, device="cuda", requires_grad=True)
    stack(x).sum().backward()  # warm the kernels
    out = stack(x).sum()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out.backward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    # Kineto writes GPU kernels as "kernel" events whose thread id (and args.stream) is the CUDA stream.
    per_stream = Counter(e.get("args", {}).get("stream", e.get("tid")) for e in events
                         if str(e.get("cat", "")).lower() == "kernel")
    counts = sorted(per_stream.values(), reverse=True)
    if lanes == 1:  # everything on the caller's stream
        assert counts[0] >= 0.9 * sum(counts), per_stream
    else:  # two lanes with two blocks each: about half of the kernels on each
        assert len(counts) >= 2 and counts[1] >= 0.25 * sum(counts), per_stream


def test_launch_budget_of_a_fused_block():
    stack = ReversibleStack([vit_block()]).cuda().eval()
    x = torch.randn(2, 197, 256, device="cuda", requires_grad=True)
    with count_launches() as forward:
        out = stack(x)
    with count_launches() as backward:
        out.sum().backward()
    # Per block: the halves' 7 forward launches; in backward the rebuild's 7 + attention 10 + MLP 7.
    # Exact streams (the default) add the engine's one-pass checksum (forward: input and output;
    # backward: the rebuilt input), counted apart.
    assert forward.pop("weighted_checksum_kernel", 0) <= 2 and backward.pop("weighted_checksum_kernel", 0) <= 2
    assert sum(forward.values()) <= 7, forward
    assert sum(backward.values()) <= 24, backward


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_cuda_peak_memory_is_flat_in_depth(schedule):
    peaks = []
    x = torch.randn(4, 197, 256, device="cuda", requires_grad=True)
    for depth in (4, 16):
        stack = ReversibleStack([vit_block() for _ in range(depth)], schedule=schedule).cuda()
        stack(x).sum().backward()  # allocate .grad and warm the kernels
        peaks.append(peak_memory(lambda: stack(x).sum().backward(), device="cuda"))
    # Parameter grads already exist; what remains grows with neither depth nor schedule run-ahead.
    assert peaks[1] <= 1.10 * peaks[0], peaks


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_backward_schedule_makes_no_host_sync(schedule, monkeypatch):
    """The per-block part of the backward (every rebuild and gradient step) never syncs with the
    host: torch.cuda.set_sync_debug_mode("error") raises on any sync inside it. The backward's one
    sync (the checksum flags) comes after the schedule. tests/test_host_sync.py counts the same on CPU."""
    from revtriton import engine

    stack = ReversibleStack([vit_block() for _ in range(4)], schedule=schedule).cuda().train()
    x = torch.randn(2, 197, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = stack(x)
    out.float().square().mean().backward()  # warm: first launches autotune, which syncs
    real = engine.segment.run_backward_schedule

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine.segment, "run_backward_schedule", strict)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = stack(x)
    out.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_a_deferred_training_step_makes_no_host_sync(schedule, exact, dropout):
    """Issue 45 on the GPU: a whole step (forward and backward; dropout replayed through graph-safe
    generator state) inside deferred_checks() never syncs with the host, so a CUDA graph can capture
    it; check_step() is the one sync, and it raises a planted overflow."""
    import revtriton

    blocks = [ReversibleBlock(nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256), nn.Dropout(dropout)),
                              nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256))) for _ in range(5)]
    stack = ReversibleStack(blocks, schedule=schedule, exact=exact).cuda().train()
    x = torch.randn(2, 64, 256, device="cuda", requires_grad=True)
    stack(x).square().mean().backward()  # warm: first launches autotune, which syncs
    with revtriton.deferred_checks():
        torch.cuda.set_sync_debug_mode("error")
        try:
            stack(x).square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    revtriton.check_step()
    if exact:
        with revtriton.deferred_checks():
            stack(x * 1e5).square().mean().backward()  # beyond the exact range at the input
        with pytest.raises(OverflowError):
            revtriton.check_step()


@pytest.mark.parametrize("halves", ["dropout", "drop-path"])
def test_another_thread_drawing_cuda_numbers_in_the_recompute_changes_no_gradient(halves):
    """Issue 45 step 3 on the GPU: nn.Dropout (native_dropout: the global CUDA generator swapped for
    the half's, graph-safely) and revtriton's drop-path (the half's generator asked for) replay the
    forward's masks while another thread draws CUDA random numbers before each recompute."""
    import threading

    from revtriton import engine

    def steps(other_thread, monkeypatch):
        real = engine.segment.couple_half

        def couple_half(*args, **kwargs):
            if other_thread and torch.is_grad_enabled():
                thread = threading.Thread(target=lambda: torch.rand(1000, device="cuda"))
                thread.start()
                thread.join()
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.segment, "couple_half", couple_half)
        torch.manual_seed(0)
        if halves == "dropout":
            blocks = [ReversibleBlock(nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256), nn.Dropout(0.3)),
                                      nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 256), nn.Dropout(0.3)))
                      for _ in range(3)]
        else:
            blocks = [ReversibleBlock(LayerNormAttention(256, 4, drop_path=0.5), LayerNormMLP(256, 512, drop_path=0.5))
                      for _ in range(3)]
        stack = ReversibleStack(blocks).cuda().train()
        x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
        grads = []
        for step in range(2):
            torch.manual_seed(1 + step)
            stack.zero_grad(set_to_none=True)
            x.grad = None
            stack(x).square().mean().backward()
            grads.append([x.grad] + [p.grad for p in stack.parameters()])
        return grads

    with pytest.MonkeyPatch.context() as monkeypatch:
        alone = steps(False, monkeypatch)
    with pytest.MonkeyPatch.context() as monkeypatch:
        with_thread = steps(True, monkeypatch)
    for a, b in zip(alone, with_thread):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


# --------------------------------------------------------------------------------------------
# Issue 19: the dispatcher's measured choice (fused Triton vs cuBLAS + SDPA) on this GPU


@pytest.fixture(autouse=True)
def triton_backend(request, tmp_path, monkeypatch):
    """The tests of this module check the Triton kernels, so they run on that backend (on a GPU the
    dispatcher would otherwise measure and might take the library path); the dispatch test
    measures, with a cache of its own and no choice pinned before it."""
    from revtriton.ops import backend

    if not request.node.name.startswith("test_dispatch_choice"):
        with backend.use_backend("triton"):
            yield
        return
    monkeypatch.setenv(backend.ENV_CACHE_DIR, str(tmp_path / "backend-cache"))
    monkeypatch.delenv(backend.ENV_BACKEND, raising=False)
    backend.reset()
    yield
    backend.reset()


@pytest.mark.parametrize("head_dim,heads,kv_heads,causal", [(64, 4, 4, False), (128, 4, 1, True), (80, 4, 2, True),
                                                              (256, 2, 2, False)])
def test_flash_attention_bf16_matches_sdpa(head_dim, heads, kv_heads, causal):
    """bf16 attention on the compiled kernels (TMA on sm_90): the interpreter cannot check bf16 dots."""
    from revtriton.ops import fused_attention as fa

    torch.manual_seed(0)
    qkv = torch.randn(2, 333, heads + 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads], qkv[:, :, heads + kv_heads:]
    o, lse = fa.attention_fwd(q, k, v, causal=causal)
    ref_o, ref_lse = fa.attention_fwd_reference(q.float(), k.float(), v.float(), causal=causal)
    assert rel(o, ref_o) <= TOL[torch.bfloat16] and rel(lse, ref_lse) <= 1e-2
    do = torch.randn_like(o)
    tables = fa.rope_tables(333, head_dim, 10000.0, q.device)
    grads = fa.attention_bwd(q, k, v, o, lse, do, causal=causal, rope=tables)
    ref = fa.attention_bwd_reference(q.float(), k.float(), v.float(), do.float(), causal=causal, rope=tables)
    for name, g, r in zip("qkv", grads, ref):
        assert rel(g, r) <= TOL[torch.bfloat16], name


@pytest.mark.parametrize("mix", ["triton_gemm_sdpa", "torch_gemm_flash"])
def test_attention_sub_op_mixes_match_the_library_path_in_bf16(mix):
    """The attention half's mixes (fused GEMMs + SDPA core, cuBLAS GEMMs + Triton core) under bf16
    autocast against the library path, forward and gradients."""
    from revtriton.ops import backend

    torch.manual_seed(0)
    half = RMSNormAttention(512, 8, kv_heads=2, rope_theta=10000.0, causal=True).cuda()
    x = torch.randn(2, 300, 512, device="cuda", requires_grad=True)
    res = torch.randn(2, 300, 512, device="cuda")
    g = torch.randn_like(res)
    results = []
    for name in (mix, "torch"):
        with backend.use_backend(name), torch.autocast("cuda", dtype=torch.bfloat16):
            stream, port = half.couple(res, x, 1, None)
        results.append((stream.float(), torch.autograd.grad(port, [x, *half.parameters()], g)))
    (s, grads), (s_ref, grads_ref) = results
    assert rel(s, s_ref) <= TOL[torch.bfloat16]
    for got, want in zip(grads, grads_ref):
        assert rel(got, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_bf16_masks_padded_and_packed_rows(head_dim):
    """segments in the compiled kernels (TMA on sm_90): packed and padded rows against SDPA with
    the library path's [B, 1, T, T] mask, and per-row RoPE tables in the backward."""
    from revtriton.ops import fused_attention as fa
    from revtriton.ops.attention import sequence_mask

    torch.manual_seed(0)
    tokens, heads, kv_heads = 300, 4, 2
    segments = torch.tensor([[1] * 100 + [2] * 150 + [3] * 50, [0] * 40 + [1] * 260], device="cuda")
    qkv = torch.randn(2, tokens, heads + 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads], qkv[:, :, heads + kv_heads:]
    o, lse = fa.attention_fwd(q, k, v, causal=True, segments=segments)
    do = torch.randn_like(o)
    positions = torch.stack([torch.arange(tokens), torch.arange(tokens) + 7]).cuda()
    rope = fa.rope_tables_at(positions, head_dim, 10000.0)
    grads = fa.attention_bwd(q, k, v, o, lse, do, causal=True, rope=rope, segments=segments)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = fa._expand_kv(*leaves)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=sequence_mask(segments, True))
    ref = ref.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, leaves, do.float())
    ref_grads = (fa.rope_unrotate_reference(ref_grads[0], *rope), fa.rope_unrotate_reference(ref_grads[1], *rope),
                 ref_grads[2])
    assert rel(o, ref) <= TOL[torch.bfloat16]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel(g, r) <= TOL[torch.bfloat16], name


def test_dispatch_choice_is_at_least_098_of_the_faster_path():
    """Every half: the candidate the dispatcher measured and pinned is >= 0.98 x the faster of the
    two when both are timed again (forward + backward, bf16 autocast, exact streams)."""
    from perf.kernels import BAR_CHOICE_VS_FASTEST, dispatch_report

    rows = dispatch_report(shapes=((4, 512, 512),), device="cuda")
    assert len(rows) == 4 and all(r["source"] == "measured" for r in rows), rows
    for r in rows:  # both timed, unless the library path is not deterministic (then exact mode excludes it)
        assert "triton" in r["bench_ms"], r
        assert "torch" in r["bench_ms"] or "not deterministic" in r["excluded"].get("torch", ""), r
    missed = [r for r in rows if r["chosen_vs_fastest"] < BAR_CHOICE_VS_FASTEST]
    assert not missed, json.dumps(missed, indent=1)


@pytest.mark.parametrize("name", ["layernorm_mlp", "rmsnorm_swiglu", "rmsnorm_attention_gqa_rope"])
def test_fused_scaled_couple_is_the_shifted_couple_and_inverts_bitwise(name):
    # The scale lives in the fused epilogue (issue 14): on exact streams the forward must equal the
    # unscaled fused couple of the shifted stream, bit for bit, and the inverse must restore res.
    from revtriton.ops.streams import ResidualScale

    half = HALVES[name]().cuda()
    x = torch.randn(2, 100, half.dim, device="cuda")
    res = to_fixed(torch.randn(2, 100, half.dim, device="cuda"), 16)
    scale = ResidualScale(2.0**-6)
    with torch.no_grad():
        stream, _ = half.couple(res, x, +1, 16, scale=scale)
        shifted, _ = half.couple(res >> 6, x, +1, 16)
        restored, _ = half.couple(stream, x, -1, 16, scale=ResidualScale(2.0**-6, scale.dropped_bits(res)))
    assert torch.equal(stream, shifted)
    assert torch.equal(restored, res)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_scaled_swapped_fused_stack_trains_like_its_twin(exact):
    # revify(preserve=...)'s couplings on the fused halves, compiled: the backward's rebuild is
    # checksummed (exact: it raises unless bitwise), gradients close to the stored-activation twin's
    # (which runs the halves' reference path: other kernels, so not bitwise).
    from revtriton import to_stored_activations

    torch.manual_seed(0)
    blocks = [ReversibleBlock(RMSNormAttention(256, 4, kv_heads=2), RMSNormSwiGLU(256, 512), scale1=2.0**-6,
                              swap=True) for _ in range(8)]
    stack = ReversibleStack(blocks, exact=exact, anchor_every=0 if exact else 1, readout="second").cuda()
    twin = to_stored_activations(copy.deepcopy(stack))
    x = torch.randn(2, 128, 256, device="cuda")
    grads = []
    for model in (stack, twin):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(xi)
        out.float().square().mean().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
    # With readout="second" and swap=True the last block's G half never reaches the output: the
    # twin's autograd leaves its gradients None, the reversible stack's backward gives zeros.
    dead = {id(p) for p in stack[-1].g.parameters()}
    for p, a, b in zip(stack.parameters(), grads[0][1:], grads[1][1:]):
        if id(p) in dead:
            assert b is None and not a.any()
    alive = [(a, b) for a, b in zip(grads[0], grads[1]) if b is not None]
    assert len(alive) == len(grads[0]) - len(dead)
    for a, b in alive:
        assert rel(a, b) <= TOL[torch.bfloat16]


def test_layout_arguments_are_reused_on_their_own_stream_only(monkeypatch):
    """The packed-row kernel arguments are made once per layout tensor and stream: another stream
    (PaReprop's side stream) makes its own, so replacing the cached ones never frees memory a
    kernel of another stream still reads."""
    from revtriton.ops import fused_attention as fa

    made = []
    real = fa.segment_spans
    monkeypatch.setattr(fa, "segment_spans", lambda seg, until: made.append(1) or real(seg, until))
    monkeypatch.setattr(fa, "_last_segment_args", None)
    segments = torch.tensor([[1] * 40 + [2] * 24], device="cuda")
    like = torch.empty(0, device="cuda")
    first = fa._segment_args(segments, 1, 64, True, like)
    assert fa._segment_args(segments, 1, 64, True, like) is first and len(made) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = fa._segment_args(segments, 1, 64, True, like)
    assert other is not first and len(made) == 2
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(a, b) for a, b in zip(first, other) if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("shape", [(8192, 768, 3072), (4096, 1024, 1000)], ids=["gpt2", "odd_n"])
def test_gemm_tma_and_pointer_paths_give_the_same_bits(monkeypatch, shape):
    """On sm_90 the GEMM's tiles arrive by TMA where every operand can be described and by pointer
    loads otherwise; with one config both run the same dots in the same order, so a forward on an
    aligned buffer and a rebuild on a misaligned view agree bitwise (exact streams need it). The
    weight gradient (M-major A, split K) too."""
    from revtriton.ops import dispatch, gemm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA is sm_90")
    config = next(c for c in gemm.gemm_kernels.fused_gemm_kernel.configs if c.kwargs.get("USE_TMA"))
    monkeypatch.setattr(gemm.gemm_kernels.fused_gemm_kernel, "configs", [config])
    seen = []
    launch = dispatch.launch

    def recording(kernel, grid, *args, **meta):
        if "TMA_READY" in meta:
            seen.append(meta["TMA_READY"])
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(gemm.dispatch, "launch", recording)
    tokens, dim, hidden = shape
    n = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    dz = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def misaligned(t):
        wide = torch.zeros(t.shape[0], t.shape[1] + 1, device="cuda", dtype=t.dtype)
        wide[:, :-1] = t
        return wide[:, :-1]

    aligned = (gemm.linear(n, w, activation="gelu_tanh")[0], gemm.linear_weight_grad(dz, n, split_k=3))
    pointers = (gemm.linear(misaligned(n), w, activation="gelu_tanh")[0],
                gemm.linear_weight_grad(misaligned(dz), misaligned(n), split_k=3))
    assert seen == [True, True, False, False]
    for a, b in zip(aligned, pointers):
        assert torch.equal(a, b)
    assert rel(aligned[0], gemm.linear_reference(n, w, activation="gelu_tanh")[0]) <= TOL[torch.bfloat16]
    assert rel(aligned[1], gemm.linear_weight_grad_reference(dz, n)) <= 1e-2


def _gemm_table_configs():
    from revtriton.kernels import configs as kc

    arch = 90 if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 else 80
    return [(kind, c) for kind in ("regular", "dual", "act_grad") for c in kc.configs_for_arch(kind, arch)]


@pytest.mark.parametrize("kind,config", _gemm_table_configs() if torch.cuda.is_available() else [],
                         ids=lambda v: v if isinstance(v, str) else "x".join(
                             f"{v.kwargs[k]}" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + f"s{v.num_stages}"
                         + ("p" if v.kwargs.get("PERSISTENT") else ""))
def test_every_gemm_table_config_matches_the_reference_compiled(monkeypatch, kind, config):
    """Each config of the device's GEMM lists, pinned, on the compiled path (the autotuner would
    pick among them by speed alone): the forward GEMM, the activation and weight gradients and the
    couple at GPT-2's width (bf16; 2048 tokens: 384 tiles of 128 x 128, so persistent configs walk
    several tiles a program)."""
    from revtriton.ops import gemm

    kernel = {"regular": gemm.gemm_kernels.fused_gemm_kernel, "dual": gemm.gemm_kernels.fused_gemm_dual_kernel,
              "act_grad": gemm.gemm_kernels.fused_gemm_act_grad_kernel}[kind]
    monkeypatch.setattr(kernel, "configs", [config])
    tokens, dim, hidden, bf16 = 2048, 768, 3072, torch.bfloat16
    n = torch.randn(tokens, dim, device="cuda", dtype=bf16)
    w, b = torch.randn(hidden, dim, device="cuda", dtype=bf16) / dim**0.5, torch.randn(hidden, device="cuda")
    w_down = torch.randn(dim, hidden, device="cuda", dtype=bf16) / hidden**0.5
    if kind == "dual":
        w_up = torch.randn(hidden, dim, device="cuda", dtype=bf16) / dim**0.5
        got = gemm.linear(n, w, None, activation="swiglu", weight_up=w_up)[0]
        want = gemm.linear_reference(n, w, None, activation="swiglu", weight_up=w_up)[0]
        assert rel(got, want) <= TOL[bf16]
        return
    pre, g = torch.randn(tokens, hidden, device="cuda", dtype=bf16), torch.randn(tokens, dim, device="cuda",
                                                                                dtype=bf16)
    if kind == "act_grad":  # exact GELU's gradient and SwiGLU's
        got = gemm.linear_act_bwd(g, w_down, pre, activation="gelu")[0]
        assert rel(got, gemm.linear_act_bwd_reference(g, w_down, pre, activation="gelu")[0]) <= TOL[bf16]
        pre2 = torch.randn(tokens, 2 * hidden, device="cuda", dtype=bf16)
        got = gemm.linear_act_bwd(g, w_down, pre2, activation="swiglu")[0]
        assert rel(got, gemm.linear_act_bwd_reference(g, w_down, pre2, activation="swiglu")[0]) <= TOL[bf16]
        return
    got = gemm.linear_act_bwd(g, w_down, pre, activation="gelu_tanh")[0]
    assert rel(got, gemm.linear_act_bwd_reference(g, w_down, pre, activation="gelu_tanh")[0]) <= TOL[bf16]
    got = gemm.linear(n, w, b.to(bf16), activation="gelu_tanh")[0]
    assert rel(got, gemm.linear_reference(n, w, b.to(bf16), activation="gelu_tanh")[0]) <= TOL[bf16]
    dz = torch.randn(tokens, hidden, device="cuda", dtype=bf16)
    assert rel(gemm.linear_weight_grad(dz, n, split_k=1), gemm.linear_weight_grad_reference(dz, n)) <= 1e-2
    h, res = torch.randn(tokens, hidden, device="cuda", dtype=bf16), torch.randn(tokens, dim, device="cuda")
    got = gemm.linear_couple(h, w_down, None, res, 1)
    assert rel(got - res, gemm.linear_couple_reference(h, w_down, None, res, 1) - res) <= TOL[bf16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_lm_loss_on_cuda_equals_the_full_logits_and_stays_bounded(dtype):
    """Issue 36 on the GPU: the chunked linear + cross-entropy against the full-logits loss (float32
    softmax either way), and its peak (CUDA allocator) past the weight's gradient under 0.15x the
    float32 logits at 8192 tokens of GPT-2's vocabulary."""
    from revtriton.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

    torch.manual_seed(0)
    tokens, dim, vocab = 8192, 768, 50257
    hidden = torch.randn(tokens, dim, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, device="cuda", dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[::7] = -100
    results = []
    for fn in (linear_cross_entropy_reference, linear_cross_entropy):
        loss = fn(hidden, weight, labels, label_smoothing=0.1)
        results.append((loss, *torch.autograd.grad(loss, [hidden, weight])))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(results[1], results[0]):
        assert rel(ours, theirs) <= tolerance
    weight.grad = torch.zeros_like(weight)
    peak = peak_memory(lambda: linear_cross_entropy(hidden, weight, labels).backward(), "cuda")
    assert peak - 4 * weight.numel() <= 0.15 * tokens * vocab * 4


@pytest.mark.parametrize("exact", [False, True], ids=["float", "exact"])
def test_token_chunk_on_cuda_keeps_the_gradients_and_lowers_the_peak(exact):
    """Issue 36 on the GPU: a LLaMA-style stack (fused halves, bf16 autocast) at 4 x 1024 tokens, width
    512, by chunks (the MLP 1024 rows at a time, the attention a sample at a time) against the same
    stack whole: gradients within bf16 rounding (the kernels' sums over other row counts), an exact
    rebuild bitwise (the backward's checksum raises otherwise), and the step's CUDA peak below 0.8x (about
    eight stream-sized buffers stay, the MLP's [4096, 3072] pre-activations go: pending a GPU run)."""
    def build(chunk):
        torch.manual_seed(0)
        blocks = [ReversibleBlock(RMSNormAttention(512, 8, kv_heads=2), RMSNormSwiGLU(512, 1536)) for _ in range(4)]
        return ReversibleStack(blocks, exact=exact, token_chunk=chunk).cuda()

    x = torch.randn(4, 1024, 512, device="cuda", requires_grad=True)
    grads, peaks = [], []
    for chunk in (None, 1024):
        stack = build(chunk)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                stack(x).float().square().mean().backward()

        stack.zero_grad(set_to_none=True)
        x.grad = None
        step()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in stack.parameters()])
        peaks.append(peak_memory(step, device="cuda"))
    assert max(rel(a, b) for a, b in zip(grads[1], grads[0])) <= TOL[torch.bfloat16]
    assert peaks[1] <= 0.8 * peaks[0], peaks


def test_the_compiled_checksum_is_bitwise_the_reference():
    """Issue 39: the checksum's non-linear weights (a multiply, an arithmetic right shift, an xor,
    a multiply) give the torch reference's bits in the compiled kernel too, across blocks."""
    from revtriton.ops.streams import CHECKSUM_BLOCK, stream_checksum_reference, stream_checksum_triton

    for numel in (1, 77, CHECKSUM_BLOCK, 5 * CHECKSUM_BLOCK + 3):
        s1 = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, device="cuda")
        s2 = torch.randint(-2**29, 2**29, (numel,), dtype=torch.int32, device="cuda")
        assert torch.equal(stream_checksum_triton(s1, s2), stream_checksum_reference(s1, s2)), numel


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "drop-path"])
@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
@pytest.mark.parametrize("make_block", [vit_block, llama_block], ids=["vit", "llama"])
def test_a_captured_step_is_bitwise_the_eager_step(make_block, schedule, dropout):
    """Issue 35: engine.graphs.CapturedStep (forward, two-stream backward, AdamW(capturable=True))
    against the same steps run eagerly, exact streams, depth 12: every loss and parameter bitwise,
    through the warm-up, the capture and the replays; the replays' checks pass. With drop-path the
    recomputes draw from generators registered with the graph, placed before each replay at the
    forward's offsets (halves.randomness.GraphDraws): the same masks as the eager step's."""
    from revtriton import CapturedStep

    torch.manual_seed(0)
    drop_path = 0.1 if dropout else 0.0
    stacks = [ReversibleStack([make_block(drop_path=drop_path) for _ in range(12)], schedule=schedule,
                              exact=True).cuda().train()]
    stacks.append(copy.deepcopy(stacks[0]))
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-3, capturable=True) for s in stacks]

    def trainer(stack, optimizer):
        def train_step(x, target):
            optimizer.zero_grad()
            loss = (stack(x) - target).float().square().mean()
            loss.backward()
            optimizer.step()
            return loss.detach()
        return train_step

    eager, step = trainer(stacks[0], optimizers[0]), CapturedStep(trainer(stacks[1], optimizers[1]), warmup=2)
    for i in range(6):
        x, target = torch.randn(2, 64, 256, device="cuda"), torch.randn(2, 64, 256, device="cuda")
        torch.manual_seed(100 + i)
        expected = eager(x, target).clone()
        torch.manual_seed(100 + i)
        got = step(x, target).clone()
        assert torch.equal(got, expected), i
        assert all(torch.equal(a, b) for a, b in zip(stacks[0].parameters(), stacks[1].parameters())), i
    assert step.captured
    step.check()
    if dropout:
        assert len(step._draws.replays) == 24  # every half drew (drop-path), each recompute its own generator


@pytest.mark.parametrize("schedule", ["sequential", "pareprop"])
def test_a_captured_steps_memory_pool_is_flat_in_depth(schedule):
    """Issue 35: the memory a CUDA graph of a reversible step takes at capture (its private pool:
    the step's activations and temporaries; the gradients kept outside it by zero_grad(set_to_none=False))
    does not grow with depth."""
    from revtriton import CapturedStep

    pools = {}
    for depth in (4, 8):
        torch.manual_seed(0)
        stack = ReversibleStack([llama_block() for _ in range(depth)], schedule=schedule).cuda().train()
        optimizer = torch.optim.SGD(stack.parameters(), lr=1e-3)

        def train_step(x, stack=stack, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=False)
            stack(x).float().square().mean().backward()
            optimizer.step()

        step = CapturedStep(train_step, warmup=1)
        x = torch.randn(4, 512, 256, device="cuda")
        step(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        step(x)  # the capture
        torch.cuda.synchronize()
        pools[depth] = torch.cuda.memory_reserved() - before
        del step, stack, optimizer
        torch.cuda.empty_cache()
    assert pools[4] > 0 and pools[8] <= 1.3 * pools[4], pools


@pytest.mark.parametrize("kind", ["t5", "mbart"])
def test_a_revified_seq2seq_step_on_cuda_is_its_twins(kind):
    """Both stacks of a revified seq2seq model on CUDA (the library's attention modules: T5's with the
    math kernel pinned, mBART's with SDPA's choice; the decoder's cross-attention reading the encoder's
    states): an exact training step with dropout, 256 source tokens, against its stored-activation twin
    (the decoder's gradients bitwise, the encoder's within float rounding), the rebuild's checksums
    passing."""
    pytest.importorskip("transformers")
    from revified import assert_seq2seq_step_equals_its_twin

    from revtriton import revify

    if kind == "t5":
        from test_t5 import t5

        model, encoder_side = t5(seed=0, dropout_rate=0.1), ("encoder.", "shared.")
    else:
        from test_bart import seq2seq

        model = seq2seq("MBart", "ForConditionalGeneration", 0, dropout=0.1, init_std=0.02, max_position_embeddings=512)
        encoder_side = ("model.encoder.", "model.shared.")
    model = revify(model, exact=True).cuda().train()
    ids = torch.randint(3, 128, (2, 256), device="cuda")
    labels = torch.randint(3, 128, (2, 64), device="cuda")
    assert_seq2seq_step_equals_its_twin(model, lambda m: m(input_ids=ids, labels=labels).loss, seed=0,
                                        encoder_side=encoder_side)
