#!/usr/bin/env bash
# A kvr router cluster on this machine: nats-server with JetStream (its store in a directory of
# its own), three `kvr node --cluster` processes (node ids node-0, node-1, node-2, each with its
# own /metrics and /healthz port) and a `kvr mocker` fleet spread over several models, all on
# loopback. Every wait for readiness is bounded; everything is stopped on exit, failure, Ctrl-C or
# SIGTERM. Logs, the JetStream store and a pid file stay in the run directory, which is printed.
#
# Usage: deploy/cluster/local_cluster.sh [options]
#   --kvr PATH             the kvr executable (default: $KVR_BIN, else build/release/deploy/cli/kvr
#                          of this checkout, else kvr on PATH)
#   --dir DIR              run directory for logs/, the store and pids (default: a new temporary one)
#   --namespace NS         the kvr namespace (default: local)
#   --models N             models in the mocker fleet, model-0 ... (default: 4); one partition each
#   --workers-per-model N  simulated workers per model (default: 2)
#   --metrics-ports A,B,C  the three nodes' /metrics and /healthz ports (default: 9101,9102,9103)
#   --lease-ttl-ms T       the nodes' --cluster-lease-ttl-ms (default: 3000)
#   --timeout S            bound on each wait for readiness, in seconds (default: 30)
#   --check                start, wait until every partition is owned, print `kvr cluster status`
#                          and stop (exit 0 when the cluster came up)
# Without --check it runs until Ctrl-C, or until one of its processes exits (exit 1).

# The functions below run from traps and through wait_for, which shellcheck cannot follow.
# shellcheck disable=SC2317
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
kvr=${KVR_BIN:-}
run_dir=
ns=local
models=4
workers_per_model=2
metrics_ports=9101,9102,9103
lease_ttl_ms=3000
timeout_s=30
check=0

usage() {
  # The header's usage block, without its comment marks.
  awk '/^# Usage/ { shown = 1 } shown && !/^#/ { exit } shown { sub(/^# ?/, ""); print }' \
    "${BASH_SOURCE[0]}"
}

die_usage() {
  echo "local_cluster.sh: $1 (see --help)" >&2
  exit 2
}

while (($#)); do
  case $1 in
    --kvr) kvr=${2:?}; shift 2 ;;
    --dir) run_dir=${2:?}; shift 2 ;;
    --namespace) ns=${2:?}; shift 2 ;;
    --models) models=${2:?}; shift 2 ;;
    --workers-per-model) workers_per_model=${2:?}; shift 2 ;;
    --metrics-ports) metrics_ports=${2:?}; shift 2 ;;
    --lease-ttl-ms) lease_ttl_ms=${2:?}; shift 2 ;;
    --timeout) timeout_s=${2:?}; shift 2 ;;
    --check) check=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die_usage "unknown option '$1'" ;;
  esac
done

[[ $models =~ ^[1-9][0-9]*$ ]] || die_usage "--models must be a positive integer"
[[ $workers_per_model =~ ^[1-9][0-9]*$ ]] || die_usage "--workers-per-model must be a positive integer"
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die_usage "--timeout must be a positive number of seconds"
[[ $lease_ttl_ms =~ ^[1-9][0-9]*$ ]] || die_usage "--lease-ttl-ms must be a positive integer"
IFS=, read -r -a ports <<<"$metrics_ports"
((${#ports[@]} == 3)) || die_usage "--metrics-ports takes three ports, comma separated"
for port in "${ports[@]}"; do
  if ! [[ $port =~ ^[1-9][0-9]*$ ]] || ((port > 65535)); then die_usage "'$port' is not a port"; fi
done
[[ ${ports[0]} != "${ports[1]}" && ${ports[0]} != "${ports[2]}" && ${ports[1]} != "${ports[2]}" ]] ||
  die_usage "--metrics-ports must be three different ports"

if [[ -z $kvr ]]; then
  if [[ -x $root/build/release/deploy/cli/kvr ]]; then
    kvr=$root/build/release/deploy/cli/kvr
  else
    kvr=$(command -v kvr || true)
  fi
fi
[[ -n $kvr && -x $kvr ]] || die_usage "no kvr executable (build it, or give --kvr PATH)"
command -v nats-server >/dev/null || { echo "local_cluster.sh: nats-server is not installed" >&2; exit 1; }

if [[ -z $run_dir ]]; then
  run_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvr-cluster.XXXXXX")
fi
mkdir -p "$run_dir/logs"
logs=$run_dir/logs
pid_file=$run_dir/pids
: >"$pid_file"

pids=()
names=()
stop_all() {
  local i pid
  # Newest first: the nodes hand their leases back and the workers deregister while nats-server
  # still runs. Each gets five seconds after SIGTERM, then SIGKILL.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[i]}
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  pids=()
  names=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Records a started process: its pid and a name for messages.
started() {
  pids+=("$1")
  names+=("$2")
  echo "$1" >>"$pid_file"
}

fail() {
  local log
  echo "local_cluster.sh: $1" >&2
  for log in "$logs"/*.log; do
    [[ -f $log ]] && { echo "---- $log" >&2; tail -n 15 "$log" >&2; }
  done
  exit 1
}

# Polls `$@` every 0.1 s until it succeeds, for at most --timeout seconds.
wait_for() {
  local deadline=$((SECONDS + timeout_s))
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

# Every process started so far still runs; otherwise names the first that exited.
exited=
all_running() {
  local i
  for i in "${!pids[@]}"; do
    kill -0 "${pids[i]}" 2>/dev/null || { exited=${names[i]}; return 1; }
  done
}

# GET /healthz on 127.0.0.1:$1 answers 200 (bash's /dev/tcp: no HTTP client needed).
healthy() {
  local reply=
  all_running || fail "$exited exited during startup"
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
  printf 'GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  IFS= read -r -t 2 reply <&3 || true
  exec 3<&- 3>&-
  [[ $reply == "HTTP/1."?" 200"* ]]
}

nats_url=
nats_up() {
  local ports_file=$run_dir/nats-server_$nats_pid.ports
  all_running || fail "$exited exited"
  [[ -s $ports_file ]] || return 1
  nats_url=$(grep -o 'nats://127\.0\.0\.1:[0-9]*' "$ports_file" | head -n 1 || true)
  [[ -n $nats_url ]]
}

status_text=
every_partition_owned() {
  all_running || fail "$exited exited before every partition was owned"
  status_text=$("$kvr" cluster status --nats "$nats_url" --namespace "$ns" 2>&1) || return 1
  # The summary line: three members, and every model's partition owned by a live node (handovers
  # to the desired owners may still be under way: the table shows them).
  [[ $status_text == *"3 members; $models partitions: $models owned,"* ]]
}

echo "run directory: $run_dir (logs in $logs)"

# -p -1: a free port, read back from the ports file; JetStream's store in the run directory.
nats-server -a 127.0.0.1 -p -1 -js -sd "$run_dir/jetstream" --ports_file_dir "$run_dir" \
  >"$logs/nats-server.log" 2>&1 &
nats_pid=$!
started "$nats_pid" nats-server
wait_for nats_up || fail "nats-server did not report its port within ${timeout_s} s"
echo "nats-server (JetStream) at $nats_url"

# Ten times faster than the modelled GPU, so that a trial run answers quickly.
for ((m = 0; m < models; m++)); do
  "$kvr" mocker --nats "$nats_url" --namespace "$ns" --model "model-$m" \
    --workers "$workers_per_model" --worker-id-base $((1000 * (m + 1))) --time-scale 10 \
    >"$logs/mocker-$m.log" 2>&1 &
  started "$!" "mocker-$m"
done
echo "mocker fleet: $models models (model-0 ... model-$((models - 1))), $workers_per_model workers each"

for n in 0 1 2; do
  # One machine: the cluster ports stay on 127.0.0.1, where plaintext is allowed.
  "$kvr" node --nats "$nats_url" --namespace "$ns" --cluster --node-id "node-$n" --plaintext-peers \
    --metrics-port "${ports[n]}" --cluster-lease-ttl-ms "$lease_ttl_ms" \
    >"$logs/node-$n.log" 2>&1 &
  started "$!" "node-$n"
done
for n in 0 1 2; do
  wait_for healthy "${ports[n]}" ||
    fail "node-$n did not answer /healthz on port ${ports[n]} within ${timeout_s} s"
  echo "node-$n healthy: http://127.0.0.1:${ports[n]}/metrics"
done

wait_for every_partition_owned ||
  fail "not every partition was owned within ${timeout_s} s; last status:
$status_text"
echo
echo "$status_text"
echo
echo "route through any node: $kvr route --nats $nats_url --namespace $ns --model model-0 --text hello"

if ((check)); then
  echo "check passed: 3 nodes, $models partitions, each owned; stopping"
  exit 0
fi
echo "running; Ctrl-C stops everything"
# Returns when any process exits: the cluster is then not what was asked for.
wait -n || true
all_running || fail "$exited exited"
fail "a process exited"
