#!/usr/bin/env bash
# The int8 x int16 CPU GEMM (issue 20) on a quiet CPU: the device tool's machine (or any box),
# pinned to 2 cores, since the shared 2-core dev machine runs at load average 5-10:
#   1. the CUDA int8 matmul still dequantizes (a weight packed on CPU, then moved to CUDA);
#   2. the kernel's tests (this also builds it);
#   3. workload W offline, fp32 vs int8 + kv bf16, and the batch-64 decode step, llama base;
#   4. the kernel's micro-benchmark against fp32 F.linear.
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
lscpu | grep -E "^Model name|^CPU\(s\)" ; grep -o -m1 -w "avx512_vnni\|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; uptime
echo "== 1: CUDA int8"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_quantization_cuda.py -k "matmul" 2>&1 | tail -2
echo "== 2: kernel tests, 2 pinned cores"
export GRIDSERVE_CPU_THREADS=2 CUDA_VISIBLE_DEVICES=
timeout 120 taskset -c 0,1 $PY -m pytest -q -p no:cacheprovider tests/unit/kernels/test_int8_gemm.py 2>&1 | tail -2
echo "== 3: W offline and the decode step, llama base"
MODEL=$($PY -c "from gridserve.demo.recipe import ensure_checkpoint; print(ensure_checkpoint('llama', 'base'))")
timeout ${SPEED_TIMEOUT:-150} taskset -c 0,1 $PY -m gridserve.cli bench quantization-speed --device cpu --model "$MODEL" \
  --modes ${SPEED_MODES:-fp32,int8+kv-bf16} --output-json "$OUT/quantization_speed_cpu_base.json" 2>&1 | grep -v INFO | tail -6
timeout ${STEP_TIMEOUT:-90} taskset -c 0,1 $PY -m gridserve.cli bench quantization-step --model "$MODEL" \
  --modes ${SPEED_MODES:-fp32,int8+kv-bf16} --output-json "$OUT/quantization_step_cpu_base.json" 2>&1 | grep -v INFO | tail -8
echo "== 4: kernel micro-benchmark"
timeout 120 taskset -c 0,1 $PY -m gridserve.cli bench int8-gemm --threads 2 --repeats 5 2>&1 | tee "$OUT/int8_gemm_micro.txt"
uptime
