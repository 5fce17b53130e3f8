"""A whole training step in one CUDA graph: forward, the reversible backward (either schedule), the
optimizer step, replayed with the host out of the way (issue 35).

    step = CapturedStep(train_step)       # train_step(*tensors) -> its outputs (the loss, ...)
    for x, y in loader:
        loss = step(x, y)                  # warm-up calls run eagerly, then one capture, then replays
    step.check()                           # exact streams: every replay's checks, one host sync

A call runs ``train_step`` as written, so the step keeps its own semantics: ``zero_grad`` inside it
is replayed each step, gradient accumulation inside it too. What a graph cannot see:

* Host state read at capture is frozen into the graph: a learning rate that is a Python float (a
  scheduler changing it between calls raises; give the optimizer a tensor ``lr`` and set it in
  place), any Python branch of ``train_step``.
* Fixed shapes: a call with other input shapes, dtypes or devices raises (pad to one shape, or keep
  one CapturedStep per shape).
* No host sync inside the step (``.item()``, ``print(tensor)``, ``nonzero``): capture fails; the
  error says so. The stack's own step makes none (tests/test_host_sync.py).
* Optimizers with a step count (Adam, AdamW, ...) need ``capturable=True``: checked at capture.
* Halves that draw random numbers (dropout, drop-path) draw the eager step's numbers: eagerly a
  half's recompute replays a generator forked at its first draw, and a graph draws only from
  generator states registered before its capture, so the warm-up records where each half forked
  (the global Philox offset from the step's start) and which recompute replays it, the capture
  gives each recompute a generator registered with the graph, and each replay first sets those to
  the global seed and offset plus their fork's (``halves.randomness.GraphDraws``). The warm-up
  calls must draw as the captured step does (checked at capture); a stack inside a half that draws,
  and draws an extension kernel makes from the global generator itself (flash-attn's dropout),
  raise at capture, saying so.

The design follows PyTorch's whole-network capture (``torch.cuda.graphs``): warm-up calls on a
side stream (they run the backend choice and the autotuners, so the captured kernels are the
pinned ones, and create the optimizer's state), the capture itself (whose kernels do not run),
then a replay for the capturing call. Static inputs are copied into at each call; the outputs are
the graph's own tensors, overwritten by the next replay (copy what you keep). Gradients are the
graph's buffers: a ``zero_grad(set_to_none=True)`` outside the step cannot free them (the graph
writes them anyway); each call puts them back on their parameters, so ``p.grad`` is always what the
last step computed. Exact streams' checks are device flags: each replay ORs its failure into a flag
of the step (inside the graph), which :meth:`CapturedStep.check` (and ``check_step()``) reads with
one sync. The optimizer step is inside the graph, so a failed check is seen after that step's
update: the error says so.

A graph backend (``_CudaGraphs``) does the CUDA part; the rest is host logic that tests run on a
CPU with a stand-in backend that replays by running the step again.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..halves.randomness import GraphDraws
from ..ops.arguments import checked_int
from . import checks

HOST_SYNC_HINT = ("a host sync inside the step (.item(), bool(tensor), print(tensor), a data-dependent shape such "
                  "as nonzero or boolean indexing, fp16's GradScaler.step checking for infs: train in bf16) or a "
                  "copy between host and device; run the step eagerly under torch.cuda.set_sync_debug_mode('error') "
                  "to find it")


class _CudaGraphs:
    """The CUDA part: warm-up on a side stream, capture into a torch.cuda.CUDAGraph, replay."""

    def warm_up(self, run):
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = run()
        main.wait_stream(side)
        return out

    def capture(self, run, pool, generators=()):
        graph = torch.cuda.CUDAGraph()
        for generator in generators:  # (before the capture begins: PyTorch's graph-safe RNG)
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph, out

    def replay(self, graph):
        graph.replay()


class CapturedStep:
    """``train_step`` captured in one CUDA graph after ``warmup`` eager calls (see the module doc).

    Args:
        train_step: ``train_step(*tensors)`` runs one whole step (forward, backward, optimizer
            step) and returns its outputs (a tensor, or a tuple / list / dict of them).
        warmup: eager calls before the capture (at least 1: the autotuners and the backend choice
            run there; DistributedDataParallel needs 11, PyTorch's CUDA-graph notes say why).
        pool: a memory pool to share with other graphs (``torch.cuda.graph_pool_handle()``).
    """

    def __init__(self, train_step, *, warmup: int = 3, pool=None, _backend=None):
        if not callable(train_step):
            raise TypeError(f"CapturedStep takes a callable train_step, got {type(train_step).__name__}")
        checked_int("warmup", warmup, 1, note=" (the autotuners run before the capture)")
        if _backend is None and not torch.cuda.is_available():
            raise RuntimeError("CapturedStep needs CUDA (a CUDA graph); this torch has no CUDA device")
        self.train_step, self.warmup, self.pool = train_step, warmup, pool
        self.backend = _CudaGraphs() if _backend is None else _backend
        self.calls = 0
        self.graph = None
        self.static_inputs = None
        self.static_outputs = None
        self._grads = []  # (parameter, the graph's gradient buffer)
        self._rates = []  # (param group, its lr at capture), for a Python-float lr
        self._checks = []  # exact streams' StepChecks captured with the step
        self._failed = None  # device flag: a replay's check failed since the last check()
        self._draws = GraphDraws()  # the halves' random draws: recorded in warm-up, registered, placed per replay

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs):
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"CapturedStep: input {i} is a {type(t).__name__}; pass tensors only (constants "
                                f"belong in train_step itself: the graph freezes them)")
        if self.calls < self.warmup:
            self.calls += 1
            return self.backend.warm_up(lambda: self._warm_up_call(inputs))
        if self.graph is None:
            self._capture(inputs)
        else:
            self._load(inputs)
            self._check_rates()
        self._draws.place()
        with self._draws.captured():  # (a CUDA graph's replay runs no Python: only a stand-in's rerun sees it)
            self.backend.replay(self.graph)
        for p, grad in self._grads:
            if p.grad is not grad:  # set to None (or replaced) outside the step: the graph wrote grad
                p.grad = grad
        self.calls += 1
        return self.static_outputs

    def _warm_up_call(self, inputs):
        with self._draws.warming_up():
            return self.train_step(*inputs)

    # -- capture ------------------------------------------------------------------------------------

    def _capture(self, inputs):
        checks.check_step()  # the eager calls' leftovers, before the graph takes over
        self.static_inputs = tuple(t.detach().clone() for t in inputs)
        self._failed = torch.zeros((), dtype=torch.bool, device=_device_of(inputs))
        stepped = []
        handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _capturable(optimizer, stepped))
        pending_before = set(map(id, checks._pending))
        try:
            generators = self._draws.prepare()
            with checks.capturing():
                self.graph, self.static_outputs = self.backend.capture(self._captured_body(pending_before),
                                                                       self.pool, generators)
        except RuntimeError as error:
            self.graph = None
            message = str(error)
            ours = message.startswith(("CapturedStep:", "revtriton:"))
            if not ours and ("capturing" in message or "graph capture" in message):
                raise RuntimeError(f"CapturedStep: the step could not be captured in a CUDA graph: {HOST_SYNC_HINT} "
                                   f"({message})") from error
            raise
        finally:
            handle.remove()
        self._grads = [(p, p.grad) for optimizer in stepped for group in optimizer.param_groups
                       for p in group["params"] if p.grad is not None]
        self._rates = [(group, group["lr"]) for optimizer in stepped for group in optimizer.param_groups
                       if not isinstance(group.get("lr"), torch.Tensor)]
        checks._replayed_steps.add(self)

    def _captured_body(self, pending_before):
        def body():
            with self._draws.captured(capture=True):
                out = self.train_step(*self.static_inputs)
            self._checks = [c for c in checks._pending if id(c) not in pending_before]
            for c in self._checks:  # resolved from the replays' flags by check(), not by check_step's list
                checks._pending.remove(c)
            flagged = [c for c in self._checks if c.segments or c.forward is not None]
            if flagged:  # (on the device: no copy, no sync while capturing)
                self._failed.logical_or_(torch.stack([c.failed_flag() for c in flagged]).any())
            return out
        return body

    # -- each call ----------------------------------------------------------------------------------

    def _load(self, inputs):
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"CapturedStep: {len(inputs)} inputs, captured with {len(self.static_inputs)}")
        for i, (t, static) in enumerate(zip(inputs, self.static_inputs)):
            if t.shape != static.shape or t.dtype != static.dtype or t.device != static.device:
                raise ValueError(
                    f"CapturedStep: input {i} is {_describe(t)}, the step was captured with {_describe(static)}: a "
                    f"CUDA graph replays fixed shapes (pad the inputs to one shape, or keep one CapturedStep per shape)")
        for t, static in zip(inputs, self.static_inputs):
            static.copy_(t)

    def _check_rates(self):
        for group, rate in self._rates:
            if group["lr"] != rate:
                raise RuntimeError(
                    f"CapturedStep: a learning rate changed after the capture ({rate} -> {group['lr']}; a scheduler?): "
                    f"the graph keeps the Python float it was captured with. Give the optimizer a tensor lr "
                    f"(torch.tensor(lr, device='cuda'), with capturable=True) and change it in place")

    def failed_flag(self):
        """The device flag of the replays since the last check (None before the capture)."""
        return self._failed

    def check(self):
        """Raise if a replay's exact-stream check failed since the last call (one host sync)."""
        if self._failed is None or not bool(self._failed):
            return
        self._failed.zero_()
        error = next((e for e in (c._first_error() for c in self._checks) if e is not None), None)
        detail = str(error) if error is not None else "the last replay's flags no longer show which layer"
        raise RuntimeError(f"revtriton: a replay of the captured step failed its exact-stream check; that step's "
                           f"optimizer update was applied (it is inside the graph): {detail}")


def _capturable(optimizer, stepped):
    """The optimizer step pre-hook while capturing: an optimizer that keeps its step count on the host
    cannot be replayed (its bias correction would stay at the captured step)."""
    for group in optimizer.param_groups:
        if group.get("capturable") is False:
            raise RuntimeError(f"CapturedStep: {type(optimizer).__name__} was created with capturable=False: a "
                               f"captured step needs capturable=True (its step count then lives on the device)")
    if optimizer not in stepped:
        stepped.append(optimizer)


def _device_of(inputs):
    return next((t.device for t in inputs), torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


__all__ = ["CapturedStep", "HOST_SYNC_HINT"]
