// Command-line options shared by kvr's subcommands: NATS connection settings, the namespace and
// the simulated engine's parameters, each with its environment-variable form where a deployment
// needs one, and the validators that keep every value within what can work.
#pragma once

#include <cstdint>
#include <expected>
#include <string>

#include <CLI/CLI.hpp>

#include "deploy/simulation/engine_config.hpp"
#include "messages/nats/nats_client.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/partition/session_affinity.hpp"

namespace kvr::cli {

/// The exit code of every configuration or usage error (the README's promise).
inline constexpr int kUsageError = 2;

/// Most simulated KV blocks one process holds (engines x --num-gpu-blocks): each block costs
/// tens of bytes up front, so more than this is a typo rather than a fleet.
inline constexpr std::uint64_t kMaxSimulatedBlocks = std::uint64_t{1} << 26;

/// A number in [min, max]; unlike CLI::Range it also refuses NaN and infinities.
CLI::Validator finite_range(double min, double max);

/// A value that is not the empty string.
CLI::Validator non_empty();

/// Adds --nats, --nats-user, --nats-password, --nats-token, --nats-tls-* and reconnect options.
void add_nats_options(CLI::App& app, nats::NatsOptions& options);

/// Adds --namespace (env KVR_NAMESPACE): non-empty, only [A-Za-z0-9_-].
CLI::Option* add_namespace_option(CLI::App& app, std::string& ns);

/// Adds every engine parameter (--block-size, --num-gpu-blocks, --max-num-batched-tokens,
/// --max-num-seqs, --time-scale, the timing polynomial ...), defaults shown in --help.
void add_engine_options(CLI::App& app, simulation::EngineConfig& config);

/// Session affinity as `kvr node` and `kvr replay` take it.
struct SessionAffinityFlags {
  std::uint64_t ttl_secs = 0;  ///< 0: off
  std::string mode = "hard";
};

/// Adds --router-session-affinity-ttl-secs and --router-session-affinity-mode (with their
/// KVR_ROUTER_SESSION_AFFINITY_* variables), validated.
void add_session_affinity_options(CLI::App& app, SessionAffinityFlags& flags);

/// The session affinity the (validated) flags configure.
SessionAffinityOptions session_affinity_options(const SessionAffinityFlags& flags);

/// Refuses `engines` simulated engines of `config` holding more than kMaxSimulatedBlocks KV blocks
/// in all; `engines_option` names what sets the engine count (e.g. "--workers").
std::expected<void, std::string> check_simulated_blocks(std::uint64_t engines,
                                                        const simulation::EngineConfig& config,
                                                        std::string_view engines_option);

/// The admission sections a command loads and checks but does not run (the request classifier
/// unless `runs_classifier`): logs a warning naming each, so that a user is never misled into
/// thinking it takes effect.
void warn_unapplied_admission(std::string_view command, const selection::RouterPolicyConfig& config,
                              bool runs_classifier = false);

}  // namespace kvr::cli
