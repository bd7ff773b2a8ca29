#!/usr/bin/env bash
# The Python packages a lent GPU machine's image lacks, as wheels in .whl/ (git-ignored), for `run`'s carry:
#   bash benchmarks/gpu_wheels.sh            # here, with network: fills .whl/ (about 10 MiB, under the 64 MiB carry)
#   bash benchmarks/gpu_wheels.sh --check    # there, first thing: installs them offline and imports what the
#                                            # GPU scripts need; one line names what is missing
# The image (device/KINDS.md, "Python packages already there"): Python 3.12, torch 2.11+cu130, transformers 5.17,
# accelerate, peft, pyarrow, pandas, tensorboard, matplotlib, triton, ... but no DeepSpeed, Hydra/OmegaConf,
# datasets, TRL or liger-kernel. The versions below are the ones this project is tested with on CPU (pip list here),
# pure-Python wheels except pydantic-core and multiprocess (cp312 builds for the image's Python). DeepSpeed and
# antlr4 publish only source: they are built here into pure-Python wheels (DeepSpeed with no ops pre-built: it
# JIT-builds what it needs there with the image's nvcc). No flash-attn: its wheels are hundreds of MiB (over the
# carry) and built per torch/CUDA pair, so TRL's side runs on sdpa or flex_attention (benchmarks/README.md says
# what that means for the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.whl
PURE=(hjson==3.1.0 pydantic==2.13.4 annotated-types==0.7.0 typing-inspection==0.4.2 hydra-core==1.3.8
      omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 trl==1.16.0 liger-kernel==0.8.5)
CP312=(pydantic-core==2.46.4 multiprocess==0.70.19)
BUILT=(deepspeed==0.19.8 antlr4-python3-runtime==4.9.3)
IMPORTS="deepspeed hydra omegaconf datasets trl liger_kernel pydantic"

if [[ "${1:-}" == "--check" ]]; then
    ls "$DIR"/*.whl > /dev/null 2>&1 || { echo "gpu_wheels: no wheels in $DIR/ (carry it: run(carry=['.whl']))"; exit 2; }
    python3 -m pip install -q --no-index --no-deps "$DIR"/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 - "$IMPORTS" <<'EOF'
import importlib, sys
missing = []
for name in sys.argv[1].split():
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a check: every failure is reported on one line
        missing.append(f"{name} ({type(exc).__name__}: {str(exc)[:120]})")
if missing:
    sys.exit("gpu_wheels: cannot import " + "; ".join(missing))
import torch, transformers, deepspeed, trl
print(f"gpu_wheels: ok - python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, deepspeed {deepspeed.__version__}, trl {trl.__version__}, "
      f"cuda {torch.cuda.is_available()}")
EOF
    exit 0
fi

mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DIR" "${PURE[@]}" "${CP312[@]}"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "${BUILT[@]}"
for w in "$DIR"/*.whl; do
    case "$w" in *-cp3*-cp3*) [[ "$w" == *cp312* ]] || { echo "gpu_wheels: $w is not for Python 3.12"; exit 2; } ;; esac
done
size=$(du -sm "$DIR" | cut -f1)
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, ${size} MiB in $DIR/"
(( size < 60 )) || { echo "gpu_wheels: $DIR/ is ${size} MiB, over what run's carry takes with the tree (64 MiB)"; exit 2; }
