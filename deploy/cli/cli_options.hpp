// Command-line options shared by kvr's subcommands: NATS connection settings and the simulated
// engine's parameters, each with its environment-variable form where a deployment needs one.
#pragma once

#include <CLI/CLI.hpp>

#include "actors/nats/nats_client.hpp"
#include "deploy/simulation/engine_config.hpp"

namespace kvr::cli {

/// Adds --nats, --nats-user, --nats-password, --nats-token, --nats-tls-* and reconnect options.
void add_nats_options(CLI::App& app, actors::nats::NatsOptions& options);

/// Adds every engine parameter (--block-size, --num-gpu-blocks, --max-num-batched-tokens,
/// --max-num-seqs, --time-scale, the timing polynomial ...), defaults shown in --help.
void add_engine_options(CLI::App& app, simulation::EngineConfig& config);

/// Blocks SIGINT and SIGTERM in the calling thread (and the threads it starts later) and returns
/// a function that waits for one of them; call before starting any thread.
std::function<int()> block_termination_signals();

}  // namespace kvr::cli
