#!/usr/bin/env python
"""Conformance sweep: every causal LM, masked LM, sequence and image classifier and conditional
generation class of the installed transformers, built at a tiny size, through ``revify(model, preserve="meft3")`` (``"meft1"`` where
revify names it: post-norm layers, a whole layer a half): either it converts and computes the
library's logits, or revify refuses it by name (TypeError: no family takes it; NotImplementedError:
a feature its halves do not reproduce). Anything else is a crash (the conversion's or the converted
model's forward's), and a converted model off the library's logits is silently wrong: both make the
exit status 1. A converted model whose swapped classes a fresh process cannot find by name (its pickle
would not load there) is listed as unpicklable.

Causal LMs are compared on the library path (without grad, with the cache) and the fused halves
(without the cache); masked LMs on a batch with a padded row (its real tokens' logits), sequence
classifiers on the same batch and image classifiers on pixels, each without grad and with grad (the
engine's recording forward). Conditional generation models (``--kind seq2seq-lm``) as causal LMs: a
seq2seq model on a left-padded source row and its decoder's inputs (every decoder position's logits),
a vision-language model on the same rows as text (its real tokens' logits).

    python tools/conformance.py                          # every *ForCausalLM class
    python tools/conformance.py --kind masked-lm         # every *ForMaskedLM class
    python tools/conformance.py --kind all               # every kind
    python tools/conformance.py LlamaForCausalLM BertForMaskedLM   # some classes (kind by suffix)

CPU only, a few minutes a kind (each model at most --timeout seconds). A class whose tiny config
cannot be built (it needs options this sweep does not set) is listed as not built.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import signal
import sys
import warnings

import torch

# One tiny size for every config that takes these names (each config keeps its other defaults).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, n_embd=64, n_layer=2, n_head=4, d_model=64, n_positions=64, initializer_range=0.3,
            image_size=32, patch_size=8, num_channels=3, num_labels=3,
            dim=64, hidden_dim=96, n_layers=2, n_heads=4,  # (DistilBERT's names)
            # The BART lineage's: num_hidden_layers sizes its encoder, and a causal LM's cache with it
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=96, decoder_ffn_dim=96,
            # Multipliers off their neutral defaults, as real checkpoints have them (granite-3's residual_multiplier
            # 0.22: the probe refused every Granite but the default's 1.0, which the sweep never saw)
            residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.2, logits_scaling=2.0,
            scale_depth=2.0,
            # No layerdrop (which revify refuses by name, a random skip of layers in training): the function compared
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, layerdrop=0.0)
BOUND = 2e-3  # the largest logit difference allowed, relative to the largest logit (meft3 at 2**-16)
KINDS = {"causal-lm": "ForCausalLM", "masked-lm": "ForMaskedLM", "image-classification": "ForImageClassification",
         "sequence-classification": "ForSequenceClassification", "seq2seq-lm": "ForConditionalGeneration"}
_DECODES = ("causal-lm", "seq2seq-lm")  # the kinds compared with the library's cache and without


def kind_of(name: str) -> str:
    for kind, suffix in KINDS.items():
        if name.endswith(suffix):
            return kind
    return "causal-lm"


def _inputs(kind: str) -> tuple[dict, torch.Tensor | None]:
    """The batch of a kind, and the mask of the logits compared (None: all)."""
    if kind == "image-classification":
        return {"pixel_values": torch.randn(2, 3, 32, 32)}, None
    ids = torch.randint(3, 120, (2, 12))
    if kind in ("masked-lm", "sequence-classification"):
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0  # a padded row: its real tokens' logits are compared (a classifier's: the row's)
        if kind == "sequence-classification":  # (decoders classify at the last token that is not padding)
            return {"input_ids": ids.masked_fill(mask == 0, TINY["pad_token_id"]), "attention_mask": mask}, None
        return {"input_ids": ids, "attention_mask": mask}, mask.bool()
    if kind == "seq2seq-lm":  # a left-padded source row; the decoder's inputs (dropped where there is no encoder)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :4] = 0
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, 120, (2, 6))}, None
    return {"input_ids": ids}, None


def _runs(kind: str):
    """(name, keyword arguments, grad) of the converted model's runs compared with the library's."""
    if kind in _DECODES:  # the library's path (decoding with its cache); the fused halves
        return (("with the cache", {"use_cache": True}, False), ("without", {"use_cache": False}, False))
    return (("without grad", {}, False), ("with grad", {}, True))


class _Timeout(Exception):
    pass


def _library_refuses(model, inputs: dict, options: dict) -> bool:
    """Whether the unconverted model's own forward fails with these options too (then the converted
    model's failing is the library's, not the conversion's)."""
    try:
        with torch.no_grad():
            model(**inputs, **options)
    except _Timeout:
        raise
    except Exception:  # noqa: BLE001
        return True
    return False


def _on_alarm(*_):
    raise _Timeout()


# Where TINY does not build (or the library's own forward fails on it), these are tried in turn: a head
# width of the config's own (Cohere's, CodeGen's), a narrower rotary part (GPT-J's rotary_dim), DeepSeek's
# latent attention at the tiny width.
VARIANTS = ({}, {"head_dim": None}, {"rotary_dim": 8}, {"head_dim": None, "rotary_dim": 8},
            {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32})


def _tiny_config(config_class, options: dict):
    """``config_class`` at the tiny size, its sub-configs too (a vision-language model's ``text_config`` /
    ``vision_config``, a classifier's vision tower: each of the class its default config has)."""
    parameters = inspect.signature(config_class.__init__).parameters
    kwargs = {k: v for k, v in options.items() if k in parameters and v is not None}
    subs = [name for name in getattr(config_class, "sub_configs", {}) if name in parameters]
    if subs:
        default = config_class()
        for name in subs:
            sub = getattr(default, name, None)
            if sub is not None and hasattr(sub, "to_dict"):
                kwargs[name] = _tiny_config(type(sub), options)
    return config_class(**kwargs)


def _tiny(cls, variant=None):
    return cls(_tiny_config(cls.config_class, {**TINY, **(variant or {})})).eval()


def check(name: str, timeout: int) -> tuple[str, str]:
    """(verdict, detail): "converted", "refused", "not built", "timeout", or "WRONG" / "CRASH"."""
    import transformers

    from revtriton import revify

    kind = kind_of(name)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout)
    try:
        first_error = None
        for variant in VARIANTS:
            try:
                torch.manual_seed(0)
                model = _tiny(getattr(transformers, name), variant)
                inputs, compared = _inputs(kind)
                if kind == "seq2seq-lm" and not getattr(model.config, "is_encoder_decoder", False):
                    del inputs["decoder_input_ids"]  # (a vision-language model's text-only forward:
                    compared = inputs["attention_mask"].bool()  # its real tokens' logits compared)
                with torch.no_grad():
                    expected = model(**inputs, **({"use_cache": False} if kind in _DECODES else {})).logits
                if compared is not None:
                    expected = expected[compared]
                break
            except _Timeout:
                raise
            except Exception as error:  # noqa: BLE001 (a config this sweep cannot build)
                first_error = first_error or error
        else:
            return "not built", f"{type(first_error).__name__}: {str(first_error)[:80]}"
        converted, mode = None, "meft3"
        while converted is None:
            try:
                converted = revify(copy.deepcopy(model), preserve=mode, scale_bits=16, exact=False).eval()
            except _Timeout:
                raise
            except (TypeError, NotImplementedError) as error:
                if not str(error).startswith("revify"):
                    return "CRASH", f"{type(error).__name__}: {str(error)[:200]}"
                if mode == "meft3" and "preserve='meft1'" in str(error):  # (post-norm layers: a layer a half)
                    mode = "meft1"
                    continue
                return "refused", f"{type(error).__name__}: {str(error)[:100]}"
            except Exception as error:  # noqa: BLE001
                return "CRASH", f"{type(error).__name__}: {str(error)[:200]}"
        errors = []
        for _, options, grad in _runs(kind):
            try:
                with torch.set_grad_enabled(grad):
                    got = converted(**inputs, **options).logits.detach()
            except _Timeout:
                raise
            except Exception as error:  # noqa: BLE001 (converted, but its forward fails)
                if _library_refuses(model, inputs, options):  # (Switch Transformers' encoder refuses use_cache)
                    errors.append(None)
                    continue
                return "CRASH", f"{mode}, the converted model's forward: {type(error).__name__}: {str(error)[:200]}"
            got = got if compared is None else got[compared]
            errors.append(((got - expected).abs().max() / expected.abs().max()).item())
        detail = f"{mode}: logits off by " + ", ".join("(the library's own forward fails) " + run[0] if e is None else
                                                       f"{e:.1e} {run[0]}" for e, run in zip(errors, _runs(kind)))
        measured = [e for e in errors if e is not None]
        if not (measured and max(measured) <= BOUND):
            return "WRONG", detail
        unfound = unfound_class_names(converted)
        return ("unpicklable", f"{detail}; a fresh process cannot find {', '.join(unfound)}") if unfound else \
            ("converted", detail)
    except _Timeout:
        return "timeout", f"over {timeout} s"
    finally:
        signal.alarm(0)


def unfound_class_names(model) -> list:
    """The swapped classes of a converted model that a fresh process could not rebuild from their names
    (revtriton.convert's module ``__getattr__``: a family's pickled table, else a model admitted by its
    layer conventions, resolved by pattern), sorted."""
    from revtriton import convert

    names = {type(m).__qualname__ for m in model.modules() if type(m).__module__ == convert.__name__}
    return sorted(n for n in names if n not in convert._BLOCK_BASES and convert._convention_class(n) is None)


def main(argv=None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="transformers classes (default: every class of --kind)")
    parser.add_argument("--kind", choices=(*KINDS, "all"), default="causal-lm",
                        help="the classes swept without names: *ForCausalLM (default), *ForMaskedLM, "
                             "*ForImageClassification, *ForSequenceClassification, *ForConditionalGeneration "
                             "(seq2seq models; vision-language models text only), or all of them")
    parser.add_argument("--timeout", type=int, default=30, help="seconds a model may take")
    args = parser.parse_args(argv)
    suffixes = tuple(KINDS.values()) if args.kind == "all" else (KINDS[args.kind],)
    names = args.names or sorted(n for n in dir(transformers) if n.endswith(suffixes)
                                 and not n.startswith(("TF", "Flax")))
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    verdicts = {}
    for name in names:
        verdict, detail = check(name, args.timeout)
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
        print(f"{verdict:10} {name}: {detail}", flush=True)
    print(f"transformers {transformers.__version__}: " + ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())))
    return 1 if verdicts.get("WRONG") or verdicts.get("CRASH") else 0


if __name__ == "__main__":
    sys.exit(main())
