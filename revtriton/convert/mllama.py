"""Mllama's vision tower (Llama 3.2 Vision: ``MllamaVisionModel``, the ``vision_model`` of
``MllamaForConditionalGeneration``, found as its part): two encoders of pre-norm layers over every
tile's patches, ``transformer`` (``x + attn(input_layernorm(x))``, then ``h + mlp(post_attention_layernorm(h))``)
and ``global_transformer`` (the same layers gated: each branch times ``tanh`` of a learned scalar,
``gate_attn`` and ``gate_ffn``, trained with the rest). Both are ``MllamaVisionEncoder`` loops over
``layers``, handing every layer the tiles' attention mask; both halves run the layer's own modules.

The tower reads some of the first encoder's layers' outputs besides its last one's
(``config.intermediate_layers_indices``, concatenated to the tower's output), so that stack runs in
segments ending at those layers (the host's ``_read_layers``), each a reversible stack of its own on the
streams the previous one left. The loop returns every layer's output as its ``hidden_states``: a
converted one gives the read layers' and the last one's, None for the others, which the stack does not
keep (a None fails where it is read; a stale tensor would not)."""
from __future__ import annotations

from .core import Family, _host_block_mixins, _LibraryHalf, _pickled_host_classes
from .host import _blocks, _convert_library_tower, _first, _HostTowerModel, _LibraryAttentionHalf

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class _MllamaAttentionHalf(_LibraryAttentionHalf):
    def _library_call(self, x, host, extra):
        b = self.block
        x = self._input(x, b.input_layernorm.weight)
        out = _first(b.self_attn(b.input_layernorm(x), attention_mask=host.mask_for(b)))
        return b.gate_attn.tanh() * out if b.is_gated else out


class _MllamaMlpHalf(_LibraryHalf):
    def _modules(self, x):
        b = self.block
        out = b.mlp(b.post_attention_layernorm(self._input(x, b.post_attention_layernorm.weight)))
        return b.gate_ffn.tanh() * out if b.is_gated else out


_HostMllamaBlock, _HostMllamaOrdinaryBlock = _host_block_mixins((_MllamaAttentionHalf, _MllamaMlpHalf))


class _HostMllamaVisionEncoder(_HostTowerModel):
    """MllamaVisionEncoder (either of the tower's loops): the tiles' mask made by the tower; the layers the
    tower reads (``_revtriton_reads``, set at conversion on the first encoder) end segments."""

    _revtriton_reads = ()

    def _read_layers(self, kwargs) -> tuple:
        return self._revtriton_reads

    def forward(self, *args, **kwargs):
        # The loop returns its layers' outputs whatever output_hidden_states says (and not the embeddings
        # first, as the host's hidden states would give them): the stack gives the outputs it has.
        out = super().forward(*args, **{**kwargs, "output_hidden_states": False})
        last, kept = len(_blocks(self.layers)) - 1, set(self._revtriton_reads)
        out["hidden_states"] = tuple(h if i in kept or i == last else None for i, h in enumerate(out.hidden_states))
        return out


def _convert_mllama(model, conversion, found=None):
    # (a read past the encoder's layers fails in the tower's forward as the library's does: its loop returns no
    # state there)
    depth = len(model.transformer.layers)
    reads = tuple(sorted({int(i) for i in model.intermediate_layers_indices} & set(range(depth))))
    for encoder in (model.transformer, model.global_transformer):
        _convert_library_tower(model, encoder, "layers", _LAYER_PARTS, conversion,
                               (_HostMllamaBlock, _HostMllamaOrdinaryBlock), _HostMllamaVisionEncoder)
    model.transformer._revtriton_reads = reads


_MODULE = "transformers.models.mllama.modeling_mllama"
FAMILY = Family("mllama", ("transformers MllamaVisionModel: Llama 3.2 Vision's tower, both its encoders (the "
                           "global one's gated branches; the first one's intermediate layers read)",),
                _convert_mllama, halves="library", classes=(("transformers", "MllamaVisionModel"),),
                pickled=_pickled_host_classes(_MODULE, "MllamaVisionEncoderLayer", (_HostMllamaBlock,
                                                                                    _HostMllamaOrdinaryBlock),
                                              "MllamaVisionEncoder", _HostMllamaVisionEncoder))
