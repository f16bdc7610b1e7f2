#!/usr/bin/env bash
# Installs the Debian packages kvr needs to build, test and run, skipping those already present.
# Used by deploy/test.sh and deploy/quickstart.sh; safe to run repeatedly.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libcaf-dev libnats-dev nats-server
  libyaml-cpp-dev libprotobuf-dev protobuf-compiler
  libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev libabsl-dev libxxhash-dev libspdlog-dev libfmt-dev libcli11-dev libcpp-httplib-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev  # kvr bridge: the engines' ZMQ KV events
  nlohmann-json3-dev python3 python3-matplotlib
  libboost-dev libsimdjson-dev  # the node's HTTP front door: Boost.Beast and Asio, simdjson
  libgrpc++-dev protobuf-compiler-grpc  # the node's endpoint picker for Envoy (gRPC ext_proc)
  libpcre2-dev libutf8proc-dev xz-utils  # the native tokenizer: regexes, Unicode, bundled files
  openssl  # the tests make a self-signed certificate for their TLS nats-server
  curl  # deploy/scripts/bench_front_door.sh
  clang-19 libclang-rt-19-dev  # the fuzz stage: libFuzzer harnesses (deploy/scripts/fuzz.sh)
)

# Node.js and npm run the official OpenAI client in the front door's tests; a Node.js (20 or later)
# already on the PATH is used as it is.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "kvr: installing ${missing[*]}" >&2
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  sudo_cmd=(sudo)
fi
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
