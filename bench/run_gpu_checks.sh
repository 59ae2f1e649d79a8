#!/usr/bin/env bash
# Every check that needs a CUDA GPU, time-boxed, for a lent GPU machine whose python3 has
# torch and transformers: the GPU tests (tests/gpu), bench_cuda.py (inference, then sparse
# attention) and one capacity trial of offload-cpu under a 16 GiB cap (CAPACITY_LAYERS=low,high
# searches). Each part is time-boxed so the whole fits one 7-minute call. Logs and reports go
# to $OUT (default /tmp/gpu-checks).
#     bash bench/run_gpu_checks.sh [tests,inference,sparse,capacity]
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT" /tmp/swap
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
parts=${1:-tests,capacity,inference,sparse}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [[ $parts == *tests* ]]; then
    timeout 110 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 100 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
fi
if [[ $parts == *inference* ]]; then
    timeout 120 python3 bench/bench_cuda.py --sections inference --repeats 2 --out "$OUT/cuda-inference.md" \
        2>&1 | tail -14
fi
if [[ $parts == *sparse* ]]; then
    timeout 100 python3 bench/bench_cuda.py --sections sparse --lengths 4096,16384 --repeats 3 \
        --out "$OUT/cuda-sparse.md" 2>&1 | tail -20
fi
if [[ $parts == *capacity* ]]; then  # plain PyTorch's limit under this cap was 10 layers (2026-11-26, H200)
    timeout 90 python3 bench/bench_capacity.py --device cuda --cap-gib 16 --width 2048 --seq-len 1024 \
        --micro-batch 4 --steps 2 --shardwise-layers ${CAPACITY_LAYERS:-30,30} --variants offload-cpu \
        --timeout 85 --swap /tmp/swap --out "$OUT/capacity.md" 2>&1 | tee "$OUT/capacity.log" | tail -8
fi
