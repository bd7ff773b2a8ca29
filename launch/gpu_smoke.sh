#!/usr/bin/env bash
# GPU smoke test on ONE GPU (about 4-5 minutes on an H100/H200, start-up included):
#   launch/gpu_smoke.sh [OUT_DIR] [extra flags for benchmarks/gpu_smoke.py, e.g. --peak-tflops 989 --stages 2,3]
# 1. `dsrecipes doctor --json` into OUT_DIR/doctor.json (environment record; never fatal here),
# 2. benchmarks/gpu_smoke.py: a random ~0.5B Qwen2-shaped model, bf16, micro-batch 16 x 1024 (about 56 GiB of GPU
#    memory; --micro-batch 8: about 31 GiB), ZeRO-2 and ZeRO-3, tokens/s + MFU, directly
#    through deepspeed.initialize and end-to-end through `python -m dsrecipes` (launcher=deepspeed, 1 GPU).
# Results: OUT_DIR/results.json (exit code 0 = every phase passed), one JSON and one log per phase.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter: $PYTHON, else `python`, else `python3` (GPU images often have only python3; the H200 one did).
PYTHON_BIN=${PYTHON:-$(command -v python || command -v python3)}
OUT=${1:-gpu_smoke_out}
shift || true
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
timeout 90 "$PYTHON_BIN" -m dsrecipes doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.log" || echo "(doctor reported problems: $OUT/doctor.json)"
"$PYTHON_BIN" - "$OUT/doctor.json" <<'PY' || true
import json, sys
for f in json.load(open(sys.argv[1])):
    if f["level"] != "ok" or f["check"] in ("cuda", "accelerator", "nvcc"):
        print(f"doctor [{f['level']}] {f['check']}: {f['message']}")
PY
exec "$PYTHON_BIN" benchmarks/gpu_smoke.py --out "$OUT" "$@"
