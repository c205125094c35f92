#!/usr/bin/env bash
# Served throughput through Envoy with mutual TLS (`gridserve serve --tls`: HTTPS at the edge, mTLS on
# every internal link) against plaintext, alternating (plain tls plain tls plain tls) on one machine.
# Each run starts `gridserve serve` (with or without --tls), drives it with `gridserve bench serve`
# (HTTPS with the throwaway CA for --tls), and stops it; prints the medians and their ratio.
#   benchmarks/served_tls.sh      (NUM requests at once, default 128 as W's shape halved; RUNS, MODEL, KV)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/served_tls}
NUM=${NUM:-128}
RUNS=${RUNS:-3}
KV=${KV:-8589934592}
MODEL=${MODEL:-$($PY -m gridserve.demo.recipe --arch llama --size base)}
mkdir -p "$OUT"
run() {  # $1 label (plain | tls), $2 index
    local port scheme=http flags=() client=()
    port=$($PY -c "from gridserve.launcher import free_port; print(free_port())")
    if [ "$1" = tls ]; then scheme=https flags=(--tls); fi
    $PY -m gridserve.cli serve "$MODEL" --port "$port" --kv-cache-memory-bytes "$KV" "${flags[@]}" \
        > "$OUT/serve-$1-$2.log" 2>&1 &
    local serve=$!
    for _ in $(seq 600); do grep -q "gridserve ready" "$OUT/serve-$1-$2.log" && break; sleep 1; done
    if [ "$1" = tls ]; then
        client=(--ca-file "$(sed -n 's/.*give it to clients): \([^;]*\);.*/\1/p' "$OUT/serve-$1-$2.log")")
    fi
    $PY -m gridserve.cli bench serve --base-url "$scheme://127.0.0.1:$port" "${client[@]}" --dataset random \
        --num-prompts "$NUM" --random-input-len 160 --random-range-ratio 0.6 --random-output-len 144 \
        --random-output-range-ratio 0.7778 --ignore-eos --max-concurrency "$NUM" --disable-tqdm \
        --label "$1-$2" --output-json "$OUT/$1-$2.json" | grep -i "output token throughput" || true
    kill -TERM "$serve"; wait "$serve" || true
}
for i in $(seq "$RUNS"); do
    run plain "$i"
    run tls "$i"
done
$PY - "$OUT" "$RUNS" <<'PYEOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def tput(name):
    data = json.load(open(f"{out}/{name}.json"))
    return data.get("runs", [{}])[-1].get("output_throughput") or data["output_throughput"]
runs_by = {k: [tput(f"{k}-{i}") for i in range(1, runs + 1)] for k in ("plain", "tls")}
med = {k: statistics.median(v) for k, v in runs_by.items()}
summary = {"runs": runs_by, "median": med, "tls_over_plain": med["tls"] / med["plain"]}
print(json.dumps(summary, indent=1))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PYEOF
