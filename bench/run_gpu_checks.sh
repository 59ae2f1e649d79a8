#!/usr/bin/env bash
# Every check that needs a CUDA GPU, time-boxed, for a lent GPU machine whose python3 has
# torch and transformers: the GPU tests (tests/gpu), the capacity bench (plain PyTorch and
# offload-cpu; the search bounds keep each trial under a minute), and bench_cuda.py
# (inference, then sparse attention). Logs and reports go to $OUT (default /tmp/gpu-checks).
#     bash bench/run_gpu_checks.sh [tests,capacity,inference,sparse]
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT" /tmp/swap
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
parts=${1:-tests,capacity,inference,sparse}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [[ $parts == *tests* ]]; then
    timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 100 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
fi
if [[ $parts == *capacity* ]]; then
    timeout 120 python3 bench/bench_capacity.py --device cuda --cap-gib 16 --width 2048 --seq-len 1024 \
        --micro-batch 4 --steps 2 --torch-layers 1,24 --shardwise-layers 8,40 --variants torch,offload-cpu \
        --timeout 60 --swap /tmp/swap --out "$OUT/capacity.md" 2>&1 | tee "$OUT/capacity.log" | tail -20
fi
if [[ $parts == *inference* ]]; then
    timeout 90 python3 bench/bench_cuda.py --sections inference --repeats 2 --out "$OUT/cuda-inference.md" \
        2>&1 | tail -20
fi
if [[ $parts == *sparse* ]]; then
    timeout 60 python3 bench/bench_cuda.py --sections sparse --lengths 4096,16384 --repeats 3 \
        --out "$OUT/cuda-sparse.md" 2>&1 | tail -20
fi
