#!/usr/bin/env bash
# What the front door costs, measured side by side in one run (docs/performance.md, "The front
# door"): the same vLLM-speaking engines (`kvr mocker --speak vllm` at time scale 1e6, so that an
# answer takes microseconds of simulated GPU and the difference is HTTP, rendering and routing)
# reached directly, in turn, and through `kvr node --http-port`, by `kvr replay-live --openai-url`
# at the trace's arrivals (6x) and closed-loop at 64 and 512 concurrent streams; the CPU the node and the engines spent per request; then 2,000
# streams held open through the node at once (slow engines), with the node's memory per stream.
# Usage: deploy/scripts/bench_front_door.sh [KVR_BINARY] (default build/release/deploy/cli/kvr).
# KVR_BENCH_NODE_BINARY runs the node from another kvr build (the engines, bridges and client stay).
# KVR_BENCH_TIME_SCALE (default 1e6) paces the engines: at 1e6 their answers come at once and
# a closed loop saturates the machine's two cores; at 1-5 the tokens come as a GPU's would, and
# 64 streams leave CPU to spare, so what the node adds is not the wait for a core.
# KVR_BENCH_NODE_CPUS=1 gives the node CPU 1 and everything else (engines, bridges, nats-server, the
# client) the other CPUs, as a node on its own host would be; unset, all share every CPU.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
kvr=${1:-"$root/build/release/deploy/cli/kvr"}
node_kvr=${KVR_BENCH_NODE_BINARY:-$kvr}
engines=${KVR_BENCH_ENGINES:-4}
requests=${KVR_BENCH_REQUESTS:-2000}
open_requests=${KVR_BENCH_OPEN_REQUESTS:-600}
held_streams=${KVR_BENCH_HELD_STREAMS:-2000}
node_cpus=${KVR_BENCH_NODE_CPUS:-}
on_node_cpus=()
on_other_cpus=()
if [[ -n $node_cpus ]]; then
  others=$(python3 -c 'import os, sys
mine = {int(c) for c in sys.argv[1].split(",")}
print(",".join(str(c) for c in sorted(os.sched_getaffinity(0) - mine)))' "$node_cpus")
  [[ -n $others ]] || { echo "KVR_BENCH_NODE_CPUS leaves no CPU for the rest" >&2; exit 2; }
  on_node_cpus=(taskset -c "$node_cpus")
  on_other_cpus=(taskset -c "$others")
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvr-bench-front-door.XXXXXX")
pids=()
stop_all() {
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do wait "${pids[i]}" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# A base port with the $1 ports from it all free.
free_base() {
  python3 -c '
import random, socket, sys
count = int(sys.argv[1])
# Below the ephemeral port range: no outgoing connection can take one while they are bound.
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    low = 32768
low = low if low > 10000 + count else 32768
for _ in range(200):
    base = random.randint(10000, low - count)
    sockets = []
    try:
        for port in range(base, base + count):
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", port))
        print(base)
        break
    except OSError:
        pass
    finally:
        for s in sockets:
            s.close()
' "$1"
}
cpu_ms() { awk '{print ($14 + $15) * 1000 / '"$(getconf CLK_TCK)"'}' "/proc/$1/stat"; }
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# The sum of a metric's series on the node's /metrics.
metric() {
  curl -s "127.0.0.1:$metrics_port/metrics" |
    awk -v m="$1" '$1 == m || index($1, m "{") == 1 {s += $2} END {print s + 0}'
}

# A fleet: nats-server, $engines engines at time scale $1 with a bridge each, one node.
start_fleet() {
  local time_scale=$1 i base nats_port
  nats_port=$(free_port)
  "${on_other_cpus[@]}" nats-server -a 127.0.0.1 -p "$nats_port" >"$work/nats.log" 2>&1 &
  pids+=("$!")
  nats="nats://127.0.0.1:$nats_port"
  base=$(free_base $((3 * engines)))
  "${on_other_cpus[@]}" "$kvr" mocker --speak vllm --workers "$engines" --time-scale "$time_scale" --http-threads 1000 \
    --http-port "$base" --kv-events-port $((base + 1)) --kv-events-replay-port 0 --port-stride 3 \
    >"$work/engines.log" 2>&1 &
  engines_pid=$!
  pids+=("$engines_pid")
  engine_urls=()
  for ((i = 0; i < engines; i++)); do
    local http=$((base + 3 * i))
    until curl -sf "127.0.0.1:$http/health" >/dev/null; do
      kill -0 "$engines_pid" 2>/dev/null || { cat "$work/engines.log" >&2; exit 1; }
      sleep 0.1
    done
    "${on_other_cpus[@]}" "$kvr" bridge --engine vllm --engine-url "http://127.0.0.1:$http" \
      --kv-events "tcp://127.0.0.1:$((http + 1))" --nats "$nats" >"$work/bridge_$i.log" 2>&1 &
    pids+=("$!")
    engine_urls+=(--openai-url "http://127.0.0.1:$http/v1")
  done
  metrics_port=$(free_port)
  http_port=$(free_port)
  "${on_node_cpus[@]}" "$node_kvr" node --nats "$nats" --http-port "$http_port" --metrics-port "$metrics_port" \
    --http-max-connections 100000 >"$work/node.log" 2>&1 &
  node_pid=$!
  pids+=("$node_pid")
  until [[ "$(metric kvr_workers 2>/dev/null)" == "$engines" ]]; do
    sleep 0.1
  done
}

# replay-live through $1 (direct | node) at concurrency $2 (a number: closed loop, every request
# due at once; "open": the trace's arrivals at 6x its rate, about 20 requests/s, nothing
# saturated); prints one row of the table.
run() {
  local target=$1 concurrency=$2 urls json node_before engines_before load
  if [[ $target == node ]]; then urls=(--openai-url "http://127.0.0.1:$http_port/v1"); else urls=("${engine_urls[@]}"); fi
  json="$work/${target}_${concurrency}.json"
  if [[ $concurrency == open ]]; then
    load=(--speedup 6 --concurrency 1000 --limit "$open_requests")
  else
    load=(--speedup 1e6 --concurrency "$concurrency" --measure-from-send --limit "$requests"
      --warmup "$concurrency")
  fi
  node_before=$(cpu_ms "$node_pid")
  engines_before=$(cpu_ms "$engines_pid")
  # A failed request fails the replay (exit 1), not the table: its row shows the completed count.
  "${on_other_cpus[@]}" "$kvr" replay-live "${urls[@]}" --openai-api completions "${load[@]}" --timeout 120 --quiet \
    --json "$json" >/dev/null || true
  python3 - "$json" "$target" "$concurrency" \
    "$(awk -v a="$(cpu_ms "$node_pid")" -v b="$node_before" 'BEGIN {print a - b}')" \
    "$(awk -v a="$(cpu_ms "$engines_pid")" -v b="$engines_before" 'BEGIN {print a - b}')" <<'EOF'
import json, sys
path, target, concurrency, node_ms, engines_ms = sys.argv[1:]
policy = json.load(open(path))["policies"][0]
done = policy["completed"]
added = policy.get("front_door_added_ms")
added = f"{added['p50']:>9.3f} {added['p99']:>9.3f}" if added else f"{'-':>9} {'-':>9}"
print(f"{target:>7} {concurrency:>5} {done:>6}/{policy['requests']} {done / policy['makespan_s']:>9.0f} "
      f"{policy['ttft_ms']['p50']:>9.3f} {policy['ttft_ms']['p99']:>9.3f} {added} "
      f"{float(node_ms) / done:>10.3f} {float(engines_ms) / done:>12.3f}")
EOF
}

echo "kvr front door: $engines engines (time scale ${KVR_BENCH_TIME_SCALE:-1e6}), $requests requests of the bundled trace"
echo "(completions with token-id prompts, streamed) per row, side by side in one run"
start_fleet "${KVR_BENCH_TIME_SCALE:-1e6}"
printf '%7s %5s %13s %9s %9s %9s %9s %9s %10s %12s\n' target conc completed "req/s" "ttft p50" \
  "ttft p99" "added p50" "added p99" "node ms/req" "engines ms/req"
for concurrency in ${KVR_BENCH_LOADS:-open 64 512}; do
  for target in direct node; do run "$target" "$concurrency"; done
done
echo "(ttft in ms of wall-clock time at the client; added: each request's ttft less the engine's own"
echo " time to its first byte, from the node's Server-Timing header; ms/req = CPU time per request)"
# The node's own view: from a request's body to its forwarding (routing included), over every run.
curl -s "127.0.0.1:$metrics_port/metrics" | python3 -c '
import sys
lines = sys.stdin.readlines()
for metric, what in (("kvr_http_added_latency_seconds", "body to forwarded"),
                     ("kvr_http_relay_first_byte_seconds", "engine first byte to client"),
                     ("kvr_route_latency_seconds", "route request to decision"),
                     ("kvr_http_engine_first_byte_seconds", "forwarded to the engine first byte")):
    buckets = [(float(line.split("le=\"")[1].split("\"")[0].replace("+Inf", "inf")), float(line.split()[-1]))
               for line in lines if line.startswith(metric + "_bucket")]
    total = buckets[-1][1]
    quantile = lambda q: next(le for le, count in buckets if count >= q * total)
    print(f"node: {what}, {int(total)} requests: p50 <= {quantile(0.5) * 1000:g} ms, "
          f"p99 <= {quantile(0.99) * 1000:g} ms (histogram bucket bounds)")'
stop_all

echo
echo "$held_streams streams held open through the node at once (engines at time scale 0.05)"
start_fleet 0.05
idle_kb=$(rss_kb "$node_pid")
"${on_other_cpus[@]}" "$kvr" replay-live --openai-url "http://127.0.0.1:$http_port/v1" --openai-api completions \
  --limit "$held_streams" --speedup 1e6 --concurrency "$held_streams" --timeout 300 --quiet \
  >/dev/null 2>&1 &
replay_pid=$!
peak_streams=0
peak_kb=$idle_kb
while kill -0 "$replay_pid" 2>/dev/null; do
  streams=$(metric kvr_http_requests_in_flight || echo 0)
  streams=${streams%.*}
  kb=$(rss_kb "$node_pid")
  if ((${streams:-0} > peak_streams)); then peak_streams=$streams; peak_kb=$kb; fi
  ((peak_streams >= held_streams)) && break
  sleep 0.2
done
kill "$replay_pid" 2>/dev/null || true
wait "$replay_pid" 2>/dev/null || true
echo "streams in flight at the peak: $peak_streams; node RSS idle $((idle_kb / 1024)) MiB, at the peak" \
  "$((peak_kb / 1024)) MiB: $(((peak_kb - idle_kb) / (peak_streams > 0 ? peak_streams : 1))) KiB per stream"
