#!/usr/bin/env bash
# README command two: installs what is missing, builds a Debug build with AddressSanitizer and
# UndefinedBehaviorSanitizer (warnings are errors), runs the whole ctest suite; then the Release
# stage: kvr built as users run it (Release) and the integration suites labelled
# `integration-release` run again against it, where a faster node changes what races (KVR_SKIP_RELEASE=1 leaves it out,
# saying so); then the fuzz stage: every libFuzzer harness built with clang-19 and run for
# 100,000 executions (deploy/scripts/fuzz.sh; KVR_SKIP_FUZZ=1 leaves it out, saying so).
# Extra arguments go to ctest, e.g. `./deploy/test.sh -L unit` or `-R Selection`; the Release
# stage then runs only the integration-release tests they select.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${KVR_TEST_BUILD_DIR:-"$root/build/test"}
# The quickstart's folder: the same Release build of kvr, built once for both.
release_dir=${KVR_RELEASE_BUILD_DIR:-"$root/build/quickstart"}
jobs=${KVR_BUILD_JOBS:-$(nproc)}

"$root/deploy/install_deps.sh"
# The OpenAI SDK the front door's tests drive (pinned by its package-lock.json).
if [[ ! -d "$root/tests/clients/openai/node_modules/openai" ]]; then
  npm ci --prefix "$root/tests/clients/openai" --no-audit --no-fund --loglevel=error
fi

# Line tables only (-g1): sanitizer reports and backtraces keep file:line, and the build is a
# sixth faster than with full debug info (configure a build folder of your own for that).
# Unity builds: each library's sources compiled in batches (CMakeLists.txt).
cmake -S "$root" -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DKVR_SANITIZE=ON -DKVR_WERROR=ON \
  -DKVR_BUILD_TESTS=ON -DKVR_BUILD_BENCHMARKS=ON -DCMAKE_UNITY_BUILD=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$jobs" "$@"

if [[ ${KVR_SKIP_RELEASE:-0} == 1 ]]; then
  echo "kvr test: Release stage SKIPPED (KVR_SKIP_RELEASE=1)" >&2
else
  # kvr as deploy/quickstart.sh builds it (same flags); the test programs stay the sanitizer
  # build's.
  release_start=$SECONDS
  cmake -S "$root" -B "$release_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCHMARKS=OFF -DCMAKE_UNITY_BUILD=ON >/dev/null
  cmake --build "$release_dir" --target kvr -j "$jobs"
  echo "kvr test: Release kvr built in $((SECONDS - release_start)) s"
  KVR_TEST_BINARY="$release_dir/deploy/cli/kvr" ctest --test-dir "$build_dir" \
    --output-on-failure -j "$jobs" -L release "$@"
fi

if [[ ${KVR_SKIP_FUZZ:-0} == 1 ]]; then
  echo "kvr test: fuzz stage SKIPPED (KVR_SKIP_FUZZ=1)" >&2
else
  KVR_BUILD_JOBS=$jobs "$root/deploy/scripts/fuzz.sh"
fi
