#!/usr/bin/env bash
# Issue 20's device checks in one bounded run (the device tool's H200 or any CUDA box):
#   1. Triton attention / cache writes over 16-bit and fp8 caches vs the torch reference, int8 /
#      int4 matmuls on CUDA, LLM on CUDA in every mode (tests/gpu/test_quantization_cuda.py);
#   2. the CPU paths on that machine's cores, pinned to 2 of them: the C++ kernel over narrow
#      caches and offline throughput per mode (a quiet CPU, unlike the shared dev machines).
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
echo "== 1: CUDA"
timeout 170 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_quantization_cuda.py -rA -s 2>&1 | tee "$OUT/quant_gpu.log" | tail -30
echo "== 2: CPU, 2 pinned cores"
export GRIDSERVE_CPU_THREADS=2 CUDA_VISIBLE_DEVICES=
timeout 60 taskset -c 0,1 $PY -m pytest -q -p no:cacheprovider tests/unit/kernels/test_kv_cache_dtypes.py 2>&1 | tail -3
SIZE=${SPEED_MODEL_SIZE:-small}
MODEL=$($PY -c "from gridserve.demo.recipe import ensure_checkpoint; print(ensure_checkpoint('llama', '$SIZE'))")
timeout ${SPEED_TIMEOUT:-180} taskset -c 0,1 $PY -m gridserve.cli bench quantization-speed --device cpu --model "$MODEL" \
  --modes ${SPEED_MODES:-fp32,int8+kv-bf16,int4+kv-fp8} \
  --output-json "$OUT/quantization_speed_cpu_$SIZE.json" 2>&1 | grep -v INFO | tee "$OUT/quant_speed.log" | tail -12
