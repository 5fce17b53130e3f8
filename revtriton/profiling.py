"""Memory measurements used by the tests and perf/.

* :func:`saved_bytes`: bytes a forward keeps for backward — every tensor autograd saves
  (seen through ``saved_tensors_hooks``) plus tensors custom Functions keep on ``ctx``
  (found by walking the graph), each storage counted once, parameters and buffers excluded.
* :func:`peak_memory`: peak bytes allocated while a callable runs (a training step, say),
  above what was allocated when it started: CUDA's allocator statistics on a GPU, the
  profiler's allocation events (every allocation and free, in order) on the CPU.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())


def _tensors_in(obj, depth=0, seen=None):
    """Tensors reachable from a ctx attribute (lists, tuples, dicts, dataclasses), modules skipped."""
    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _tensors_in(value, depth + 1, seen)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1, seen)


def _graph_nodes(outputs):
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def _flatten_outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _flatten_outputs(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _flatten_outputs(item)]
    return [t for t in vars(out).values() if isinstance(t, torch.Tensor)] if hasattr(out, "__dict__") else []


def saved_bytes(fn, module: nn.Module | None = None) -> int:
    """Bytes kept for backward by ``fn()`` (a forward returning its output tensors).

    ``module``'s parameters and buffers are not counted (they are not activations).
    """
    excluded = set()
    if module is not None:
        excluded = {_storage_key(t) for t in list(module.parameters()) + list(module.buffers())}
    kept = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            key = _storage_key(t)
            if key not in excluded:
                kept[key] = key[3]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    for node in _graph_nodes(_flatten_outputs(out)):
        if hasattr(node, "saved_tensors") and hasattr(node, "__dict__"):  # a custom Function's ctx
            for t in _tensors_in(vars(node)):
                key = _storage_key(t)
                if key not in excluded and not isinstance(t, nn.Parameter):
                    kept[key] = key[3]
    del out
    return sum(kept.values())


def peak_memory(fn, device: torch.device | str | None = None) -> int:
    """Peak bytes allocated while ``fn()`` runs, above the bytes allocated when it started."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type()
              == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
