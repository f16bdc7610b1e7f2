#!/usr/bin/env bash
# Measures a router cluster's failover on loopback: starts nats-server with JetStream, one
# `kvr mocker` worker for each of four models and three `kvr node --cluster` nodes (default lease
# TTL), kills the owner of model m0 with SIGKILL and asks `kvr route` for m0 every 50 ms until
# a decision comes back; prints how long that took. Everything it started is stopped at the end.
#   deploy/scripts/measure_failover.sh [KVR_BINARY] [NATS_PORT]
set -euo pipefail
kvr=${1:-build/release/deploy/cli/kvr}
port=${2:-14422}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
nats=nats://127.0.0.1:$port

nats-server -a 127.0.0.1 -p "$port" -js -sd "$work/js" >"$work/nats.log" 2>&1 &
pids+=($!)
for m in 0 1 2 3; do
  "$kvr" mocker --nats "$nats" --namespace failover --model "m$m" --workers 1 \
    --worker-id-base $((100 + m * 10)) >"$work/mocker$m.log" 2>&1 &
  pids+=($!)
done
declare -A node_pid node_port
for n in 1 2 3; do
  node_port[$n]=$((port + 10 + n))
  "$kvr" node --nats "$nats" --namespace failover --cluster --node-id "n$n" --plaintext-peers \
    --metrics-port "${node_port[$n]}" >"$work/node$n.log" 2>&1 &
  node_pid[$n]=$!
  pids+=($!)
done

owner=""
for _ in $(seq 1 600); do
  for n in 1 2 3; do
    metrics=$(curl -s "127.0.0.1:${node_port[$n]}/metrics" || true)
    if [[ $metrics == *'kvr_cluster_partition_owned{partition="m0/default"} 1'* ]]; then
      owner=$n
    fi
  done
  [[ -n $owner ]] && break
  sleep 0.05
done
if [[ -z $owner ]]; then
  echo "no node took m0 within 30 s; the nodes' logs:" >&2
  tail -n 5 "$work"/node*.log >&2
  exit 1
fi
until "$kvr" route --nats "$nats" --namespace failover --model m0 --text x --timeout-ms 500 \
  >/dev/null 2>&1; do sleep 0.05; done

kill -9 "${node_pid[$owner]}"
killed=$(date +%s%N)
until "$kvr" route --nats "$nats" --namespace failover --model m0 --text x --timeout-ms 500 \
  >/dev/null 2>&1; do sleep 0.05; done
elapsed_ms=$((($(date +%s%N) - killed) / 1000000))
echo "m0 was answered again $((elapsed_ms / 1000)).$(printf '%03d' $((elapsed_ms % 1000))) s after its owner n$owner was killed"
