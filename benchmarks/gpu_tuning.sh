#!/usr/bin/env bash
# One-GPU tuning sweep for benchmarks/gpu_smoke.py's direct mode (a random Qwen2.5-0.5B-shaped model, bf16):
#   benchmarks/gpu_tuning.sh [OUT_DIR [extra gpu_smoke.py flags for every variant]]
# (about 4 minutes on an H200, a FusedAdam JIT build included).
# Each variant is one `gpu_smoke.py --modes direct` run (50 steps, the first 10 not timed) into OUT_DIR/<variant>/;
# OUT_DIR/summary.txt has one line per variant. What it varies: the optimizer (torch's AdamW, dsrecipes' default,
# against DeepSpeed's FusedAdam: optimizer.torch_adam=false, a JIT build with nvcc on first use), the micro-batch
# and the ZeRO stage. The variants run in this order, one after another, on the same GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN=${PYTHON:-$(command -v python || command -v python3)}
OUT=${1:-gpu_tuning_out}
shift || true
EXTRA=("$@")
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
FUSED=optimizer.torch_adam=false
variant() {  # variant NAME gpu_smoke.py-flags...
    local name=$1
    shift
    "$PYTHON_BIN" benchmarks/gpu_smoke.py --out "$OUT/$name" --modes direct --steps 50 --warmup 10 "$@" "${EXTRA[@]}" \
        > "$OUT/$name.log" 2>&1
    echo "$name: $(grep -E '^  direct' "$OUT/$name.log" | tr -s ' ')" | tee -a "$OUT/summary.txt"
}
variant z2_mb8_torch_adam --stages 2 --micro-batch 8
variant z2_mb8_fused_adam --stages 2 --micro-batch 8 --override "$FUSED"
variant z2_mb16_fused_adam --stages 2 --micro-batch 16 --override "$FUSED"
variant z2_mb32_fused_adam --stages 2 --micro-batch 32 --override "$FUSED"
variant z3_mb16_fused_adam --stages 3 --micro-batch 16 --override "$FUSED"
variant z0_mb16_fused_adam --stages 0 --micro-batch 16 --override "$FUSED"
