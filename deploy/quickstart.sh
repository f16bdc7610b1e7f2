#!/usr/bin/env bash
# README command one: installs what is missing, builds kvr (Release), then replays the bundled
# Mooncake conversation trace (12,031 requests) on simulated workers, comparing the built-in
# kv-cost policy with round-robin, random and least-loaded. Prints the tables and writes JSON
# reports and PNG plots to out/ (override with KVR_QUICKSTART_OUT).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${KVR_QUICKSTART_BUILD_DIR:-"$root/build/quickstart"}
out_dir=${KVR_QUICKSTART_OUT:-"$root/out"}
jobs=${KVR_BUILD_JOBS:-$(nproc)}

"$root/deploy/install_deps.sh"

cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build_dir" --target kvr -j "$jobs"
kvr="$build_dir/deploy/cli/kvr"
mkdir -p "$out_dir"

policies=kv-cost,round-robin,random,least-loaded

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
echo "Reports and plots are in $out_dir"
