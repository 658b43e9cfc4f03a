#!/usr/bin/env bash
# The GPU check (docs/performance.md#on-a-gpu) as one call of at most seven minutes, so that a short lease of a GPU
# machine leaves room to start one again and rerun the engine after a fix: chatq's engine first, then transformers'
# baseline (bench/hf_baseline.py) for the time left. Each script writes its results under $OUT as it goes, so a run
# cut short still returns what it measured.
#
#     bash bench/gpu.sh [BASELINE]     # BASELINE defaults to bench/hf_baseline.py
#     ENGINE_S=300 BASELINE_S=120      # each script's limit in seconds; BASELINE_S=0 runs the engine alone
set -u
baseline=${1:-bench/hf_baseline.py}
engine_s=${ENGINE_S:-300}
baseline_s=${BASELINE_S:-120}
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
echo "C compiler for Triton's launcher: $(command -v cc gcc | head -1)"
timeout "$engine_s" python3 bench/gpu_engine.py 2>&1 | tee "$OUT/gpu_engine.log"
if [ "$baseline_s" -gt 0 ]; then
    # The baseline reads its BUDGET only between its parts, each a minute or so: half the limit lets the last one end.
    BUDGET=$((baseline_s / 2)) timeout "$baseline_s" python3 "$baseline" 2>&1 | tee "$OUT/hf_baseline.log"
fi
