"""Write tests/data/convert/: a tiny LLaMA and GPT-2 converted by today's code, each as a
`save_pretrained` checkpoint and as a whole-model pickle, with an input and its logits.

Issue 46 (the conversion package): these files are made once, before the conversion code moves, and
tests/test_convert_fixtures.py loads them after every change, so checkpoints and pickles that users
made keep loading. Do not regenerate them to make a failing load pass: that is the bug.

    python tools/make_convert_fixtures.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from revtriton import revify

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "convert"
TINY = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2)


def tiny_llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_key_value_heads=1,
                                      max_position_embeddings=32, **TINY)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    manifest = {"revtriton_commit_note": "made before the conversion package (issue 46 step 2)",
                "torch": torch.__version__, "transformers": transformers.__version__, "models": {}}
    for name, build in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        torch.manual_seed(0)
        model = revify(build()).eval()
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        model.save_pretrained(OUT / f"{name}-checkpoint", safe_serialization=True)
        torch.save(model, OUT / f"{name}-whole.pt")
        torch.save({"ids": ids, "logits": logits}, OUT / f"{name}-expected.pt")
        # The classes the pickle names from revtriton: the conversion package must keep them importable.
        manifest["models"][name] = {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                                    "revtriton_classes": sorted({f"{type(m).__module__}.{type(m).__qualname__}"
                                                                 for m in model.modules()
                                                                 if type(m).__module__.startswith("revtriton")})}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
