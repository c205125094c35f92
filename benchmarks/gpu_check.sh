#!/usr/bin/env bash
# The GPU checks, in one bounded run on a CUDA machine (the device tool's H200, or any GPU box):
#   1. the Triton kernels compiled for the GPU (no interpreter) against the torch reference,
#      1b. their sliding-window / soft-cap / ALiBi attention and GELU paths (tests/unit/kernels),
#   2. the offline LLM on CUDA token-exact with transformers on CUDA (same checkpoints),
#   3. paged-attention decode bandwidth as a share of the copy bandwidth and the HBM peak,
#   4. decode-step CUDA graphs: token-exact with --enforce-eager (3 architectures, batch 1..256) and
#      the decode step eager vs graphs at batch 1, 8, 64, 256 (tests/gpu/test_cuda_graphs.py).
# GRAPHS_ONLY=1 runs step 4 alone (about 3 minutes at most).
# SWEEP=1 also times alternative launch plans. Set-up (OUT, PY, wheels from .whl/, protos) in gpu_env.sh.
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

if [ -z "${GRAPHS_ONLY:-}" ]; then
echo "== 1+2: Triton on CUDA and LLM vs transformers on CUDA"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/gpu --ignore=tests/gpu/test_cuda_graphs.py -rA $($PY -c "import pytest_timeout" 2>/dev/null && echo --timeout=90) 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_gpu.log"

echo "== 1b: sliding window / soft cap / ALiBi attention and GELU-and-mul, compiled, on CUDA"
timeout 180 $PY -m pytest -q -s -p no:cacheprovider tests/unit/kernels/test_cuda_score_mods.py -rA 2>&1 \
  | tee "$OUT/pytest_score_mods.log" | tail -30
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_score_mods.log"

echo "== 3: paged-attention bandwidth"
timeout 150 $PY -m gridserve.cli bench gpu-attention ${SWEEP:+--sweep-plans} --output-json "$OUT/gpu_attention_bandwidth.json" 2>&1 \
  | tee "$OUT/bandwidth.log" | tail -40
fi

echo "== 4: decode-step CUDA graphs: token-exact with eager, step time eager vs graphs"
OUT="$OUT" timeout 180 $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_cuda_graphs.py -rA 2>&1 \
  | tee "$OUT/pytest_cuda_graphs.log" | tail -30
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_cuda_graphs.log"
