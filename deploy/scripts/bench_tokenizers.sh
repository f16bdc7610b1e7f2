#!/usr/bin/env bash
# kvr's native tokenizer (Qwen3's tokenizer.json) against tiktoken (npm `tiktoken`, OpenAI's Rust
# tokenizer compiled to WASM; cl100k_base, the vocabulary Qwen's derives from, and o200k_base) on
# the same texts, one thread each, in one run: MB/s and tokens/s, the median of 5 runs.
#   deploy/scripts/bench_tokenizers.sh BUILD_DIR    (a Release build with KVR_BUILD_BENCHMARKS=ON)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:?usage: bench_tokenizers.sh BUILD_DIR}
bench="$build/tests/bench/tokenizer/kvr_tokenizer_bench"
[[ -x $bench ]] || cmake --build "$build" --target kvr_tokenizer_bench
if [[ ! -d "$root/tests/clients/tokenizers/node_modules/tiktoken" ]]; then
  npm ci --prefix "$root/tests/clients/tokenizers" --no-audit --no-fund --loglevel=error
fi

echo "== kvr (native tokenizer, Qwen3)"
"$bench" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  --benchmark_display_aggregates_only=true 2>/dev/null | grep -E "Benchmark|_median"
echo "== tiktoken (WASM)"
(cd "$root/tests/clients/tokenizers" && node bench_tiktoken.mjs --runs=5)
