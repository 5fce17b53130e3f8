"""Where an op runs (Triton or the pure-torch reference) and how many kernels it launched.

:func:`run_op` is the one dispatch point of the halves' ops: it runs the implementation that
``ops.backend`` chooses (an override, the measured and pinned choice on a GPU, or on CPU the rule
below: Triton only under :func:`force_triton` with the interpreter).

Every Triton launch in revtriton goes through :func:`launch` (ops/launches.py, re-exported
here), so :func:`count_launches` sees all of them (tests and perf/ assert launch budgets with it).
"""
from __future__ import annotations

import contextlib
import importlib

import torch

from .launches import call_signature
from .launches import count_launches, interpreter_enabled, launch, uncounted  # noqa: F401 (the ops' launch point)

_force_triton = False


def kept_import(module: str):
    """A getter of ``revtriton.ops.<module>``: imported at its first call (the fused modules import
    Triton, which ``import revtriton`` does not) and kept, since an import statement at every call
    of a candidate costs about 2 us of host time."""
    kept = []

    def get():
        if not kept:
            kept.append(importlib.import_module(f"{__package__}.{module}"))
        return kept[0]

    return get


def triton_available() -> bool:
    """Whether Triton imports (False where it is not installed: ``REVTRITON_SKIP_VERSION_CHECK``).
    An installed Triton that fails to import raises, naming why: the fused kernels would otherwise
    give way to the torch path without a word (``import revtriton`` does not import Triton)."""
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "triton":
            return False
        raise ImportError(f"revtriton: triton is installed but fails to import: {e}") from e
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton for CUDA tensors; for CPU tensors only under the interpreter when forced."""
    if not triton_available():
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return _force_triton and interpreter_enabled()


@contextlib.contextmanager
def force_triton(enabled: bool = True):
    """Run the Triton path on CPU tensors (requires ``TRITON_INTERPRET=1``); for tests."""
    global _force_triton
    if enabled and not interpreter_enabled():
        raise RuntimeError("force_triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    previous, _force_triton = _force_triton, enabled
    try:
        yield
    finally:
        _force_triton = previous


def scale_option(scale) -> dict:
    """A couple op's ``scale`` option for :func:`run_op`: ``{"scale": scale}`` for a scaled coupling,
    nothing otherwise (an unscaled call keeps the options, the backend key and the candidates'
    arguments it always had)."""
    return {} if scale is None else {"scale": scale}


_backend = kept_import("backend")  # imported at the first call


_recorders: list = []  # run_bound's lists of the run_op calls a checked couple makes (to bind the one it made)


def run_op(op: str, *args, **options):
    """Run op ``op`` (registered in ``ops.backend``) on ``args`` with the chosen implementation.

    The call's signature is worked out once: the choice's key comes from it, and a candidate that
    keeps launch plans (``planned``) gets it as ``call_key`` (with its name: candidates of one op
    keep different plans)."""
    if _recorders:
        _recorders[-1].append((op, args, options))
    backend = _backend()
    signature = backend.call_signature(op, args, options)
    cand, signature = backend.choose(op, args, options, signature, _force_triton)
    if cand.planned and signature is not None:
        return cand.run(*args, call_key=(cand.name, signature), **options)
    return cand.run(*args, **options)


def choice_state() -> tuple:
    """What decides, beside a call's signature, which candidate runs an op (``backend.choice_state``
    with this module's force_triton): a runner from :func:`bind_op` serves only while it is equal."""
    return _backend().choice_state(_force_triton)


def bind_op(op: str, *args, **options):
    """``run_op(op, *args, **options)`` with the signature's work done once: a runner
    ``(res, x, *weights) -> (stream, port)`` of later calls of a couple op that differ from this
    one only in their tensors' data and addresses (the same shapes, strides, dtypes, devices and
    grad requirements, the same sign, frac_bits and options, autocast as now), skipping the
    signature, the choice and, for a candidate that binds itself (the fused ones), its per-call
    checks and plan lookup. None where calls are not kept (a scaled coupling, torch.compile, an
    unhashable option). The caller keys it by all of that and by :func:`choice_state`
    (:func:`run_bound`); call it after a call of the signature (run_op's plans exist then)."""
    backend = _backend()
    signature = backend.call_signature(op, args, options)
    if signature is None:
        return None
    cand, signature = backend.choose(op, args, options, signature, _force_triton)
    call_key = (cand.name, signature) if cand.planned else None
    if cand.bind is not None:
        bound = cand.bind(args, options, call_key)
        if bound is not None:
            return bound
    run, sign, frac_bits = cand.run, args[2], args[3]
    kept = dict(options, call_key=call_key) if cand.planned else options

    def bound(res, x, *weights):
        return run(res, x, sign, frac_bits, *weights, **kept)

    return bound


_runners: dict = {}  # run_bound's key -> runner (bind_op's): a runner is a function of its key alone
RUNNERS_KEPT = 256  # all dropped when full (a model has a handful of call signatures: forward, rebuild, eval)


def run_bound(couple, res, x, sign, frac_bits, weights: tuple, options: dict, check=None):
    """``couple(res, x, sign, frac_bits, *weights, **options)``, ``couple`` a couple op's dispatching
    function (``ops.mlp.norm_mlp_couple``, ...), with its host work done once per call signature.

    The key holds everything the call's signature and choice are made of: ``couple``, the dispatch
    state (:func:`choice_state`), autocast, whether a gradient is needed (grad mode, and any of the
    tensors requiring one), sign, frac_bits, the options, and every tensor's shape, strides, dtype
    and device. A repeated key runs the runner :func:`bind_op` made for it: no checks, no
    signature, no choice, no plan lookup (every block of a model shares it). A new key runs
    ``couple`` as it is (``check(x)`` first, when given: the caller's own checks) and binds the one
    run_op call it made, when it made exactly one, on these very tensors. Options holding a tensor
    (a row scale, a token layout) are each call's: such calls are never kept."""
    if not (isinstance(x, torch.Tensor) and isinstance(res, torch.Tensor)) or torch.compiler.is_compiling() or any(
            isinstance(value, torch.Tensor) for value in options.values()):
        if check is not None:
            check(x)
        return couple(res, x, sign, frac_bits, *weights, **options)
    device_type = x.device.type
    key = (couple, choice_state(), torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type),
           torch.is_grad_enabled() and (
               res.requires_grad or x.requires_grad or any(w is not None and w.requires_grad for w in weights)),
           sign, frac_bits, *options.items(), call_signature(res, x, *weights))
    try:
        run = _runners.get(key)
    except TypeError:  # an unhashable option: the op's checks say what is wrong with it
        key = run = None
    if run is not None:
        return run(res, x, *weights)
    if check is not None:
        check(x)
    calls = []
    _recorders.append(calls)
    try:
        out = couple(res, x, sign, frac_bits, *weights, **options)
    finally:
        _recorders.pop()
    if key is not None and len(calls) == 1:
        op, args, seen = calls[0]
        tensors = (res, x, *weights)
        if len(args) == len(tensors) + 2 and args[2] == sign and args[3] == frac_bits and all(
                a is b for a, b in zip(args[:2] + args[4:], tensors)):
            run = bind_op(op, *args, **seen)
            if run is not None:
                if len(_runners) >= RUNNERS_KEPT:
                    _runners.clear()
                _runners[key] = run
    return out


def forget_runners():
    """Drop every runner run_bound kept (tests: the next call of each key takes the checked path)."""
    _runners.clear()


def capture_state():
    """Everything that decides where ops run (force_triton, backend override), for a replay."""
    from . import backend

    return _force_triton, backend.capture()


@contextlib.contextmanager
def replayed(state):
    """Run the block inside with the dispatch state :func:`capture_state` returned (the engine's
    recompute in backward must choose as its forward did)."""
    global _force_triton
    from . import backend

    if state is None:
        yield
        return
    previous, _force_triton = _force_triton, state[0]
    try:
        with backend.restored(state[1]):
            yield
    finally:
        _force_triton = previous


def triton_runs_on(args, options) -> bool:
    """A candidate predicate (ops.backend): the fused kernels run on CUDA tensors, and on CPU
    tensors under force_triton (interpreter); ``args[1]`` is a couple's input x."""
    return use_triton(args[1])


def triton_dtypes(args, options) -> bool:
    return args[1].dtype in (torch.float16, torch.bfloat16, torch.float32)
