#include "deploy/cli/cli_options.hpp"

#include <cmath>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "discovery/catalog/worker_registration.hpp"
#include "messages/subjects.hpp"

namespace kvr::cli {

CLI::Validator finite_range(double min, double max) {
  return CLI::Validator(
      [min, max](std::string& input) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(input, value)) {
          return fmt::format("Value {} is not a number", input);
        }
        // NaN compares false with everything, so CLI::Range would let it through.
        if (!std::isfinite(value) || value < min || value > max) {
          return fmt::format("Value {} not in range {} to {}", input, min, max);
        }
        return {};
      },
      fmt::format("FLOAT in [{} - {}]", min, max));
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        return input.empty() ? std::string{"must not be empty"} : std::string{};
      },
      "TEXT (non-empty)");
}

void add_nats_options(CLI::App& app, nats::NatsOptions& options) {
  app.add_option("--nats", options.url, "NATS server URL(s), comma separated")
      ->envname("KVR_NATS_URL")
      ->capture_default_str()
      ->check(non_empty());
  app.add_option("--nats-user", options.user, "NATS user name")->envname("KVR_NATS_USER");
  app.add_option("--nats-password", options.password, "NATS password")
      ->envname("KVR_NATS_PASSWORD");
  app.add_option("--nats-token", options.token, "NATS authentication token")
      ->envname("KVR_NATS_TOKEN");
  app.add_option("--nats-tls-ca", options.tls_ca_file, "CA file that verifies the NATS server")
      ->check(CLI::ExistingFile);
  app.add_option("--nats-tls-cert", options.tls_cert_file, "client certificate for mutual TLS")
      ->check(CLI::ExistingFile);
  app.add_option("--nats-tls-key", options.tls_key_file, "client key for mutual TLS")
      ->check(CLI::ExistingFile);
  app.add_option_function<int>(
         "--nats-reconnect-wait-ms",
         [&options](int ms) { options.reconnect_wait = std::chrono::milliseconds(ms); },
         "wait between NATS reconnect attempts")
      ->default_str("250")
      ->check(CLI::Range(1, 60'000));
}

CLI::Option* add_namespace_option(CLI::App& app, std::string& ns) {
  return app.add_option("--namespace", ns, "subject namespace (kvr.<namespace>.…)")
      ->envname("KVR_NAMESPACE")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& input) -> std::string {
            return subjects::is_valid_namespace(input)
                       ? std::string{}
                       : fmt::format("'{}' must be non-empty and use only [A-Za-z0-9_-]", input);
          },
          "NAME"));
}

void add_engine_options(CLI::App& app, simulation::EngineConfig& config) {
  const std::string group = "Simulated engine";
  app.add_option("--block-size", config.block_size, "tokens per KV block")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(1U, discovery::kMaxBlockSize));
  app.add_option("--num-gpu-blocks", config.num_gpu_blocks, "KV blocks per data-parallel rank")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{1}, static_cast<std::uint32_t>(kMaxSimulatedBlocks)));
  app.add_option("--max-num-batched-tokens", config.max_num_batched_tokens,
                 "token budget per engine step (decodes first, then chunked prefill)")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{1} << 24));
  app.add_option("--max-num-seqs", config.max_num_seqs, "most requests running at once")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{1}, std::uint32_t{65'536}));
  app.add_option("--time-scale", config.timing.time_scale,
                 "divides every engine time (10: ten times faster than the modelled GPU)")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(0.001, 1e6));
  app.add_flag("!--no-prefix-caching", config.enable_prefix_caching,
               "disable KV block reuse in the engine")
      ->group(group);
  // Prefill coefficients stay non-negative (prefill time grows with the tokens); decode
  // coefficients may be negative (the default fit's quadratic term is), the floor keeps a decode
  // step positive.
  app.add_option("--prefill-quadratic-ms", config.timing.prefill_quadratic_ms,
                 "prefill ms = a*T^2 + b*T + c for T uncached tokens: a")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  app.add_option("--prefill-linear-ms", config.timing.prefill_linear_ms, "prefill model: b")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  app.add_option("--prefill-constant-ms", config.timing.prefill_constant_ms, "prefill model: c")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  app.add_option("--decode-quadratic-ms", config.timing.decode_quadratic_ms,
                 "decode ms = max(floor, a*u^2 + b*u + c) for KV utilisation u: a")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(-1e6, 1e6));
  app.add_option("--decode-linear-ms", config.timing.decode_linear_ms, "decode model: b")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(-1e6, 1e6));
  app.add_option("--decode-constant-ms", config.timing.decode_constant_ms, "decode model: c")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(-1e6, 1e6));
  app.add_option("--decode-floor-ms", config.timing.decode_floor_ms, "decode model: floor")
      ->group(group)
      ->capture_default_str()
      ->check(finite_range(1e-6, 1e6));
}

std::expected<void, std::string> check_simulated_blocks(std::uint64_t engines,
                                                        const simulation::EngineConfig& config,
                                                        std::string_view engines_option) {
  const std::uint64_t blocks = engines * config.num_gpu_blocks;
  if (blocks > kMaxSimulatedBlocks) {
    return std::unexpected(fmt::format(
        "{} x --num-gpu-blocks: {} simulated KV blocks in one process exceed {}; use fewer "
        "workers or blocks",
        engines_option, blocks, kMaxSimulatedBlocks));
  }
  return {};
}

void warn_unapplied_admission(std::string_view command, const selection::RouterPolicyConfig& config,
                              bool runs_classifier) {
  if (config.request_classifier && !runs_classifier) {
    spdlog::warn("{}: request_classifier '{}' is not applied: admission does not run yet", command,
                 config.request_classifier->type);
  }
}

void add_session_affinity_options(CLI::App& app, SessionAffinityFlags& flags) {
  app.add_option("--router-session-affinity-ttl-secs", flags.ttl_secs,
                 "session affinity: a session's binding to a worker expires after this many idle "
                 "seconds (0: session affinity off)")
      ->envname("KVR_ROUTER_SESSION_AFFINITY_TTL_SECS")
      ->capture_default_str()
      ->check(
          CLI::Range(std::uint64_t{0}, static_cast<std::uint64_t>(kMaxSessionAffinityTtl.count())));
  app.add_option("--router-session-affinity-mode", flags.mode,
                 "hard: a bound session goes exactly to its worker; soft: the binding is offered "
                 "to the policy as its affinity target")
      ->envname("KVR_ROUTER_SESSION_AFFINITY_MODE")
      ->capture_default_str()
      ->check(CLI::IsMember({"hard", "soft"}));
}

SessionAffinityOptions session_affinity_options(const SessionAffinityFlags& flags) {
  SessionAffinityOptions options;
  // The validators allow only "hard" and "soft", and TTLs within kMaxSessionAffinityTtl.
  options.mode = parse_session_affinity_mode(flags.mode).value_or(SessionAffinityMode::hard);
  if (flags.ttl_secs > 0) {
    options.ttl = std::chrono::seconds(static_cast<std::int64_t>(flags.ttl_secs));
  }
  return options;
}

}  // namespace kvr::cli
