#!/usr/bin/env bash
# Served throughput through Envoy, two source trees alternating (A B A B A B) on one machine: the
# "no slower than before" check of a change to the served path. Each run starts `gridserve serve`
# from one tree, drives it with the same client (this tree's `gridserve bench serve`) on W's shape,
# and stops it; the medians of each tree's runs and their ratio are printed.
#   benchmarks/served_ab.sh BEFORE_TREE AFTER_TREE   (a tree: a checkout with its protos generated)
# NUM (default 128; W is 256) requests, all at once; prompts 64-256 tokens, outputs 32-256, ignore_eos.
set -euo pipefail
BEFORE=$1 AFTER=$2
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/served_ab}
NUM=${NUM:-128}
RUNS=${RUNS:-3}
KV=${KV:-8589934592}
MODEL=${MODEL:-$($PY -m gridserve.demo.recipe --arch llama --size base)}
mkdir -p "$OUT"
run() {  # $1 label, $2 tree, $3 index
    local port; port=$($PY -c "from gridserve.launcher import free_port; print(free_port())")
    (cd "$2" && PYTHONPATH="$2" exec "$OLDPWD/$PY" -m gridserve.cli serve "$MODEL" --port "$port" \
        --kv-cache-memory-bytes "$KV") > "$OUT/serve-$1-$3.log" 2>&1 &
    local serve=$!
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    $PY -m gridserve.cli bench serve --base-url "http://127.0.0.1:$port" --dataset random --num-prompts "$NUM" \
        --random-input-len 160 --random-range-ratio 0.6 --random-output-len 144 --random-output-range-ratio 0.7778 \
        --ignore-eos --max-concurrency "$NUM" --disable-tqdm --label "$1-$3" --output-json "$OUT/$1-$3.json" \
        | grep -i "output token throughput" || true
    kill -TERM "$serve"; wait "$serve" || true
}
for i in $(seq "$RUNS"); do
    run before "$BEFORE" "$i"
    run after "$AFTER" "$i"
done
$PY - "$OUT" "$RUNS" <<'PYEOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
tput = {k: [json.load(open(f"{out}/{k}-{i}.json")).get("runs", [{}])[-1].get("output_throughput")
            or json.load(open(f"{out}/{k}-{i}.json"))["output_throughput"] for i in range(1, runs + 1)]
        for k in ("before", "after")}
med = {k: statistics.median(v) for k, v in tput.items()}
print(json.dumps({"runs": tput, "median": med, "after_over_before": med["after"] / med["before"]}, indent=1))
json.dump({"runs": tput, "median": med, "after_over_before": med["after"] / med["before"]},
          open(f"{out}/summary.json", "w"), indent=1)
PYEOF
