#!/usr/bin/env bash
# perf/gpu_check.sh OUTDIR [--dry-run]
#
# One call on a GPU machine that has only this repository and its Python packages (no network):
# the GPU tests, autotune warm-up, a short sweep, the kernel microbenchmarks and the PaReprop
# benchmark, within 8 minutes in all. Every output goes under OUTDIR; a short summary table is
# printed last. Without a CUDA device it fails at once (exit 2) with a message.
#
#   --dry-run   print the plan (steps, time caps, commands) and exit 0; needs no GPU
#
# Environment: PYTHON (default: python), GPU_CHECK_BUDGET_S (default 470: total seconds).
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
py="${PYTHON:-python}"
budget="${GPU_CHECK_BUDGET_S:-470}"
# Compiled kernels, never the interpreter (tests/conftest.py defaults it to 1 when unset).
export TRITON_INTERPRET=0
export PYTHONUNBUFFERED=1

# name | time cap (s) | command (run from the repository root; $OUT is the output folder, $TL the
# sweep's own time limit: the step's cap less 30 s, so it writes its results before the cap)
steps=(
    "gpu-tests|110|$py -m pytest -m gpu -q -p no:cacheprovider --junitxml=\$OUT/gpu-tests.xml tests"
    "autotune|60|$py -m perf.autotune --presets vit-b,gpt2 --dtypes bf16"
    "sweep|100|$py -m perf.sweep --suite short --time-limit \$TL --out \$OUT/sweep --tag short --no-progress"
    "kernels|80|$py -m perf.kernels --out \$OUT/kernels"
    "pareprop|100|$py -m perf.sweep --suite pareprop --batches 8,16,32 --no-max-batch --time-limit \$TL --out \$OUT/pareprop --tag pareprop --no-progress"
)

if [ "$dry_run" = 1 ]; then
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
    exit 0
fi

start=$(date +%s)
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
