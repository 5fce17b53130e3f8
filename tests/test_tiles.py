"""Every tile shape the GPU config tables can pick, run under the interpreter (issue 21).

Under ``TRITON_INTERPRET=1`` the kernels are decorated with one interpreter config (32 x 32
attention tiles, 64 x 64 x 64 GEMM tiles), so bugs that only show when BLOCK_FIXED !=
BLOCK_STREAM, BLOCK_M != BLOCK_N or with 128-row tiles would never run. Here each distinct
shape of kernels/attention.py FWD_CONFIGS / DKDV_CONFIGS / DQ_CONFIGS, kernels/attention_qkv.py QKV_CONFIGS
and the kernels/configs.py GEMM lists is pinned on its autotuner (``configs = [that config]``,
the single-config path Triton takes without benchmarking) and checked against the pure-torch
references, causal and not. The shape lists are read from the tables at collection time, so a
new shape is tested as soon as it is added. Also here: the row kernels on constant, zero and
large-magnitude rows.
"""
import pytest
import torch

from revtriton.ops import dispatch, gemm, norm_rows
from revtriton.ops import fused_attention as fa

pytestmark = pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")

ka = fa._attention_kernels()
kq = fa._qkv_kernels()
kg = gemm.gemm_kernels
from revtriton.kernels import configs as kc  # noqa: E402  (the package the launchers import)


def shapes(table, names):
    """{tile shape: first config with it} over every list of a table (dict of lists, or lists)."""
    lists = table.values() if isinstance(table, dict) else table
    found = {}
    for configs in lists:
        for c in configs:
            found.setdefault(tuple(c.kwargs[n] for n in names), c)
    return found


FWD = shapes([*ka.FWD_CONFIGS.values(), *ka.FWD_PACKED_ROWS_CONFIGS.values()],
             ("BLOCK_M", "BLOCK_N", "USE_TMA"))  # both load paths (TMA on sm_90)
DKDV = shapes(ka.DKDV_CONFIGS, ("BLOCK_FIXED", "BLOCK_STREAM", "USE_TMA", "ONE_LOOP"))  # both loop forms
DQ = shapes(ka.DQ_CONFIGS, ("BLOCK_FIXED", "BLOCK_STREAM", "USE_TMA"))
QKV = shapes(kq.QKV_CONFIGS, ("BLOCK_M", "BLOCK_K", "HEADS_PER_TILE", "USE_TMA"))  # both load paths
GEMM_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PERSISTENT")  # one program per tile, or per SM
GEMM = shapes([kc.GEMM_CONFIGS_SM90, kc.GEMM_CONFIGS_SM80], GEMM_TILE)
GEMM_DUAL = shapes([kc.GEMM_DUAL_CONFIGS_SM90, kc.GEMM_DUAL_CONFIGS_SM80], GEMM_TILE)
GEMM_ACT_GRAD = shapes([kc.GEMM_ACT_GRAD_CONFIGS_SM90, kc.GEMM_ACT_GRAD_CONFIGS_SM80], GEMM_TILE)


def ids(shape):
    return "x".join(map(str, shape))


def rel_err(actual, expected):
    """max |a - e| / max |e|, with no floor under the denominator; an all-zero expected tensor
    must come out exactly zero."""
    expected = expected.double()
    scale = expected.abs().max()
    error = (actual.double() - expected).abs().max()
    return (error / scale).item() if scale > 0 else (0.0 if error == 0 else float("inf"))


@pytest.fixture
def pin(monkeypatch):
    """pin(autotuned_kernel, config): the kernel runs with exactly that config."""

    def pin_config(kernel, config):
        monkeypatch.setattr(kernel, "configs", [config])

    return pin_config


def test_tables_have_the_shapes_the_tests_expect():
    # If a table is emptied or renamed this file would silently test nothing.
    assert len(FWD) >= 3 and len(DKDV) >= 3 and len(DQ) >= 3 and len(QKV) >= 4
    assert len(GEMM) >= 5 and len(GEMM_DUAL) >= 4 and len(GEMM_ACT_GRAD) >= 4
    assert any(shape[-1] for shape in GEMM) and any(not shape[-1] for shape in GEMM)  # both tile walks
    assert any(f != s for f, s, *_ in DKDV) and any(f != s for f, s, _ in DQ) and any(m != n for m, n, _ in FWD)
    for table in (FWD, DQ):  # both load paths: TMA (sm_90) and pointers (sm_80)
        assert {tma for *_, tma in table} == {True, False}
    assert {(tma, one_loop) for *_, tma, one_loop in DKDV} == {(True, True), (True, False), (False, True),
                                                                (False, False)}


# --------------------------------------------------------------------------------------------
# Flash attention

TOKENS = 136  # not a multiple of any tile, and more than one 128-row tile


def attention_inputs(tokens=TOKENS, heads=4, kv_heads=2, head_dim=16):
    qkv = torch.randn(1, tokens, heads + 2 * kv_heads, head_dim)
    return qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads], qkv[:, :, heads + kv_heads:]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", list(FWD), ids=ids)
def test_attention_forward_at_every_table_tile(seeded, pin, shape, causal):
    pin(ka.attention_fwd_kernel, FWD[shape])
    q, k, v = attention_inputs()
    o, lse = fa.attention_fwd(q, k, v, causal=causal)
    ref_o, ref_lse = fa.attention_fwd_reference(q, k, v, causal=causal)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("causal,rope", [(False, False), (True, True)], ids=["full", "causal-rope"])
@pytest.mark.parametrize("pass_shape", [("dkdv",) + s for s in DKDV] + [("dq",) + s for s in DQ], ids=ids)
def test_attention_backward_at_every_table_tile(seeded, pin, pass_shape, causal, rope):
    which, shape = pass_shape[0], pass_shape[1:]
    if which == "dkdv":
        pin(ka.attention_bwd_dkdv_kernel, DKDV[shape])
    else:
        pin(ka.attention_bwd_dq_kernel, DQ[shape])
    q, k, v = attention_inputs()
    o, lse = fa.attention_fwd_reference(q, k, v, causal=causal)
    do = torch.randn_like(o)
    tables = fa.rope_tables(TOKENS, 16, 10000.0, q.device) if rope else None
    grads = fa.attention_bwd(q, k, v, o.contiguous(), lse.contiguous(), do, causal=causal, rope=tables)
    ref = fa.attention_bwd_reference(q, k, v, do, causal=causal, rope=tables)
    for name, g, r in zip("qkv", grads, ref):
        assert rel_err(g, r) <= 1e-5, f"d{name} at {shape}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", list(QKV), ids=ids)
def test_qkv_projection_at_every_table_tile(seeded, pin, shape, dtype):
    """fp32 operands take the pointer loads; fp16 ones (16-bit, aligned rows) the TMA descriptors
    where the config says USE_TMA (at head dim 16, a power of two): each against the reference,
    over several K steps and a partial last one (width 136)."""
    pin(kq.qkv_rope_gemm_kernel, QKV[shape])
    batch, tokens, heads, kv_heads, head_dim, dim = 2, 70, 4, 2, 16, 136
    n = torch.randn(batch * tokens, dim).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * head_dim, dim) / dim**0.5).to(dtype)
    b = (0.2 * torch.randn(w.shape[0])).to(dtype)
    kwargs = dict(heads=heads, kv_heads=kv_heads, tokens=tokens, rope=fa.rope_tables(tokens, head_dim, 500.0, n.device))
    got = fa.qkv_projection(n, w, b, **kwargs)
    assert rel_err(got, fa.qkv_projection_reference(n, w, b, **kwargs)) <= (1e-5 if dtype == torch.float32 else 1e-2)


# --------------------------------------------------------------------------------------------
# The fused GEMM (regular and dual-accumulator lists)

ROWS, DIM, HIDDEN = 136, 96, 136  # ragged for every tile; several row and column tiles


@pytest.mark.parametrize("shape", list(GEMM), ids=ids)
def test_gemm_variants_at_every_table_tile(seeded, pin, shape):
    pin(kg.fused_gemm_kernel, GEMM[shape])
    n = torch.randn(ROWS, DIM) + 0.5
    w1, b1 = torch.randn(HIDDEN, DIM) / DIM**0.5, torch.randn(HIDDEN)
    w2, b2 = torch.randn(DIM, HIDDEN) / HIDDEN**0.5, torch.randn(DIM)
    kw = dict(activation="gelu_tanh", save_preact=True)
    for got, want in zip(gemm.linear(n, w1, b1, **kw), gemm.linear_reference(n, w1, b1, **kw)):
        assert rel_err(got, want) <= 1e-5
    a, res, row_scale = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, DIM), torch.rand(ROWS) + 0.5
    got = gemm.linear_couple(a, w2, b2, res, -1, row_scale=row_scale)
    want = gemm.linear_couple_reference(a, w2, b2, res, -1, row_scale=row_scale)
    assert rel_err(got - res, want - res) <= 1e-5
    dz = torch.randn(ROWS, HIDDEN)
    for split_k in (1, 3):  # the split-K partials and their fixed-order reduction too
        with dispatch.count_launches() as launches:
            got = gemm.linear_weight_grad(dz, n, split_k=split_k)
        assert sum(launches.values()) == min(split_k, 2)  # a split runs its reduction
        assert rel_err(got, gemm.linear_weight_grad_reference(dz, n)) <= 1e-5
    pre, g = torch.randn(ROWS, HIDDEN), torch.randn(ROWS, DIM)
    (got, sums), (want, want_sums) = (gemm.linear_act_bwd(g, w2, pre, activation="gelu_tanh", col_sums=True),
                                      gemm.linear_act_bwd_reference(g, w2, pre, activation="gelu_tanh",
                                                                    col_sums=True))
    gemm.reduce_partials(sums)  # column-sum partial rows: 64 rows of C each, whatever BLOCK_M
    assert rel_err(got, want) <= 1e-5 and rel_err(sums.out, want_sums) <= 1e-5


@pytest.mark.parametrize("shape", list(GEMM_DUAL), ids=ids)
def test_dual_gemm_variants_at_every_table_tile(seeded, pin, shape):
    pin(kg.fused_gemm_dual_kernel, GEMM_DUAL[shape])
    n = torch.randn(ROWS, DIM)
    w_gate, w_up = torch.randn(HIDDEN, DIM) / DIM**0.5, torch.randn(HIDDEN, DIM) / DIM**0.5
    kw = dict(activation="swiglu", weight_up=w_up, save_preact=True)
    for got, want in zip(gemm.linear(n, w_gate, None, **kw), gemm.linear_reference(n, w_gate, None, **kw)):
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("shape", list(GEMM_ACT_GRAD), ids=ids)
def test_act_grad_gemm_at_every_table_tile(seeded, pin, shape):
    """The heavy-epilogue gradients: SwiGLU's and exact GELU's (with its bias-gradient partials)."""
    pin(kg.fused_gemm_act_grad_kernel, GEMM_ACT_GRAD[shape])
    w_down = torch.randn(DIM, HIDDEN) / HIDDEN**0.5
    g, pre = torch.randn(ROWS, DIM), torch.randn(ROWS, 2 * HIDDEN)
    got, _ = gemm.linear_act_bwd(g, w_down, pre, activation="swiglu")
    want, _ = gemm.linear_act_bwd_reference(g, w_down, pre, activation="swiglu")
    assert rel_err(got, want) <= 1e-5
    pre = pre[:, :HIDDEN].contiguous()
    (got, sums), (want, want_sums) = (gemm.linear_act_bwd(g, w_down, pre, activation="gelu", col_sums=True),
                                      gemm.linear_act_bwd_reference(g, w_down, pre, activation="gelu", col_sums=True))
    gemm.reduce_partials(sums)
    assert rel_err(got, want) <= 1e-5 and rel_err(sums.out, want_sums) <= 1e-5


@pytest.fixture
def gemm_launches(monkeypatch):
    """(grid, meta) of every launch the GEMM launchers make, recorded before it runs."""
    seen = []
    launch = gemm.dispatch.launch

    def recording(kernel, grid, *args, **meta):
        seen.append((grid, meta))
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(gemm.dispatch, "launch", recording)
    return seen


def test_persistent_gemm_programs_walk_every_tile(seeded, pin, gemm_launches):
    """A persistent config launches fewer programs than tiles (three under the interpreter) and each
    walks its share in grouped order: the output is the reference's, for nine 64 x 64 tiles on three
    programs and for four (one program walks two, the others one)."""
    table = next(c for c in kc.GEMM_CONFIGS_SM90 if c.kwargs["PERSISTENT"])
    config = kc.triton.Config(dict(table.kwargs, BLOCK_M=64, BLOCK_N=64), num_warps=4, num_stages=1)
    pin(kg.fused_gemm_kernel, config)
    for rows, out in ((ROWS, HIDDEN), (128, 128)):  # 3 x 3 and 2 x 2 tiles
        n, w = torch.randn(rows, DIM), torch.randn(out, DIM) / DIM**0.5
        got, _ = gemm.linear(n, w, None)
        assert rel_err(got, gemm.linear_reference(n, w, None)[0]) <= 1e-5
    assert [grid({**meta, **config.kwargs}) for grid, meta in gemm_launches] == [(3, 1), (3, 1)]


# --------------------------------------------------------------------------------------------
# The GEMM's two load paths: TMA descriptors (sm_90 configs) and masked pointer loads

TMA_TILES = shapes([kc.GEMM_CONFIGS_SM90, [kc.GEMM_CONFIG_INTERPRETER]], GEMM_TILE)


@pytest.fixture
def load_paths(monkeypatch):
    """The GEMM launches' load-path flags (TMA_READY, A_K_MAJOR, B_K_MAJOR), in order."""
    seen = []
    launch = gemm.dispatch.launch

    def recording(kernel, grid, *args, **meta):
        if "TMA_READY" in meta:  # not the split's reduction
            seen.append((meta["TMA_READY"], meta["A_K_MAJOR"], meta["B_K_MAJOR"]))
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(gemm.dispatch, "launch", recording)
    return seen


def misaligned(t):
    """The same values in a view whose row stride (cols + 1 elements, 2 bytes each) is no 16-byte
    multiple: no descriptor can describe it, so the kernel takes the pointer path."""
    rows, cols = t.shape
    wide = torch.zeros(rows, cols + 1, dtype=t.dtype)
    wide[:, :cols] = t
    return wide[:, :cols]


@pytest.mark.parametrize("shape", list(TMA_TILES), ids=ids)
def test_gemm_tma_and_pointer_loads_give_the_same_bits(seeded, pin, load_paths, shape):
    """fp16 operands at a Hopper tile: the aligned call loads by TMA (K-major A and B in the forward,
    M- and N-major in the weight gradient), a misaligned copy by pointers, and both give the same
    bits and the reference's values. The weight gradient's split ends inside a K tile (48 tokens
    a split against 64-deep tiles): its descriptors must stop at the split's end (zero fill)."""
    pin(kg.fused_gemm_kernel, TMA_TILES[shape])
    pin(kg.fused_gemm_dual_kernel, TMA_TILES[shape])
    rows, dim, hidden, dt = 130, 96, 136, torch.float16
    n = torch.randn(rows, dim).to(dt)
    w, b = (torch.randn(hidden, dim) / dim**0.5).to(dt), torch.randn(hidden).to(dt)
    w_up = (torch.randn(hidden, dim) / dim**0.5).to(dt)
    dz = torch.randn(rows, hidden).to(dt)
    g2 = torch.randn(rows, 2 * hidden).to(dt)
    w_down = torch.randn(hidden, dim).to(dt)

    def run(n, dz, g2):
        return (gemm.linear(n, w, b, activation="gelu_tanh")[0],
                gemm.linear(n, w, None, activation="swiglu", weight_up=w_up)[0],
                gemm.linear_weight_grad(dz, n, split_k=3),  # 48 tokens a split
                gemm.linear_input_grad(g2, w_down, weight2=w_down))  # two K segments of A

    by_tma = run(n, dz, g2)
    assert load_paths == [(True, True, True), (True, True, True), (True, False, False), (True, True, False)]
    load_paths.clear()
    by_pointers = run(misaligned(n), misaligned(dz), misaligned(g2))
    assert not any(ready for ready, _, _ in load_paths)
    for got, want in zip(by_tma, by_pointers):
        assert torch.equal(got, want)
    refs = (gemm.linear_reference(n, w, b, activation="gelu_tanh")[0],
            gemm.linear_reference(n, w, None, activation="swiglu", weight_up=w_up)[0],
            gemm.linear_weight_grad_reference(dz, n),
            gemm.linear_input_grad_reference(g2, w_down, weight2=w_down))
    for got, want in zip(by_tma, refs):
        assert rel_err(got, want) <= 1e-2


def test_gemm_pointer_loads_of_aligned_operands_take_the_hints_and_give_the_tma_bits(seeded, pin, monkeypatch):
    """Descriptor-ready fp16 operands whose sizes are multiples of 8, not all of 16 (136 rows, widths
    200 and 136): a config without TMA (sm_80's pointer loads) is told their alignment (ALIGNED_8:
    sizes and strides multiples of 8, which the JIT's specialisation cannot see) and gives bitwise
    what the TMA config gives, and the reference's values."""
    hinted = []
    launch = gemm.dispatch.launch

    def recording(kernel, grid, *args, **meta):
        if "ALIGNED_8" in meta:
            hinted.append(meta["TMA_READY"] and meta["ALIGNED_8"])
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(gemm.dispatch, "launch", recording)
    rows, dim, hidden, dt = 136, 200, 136, torch.float16
    n = torch.randn(rows, dim).to(dt)
    w, b = (torch.randn(hidden, dim) / dim**0.5).to(dt), torch.randn(hidden).to(dt)
    dz = torch.randn(rows, hidden).to(dt)
    g = torch.randn(rows, hidden).to(dt)

    def run(use_tma):
        config = kc.GEMM_CONFIG_INTERPRETER
        config = type(config)({**config.kwargs, "USE_TMA": use_tma}, num_warps=config.num_warps,
                              num_stages=config.num_stages)
        pin(kg.fused_gemm_kernel, config)
        return (gemm.linear(n, w, b, activation="gelu_tanh")[0], gemm.linear_weight_grad(dz, n),
                gemm.linear_input_grad(g, w))

    by_pointers, by_tma = run(False), run(True)
    assert hinted and all(hinted)
    for got, want in zip(by_pointers, by_tma):
        assert torch.equal(got, want)
    refs = (gemm.linear_reference(n, w, b, activation="gelu_tanh")[0], gemm.linear_weight_grad_reference(dz, n),
            gemm.linear_input_grad_reference(g, w))
    for got, want in zip(by_pointers, refs):
        assert rel_err(got, want) <= 1e-2


def test_gemm_takes_no_alignment_hint_where_the_jit_sees_multiples_of_16(seeded, gemm_launches):
    """Every size and stride a multiple of 16 (128 x 256 x 128, fp16): the JIT's own specialisation
    says it all, so no launch sets ALIGNED_8 (it would compile a second variant of the same kernel),
    with or without the epilogue's tiles (the couple's residual, the saved pre-activation)."""
    rows, dim, hidden, dt = 128, 256, 128, torch.float16
    n, w = torch.randn(rows, dim).to(dt), (torch.randn(hidden, dim) / dim**0.5).to(dt)
    gemm.linear(n, w, None, activation="gelu_tanh", save_preact=True)
    gemm.linear_couple(n, w, None, torch.randn(rows, hidden), +1)
    gemm.linear_weight_grad(torch.randn(rows, hidden).to(dt), n)
    gemm.linear_input_grad(torch.randn(rows, hidden).to(dt), w)
    flags = [meta["ALIGNED_8"] for _, meta in gemm_launches if "ALIGNED_8" in meta]
    assert len(flags) >= 4 and not any(flags), flags


def test_gemm_writes_an_output_through_its_strides(seeded):
    """The launch writes C where its strides say: a transposed buffer (row stride 1, column stride
    M) at sizes where the alignment hint would otherwise be taken (multiples of 8, not all of 16):
    the hint rewrites the output's row stride as a multiple of 8, so it must not be taken here."""
    rows, dim, hidden = 136, 136, 200
    a = torch.randn(rows, dim).half()
    w = (torch.randn(hidden, dim) / dim**0.5).half()
    c = torch.empty(hidden, rows).t()
    gemm._launch_gemm(a, a.stride(), w, (w.stride(1), w.stride(0)), c, rows, hidden, dim)
    assert rel_err(c, a.float() @ w.float().t()) <= 1e-3


def test_gemm_loads_by_pointers_where_no_descriptor_fits(seeded, load_paths):
    """fp32 operands (the correctness path), and an input gradient whose second K segment starts
    off a 16-byte boundary (K = 100 fp16 columns: 200 bytes), take the pointer path."""
    a, w = torch.randn(33, 64), torch.randn(48, 64)
    assert rel_err(gemm.linear(a, w)[0], gemm.linear_reference(a, w)[0]) <= 1e-5
    g2, w_down = torch.randn(33, 200).to(torch.float16), torch.randn(100, 64).to(torch.float16)
    got = gemm.linear_input_grad(g2, w_down, weight2=w_down)
    assert rel_err(got, gemm.linear_input_grad_reference(g2, w_down, weight2=w_down)) <= 1e-2
    assert [ready for ready, _, _ in load_paths] == [False, False]


# --------------------------------------------------------------------------------------------
# Row kernels on rows with zero variance or large values


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_row_kernels_on_constant_zero_and_large_rows(seeded, norm):
    """A constant row has variance 0 and an all-zero row has mean square 0: only eps keeps rstd
    finite (1/sqrt(eps)). Rows of +-3000 check the sums of squares stay accurate. dim 96 is not a
    power of two: the row is padded to 128 in registers, and the means must divide by 96."""
    dim, eps = 96, 1e-6
    x = torch.randn(9, dim)
    x[0] = 0.0
    x[1] = 1.5
    x[2] = -3.25
    x[3] = 3000.0 * torch.randn(dim).sign()
    x[4] = 3000.0 + torch.randn(dim)  # large mean, small spread
    gamma = torch.randn(dim) + 1
    beta = torch.randn(dim) if norm == "layer" else None
    # The norm is applied once per row, before the GEMMs (issue 12): large-mean and large-scale
    # rows must normalise as accurately as the fp32 reference.
    # The oracle is float64: an fp32 reference loses about 1e-4 of a 3000 + noise row's spread itself.
    n, mean, rstd = norm_rows.normalize(x, norm=norm, eps=eps, norm_weight=gamma, norm_bias=beta)
    ref_n, ref_mean, ref_rstd = norm_rows.normalize_and_stats_reference(
        x.double(), norm=norm, eps=eps, norm_weight=gamma.double(), norm_bias=None if beta is None else beta.double())
    assert torch.isfinite(mean).all() and torch.isfinite(rstd).all() and torch.isfinite(n).all()
    assert rel_err(mean, ref_mean) <= 1e-6 and rel_err(rstd, ref_rstd) <= 1e-5
    for row in range(9):  # row by row: a large row must not hide a wrong small one
        assert rel_err(n[row], ref_n[row]) <= 2e-6, row
    zero_var = [0, 1, 2] if norm == "layer" else [0]
    assert torch.allclose(rstd[zero_var], torch.full((len(zero_var),), eps**-0.5), rtol=1e-5)
    dn, dres = torch.randn(9, dim), torch.randn(9, dim)
    stats = (mean, rstd)
    got = norm_rows.norm_bwd(dn, x, stats, gamma, norm=norm, has_bias=norm == "layer", dres=dres)
    want = norm_rows.norm_bwd_reference(dn, x, stats, gamma, norm=norm, has_bias=norm == "layer", dres=dres)
    for g, w in zip(got, want):
        if w is not None:
            assert torch.isfinite(g).all() and rel_err(g, w) <= 1e-5


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
def test_fused_mlp_half_on_constant_and_zero_rows(seeded, kind):
    """The fused norm+MLP couple (forward and gradients) on tokens that are constant or zero."""
    from revtriton.ops import mlp

    dim, hidden = 64, 96
    x = torch.randn(2, 5, dim)
    x[0, 0], x[0, 3], x[1] = 0.0, 2.5, -1.0
    x.requires_grad_(True)
    if kind == "layer":
        params = [torch.randn(dim) + 1, torch.randn(dim), torch.randn(hidden, dim) / 8, torch.randn(hidden),
                  torch.randn(dim, hidden) / 10, torch.randn(dim)]
        fn = lambda xx, ps: mlp.norm_mlp_couple(res, xx, 1, None, *ps, norm="layer", activation="gelu_tanh")  # noqa
    else:
        params = [torch.randn(dim) + 1, torch.randn(hidden, dim) / 8, torch.randn(hidden, dim) / 8,
                  torch.randn(dim, hidden) / 10]
        fn = lambda xx, ps: mlp.swiglu_mlp_couple(res, xx, 1, None, *ps)  # noqa: E731
    params = [p.requires_grad_(True) for p in params]
    res, g = torch.randn(2, 5, dim), torch.randn(2, 5, dim)
    results = []
    for triton_path in (True, False):
        with dispatch.force_triton(triton_path):
            stream, port = fn(x, params)
            grads = torch.autograd.grad(port, [x] + params, g)
        results.append((stream, grads))
    (s, grads), (s_ref, grads_ref) = results
    assert torch.isfinite(s).all() and rel_err(s - res, s_ref - res) <= 1e-5
    for a, b in zip(grads, grads_ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-5
