#!/usr/bin/env bash
# Issue 6: the serving sweep behind the README's table and plot. Serves the recipe's Llama "base"
# (134M, fp32) through Envoy -> gateway -> engine -> worker and runs `gridserve bench serve` on
# workload W's shape at max concurrency 1, 8, 32, 64 and 256 (4 x concurrency requests per point,
# at most the 256 of W). The client runs on the same cores as the server.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
KV=${KV:-8589934592}
MODEL=${MODEL:-$($PY -m gridserve.demo.recipe --arch llama --size base)}

PORT=$($PY -c "from gridserve.launcher import free_port; print(free_port())")
$PY -m gridserve.cli serve "$MODEL" --port "$PORT" --kv-cache-memory-bytes "$KV" > /tmp/gridserve-sweep-serve.log 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
$PY -m gridserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset random \
    --num-prompts 256 --random-input-len 160 --random-range-ratio 0.6 \
    --random-output-len 144 --random-output-range-ratio 0.7778 --ignore-eos \
    --sweep-concurrency 1,8,32,64,256 --prompts-per-concurrency 4 --label gridserve \
    --disable-tqdm --output-json "$OUT/serve.json" --plot "$OUT/serve.png"
