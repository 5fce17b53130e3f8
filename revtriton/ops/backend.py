"""Measured choice between the implementations of an op: fused Triton or the library path.

Every op the halves use (``norm_mlp``, ``swiglu_mlp``, ``norm_attention``: a whole couple,
forward and backward) has two or more *candidates* registered here: ``triton`` (the fused
kernels) and ``torch`` (cuBLAS GEMMs through ``F.linear`` and SDPA, i.e. the pure-torch
reference); ``norm_attention`` also has the two mixes of its sub-ops (fused GEMMs with SDPA,
cuBLAS GEMMs with the Triton flash core: ops/attention.py), so each sub-op's implementation is
chosen by measurement in the half it runs in. ``ops.dispatch.run_op`` is the one dispatch point;
it asks :func:`choose`.

How a candidate is chosen for one call:

1. An override, ``with use_backend("triton" | "torch" | "auto")`` or ``REVTRITON_BACKEND``,
   names the candidate (a clear error if it cannot run on these tensors).
2. Where nothing can be measured (CPU tensors, no timer installed) the rule is what it always
   was: the first registered candidate that runs on the tensors (Triton on CUDA, or on CPU under
   ``force_triton`` with the interpreter; else the torch reference).
3. Otherwise the choice for the call's key (op, shape bucket, dtypes, autocast, exact or float,
   GPU) is *pinned* for the life of the process. The first call for a key reads the on-disk cache
   or, failing that, measures: each available candidate runs twice on the call's own inputs
   (forward + backward when parameters need grad); in exact mode a candidate whose two runs are
   not bitwise equal is excluded; then a timer (CUDA events: warm-up, repeats, a time budget)
   times it and the fastest wins. One line goes to stderr; the choice and both timings go to the
   cache. Under torch.distributed rank 0 decides and broadcasts, so every rank runs the same code.

The cache is one JSON file per (GPU name, compute capability, driver, torch, triton) under
``<triton cache dir>/revtriton/`` (``REVTRITON_BACKEND_CACHE_DIR`` moves it; ``off`` disables it).
A corrupt or stale file is ignored with a warning and rewritten.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch

from . import launches

BACKENDS = ("auto", "triton", "torch")
ENV_BACKEND = "REVTRITON_BACKEND"
ENV_CACHE_DIR = "REVTRITON_BACKEND_CACHE_DIR"
CACHE_FORMAT = 2  # 2: norm_attention's sub-op candidates (a choice made without them is stale)
WARMUP = 3  # timed runs dropped (after the two runs of the determinism check)
REPEATS = 10  # timed runs per candidate, in ROUNDS rounds that alternate the candidates
ROUNDS = 5  # (so clock ramps and host noise fall on all of them alike: a median of rounds each)
BUDGET_S = 2.0  # per candidate, after warm-up: stop repeating once it is spent (at least one round)


@dataclasses.dataclass
class Candidate:
    """One implementation of an op: ``run(*args, **options) -> (stream, port)``.

    ``available(args, options)``: can it run on these tensors at all (device, interpreter);
    ``supports(args, options)``: does it handle this shape / dtype (checked only when measuring,
    so an explicit choice still gets the implementation's own error).
    """

    name: str
    run: Callable
    available: Callable = lambda args, options: True
    supports: Callable = lambda args, options: True
    planned: bool = False  # run takes ``call_key=``: its call signature, for its launch plans (dispatch.run_op)
    # bind(args, options, call_key) -> a runner of later calls of this signature, ``(res, x, *weights)``,
    # or None: what the candidate works out per call done once (dispatch.bind_op); planned candidates
    bind: Callable | None = None


@dataclasses.dataclass
class Op:
    name: str
    key: Callable  # (args, options) -> str: shape bucket, dtypes, switches (never sign or grad mode)
    candidates: dict = dataclasses.field(default_factory=dict)  # name -> Candidate, in preference order


_ops: dict[str, Op] = {}
_pins: dict[tuple, str] = {}  # (device, op, key) -> candidate name, for the life of the process
_decisions: dict[tuple, dict] = {}  # same keys: how each pinned choice was made (for perf reports)
_override: str | None = None  # set by use_backend(); None: the environment decides
_epoch = 0  # counts registry changes and reset()s: what the kept choices and bound runners were made under
_timer = None  # installed by use_timer() (tests: a fake timer, also on CPU tensors)


# --------------------------------------------------------------------------------------------
# Registry


def register_op(name: str, key: Callable) -> Op:
    if name in _ops:
        raise ValueError(f"op {name!r} is registered twice")
    _ops[name] = Op(name, key)
    _registry_changed()
    return _ops[name]


def register_candidate(op: str, name: str, run: Callable, *, available=None, supports=None,
                       planned: bool = False, bind: Callable | None = None) -> Candidate:
    if op not in _ops:
        raise KeyError(f"unknown op {op!r} (registered: {sorted(_ops)})")
    if name in _ops[op].candidates:
        raise ValueError(f"op {op!r} already has a candidate {name!r}")
    cand = Candidate(name, run, planned=planned, bind=bind)
    if available is not None:
        cand.available = available
    if supports is not None:
        cand.supports = supports
    _ops[op].candidates[name] = cand
    _registry_changed()
    return cand


def unregister_candidate(op: str, name: str):
    _ops[op].candidates.pop(name, None)
    _registry_changed()


def _registry_changed():
    """The kept choices (see :func:`choose`) hold candidate objects: a change of the registry
    forgets them all (and the runners bound to them: :func:`choice_state`)."""
    global _epoch
    _chosen.clear()
    _epoch += 1


def ops() -> dict:
    return dict(_ops)


# --------------------------------------------------------------------------------------------
# Overrides


def _check_backend(value, source, candidates: bool = False) -> str:
    """``value`` if it is a backend (or, with ``candidates``, a candidate some op registered)."""
    if value in BACKENDS:
        return value
    named = sorted({name for op in _ops.values() for name in op.candidates} - set(BACKENDS)) if candidates else []
    if value in named:
        return value
    raise ValueError(f"{source}={value!r} is not a backend: use one of {', '.join(BACKENDS + tuple(named))}")


_environment_backends: dict = {}  # REVTRITON_BACKEND's raw value -> the backend it names (checked once)


def current_backend() -> str:
    """The override in force: ``use_backend``'s, else ``REVTRITON_BACKEND``'s, else ``"auto"``.
    Read at every call (a test or a launcher may set the variable at any time); a value is checked
    once (an op call asks twice: about a microsecond each when checked again)."""
    if _override is not None:
        return _override
    raw = os.environ.get(ENV_BACKEND)
    value = _environment_backends.get(raw)
    if value is None:
        value = _check_backend((raw or "").strip().lower() or "auto", ENV_BACKEND)
        _environment_backends[raw] = value
    return value


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops inside on one backend: ``"triton"``, ``"torch"`` or ``"auto"`` (measured choice).

    Overrides ``REVTRITON_BACKEND``. Reversible stacks replay the forward's setting in backward.
    A candidate of one op (``"triton_gemm_sdpa"``, ...) may be named too, for benchmarks of that op:
    an op without it raises when called inside.
    """
    global _override
    previous, _override = _override, _check_backend(name, "use_backend", candidates=True)
    try:
        yield
    finally:
        _override = previous


@contextlib.contextmanager
def use_timer(timer):
    """Time candidates with ``timer(run, *, op, candidate) -> ms`` (tests: a fake device timer).

    While one is installed, measurement also runs on CPU tensors.
    """
    global _timer
    previous, _timer = _timer, timer
    try:
        yield
    finally:
        _timer = previous


def reset():
    """Forget every pinned choice (as a new process would). For tests and benchmarks."""
    global _epoch
    _pins.clear()
    _decisions.clear()
    _chosen.clear()
    _epoch += 1


# --------------------------------------------------------------------------------------------
# Keys


def bucket(n: int) -> int:
    """The next power of two >= n (shape buckets: a choice holds for every size in its bucket)."""
    return 1 << max(0, int(n) - 1).bit_length()


def couple_key(args, options, *, tokens: bool = False) -> str:
    """Key of a couple op ``(res, x, sign, frac_bits, *weights, **options)``: rows (and tokens)
    bucketed, weight shapes, switches (a coupling scale: "scaled", not its value), dtypes,
    autocast, exact or float. Not the sign, not the grad mode: the forward and the rebuild of a
    block get the same choice."""
    x, frac_bits = args[1], args[3]
    dim = x.shape[-1] if x.dim() else 1
    parts = [f"rows<={bucket(x.numel() // max(dim, 1))}"]
    if tokens and x.dim() >= 2:
        parts.append(f"tokens<={bucket(x.shape[-2])}")
    parts.append("w=" + ",".join("-" if w is None else "x".join(map(str, w.shape)) for w in args[4:]))
    for name in sorted(options):
        value = options[name]
        if isinstance(value, torch.Tensor):
            parts.append(name)
        elif isinstance(value, (bool, int, str)) and value is not None:
            parts.append(f"{name}={value}")
        elif name == "rope_theta" and value is not None:
            parts.append("rope")
        elif name == "scale" and value is not None:  # a scaled coupling: another couple epilogue
            parts.append("scaled")
    device_type = x.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    dtypes = [str(x.dtype).replace("torch.", "")]
    weight = next((w for w in args[4:] if isinstance(w, torch.Tensor)), None)
    if weight is not None:
        dtypes.append(str(weight.dtype).replace("torch.", ""))
    if compute is not None:
        dtypes.append("autocast " + str(compute).replace("torch.", ""))
    parts.append("/".join(dtypes))
    parts.append("float" if frac_bits is None else "exact")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# Devices and the cache file


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _driver_version() -> str:
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    if getter is not None:
        try:
            return str(getter())
        except Exception:  # noqa: BLE001
            pass
    try:
        with open("/proc/driver/nvidia/version") as handle:
            match = re.search(r"Kernel Module\s+([\d.]+)", handle.read())
            return match.group(1) if match else "unknown"
    except OSError:
        return "unknown"


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


_fingerprints: dict = {}


def fingerprint(device: torch.device) -> dict:
    """What a cached choice is valid for: GPU name, capability, driver, torch and triton versions."""
    device = torch.device(device)
    tag = (device.type, _device_index(device) if device.type == "cuda" else None)
    if tag not in _fingerprints:
        fp = {"format": CACHE_FORMAT, "device": device.type, "torch": torch.__version__,
              "triton": _triton_version()}
        if device.type == "cuda":
            index = tag[1]
            major, minor = torch.cuda.get_device_capability(index)
            fp.update(name=torch.cuda.get_device_name(index), capability=f"{major}.{minor}",
                      driver=_driver_version(), cuda=torch.version.cuda)
        else:
            fp.update(name=device.type)
        _fingerprints[tag] = fp
    return _fingerprints[tag]


def cache_dir() -> str | None:
    """Where the choice files live (None: no disk cache): beside Triton's cache, or the env's."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else env
    base = os.environ.get("TRITON_CACHE_DIR")
    if not base:
        try:
            from triton import knobs

            base = knobs.cache.dir
        except Exception:  # noqa: BLE001 (no triton, or an older one)
            base = None
    base = base or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.path.join(base, "revtriton")


def cache_path(device: torch.device) -> str | None:
    directory = cache_dir()
    if directory is None:
        return None
    fp = fingerprint(device)
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", fp["name"]).strip("-").lower()
    return os.path.join(directory, f"backend-{slug}-{digest}.json")


def _read_cache(path: str, fp: dict) -> dict:
    """The file's entries ({key: record}); {} with a warning if it is corrupt or stale."""
    try:
        with open(path) as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep to parse
        warnings.warn(f"revtriton: backend cache {path} is corrupt ({error}); ignoring it, measuring again "
                      f"and rewriting it", RuntimeWarning, stacklevel=4)
        return {}
    if (not isinstance(doc, dict) or doc.get("fingerprint") != fp or not isinstance(doc.get("entries"), dict)
            or not all(isinstance(e, dict) and isinstance(e.get("choice"), str) for e in doc["entries"].values())):
        warnings.warn(f"revtriton: backend cache {path} is stale or malformed (made for "
                      f"{doc.get('fingerprint') if isinstance(doc, dict) else None}, this process is {fp}); "
                      f"ignoring it, measuring again and rewriting it", RuntimeWarning, stacklevel=4)
        return {}
    return doc["entries"]


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock (``flock`` on ``<path>.lock``) around a read-modify-write of the cache file:
    other processes write it too (the ranks of one machine, two jobs), and without the lock one
    writer's new entries are lost when the other replaces the file with what it read before."""
    import fcntl  # POSIX: revtriton runs on Linux

    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_cache(path: str, fp: dict, key: str, record: dict):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _locked(path):
            entries = {}
            if os.path.exists(path):
                with warnings.catch_warnings():  # already warned about when it was read
                    warnings.simplefilter("ignore")
                    entries = _read_cache(path, fp)
            entries[key] = record
            handle, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".backend-", suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump({"fingerprint": fp, "entries": entries}, out, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as error:
        warnings.warn(f"revtriton: cannot write the backend cache {path} ({error}); choices are kept in memory "
                      f"only", RuntimeWarning, stacklevel=4)


# --------------------------------------------------------------------------------------------
# Measuring


def cuda_event_timer(run, *, op=None, candidate=None, warmup=WARMUP, repeats=REPEATS, budget_s=BUDGET_S) -> float:
    """Median milliseconds of ``run()`` with CUDA events on the current stream."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times, deadline = [], time.perf_counter() + budget_s
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


def _runner(cand: Candidate, args, options):
    """A closure running ``cand`` once on the call's inputs: forward, and backward when parameters
    need grad (on detached leaves, so nothing reaches .grad). Returns every output tensor."""
    res, x, sign, frac_bits = args[:4]
    weights = args[4:]
    training = any(isinstance(w, torch.Tensor) and w.requires_grad for w in weights)
    if not training:
        def run():
            with torch.no_grad():
                return tuple(cand.run(res, x, sign, frac_bits, *weights, **options)[:1])
        return run
    x_leaf = x.detach().requires_grad_(x.is_floating_point())
    leaves = [w.detach().requires_grad_() if isinstance(w, torch.Tensor) and w.requires_grad
              else (None if w is None else w.detach()) for w in weights]
    inputs = [t for t in (x_leaf, *leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    grad_dtype = res.dtype if frac_bits is None else torch.promote_types(torch.float32, x.dtype)
    generator = torch.Generator(device=res.device)
    generator.manual_seed(0)
    g = torch.randn(res.shape, generator=generator, device=res.device, dtype=grad_dtype)

    def run():
        with torch.enable_grad():
            stream, port = cand.run(res, x_leaf, sign, frac_bits, *leaves, **options)
            grads = () if port is None else torch.autograd.grad(port, inputs, g, allow_unused=True)
        return (stream.detach(), *grads)

    return run


def _bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all((s is None and t is None) or (s is not None and t is not None and torch.equal(s, t))
                                    for s, t in zip(a, b))


def _measure(op: Op, key: str, args, options, where: str) -> dict:
    exact = args[3] is not None
    timer = _timer or functools.partial(cuda_event_timer, warmup=0, repeats=REPEATS // ROUNDS,
                                        budget_s=BUDGET_S / ROUNDS)
    runs, excluded = {}, {}
    begin = time.perf_counter()
    with launches.uncounted():
        for cand in op.candidates.values():
            if not (cand.available(args, options) and cand.supports(args, options)):
                continue
            run = _runner(cand, args, options)
            try:
                first = run()  # also the first warm-up (Triton compiles here)
                second = run() if exact else first
            except Exception as error:  # noqa: BLE001 (a candidate that fails here is simply not used)
                excluded[cand.name] = f"failed: {type(error).__name__}: {error}"[:300]
                continue
            if exact and not _bitwise_equal(first, second):
                excluded[cand.name] = "two runs on the same inputs differ (not deterministic: not for exact streams)"
                continue
            del first, second
            for _ in range(WARMUP if _timer is None else 0):
                run()
            runs[cand.name] = run
        # Round-robin: a host hiccup or a clock change hits every candidate in a round, not one.
        rounds = {name: [] for name in runs}
        deadline = time.perf_counter() + BUDGET_S * len(runs)
        for _ in range(ROUNDS):
            for name, run in runs.items():
                rounds[name].append(float(timer(run, op=op.name, candidate=name)))
            if time.perf_counter() > deadline:
                break
    times = {name: statistics.median(ms) for name, ms in rounds.items()}
    if not times:
        raise RuntimeError(f"revtriton: no implementation of {op.name} can run [{key}] on {where}: {excluded}")
    choice = min(times, key=times.get)  # ties: the first registered
    record = {"choice": choice, "times_ms": times, "excluded": excluded, "op": op.name, "key": key,
              "measured_s": round(time.perf_counter() - begin, 3)}
    timings = ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
    skipped = "".join(f"; {name} excluded ({why})" for name, why in excluded.items())
    print(f"revtriton: {op.name} [{key}] on {where}: {timings} -> {choice}{skipped}", file=sys.stderr, flush=True)
    return record


def _measurable(x: torch.Tensor) -> bool:
    if _timer is not None:
        return True
    if not x.is_cuda:
        return False
    compiler = getattr(torch, "compiler", None)
    return not (compiler is not None and compiler.is_compiling())


def _distributed():
    """(rank, world size) when a default process group of more than one rank is up, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def _decide(op: Op, key: str, args, options, device: torch.device) -> dict:
    """Rank-local choice for an unpinned key: the cache's, else measured (and written)."""
    fp = fingerprint(device)
    where = fp["name"]
    path = cache_path(device)
    if path is not None:
        entry = _read_cache(path, fp).get(key)
        if entry is not None:
            cand = op.candidates.get(entry["choice"])
            if cand is not None and cand.available(args, options) and cand.supports(args, options):
                return {**entry, "op": op.name, "key": key, "source": "cache"}
            warnings.warn(f"revtriton: backend cache {path} names {entry['choice']!r} for {op.name} [{key}], which "
                          f"cannot run here; measuring again", RuntimeWarning, stacklevel=3)
    usable = [c for c in op.candidates.values() if c.available(args, options) and c.supports(args, options)]
    if len(usable) == 1:
        _warn_unsupported(op, args, options, key)
        return {"choice": usable[0].name, "times_ms": {}, "excluded": {}, "op": op.name, "key": key,
                "source": "only candidate"}
    record = _measure(op, key, args, options, where)
    if path is not None:
        _write_cache(path, fp, key, {k: record[k] for k in ("choice", "times_ms", "excluded")})
    return {**record, "source": "measured"}


def _decide_everywhere(op: Op, key: str, args, options, device: torch.device) -> dict:
    ranks = _distributed()
    if ranks is None:
        return _decide(op, key, args, options, device)
    import torch.distributed as dist

    rank, _ = ranks
    payload = [None]
    if rank == 0:
        try:
            payload[0] = _decide(op, key, args, options, device)
        except Exception as error:  # the other ranks wait in the broadcast: tell them
            payload[0] = {"error": f"{type(error).__name__}: {error}"}
            dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
            raise
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    record = payload[0]
    if "error" in record:
        raise RuntimeError(f"revtriton: rank 0 could not choose an implementation of {op.name}: {record['error']}")
    if rank != 0:
        record = {**record, "source": f"rank 0 ({record.get('source')})"}
    if record["choice"] not in op.candidates:
        raise RuntimeError(f"revtriton: rank 0 chose {record['choice']!r} for {op.name}, which this rank lacks")
    return record


_warned_unsupported: set = set()


def _warn_unsupported(op: Op, args, options, key: str | None = None):
    """One warning per (op, key): a candidate that runs on this device does not handle these inputs
    (e.g. a head dim the Triton attention kernels lack), so another one runs instead."""
    skipped = [c.name for c in op.candidates.values() if c.available(args, options) and not c.supports(args, options)]
    if not skipped:  # the common case: no key to build (a string of shapes and flags, per call)
        return
    key = key if key is not None else op.key(args, options)
    if (op.name, key) not in _warned_unsupported:
        _warned_unsupported.add((op.name, key))
        warnings.warn(f"revtriton: {op.name} [{key}]: the {', '.join(skipped)} implementation does not support "
                      f"these inputs; running the other implementation instead", RuntimeWarning, stacklevel=4)


def _default(op: Op, args, options) -> Candidate:
    for cand in op.candidates.values():
        if cand.available(args, options) and cand.supports(args, options):
            _warn_unsupported(op, args, options)
            return cand
    raise RuntimeError(f"revtriton: no implementation of {op.name} runs on these tensors")


def call_signature(op_name: str, args, options):
    """A hashable key of an op call: the op, autocast's dtype, its tensors' shapes, strides, dtypes
    and devices, its other arguments and options as they are (launches.call_signature); None for a
    scaled coupling (a scale object per call), an unhashable argument or under torch.compile."""
    if options.get("scale") is not None or not isinstance(args[1], torch.Tensor) or torch.compiler.is_compiling():
        return None  # (under torch.compile the call is traced once: nothing to keep)
    device_type = args[1].device.type
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    try:
        return launches.CallKey(launches.call_signature(op_name, autocast, *args, *options, *options.values()))
    except TypeError:  # an unhashable argument
        return None


_keys: dict = {}  # call signature -> the op's key string (see _key)
KEYS_KEPT = 256


def _key(op: Op, args, options, signature) -> str:
    """``op.key(args, options)``, built once per call signature: an op's key is a function of its
    arguments' metadata and options (couple_key), and building its string costs about as much
    host time as the rest of the dispatch."""
    if signature is None:
        return op.key(args, options)
    key = _keys.get(signature)
    if key is None:
        if len(_keys) >= KEYS_KEPT:
            _keys.clear()
        key = _keys[signature] = op.key(args, options)
    return key


# (call signature, backend override, the caller's dispatch state (force_triton), timer) -> (the
# candidate chosen, the signature as first seen). A choice is a function of those (the signature holds
# the op, devices, shapes, dtypes and options), the registry and the pins: registering a candidate and
# reset() clear it.
_chosen: dict = {}


def choose(op_name: str, args, options, signature=None, dispatch_state=None) -> tuple:
    """``(candidate, signature)``: the candidate that runs ``op_name`` on these arguments (see the
    module doc), and the signature object first seen equal to ``signature`` (the call's
    :func:`call_signature`; None without one). A repeated signature's choice is looked up, not made
    again, and its later lookups (the key string, the launch plans) match by identity instead of
    comparing every tensor's metadata again. ``dispatch_state``: what else of the caller's decides
    the candidates' availability (hashable: ops.dispatch's force_triton)."""
    if signature is None:
        return _choose(op_name, args, options, None), None
    memo = (signature, current_backend(), dispatch_state, _timer)
    kept = _chosen.get(memo)
    if kept is None:
        if len(_chosen) >= KEYS_KEPT:
            _chosen.clear()
        kept = _chosen[memo] = (_choose(op_name, args, options, signature), signature)
    return kept


def choice_state(dispatch_state) -> tuple:
    """Everything beside a call's signature that decides which candidate runs it: the override
    (context or environment), the caller's dispatch state (force_triton), the timer, and the
    registry and pins as of now (an epoch that registering a candidate and reset() advance; a pin,
    once made, stays). A runner bound to a signature (dispatch.bind_op) serves while it is equal."""
    return current_backend(), dispatch_state, _timer, _epoch


def _choose(op_name: str, args, options, signature) -> Candidate:
    op = _ops[op_name]
    mode = current_backend()
    if mode != "auto":
        cand = op.candidates.get(mode)
        if cand is None:
            raise ValueError(f"revtriton: {op_name} has no {mode!r} implementation (has: {list(op.candidates)})")
        if not cand.available(args, options):
            raise RuntimeError(f"revtriton: backend {mode!r} was asked for, but it cannot run {op_name} on "
                               f"{args[1].device.type} tensors here (Triton needs CUDA tensors, or CPU tensors "
                               f"inside ops.dispatch.force_triton() with TRITON_INTERPRET=1)")
        return cand
    x = args[1]
    if not _measurable(x):
        return _default(op, args, options)
    device = x.device
    pin = (str(device), op_name, _key(op, args, options, signature))
    name = _pins.get(pin)
    if name is None:
        record = _decide_everywhere(op, pin[2], args, options, device)
        name = _pins[pin] = record["choice"]
        _decisions[pin] = {**record, "device": fingerprint(device)["name"]}
    return op.candidates[name]


def decisions() -> list[dict]:
    """How each pinned choice of this process was made: op, key, device, choice, source
    (measured, cache, only candidate, rank 0), times_ms per candidate, excluded candidates."""
    return [dict(record) for record in _decisions.values()]


def decision(op_name: str, *args, **options) -> dict | None:
    """The pinned choice's record for this call's key, if one was made."""
    pin = (str(args[1].device), op_name, _ops[op_name].key(args, options))
    record = _decisions.get(pin)
    return None if record is None else dict(record)


# --------------------------------------------------------------------------------------------
# Replay (the engine's forward -> recompute)


def capture():
    """The override in force now (for a recompute to run as the forward did)."""
    return current_backend()


@contextlib.contextmanager
def restored(state):
    global _override
    previous, _override = _override, state
    try:
        yield
    finally:
        _override = previous
