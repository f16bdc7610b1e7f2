#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, -DKVR_FUZZ=ON) with clang-19 and runs each against
# a copy of its committed corpus in a temporary folder, so the repository is never written; new
# inputs a run finds are dropped, crashes are kept in <build dir>/artifacts. See docs/fuzzing.md.
#   deploy/scripts/fuzz.sh [--runs N] [--time SECONDS] [--corpus-out DIR] [harness...]
# Defaults: every harness, 100000 executions each, at most 120 s each (CI); fewer for the harnesses
# whose executions are slow by nature: peer_port_handshake 15000 (a TLS handshake over a socket
# pair each, about 300/s), chat_template_source 5000 (a template of kilobytes parsed and rendered
# twice, some nesting thousands of levels: 120-300/s), chat_request 50000 (a chat template rendered
# and tokenized, about 1500/s after a few seconds loading three tokenizers). `--time 3600` alone
# fuzzes each harness for an hour (`--runs 0`: no bound on executions); --corpus-out DIR keeps
# the grown corpora there (e.g. to minimise and commit new seeds by hand).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build_dir=${KVR_FUZZ_BUILD_DIR:-"$root/build/fuzz"}
jobs=${KVR_BUILD_JOBS:-$(nproc)}
cxx=${KVR_FUZZ_CXX:-clang++-19}
cc=${KVR_FUZZ_CC:-clang-19}
runs=""
max_time=""
corpus_out=""
harnesses=()
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --time) max_time=$2; shift 2 ;;
    --corpus-out) corpus_out=$2; shift 2 ;;
    -*) echo "kvr fuzz: unknown option $1" >&2; exit 2 ;;
    *) harnesses+=("$1"); shift ;;
  esac
done
runs_given=$runs
if [[ -z $runs ]]; then
  # A time alone asks for that long; neither is the CI budget.
  if [[ -n $max_time ]]; then runs=0; else runs=100000; fi
fi
# The CI budget of the harnesses whose executions are slow by nature.
declare -A default_runs=([peer_port_handshake]=15000 [chat_template_source]=5000
  [chat_request]=50000)
max_time_given=$max_time
max_time=${max_time:-120}
if ((${#harnesses[@]} == 0)); then
  for dir in "$root"/tests/fuzz/corpus/*/; do harnesses+=("$(basename "$dir")"); done
fi

if ! command -v "$cxx" >/dev/null || ! command -v "$cc" >/dev/null; then
  echo "kvr fuzz: FAILED: $cxx / $cc not found; the fuzz stage needs Debian's clang-19 and" \
    "libclang-rt-19-dev (deploy/install_deps.sh installs them)" >&2
  exit 1
fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
build_start=$SECONDS
cmake -S "$root" -B "$build_dir" -G Ninja -DKVR_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="$cc" "${launcher[@]}" >/dev/null
cmake --build "$build_dir" -j "$jobs"
echo "kvr fuzz: harnesses built in $((SECONDS - build_start)) s"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
artifacts="$build_dir/artifacts"
mkdir -p "$artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

failed=()
run_start=$SECONDS
for harness in "${harnesses[@]}"; do
  binary="$build_dir/tests/fuzz/kvr_fuzz_$harness"
  seeds="$root/tests/fuzz/corpus/$harness"
  if [[ ! -x $binary || ! -d $seeds ]]; then
    echo "kvr fuzz: FAILED: no harness or corpus named $harness" >&2
    failed+=("$harness")
    continue
  fi
  cp -r "$seeds" "$work/$harness"
  harness_runs=$runs
  if [[ -z $runs_given && -z ${max_time_given:-} && -n ${default_runs[$harness]:-} ]]; then
    harness_runs=${default_runs[$harness]}
  fi
  options=(-runs="$( ((harness_runs > 0)) && echo "$harness_runs" || echo -1)" -max_total_time="$max_time" -rss_limit_mb=1024 -malloc_limit_mb=256
    -timeout=10 -print_final_stats=1 -artifact_prefix="$artifacts/$harness-")
  if [[ -f "$root/tests/fuzz/dictionaries/$harness.dict" ]]; then
    options+=(-dict="$root/tests/fuzz/dictionaries/$harness.dict")
  fi
  start=${EPOCHREALTIME/[.,]/}
  if "$binary" "${options[@]}" "$work/$harness" >"$work/$harness.log" 2>&1; then
    elapsed_ms=$(((${EPOCHREALTIME/[.,]/} - start) / 1000))
    executed=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$harness.log")
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$work/$harness.log")
    echo "kvr fuzz: $harness: ${executed:-?} executions in $((elapsed_ms / 1000)).$(printf %03d \
      $((elapsed_ms % 1000))) s ($((${executed:-0} * 1000 / (elapsed_ms + 1)))/s, peak RSS" \
      "${rss:-?} MB)"
    if ((harness_runs > 0)) && [[ ${executed:-0} -lt $harness_runs ]]; then
      echo "kvr fuzz: FAILED: $harness ran ${executed:-0} of $harness_runs executions in the" \
        "time limit" >&2
      failed+=("$harness")
    fi
  else
    tail -n 80 "$work/$harness.log" >&2
    echo "kvr fuzz: FAILED: $harness (the input is in $artifacts; replay it with" \
      "$binary <file>)" >&2
    failed+=("$harness")
  fi
  if [[ -n $corpus_out ]]; then
    mkdir -p "$corpus_out/$harness"
    cp -r "$work/$harness/." "$corpus_out/$harness/"
  fi
done
echo "kvr fuzz: ${#harnesses[@]} harnesses run in $((SECONDS - run_start)) s"
if ((${#failed[@]})); then
  echo "kvr fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
