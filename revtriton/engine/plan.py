"""What a stack's steps can reuse: its segments, each layer's modules, parameters and buffers,
which halves draw random numbers, which rebuilt halves passed the captured-tensor walk.

Working these out walks every module of every layer (``named_modules`` and friends), which on a
CPU cost about as much Python as the engine's own per-block work. A :class:`StackPlan` does it once
and is rebuilt only when something it depends on changed:

* a module, parameter or buffer assigned anywhere (``module.x = ...``, ``register_*``): PyTorch's
  global registration hooks bump :data:`structure_epoch`;
* a submodule, parameter, buffer or attribute added or deleted, a layer's class changed
  (``fully_shard`` does that), a training flag or a dropout probability changed, a module compiled
  in place (``module.compile()`` adds the attribute ``_compiled_call_impl``: tests/test_compile.py),
  a tensor held as a plain attribute replaced or starting to require grad: part of the plan's
  signature, recomputed at every forward from the plan's own module list (a few attribute reads
  per module, no walk).

What no signature sees: a tensor a half reads through a closure or a global. The captured-tensor
walk (engine.segment) is then done once per plan and input shape, as the README states.

FSDP2-sharded layers swap their parameter objects around every use: their parameters are
always listed afresh (and never version-checked, as before).
"""
from __future__ import annotations

import numbers
import weakref

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..halves.base import takes_cond
from .fsdp import _is_fsdp_module
from .protocol import coupling_of, is_invertible_layer, is_reversible_block

structure_epoch = 0


def _structure_changed(*_):
    global structure_epoch
    structure_epoch += 1


for _register in (nn.modules.module.register_module_module_registration_hook,
                  nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook):
    _register(_structure_changed)


def _random_settings(module: nn.Module):
    """The names of a module's attributes that say how much it draws (dropout ``p``, ``drop_prob``,
    ``attention_dropout``, ``drop_path`` rates, ...): numbers whose name says dropout."""
    return tuple(name for name, value in vars(module).items()
                 if isinstance(value, numbers.Number) and not isinstance(value, bool)
                 and (name == "p" or "drop" in name))


def runs_compiled_code(half) -> bool:
    """Whether a half runs code torch.compile compiles: a module of it compiled in place
    (``module.compile()``) or wrapped (``torch.compile(module)``, an OptimizedModule: ``_orig_mod``).
    Such a half never runs under the engine's RNG routing mode (a TorchFunctionMode): Dynamo traces
    the mode's handler and breaks the compiled graphs at its generators."""
    return isinstance(half, nn.Module) and any(m._compiled_call_impl is not None or "_orig_mod" in m._modules
                                               for m in half.modules())


# nn.Module's own instance attributes (its dicts, flags and hook slots): never a tensor of the user's, so the
# tensor-attribute watch leaves them out (every module has _is_full_backward_hook = None).
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


def _tensor_identity(value):
    return (id(value), value.requires_grad) if isinstance(value, torch.Tensor) else None


class LayerPlan:
    """One layer of a segment as the engine uses it."""

    __slots__ = ("layer", "is_block", "coupling", "fsdp", "params", "modules", "buffers", "running_stats",
                 "bumped", "cond_f", "cond_g", "draws", "routing")

    def __init__(self, layer):
        self.layer = layer
        self.is_block = is_reversible_block(layer)
        self.coupling = coupling_of(layer) if self.is_block else None
        self.fsdp = _is_fsdp_module(layer)
        self.params = None if self.fsdp else list(layer.parameters())
        self.modules = list(layer.modules())
        self.buffers = [(m, name, b) for m in self.modules for name, b in m._buffers.items() if b is not None]
        # Batch norms update their running statistics inside the kernel, without bumping the buffers'
        # version counters: they are known to change in a training forward.
        self.running_stats = [(m, name) for m in self.modules
                              if isinstance(m, _NormBase) and m.training and m.track_running_stats
                              for name in ("running_mean", "running_var", "num_batches_tracked")
                              if m._buffers.get(name) is not None]
        self.bumped = None  # the (module, name) of buffers a recording forward updated in place, once seen
        halves = layer.coupling_halves() if self.is_block else (None, None)
        self.cond_f, self.cond_g = takes_cond(halves[0]), takes_cond(halves[1])
        self.draws = None  # how F and G draw (False, "own", "routed" or "global": segment._recording), once probed
        # Whether F's and G's draws may be routed (HalfRandomness.recorded): not in compiled code.
        self.routing = (not runs_compiled_code(halves[0]), not runs_compiled_code(halves[1]))

    def parameters(self):
        return list(self.layer.parameters()) if self.params is None else self.params


class SegmentPlan:
    __slots__ = ("first_index", "layers", "captured_checked", "parameter_slots", "mode_modules", "mode_layers",
                 "slot_modules", "slot_names", "slot_tensors")

    def __init__(self, first_index, layers):
        self.first_index = first_index
        self.layers = [LayerPlan(layer) for layer in layers]
        self.captured_checked = set()  # (layer, half, key) whose rebuilt graph reached no foreign leaf
        # Where each parameter is registered, with the tensor there: torch.func.functional_call puts other
        # tensors there for one call by assigning m._parameters[name] directly, which no registration
        # hook sees (the plan's validity compares them; the backward checks them against the forward's).
        self.parameter_slots = [(lp, m, name, p) for lp in self.layers if not lp.fsdp for m in lp.modules
                                for name, p in m._parameters.items() if p is not None]
        # The same as flat lists, which state.StateWatch compares whole (C loops: a step's checks, issue 44):
        # every module of the layers (and its layer's index), every parameter slot's module, name and tensor
        self.mode_modules = [m for lp in self.layers for m in lp.modules]
        self.mode_layers = [i for i, lp in enumerate(self.layers) for _ in lp.modules]
        self.slot_modules = [m for _, m, _, _ in self.parameter_slots]
        self.slot_names = [name for _, _, name, _ in self.parameter_slots]
        self.slot_tensors = [p for _, _, _, p in self.parameter_slots]

    def stateless_parameter(self):
        """``(layer plan, module, name)`` of a parameter slot holding a tensor that is not an
        nn.Parameter (only a stateless call such as torch.func.functional_call puts one there), or None."""
        return next(((lp, m, name) for lp, m, name, p in self.parameter_slots if not isinstance(p, nn.Parameter)),
                    None)

    @property
    def modules(self):
        return [layer.layer for layer in self.layers]


class StackPlan:
    """The segments of a stack (``("segment", first_index, SegmentPlan)`` or ``("transition", index,
    module)``), built once per structure, with the signature that says when to build it again."""

    def __init__(self, stack):
        self.epoch = structure_epoch
        self.layers = list(stack._modules.values())
        self.parts = []
        current, start = [], 0
        for i, layer in enumerate(self.layers):
            if is_reversible_block(layer) or is_invertible_layer(layer):
                if not current:
                    start = i
                current.append(layer)
                continue
            if current:
                self.parts.append(("segment", start, SegmentPlan(start, current)))
                current = []
            self.parts.append(("transition", i, layer))
        if current:
            self.parts.append(("segment", start, SegmentPlan(start, current)))
        self.modules = list(stack.modules())
        self.random_settings = [(m, name) for m in self.modules for name in _random_settings(m)]
        # Plain attributes holding a tensor or None (a slot for one): a half may read a tensor that
        # requires grad from one (a captured tensor), so assigning one, or one starting to require
        # grad, must bring the captured-tensor walk back. (A new attribute changes len(__dict__).)
        self.tensor_attributes = [(m, name) for m in self.modules for name, value in vars(m).items()
                                  if (value is None or isinstance(value, torch.Tensor))
                                  and name not in _MODULE_ATTRIBUTES]
        self.first_param = next(stack.parameters(), None)
        self.signature = self._signature()
        self.parameter_slots = [(m, name, p) for kind, _, part in self.parts if kind == "segment"
                                for _, m, name, p in part.parameter_slots]

    def _signature(self):
        """Each module's class, training flag and entry counts (one tuple a module: one pass), the random
        settings, and the tensor attributes' identities."""
        return ([(m.__class__, m.training, len(m._modules) + len(m._parameters) + len(m._buffers) + len(m.__dict__))
                 for m in self.modules],
                [getattr(m, name, None) for m, name in self.random_settings],
                [_tensor_identity(getattr(m, name, None)) for m, name in self.tensor_attributes])

    def valid(self) -> bool:
        return (self.epoch == structure_epoch and self._signature() == self.signature
                and all(m._parameters.get(name) is p for m, name, p in self.parameter_slots))


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_of(stack) -> StackPlan:
    """The stack's plan, rebuilt if anything it depends on changed since it was built."""
    plan = _plans.get(stack)
    if plan is None or not plan.valid():
        plan = _plans[stack] = StackPlan(stack)
    return plan


def forget_plan(stack):
    _plans.pop(stack, None)
