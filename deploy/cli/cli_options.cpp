#include "deploy/cli/cli_options.hpp"

#include <signal.h>

namespace kvr::cli {

void add_nats_options(CLI::App& app, actors::nats::NatsOptions& options) {
  app.add_option("--nats", options.url, "NATS server URL(s), comma separated")
      ->envname("KVR_NATS_URL")
      ->capture_default_str();
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

void add_engine_options(CLI::App& app, simulation::EngineConfig& config) {
  const std::string group = "Simulated engine";
  app.add_option("--block-size", config.block_size, "tokens per KV block")
      ->group(group)
      ->capture_default_str()
      ->check(CLI::Range(1U, 4096U));
  app.add_option("--num-gpu-blocks", config.num_gpu_blocks, "KV blocks per data-parallel rank")
      ->group(group)
      ->capture_default_str();
  app.add_option("--max-num-batched-tokens", config.max_num_batched_tokens,
                 "token budget per engine step (decodes first, then chunked prefill)")
      ->group(group)
      ->capture_default_str();
  app.add_option("--max-num-seqs", config.max_num_seqs, "most requests running at once")
      ->group(group)
      ->capture_default_str();
  app.add_option("--time-scale", config.timing.time_scale,
                 "divides every engine time (10: ten times faster than the modelled GPU)")
      ->group(group)
      ->capture_default_str();
  app.add_flag("!--no-prefix-caching", config.enable_prefix_caching,
               "disable KV block reuse in the engine")
      ->group(group);
  app.add_option("--prefill-quadratic-ms", config.timing.prefill_quadratic_ms,
                 "prefill ms = a*T^2 + b*T + c for T uncached tokens: a")
      ->group(group)
      ->capture_default_str();
  app.add_option("--prefill-linear-ms", config.timing.prefill_linear_ms, "prefill model: b")
      ->group(group)
      ->capture_default_str();
  app.add_option("--prefill-constant-ms", config.timing.prefill_constant_ms, "prefill model: c")
      ->group(group)
      ->capture_default_str();
  app.add_option("--decode-quadratic-ms", config.timing.decode_quadratic_ms,
                 "decode ms = max(floor, a*u^2 + b*u + c) for KV utilisation u: a")
      ->group(group)
      ->capture_default_str();
  app.add_option("--decode-linear-ms", config.timing.decode_linear_ms, "decode model: b")
      ->group(group)
      ->capture_default_str();
  app.add_option("--decode-constant-ms", config.timing.decode_constant_ms, "decode model: c")
      ->group(group)
      ->capture_default_str();
  app.add_option("--decode-floor-ms", config.timing.decode_floor_ms, "decode model: floor")
      ->group(group)
      ->capture_default_str();
}

std::function<int()> block_termination_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return [signals] {
    int received = 0;
    sigwait(&signals, &received);
    return received;
  };
}

}  // namespace kvr::cli
