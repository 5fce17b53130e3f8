"""Fine-tune a pretrained model after a function-preserving conversion (``revify(model, preserve=...)``).

A small Hugging Face LlamaForCausalLM (``--family gpt2``: GPT2LMHeadModel; random initial
weights, nothing downloaded, byte vocabulary 256) is first trained with plain autograd on the
Python standard library's top-level modules (``stdlib/*.py``, code): the "pretrained" model.
Then, for each conversion, a copy of it is converted and fine-tuned on another distribution,
``pydoc_data/topics.py`` (the interpreter's help text: English prose with examples), with the
same batches, optimizer, learning rate and seed:

* ``original``: the unconverted model (stored activations, plain autograd), the reference;
* ``none``: ``revify(model)``, the two-stream coupling of each block's halves (the function changes);
* ``meft1``, ``meft2``, ``meft3``: ``revify(model, preserve=...)``, scaled couplings with the
  pretrained layer as one half and zero-initialised adapters (the function is kept).

Printed for each: the validation loss right after conversion (on the pretraining data and on
the new data), after fine-tuning, and the ratio to the original's at the same point.

    python examples/finetune_pretrained.py                    # LLaMA, exact streams: a few min on one core
    python examples/finetune_pretrained.py --family gpt2      # GPT-2
    python examples/finetune_pretrained.py --adapters-only    # MEFT variants train their adapters only
    python examples/finetune_pretrained.py --float-streams    # exact=False
    python examples/finetune_pretrained.py --plot curves.png  # the fine-tuning curves
    python examples/finetune_pretrained.py --smoke            # a few small steps (used by the tests)
"""
from __future__ import annotations

import argparse
import copy
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loss_curves import trailing_mean  # examples/
from train_lm import get_batch, stdlib_text  # examples/
from revtriton import revify, train_adapters_only
from revtriton.models import count_parameters
from revtriton.profiling import saved_bytes

VARIANTS = ("original", "none", "meft1", "meft2", "meft3")
# The fine-tuning data: the first of these (relative to the standard library) that exists.
FINETUNE_SOURCES = ("pydoc_data/topics.py", "email/**/*.py", "json/*.py")


def finetune_text(max_bytes: int) -> tuple[str, bytes]:
    """(what it is, bytes) of a part of the standard library unlike its top-level modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for pattern in FINETUNE_SOURCES:
        paths = sorted(root.glob(pattern))
        if paths:
            data = b"\n".join(path.read_bytes() for path in paths)[:max_bytes]
            if data:
                return f"{root}/{pattern}", data
    raise RuntimeError(f"none of {FINETUNE_SOURCES} found under {root}")


def as_tensor(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors: the last 10% is the validation part."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(0.9 * tokens.numel())
    return tokens[:split], tokens[split:]


def build(args):
    """The model to pretrain, from a random-init config (no download)."""
    torch.manual_seed(args.seed)
    if args.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.dim, n_layer=args.depth,
                            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=3 * args.dim,
                         num_hidden_layers=args.depth, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return LlamaForCausalLM(config)


def lm_loss(model, x, y):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def train(model, data, steps, lr, args, desc, seed_offset):
    """AdamW with a linear warm-up, then constant; batch i is the same for every model."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses, elapsed = [], 0.0
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=args.no_bar, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / args.warmup)
        x, y = get_batch(data, args.batch, args.seq, seed=seed_offset + args.seed * 100_000 + step)
        start = time.perf_counter()
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step > 0:  # step 0 pays one-time start-up costs
            elapsed += time.perf_counter() - start
        losses.append(loss.item())
        if args.no_bar and (step % 50 == 0 or step == steps - 1):
            print(f"{desc} step {step}: loss {losses[-1]:.4f}", flush=True)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses, elapsed / max(1, steps - 1)


@torch.no_grad()
def evaluate(model, data, args):
    """Mean loss over ``args.eval_batches`` fixed validation batches."""
    model.eval()
    total = sum(lm_loss(model, *get_batch(data, args.batch, args.seq, seed=10**9 + i)).item()
                for i in range(args.eval_batches))
    model.train()
    return total / args.eval_batches


def convert(pretrained, variant, args):
    """A deep copy of the pretrained model, converted (or not, for ``original``)."""
    model = copy.deepcopy(pretrained)
    torch.manual_seed(args.seed + 1)  # the same adapter draws for every preserving variant
    if variant == "original":
        return model
    preserve = None if variant == "none" else variant
    options = dict(exact=not args.float_streams, anchor_every=args.anchor_every, preserve=preserve)
    if preserve is not None:
        options.update(scale_bits=args.scale_bits, adapter_size=args.adapter_size, ordinary_top=args.ordinary_top)
    revify(model, **options)
    if preserve is not None and args.adapters_only:
        train_adapters_only(model)
    return model


def kept_bytes(model, data, args):
    """Bytes one training forward keeps for backward (parameters excluded)."""
    x, y = get_batch(data, args.batch, args.seq, seed=123_456_789)
    kept = saved_bytes(lambda: lm_loss(model, x, y), module=model)
    model.zero_grad(set_to_none=True)
    return kept


def plot(curves, window, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, losses), color in zip(curves.items(), ("black", "tab:red", "tab:blue", "tab:orange", "tab:green")):
        ax.plot(losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(trailing_mean(losses, window), color=color, label=f"{name} (mean of {window})",
                linestyle="-" if name == "original" else "--")
    ax.set(xlabel="fine-tuning step", ylabel="training loss", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"fine-tuning curves written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama",
                        help="the Hugging Face model: LlamaForCausalLM or GPT2LMHeadModel")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (original is always run)")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="steps of the plain-autograd pretraining")
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences a batch")
    parser.add_argument("--seq", type=int, default=96, help="bytes a sequence (the context length)")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--depth", type=int, default=6, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (LLaMA: half as many key / value heads)")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3, help="pretraining learning rate")
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate (every variant)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="steps of linear learning-rate warm-up (pretraining and fine-tuning)")
    parser.add_argument("--float-streams", action="store_true", help="exact=False (default: exact int32 streams)")
    parser.add_argument("--scale-bits", type=int, default=6, help="coupling scale 2**-scale_bits (preserving variants)")
    parser.add_argument("--adapter-size", type=int, default=64,
                        help="hidden width of the preserving variants' adapters")
    parser.add_argument("--ordinary-top", type=int, default=0, help="top blocks left ordinary (preserving variants)")
    parser.add_argument("--anchor-every", type=int, default=None,
                        help="default: revify's (none for exact streams; float preserving conversions anchor)")
    parser.add_argument("--adapters-only", action="store_true",
                        help="the preserving variants train their adapters only (train_adapters_only); "
                             "original and none train everything")
    parser.add_argument("--data-bytes", type=int, default=2_000_000, help="bytes of each corpus")
    parser.add_argument("--eval-batches", type=int, default=8, help="fixed validation batches a loss is averaged over")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and batches (every variant gets the same)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: no oversubscription on a busy machine; 0: torch's default)")
    parser.add_argument("--window", type=int, default=0, help="steps in the plotted trailing mean (0: steps / 15)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the fine-tuning curves to this image")
    parser.add_argument("--no-bar", action="store_true", help="no progress bar: a line every 50 steps instead")
    parser.add_argument("--smoke", action="store_true", help="a few small steps (tests)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.pretrain_steps, args.steps, args.batch, args.seq, args.depth, args.dim = 4, 3, 2, 32, 2, 64
        args.warmup, args.eval_batches, args.data_bytes, args.adapter_size = 2, 2, 100_000, 16
    variants = ["original"] + [v for v in args.variants.split(",") if v and v != "original"]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")

    pre_train, pre_val = as_tensor(stdlib_text(args.data_bytes))
    ft_name, ft_bytes = finetune_text(args.data_bytes)
    ft_train, ft_val = as_tensor(ft_bytes)
    streams = "float" if args.float_streams else "exact"
    print(f"pretraining data: {pre_train.numel() + pre_val.numel():,} bytes of {sysconfig.get_paths()['stdlib']}/*.py; "
          f"fine-tuning data: {len(ft_bytes):,} bytes of {ft_name}")
    pretrained = build(args)
    anchors = "default" if args.anchor_every is None else args.anchor_every
    print(f"model: {type(pretrained).__name__}, {count_parameters(pretrained):,} parameters, {args.depth} blocks, "
          f"dim {args.dim}, batch {args.batch} x {args.seq} bytes; conversions: {streams} streams, scale 2**-"
          f"{args.scale_bits}, adapters of {args.adapter_size}, ordinary_top {args.ordinary_top}, anchor_every "
          f"{anchors}{', adapters only' if args.adapters_only else ''}; torch threads: {torch.get_num_threads()}")

    losses, _ = train(pretrained, pre_train, args.pretrain_steps, args.pretrain_lr, args, "pretraining", 0)
    print(f"pretrained {args.pretrain_steps} steps: training loss {losses[-1]:.4f}, validation loss "
          f"{evaluate(pretrained, pre_val, args):.4f} (pretraining data), {evaluate(pretrained, ft_val, args):.4f} "
          f"(fine-tuning data)")

    results, curves = {}, {}
    for variant in variants:
        model = convert(pretrained, variant, args)
        row = dict(trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   pre_at=evaluate(model, pre_val, args), ft_at=evaluate(model, ft_val, args))
        print(f"{variant}: right after conversion, validation loss {row['pre_at']:.4f} (pretraining data), "
              f"{row['ft_at']:.4f} (fine-tuning data)", flush=True)
        curves[variant], row["s_step"] = train(model, ft_train, args.steps, args.lr, args, f"fine-tune {variant}",
                                               seed_offset=50_000_000)
        row["ft_end"], row["pre_end"] = evaluate(model, ft_val, args), evaluate(model, pre_val, args)
        row["kept"] = kept_bytes(model, ft_train, args)
        results[variant] = row
        del model

    ref = results["original"]
    print(f"\nvalidation loss (fine-tuning data unless marked 'pretrain'); ratio = variant / original at the same "
          f"point; {args.steps} fine-tuning steps, lr {args.lr}")
    header = (f"{'variant':<9} {'trainable':>10} {'pretrain@conv':>13} {'ratio':>6} {'new@conv':>9} {'ratio':>6} "
              f"{'new@end':>8} {'ratio':>6} {'pretrain@end':>12} {'s/step':>7} {'kept MiB':>9}")
    print(header)
    for variant, r in results.items():
        print(f"{variant:<9} {r['trainable']:>10,} {r['pre_at']:>13.4f} {r['pre_at'] / ref['pre_at']:>6.3f} "
              f"{r['ft_at']:>9.4f} {r['ft_at'] / ref['ft_at']:>6.3f} {r['ft_end']:>8.4f} "
              f"{r['ft_end'] / ref['ft_end']:>6.3f} {r['pre_end']:>12.4f} {r['s_step']:>7.3f} "
              f"{r['kept'] / 2**20:>9.2f}")
    if not all(math.isfinite(r["ft_end"]) for r in results.values()):
        print("a fine-tuned variant has a non-finite loss")
        return 1
    if args.plot:
        window = args.window or max(1, args.steps // 15)
        plot(curves, window, args.plot, f"{args.family}: fine-tuning after conversion ({streams} streams)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
