"""What the backward relies on staying as the forward left it: training flags and parameter versions
(checked before the rebuild), buffers the forward updated (the rebuild works on copies), and a
half's input (a half must not modify it in place)."""
from __future__ import annotations

import contextlib
import operator
import sys

import torch

from .fsdp import _is_fsdp_module


def _dtensor_class():
    """torch's DTensor class where torch.distributed.tensor is imported (a DTensor exists only then), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _is_dtensor(tensor) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


_training = operator.attrgetter("training")
_version = operator.attrgetter("_version")
_parameter_dict = operator.attrgetter("_parameters")


def swapped_parameter_message(plan, layer_plan, module, name) -> str:
    """The error of a parameter slot holding another tensor for one call (``plan``: the SegmentPlan)."""
    index = plan.first_index + plan.layers.index(layer_plan)
    where = next((n for n, m in layer_plan.layer.named_modules() if m is module), "")
    qualified = f"{where}.{name}" if where else name
    return (f"revtriton: parameter {qualified} of layer {index} is not the tensor its module registered: another "
            f"tensor was put in its place for one call (torch.func.functional_call or another stateless "
            f"reparametrization). A reversible stack's backward runs its layers again after that call has put "
            f"the module's own parameters back, so it would differentiate other weights, and the swapped-in "
            f"tensors would get no gradient. Load the weights into the stack for the forward and the backward "
            f"(stack.load_state_dict(weights), or torch.nn.utils.swap_tensors), or run the forward under "
            f"torch.no_grad() when no gradient is wanted.")


class StateWatch:
    """What a segment's backward needs unchanged since the forward, recorded as host-side ints.

    The backward rebuilds every block by running its halves again, so it must see what the
    forward saw: a module switched between train and eval (dropout, drop-path, BatchNorm) or a
    parameter changed in place (an optimizer step, an edit under no_grad) in between would give
    silently wrong gradients with float streams and a misleading checksum error with exact ones.
    Training flags and parameter version counters are compared before the rebuild: no device
    work, no host sync. It also lists the buffers of each layer, so the forward can tell which
    ones it updated (BatchNorm's running statistics).
    """

    def __init__(self, plan, params=None):
        """``plan``: the segment's :class:`~revtriton.engine.plan.SegmentPlan` (its layers' modules and
        buffers, listed once per structure); ``params``: each layer's parameters, if the caller listed
        them already."""
        self.plan = plan
        self.layers, self.first_index = plan.modules, plan.first_index
        self.params = params if params is not None else [lp.parameters() for lp in plan.layers]
        # Each module's training flag now, in the plan's order of its modules (compared whole in check())
        self.mode_flags = list(map(_training, plan.mode_modules))
        self.versions, self._version_tensors, self._version_values = [], [], []
        self.buffers = [lp.buffers for lp in plan.layers]
        self.running_stats = [lp.running_stats for lp in plan.layers]

    def record_versions(self):
        """Take the parameters' versions as the forward leaves them (a module may renormalise its own
        weights in its forward, e.g. nn.Embedding(max_norm=...))."""
        dtensor = _dtensor_class() or ()  # (isinstance of an empty tuple: never)
        self.versions = [(i, p, p._version) for i, (layer, params) in enumerate(zip(self.layers, self.params))
                         # FSDP2 re-gathers a sharded block's parameters in place: its business
                         if not _is_fsdp_module(layer) for p in params if not isinstance(p, dtensor)]
        self._version_tensors = [p for _, p, _ in self.versions]
        self._version_values = [v for _, _, v in self.versions]

    def _where(self, i, named, target, kind):
        name = next((n for n, t in named if t is target), "")
        layer = f"layer {self.first_index + i}"
        return f"{kind} {name} of {layer}" if name else layer

    def check(self):
        """Raise if a training flag or a parameter changed since the forward (the lists compared whole; the
        first difference found only when there is one)."""
        plan = self.plan
        if (all(map(operator.is_, map(dict.get, map(_parameter_dict, plan.slot_modules), plan.slot_names),
                    plan.slot_tensors))
                and list(map(_training, plan.mode_modules)) == self.mode_flags
                and list(map(_version, self._version_tensors)) == self._version_values):
            return
        for lp, m, name, p in plan.parameter_slots:
            if m._parameters.get(name) is not p:  # the forward ran other tensors (functional_call)
                raise RuntimeError(swapped_parameter_message(plan, lp, m, name))
        changed = None
        for i, module, training in zip(plan.mode_layers, plan.mode_modules, self.mode_flags):
            if module.training != training:
                where = self._where(i, self.layers[i].named_modules(), module, "submodule")
                was, now = ("train", "eval") if training else ("eval", "train")
                changed = f"the training flag of {where} ({type(module).__name__}) went from {was} to {now}"
                break
        else:
            for i, param, version in self.versions:
                if param._version != version:
                    where = self._where(i, self.layers[i].named_parameters(), param, "parameter")
                    changed = (f"{where} was modified in place (its version counter went from "
                               f"{version} to {param._version})")
                    break
        if changed is not None:
            raise RuntimeError(
                f"revtriton: {changed} between the forward and the backward of a reversible stack. The backward "
                f"rebuilds each block by running it again, so it needs the forward's modes and weights: run "
                f"backward before model.eval() / model.train(), optimizer.step() or in-place edits of parameters, "
                f"or run the forward again after changing them."
            )


def _buffer_versions(buffers):
    return [b._version for _, _, b in buffers]


def _buffer_starts(buffers, bumped):
    """Copies of the buffers a layer's forward may update in place, taken before it runs: the values
    the forward reads, which its rebuild must read too (spectral_norm's power-iteration vectors, a
    step counter, an observer's range). ``bumped``: the (module, name) an earlier forward updated, or
    None (not known yet: all of them, once)."""
    return [b.clone() if bumped is None or (m, name) in bumped else None for m, name, b in buffers]


def _updated_buffers(buffers, versions, starts):
    """``(module, name, value before the forward or None)`` of the buffers whose version changed since
    ``versions`` was taken (``starts``: :func:`_buffer_starts`)."""
    return [(m, name, start) for (m, name, b), v, start in zip(buffers, versions, starts) if b._version != v]


@contextlib.contextmanager
def _scratch_buffers(updated):
    """Run a rebuild on copies of the buffers its forward updated, so the module's buffers stay as the
    forward left them. ``updated``: ``(module, name, start)``; a copy of ``start``, the value the
    forward read, where it was taken (buffers updated with an in-place torch op), else of the buffer
    as the forward left it (BatchNorm's running statistics, which its training forward does not read)."""
    originals = [(m, name, m._buffers[name], start) for m, name, start in updated]
    for m, name, buffer, start in originals:
        m._buffers[name] = (buffer if start is None else start).clone()
    try:
        yield
    finally:
        for m, name, buffer, _ in originals:
            m._buffers[name] = buffer


def _version_of(x: torch.Tensor):
    """The version counter of ``x`` (None for inference tensors, which have none)."""
    return None if x.is_inference() else x._version


def _check_input_untouched(x: torch.Tensor, version, half: str, index: int):
    if version is not None and x._version != version:
        raise RuntimeError(
            f"revtriton: the {half} half of layer {index} modified its input in place (an in-place op such as "
            f"nn.ReLU(inplace=True) or x.add_() on the half's input). A half's input is the other residual "
            f"stream, which the block still needs (and the backward rebuilds it as a leaf): make the half's "
            f"first op out of place (e.g. nn.ReLU(inplace=False))."
        )
