"""The CPU norm of the reference path (ops.reference.normalize_reference): with grad it keeps the input
and a row's statistics, not the formula's centred and normalized rows (issue 36: a long sequence's
attention half keeps them while its projections are live), with the formula's values and gradients."""
import pytest
import torch

from revtriton.ops.reference import _row_norm_value, normalize_reference
from revtriton.profiling import saved_bytes


def formula(x, w, b, norm, eps):
    """The norm spelled out with plain autograd (what the CPU path computed before)."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = _row_norm_value(xf, None if w is None else w.to(xf.dtype), norm == "layer", eps)[0].to(x.dtype)
    return y if b is None else y + b.to(y.dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_values_bitwise_and_gradients_the_formulas(seeded, norm, affine, dtype, tol):
    # Rows of odd widths with a large mean: the centring matters, the gradient's projections too.
    x = (torch.randn(3, 5, 37, dtype=dtype) * 2 + 3).requires_grad_()
    w = (torch.randn(37, dtype=dtype) + 1).requires_grad_() if affine else None
    b = torch.randn(37, dtype=dtype).requires_grad_() if affine and norm == "layer" else None
    leaves = [t for t in (x, w, b) if t is not None]
    g = torch.randn(3, 5, 37, dtype=dtype)
    got = normalize_reference(x, w, b, norm=norm, eps=1e-5)
    want = formula(x, w, b, norm, 1e-5)
    assert torch.equal(got, want)  # the same ops on the values: the forward's bits
    for a, c in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert rel(a, c) <= tol


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_second_order_gradients_are_the_formulas(seeded, norm):
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w: normalize_reference(x, w, None, norm=norm, eps=1e-6), (x, w))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_keeps_the_input_and_row_statistics_only(seeded, norm):
    x = torch.randn(4, 64, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    kept = saved_bytes(lambda: normalize_reference(x, w, None, norm=norm, eps=1e-6))
    x_bytes, rows = x.numel() * 4, 4 * 64
    # x and w themselves (the caller's, alive anyway), a row's mean and rstd
    assert kept <= x_bytes + w.numel() * 4 + rows * 4 * 2
    assert saved_bytes(lambda: formula(x, w, None, norm, 1e-6)) >= 2 * x_bytes  # the centred and normalized rows


def test_without_grad_nothing_is_kept_and_values_match(seeded):
    x = torch.randn(3, 16)
    with torch.no_grad():
        got = normalize_reference(x, None, None, norm="layer", eps=1e-6)
    assert torch.equal(got, formula(x, None, None, "layer", 1e-6))
    assert got.grad_fn is None
