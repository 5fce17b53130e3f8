"""perf/: sweeps of memory and speed per device, for the presets or your own model
(``python -m perf.sweep``), the engine benchmark (``python -m perf.engine_bench``), autotune warm-up
(``python -m perf.autotune``) and the one-call GPU check (``perf/gpu_check.sh OUTDIR``). Installed,
it is ``revtriton.perf``: ``revtriton-perf COMMAND`` or ``python -m revtriton.perf COMMAND``.
See perf/README.md."""
