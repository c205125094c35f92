#!/usr/bin/env bash
# Issue 6, goal 3: output throughput on workload W served through Envoy -> gateway -> engine ->
# worker, against gridserve's offline LLM on W, in one run (offline first, then served).
# W: 256 requests, prompts uniform in [64, 256] tokens, outputs uniform in [32, 256] (ignore_eos),
# all submitted at once; the recipe's Llama "base" (134M, fp32); an 8 GiB KV cache holds all of W.
# Each phase runs under benchmarks/cpu_by_process.py: CPU seconds per process (w_*_cpu.json).
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
KV=${KV:-8589934592}
MODEL=${MODEL:-$($PY -m gridserve.demo.recipe --arch llama --size base)}

$PY -m gridserve.benchmarks.cpu_by_process --json "$OUT/w_offline_cpu.json" -- \
  $PY -m gridserve.cli bench throughput --model "$MODEL" --skip-hf --num-prompts 256 \
    --input-len-min 64 --input-len-max 256 --output-len-min 32 --output-len-max 256 \
    --kv-cache-memory-bytes "$KV" --output-json "$OUT/w_offline.json"

PORT=$($PY -c "from gridserve.launcher import free_port; print(free_port())")
$PY -m gridserve.cli serve "$MODEL" --port "$PORT" --kv-cache-memory-bytes "$KV" > /tmp/gridserve-w-serve.log 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
$PY -m gridserve.benchmarks.cpu_by_process --json "$OUT/w_served_cpu.json" -- \
  $PY -m gridserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset random --num-prompts 256 \
    --random-input-len 160 --random-range-ratio 0.6 --random-output-len 144 --random-output-range-ratio 0.7778 \
    --ignore-eos --max-concurrency 256 --disable-tqdm --label gridserve-W --output-json "$OUT/w_served.json"

$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/w_offline.json"))
served = json.load(open(f"{out}/w_served.json"))
off = next(s for s in offline["systems"] if s["name"] == "gridserve")["output_tok_per_s"]
runs = served.get("runs", [served])
srv = runs[-1]["output_throughput"]
print(f"offline {off:.1f} tok/s, served {srv:.1f} tok/s, served/offline = {srv / off:.2f}")
PYEOF
