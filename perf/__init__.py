"""perf/: sweeps of memory and speed per device (``python -m perf.sweep``), the engine benchmark
(``python -m perf.engine_bench``), autotune warm-up (``python -m perf.autotune``) and the one-call
GPU check (``perf/gpu_check.sh OUTDIR``). See perf/README.md."""
