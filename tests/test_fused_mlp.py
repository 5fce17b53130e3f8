"""Fused norm+MLP half: every kernel vs its reference under the Triton interpreter, the fused
couple vs the reference half (forward, exact inverse, gradients), scaled couplings (the scale in
GEMM2's epilogue), launch budgets, bad input, and the fused half inside a ReversibleStack."""
import pytest
import torch
import torch.nn.functional as F

from revtriton.ops import dispatch, gemm, mlp, norm_rows
from revtriton.ops.reference import apply_row_scale, normalize_reference
from revtriton.ops.fused_mlp import fused_norm_mlp_couple, fused_swiglu_mlp_couple
from revtriton.ops.streams import ResidualScale, couple_output, quantize_reference, to_fixed

from launch_plans import assert_kept_plans_change_nothing, strided_copy

pytestmark = pytest.mark.skipif(not dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (conftest)")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# ---------------------------------------------------------------- every launcher vs its reference

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,dim,hidden", [(1, 96, 200), (7, 200, 64), (130, 64, 96), (130, 200, 96),
                                             (197, 384, 64)])  # the last: more output tiles than programs
def test_launchers_match_references(seeded, dtype, rows, dim, hidden):
    tol = TOL[dtype]
    x = rand(rows, dim, dtype=dtype) + 0.5  # a non-zero mean exercises the centering
    w1, b1 = rand(hidden, dim, dtype=dtype, scale=dim ** -0.5), rand(hidden, dtype=dtype)
    w_up = rand(hidden, dim, dtype=dtype, scale=dim ** -0.5)
    w2, b2 = rand(dim, hidden, dtype=dtype, scale=hidden ** -0.5), rand(dim, dtype=dtype)
    gamma, beta = rand(dim) + 1, rand(dim)
    row_scale = torch.rand(rows) + 0.5
    errors = {}
    for norm in ("layer", "rms"):
        nb = beta if norm == "layer" else None
        kw = dict(norm=norm, norm_weight=gamma, norm_bias=nb, out_dtype=dtype)
        got, want = norm_rows.normalize(x, **kw), norm_rows.normalize_and_stats_reference(x, **kw)
        errors[f"normalize_{norm}"] = max(rel_err(s, r) for s, r in zip(got, want) if r.norm() > 0)
        n, mean, rstd = got
        for act in ("gelu_tanh", "gelu", "relu"):
            out, pre = gemm.linear(n, w1, b1, activation=act, save_preact=True)
            ref_out, ref_pre = gemm.linear_reference(n, w1, b1, activation=act, save_preact=True)
            errors[f"linear_{norm}_{act}"] = max(rel_err(out, ref_out), rel_err(pre, ref_pre))
        kw = dict(activation="swiglu", weight_up=w_up, save_preact=True)
        out, pre = gemm.linear(n, w1, None, **kw)
        ref_out, ref_pre = gemm.linear_reference(n, w1, None, **kw)
        errors[f"linear_{norm}_swiglu"] = max(rel_err(out, ref_out), rel_err(pre, ref_pre))

        dn = rand(rows, dim)
        dres = rand(rows, dim, dtype=dtype)
        got = norm_rows.norm_bwd(dn, x, (mean, rstd), gamma, norm=norm, has_bias=norm == "layer", dres=dres)
        want = norm_rows.norm_bwd_reference(dn, x, (mean, rstd), gamma, norm=norm, has_bias=norm == "layer", dres=dres)
        errors[f"norm_bwd_{norm}"] = max(rel_err(g, w) for g, w in zip(got, want) if w is not None)

    a = rand(rows, hidden, dtype=dtype)
    res = rand(rows, dim)
    for sign in (1, -1):
        got = gemm.linear_couple(a, w2, b2, res, sign, row_scale=row_scale)
        errors[f"couple_float_{sign}"] = rel_err(got - res, gemm.linear_couple_reference(
            a, w2, b2, res, sign, row_scale=row_scale) - res)
    g = rand(rows, dim)
    kw = dict(alpha=-1.0, row_scale=row_scale, out_dtype=dtype, col_sums=True)
    (gs, sums), (ref_gs, ref_sums) = gemm.scale_rows(g, **kw), gemm.scale_rows_reference(g, **kw)
    gemm.reduce_partials(sums)
    errors["scale_rows"] = max(rel_err(gs, ref_gs), rel_err(sums.out, ref_sums))
    for act in ("gelu_tanh", "gelu", "relu", "swiglu"):
        width = 2 * hidden if act == "swiglu" else hidden
        pre = rand(rows, width, dtype=dtype)
        kw = dict(activation=act, col_sums=act != "swiglu")
        (got, sums), (want, want_sums) = (gemm.linear_act_bwd(gs, w2, pre, **kw),
                                          gemm.linear_act_bwd_reference(gs, w2, pre, **kw))
        gemm.reduce_partials(sums)
        errors[f"act_bwd_{act}"] = max(rel_err(got, want), rel_err(sums.out, want_sums) if sums else 0.0)
        act_out = rand(rows, hidden, dtype=dtype)
        for split_k in (None, 2):
            got = gemm.linear_weight_grad(gs, act_out, split_k=split_k)
            errors[f"weight_grad_split{split_k}"] = rel_err(got, gemm.linear_weight_grad_reference(gs, act_out))
    dz = rand(rows, hidden, dtype=dtype)
    errors["input_grad"] = rel_err(gemm.linear_input_grad(dz, w1), gemm.linear_input_grad_reference(dz, w1))
    dz2 = rand(rows, 2 * hidden, dtype=dtype)
    errors["input_grad_swiglu"] = rel_err(gemm.linear_input_grad(dz2, w1, weight2=w_up),
                                          gemm.linear_input_grad_reference(dz2, w1, weight2=w_up))
    worst = max(errors, key=errors.get)
    print(f"\n{dtype} rows={rows} dim={dim} hidden={hidden}: max rel err {errors[worst]:.1e} ({worst})")
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


def test_reduce_partials_runs_every_job_in_a_fixed_order(seeded):
    """Five jobs of different heights, widths and output dtypes: two launches (four per launch),
    each column summed in row order (bitwise equal to a sequential fp32 sum), rerun bitwise equal."""
    shapes = [(7, 33, torch.float32), (1, 5, torch.float16), (130, 96, torch.float32), (3, 300, torch.bfloat16),
              (64, 1, torch.float32)]
    jobs = [gemm.Partials(torch.randn(p, n), torch.empty(n, dtype=dtype)) for p, n, dtype in shapes]
    with dispatch.count_launches() as launches:
        gemm.reduce_partials(jobs[0], None, *jobs[1:])
    assert sum(launches.values()) == 2, launches
    first = [j.out.clone() for j in jobs]
    wants = [gemm.Partials(j.part, torch.empty_like(j.out, dtype=torch.float32)) for j in jobs]
    gemm.reduce_partials_reference(*wants)  # p = 0, 1, ... in order, fp32
    for job, want in zip(jobs, wants):
        if job.out.dtype == torch.bfloat16:  # the interpreter's bf16 cast truncates (a GPU rounds to nearest)
            assert torch.allclose(job.out.float(), want.out, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(job.out, want.out.to(job.out.dtype))
    gemm.reduce_partials(*jobs)
    assert all(torch.equal(a, j.out) for a, j in zip(first, jobs))


def test_exact_epilogue_rounds_half_to_even_saturates_and_maps_nan(seeded):
    frac_bits = 4
    ulp = 2.0 ** -frac_bits
    ties = (torch.arange(-8, 8, dtype=torch.float32) + 0.5) * ulp  # every value is a tie
    special = torch.tensor([2.0 ** 40, -2.0 ** 40, float("inf"), float("-inf"), float("nan"), 2.0 ** 27 - ulp / 2,
                            0.49 * ulp, -0.51 * ulp, 3.0 * ulp, -2.5 * ulp, 1e-30, -0.0, 0.5 * ulp, -0.5 * ulp,
                            1.5 * ulp, 2.0 ** 26 + 0.5 * ulp])
    h = torch.cat([ties, special, torch.randn(32) * 4])  # 64 values
    n = h.numel()
    # a = 0, weight = 0, bias = h: the epilogue sees exactly h in every row (inf * 0 never happens).
    rows = 5
    a, weight = torch.zeros(rows, 16), torch.zeros(n, 16)
    res = torch.randint(-2 ** 20, 2 ** 20, (rows, n), dtype=torch.int32)
    for sign in (1, -1):
        got = gemm.linear_couple(a, weight, h, res, sign, frac_bits=frac_bits)
        q = quantize_reference(h.expand(rows, n), frac_bits)
        want = res + q if sign > 0 else res - q
        assert torch.equal(got, want)


# ---------------------------------------------------------------- the fused couple vs the reference half

def make_params(kind, dim, hidden, dtype=torch.float32):
    if kind == "swiglu":
        return [rand(dim) + 1, rand(hidden, dim, scale=dim ** -0.5, dtype=dtype),
                rand(hidden, dim, scale=dim ** -0.5, dtype=dtype), rand(dim, hidden, scale=hidden ** -0.5, dtype=dtype)]
    norm_bias = rand(dim) if kind == "layer" else None
    params = [rand(dim) + 1, norm_bias, rand(hidden, dim, scale=dim ** -0.5), rand(hidden),
              rand(dim, hidden, scale=hidden ** -0.5), rand(dim)]
    return [None if p is None else p.to(dtype) if i >= 2 else p for i, p in enumerate(params)]


def couple_fn(kind, activation="gelu_tanh", eps=1e-6):
    """The dispatching couple ``(res, x, sign, frac_bits, params, row_scale, scale=None)``."""
    if kind == "swiglu":
        return lambda res, x, sign, fb, p, rs, scale=None: mlp.swiglu_mlp_couple(res, x, sign, fb, *p, eps=eps,
                                                                                 row_scale=rs, scale=scale)
    return lambda res, x, sign, fb, p, rs, scale=None: mlp.norm_mlp_couple(
        res, x, sign, fb, *p, norm=kind, activation=activation, eps=eps, row_scale=rs, scale=scale)


def reference_h(kind, activation, x, params, rs):
    if kind == "swiglu":
        return mlp.swiglu_mlp_reference(x, *params, row_scale=rs)
    return mlp.norm_mlp_reference(x, *params, norm=kind, activation=activation, row_scale=rs)


CASES = [("layer", "gelu_tanh"), ("layer", "gelu"), ("layer", "relu"), ("rms", "gelu_tanh"), ("swiglu", None)]


@pytest.mark.parametrize("kind,activation", CASES)
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_couple_matches_reference_with_launch_budgets(seeded, kind, activation, exact, dtype):
    dim, hidden, shape = 64, 96, (2, 7)
    frac_bits = 16 if exact else None
    sign = -1
    x = (rand(*shape, dim) + 0.3).to(dtype).requires_grad_(True)
    params = [None if p is None else p.requires_grad_(True) for p in make_params(kind, dim, hidden, dtype)]
    rs = (torch.rand(*shape) + 0.5)
    res = to_fixed(rand(*shape, dim), 16) if exact else rand(*shape, dim)
    fn = couple_fn(kind, activation)
    with dispatch.force_triton(), dispatch.count_launches() as fwd:
        stream, port = fn(res, x, sign, frac_bits, params, rs)
    # the pre-activation the kernel saved for backward: (x2, mean, rstd, n, a1, z1, ...)
    saved_z = port.grad_fn.saved_tensors[5] if activation == "relu" else None
    g = rand(*shape, dim)
    with dispatch.force_triton(), dispatch.count_launches() as bwd:
        torch.autograd.backward(port, g)
    assert sum(fwd.values()) <= 3, fwd
    assert 1 <= sum(bwd.values()) <= 7, bwd  # issue 12 budget: <= 8 (README: 3 forward, 7 backward)

    # Oracle: plain autograd of the reference half in float64.
    xd = x.detach().double().requires_grad_(True)
    pd = [None if p is None else p.detach().double().requires_grad_(True) for p in params]
    h = reference_h(kind, activation, xd, pd, rs.double())
    if activation == "relu":
        # ReLU's kink: a pre-activation within rounding of 0 can take the other branch in the
        # kernel than in float64, which moves whole gradient entries (fp16: about one of the 1344
        # pre-activations per run, up to 1e-1 relative on x's gradient). The gradient oracle takes
        # the kernel's own branches (the pre-activation it saved for backward), so the bound is
        # the dtype's alone; a wrong derivative or a lost row scale is off by far more.
        z = saved_z.reshape(*shape, hidden)
        n = normalize_reference(xd, pd[0], pd[1], norm=kind, eps=1e-6)
        h_grad = apply_row_scale(F.linear(F.linear(n, pd[2], pd[3]) * (z > 0), pd[4], pd[5]), rs.double())
    else:
        h_grad = h
    if exact:
        want = res - quantize_reference(reference_h(kind, activation, x.detach(), [None if p is None else p.detach()
                                                                                 for p in params], rs), 16)
        diff = (stream.long() - want.long()).abs()
        assert stream.dtype == torch.int32 and port.dtype == torch.float32
        # One grid step of disagreement is allowed where h * 2^16 sits near a rounding boundary.
        assert diff.max() <= (1 if dtype == torch.float32 else 2 ** 16 * TOL[dtype] * h.abs().max().item())
    else:
        assert stream.dtype == res.dtype
        assert rel_err(stream - res, -h) <= TOL[dtype]
    torch.autograd.backward(-h_grad, g.double())
    got = [x.grad] + [p.grad for p in params if p is not None]
    want = [xd.grad] + [p.grad for p in pd if p is not None]
    tol = TOL[dtype]
    leaves = [x] + [p for p in params if p is not None]
    for name, a, b, leaf in zip(["x"] + [f"p{i}" for i in range(len(got) - 1)], got, want, leaves):
        assert a.dtype == leaf.dtype
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_forward_and_inverse_are_bitwise_consistent(seeded, kind, dtype):
    dim, hidden = 96, 200
    x = (rand(3, 5, dim) * 3).to(dtype)
    params = make_params(kind, dim, hidden, dtype)
    res = to_fixed(rand(3, 5, dim) * 100, 16)
    fn = couple_fn(kind)
    with dispatch.force_triton():
        y, port = fn(res, x, 1, 16, params, None)
        back, _ = fn(y, x, -1, 16, params, None)
    assert port is None
    assert not torch.equal(y, res)
    assert torch.equal(back, res)
    # With grad (the recompute in backward) the stream is bitwise the no-grad forward's.
    xg = x.clone().requires_grad_(True)
    with dispatch.force_triton():
        y_grad, port = fn(res, xg, 1, 16, params, None)
    assert port is not None and torch.equal(y_grad, y)


def test_no_grad_forward_keeps_nothing_and_float_port_is_the_stream(seeded):
    dim, hidden = 64, 64
    x = rand(5, dim)
    params = make_params("layer", dim, hidden)
    res = rand(5, dim)
    fn = couple_fn("layer")
    with dispatch.force_triton():
        stream, port = fn(res, x, 1, None, params, None)
        assert port is None and stream.grad_fn is None
        params[2].requires_grad_(True)
        stream, port = fn(res, x, 1, None, params, None)
    assert port is stream and stream.requires_grad


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", ["layer", "swiglu"])
def test_inputs_the_launches_cannot_read_as_rows_are_copied_first(seeded, kind, grad):
    """A launch reads its tensor's address with the row stride its launch object worked out, so the
    couples hand a contiguous x / res over as they are (gemm.row_operand) and copy any other into
    rows: x with a column stride other than 1, res with one row broadcast to all. The stream, and with
    grad the gradients of x and of every weight, bitwise those of the same values contiguous."""
    dim, hidden, shape = 64, 96, (2, 6)
    params = [p.requires_grad_(grad) for p in make_params(kind, dim, hidden)]  # (LayerNorm's has its bias)
    fn = couple_fn(kind)
    x, row = rand(*shape, dim), rand(1, 1, dim)
    g = rand(*shape, dim)
    by_columns = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, column stride 6
    broadcast = row.expand(*shape, dim)

    def run(res, x):
        x = x.detach().requires_grad_(grad)
        with dispatch.force_triton(), torch.set_grad_enabled(grad):
            stream, _ = fn(res, x, 1, None, params, None)
        return [stream.detach()] + (list(torch.autograd.grad(stream, [x, *params], g)) if grad else [])

    want = run(broadcast.contiguous(), x)
    assert not by_columns.is_contiguous() and not broadcast.is_contiguous()
    for got in (run(broadcast, by_columns), run(broadcast, by_columns)):  # the second: the plan kept
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
def test_a_kept_launch_plan_serves_only_calls_of_its_signature(seeded, kind):
    """A repeated couple call runs the launch plan its first call kept (issue 44 step 5: no checks,
    the launch arguments prebuilt): bitwise the first call's stream, forward and with grad. A call
    that differs in strides, dtype or shape gets a plan of its own (one keyed without the strides
    would read a strided input with the first call's row stride), and bad inputs still raise."""
    from revtriton.ops import fused_mlp

    dim, hidden, shape = 64, 96, (2, 6)
    params = make_params(kind, dim, hidden)
    fn = couple_fn(kind)
    x, res = rand(*shape, dim), rand(*shape, dim)
    strided = strided_copy(x)
    fused_mlp._plans.clear()
    with dispatch.force_triton(), torch.no_grad():
        first, _ = fn(res, x, 1, None, params, None)
        kept = len(fused_mlp._plans.plans)
        assert kept == 1
        assert torch.equal(fn(res.clone(), x.clone(), 1, None, params, None)[0], first)
        assert len(fused_mlp._plans.plans) == kept  # the same signature: the kept plan ran
        assert torch.equal(fn(res, strided, 1, None, params, None)[0], first)
        assert len(fused_mlp._plans.plans) == kept + 1
        longer_x, longer_res = rand(2, 9, dim), rand(2, 9, dim)
        want = longer_res + reference_h(kind, "gelu_tanh", longer_x, params, None)
        assert rel_err(fn(longer_res, longer_x, 1, None, params, None)[0], want) <= TOL[torch.float32]
        half = fn(res.half(), x.half(), 1, None, [None if p is None else p.half() for p in params], None)[0]
        assert half.dtype == torch.float16 and rel_err(half, first) <= TOL[torch.float16]
        with pytest.raises(ValueError, match="does not match the half's dim"):
            fn(res, rand(*shape, dim + 1), 1, None, params, None)
        with pytest.raises(TypeError, match="must be int32"):
            fn(res, x, 1, 16, params, None)

    def rebuild_grads(g, frozen=None):
        """The stream and every gradient of a rebuild (sign -1, with grad) given the stream's gradient."""
        leaf = x.clone().requires_grad_(True)
        ps = [None if p is None else p.detach().clone().requires_grad_(i != frozen) for i, p in enumerate(params)]
        with dispatch.force_triton():
            stream, port = fn(res, leaf, -1, None, ps, None)
            port.backward(g)
        return [stream.detach(), leaf.grad] + [p.grad for p in ps if p is not None]

    # With grad: the forward's and the backward's launches are kept, per gradient layout and per set
    # of inputs that need a gradient; each call below against one made with no plan kept.
    g = rand(*shape, dim)
    frozen = 3 if kind == "layer" else 1  # fc1's bias / the gate weight
    assert_kept_plans_change_nothing(fused_mlp._plans, (
        lambda: rebuild_grads(g), lambda: rebuild_grads(strided_copy(g)), lambda: rebuild_grads(g, frozen)))
    assert rebuild_grads(g, frozen)[2 + frozen] is None


def launch_operand_dtypes(monkeypatch, *modules):
    """Record the dtypes of the tensors every Triton launch receives (through ``modules.launch``)."""
    seen, real = set(), dispatch.launch

    def launch(kernel, grid, *args, **meta):
        seen.update(a.dtype for a in (*args, *meta.values()) if isinstance(a, torch.Tensor))
        return real(kernel, grid, *args, **meta)

    for module in (dispatch, *modules):
        if hasattr(module, "launch"):  # modules that imported dispatch.launch by name
            monkeypatch.setattr(module, "launch", launch)
    return seen


def test_autocast_uses_the_autocast_dtype_for_gemms(seeded, monkeypatch):
    dim, hidden = 64, 96
    x = rand(2, 5, dim).requires_grad_(True)
    params = [p.requires_grad_(True) for p in make_params("swiglu", dim, hidden)]
    res = rand(2, 5, dim)
    fn = couple_fn("swiglu")
    operands = launch_operand_dtypes(monkeypatch)
    with torch.autocast("cpu", dtype=torch.float16):
        with dispatch.force_triton():
            stream, port = fn(res, x, 1, None, params, None)
        assert torch.float16 in operands  # the GEMMs get fp16 operands (fp32 and fp16 errors are both < 1e-2)
        ref, _ = mlp.swiglu_mlp_couple(res, x.detach(), 1, None, *[p.detach() for p in params])
    assert stream.dtype == torch.float32
    assert rel_err(stream - res, ref.float() - res) <= 1e-2
    with dispatch.force_triton():
        port.backward(rand(2, 5, dim))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


# ---------------------------------------------------------------- scaled couplings: the scale in GEMM2's epilogue

@pytest.mark.parametrize("N", [72, 36], ids=["rows-on-bytes", "rows-straddle-bytes"])
def test_linear_couple_applies_the_scale_in_its_epilogue(seeded, N):
    """The couple GEMM with a scale over 2 x 2 tiles at N = 72 (tiles start mid-stream), bitwise
    couple_output with the GEMM's own grid output, shifts 1, 3, 7, full-range streams (the shifts
    and adds wrap), the residual a view with a row stride of its own (the dropped bits follow the
    [M, N] position); float streams against linear_couple_reference."""
    M, K = 70, 32
    a, w, b, rs = rand(M, K), rand(N, K, scale=K ** -0.5), rand(N), torch.rand(M) + 0.5

    def strided(t):  # the same values in a view with a row stride of its own
        view = torch.empty(M, N + 8, dtype=t.dtype)[:, :N]
        return view.copy_(t)

    res = strided(torch.randint(-2**31, 2**31 - 1, (M, N), dtype=torch.int32))
    h = gemm.linear_couple(a, w, b, torch.zeros_like(res), 1, frac_bits=16, row_scale=rs).double() * 2.0**-16
    for shift in (1, 3, 7):
        forward = ResidualScale(2.0**-shift)
        y = gemm.linear_couple(a, w, b, res, 1, frac_bits=16, row_scale=rs, scale=forward)
        assert torch.equal(y, couple_output(res, h, 1, 16, forward)[0])
        inverse = ResidualScale(forward.value, forward.dropped_bits(res))
        back = gemm.linear_couple(a, w, b, strided(y), -1, frac_bits=16, row_scale=rs, scale=inverse)
        assert torch.equal(back, couple_output(y, h, -1, 16, inverse)[0]) and torch.equal(back, res)
    res = rand(M, N)
    for sign in (1, -1):
        kw = dict(row_scale=rs, scale=ResidualScale(0.3))
        got, want = gemm.linear_couple(a, w, b, res, sign, **kw), gemm.linear_couple_reference(a, w, b, res, sign, **kw)
        assert rel_err(got, want) <= 1e-5


def grid_output(fn, x, params, shape):
    """The fused half's own output on the exact grid (what its epilogue adds), as float64: the
    unscaled couple from a zero stream, times 2**-16 (exact). couple_output with this ``h`` is the
    reference epilogue for the fused couple's bits."""
    with dispatch.force_triton(), torch.no_grad():
        q, _ = fn(torch.zeros(shape, dtype=torch.int32), x, 1, 16, params, None)
    return q.double() * 2.0**-16


def port_gradients(fn, res, x, sign, frac_bits, params, scale, g):
    """(stream, gradients of x and the parameters through the port) of one with-grad couple."""
    xg = x.detach().clone().requires_grad_(True)
    leaves = [None if p is None else p.detach().clone().requires_grad_(True) for p in params]
    with dispatch.force_triton():
        stream, port = fn(res, xg, sign, frac_bits, leaves, None, scale=scale)
    return stream, torch.autograd.grad(port, [xg] + [p for p in leaves if p is not None], g)


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
def test_scaled_exact_couple_is_bitwise_the_reference_epilogue(seeded, kind):
    """Shifts 1, 3, 7: forward (res >> s) + q and inverse ((y - q) << s) | the dropped bits,
    bitwise couple_output with the scale, the inverse giving back the forward's input; with grad
    the same streams, and the rebuild's port gradients are the unscaled couple's."""
    dim, hidden, shape = 36, 48, (3, 5)  # 540 elements (not a multiple of 8), rows straddling bytes
    fn = couple_fn(kind)
    x, params = rand(*shape, dim) * 3, make_params(kind, dim, hidden)
    res = to_fixed(rand(*shape, dim) * 100, 16)
    h = grid_output(fn, x, params, res.shape)
    for shift in (1, 3, 7):
        forward = ResidualScale(2.0**-shift)
        with dispatch.force_triton(), dispatch.count_launches() as launches:
            y, port = fn(res, x, 1, 16, params, None, scale=forward)
        assert port is None and sum(launches.values()) == 3  # the scale costs no pass of its own
        assert torch.equal(y, couple_output(res, h, 1, 16, forward)[0])
        inverse = ResidualScale(forward.value, forward.dropped_bits(res))  # the engine keeps them from the forward
        with dispatch.force_triton():
            back, _ = fn(y, x, -1, 16, params, None, scale=inverse)
        assert torch.equal(back, couple_output(y, h, -1, 16, inverse)[0])
        assert torch.equal(back, res)
    g = rand(*shape, dim)
    with dispatch.force_triton():
        y_grad, port = fn(res, x.clone().requires_grad_(True), 1, 16, params, None, scale=forward)
    assert port is not None and torch.equal(y_grad, y)
    stream, grads = port_gradients(fn, y, x, -1, 16, params, inverse, g)
    _, unscaled = port_gradients(fn, y, x, -1, 16, params, None, g)
    assert torch.equal(stream, res)
    assert all(torch.equal(a, b) for a, b in zip(grads, unscaled))


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
def test_scaled_float_couple_matches_the_reference(seeded, kind):
    """scale * res + H(x) forward, (res - H(x)) / scale inverse, against couple_output with the
    float64 reference half; the port's gradients are the unscaled couple's, res gets couple_output's."""
    dim, hidden, shape = 36, 48, (3, 5)
    fn = couple_fn(kind)
    x, params = rand(*shape, dim) + 0.3, make_params(kind, dim, hidden)
    rs = torch.rand(*shape) + 0.5
    scale = ResidualScale(0.3)
    g = rand(*shape, dim)
    h = reference_h(kind, "gelu_tanh", x.double(), [None if p is None else p.double() for p in params], rs.double())
    for sign in (1, -1):
        res = rand(*shape, dim).requires_grad_(True)
        xg = x.clone().requires_grad_(True)
        leaves = [None if p is None else p.clone().requires_grad_(True) for p in params]
        with dispatch.force_triton():
            stream, port = fn(res, xg, sign, None, leaves, rs, scale=scale)
            unscaled, _ = fn(res.detach(), x, sign, None, params, rs)
        want, _ = couple_output(res.detach().double(), h, sign, None, scale)
        assert not stream.requires_grad and port.requires_grad and stream.dtype == torch.float32
        assert rel_err(stream, want) <= 1e-5
        inputs = [res, xg] + [p for p in leaves if p is not None]
        grads = torch.autograd.grad(port, inputs, g)
        xu = x.clone().requires_grad_(True)
        lu = [None if p is None else p.clone().requires_grad_(True) for p in params]
        with dispatch.force_triton():
            _, port_u = fn(res.detach(), xu, sign, None, lu, rs)
        grads_u = torch.autograd.grad(port_u, [xu] + [p for p in lu if p is not None], g)
        assert all(torch.equal(a, b) for a, b in zip(grads[1:], grads_u))
        # couple_output's res gradient: through scale * res in the forward, res - H(x) in the inverse
        assert torch.equal(grads[0], g * scale.value if sign > 0 else g)


def test_scaled_couple_checks_its_scale():
    params, sw = make_params("layer", 64, 32), make_params("swiglu", 64, 32)
    res, x = rand(3, 64), rand(3, 64)
    fixed = to_fixed(res, 16)
    with dispatch.force_triton():
        with pytest.raises(TypeError, match="ResidualScale"):
            fused_norm_mlp_couple(res, x, 1, None, *params, scale=0.5)
        with pytest.raises(ValueError, match="finite float > 0"):
            fused_norm_mlp_couple(res, x, 1, None, *params, scale=ResidualScale(0.0))
        with pytest.raises(ValueError, match=r"2\*\*-s"):
            fused_norm_mlp_couple(fixed, x, 1, 16, *params, scale=ResidualScale(0.3))
        with pytest.raises(ValueError, match="dropped"):
            fused_swiglu_mlp_couple(fixed, x, -1, 16, *sw, scale=ResidualScale(0.5))
        short = ResidualScale(0.5, torch.zeros(1, 23, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"\(1, 24\)"):  # 192 elements, 2**-1: one plane of 24 bytes
            fused_swiglu_mlp_couple(fixed, x, -1, 16, *sw, scale=short)
        with pytest.raises(TypeError, match="uint8"):
            fused_norm_mlp_couple(fixed, x, -1, 16, *params, scale=ResidualScale(0.5, torch.zeros(1, 24)))


def test_transformer_halves_take_the_scale_into_their_epilogue(seeded, monkeypatch):
    """takes_scale: the engine hands them the ResidualScale and it reaches the fused op."""
    from revtriton import LayerNormAttention, LayerNormMLP, RMSNormAttention, RMSNormSwiGLU
    from revtriton.halves.base import couple_half, takes_scale
    from revtriton.ops import fused_mlp

    assert all(takes_scale(cls.__new__(cls)) for cls in (LayerNormMLP, RMSNormSwiGLU, LayerNormAttention,
                                                          RMSNormAttention))
    seen, real = [], fused_mlp.fused_swiglu_mlp_couple

    def spy(*args, scale=None, **options):
        seen.append(scale)
        return real(*args, scale=scale, **options)

    monkeypatch.setattr(fused_mlp, "fused_swiglu_mlp_couple", spy)
    half = RMSNormSwiGLU(36, 48)
    res, x = to_fixed(rand(2, 5, 36), 16), rand(2, 5, 36)
    scale = ResidualScale(0.25)
    with dispatch.force_triton(), torch.no_grad():
        y, _ = couple_half(half, res, x, 1, 16, scale=scale)
        want, _ = half.couple(res >> 2, x, 1, 16)  # the same bits as scaling around an unscaled couple
    assert seen == [scale, None] and torch.equal(y, want)


# ---------------------------------------------------------------- bad input

def test_bad_launcher_and_couple_inputs_raise_clearly():
    x, w = rand(8, 64), rand(32, 64)
    with pytest.raises(TypeError, match="dtype"):
        gemm.linear(x, w.half())
    with pytest.raises(TypeError, match="dtype"):
        gemm.linear(x.half(), w)
    with pytest.raises(ValueError, match="columns"):
        gemm.linear(rand(8, 63), w)
    with pytest.raises(ValueError, match="unit stride"):
        norm_rows.normalize(rand(64, 8).t())
    with pytest.raises(ValueError, match="stride-0|broadcast"):
        gemm.linear_couple(rand(8, 32), rand(64, 32), None, torch.zeros(64).expand(8, 64), 1)
    with pytest.raises(TypeError, match="int32"):
        gemm.linear_couple(rand(8, 32), rand(64, 32), None, rand(8, 64), 1, frac_bits=16)
    with pytest.raises(ValueError, match="rows"):
        gemm.linear_couple(rand(8, 32), rand(64, 32), None, rand(9, 64), 1)
    with pytest.raises(ValueError, match="split_k"):
        gemm.linear_weight_grad(x, x, split_k=0)
    with pytest.raises(ValueError, match="col_sums"):
        gemm.scale_rows(x, store=False)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        norm_rows.normalize(x, norm="rms", norm_bias=rand(64))
    with pytest.raises(ValueError, match="sign"):
        gemm.linear_couple(rand(8, 32), rand(64, 32), None, rand(8, 64), 2)

    params = make_params("layer", 64, 32)
    res, xx = rand(3, 64), rand(3, 64)
    with dispatch.force_triton():
        with pytest.raises(TypeError, match="dtype"):
            fused_norm_mlp_couple(res, xx.half(), 1, None, *params, norm="layer", activation="gelu")
        with pytest.raises(ValueError, match="last dim"):
            fused_norm_mlp_couple(rand(3, 65), rand(3, 65), 1, None, *params, norm="layer", activation="gelu")
        with pytest.raises(ValueError, match="shape"):
            fused_norm_mlp_couple(rand(4, 64), xx, 1, None, *params, norm="layer", activation="gelu")
        with pytest.raises(TypeError, match="int32"):
            fused_norm_mlp_couple(res, xx, 1, 16, *params, norm="layer", activation="gelu")
        with pytest.raises(ValueError, match="w2"):
            fused_norm_mlp_couple(res, xx, 1, None, *params[:4], rand(64, 31), params[5], norm="layer",
                                  activation="gelu")
        with pytest.raises(ValueError, match="row_scale"):
            fused_norm_mlp_couple(res, xx, 1, None, *params, norm="layer", activation="gelu", row_scale=torch.ones(4))
        sw = make_params("swiglu", 64, 32)
        with pytest.raises(ValueError, match="w_up"):
            fused_swiglu_mlp_couple(res, xx, 1, None, sw[0], sw[1], rand(31, 64), sw[3])


# ---------------------------------------------------------------- inside the reversible engine

def _stack(kind, depth, exact, seed, scales=(1.0, 1.0)):
    from torch import nn

    from revtriton import LayerNormMLP, RMSNormSwiGLU
    from revtriton.engine import ReversibleBlock, ReversibleStack

    torch.manual_seed(seed)
    dim = 32
    blocks = []
    for _ in range(depth):
        f = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())
        g = LayerNormMLP(dim, 48, activation="gelu_tanh") if kind == "layer" else RMSNormSwiGLU(dim, 48)
        with torch.no_grad():  # non-trivial norm parameters
            for p in g.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        blocks.append(ReversibleBlock(f, g, scale1=scales[0], scale2=scales[1]))
    return ReversibleStack(blocks, exact=exact, frac_bits=16)


def _check_fused_stack_against_reference(fused, reference, depth):
    """One training step of each: the same output and gradients, 13 fused launches per block (3 forward +
    3 recompute + 7 backward), none on the reference path."""
    x, g_out = torch.randn(2, 5, 32), torch.randn(2, 5, 32)

    def run(stack, triton):
        xi = x.clone().requires_grad_(True)
        with dispatch.force_triton(triton), dispatch.count_launches() as launches:
            out = stack(xi)
            (out * g_out).sum().backward()
        assert sum(launches.values()) == (13 * depth if triton else 0), launches
        return out.detach(), xi.grad, [p.grad for p in stack.parameters()]

    out_f, dx_f, grads_f = run(fused, True)
    out_r, dx_r, grads_r = run(reference, False)
    assert rel_err(out_f, out_r) <= 1e-5
    assert rel_err(dx_f, dx_r) <= 1e-4
    for a, b in zip(grads_f, grads_r):
        assert a is not None and rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("kind", ["layer", "swiglu"])
@pytest.mark.parametrize("exact", [False, True])
def test_stack_with_fused_g_halves_matches_reference_path(seeded, kind, exact):
    depth = 3
    fused, reference = _stack(kind, depth, exact, seeded), _stack(kind, depth, exact, seeded)
    _check_fused_stack_against_reference(fused, reference, depth)
    if exact:
        s1, s2 = to_fixed(torch.randn(2, 5, 32), 16), to_fixed(torch.randn(2, 5, 32), 16)
        with torch.no_grad(), dispatch.force_triton():
            y1, y2 = fused.forward_streams(s1, s2)
            b1, b2 = fused.inverse(y1, y2)
        assert not torch.equal(y2, s2)
        assert torch.equal(b1, s1) and torch.equal(b2, s2)


@pytest.mark.parametrize("exact", [False, True])
def test_scaled_stack_with_fused_g_halves_matches_reference_path(seeded, exact):
    """Scaled couplings y2 = 2**-2 * x2 + G(y1) with fused G halves: the engine hands G the scale
    (no extra launch: the same 13 per block), F's is applied around its generic couple; the fused
    path matches the reference path, and in exact mode the rebuild from the kept bits passes the
    recompute checksum (bitwise)."""
    depth, scales = 2, (0.5, 0.25)
    fused, reference = _stack("layer", depth, exact, seeded, scales), _stack("layer", depth, exact, seeded, scales)
    _check_fused_stack_against_reference(fused, reference, depth)
