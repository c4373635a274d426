#!/usr/bin/env bash
# Is bench serve's client the limit at rate inf? One server, then the same 500-request load sent by 1, 2 and 4
# client processes at once (each its own share, its own seed so no prompt hits the prefix cache). If the
# summed request rate grows with the clients, one client process was setting the pace.
# Usage (GPU machine, repo root): bash scripts/serve_split_clients.sh [server flags...]
set -u
cfg=${BENCH_CONFIGS:-shared/bench-configs}
[ -d "$cfg" ] || cfg=../shared/bench-configs
port=${PORT:-8765}
url=http://127.0.0.1:$port
python -m nanoserve.server.app --host 127.0.0.1 --port "$port" --model "$cfg/qwen3-0.6b" --load-format dummy \
  --dtype bfloat16 "$@" > "${OUT:-/tmp}/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server' EXIT
for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 0.5; done
seed=100
for clients in 1 2 4; do
  n=$((500 / clients))
  pids=()
  for i in $(seq "$clients"); do
    seed=$((seed + 1))
    python -m nanoserve.cli bench serve --base-url "$url" --no-progress --num-prompts "$n" --seed "$seed" \
      > "/tmp/client-$clients-$i.json" 2>/dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
  python - "$clients" /tmp/client-"$clients"-*.json <<'EOF'
import json, sys
rows = [json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[2:]]
wall = max(r["duration_s"] for r in rows)
done = sum(r["completed"] for r in rows)
print(json.dumps({"clients": int(sys.argv[1]), "completed": done, "wall_s": wall,
                  "request_throughput": round(done / wall, 2),
                  "client_cpu_s": [r["client_cpu_s"] for r in rows],
                  "p50_ttft_ms": [r["p50_ttft_ms"] for r in rows], "p50_tpot_ms": [r["p50_tpot_ms"] for r in rows]}))
EOF
done
