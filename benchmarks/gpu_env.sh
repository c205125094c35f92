# Sourced by the GPU check scripts (gpu_check.sh, gpu_quant_check.sh), from the repository root:
# $OUT (created), $PY, offline Hugging Face, no Triton interpreter, the source tree installed editable
# and, when .whl/ holds wheels the GPU machine lacks, those installed into /tmp/site first (nothing
# is fetched); the generated protobuf code built for this tree.
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=0
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# The tree as an editable install: its finder maps services/, shared/, kernels/ ... onto gridserve.*
# (the build's package-dir mapping, setup.py ROOTS), wherever this copy of the tree lies.
$PY -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . \
  || $PY -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check --user -e . \
  || { echo "editable install of the tree failed"; exit 1; }
# Checkpoints built here by the recipe can travel in .gpu_models/ (saves the recipe's build there).
if [ -d .gpu_models ]; then export GRIDSERVE_MODEL_CACHE=$PWD/.gpu_models; fi
$PY -m gridserve.protos_build >/dev/null 2>&1 || echo "protos_build failed"
