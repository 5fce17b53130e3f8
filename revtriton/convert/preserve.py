"""Function-preserving conversion (MEFT, Liao, Tan and Monz, NeurIPS 2023): scaled couplings with
the pretrained layer (or sublayer) as one half and a zero-initialised adapter beside it."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..engine import Coupling
from ..halves.adapter import Adapter
from ..halves.base import half_output
from ..ops.streams import couple_output


@dataclass(frozen=True)
class PreserveMode:
    """A function-preserving conversion: which halves, which streams are scaled, swap, readout."""

    halves: str  # "layer, adapter" (F, G)
    scaled: tuple  # (scale1 scaled, scale2 scaled)
    swap: bool
    readout: str  # the stream that carries the pretrained function
    adapters: tuple  # adapter slots: "f" (F's), "g" (G's)


#: With ``L(x) = x + A(x) + M(x + A(x))`` the pretrained layer, ``A`` / ``M`` its attention and MLP
#: branches, ``Ad`` a zero-initialised adapter and ``s = 2**-scale_bits``; both streams start as h0.
#:
#: * ``"meft1"``: ``y1 = s*x1 + L(x2) + Ad_F(x2)``, ``y2 = x2 + Ad_G(y1)``, outputs swapped. Layer
#:   i's input is ``h_i`` plus ``s`` times the one before; the output is the second stream. Scales
#:   one stream. (Ad_G alone would reach the function only through the next ``s*x1``: Ad_F, beside
#:   the layer, is what adapter-only fine-tuning trains; the top block's Ad_G feeds the unread stream.)
#: * ``"meft2"``: ``y1 = x1 + Ad(x2)``, ``y2 = s*x2 + L(y1)``, outputs swapped; reads the first stream.
#: * ``"meft3"``: ``y1 = s*x1 + x2 + A(x2) + Ad_A(x2)``, ``y2 = s*x2 + y1 + M(y1) + Ad_M(y1)``
#:   (attention and MLP sublayers as the halves, an adapter beside each); reads the second stream.
#:   Scales both streams (twice the kept bits of meft1 / meft2 in exact mode).
PRESERVE_MODES = {
    "meft1": PreserveMode("layer+adapter, adapter", (True, False), True, "second", ("f", "g")),
    "meft2": PreserveMode("adapter, layer", (False, True), True, "first", ("f",)),
    "meft3": PreserveMode("attention+adapter, mlp+adapter", (True, True), False, "second", ("f", "g")),
}


@dataclass(frozen=True)
class _Conversion:
    options: dict
    preserve: str | None
    scale_bits: int
    adapter_size: int
    ordinary_top: int

    def coupling(self) -> Coupling | None:
        if self.preserve is None:
            return None
        mode, scale = PRESERVE_MODES[self.preserve], 2.0**-self.scale_bits
        return Coupling(scale if mode.scaled[0] else 1.0, scale if mode.scaled[1] else 1.0, mode.swap)

    def stack_options(self) -> dict:
        readout = "mean" if self.preserve is None else PRESERVE_MODES[self.preserve].readout
        options = dict(self.options, readout=readout)
        if options["anchor_every"] is None:
            options["anchor_every"] = self.default_anchor_every()
        return options

    def default_anchor_every(self) -> int:
        """Float streams' inverse amplifies rounding by 1 / scale per scaled stream and block: anchors
        at least every FLOAT_ANCHOR_BITS of amplification (none for exact or unscaled streams)."""
        if self.preserve is None or self.options["exact"]:
            return 0
        bits_per_block = self.scale_bits * sum(PRESERVE_MODES[self.preserve].scaled)
        return max(1, FLOAT_ANCHOR_BITS // bits_per_block)


# Float streams of a preserving conversion keep anchors so that the inverse amplifies rounding by at
# most 2**8 between them (about 1e-5 relative in float32 gradients; perf/reconstruction.py).
FLOAT_ANCHOR_BITS = 8


class _WholeLayer:
    """The pretrained layer as one half, ``L(x) = mid + M(mid)`` with ``mid = x + A(x)`` (``parallel``:
    ``L(x) = x + A(x) + M(x)``, GPT-NeoX's parallel residual), plus an adapter beside it when given
    (torch epilogue)."""

    def __init__(self, attention, mlp, adapter=None, parallel=False):
        self.attention, self.mlp, self.adapter, self.parallel = attention, mlp, adapter, parallel

    @property
    def takes_cond(self) -> bool:  # the attention half takes the model's layer inputs (NLLB-MoE's MLP too)
        return self.attention.takes_cond or getattr(self.mlp, "takes_cond", False)

    def parameters(self):
        return self.attention.parameters()

    def __call__(self, x, cond=None):
        if self.parallel:
            out = x + half_output(self.attention, x, cond) + half_output(self.mlp, x, cond)
        else:
            mid = x + half_output(self.attention, x, cond)
            out = mid + half_output(self.mlp, mid, cond)
        return out if self.adapter is None else out + self.adapter(x)

    def couple(self, res, x, sign, frac_bits=None, scale=None, cond=None):
        return couple_output(res, self(x, cond), sign, frac_bits, scale)


class _SublayerWithAdapter(_WholeLayer):
    """A sublayer with its skip and an adapter beside it as one half: ``x + A(x) + Ad(x)``."""

    def __init__(self, branch, adapter):
        self.branch, self.adapter = branch, adapter

    @property
    def takes_cond(self) -> bool:
        return self.branch.takes_cond

    def parameters(self):
        return self.branch.parameters()

    def __call__(self, x, cond=None):
        return x + half_output(self.branch, x, cond) + self.adapter(x)


def _add_adapters(block: nn.Module, dim: int, conversion: _Conversion):
    """Register the preserve mode's zero-initialised adapters on a block, on its device and dtype."""
    reference = next(p for p in block.parameters() if p.is_floating_point())
    slots = PRESERVE_MODES[conversion.preserve].adapters
    block.revtriton_adapters = nn.ModuleDict(
        {slot: Adapter(dim, conversion.adapter_size).to(device=reference.device, dtype=reference.dtype)
         for slot in slots})


#: The adapters' module names as PEFT's ``modules_to_save`` takes them (it matches name endings):
#: ``LoraConfig(..., modules_to_save=[*ADAPTER_MODULES])`` trains and saves them with the LoRA weights.
ADAPTER_MODULES = ("revtriton_adapters.f", "revtriton_adapters.g")


def _trains_adapter(name: str) -> bool:
    # PEFT's modules_to_save keeps the wrapped original frozen beside the trained copy.
    return ".revtriton_adapters." in f".{name}" and ".original_module." not in f".{name}."


def train_adapters_only(model: nn.Module) -> nn.Module:
    """Freeze everything but the adapters a preserving ``revify`` added (PEFT-style fine-tuning)."""
    names = [name for name, _ in model.named_parameters() if _trains_adapter(name)]
    if not names:
        raise ValueError("the model has no revtriton adapters: convert it with revify(model, preserve=...) first")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(_trains_adapter(name))
    return model


def active_adapter(module: nn.Module) -> nn.Module:
    """The adapter module a forward runs: itself, or, wrapped by PEFT's ``modules_to_save``
    (a ``ModulesToSaveWrapper``: the original and a trained copy per PEFT adapter), the module the
    wrapper's own forward would run (the active adapter's copy; the original while disabled)."""
    copies = module._modules.get("modules_to_save")
    if copies is None or "original_module" not in module._modules:
        return module
    active = module.active_adapters
    if module.disable_adapters or not active or any(name not in copies for name in active):
        return module.original_module
    return copies[active[0]]


def check_adapters_train(block: nn.Module, adapters: list):
    """Raise when a training forward finds the block's adapters frozen while PEFT layers in it train:
    ``get_peft_model`` after ``revify(preserve=...)`` freezes what PEFT does not own, and the zero
    adapters would stay zero through training, silently."""
    if any(a.up.weight.requires_grad or a.up.bias.requires_grad for a in adapters):
        return
    peft_layers = (m for m in block.modules() if type(m).__module__.startswith("peft."))
    if any(p.requires_grad for m in peft_layers for p in m.parameters()):
        raise RuntimeError(
            f"revtriton: the preserving adapters (revtriton_adapters) of a {type(block).__name__} are frozen while "
            f"its PEFT (LoRA) layers train: get_peft_model, applied after revify(..., preserve=...), freezes every "
            f"module PEFT does not own, so the zero-initialised adapters would never train. Convert the PEFT model "
            f"instead (revify(get_peft_model(model, config), preserve=...)), or name the adapters in the PEFT "
            f"config: LoraConfig(..., modules_to_save=[*revtriton.ADAPTER_MODULES])")
