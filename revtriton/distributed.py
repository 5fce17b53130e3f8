"""Distributed training of reversible stacks: DDP and FSDP2.

The reversible backward accumulates parameter gradients into ``p.grad`` from local backward
calls inside the stack's autograd node (one per half and block), so:

* **DDP** works as is, with its defaults and with ``static_graph=True``: every parameter's
  gradient hook fires exactly once per step. ``find_unused_parameters=True`` cannot work: DDP
  looks for the parameters in the output's autograd graph, where the blocks' parameters are
  not (the forward keeps no graph), so it marks them unused and then sees their gradients
  arrive; DDP raises "Expected to mark a variable ready only once" at the first backward.
  :func:`check_ddp` refuses such a model up front; :func:`ddp_error_hint` explains the error.
* **FSDP2** needs every use of a block's parameters to go through one hookable call per block
  and phase. The engine runs each phase (forward, rebuild in backward, inverse) as one call of
  the block's ``reversible_phase`` method, registered as an FSDP2 forward method (by
  :func:`shard_reversible`, or by the engine itself the first time it meets a block that
  ``fully_shard`` was applied to directly, e.g. by accelerate). A block is then all-gathered
  once in forward and once in backward (FSDP2 leaves a call made inside backward gathered, as
  for activation-checkpointing recomputes, so the rebuild's gather also serves the block's
  gradients), and its gradients are reduce-scattered once, right after both halves' gradients
  are in (a post-backward token joined to F's input in the rebuild).
"""
from __future__ import annotations

from torch import nn

from .engine import FIND_UNUSED_HINT, hook_phase_for_fsdp, is_reversible_block

__all__ = ["shard_reversible", "reversible_blocks", "check_ddp", "ddp_error_hint", "FIND_UNUSED_HINT"]


def reversible_blocks(model: nn.Module):
    """The outermost reversible blocks in ``model`` (modules with ``coupling_halves()``), in order."""
    blocks, inside = [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if is_reversible_block(module):
            blocks.append(module)
            inside.append(name + ".")
    return blocks


def shard_reversible(model: nn.Module, mesh=None, *, reshard_after_forward=True, shard_root: bool = True,
                     **fsdp_kwargs):
    """Shard a model holding reversible stacks with FSDP2: ``fully_shard`` per block, then the root.

    Args:
        model: the root module (a :class:`~revtriton.ReversibleStack` or a model containing
            stacks), not sharded yet.
        mesh: the ``DeviceMesh`` (None: FSDP2's default, all ranks on the current device type).
        reshard_after_forward: for the blocks (the root follows FSDP2's own rule).
        shard_root: apply ``fully_shard`` to ``model`` too. FSDP2 needs a sharded root above the
            blocks (its end-of-backward callback is queued by the root's backward); pass False
            only if you shard a module above ``model`` yourself.
        **fsdp_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ``offload_policy``...).

    Other submodules (embeddings, heads) stay in the root's group unless you shard them first.
    Returns ``model`` (its class is now FSDP's subclass, as with ``fully_shard``).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        raise ValueError("shard_reversible: the model is already sharded; apply it to the unsharded model")
    blocks = reversible_blocks(model)
    if not blocks:
        raise ValueError("shard_reversible: the model holds no reversible block (a module with coupling_halves())")
    for block in blocks:
        if isinstance(block, FSDPModule):
            raise ValueError(f"shard_reversible: block {type(block).__name__} is already sharded")
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
        hook_phase_for_fsdp(block)
    if shard_root:
        fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model




def check_ddp(model: nn.Module) -> nn.Module:
    """Raise a clear error if ``model`` is a DDP model with ``find_unused_parameters=True``
    (without ``static_graph``) that holds reversible blocks; returns ``model``."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and model.find_unused_parameters and not model.static_graph:
        if reversible_blocks(model.module):
            raise ValueError(FIND_UNUSED_HINT)
    return model


def ddp_error_hint(error: BaseException) -> str | None:
    """The explanation of DDP's error for ``find_unused_parameters=True`` raised inside a
    reversible backward ("Expected to mark a variable ready only once"), or None for other errors."""
    text = str(error)
    if FIND_UNUSED_HINT in text or "mark a variable ready only once" in text or "marked as ready twice" in text:
        return FIND_UNUSED_HINT
    return None
