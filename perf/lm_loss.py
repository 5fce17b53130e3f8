"""``python -m perf.lm_loss``: the LM head's memory and time with and without the fused loss (issue 36).

Two parts, each printing the fused chunked linear + cross-entropy beside the full-logits loss:

* model rows: ``rev_causal_lm(preset, depth)`` (a revified Hugging Face LM), one training step at
  each ``--tokens`` (batch ``--batch``), the same model with ``revtriton_fused_loss`` on and off.
  Peak memory of the step with the parameters' ``.grad`` buffers already there (as perf.engine_bench
  measures it), twice: the whole peak, and the peak past parameter gradients, which leaves out
  the buffers of a parameter's shape and dtype (its gradient contributions: a tied head's weight
  gets two of ``vocab x dim``, the head's and the embedding's, whatever the loss); both against
  the float32 logits' size (tokens x vocab x 4 bytes). CPU: live tensor bytes (LiveBytes); CUDA:
  the allocator's peak (whole only).
* op rows (``--op``): the loss alone, hidden [tokens, dim] and head weight [vocab, dim] in
  ``--dtype``, at GPT-2's and LLaMA-3's vocabularies: step time (forward + backward) and peak.

A third model row runs the stack without a head (its last hidden states' sum as the loss): the
peak a head cannot go below, one block's rebuild and backward (perf.engine_bench's one-block
bound), which grows with the tokens as the logits do. The fused and headless rows run again with
the stack's ``token_chunk`` at ``--token-chunk`` rows (``ReversibleStack(token_chunk=)``: the MLP
halves by chunks of that many token rows, the attention by whole samples and a sample longer than
that in head groups, so the largest activations of a block's rebuild and backward stay chunk-sized).

Bars (issue 36, model rows, CPU): fused peak past parameter gradients <= 0.5x the logits at 2 x 256
tokens and <= 0.15x at 2 x 2048, judged on the fused row with ``--token-chunk`` (without one when it
is 0; ``--check`` exits 1 when one is missed); op rows on a GPU: fused time <= the eager head +
cross-entropy's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from revtriton.ops.linear_cross_entropy import linear_cross_entropy
from revtriton.profiling import LiveBytes, peak_memory

MIB = 2**20
BARS = {256: 0.5, 2048: 0.15}  # tokens a row -> fused peak past parameter gradients / logits bytes
OP_VOCABS = {"gpt2": 50257, "llama3": 128256}


class BytesPastParameterGradients(LiveBytes):
    """LiveBytes leaving out buffers of a trainable parameter's shape and dtype (its gradients)."""

    def __init__(self, model, device="cpu"):
        super().__init__(device)
        self.parameter_kinds = {(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad}

    def _outputs(self, out):
        return [t for t in super()._outputs(out) if (tuple(t.shape), t.dtype) not in self.parameter_kinds]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m perf.lm_loss", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2", help="rev_causal_lm preset of the model rows (default: gpt2)")
    ap.add_argument("--depth", type=int, default=2, help="blocks of the model rows (default: 2)")
    ap.add_argument("--batch", type=int, default=2, help="rows a batch (default: 2)")
    ap.add_argument("--tokens", default="256,2048", help="tokens a row, comma-separated (default: 256,2048)")
    ap.add_argument("--token-chunk", type=int, default=256,
                    help="the stack's token_chunk in the chunked rows (default: 256; 0: no such rows)")
    ap.add_argument("--op", action="store_true", help="the op rows instead (the loss alone, GPT-2 and LLaMA-3 "
                                                      "vocabularies)")
    ap.add_argument("--op-tokens", type=int, default=8192, help="tokens of the op rows (default: 8192)")
    ap.add_argument("--op-dim", type=int, default=4096, help="hidden width of the op rows (default: 4096)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="op rows' dtype")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of the op rows (default: 5)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return args


def model_rows(args) -> list[dict]:
    from revtriton import ReversibleStack
    from revtriton.models.hf import rev_causal_lm

    torch.manual_seed(0)
    # positions for the longest row (GPT-2 has 1024 learned ones)
    model = rev_causal_lm(args.preset, depth=args.depth, block_size=max(args.tokens)).to(args.device).train()
    stack = next(m for m in model.modules() if isinstance(m, ReversibleStack))
    vocab = model.config.vocab_size
    chunk = args.token_chunk or None
    # fused None: no head, the stack's own peak (the bound a head can reach); then the MLP halves by chunks
    variants = [(False, None), (True, None), (None, None)] + ([(True, chunk), (None, chunk)] if chunk else [])
    rows = []
    for tokens in args.tokens:
        ids = torch.randint(0, vocab, (args.batch, tokens), device=args.device)
        for fused, token_chunk in variants:
            model.revtriton_fused_loss = bool(fused)
            stack.token_chunk = token_chunk

            def step():
                model.zero_grad(set_to_none=False)  # the .grad buffers stay: the peak is the step's own
                if fused is None:
                    hidden = model.base_model(input_ids=ids).last_hidden_state
                    hidden.backward(torch.ones_like(hidden))
                else:
                    model(input_ids=ids, labels=ids).loss.backward()

            step()
            start = time.perf_counter()
            whole = peak_memory(step, args.device)
            seconds = time.perf_counter() - start
            past = None
            if args.device.type == "cpu":
                with BytesPastParameterGradients(model) as meter:
                    step()
                past = meter.peak
            rows.append(dict(tokens=tokens, fused=fused, token_chunk=token_chunk,
                             logits_bytes=args.batch * tokens * vocab * 4,
                             peak_bytes=whole, peak_past_parameter_gradients_bytes=past, step_s=seconds))
    return rows


def model_report(rows, args) -> tuple[str, bool]:
    lines = [f"model rows: rev_causal_lm({args.preset!r}, depth={args.depth}), batch {args.batch}, one training "
             f"step on {args.device} (.grad buffers kept)", "",
             "| tokens a row | loss | fp32 logits MiB | peak MiB | / logits | peak past param grads MiB | / logits "
             "| step s |", "|---|---|---|---|---|---|---|---|"]
    ok = True
    for r in rows:
        logits = r["logits_bytes"]
        past = r["peak_past_parameter_gradients_bytes"]
        loss = {False: "full logits", True: "fused", None: "no head (the stack alone)"}[r["fused"]]
        if r.get("token_chunk"):
            loss += f", token_chunk {r['token_chunk']}"
        lines.append(f"| {r['tokens']} | {loss} | {logits / MIB:.1f} "
                     f"| {r['peak_bytes'] / MIB:.1f} | {r['peak_bytes'] / logits:.2f}x "
                     f"| {'-' if past is None else f'{past / MIB:.1f}'} "
                     f"| {'-' if past is None else f'{past / logits:.3f}x'} | {r['step_s']:.2f} |")
    lines.append("")
    judged = args.token_chunk or None  # the bar's row: the fused loss, with token_chunk when asked
    for r in rows:
        bar = BARS.get(r["tokens"])
        if r["fused"] and r["token_chunk"] == judged and bar is not None and (
                r["peak_past_parameter_gradients_bytes"] is not None):
            ratio = r["peak_past_parameter_gradients_bytes"] / r["logits_bytes"]
            stack = next(s["peak_past_parameter_gradients_bytes"] for s in rows
                         if s["tokens"] == r["tokens"] and s["fused"] is None and s["token_chunk"] == judged)
            held = ratio <= bar
            ok &= held
            lines.append(f"{r['tokens']} tokens a row: fused peak past parameter gradients {ratio:.3f}x <= {bar}x "
                         f"the logits: {'PASS' if held else 'MISS'} (the stack alone: {stack / r['logits_bytes']:.3f}x; "
                         f"the head adds {(r['peak_past_parameter_gradients_bytes'] - stack) / MIB:.1f} MiB to it)")
    return "\n".join(lines), ok


def op_rows(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, vocab in OP_VOCABS.items():
        torch.manual_seed(0)
        hidden = torch.randn(args.op_tokens, args.op_dim, device=args.device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(vocab, args.op_dim, device=args.device, dtype=dtype) * 0.02).requires_grad_()
        labels = torch.randint(0, vocab, (args.op_tokens,), device=args.device)
        weight.grad = torch.zeros_like(weight)

        def eager():
            F.cross_entropy(F.linear(hidden, weight).float(), labels).backward()

        def fused():
            linear_cross_entropy(hidden, weight, labels).backward()

        for label, step in (("eager head + cross-entropy", eager), ("fused", fused)):
            step()
            times = []
            for _ in range(args.repeats):
                if args.device.type == "cuda":
                    torch.cuda.synchronize(args.device)
                start = time.perf_counter()
                step()
                if args.device.type == "cuda":
                    torch.cuda.synchronize(args.device)
                times.append(time.perf_counter() - start)
            rows.append(dict(vocab_name=name, vocab=vocab, variant=label, step_ms=1e3 * sorted(times)[len(times) // 2],
                             peak_bytes=peak_memory(step, args.device) - weight.numel() * weight.element_size(),
                             logits_bytes=args.op_tokens * vocab * 4))
    return rows


def op_report(rows, args) -> tuple[str, bool]:
    lines = [f"op rows: {args.op_tokens} tokens, dim {args.op_dim}, {args.dtype}, on {args.device}; medians of "
             f"{args.repeats} steps; peak minus the weight's gradient", "",
             "| vocabulary | variant | step ms | peak MiB | / fp32 logits |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vocab_name']} ({r['vocab']}) | {r['variant']} | {r['step_ms']:.1f} "
                     f"| {r['peak_bytes'] / MIB:.1f} | {r['peak_bytes'] / r['logits_bytes']:.3f}x |")
    ok = True
    if args.device.type == "cuda":
        lines.append("")
        for name in OP_VOCABS:
            eager, fused = (next(r for r in rows if r["vocab_name"] == name and r["variant"] == v)
                            for v in ("eager head + cross-entropy", "fused"))
            held = fused["step_ms"] <= eager["step_ms"]
            ok &= held
            lines.append(f"{name}: fused {fused['step_ms']:.1f} ms <= eager {eager['step_ms']:.1f} ms: "
                         f"{'PASS' if held else 'MISS'}")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = op_rows(args) if args.op else model_rows(args)
    text, ok = (op_report if args.op else model_report)(rows, args)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "torch_version": torch.__version__, "rows": rows},
                                        indent=1) + "\n")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
