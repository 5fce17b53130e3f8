"""Unused pointer arguments are null pointers on a compiled CUDA launch (ops.launches.NullPointer).

Triton's CUDA launcher asks the driver about every tensor argument (cuPointerGetAttribute), one
call each, except for a null address; a GEMM launch has up to ten pointer arguments, six unused in
a plain forward. A null pointer must compile exactly what the tensor it replaces compiled: exact
streams need the forward (no saved pre-activation: unused) and the rebuild (a real one) to run one
kernel, and the autotuner keys on the arguments' dtypes.
"""
import types

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from revtriton import aot
from revtriton.ops import fused_attention as fa
from revtriton.ops import gemm, launches, norm_rows, streams
from revtriton.ops.streams import ResidualScale


def specialisation(arg):
    """How Triton's JIT specialises a pointer argument: (type, alignment) as the launch binds it."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8])
def test_null_pointer_specialises_as_an_aligned_tensor_of_its_dtype(dtype):
    aligned = torch.empty(64, dtype=dtype)
    assert aligned.data_ptr() % 16 == 0
    assert specialisation(launches.NullPointer(dtype)) == specialisation(aligned)
    assert launches.NullPointer(dtype).data_ptr() == 0  # the launcher passes 0 without a driver call


def test_unused_pointer_is_null_only_on_a_compiled_cuda_launch(monkeypatch):
    cpu = torch.empty(4, 8, dtype=torch.bfloat16)
    assert launches.unused_pointer(cpu) is cpu  # the interpreter and the static model need tensors
    as_bytes = launches.unused_pointer(cpu, torch.uint8)
    assert as_bytes.dtype == torch.uint8 and as_bytes.data_ptr() == cpu.data_ptr()
    cuda = types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=True)
    monkeypatch.setattr(launches, "interpreter_enabled", lambda: False)
    assert isinstance(launches.unused_pointer(cuda), launches.NullPointer)
    assert launches.unused_pointer(cuda).dtype == torch.bfloat16
    assert launches.unused_pointer(cuda, torch.uint8).dtype == torch.uint8
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # dynamo traces launches of tensors
    with pytest.raises(AttributeError):  # (the tensor path views the stand-in, which has no view)
        launches.unused_pointer(cuda, torch.uint8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(launches, "interpreter_enabled", lambda: True)
    with pytest.raises(AttributeError):  # the interpreter path wants a tensor to view
        launches.unused_pointer(cuda, torch.uint8)


def recorded(monkeypatch, call, *, null):
    """The arguments of the launches ``call`` makes (recorded, not run), with unused pointers as a
    compiled CUDA launch would pass them (``null``) or as tensors."""

    def as_on_cuda(like, dtype=None):
        return launches.NullPointer(like.dtype if dtype is None else dtype)

    for module in (gemm, norm_rows, fa, streams):  # the launchers' own references to unused_pointer
        monkeypatch.setattr(module, "unused_pointer", as_on_cuda if null else launches.unused_pointer)
    with aot.recording_launches() as seen:
        call()
    return seen


CALLS = {
    "linear": lambda: gemm.linear(torch.randn(40, 32), torch.randn(48, 32), torch.randn(48), activation="gelu_tanh"),
    "linear_save_preact": lambda: gemm.linear(torch.randn(40, 32), torch.randn(48, 32), torch.randn(48),
                                              activation="gelu_tanh", save_preact=True),
    "couple_exact_scaled": lambda: gemm.linear_couple(
        torch.randn(40, 48), torch.randn(32, 48), None, torch.zeros(40, 32, dtype=torch.int32), 1, frac_bits=16,
        scale=ResidualScale(0.5)),
    "weight_grad": lambda: gemm.linear_weight_grad(torch.randn(40, 48), torch.randn(40, 32)),
    "normalize_rms": lambda: norm_rows.normalize(torch.randn(40, 32), norm="rms"),
    "scale_rows_sums_only": lambda: gemm.scale_rows(torch.randn(40, 32), col_sums=True, store=False),
    "norm_bwd_no_params": lambda: norm_rows.norm_bwd_partials(
        torch.randn(40, 32), torch.randn(40, 32), (torch.zeros(40), torch.ones(40)), None, norm="rms",
        has_bias=False),
    "attention_fwd": lambda: fa.attention_fwd(torch.randn(1, 16, 2, 16), torch.randn(1, 16, 2, 16),
                                              torch.randn(1, 16, 2, 16), causal=True),
    "attention_bwd": lambda: fa.attention_bwd(*(torch.randn(1, 16, 2, 16) for _ in range(4)),
                                              torch.randn(1, 2, 16), torch.randn(1, 16, 2, 16), causal=True),
    "qkv": lambda: fa.qkv_projection(torch.randn(32, 64), torch.randn(192, 64), None, heads=4, kv_heads=4,
                                     tokens=16),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_null_pointers_take_the_places_and_dtypes_of_the_tensors_they_replace(monkeypatch, name):
    """Launch by launch, a compiled CUDA launch binds a null pointer exactly where the CPU launch
    binds a placeholder tensor, of that tensor's dtype: the same specialisation, kernel and tuning
    key. Every other argument is the same object."""
    torch.manual_seed(0)
    with_tensors = recorded(monkeypatch, CALLS[name], null=False)
    torch.manual_seed(0)
    with_nulls = recorded(monkeypatch, CALLS[name], null=True)
    assert len(with_tensors) == len(with_nulls) >= 1
    nulls = 0
    for a, b in zip(with_tensors, with_nulls):
        assert a.meta == b.meta
        for x, y in zip(a.args, b.args):
            if isinstance(y, launches.NullPointer):
                nulls += 1
                assert isinstance(x, torch.Tensor) and specialisation(x)[0] == specialisation(y)[0]
            elif isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            else:
                assert x == y
    assert nulls >= 2
