#!/usr/bin/env bash
# README command one: installs what is missing, builds kvr (Release), then replays the bundled
# Mooncake conversation trace (12,031 requests) on simulated workers, comparing the built-in
# kv-cost policy with predicted-ttft (which learns the engines' rates online), round-robin, random
# and least-loaded; then starts a real local cluster
# (nats-server, one kvr node, a kvr mocker fleet) and routes a slice of the trace through it live;
# then routes the same slice through `kvr bridge`s in front of vLLM-speaking engines (`kvr mocker
# --speak vllm`: vLLM's HTTP API, Prometheus metrics and ZMQ KV events), once over NATS and once
# as OpenAI chat completions through the node's HTTP front door. Prints the tables and writes
# JSON reports and PNG plots to out/ (override with KVR_QUICKSTART_OUT). The cluster is torn down on exit, failure or Ctrl-C.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${KVR_QUICKSTART_BUILD_DIR:-"$root/build/quickstart"}
out_dir=${KVR_QUICKSTART_OUT:-"$root/out"}
jobs=${KVR_BUILD_JOBS:-$(nproc)}

"$root/deploy/install_deps.sh"

cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCHMARKS=OFF -DCMAKE_UNITY_BUILD=ON >/dev/null
cmake --build "$build_dir" --target kvr -j "$jobs"
kvr="$build_dir/deploy/cli/kvr"
mkdir -p "$out_dir"

policies=kv-cost,predicted-ttft,round-robin,random,least-loaded

echo
echo "== 1. 16 simulated workers, the trace's real arrival rate =="
echo "   (how much of each prompt is served from cache: kv-cost routes to the worker that holds it)"
"$kvr" replay --workers 16 --speedup 1 --policies "$policies" \
  --json "$out_dir/replay_16_workers.json" --plot "$out_dir/replay_16_workers.png"

echo
echo "== 2. 8 simulated workers, 6x the arrival rate (a saturated fleet) =="
echo "   (saved prefill compounds through the queues: time to first token drops several-fold)"
"$kvr" replay --workers 8 --speedup 6 --policies "$policies" \
  --json "$out_dir/replay_8_workers_6x.json" --plot "$out_dir/replay_8_workers_6x.png"

echo
echo "== 2b. the same 8 workers as 4 prefill + 4 decode, 4x the arrival rate (disaggregated) =="
echo "   (decode workers never prefill between two tokens: inter-token p99 falls; docs/disaggregation.md)"
"$kvr" replay --workers 8 --prefill-workers 4 --disaggregation-min-uncached-tokens 1024 \
  --speedup 4 --policies kv-cost --json "$out_dir/replay_8_workers_disaggregated_4x.json"

# ---- 3. live: a real cluster on loopback, torn down on exit, failure or Ctrl-C ----------------
live_requests=${KVR_QUICKSTART_LIVE_REQUESTS:-200}
live_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvr-quickstart.XXXXXX")
live_pids=()
stop_cluster() {
  local i pid
  # Newest first, so that the workers and the node deregister and close while nats-server runs;
  # each gets a few seconds after SIGTERM, then SIGKILL.
  for ((i = ${#live_pids[@]} - 1; i >= 0; i--)); do
    pid=${live_pids[i]}
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  live_pids=()
  rm -rf "$live_dir"
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Shows the tail of each log when the live part fails.
show_logs() {
  local log
  for log in "$out_dir"/live_*.log "$out_dir"/bridge_*.log; do
    [[ -f "$log" ]] && { echo "---- $log"; tail -n 20 "$log"; }
  done
}

# Starts nats-server on a free port (-p -1, learnt from the ports file) with a private store;
# sets nats_url. Its log goes to $1.
start_nats() {
  local log=$1 ports_file
  mkdir -p "$live_dir"
  nats-server -a 127.0.0.1 -p -1 --ports_file_dir "$live_dir" -sd "$live_dir/store" \
    >"$log" 2>&1 &
  nats_pid=$!
  live_pids+=("$nats_pid")
  nats_url=
  for _ in $(seq 100); do
    ports_file="$live_dir/nats-server_$nats_pid.ports"
    if [[ -s "$ports_file" ]]; then
      nats_url=$(grep -o 'nats://127\.0\.0\.1:[0-9]*' "$ports_file" | head -n 1 || true)
      [[ -n "$nats_url" ]] && break
    fi
    kill -0 "$nats_pid" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -z "$nats_url" ]]; then
    echo "quickstart: nats-server did not start" >&2
    show_logs >&2
    exit 1
  fi
  echo "   nats-server at $nats_url"
}

echo
echo "== 3. Live: nats-server, one kvr node and 8 kvr mocker workers on this machine =="
echo "   (the first $live_requests requests routed for real over NATS; latencies are wall-clock)"
start_nats "$out_dir/live_nats-server.log"
# 8 workers ten times faster than the modelled GPU (block size 64, the trace's 512-token blocks
# in eight); the node learns the block size from their registrations. The slice arrives at 4x
# the trace's rate.
"$kvr" mocker --nats "$nats_url" --namespace quickstart --workers 8 --time-scale 10 \
  >"$out_dir/live_mocker.log" 2>&1 &
live_pids+=("$!")
"$kvr" node --nats "$nats_url" --namespace quickstart >"$out_dir/live_node.log" 2>&1 &
live_pids+=("$!")
if ! "$kvr" replay-live --nats "$nats_url" --namespace quickstart --limit "$live_requests" \
  --speedup 4 --timeout 60 --json "$out_dir/replay_live.json" --plot "$out_dir/replay_live.png"; then
  echo "quickstart: the live replay failed" >&2
  show_logs >&2
  exit 1
fi
stop_cluster

# ---- 4. and 5. live through bridges: workers being vLLM-speaking engines ----------------------
bridge_engines=${KVR_QUICKSTART_BRIDGE_ENGINES:-8}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# Each engine takes three consecutive ports (HTTP, KV events, replay), then each bridge one for
# its /healthz, then the node's HTTP API one: a base with all free (sets engine_base). Below the
# kernel's ephemeral range, where no outgoing connection (a bridge polling an engine that is still
# binding its ports) can take one first.
find_engine_ports() {
  engine_base=
  local candidate all_free p ephemeral_low span=$((4 * bridge_engines + 1))
  ephemeral_low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  ((ephemeral_low > 10000 + span)) || ephemeral_low=32768
  for _ in $(seq 50); do
    candidate=$((10000 + RANDOM % (ephemeral_low - 10000 - span)))
    all_free=1
    for ((p = candidate; p <= candidate + 4 * bridge_engines; p++)); do
      port_free "$p" || { all_free=0; break; }
    done
    if ((all_free)); then engine_base=$candidate; return; fi
  done
  echo "quickstart: no free port range for the engines" >&2
  exit 1
}
healthy() {
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET %s HTTP/1.0\r\n\r\n' "${2:-/healthz}" >&3
  read -r -t 2 reply <&3 || true
  exec 3>&-
  [[ "$reply" == *" 200"* ]]
}
# The same engines as in run 3 (block size 64, ten times the modelled GPU's speed), behind
# vLLM's wire formats, each with a bridge on namespace $1; engine i listens on base + 3i (HTTP),
# + 1 (KV events), + 2 (replay). Returns once every bridge registered its engine, so that the
# replay sees the whole fleet from its first request.
start_bridged_fleet() {
  local ns=$1 i http registered
  find_engine_ports
  "$kvr" mocker --speak vllm --workers "$bridge_engines" --time-scale 10 \
    --http-port "$engine_base" --kv-events-port $((engine_base + 1)) \
    --kv-events-replay-port $((engine_base + 2)) --port-stride 3 \
    >"$out_dir/bridge_engines_$ns.log" 2>&1 &
  live_pids+=("$!")
  for ((i = 0; i < bridge_engines; i++)); do
    http=$((engine_base + 3 * i))
    "$kvr" bridge --engine vllm --engine-url "http://127.0.0.1:$http" \
      --kv-events "tcp://127.0.0.1:$((http + 1))" --kv-events-replay "tcp://127.0.0.1:$((http + 2))" \
      --nats "$nats_url" --namespace "$ns" \
      --metrics-port $((engine_base + 3 * bridge_engines + i)) >"$out_dir/bridge_${ns}_$i.log" 2>&1 &
    live_pids+=("$!")
  done
  for _ in $(seq 300); do
    registered=0
    for ((i = 0; i < bridge_engines; i++)); do
      healthy $((engine_base + 3 * bridge_engines + i)) 2>/dev/null && registered=$((registered + 1))
    done
    ((registered == bridge_engines)) && break
    sleep 0.1
  done
  echo "   $registered of $bridge_engines bridges registered with their engines"
}

echo
echo "== 4. Live through kvr bridge: $bridge_engines vLLM-speaking engines, each with a bridge =="
echo "   (the same $live_requests requests; prompts sent as token ids, streamed over HTTP by the"
echo "   engines; the bridges translate their ZMQ KV events and Prometheus load for the node)"
start_nats "$out_dir/bridge_nats-server.log"
start_bridged_fleet quickstart-bridge
"$kvr" node --nats "$nats_url" --namespace quickstart-bridge >"$out_dir/bridge_node.log" 2>&1 &
live_pids+=("$!")
if ! "$kvr" replay-live --nats "$nats_url" --namespace quickstart-bridge --limit "$live_requests" \
  --speedup 4 --timeout 60 --send-tokens --json "$out_dir/replay_live_bridge.json" \
  --plot "$out_dir/replay_live_bridge.png"; then
  echo "quickstart: the live replay through the bridges failed" >&2
  show_logs >&2
  exit 1
fi
stop_cluster

echo
echo "== 5. Through the front door: the node's OpenAI-compatible API before fresh engines =="
echo "   (the same $live_requests requests as OpenAI chat completions, streamed; an engine renders"
echo "   each prompt into token ids, the node routes and forwards; hit = the engines' cached_tokens)"
start_nats "$out_dir/bridge_nats-server.log"
start_bridged_fleet quickstart-http
http_port=$((engine_base + 4 * bridge_engines))
"$kvr" node --nats "$nats_url" --namespace quickstart-http --http-port "$http_port" \
  >"$out_dir/bridge_http_node.log" 2>&1 &
live_pids+=("$!")
for _ in $(seq 100); do healthy "$http_port" /health 2>/dev/null && break; sleep 0.1; done
if ! "$kvr" replay-live --openai-url "http://127.0.0.1:$http_port/v1" --openai-api chat \
  --limit "$live_requests" --speedup 4 --timeout 60 --block-size 64 \
  --json "$out_dir/replay_front_door.json" --plot "$out_dir/replay_front_door.png"; then
  echo "quickstart: the replay through the front door failed" >&2
  show_logs >&2
  exit 1
fi
stop_cluster

echo
echo "Reports and plots are in $out_dir (live cluster logs: $out_dir/live_*.log, $out_dir/bridge_*.log)"
