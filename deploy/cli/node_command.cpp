#include "deploy/cli/node_command.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/node/router_node.hpp"
#include "deploy/cli/cli_options.hpp"
#include "deploy/cli/stop_signals.hpp"
#include "discovery/catalog/worker_registration.hpp"
#include "messages/descriptor_limit.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/config/plugin_factories.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/partition/partition_queue.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/sdk/plugin_loader.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"

namespace kvr::cli {
namespace {

struct NodeCommandOptions {
  actors::NodeOptions node;
  std::string router_policy_config;
  std::vector<std::string> plugin_paths;     // --plugin, loaded before the YAML's `plugins`
  std::array<std::string, 4> role_policies;  // empty: not given on the command line
  double booking_ttl_secs = 120;
  SessionAffinityFlags session_affinity;
  std::uint64_t first_token_timeout_ms = 30'000;
  std::uint64_t stream_stall_timeout_ms = 30'000;
  std::uint64_t drain_timeout_ms = 20'000;
  std::int64_t engine_idle_ms = 4'000;
  // The HTTP API's client timeouts (FrontDoorOptions).
  std::int64_t http_idle_timeout_ms = 60'000;
  std::int64_t http_header_timeout_ms = 30'000;
  std::int64_t http_body_timeout_ms = 30'000;
  std::int64_t http_send_timeout_ms = 60'000;
  std::optional<std::uint32_t> block_size;  // unset: each partition learns its workers' size
  std::optional<std::uint16_t> metrics_port;
  std::optional<std::uint16_t> actor_port;
  std::optional<std::uint16_t> http_port;
  front_door::FrontDoorOptions http;
  std::optional<std::uint16_t> epp_port;
  std::string epp_address = "127.0.0.1";
  // The endpoint picker's stream bounds (the flags set the others' fields).
  front_door::EndpointPickerOptions epp;
  std::int64_t epp_request_timeout_ms = epp.request_timeout.count();
  std::int64_t epp_response_timeout_ms = epp.response_timeout.count();
  std::string tokenizer_mode = "engine";
  /// --tokenizer MODEL=PATH, repeatable.
  std::vector<std::string> tokenizers;
  std::optional<double> queue_threshold;  // unset: the class `default` never queues
  std::uint64_t cluster_lease_ttl_ms = 3000;
  /// --partition-shards MODEL=S, repeatable.
  std::vector<std::string> partition_shards;
  cluster::ShardingConfig shard_settings;
  bool check_config = false;  // --check-config: validate, build the factories, exit
};

// --partition-shards MODEL=S: the models split into shards, each with the --shard-* settings.
std::expected<std::map<std::string, cluster::ShardingConfig, std::less<>>, std::string>
parse_partition_shards(const std::vector<std::string>& flags, const cluster::ShardingConfig& base) {
  std::map<std::string, cluster::ShardingConfig, std::less<>> sharding;
  for (const std::string& flag : flags) {
    const std::size_t equals = flag.rfind('=');
    std::uint32_t shards = 0;
    const char* digits = flag.data() + equals + 1;
    if (equals == std::string::npos || equals == 0 ||
        std::from_chars(digits, flag.data() + flag.size(), shards).ptr !=
            flag.data() + flag.size()) {
      return std::unexpected(fmt::format("--partition-shards: '{}' is not MODEL=SHARDS", flag));
    }
    cluster::ShardingConfig config = base;
    config.shards = shards;
    if (auto invalid = cluster::validate(config)) {
      return std::unexpected(fmt::format("--partition-shards {}: {}", flag, *invalid));
    }
    sharding.insert_or_assign(flag.substr(0, equals), config);
  }
  return sharding;
}

// More scheduler threads than this only contend for the cores (and thousands take minutes to
// start): four per hardware thread, at most 256.
std::size_t max_scheduler_threads() {
  return std::clamp<std::size_t>(4 * std::size_t{std::thread::hardware_concurrency()}, 4, 256);
}

// Loads the policy YAML, applies flag/env precedence and resolves the policies; the error names
// the key (file, flag or variable) at fault.
// The native mode's tokenizers: the YAML's `tokenizers`, overridden by --tokenizer MODEL=PATH,
// each loaded now so that a bad file stops startup naming the model. A model that names the
// native mode explicitly needs one; a native default applies only to models with one.
std::expected<std::shared_ptr<const front_door::NativeTokenizers>, std::string>
load_native_tokenizers(const std::vector<std::string>& flags,
                       const std::map<std::string, std::string, std::less<>>& from_yaml,
                       const selection::TokenizerModes& modes,
                       const std::map<std::string, selection::ModelConfig, std::less<>>& models) {
  std::map<std::string, std::string, std::less<>> paths = from_yaml;
  for (const std::string& flag : flags) {
    const std::size_t equals = flag.find('=');
    if (equals == 0 || equals == std::string::npos || equals + 1 == flag.size()) {
      return std::unexpected(fmt::format("--tokenizer: '{}' is not MODEL=PATH", flag));
    }
    paths[flag.substr(0, equals)] = flag.substr(equals + 1);
  }
  for (const auto& [model, mode] : modes.per_model) {
    if (mode == selection::TokenizerMode::native && !paths.contains(model)) {
      return std::unexpected(fmt::format(
          "models.{}.tokenizer_mode: native needs the model's tokenizer (--tokenizer {}=PATH or "
          "tokenizers: in the router-policy YAML)",
          model, model));
    }
  }
  auto native = std::make_shared<front_door::NativeTokenizers>();
  for (const auto& [model, path] : paths) {
    const auto config = models.find(model);
    const bool content_as_text =
        config != models.end() && config->second.content_special_tokens_as_text;
    auto loaded = tokenizer::PromptTokenizer::load(path, {},
                                                   content_as_text
                                                       ? tokenizer::ContentSpecialTokens::text
                                                       : tokenizer::ContentSpecialTokens::special);
    if (!loaded) {
      return std::unexpected(fmt::format("--tokenizer {}: {}", model, loaded.error().message));
    }
    spdlog::info("kvr node: model '{}' has kvr's tokenizer {} ({} ids{})", model, path,
                 (*loaded)->tokenizer().vocab_size(),
                 (*loaded)->has_chat_template() ? ", chat template" : ", no chat template");
    native->emplace(model, std::move(*loaded));
  }
  if (!native->empty() && !modes.uses(selection::TokenizerMode::native)) {
    spdlog::warn("kvr node: tokenizers are given but no model uses --tokenizer-mode native");
  }
  return native;
}

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
  // Before the YAML's types are resolved: they may name a plugin's.
  if (auto loaded = plugins::load_plugins(options.plugin_paths, registry); !loaded) {
    return std::unexpected("--plugin: " + loaded.error());
  }
  if (auto loaded = plugins::load_plugins(config.plugins, registry); !loaded) {
    return std::unexpected("--router-policy-config: plugins: " + loaded.error());
  }
  for (const std::vector<std::string>* paths :
       {&options.plugin_paths, static_cast<const std::vector<std::string>*>(&config.plugins)}) {
    for (const std::string& path : *paths) spdlog::info("kvr node: loaded plugin {}", path);
  }
  selection::SelectionOverrides overrides;
  for (WorkerType role : kAllWorkerTypes) {
    const std::string& value = options.role_policies[static_cast<std::size_t>(role)];
    if (!value.empty()) overrides.cli[static_cast<std::size_t>(role)] = value;
  }
  auto applied =
      selection::apply_selection_precedence(config, overrides, selection::process_environment);
  if (!applied) return std::unexpected(applied.error());
  for (const std::string& notice : *applied) spdlog::warn("kvr node: {}", notice);
  auto plugins = registry.resolve_plugins(config);
  if (!plugins) return std::unexpected(std::string{plugins.error().message()});
  for (WorkerType role : kAllWorkerTypes) {
    spdlog::info("kvr node: {} workers selected by '{}' (type {}, from {})", as_str(role),
                 plugins->selection_for(role).instance_name, plugins->selection_for(role).type,
                 selection::selection_origin(config, role));
  }
  return std::move(*plugins);
}

// --check-config: every factory runs once for each model the configuration names (else for one
// model named `*`), as each partition's would when it is created; 0, or 2 naming the failure.
int check_config(const NodeCommandOptions& options, const plugins::RouterPlugins& plugins) {
  std::set<std::string> names;
  for (const auto& [model, config] : plugins.models) names.insert(model);
  for (const auto& [model, path] : plugins.tokenizers) names.insert(model);
  for (const auto& [model, sharding] : options.node.cluster.sharding) names.insert(model);
  if (names.empty()) names.emplace(selection::kCheckConfigModel);
  const std::vector<std::string> models(names.begin(), names.end());
  plugins::worker_selection::RouterConfig router = options.node.router;
  // Without --block-size a partition learns its workers' size; the default stands in for it.
  if (router.block_size == 0)
    router.block_size = plugins::worker_selection::RouterConfig{}.block_size;
  if (auto checked = selection::check_plugin_factories(plugins, router, models); !checked) {
    spdlog::error("kvr node: --check-config: {}", checked.error());
    return kUsageError;
  }
  spdlog::info("kvr node: --check-config: the configuration is valid ({} model{} checked)",
               models.size(), models.size() == 1 ? "" : "s");
  return 0;
}

int run_node(NodeCommandOptions options) {
  // Before any thread starts, so that every thread inherits the blocked signals.
  auto signals = StopSignals::install("kvr node");
  // 0: learnt per partition from the first registration
  options.node.router.block_size = options.block_size.value_or(0);
  options.node.metrics_port = options.metrics_port.value_or(0);
  options.node.actor_port = options.actor_port.value_or(0);
  options.node.queue_threshold = options.queue_threshold;
  options.node.cluster.lease_ttl = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::min<std::uint64_t>(options.cluster_lease_ttl_ms, 60'000)));
  options.node.booking_ttl = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::llround(options.booking_ttl_secs * 1000)));
  options.node.session_affinity = session_affinity_options(options.session_affinity);
  options.node.first_token_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
      std::min<std::uint64_t>(options.first_token_timeout_ms, std::uint64_t{1} << 40)));
  options.node.stream_stall_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
      std::min<std::uint64_t>(options.stream_stall_timeout_ms, std::uint64_t{1} << 40)));
  options.node.drain_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
      std::min<std::uint64_t>(options.drain_timeout_ms, std::uint64_t{1} << 40)));
  options.http.engine_connections.idle_limit = std::chrono::milliseconds(options.engine_idle_ms);
  options.http.idle_timeout = std::chrono::milliseconds(options.http_idle_timeout_ms);
  options.http.header_timeout = std::chrono::milliseconds(options.http_header_timeout_ms);
  options.http.body_timeout = std::chrono::milliseconds(options.http_body_timeout_ms);
  options.http.send_timeout = std::chrono::milliseconds(options.http_send_timeout_ms);
  // Every door's connection cap is set below the limit (HttpFrontDoor clamps to it): as high as
  // the process may take it.
  const DescriptorLimit descriptors = raise_descriptor_limit();
  spdlog::info("kvr node: {} file descriptors (hard limit {})", descriptors.soft, descriptors.hard);
  if (options.http_port) {
    options.node.http = options.http;
    options.node.http->port = *options.http_port;
    options.node.http->first_byte_timeout = options.node.first_token_timeout;
    options.node.http->stall_timeout = options.node.stream_stall_timeout;
    options.node.http->max_retries = options.node.max_retries;
  }
  const auto tokenizer_mode = selection::tokenizer_mode_from(options.tokenizer_mode);
  if (!tokenizer_mode) {
    spdlog::error("kvr node: --tokenizer-mode: '{}' is not a mode ({})", options.tokenizer_mode,
                  selection::tokenizer_mode_names());
    return kUsageError;
  }
  if (options.epp_port) {
    // Requests reach it through Envoy instead of the HTTP API: the same limits apply.
    options.node.epp = front_door::EndpointPickerOptions{
        .address = options.epp_address,
        .port = *options.epp_port,
        .max_body_bytes = options.http.max_body_bytes,
        .session_header = options.http.session_header,
        .max_renders_in_flight = options.http.max_renders_in_flight,
        .render_timeout = options.http.render_timeout,
        .request_timeout = std::chrono::milliseconds(options.epp_request_timeout_ms),
        .response_timeout = std::chrono::milliseconds(options.epp_response_timeout_ms),
        .max_streams_per_connection = options.epp.max_streams_per_connection,
        .max_open_streams = options.epp.max_open_streams,
        .max_buffered_body_bytes = options.epp.max_buffered_body_bytes,
        .grpc_memory_bytes = options.epp.grpc_memory_bytes,
        .max_json_depth = options.http.max_json_depth,
        .render_pool = options.http.render_pool};
  }
  auto sharding = parse_partition_shards(options.partition_shards, options.shard_settings);
  if (!sharding) {
    spdlog::error("kvr node: {}", sharding.error());
    return kUsageError;
  }
  if (!sharding->empty() && !options.node.cluster.enabled) {
    spdlog::error(
        "kvr node: --partition-shards: needs --cluster (each shard is leased as a "
        "partition)");
    return kUsageError;
  }
  options.node.cluster.sharding = std::move(*sharding);
  if (auto valid = options.node.validate(); !valid) {
    spdlog::error("kvr node: {}", valid.error());
    return kUsageError;
  }
  auto plugins = resolve_policies(options);
  if (!plugins) {
    spdlog::error("kvr node: {}", plugins.error());
    return kUsageError;
  }
  // The YAML's `models` override the flag per model.
  const selection::TokenizerModes modes =
      selection::tokenizer_modes(*tokenizer_mode, plugins->models);
  if (options.node.http) options.node.http->tokenizer_modes = modes;
  if (options.node.epp) options.node.epp->tokenizer_modes = modes;
  auto native =
      load_native_tokenizers(options.tokenizers, plugins->tokenizers, modes, plugins->models);
  if (!native) {
    spdlog::error("kvr node: {}", native.error());
    return kUsageError;
  }
  if (options.node.http) options.node.http->native_tokenizers = *native;
  if (options.node.epp) options.node.epp->native_tokenizers = *native;
  if (!plugins->policy_classes.empty() &&
      !queues_requests(classifiers::resolve_policy_classes(
          plugins->policy_classes,
          classifiers::default_policy_class(options.node.queue_threshold)))) {
    spdlog::warn(
        "kvr node: policy_classes are configured but none has a prefill_busy_threshold, "
        "prefill_busy_threshold_frac or kv_busy_threshold (nor --router-queue-threshold): "
        "requests never queue");
  }
  if (options.check_config) return check_config(options, *plugins);
  // A signal stops the node gracefully from the moment a client can see it: anyone who saw it
  // answer (a route, /healthz) may stop it and expect a clean exit.
  auto node = actors::RouterNode::start(options.node, std::move(*plugins),
                                        [&signals] { signals->ready(); });
  if (!node) {
    spdlog::error("kvr node: {}", node.error());
    return kUsageError;
  }
  const int signal = signals->wait();
  spdlog::info("kvr node: signal {} received; taking no new request, draining", signal);
  const std::size_t left = (*node)->drain(options.node.drain_timeout);
  if (left > 0) {
    spdlog::warn("kvr node: {} generate streams still in flight after the {} ms drain; ending them",
                 left, options.node.drain_timeout.count());
  }
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
  add_namespace_option(*command, options->node.ns);
  command
      ->add_option("--plugin", options->plugin_paths,
                   "a plugin library (built against the kvr SDK with KVR_PLUGIN_CATALOG) whose "
                   "policies and classifiers the router-policy YAML may name; repeatable")
      ->envname("KVR_PLUGINS")
      ->delimiter(',');
  command
      ->add_option("--router-policy-config", options->router_policy_config,
                   "router-policy YAML: worker_selection per role, policy instances, classifier")
      ->envname("KVR_ROUTER_POLICY_CONFIG")
      ->check(CLI::ExistingFile);
  command->add_flag(
      "--check-config", options->check_config,
      "check the configuration and exit without connecting: the flags, the "
      "router-policy YAML, plugins and tokenizers, and every worker-selection and "
      "request-classifier factory built once per model the configuration names; "
      "exit 0 when valid, else 2 naming the failure (key, or model, role and plugin)");
  for (WorkerType role : kAllWorkerTypes) {
    const std::string flag{selection::role_selection_flag(role)};
    const std::string description =
        selection::role_has_own_selection_override(role)
            ? fmt::format(
                  "policy instance or type for {} workers ('default': the built-in "
                  "kv-cost); overrides {}, {} and the YAML",
                  as_str(role), selection::role_selection_env_var(role),
                  selection::kGlobalSelectionEnvVar)
            : fmt::format("deprecated: {} workers take {} or worker_selection.{} of the YAML",
                          as_str(role), selection::kGlobalSelectionEnvVar, as_str(role));
    command->add_option(flag, options->role_policies[static_cast<std::size_t>(role)], description);
  }
  command
      ->add_option("--block-size", options->block_size,
                   "tokens per KV block, checked against every worker (workers with another size "
                   "are refused); unset: each model's partition takes its first worker's size")
      ->envname("KVR_BLOCK_SIZE")
      ->check(CLI::Range(1U, discovery::kMaxBlockSize));
  command
      ->add_option("--router-booking-ttl-secs", options->booking_ttl_secs,
                   "an unreported booking is released after this many seconds")
      ->envname("KVR_ROUTER_BOOKING_TTL_SECS")
      ->capture_default_str()
      ->check(finite_range(0.1, 86'400));
  command
      ->add_option("--router-max-open-bookings", options->node.node_caps.max_bookings,
                   "open bookings (routed requests not yet reported or expired, and generate "
                   "requests in flight) over all partitions; a route beyond it is refused as "
                   "overloaded")
      ->envname("KVR_ROUTER_MAX_OPEN_BOOKINGS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, actors::kMaxBookingCap));
  command
      ->add_option("--router-max-booked-blocks", options->node.node_caps.max_blocks,
                   "prompt KV blocks over all open bookings (each costs 27 to 47 bytes of memory "
                   "until its booking ends); a route beyond it is refused as overloaded")
      ->envname("KVR_ROUTER_MAX_BOOKED_BLOCKS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, actors::kMaxBookingCap));
  command
      ->add_option("--router-partition-max-open-bookings",
                   options->node.partition_caps.max_bookings,
                   "open bookings per partition (model and routing group); 0: only the node's cap")
      ->envname("KVR_ROUTER_PARTITION_MAX_OPEN_BOOKINGS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, actors::kMaxBookingCap));
  command
      ->add_option("--router-partition-max-booked-blocks", options->node.partition_caps.max_blocks,
                   "prompt KV blocks over a partition's open bookings; 0: only the node's cap")
      ->envname("KVR_ROUTER_PARTITION_MAX_BOOKED_BLOCKS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, actors::kMaxBookingCap));
  command
      ->add_option("--router-max-open-bookings-per-client", options->node.client_caps.max_bookings,
                   "open bookings of one client (a NATS connection, a remote actor) over all "
                   "partitions, so that a client that never reports cannot starve the others; "
                   "0: no per-client cap")
      ->envname("KVR_ROUTER_MAX_OPEN_BOOKINGS_PER_CLIENT")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, actors::kMaxBookingCap));
  command
      ->add_option("--router-max-booked-blocks-per-client", options->node.client_caps.max_blocks,
                   "prompt KV blocks over one client's open bookings; 0: no per-client cap")
      ->envname("KVR_ROUTER_MAX_BOOKED_BLOCKS_PER_CLIENT")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, actors::kMaxBookingCap));
  command
      ->add_option("--router-max-workers-per-partition", options->node.max_workers_per_partition,
                   "workers a partition admits; a registration of one more is refused")
      ->envname("KVR_ROUTER_MAX_WORKERS_PER_PARTITION")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}));
  command
      ->add_option("--router-max-rank-entries", options->node.max_rank_entries,
                   "data-parallel ranks of registered workers over all of the node's partitions "
                   "(under 1 KB each); a registration beyond them is refused")
      ->envname("KVR_ROUTER_MAX_RANK_ENTRIES")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{100'000'000}));
  add_session_affinity_options(*command, options->session_affinity);
  command
      ->add_option("--hit-rate-workload-tokens", options->node.hit_rate_workload_tokens,
                   "the hit-rate ceilings in /metrics (docs/hit-rate.md): the tokens each "
                   "partition's workload cache holds (at least its fleet's KV); 0: not measured")
      ->envname("KVR_HIT_RATE_WORKLOAD_TOKENS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, actors::kMaxHitRateWorkloadTokens));
  command
      ->add_option("--router-first-token-timeout-ms", options->first_token_timeout_ms,
                   "generate mode: a worker that sends no first chunk within this time has failed "
                   "the request (retried elsewhere: --router-max-retries)")
      ->envname("KVR_ROUTER_FIRST_TOKEN_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{86'400'000}));
  command
      ->add_option("--router-max-retries", options->node.max_retries,
                   "generate mode and the HTTP front door: retries of a request whose worker "
                   "failed before its first token, each on another worker")
      ->envname("KVR_ROUTER_MAX_RETRIES")
      ->capture_default_str()
      ->check(CLI::Range(std::uint32_t{0}, actors::kMaxRetries));
  command
      ->add_option("--drain-timeout-ms", options->drain_timeout_ms,
                   "on SIGTERM/SIGINT: take no new request and let the generate streams in flight "
                   "run for up to this long before ending them with an explicit error")
      ->envname("KVR_DRAIN_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{3'600'000}));
  command
      ->add_option("--router-stream-stall-timeout-ms", options->stream_stall_timeout_ms,
                   "generate mode: a response stream with no chunk for this long ends with an "
                   "explicit error (a stream timeout against its worker)")
      ->envname("KVR_ROUTER_STREAM_STALL_TIMEOUT_MS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{86'400'000}));
  command
      ->add_option("--router-queue-threshold", options->queue_threshold,
                   "queue requests at the router while every eligible worker's active prefill "
                   "tokens exceed this fraction of its max batched tokens (the class `default`; "
                   "policy_classes set their own); unset: no queueing")
      ->envname("KVR_ROUTER_QUEUE_THRESHOLD")
      ->check(CLI::Validator(
          [](const std::string& text) -> std::string {
            double value = 0;
            if (!CLI::detail::lexical_cast(text, value) || !(value > 0 && value <= 1)) {
              return "a fraction in (0, 1]";
            }
            return {};
          },
          "FRACTION in (0, 1]"));
  const std::string cluster_group = "Cluster";
  command
      ->add_flag("--cluster", options->node.cluster.enabled,
                 "join the router cluster of the namespace: partitions are placed across the "
                 "nodes (NATS JetStream key-value buckets; the server must run with -js), and "
                 "requests for partitions another node owns are forwarded to it")
      ->envname("KVR_CLUSTER")
      ->group(cluster_group);
  command
      ->add_option("--node-id", options->node.cluster.node_id,
                   "this node's id in the cluster, stable across restarts; unset: "
                   "<hostname>-<pid>")
      ->envname("KVR_NODE_ID")
      ->group(cluster_group);
  command
      ->add_option("--cluster-address", options->node.cluster.address,
                   "the address the cluster's CAF middleman binds to (peers forward requests "
                   "to it; see --peer-tls-cert)")
      ->envname("KVR_CLUSTER_ADDRESS")
      ->capture_default_str()
      ->group(cluster_group);
  command
      ->add_option("--cluster-port", options->node.cluster.port,
                   "the middleman's port; 0: any free one (peers learn it from the members "
                   "bucket)")
      ->envname("KVR_CLUSTER_PORT")
      ->capture_default_str()
      ->check(CLI::Range(0, 65'535))
      ->group(cluster_group);
  command
      ->add_option("--node-capacity", options->node.cluster.capacity,
                   "placement weight: a node of capacity 2 owns about twice the partitions")
      ->envname("KVR_NODE_CAPACITY")
      ->capture_default_str()
      ->check(finite_range(0.01, 1000))
      ->group(cluster_group);
  command
      ->add_option("--cluster-lease-ttl-ms", options->cluster_lease_ttl_ms,
                   "a partition lease not renewed for this long ages out and another node takes "
                   "it; the owner stops serving it two thirds of it after its last renewal")
      ->envname("KVR_CLUSTER_LEASE_TTL_MS")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{300}, std::uint64_t{60'000}))
      ->group(cluster_group);
  command
      ->add_option("--partition-shards", options->partition_shards,
                   "MODEL=S: split the model into S shards, each a partition of its own that owns "
                   "a share of the model's workers, so that several nodes decide its requests; "
                   "repeatable (docs/cluster.md)")
      ->envname("KVR_PARTITION_SHARDS")
      ->delimiter(',')
      ->group(cluster_group);
  command
      ->add_option("--shard-prefix-tokens", options->shard_settings.prefix_tokens,
                   "a request's shard is its prompt prefix's of this many tokens")
      ->envname("KVR_SHARD_PREFIX_TOKENS")
      ->capture_default_str()
      ->check(CLI::Range(1U, 1U << 20))
      ->group(cluster_group);
  command
      ->add_option("--shard-miss-cost", options->shard_settings.miss_cost,
                   "a request leaves its prefix's shard when another's least loaded worker is "
                   "ahead by more than this many times its prompt tokens")
      ->envname("KVR_SHARD_MISS_COST")
      ->capture_default_str()
      ->check(finite_range(0, 1000))
      ->group(cluster_group);
  command
      ->add_option("--metrics-port", options->metrics_port,
                   "serve /metrics and /healthz on 127.0.0.1:P, bound exclusively (a port in use "
                   "stops startup); unset: no HTTP endpoint")
      ->envname("KVR_METRICS_PORT")
      ->check(CLI::Range(1, 65'535));
  command
      ->add_option("--actor-port", options->actor_port,
                   "publish the ingress actor on --actor-address:P for CAF clients (see "
                   "--peer-tls-cert); unset: not published")
      ->envname("KVR_ACTOR_PORT")
      ->check(CLI::Range(1, 65'535));
  command
      ->add_option("--actor-address", options->node.actor_address,
                   "the address the ingress actor is published on")
      ->envname("KVR_ACTOR_ADDRESS")
      ->capture_default_str();
  // The actor port and the cluster port are both CAF's middleman: one identity for both.
  const std::string peer_group = "Peer ports (--actor-port, --cluster; docs/security.md)";
  command
      ->add_option("--peer-tls-cert", options->node.peers.tls.certificate,
                   "PEM certificate (chain) this node presents on the peer ports; mutual TLS: "
                   "peers must present one --peer-tls-ca signed")
      ->envname("KVR_PEER_TLS_CERT")
      ->group(peer_group);
  command
      ->add_option("--peer-tls-key", options->node.peers.tls.key,
                   "the certificate's PEM private key, unencrypted")
      ->envname("KVR_PEER_TLS_KEY")
      ->group(peer_group);
  command
      ->add_option("--peer-tls-ca", options->node.peers.tls.ca,
                   "PEM certificate of the CA that signs every peer's certificate")
      ->envname("KVR_PEER_TLS_CA")
      ->group(peer_group);
  command
      ->add_flag("--plaintext-peers", options->node.peers.plaintext,
                 "serve the peer ports without TLS, trusting every process that can reach them; "
                 "only on loopback addresses")
      ->envname("KVR_PLAINTEXT_PEERS")
      ->group(peer_group);
  command
      ->add_option("--peer-max-message-bytes", options->node.peers.frames.message_bytes,
                   "the largest message a plaintext peer may send; a larger one closes its "
                   "connection before it is read (until its handshake, 64 KiB)")
      ->envname("KVR_PEER_MAX_MESSAGE_BYTES")
      ->capture_default_str()
      ->group(peer_group);
  const std::string http_group = "OpenAI-compatible HTTP API";
  command
      ->add_option("--http-port", options->http_port,
                   "serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                   "/v1/models, /health) on this port; unset: not served")
      ->envname("KVR_HTTP_PORT")
      ->check(CLI::Range(1, 65'535))
      ->group(http_group);
  command
      ->add_option("--http-address", options->http.address,
                   "the address the HTTP API binds (an IP address)")
      ->envname("KVR_HTTP_ADDRESS")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--http-threads", options->http.threads,
                   "threads serving HTTP connections (each connection is a few KB, not a thread)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{64}))
      ->group(http_group);
  command
      ->add_option("--http-max-body-bytes", options->http.max_body_bytes,
                   "a request body above this is refused with 413")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 30))
      ->group(http_group);
  command
      ->add_option("--http-max-connections", options->http.max_connections,
                   "client connections at most (lowered to fit the descriptor limit, logged); "
                   "at the cap a new client takes the slot of the connection idle longest, or "
                   "is answered 503")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}))
      ->group(http_group);
  command
      ->add_option("--http-idle-timeout-ms", options->http_idle_timeout_ms,
                   "a kept-alive client connection idle this long between requests is closed")
      ->capture_default_str()
      ->check(CLI::Range(1, 86'400'000))
      ->group(http_group);
  command
      ->add_option("--http-header-timeout-ms", options->http_header_timeout_ms,
                   "a request's head must arrive whole within this (from a new connection's "
                   "accept, or a kept-alive one's first byte)")
      ->capture_default_str()
      ->check(CLI::Range(1, 86'400'000))
      ->group(http_group);
  command
      ->add_option("--http-body-timeout-ms", options->http_body_timeout_ms,
                   "a request body may take this long plus its size at --http-min-body-rate")
      ->capture_default_str()
      ->check(CLI::Range(1, 86'400'000))
      ->group(http_group);
  command
      ->add_option("--http-min-body-rate", options->http.min_body_bytes_per_second,
                   "bytes per second a request body must keep up after --http-body-timeout-ms")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 30))
      ->group(http_group);
  command
      ->add_option("--http-send-timeout-ms", options->http_send_timeout_ms,
                   "a write to a client that does not complete within this closes its "
                   "connection (and ends its request)")
      ->capture_default_str()
      ->check(CLI::Range(1, 86'400'000))
      ->group(http_group);
  command
      ->add_option("--http-max-pending-stream-bytes", options->http.max_pending_stream_bytes,
                   "a stream through kvr's generate API whose client lags this many bytes "
                   "behind is ended and its generation cancelled")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{4096}, std::size_t{1} << 30))
      ->group(http_group);
  command
      ->add_option("--http-engine-idle-connections", options->http.engine_connections.per_engine,
                   "idle keep-alive connections kept per engine for the next requests forwarded "
                   "to it (0: a new connection per request)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{0}, std::size_t{100'000}))
      ->group(http_group);
  command
      ->add_option("--http-engine-idle-ms", options->engine_idle_ms,
                   "an engine connection idle longer is closed, not reused (below the engine's "
                   "own keep-alive timeout: vLLM's is 5 s)")
      ->capture_default_str()
      ->check(CLI::Range(1, 3'600'000))
      ->group(http_group);
  command
      ->add_option("--http-session-header", options->http.session_header,
                   "the request header naming the session (session affinity)")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--tokenizer-mode", options->tokenizer_mode,
                   "how the HTTP API and the endpoint picker get a prompt's routing key, for "
                   "models the router-policy YAML's `models` leave unset: engine (an engine of "
                   "the model renders the request into token ids: vLLM's /v1/*/render, else "
                   "/tokenize), estimate (no tokenizer: the prompt's text is hashed in byte "
                   "blocks and matched against the router's own index of what it routed) or "
                   "native (kvr's own tokenizer and chat template, --tokenizer, once they agree "
                   "with an engine's rendering)")
      ->envname("KVR_TOKENIZER_MODE")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--tokenizer", options->tokenizers,
                   "MODEL=PATH: the tokenizer of MODEL for the native mode, a folder with "
                   "tokenizer.json and tokenizer_config.json (repeatable; overrides the "
                   "router-policy YAML's `tokenizers`)")
      ->group(http_group);
  command
      ->add_option("--http-max-renders-in-flight", options->http.max_renders_in_flight,
                   "render calls to engines at once; beyond it a request is refused with 503")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}))
      ->group(http_group);
  command
      ->add_option("--max-json-depth", options->http.max_json_depth,
                   "the deepest a request body may nest (objects and arrays; the body is the "
                   "first level); deeper bodies are refused with a 400 naming the field (both "
                   "front doors)")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--render-threads", options->http.render_pool.threads,
                   "threads rendering prompts in the native tokenizer mode, per front door "
                   "(0: one per core, at most 8)")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--render-queue", options->http.render_pool.max_queued,
                   "native renders that may wait for a render thread; beyond it a request is "
                   "refused with 503")
      ->capture_default_str()
      ->group(http_group);
  command
      ->add_option("--render-queue-per-client", options->http.render_pool.max_queued_per_client,
                   "native renders of one client (its IP address) that may wait; beyond it the "
                   "client's request is refused with 503 (clients take turns)")
      ->capture_default_str()
      ->group(http_group);
  const std::string epp_group = "Envoy endpoint picker (ext_proc)";
  command
      ->add_option("--epp-port", options->epp_port,
                   "serve the endpoint picker for Envoy (gRPC ext_proc, docs/gateway.md) on this "
                   "port; the --http-max-body-bytes, --http-session-header and "
                   "--http-max-renders-in-flight settings apply to it; unset: not served")
      ->envname("KVR_EPP_PORT")
      ->check(CLI::Range(1, 65'535))
      ->group(epp_group);
  command
      ->add_option("--epp-address", options->epp_address,
                   "the address the endpoint picker binds (an IP address)")
      ->envname("KVR_EPP_ADDRESS")
      ->capture_default_str()
      ->group(epp_group);
  command
      ->add_option("--epp-request-timeout-ms", options->epp_request_timeout_ms,
                   "a stream whose request headers and body have not arrived whole this long "
                   "after it opened is answered 408 and ended")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{3'600'000}))
      ->group(epp_group);
  command
      ->add_option("--epp-response-timeout-ms", options->epp_response_timeout_ms,
                   "a stream whose answer (routing, then the response through Envoy) has not "
                   "ended this long after its request arrived is ended, its booking released")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{604'800'000}))
      ->group(epp_group);
  command
      ->add_option("--epp-max-streams-per-connection", options->epp.max_streams_per_connection,
                   "streams one gRPC connection may have open at once (HTTP/2 "
                   "SETTINGS_MAX_CONCURRENT_STREAMS)")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{1'000'000}))
      ->group(epp_group);
  command
      ->add_option("--epp-max-open-streams", options->epp.max_open_streams,
                   "streams open over all connections; a new one beyond it is answered 503")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1}, std::size_t{10'000'000}))
      ->group(epp_group);
  command
      ->add_option("--epp-max-buffered-body-bytes", options->epp.max_buffered_body_bytes,
                   "request body bytes held over all streams while their requests arrive (at "
                   "least --http-max-body-bytes); a body beyond it is answered 503")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1024}, std::size_t{1} << 40))
      ->group(epp_group);
  command
      ->add_option("--epp-grpc-memory-bytes", options->epp.grpc_memory_bytes,
                   "memory gRPC itself may take for the endpoint picker's connections and calls "
                   "(at least twice --http-max-body-bytes plus 2 MiB); beyond it gRPC cancels "
                   "streams")
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{1} << 20, std::size_t{1} << 40))
      ->group(epp_group);
  const std::size_t max_threads = max_scheduler_threads();
  command
      ->add_option("--scheduler-threads", options->node.scheduler_threads,
                   fmt::format("CAF scheduler threads, at most 4 per core ({} here); 0: one per "
                               "core",
                               max_threads))
      ->capture_default_str()
      ->check(CLI::Range(std::size_t{0}, max_threads));
  command
      ->add_option("--temperature", options->node.router.temperature,
                   "default kv-cost softmax temperature (0: lowest cost wins)")
      ->capture_default_str()
      ->check(finite_range(0, 1e6));
  command->callback([options, &exit_code] { exit_code = run_node(*options); });
}

}  // namespace kvr::cli
