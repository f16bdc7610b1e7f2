#include "deploy/cli/node_command.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>

#include <spdlog/spdlog.h>

#include "actors/node/router_node.hpp"
#include "deploy/cli/cli_options.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/policies/builtin_policies.hpp"

namespace kvr::cli {
namespace {

struct NodeCommandOptions {
  actors::NodeOptions node;
  std::string router_policy_config;
  std::array<std::string, 4> role_policies;  // empty: not given on the command line
  double lease_ttl_secs = 120;
  std::uint64_t session_affinity_ttl_secs = 0;  // 0: off
  std::string session_affinity_mode = "hard";
  std::uint64_t first_token_timeout_ms = 30'000;
};

// Loads the policy YAML, applies flag/env precedence and resolves the policies; the error names
// the key (file, flag or variable) at fault.
std::expected<plugins::RouterPlugins, std::string> resolve_policies(
    const NodeCommandOptions& options) {
  plugins::RouterPluginRegistry registry;
  if (auto registered = selection::register_builtin_policies(registry); !registered) {
    return std::unexpected(std::string{registered.error().message()});
  }
  selection::RouterPolicyConfig config;
  if (!options.router_policy_config.empty()) {
    auto loaded = selection::load_router_policy_config(options.router_policy_config);
    if (!loaded) return std::unexpected("--router-policy-config: " + loaded.error());
    config = std::move(*loaded);
  }
  selection::SelectionOverrides overrides;
  for (WorkerType role : kAllWorkerTypes) {
    const std::string& value = options.role_policies[static_cast<std::size_t>(role)];
    if (!value.empty()) overrides.cli[static_cast<std::size_t>(role)] = value;
  }
  if (auto applied =
          selection::apply_selection_precedence(config, overrides, selection::process_environment);
      !applied) {
    return std::unexpected(applied.error());
  }
  auto plugins = registry.resolve_plugins(config);
  if (!plugins) return std::unexpected(std::string{plugins.error().message()});
  for (WorkerType role : kAllWorkerTypes) {
    spdlog::info("kvr node: {} workers selected by '{}' (type {}, from {})", as_str(role),
                 plugins->selection_for(role).instance_name, plugins->selection_for(role).type,
                 selection::selection_origin(config, role));
  }
  return std::move(*plugins);
}

int run_node(NodeCommandOptions options) {
  // Before any thread starts, so that every thread inherits the blocked signals.
  auto wait_for_signal = block_termination_signals();
  if (!std::isfinite(options.lease_ttl_secs) || options.lease_ttl_secs < 0.1 ||
      options.lease_ttl_secs > 86'400) {
    spdlog::error("kvr node: --router-lease-ttl-secs: {} is outside 0.1 .. 86400",
                  options.lease_ttl_secs);
    return 2;
  }
  options.node.lease_ttl = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::llround(options.lease_ttl_secs * 1000)));
  const auto mode = actors::parse_session_affinity_mode(options.session_affinity_mode);
  if (!mode) {
    spdlog::error("kvr node: --router-session-affinity-mode: '{}' is not hard or soft",
                  options.session_affinity_mode);
    return 2;
  }
  options.node.session_affinity.mode = *mode;
  if (options.session_affinity_ttl_secs > 0) {
    if (options.session_affinity_ttl_secs >
        static_cast<std::uint64_t>(actors::kMaxSessionAffinityTtl.count())) {
      spdlog::error("kvr node: --router-session-affinity-ttl-secs: {} exceeds {}",
                    options.session_affinity_ttl_secs, actors::kMaxSessionAffinityTtl.count());
      return 2;
    }
    options.node.session_affinity.ttl =
        std::chrono::seconds(static_cast<std::int64_t>(options.session_affinity_ttl_secs));
  }
  options.node.first_token_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
      std::min<std::uint64_t>(options.first_token_timeout_ms, std::uint64_t{1} << 40)));
  if (auto valid = options.node.validate(); !valid) {
    spdlog::error("kvr node: {}", valid.error());
    return 2;
  }
  auto plugins = resolve_policies(options);
  if (!plugins) {
    spdlog::error("kvr node: {}", plugins.error());
    return 2;
  }
  auto node = actors::RouterNode::start(options.node, std::move(*plugins));
  if (!node) {
    spdlog::error("kvr node: {}", node.error());
    return 2;
  }
  const int signal = wait_for_signal();
  spdlog::info("kvr node: signal {} received; stopping", signal);
  node->reset();
  spdlog::info("kvr node: stopped");
  return 0;
}

}  // namespace

void add_node_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "node",
      "run a router node: route decisions and proxied generation over NATS, and CAF actors");
  auto options = std::make_shared<NodeCommandOptions>();
  add_nats_options(*command, options->node.nats);
  options->node.nats.name = "kvr-node";
  options->node.nats.max_reconnects = -1;
  command->add_option("--namespace", options->node.ns, "subject namespace (kvr.<namespace>.…)")
      ->envname("KVR_NAMESPACE")
      ->capture_default_str();
  command
      ->add_option("--router-policy-config", options->router_policy_config,
                   "router-policy YAML: worker_selection per role, policy instances, classifier")
      ->envname("KVR_ROUTER_POLICY_CONFIG")
      ->check(CLI::ExistingFile);
  for (WorkerType role : kAllWorkerTypes) {
    const std::string flag{selection::role_selection_flag(role)};
    command->add_option(
        flag, options->role_policies[static_cast<std::size_t>(role)],
        fmt::format("policy instance or type for {} workers ('default': the built-in kv-cost); "
                    "overrides {}, {} and the YAML",
                    as_str(role), selection::role_selection_env_var(role),
                    selection::kGlobalSelectionEnvVar));
  }
  command
      ->add_option("--block-size", options->node.router.block_size,
                   "tokens per KV block; workers with another size are refused")
      ->envname("KVR_BLOCK_SIZE")
      ->capture_default_str()
      ->check(CLI::Range(1U, 4096U));
  command
      ->add_option("--router-lease-ttl-secs", options->lease_ttl_secs,
                   "an unreported booking (lease) is released after this many seconds")
      ->envname("KVR_ROUTER_LEASE_TTL_SECS")
      ->capture_default_str();
  command
      ->add_option("--router-session-affinity-ttl-secs", options->session_affinity_ttl_secs,
                   "session affinity: a session's binding to a worker expires after this many idle "
                   "seconds (0: session affinity off)")
      ->envname("KVR_ROUTER_SESSION_AFFINITY_TTL_SECS")
      ->capture_default_str();
  command
      ->add_option("--router-session-affinity-mode", options->session_affinity_mode,
                   "hard: a bound session goes exactly to its worker; soft: the binding is offered "
                   "to the policy as its affinity target")
      ->envname("KVR_ROUTER_SESSION_AFFINITY_MODE")
      ->capture_default_str()
      ->check(CLI::IsMember({"hard", "soft"}));
  command
      ->add_option("--router-first-token-timeout-ms", options->first_token_timeout_ms,
                   "generate mode: a worker that sends no first chunk within this time has failed "
                   "the request (retried once elsewhere)")
      ->envname("KVR_ROUTER_FIRST_TOKEN_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{86'400'000}));
  command
      ->add_option("--metrics-port", options->node.metrics_port,
                   "serve /metrics and /healthz on 127.0.0.1:P (0: off)")
      ->envname("KVR_METRICS_PORT")
      ->capture_default_str();
  command
      ->add_option("--actor-port", options->node.actor_port,
                   "publish the ingress actor on 127.0.0.1:P for CAF clients (0: not published)")
      ->envname("KVR_ACTOR_PORT")
      ->capture_default_str();
  command
      ->add_option("--scheduler-threads", options->node.scheduler_threads,
                   "CAF scheduler threads (0: one per core)")
      ->capture_default_str();
  command
      ->add_option("--temperature", options->node.router.temperature,
                   "default kv-cost softmax temperature (0: lowest cost wins)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->callback([options, &exit_code] { exit_code = run_node(*options); });
}

}  // namespace kvr::cli
