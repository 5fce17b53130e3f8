"""``revtriton-perf COMMAND [options]``, ``python -m revtriton.perf COMMAND`` (installed) or
``python -m perf COMMAND`` (a checkout): the perf/ tools by name; ``COMMAND --help`` for each."""
from __future__ import annotations

import importlib
import sys

# command: (module, what it does)
COMMANDS = {
    "sweep": ("sweep", "memory and speed sweeps of the presets or your own model (the default command)"),
    "autotune": ("autotune", "warm Triton's autotune cache for the presets' or your model's shapes (GPU)"),
    "engine-bench": ("engine_bench", "the engine's CPU benchmark against plain autograd, checkpointing and RevTorch"),
    "launchers": ("launchers", "the fused halves' host work per Triton launch, the launches stubbed"),
    "lm-loss": ("lm_loss", "the fused linear + cross-entropy against the full-logits loss (memory, time)"),
    "kernels": ("kernels", "per-kernel microbenchmarks (GPU)"),
    "kernels-attention": ("kernels_attention", "flash attention and the fused attention block (GPU)"),
    "reconstruction": ("reconstruction", "inverse error vs depth of scaled (MEFT) couplings, float vs exact (CPU)"),
    "roofline": ("roofline", "roofline per production shape, half and phase (arithmetic, no GPU)"),
    "static": ("static", "static GPU performance model: compiles every launch for sm_90 / sm_80 (no GPU)"),
}


def usage(prog: str) -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {prog} COMMAND [options]   ({prog} COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:{width}s}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", f"Without a command (or starting with an option) it runs the sweep: {prog} --quick"]
    return "\n".join(lines)


def main(argv=None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or ("revtriton-perf" if __package__ == "revtriton.perf" and sys.argv[0].endswith("revtriton-perf")
                    else f"python -m {__package__ or 'perf'}")
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage(prog))
        return 0
    command = "sweep" if not argv or argv[0].startswith("-") else argv.pop(0)
    command = command.replace("_", "-")
    if command not in COMMANDS:
        print(f"{prog}: unknown command {command!r}\n\n{usage(prog)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__ or 'perf'}.{COMMANDS[command][0]}")
    return int(module.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
