#!/usr/bin/env bash
# perf/gpu_check.sh OUTDIR [--dry-run]
#
# One call on a GPU machine that has only this repository and its Python packages (no network):
# the GPU tests, autotune warm-up, a short sweep, the kernel microbenchmarks and the PaReprop
# benchmark, within 8 minutes in all. Every output goes under OUTDIR; a short summary table is
# printed last. Without a CUDA device it fails at once (exit 2) with a message.
#
# Runs as it is on a bare GPU machine: `python3` (no `python` needed), the preinstalled torch,
# triton and pytest, the repository not installed (everything imports from this source tree:
# PYTHONPATH is set to it), no network (nothing is downloaded: Hugging Face is forced offline),
# nothing compiled but by Triton's JIT. It checks those requirements first (exit 2 if one fails).
#
#   --dry-run   check and state each requirement (no GPU needed: the device is reported, not
#               required), print the plan (steps, time caps, commands); exit 0, or 1 when a
#               requirement fails
#
# Environment: PYTHON (default: python3), GPU_CHECK_BUDGET_S (default 470: total seconds),
# GPU_CHECK_STEPS (default: all; a comma-separated subset of the step names below, e.g.
# "gpu-tests,kernels": a short lease runs the steps that matter first and the rest in a second call).
set -u

usage() {
    echo "usage: perf/gpu_check.sh OUTDIR [--dry-run]"
    echo "  runs the GPU tests, a short sweep, python -m perf.kernels and the pareprop benchmark"
    echo "  within 8 minutes, writing every output under OUTDIR (needs a CUDA device)"
}

dry_run=0
out=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; usage >&2; exit 2 ;;
        *)
            if [ -n "$out" ]; then echo "gpu_check: one OUTDIR only (got '$out' and '$arg')" >&2; exit 2; fi
            out="$arg" ;;
    esac
done
if [ -z "$out" ]; then usage >&2; exit 2; fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET_S:-470}"
# Compiled kernels, never the interpreter (tests/conftest.py defaults it to 1 when unset).
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1
# The source tree, not an installed copy (there may be none), in this process and every child.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# No network there: never try a download (a hub lookup would hang until its timeout instead).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1

# requirements [--collect]: check and print each requirement; exit 1 if one fails. --collect also
# collects the GPU tests (the dry run: it imports every test module, without a GPU).
requirements() {
    local tool
    for tool in timeout date tail sed; do
        if ! command -v "$tool" > /dev/null 2>&1; then
            echo "  FAIL  $tool: not on PATH (coreutils)"; return 1
        fi
    done
    if ! command -v "$py" > /dev/null 2>&1; then
        echo "  FAIL  python: '$py' is not on PATH (set PYTHON=/path/to/python3)"; return 1
    fi
    (cd "$repo" && "$py" - "$repo" "$out" "$@" <<'EOF'
import importlib.metadata, importlib.util, os, re, subprocess, sys

repo, out, collect = sys.argv[1], sys.argv[2], "--collect" in sys.argv[3:]
failed = []


def say(status, name, detail):
    print(f"  {status:5s} {name}: {detail}", flush=True)
    if status == "FAIL":
        failed.append(name)


# The minimums, read from the source tree without importing the package (its import enforces them).
spec = importlib.util.spec_from_file_location("_revtriton_versions", os.path.join(repo, "revtriton", "_versions.py"))
versions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(versions)
fmt = lambda v: ".".join(map(str, v))  # noqa: E731

py_ok = sys.version_info >= (3, 11)
say("ok" if py_ok else "FAIL", "python", f"{sys.executable}, Python {sys.version.split()[0]} (needs >= 3.11)")
try:
    import torch
    ok = not versions.too_old(torch.__version__, versions.MIN_TORCH)
    say("ok" if ok else "FAIL", "torch", f"{torch.__version__} (needs >= {fmt(versions.MIN_TORCH)}), "
        + (f"CUDA build {torch.version.cuda}" if torch.version.cuda else "a CPU-only build (the run needs CUDA)"))
except Exception as e:  # noqa: BLE001
    torch = None
    say("FAIL", "torch", f"cannot import: {e!r}")
try:
    import triton
    ok = not versions.too_old(triton.__version__, versions.MIN_TRITON)
    say("ok" if ok else "FAIL", "triton", f"{triton.__version__} (needs >= {fmt(versions.MIN_TRITON)})")
except Exception as e:  # noqa: BLE001
    say("FAIL", "triton", f"cannot import: {e!r}")
for name in ("pytest",):
    try:
        say("ok", name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        say("FAIL", name, "not installed")
installed = "the source tree is used"
try:  # metadata outside the tree (a repo-root egg-info from an editable install does not count)
    dist = importlib.metadata.distribution("revtriton")
    home = os.path.abspath(str(dist.locate_file("")))
    if os.path.commonpath([home, repo]) != repo:
        installed += f" (revtriton {dist.version} is also installed, in {home}: not used)"
except importlib.metadata.PackageNotFoundError:
    pass
try:
    import revtriton
    import revtriton.kernels
    import revtriton.ops.fused_attention  # noqa: F401
    import revtriton.ops.fused_mlp  # noqa: F401
    where = [os.path.dirname(revtriton.__file__), list(revtriton.kernels.__path__)[0]]  # kernels/: no __init__.py
    inside = all(os.path.commonpath([w, repo]) == repo for w in where)
    say("ok" if inside else "FAIL", "revtriton", f"imports from {', '.join(where)}; {installed}")
except Exception as e:  # noqa: BLE001
    say("FAIL", "revtriton", f"cannot import from the source tree {repo}: {e!r}")
try:
    import perf.autotune, perf.kernels, perf.sweep  # noqa: E401, F401
    say("ok", "perf", "perf.autotune, perf.kernels, perf.sweep import")
except Exception as e:  # noqa: BLE001
    say("FAIL", "perf", f"cannot import the benchmark modules: {e!r}")
optional = []
for name in ("numpy", "transformers", "timm", "matplotlib", "tqdm"):
    try:
        optional.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        optional.append(f"{name} absent")
say("info", "optional", ", ".join(optional))
say("ok", "network", "none used: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1; nothing is installed")
parent = os.path.abspath(out)
while not os.path.exists(parent):
    parent = os.path.dirname(parent)
say("ok" if os.access(parent, os.W_OK) else "FAIL", "OUTDIR", f"{out} (created under {parent})")
if collect:
    # The files that carry the gpu mark, as the steps run them (importing every test module: about 10 s)
    files = sorted(os.path.join("tests", name) for name in os.listdir(os.path.join(repo, "tests"))
                   if re.fullmatch(r"test_\w+\.py", name)
                   and re.search(r"mark\.gpu", open(os.path.join(repo, "tests", name)).read())) or ["tests"]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    ok = r.returncode in (0, 5) and not re.search(r"\berror", last)
    say("ok" if ok else "FAIL", "gpu tests", f"collect: {last}" + ("" if ok else f" (exit {r.returncode})"))
    for line in [] if ok else [x for x in r.stdout.splitlines() if x.startswith(("ERROR ", "E  "))][:10]:
        print(f"        {line}")
if torch is not None:
    try:
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001
        gpu = None
        print(f"        ({e!r})")
    say("info", "CUDA device", gpu or "none visible (the real run needs one: it exits 2 without)")
sys.exit(1 if failed else 0)
EOF
    )
}

# name | time cap (s) | command (run from the repository root; $OUT is the output folder, $TL the
# sweep's own time limit: the step's cap less 30 s, so it writes its results before the cap)
# The GPU tests compile many kernel variants: with pytest-xdist, Triton's compiles run on 8 processes
# (the timing test runs alone afterwards: it compares two paths' speed and needs a quiet GPU).
if "$py" -c "import xdist" > /dev/null 2>&1; then parallel="-n 8"; else parallel=""; fi
if "$py" -c "import pytest_timeout" > /dev/null 2>&1; then per_test="--timeout 120"; else per_test=""; fi
# Only the test files that carry the gpu mark (collecting every test module imports them all: about 10 s).
gpu_files="$(cd "$repo" && grep -l 'mark\.gpu' tests/test_*.py | tr '\n' ' ')"
gpu_files="${gpu_files:-tests}"
timing_test="test_dispatch_choice_is_at_least_098_of_the_faster_path"
# Every GEMM table config pinned and checked on the compiled path: many compiles, so a step of its own
# after the measurements (the autotuner picks among these configs by speed alone).
configs_test="test_every_gemm_table_config_matches_the_reference_compiled"
steps=(
    "gpu-tests|170|$py -m pytest -m gpu -q --tb=short -rfE -p no:cacheprovider $parallel $per_test -k 'not $timing_test and not $configs_test' --junitxml=\$OUT/gpu-tests.xml $gpu_files; a=\$?; $py -m pytest -m gpu -q -p no:cacheprovider $per_test -k $timing_test --junitxml=\$OUT/gpu-timing-test.xml $gpu_files; b=\$?; [ \$a -eq 0 ] && exit \$b; exit \$a"
    "autotune|60|$py -m perf.autotune --presets vit-b,gpt2 --dtypes bf16"
    "sweep|100|$py -m perf.sweep --suite short --time-limit \$TL --out \$OUT/sweep --tag short --no-progress"
    # issue 35: ViT-B, GPT-2 and LLaMA at depth 12, bf16, every variant eager and then captured in CUDA
    # graphs (revtriton.CapturedStep): step ms against host ms, captured against captured
    "graphs|120|for g in '' --cuda-graphs; do $py -m perf.sweep --presets vit-b,gpt2,llama --depths 12 --batches 8 --dtype bf16 --warmup 2 --repeats 5 --no-max-batch --no-plots --time-limit \$((TL / 2)) --out \$OUT/graphs --tag graphs\${g:+-captured} --no-progress \$g || exit \$?; done"
    "kernels|150|$py -m perf.kernels --out \$OUT/kernels"
    "gemm-configs|60|$py -m pytest -m gpu -q --tb=short -rfE -p no:cacheprovider $parallel $per_test -k $configs_test --junitxml=\$OUT/gemm-configs.xml $gpu_files"
    # issue 18: flash attention forward / backward vs SDPA's flash backend (head dims 64, 128, 80)
    "attention|50|$py -m perf.kernels_attention --cases gpt2,llama-d128,phi-d80 --csv \$OUT/attention.csv"
    "pareprop|80|$py -m perf.sweep --suite pareprop --batches 8,16,32 --no-max-batch --time-limit \$TL --out \$OUT/pareprop --tag pareprop --no-progress"
    # issue 44: the fused halves' host work per launch, the launches stubbed (first calls compile and autotune)
    "launchers|45|$py -m perf.launchers --repeats 100 --json \$OUT/launchers.json"
    # issue 36: the fused linear + cross-entropy against the eager head + loss, 8192 tokens, GPT-2 and LLaMA-3
    # vocabularies; then the model rows' CUDA peaks at 2 x 2048 tokens, with and without token_chunk
    "lm-loss|40|$py -m perf.lm_loss --op --repeats 3 --check --json \$OUT/lm-loss.json && $py -m perf.lm_loss --tokens 2048 --json \$OUT/lm-loss-model.json"
    # issue 19: the dispatcher's measured choice per half (fused Triton, cuBLAS + SDPA, and the attention
    # half's two mixes) and every candidate re-timed; fails when a chosen path is < 0.98 x the fastest.
    # Last: it gets what time is left.
    "dispatch|60|$py -m perf.kernels --dispatch-only --out \$OUT/dispatch"
)

# GPU_CHECK_STEPS: keep the named steps (in the order above); an unknown name is an error.
if [ -n "${GPU_CHECK_STEPS:-}" ]; then
    known=" "
    for step in "${steps[@]}"; do known+="${step%%|*} "; done
    IFS=',' read -r -a wanted <<< "$GPU_CHECK_STEPS"
    for name in "${wanted[@]}"; do
        case "$known" in *" $name "*) ;; *) echo "gpu_check: unknown step '$name' in GPU_CHECK_STEPS (steps:$known)" >&2; exit 2 ;; esac
    done
    kept=()
    for step in "${steps[@]}"; do
        case ",$GPU_CHECK_STEPS," in *",${step%%|*},"*) kept+=("$step") ;; esac
    done
    steps=("${kept[@]}")
fi

if [ "$dry_run" = 1 ]; then
    echo "gpu_check requirements (dry run, checked now):"
    # The GPU tests are collected (every test module imported, about 10 s) when the plan runs them.
    collect=""
    for step in "${steps[@]}"; do
        case "${step%%|*}" in gpu-tests|gemm-configs) collect="--collect" ;; esac
    done
    requirements $collect
    req=$?
    echo "gpu_check plan (dry run): outputs under $out, total budget ${budget} s"
    echo "  0. probe: torch.cuda.is_available() within 60 s, else exit 2"
    i=1
    for step in "${steps[@]}"; do
        IFS='|' read -r name cap cmd <<< "$step"
        cmd="${cmd//\$OUT/$out}"
        echo "  $i. $name (cap ${cap} s): ${cmd//\$TL/$((cap - 30))}  > $out/$name.log"
        i=$((i + 1))
    done
    echo "  then: summary table (step, status, seconds, log)"
    if [ "$req" -ne 0 ]; then echo "gpu_check: a requirement above is not met (FAIL)" >&2; exit 1; fi
    exit 0
fi

start=$(date +%s)
echo "gpu_check requirements:"
if ! requirements; then
    echo "gpu_check: a requirement above is not met (FAIL); 'perf/gpu_check.sh OUTDIR --dry-run' checks them" >&2
    exit 2
fi
probe=$(timeout 60 "$py" -c '
import sys, torch
if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
    sys.exit(3)
print(torch.cuda.get_device_name(0))
' 2>&1)
rc=$?
if [ $rc -ne 0 ]; then
    if [ $rc -eq 124 ]; then probe="the CUDA probe did not answer within 60 s"; fi
    echo "gpu_check: no usable GPU: ${probe##*$'\n'}" >&2
    echo "gpu_check: this script needs a CUDA device; 'perf/gpu_check.sh OUTDIR --dry-run' prints the plan" >&2
    exit 2
fi
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 2; }
out="$(cd "$out" && pwd)"
echo "gpu_check on $probe; outputs in $out"

summary=()
failed=0
cd "$repo" || exit 2
for step in "${steps[@]}"; do
    IFS='|' read -r name cap cmd <<< "$step"
    left=$((budget - ($(date +%s) - start)))
    log="$out/$name.log"
    if [ "$left" -lt 15 ]; then
        summary+=("$name|skipped|0|out of time")
        failed=1
        continue
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    cmd="${cmd//\$OUT/$out}"
    tl=$((cap - 30)); [ "$tl" -lt 10 ] && tl=10
    cmd="${cmd//\$TL/$tl}"
    echo "== $name (cap ${cap} s): $cmd"
    t0=$(date +%s)
    PERF_OUT="$out/$name" timeout --kill-after=10 "$cap" bash -c "$cmd" > "$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - t0))
    case $rc in
        0) status=ok ;;
        5) if [ "$name" = gpu-tests ]; then status="none"; else status="fail(5)"; failed=1; fi ;;
        124|137) status=timeout; failed=1 ;;
        *) status="fail($rc)"; failed=1 ;;
    esac
    tail -n 3 "$log" | sed 's/^/   /'
    summary+=("$name|$status|$secs|$log")
done

# Headline figures from the sweeps (if they wrote results).
"$py" - "$out" <<'EOF' 2>/dev/null || true
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/sweep/*.json") + glob.glob(f"{sys.argv[1]}/pareprop/*.json")):
    doc = json.load(open(path))
    rows = [r for r in doc["rows"] if r["status"] == "ok" and r["rank"] == 0]
    print(f"\n{path} ({doc['device']['name']}, {len(rows)}/{len(doc['rows'])} points ok)")
    for r in rows:
        if r["variant"].startswith("revtriton"):
            figs = [f"{k}={r[k]:.2f}" for k in ("time_vs_vanilla", "mem_vs_vanilla", "speedup_vs_sequential")
                    if r[k] is not None]
            print(f"  {r['preset']:6s} d={r['depth']:<3d} b={r['batch']:<4d} {r['variant']}/{r['halves']}: "
                  f"{r['step_time_ms']:.1f} ms, {r['peak_mem_bytes'] / 2**20:.0f} MiB, {', '.join(figs)}")
EOF

echo
echo "gpu_check summary ($probe, $(($(date +%s) - start)) s):"
printf '%-10s %-10s %7s  %s\n' step status seconds output
for line in "${summary[@]}"; do
    IFS='|' read -r name status secs log <<< "$line"
    printf '%-10s %-10s %7s  %s\n' "$name" "$status" "$secs" "$log"
done
exit $failed
