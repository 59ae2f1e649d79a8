#!/usr/bin/env bash
# Every check that needs a CUDA GPU, time-boxed, for a lent GPU machine whose python3 has
# torch and transformers: the GPU tests (tests/gpu), one GRPO iteration of a 1B Llama through
# the hybrid engine (bench_rlhf.py), serving a 0.8B Llama (bench_serve.py), bench_cuda.py
# (inference, then sparse attention); on request one capacity trial of offload-cpu under a
# 16 GiB cap (CAPACITY_LAYERS=low,high searches) and one MoE layer's layouts (grouped experts;
# DeepSpeed's layer too where it imports). Each part is time-boxed so the default set fits one
# 9-minute call. Logs and reports go to $OUT (default /tmp/gpu-checks).
#     bash bench/run_gpu_checks.sh [tests,rlhf,serve,inference,sparse,capacity,moe]
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT" /tmp/swap
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
parts=${1:-tests,rlhf,serve,sparse}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [[ $parts == *tests* ]]; then
    timeout 170 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 100 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
fi
if [[ $parts == *rlhf* ]]; then
    timeout 200 python3 bench/bench_rlhf.py --device cuda --nproc 1 --model-size 1b --dtype bfloat16 \
        --variants hybrid-graph,hybrid,zero3 --rounds 1 --steps 3 --timeout 75 --out "$OUT/rlhf.md" \
        > "$OUT/rlhf.log" 2>&1; tail -25 "$OUT/rlhf.log"
fi
if [[ $parts == *serve* ]]; then
    timeout 130 python3 bench/bench_serve.py --device cuda --dtype bfloat16 --hidden 2048 --layers 16 --heads 16 \
        --vocab 32000 --sections clients,chunked --rounds 2 --out "$OUT/serve.md" > "$OUT/serve.log" 2>&1
    tail -25 "$OUT/serve.log"
fi
if [[ $parts == *inference* ]]; then
    timeout 120 python3 bench/bench_cuda.py --sections inference --repeats 2 --out "$OUT/cuda-inference.md" \
        2>&1 | tail -14
fi
if [[ $parts == *sparse* ]]; then
    timeout 70 python3 bench/bench_cuda.py --sections sparse --lengths 8192,16384 --repeats 3 \
        --out "$OUT/cuda-sparse.md" 2>&1 | tail -20
fi
if [[ $parts == *capacity* ]]; then  # plain PyTorch's limit under this cap was 10 layers (2026-11-26, H200)
    timeout 90 python3 bench/bench_capacity.py --device cuda --cap-gib 16 --width 2048 --seq-len 1024 \
        --micro-batch 4 --steps 2 --shardwise-layers ${CAPACITY_LAYERS:-30,30} --variants offload-cpu \
        --timeout 85 --swap /tmp/swap --out "$OUT/capacity.md" 2>&1 | tee "$OUT/capacity.log" | tail -8
fi
if [[ $parts == *moe* ]]; then
    ds=$(python3 -c "import deepspeed" 2>/dev/null && echo --deepspeed)
    for shape in "--tokens 32768 --hidden 1024" "--tokens 4096 --hidden 256"; do
        timeout 60 python3 bench/bench_moe_dispatch.py --device cuda --dtype bfloat16 $shape --rounds 10 $ds \
            2>&1 | grep -v '^\[' | tee -a "$OUT/moe.md" | tail -12
    done
fi
