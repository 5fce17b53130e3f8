#!/usr/bin/env python
"""Conformance sweep: every causal LM class of the installed transformers, built at a tiny size,
through ``revify(model, preserve="meft3")``: either it converts and computes the library's logits
(the library path without grad and with the cache, the fused kernels without the cache), or revify
refuses it by name (TypeError: no family takes it; NotImplementedError: a feature its halves do
not reproduce). Anything else is a crash, and a converted model off the library's logits is
silently wrong: both make the exit status 1.

    python tools/conformance.py                    # every *ForCausalLM class
    python tools/conformance.py LlamaForCausalLM   # some of them

CPU only, a few minutes for all of them (each model at most --timeout seconds). A class whose tiny
config cannot be built (it needs options this sweep does not set) is listed as not built.
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
            eos_token_id=2, n_embd=64, n_layer=2, n_head=4, d_model=64, n_positions=64, initializer_range=0.3)
BOUND = 2e-3  # the largest logit difference allowed, relative to the largest logit (meft3 at 2**-16)


class _Timeout(Exception):
    pass


def _on_alarm(*_):
    raise _Timeout()


def _tiny(cls):
    config_class = cls.config_class
    parameters = inspect.signature(config_class.__init__).parameters
    return cls(config_class(**{k: v for k, v in TINY.items() if k in parameters})).eval()


def check(name: str, timeout: int) -> tuple[str, str]:
    """(verdict, detail): "converted", "refused", "not built", "timeout", or "WRONG" / "CRASH"."""
    import transformers

    from revtriton import revify

    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout)
    try:
        try:
            torch.manual_seed(0)
            model = _tiny(getattr(transformers, name))
            ids = torch.randint(3, 120, (2, 12))
            with torch.no_grad():
                expected = model(input_ids=ids, use_cache=False).logits
        except _Timeout:
            raise
        except Exception as error:  # noqa: BLE001 (a config this sweep cannot build)
            return "not built", f"{type(error).__name__}: {str(error)[:80]}"
        try:
            converted = revify(copy.deepcopy(model), preserve="meft3", scale_bits=16, exact=False).eval()
        except (TypeError, NotImplementedError) as error:
            if str(error).startswith("revify"):
                return "refused", f"{type(error).__name__}: {str(error)[:100]}"
            return "CRASH", f"{type(error).__name__}: {str(error)[:200]}"
        except Exception as error:  # noqa: BLE001
            return "CRASH", f"{type(error).__name__}: {str(error)[:200]}"
        errors = []
        for cache in (True, False):  # the library's path (decoding with its cache); the fused halves
            with torch.no_grad():
                got = converted(input_ids=ids, use_cache=cache).logits
            errors.append(((got - expected).abs().max() / expected.abs().max()).item())
        detail = f"logits off by {errors[0]:.1e} with the cache, {errors[1]:.1e} without"
        return ("converted" if max(errors) <= BOUND else "WRONG"), detail
    except _Timeout:
        return "timeout", f"over {timeout} s"
    finally:
        signal.alarm(0)


def main(argv=None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="transformers classes (default: every *ForCausalLM)")
    parser.add_argument("--timeout", type=int, default=30, help="seconds a model may take")
    args = parser.parse_args(argv)
    names = args.names or sorted(n for n in dir(transformers) if n.endswith("ForCausalLM")
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
