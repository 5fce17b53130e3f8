"""The exact couple epilogue in one Triton pass (kernels/couple.py, used on CUDA by the library path
of a half): bitwise the torch reference under the interpreter for every input, the edges planted;
chosen by ``couple_output`` when selected, gradients unchanged; a scaled coupling's shift and
dropped bits in the same pass; and it compiles for sm_90 / sm_80."""
import json
import os
import subprocess
import sys

import pytest
import torch

from revtriton.ops import backend, dispatch, streams
from revtriton.ops.streams import (EXACT_ADD_BLOCK, SATURATION, ResidualScale, couple_output, exact_add,
                                   exact_add_reference, exact_add_triton, exact_add_uses_triton,
                                   library_couple_output, to_fixed)

# numpy under the interpreter warns on what the edges are for (inf - inf, overflow to inf)
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def interpreted_unless_gpu(request):
    """The CPU tests run the kernel under the interpreter; the gpu-marked one compiled (gpu_check
    runs it with TRITON_INTERPRET=0: a module-wide skip had skipped it there, on the H200)."""
    if request.node.get_closest_marker("gpu") is None and not dispatch.interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (conftest)")

INT32 = torch.iinfo(torch.int32)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
FRAC_BITS = [0, 8, 16, 30]
SHAPES = [(1,), (7, 13), (3, 5, 33), (EXACT_ADD_BLOCK + 1,), (2, EXACT_ADD_BLOCK + 5)]

# Edges in grid units (the value of h * 2**k): ties both ways, the float below a tie, the
# integers where float32 has no fraction bits left, saturation and int32 bounds, zeros of both
# signs, NaN and infinities. h = edge * 2**-k, cast to h's dtype (where it survives the cast).
GRID_EDGES = [
    0.5, 1.5, 2.5, 3.5, 4.5, -0.5, -1.5, -2.5, -3.5, -4.5, 0.49999997, -0.49999997, 0.50000006, -0.50000006,
    1.4999999, 2.5000002, 0.0, -0.0, 1e-3, -1e-3, 0.75, -0.75, 1.25, -1.25,
    2.0**22 + 0.5, 2.0**22 + 1.5, -(2.0**22 + 0.5), 2.0**23 - 0.5, -(2.0**23 - 0.5), 2.0**23 + 1, 2.0**24 + 2,
    2.0**29 - 0.5, -(2.0**29 + 0.5), SATURATION - 0.5, SATURATION, SATURATION + 0.5, SATURATION + 64, 2.0**31 - 1,
    2.0**31, 2.0**31 + 0.5, -SATURATION + 0.5, -SATURATION, -SATURATION - 0.5, -(2.0**31), -(2.0**31) - 1,
    2.0**40 + 0.5, -(2.0**52) - 0.5, 2.0**53 - 1, 1e300, -1e300, float("nan"), -float("nan"), float("inf"),
    -float("inf"),
]
STREAM_EDGES = [INT32.min, INT32.max, INT32.min + 1, INT32.max - 1, -1, 0, 1, 2**29, -(2**29)]


def raw_edges(dtype):
    """Edges in h's own units: its largest, smallest normal and subnormal values, both signs."""
    info = torch.finfo(dtype)
    tiny = torch.tensor(info.tiny, dtype=dtype)
    subnormal = torch.nextafter(torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)).to(dtype) \
        if dtype == torch.float64 else (tiny.double() / 8).to(dtype)
    values = torch.stack([torch.tensor(info.max, dtype=dtype), tiny, subnormal, torch.tensor(info.eps, dtype=dtype)])
    return torch.cat([values, -values])


def edge_inputs(dtype, frac_bits):
    """(res, h) holding every edge of h against every edge of the stream (wrap-arounds included)."""
    grid = torch.tensor(GRID_EDGES, dtype=torch.float64)
    h = torch.cat([(grid * 2.0**-frac_bits).to(dtype), raw_edges(dtype),
                   ((torch.arange(-40, 40, dtype=torch.float64) + 0.5) * 2.0**-frac_bits).to(dtype)])
    stream = torch.tensor(STREAM_EDGES, dtype=torch.int32)
    return stream.repeat_interleave(h.numel()), h.repeat(stream.numel())


def random_inputs(shape, dtype, frac_bits):
    """Full-range streams (so the add wraps) and half outputs at every scale, about 1 in 8 a tie."""
    res = torch.randint(INT32.min, INT32.max, shape, dtype=torch.int32)
    exponent = torch.randint(-frac_bits - 4, 34 - frac_bits, shape).double()
    h = torch.randn(shape, dtype=torch.float64) * 2.0**exponent
    ties = (torch.randint(-100, 100, shape).double() + 0.5) * 2.0**-frac_bits
    h = torch.where(torch.rand(shape) < 0.125, ties, h).to(dtype)
    return res, h


def assert_bitwise(res, h, sign, frac_bits):
    with dispatch.count_launches() as launches:
        got = exact_add_triton(res, h, sign, frac_bits)
    want = exact_add_reference(res, h, sign, frac_bits)
    assert got.dtype == torch.int32 and got.shape == res.shape
    assert launches["exact_add_kernel"] == (1 if res.numel() else 0)
    if not torch.equal(got, want):
        differ = got != want
        at = tuple(differ.nonzero()[0].tolist())
        raise AssertionError(f"{h.dtype} k={frac_bits} sign={sign}: {int(differ.sum())} of {got.numel()} differ; "
                             f"first at {at}: res={res[at].item()} h={h[at].item()!r} kernel={got[at].item()} "
                             f"reference={want[at].item()}")


# --------------------------------------------------------------------------------------------
# The kernel is bitwise the reference


@pytest.mark.parametrize("frac_bits", FRAC_BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_is_bitwise_the_reference_on_random_inputs(seeded, dtype, frac_bits):
    for shape in SHAPES:
        res, h = random_inputs(shape, dtype, frac_bits)
        for sign in (1, -1):
            assert_bitwise(res, h, sign, frac_bits)


@pytest.mark.parametrize("frac_bits", FRAC_BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_is_bitwise_the_reference_on_the_edges(dtype, frac_bits):
    res, h = edge_inputs(dtype, frac_bits)
    for sign in (1, -1):
        assert_bitwise(res, h, sign, frac_bits)


def test_the_edges_mean_what_they_say():
    """Spot values of the kernel itself: ties to even, saturation, NaN, signed zero, int32 wrap."""
    h = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, -0.0, 0.49999997, 3e9, -3e9, float("nan"), float("inf"),
                      -float("inf"), 2.0**-140, -(2.0**-140)])
    sat = int(SATURATION)
    got = exact_add_triton(torch.zeros(h.shape, dtype=torch.int32), h, 1, 0)
    assert got.tolist() == [0, 2, 2, 0, -2, 0, 0, sat, -sat, sat, sat, -sat, 0, 0]
    top = torch.full((2,), INT32.max, dtype=torch.int32)
    assert exact_add_triton(top, torch.tensor([1.0, 2.0**-16]), 1, 16).tolist() == [INT32.min + 2**16 - 1, INT32.min]
    bottom = torch.full((1,), INT32.min, dtype=torch.int32)
    assert exact_add_triton(bottom, torch.tensor([3.0]), -1, 0).tolist() == [INT32.max - 2]


def test_kernel_takes_strided_and_empty_inputs(seeded):
    res, h = random_inputs((33, 40), torch.float32, 16)
    for sign in (1, -1):
        assert torch.equal(exact_add_triton(res.t(), h.t(), sign, 16), exact_add_reference(res.t(), h.t(), sign, 16))
        assert torch.equal(exact_add_triton(res[:, ::3], h[:, ::3], sign, 16),
                           exact_add_reference(res[:, ::3], h[:, ::3], sign, 16))
    empty = torch.zeros(0, 8, dtype=torch.int32)
    with dispatch.count_launches() as launches:
        out = exact_add_triton(empty, torch.zeros(0, 8), 1, 16)
    assert out.shape == (0, 8) and out.dtype == torch.int32 and launches.total() == 0


def test_kernel_refuses_what_it_cannot_add():
    res = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="int32 stream"):
        exact_add_triton(res.float(), torch.zeros(4), 1, 16)
    with pytest.raises(TypeError, match="half output"):
        exact_add_triton(res, torch.zeros(5), 1, 16)
    with pytest.raises(TypeError, match="half output"):
        exact_add_triton(res, torch.zeros(4, dtype=torch.int64), 1, 16)
    with pytest.raises(ValueError, match="frac_bits"):
        exact_add_triton(res, torch.zeros(4), 1, 31)


# --------------------------------------------------------------------------------------------
# The couple path uses it when selected (CUDA; here a patched device check), gradients unchanged


@pytest.fixture
def kernel_selected(monkeypatch):
    """exact_add's device check answering yes for CPU tensors (the kernel then runs interpreted)."""
    monkeypatch.setattr(streams, "exact_add_uses_triton", lambda res, h: True)


def test_the_torch_path_is_chosen_on_cpu():
    res, h = random_inputs((4, 8), torch.float32, 16)
    assert not exact_add_uses_triton(res, h)
    with dispatch.count_launches() as launches, dispatch.force_triton():  # force_triton is for fused ops only
        out, port = couple_output(res, h, 1, 16)
    assert launches.total() == 0 and port is None and torch.equal(out, exact_add_reference(res, h, 1, 16))


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_couple_output_runs_the_kernel_when_selected_and_grads_pass_straight_through(seeded, dtype, sign):
    res, h = random_inputs((3, 5, 7), dtype, 16)
    g = torch.randn(3, 5, 7, dtype=streams.stream_grad_dtype(dtype))
    results = {}
    for selected in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if selected:
                mp.setattr(streams, "exact_add_uses_triton", lambda res, h: True)
            with dispatch.count_launches() as launches:
                plain, no_port = couple_output(res, h, sign, 16)  # no grad: the value only
                leaf = h.clone().requires_grad_(True)
                out, port = couple_output(res, leaf, sign, 16)  # grad: its port (ExactAdd's, or inverse_port's for sign -1)
            assert dict(launches) == ({"exact_add_kernel": 2} if selected else {})
            assert no_port is None and not out.requires_grad and port.requires_grad
            (grad,) = torch.autograd.grad(port, leaf, g)
            results[selected] = plain, out, grad
    (plain_t, out_t, grad_t), (plain_k, out_k, grad_k) = results[False], results[True]
    assert torch.equal(plain_k, plain_t) and torch.equal(out_k, out_t) and torch.equal(out_k, plain_k)
    assert grad_k.dtype == dtype and torch.equal(grad_k, grad_t) and torch.equal(grad_k, (sign * g).to(dtype))


def test_float_streams_never_run_the_kernel(kernel_selected):
    res, h = torch.randn(4, 8), torch.randn(4, 8)
    with dispatch.count_launches() as launches:
        out, _ = couple_output(res, h, -1, None)
    assert launches.total() == 0 and torch.equal(out, res - h)


def test_the_library_path_of_a_half_uses_the_kernel(seeded, monkeypatch):
    """The torch candidate of a LayerNormMLP half (GEMMs in torch) ends in one exact_add launch,
    with the same stream and the same gradients as the all-torch epilogue."""
    from revtriton import LayerNormMLP

    half = LayerNormMLP(32, 64)
    x, res = torch.randn(2, 4, 32), to_fixed(torch.randn(2, 4, 32), 16)
    g = torch.randn(2, 4, 32)

    def run():
        xi = x.clone().requires_grad_(True)
        with backend.use_backend("torch"), dispatch.count_launches() as launches:
            stream, port = half.couple(res, xi, -1, 16)
        grads = torch.autograd.grad(port, [xi, *half.parameters()], g)
        return stream, grads, dict(launches)

    stream_t, grads_t, launches_t = run()
    monkeypatch.setattr(streams, "exact_add_uses_triton", lambda res, h: True)
    stream_k, grads_k, launches_k = run()
    assert launches_k == {"exact_add_kernel": 1} and launches_t == {}
    assert torch.equal(stream_k, stream_t) and all(torch.equal(a, b) for a, b in zip(grads_k, grads_t))


def test_exact_add_dispatches_on_the_device_check(seeded, kernel_selected):
    res, h = random_inputs((5, 9), torch.bfloat16, 8)
    with dispatch.count_launches() as launches:
        out = exact_add(res, h, -1, 8)
    assert launches.total() == 1 and torch.equal(out, exact_add_reference(res, h, -1, 8))


# --------------------------------------------------------------------------------------------
# A scaled coupling (scale 2**-s) in the same pass: (res >> s) + q forward, ((res - q) << s) | the
# dropped bits inverse, bitwise couple_output with the scale


SHIFTS = [1, 3, 7]


def scaled_cases():
    """(res, h): 91 elements (not a multiple of 8: the last byte of each bit plane is partly
    padding), two blocks (the second starting mid-stream), a strided view, every edge."""
    yield random_inputs((7, 13), torch.float32, 16)
    yield random_inputs((2, EXACT_ADD_BLOCK + 5), torch.bfloat16, 16)
    res, h = random_inputs((33, 40), torch.float32, 16)
    yield res.t(), h.t()
    yield edge_inputs(torch.float32, 16)


@pytest.mark.parametrize("shift", SHIFTS)
def test_scaled_kernel_is_bitwise_the_reference_and_inverts(seeded, shift):
    for res, h in scaled_cases():
        forward = ResidualScale(2.0**-shift)
        with dispatch.count_launches() as launches:
            y = exact_add_triton(res, h, 1, 16, forward)
        assert launches["exact_add_kernel"] == 1
        assert torch.equal(y, exact_add_reference(res, h, 1, 16, forward))
        assert torch.equal(y, couple_output(res, h, 1, 16, forward)[0])
        inverse = ResidualScale(2.0**-shift, forward.dropped_bits(res))  # kept by the engine in the forward
        back = exact_add_triton(y, h, -1, 16, inverse)
        assert torch.equal(back, couple_output(y, h, -1, 16, inverse)[0])
        assert torch.equal(back, res)  # the round trip, int32 wrap-arounds included


def test_scaled_kernel_refuses_what_it_cannot_invert():
    res, h = torch.zeros(20, dtype=torch.int32), torch.zeros(20)
    with pytest.raises(TypeError, match="ResidualScale"):
        exact_add_triton(res, h, 1, 16, 0.5)
    with pytest.raises(ValueError, match=r"2\*\*-s"):
        exact_add_triton(res, h, 1, 16, ResidualScale(0.3))
    with pytest.raises(ValueError, match="dropped"):
        exact_add_triton(res, h, -1, 16, ResidualScale(0.5))
    with pytest.raises(TypeError, match="uint8"):
        exact_add_triton(res, h, -1, 16, ResidualScale(0.5, torch.zeros(1, 3, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"\(1, 3\)"):  # 20 elements: 3 bytes a plane, 1 plane for 2**-1
        exact_add_triton(res, h, -1, 16, ResidualScale(0.5, torch.zeros(2, 3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="meta"):
        exact_add_triton(res, h, -1, 16, ResidualScale(0.5, torch.zeros(1, 3, dtype=torch.uint8, device="meta")))


@pytest.mark.parametrize("sign", [1, -1])
def test_the_library_path_applies_the_scale_in_the_kernel(seeded, monkeypatch, sign):
    """The torch candidate of a LayerNormMLP half with a scale ends in one exact_add launch (shift,
    rounded add and the restored bits): couple_output's stream, and the port's gradients those of
    the unscaled couple (the engine scales the stream's own gradient)."""
    from revtriton import LayerNormMLP

    half = LayerNormMLP(36, 48)  # 3 x 5 x 36 = 540 elements: not a multiple of 8
    x, res = torch.randn(3, 5, 36), to_fixed(torch.randn(3, 5, 36) * 100, 16)
    g = torch.randn(3, 5, 36)
    forward = ResidualScale(2.0**-3)
    scale = forward if sign > 0 else ResidualScale(forward.value, forward.dropped_bits(res))

    def run(scale):
        xi = x.clone().requires_grad_(True)
        with backend.use_backend("torch"), dispatch.count_launches() as launches:
            stream, port = half.couple(res, xi, sign, 16, scale=scale)
        grads = torch.autograd.grad(port, [xi, *half.parameters()], g)
        return stream, grads, dict(launches)

    stream_t, grads_t, launches_t = run(scale)
    monkeypatch.setattr(streams, "exact_add_uses_triton", lambda res, h: True)
    stream_k, grads_k, launches_k = run(scale)
    _, grads_unscaled, _ = run(None)
    assert launches_k == {"exact_add_kernel": 1} and launches_t == {}
    want, _ = couple_output(res, half(x).detach(), sign, 16, scale)
    assert torch.equal(stream_k, stream_t) and torch.equal(stream_k, want)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(grads_k, grads_t, grads_unscaled))


def test_library_couple_output_is_couple_output(seeded, kernel_selected):
    """Float streams and unscaled couples take couple_output itself; exact scaled ones one pass."""
    res, h = torch.randn(4, 9), torch.randn(4, 9)
    for sign in (1, -1):
        for scale in (None, ResidualScale(0.3)):
            got, want = library_couple_output(res, h, sign, None, scale), couple_output(res, h, sign, None, scale)
            assert torch.equal(got[0], want[0])
            # ... and both are the coupling written out (not only each other)
            written = res + sign * h if scale is None else (res * 0.3 + h if sign > 0 else (res - h) / 0.3)
            torch.testing.assert_close(got[0], written, rtol=1e-6, atol=1e-6)
    fixed = to_fixed(res, 16)
    with dispatch.count_launches() as launches:
        got, _ = library_couple_output(fixed, h, 1, 16, ResidualScale(0.25))
    assert launches.total() == 1 and torch.equal(got, couple_output(fixed, h, 1, 16, ResidualScale(0.25))[0])


# --------------------------------------------------------------------------------------------
# It compiles for the GPUs (no GPU needed) and, where one is lent, runs there bitwise


COMPILE_SCRIPT = r"""
import json, torch
from revtriton import aot
from revtriton.ops.streams import ResidualScale, exact_add_triton
out = []
numel = 8192 * 4096  # a production stream (8192 tokens x 4096): the specialisation a launch builds
res = torch.empty(numel, dtype=torch.int32, device="meta")
planes = torch.empty(3, numel // 8, dtype=torch.uint8, device="meta")
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    h = torch.empty(numel, dtype=dtype, device="meta")
    calls = [(-1, None)]
    if dtype in (torch.float32, torch.bfloat16):  # a scaled coupling: its forward and its inverse
        calls += [(1, ResidualScale(2.0**-3)), (-1, ResidualScale(2.0**-3, planes))]
    for sign, scale in calls:
        with aot.recording_launches() as launches:
            exact_add_triton(res, h, sign, 16, scale)
        (launch,) = launches
        for arch in aot.ARCHS:
            (config,) = aot.configs_for_arch(launch, arch)
            job = aot.compile_job(launch, config, arch)
            result = aot.analyze(job, aot.jit_function(launch.kernel))
            out.append(dict(result, dtype=str(dtype), sign=sign, scaled=scale is not None, job=job.key))
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_and_sm80_without_spills():
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], check=False, capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["dtype"], r["arch"]) for r in results} == {(str(d), a) for d in DTYPES for a in (90, 80)}
    for r in results:
        assert r["error"] is None, r
        assert r["local"] == 0 and r["stack"] == 0 and r["registers"] <= 232, r
    # a scaled forward and its inverse run one compiled kernel (a runtime branch on the sign)
    scaled = {}
    for r in results:
        if r["scaled"]:
            scaled.setdefault((r["dtype"], r["arch"]), set()).add(r["job"])
    assert len(scaled) == 4 and all(len(jobs) == 1 for jobs in scaled.values()), scaled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_the_gpu_the_couple_path_runs_the_kernel_bitwise(dtype):
    for frac_bits in FRAC_BITS:
        for res, h in (random_inputs((3, 4099), dtype, frac_bits), edge_inputs(dtype, frac_bits)):
            for sign in (1, -1):
                res_c, h_c = res.cuda(), h.cuda()
                assert exact_add_uses_triton(res_c, h_c)
                with dispatch.count_launches() as launches:
                    out, _ = couple_output(res_c, h_c, sign, frac_bits)
                assert launches.total() == 1
                assert torch.equal(out.cpu(), exact_add_reference(res, h, sign, frac_bits))
