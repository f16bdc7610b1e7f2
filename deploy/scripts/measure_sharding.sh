#!/usr/bin/env bash
# Measures a sharded model on a live router cluster on loopback: starts nats-server with
# JetStream, 16 `kvr mocker` workers of one model and NODES `kvr node --cluster` nodes with the
# model in SHARDS shards (0: unsharded), waits 5 s to read each node's idle CPU, replays the first
# LIMIT requests of the bundled trace at SPEEDUP through `kvr replay-live` (route mode, the queue
# group), then prints per node its worker messages decoded per second, its CPU time during the
# run, its decisions and the partitions it owns, and the run's hit rate and TTFT. Everything it
# started is stopped at the end.
#   deploy/scripts/measure_sharding.sh NODES SHARDS [LIMIT] [SPEEDUP] [KVR_BINARY] [NATS_PORT]
set -euo pipefail
nodes=$1
shards=$2
limit=${3:-3000}
speedup=${4:-40}
kvr=${5:-build/release/deploy/cli/kvr}
port=${6:-14522}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
nats=nats://127.0.0.1:$port
hz=$(getconf CLK_TCK)
cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat"; }
metrics_of() { curl -s "http://127.0.0.1:$1/metrics"; }
decoded_of() { metrics_of "$1" | awk '/^kvr_worker_messages_decoded_total/ {s += $2} END {print s + 0}'; }

nats-server -a 127.0.0.1 -p "$port" -js -sd "$work/js" >"$work/nats.log" 2>&1 &
pids+=($!)
sleep 0.5
"$kvr" mocker --nats "$nats" --namespace sharding --workers 16 --time-scale 10 \
  >"$work/mocker.log" 2>&1 &
pids+=($!)
shard_flags=()
if ((shards > 0)); then shard_flags=(--partition-shards "mock-model=$shards"); fi
node_pids=()
node_ports=()
for n in $(seq 1 "$nodes"); do
  metrics_port=$((port + 10 + n))
  "$kvr" node --nats "$nats" --namespace sharding --cluster --node-id "n$n" --plaintext-peers \
    --metrics-port "$metrics_port" "${shard_flags[@]}" >"$work/node$n.log" 2>&1 &
  pids+=($!)
  node_pids+=($!)
  node_ports+=("$metrics_port")
done
for metrics_port in "${node_ports[@]}"; do
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$metrics_port/healthz" >/dev/null && break
    sleep 0.2
  done
done
sleep 4  # leases placed, every owner has heard its workers

idle=()
for pid in "${node_pids[@]}"; do idle+=("$(cpu_of "$pid")"); done
sleep 5
before=()
decoded=()
for i in "${!node_pids[@]}"; do
  before+=("$(cpu_of "${node_pids[$i]}")")
  decoded+=("$(decoded_of "${node_ports[$i]}")")
done
started=$(date +%s.%N)
"$kvr" replay-live --nats "$nats" --namespace sharding --limit "$limit" --speedup "$speedup" \
  --timeout 120 --quiet --json "$work/replay.json" >"$work/replay.txt" 2>&1
ended=$(date +%s.%N)

for i in "${!node_pids[@]}"; do
  text=$(metrics_of "${node_ports[$i]}")
  after=$(cpu_of "${node_pids[$i]}")
  awk -v node="n$((i + 1))" -v idle="$(((before[i] - idle[i])))" -v cpu="$((after - before[i]))" \
    -v hz="$hz" -v decoded_before="${decoded[$i]}" -v seconds="$(echo "$ended - $started" | bc -l)" \
    -v decoded_after="$(echo "$text" | awk '/^kvr_worker_messages_decoded_total/ {s += $2} END {print s + 0}')" \
    -v decisions="$(echo "$text" | awk '/^kvr_route_decisions_total/ {s += $2} END {print s + 0}')" \
    -v owned="$(echo "$text" | awk '/^kvr_cluster_partition_owned/ && $2 == 1 {match($1, /"[^"]*"/); printf "%s ", substr($1, RSTART + 1, RLENGTH - 2)}')" \
    'BEGIN {
       printf "%s: decoded %.1f worker messages/s, CPU %.2f s (idle %.3f s/s), %d decisions, owns %s\n",
         node, (decoded_after - decoded_before) / seconds, cpu / hz, idle / hz / 5, decisions, owned
     }'
done
python3 - "$work/replay.json" <<'EOF'
import json, sys
policy = json.load(open(sys.argv[1]))["policies"][0]
print(f"answered {policy['completed']}/{policy['requests']}, hit rate {policy['hit_rate']:.3f}, "
      f"mean TTFT {policy['ttft_ms']['mean']:.1f} ms")
EOF
