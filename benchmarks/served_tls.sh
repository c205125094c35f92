#!/usr/bin/env bash
# Served throughput through Envoy with mutual TLS (`gridserve serve --tls`: HTTPS at the edge, mTLS on
# every internal link) against plaintext. Both deployments run side by side (one idles while the
# other is measured) and `gridserve bench serve` alternates between them, RUNS times each (plain tls
# plain tls ...), so load from elsewhere on a shared machine hits both alike; prints each side's
# median output throughput and the median of the per-pair ratios tls / plain.
#   benchmarks/served_tls.sh      (NUM requests at once per run, default 128; RUNS, MODEL, KV)
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/served_tls}
NUM=${NUM:-128}
RUNS=${RUNS:-3}
KV=${KV:-8589934592}
MODEL=${MODEL:-$($PY -m gridserve.demo.recipe --arch llama --size base)}
mkdir -p "$OUT"
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true' EXIT
declare -A URL CLIENT
for side in plain tls; do
    port=$($PY -c "from gridserve.launcher import free_port; print(free_port())")
    flags=(); [ "$side" = tls ] && flags=(--tls)
    : > "$OUT/serve-$side.log"
    $PY -m gridserve.cli serve "$MODEL" --port "$port" --kv-cache-memory-bytes "$KV" "${flags[@]}" \
        > "$OUT/serve-$side.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do grep -q "gridserve ready" "$OUT/serve-$side.log" && break; sleep 1; done
    URL[$side]="http://127.0.0.1:$port"; CLIENT[$side]=""
    if [ "$side" = tls ]; then
        URL[$side]="https://127.0.0.1:$port"
        CLIENT[$side]="--ca-file $(sed -n 's/.*give it to clients): \([^;]*\);.*/\1/p' "$OUT/serve-$side.log")"
    fi
done
for i in $(seq "$RUNS"); do
    for side in plain tls; do
        # shellcheck disable=SC2086  # CLIENT holds two words or none
        $PY -m gridserve.cli bench serve --base-url "${URL[$side]}" ${CLIENT[$side]} --dataset random \
            --num-prompts "$NUM" --random-input-len 160 --random-range-ratio 0.6 --random-output-len 144 \
            --random-output-range-ratio 0.7778 --ignore-eos --max-concurrency "$NUM" --disable-tqdm \
            --label "$side-$i" --output-json "$OUT/$side-$i.json" | grep -i "output token throughput" || true
    done
done
$PY - "$OUT" "$RUNS" <<'PYEOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def tput(name):
    data = json.load(open(f"{out}/{name}.json"))
    return data.get("runs", [{}])[-1].get("output_throughput") or data["output_throughput"]
runs_by = {k: [tput(f"{k}-{i}") for i in range(1, runs + 1)] for k in ("plain", "tls")}
med = {k: statistics.median(v) for k, v in runs_by.items()}
ratios = [t / p for p, t in zip(runs_by["plain"], runs_by["tls"])]
summary = {"runs": runs_by, "median": med, "tls_over_plain_of_medians": med["tls"] / med["plain"],
           "median_of_paired_ratios": statistics.median(ratios)}
print(json.dumps(summary, indent=1))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PYEOF
