#include "deploy/bridge/engine_bridge.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "deploy/bridge/generate_forwarder.hpp"
#include "deploy/bridge/kv_translator.hpp"
#include "deploy/worker/worker_inbox.hpp"
#include "deploy/worker/worker_publisher.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/http_url.hpp"
#include "messages/metrics/metrics_http.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "messages/subjects.hpp"

namespace kvr::bridge {
namespace {

using Clock = std::chrono::steady_clock;

// What the other threads hand to the run loop.
struct BatchItem {
  DpRank rank;
  EngineKvEventBatch batch;
};
struct LostItem {
  DpRank rank;
};
struct DumpItem {
  nats::NatsMessage message;
};
struct DiscoverItem {};
// The engine's ZMQ publisher of `rank` restarted; the batches queued after this are the new one's.
struct RestartItem {
  DpRank rank;
};
// What the prober thread learnt from the engine's HTTP server.
struct HealthItem {
  bool healthy = false;
};
struct MetricsItem {
  std::string text;
};
// The engine's /v1/models answer, read again while registered: LoRA adapters come and go at run
// time (vLLM's /v1/load_lora_adapter).
struct ModelsItem {
  std::string text;
};
using InboxItem = std::variant<BatchItem, LostItem, DumpItem, DiscoverItem, RestartItem, HealthItem,
                               MetricsItem, ModelsItem>;

// How often a registered bridge reads /v1/models again for the engine's LoRA adapters.
constexpr std::chrono::seconds kModelsInterval{2};

// The LoRA adapters in a /v1/models `data` array: the entries whose parent is `model`.
std::vector<std::string> lora_adapters_of(const nlohmann::json& data, const std::string& model) {
  std::vector<std::string> adapters;
  for (const auto& entry : data) {
    const auto parent = entry.find("parent");
    const auto id = entry.find("id");
    if (parent == entry.end() || !parent->is_string() || *parent != model) continue;
    if (id != entry.end() && id->is_string() && !id->get<std::string>().empty()) {
      adapters.push_back(id->get<std::string>());
    }
  }
  std::ranges::sort(adapters);
  adapters.erase(std::unique(adapters.begin(), adapters.end()), adapters.end());
  return adapters;
}

// The bridge's metric families: name, help, and whether it is a counter (else a gauge).
struct BridgeMetric {
  std::string_view name;
  std::string_view help;
  bool counter = true;
};
constexpr BridgeMetric kBridgeMetrics[] = {
    {"kvr_bridge_registered", "1 while the worker is registered (the engine answers /health)",
     false},
    {"kvr_bridge_registrations_total", "registrations of a new incarnation"},
    {"kvr_bridge_engine_restarts_total",
     "engine restarts seen between health probes, by signal (zmq_sequence: a rank's sequence "
     "numbers went back; start_time: process_start_time_seconds changed)"},
    {"kvr_bridge_zmq_messages_total",
     "KV event messages received from the engine (live and "
     "replayed)"},
    {"kvr_bridge_malformed_frames_total",
     "ZMQ messages without three frames or an 8-byte sequence number (dropped)"},
    {"kvr_bridge_malformed_payloads_total", "msgpack payloads the decoder rejected (dropped)"},
    {"kvr_bridge_stale_messages_total", "messages whose sequence number was seen before (dropped)"},
    {"kvr_bridge_sequence_gaps_total", "sequence gaps detected"},
    {"kvr_bridge_replays_total", "replays asked of the engine, by outcome (filled or failed)"},
    {"kvr_bridge_ranks_cleared_total", "ranks cleared because missed events could not be replayed"},
    {"kvr_bridge_unknown_removed_blocks_total",
     "removed engine hashes the bridge did not know (skipped)"},
    {"kvr_bridge_skipped_events_total",
     "engine events not forwarded, by reason (unknown_parent, bad_stored, unknown_medium, "
     "refused, other_group, unknown_type)"},
    {"kvr_bridge_kv_batches_published_total", "kvr KvEventBatches published"},
    {"kvr_bridge_blocks_stored_total", "blocks forwarded in Stored events"},
    {"kvr_bridge_blocks_removed_total", "blocks forwarded in Removed events"},
    {"kvr_bridge_load_reports_total", "LoadMetrics published"},
    {"kvr_bridge_dumps_served_total", "KV dumps served"},
    {"kvr_bridge_generate_requests_total",
     "generate requests by outcome (completed, cancelled, failed, refused)"},
};

// Counters of subscribers and translators that were replaced (one per engine incarnation).
struct RetiredTotals {
  ZmqSubscriberStats zmq;
  TranslatorStats translator;
  std::uint64_t other_group_events = 0;
  std::uint64_t unknown_events = 0;
};

// What the engine said when it last came up.
struct EngineFacts {
  std::string model;
  std::uint32_t block_size = 0;
  // KV capacity per rank; nullopt: neither the engine nor --num-gpu-blocks says.
  std::optional<std::uint64_t> num_gpu_blocks;
  // process_start_time_seconds, when the engine publishes it.
  std::optional<double> start_time;
  // Sorted.
  std::vector<std::string> lora_adapters;
};

}  // namespace

std::expected<void, std::string> BridgeOptions::validate() const {
  if (!subjects::is_valid_namespace(ns)) {
    return std::unexpected("--namespace must be non-empty and use only [A-Za-z0-9_-]");
  }
  if (const std::string why = invalid_http_url(engine_url); !why.empty()) {
    return std::unexpected("--engine-url '" + engine_url + "' " + why);
  }
  if (!advertise_url.empty()) {
    if (const std::string why = invalid_http_url(advertise_url); !why.empty()) {
      return std::unexpected("--advertise-url '" + advertise_url + "' " + why);
    }
  }
  if (kv_events.empty()) return std::unexpected("--kv-events must not be empty");
  if (data_parallel_size == 0 || data_parallel_size > 64) {
    return std::unexpected("--data-parallel-size must be in [1, 64]");
  }
  if (liveness_ttl < std::chrono::milliseconds(100)) {
    return std::unexpected("--liveness-ttl-ms must be at least 100");
  }
  if (load_interval < std::chrono::milliseconds(10)) {
    return std::unexpected("--load-interval-ms must be at least 10");
  }
  if (max_concurrent_generates == 0 || max_concurrent_generates > 4096) {
    return std::unexpected("--max-concurrent-generates must be in [1, 4096]");
  }
  // kvr's two hops pass vLLM's kv_transfer_params from the prefill's answer to the decode request;
  // SGLang's P/D instead sends one request to both servers at once, which no kvr hop can do.
  if (engine == EngineKind::sglang && (role == WorkerType::Prefill || role == WorkerType::Decode)) {
    return std::unexpected("--role " + std::string{as_str(role)} +
                           " needs --engine vllm: kvr's prefill/decode hops pass vLLM's "
                           "kv_transfer_params, and SGLang's P/D exchange (bootstrap_host, "
                           "bootstrap_port, bootstrap_room) is not supported");
  }
  for (DpRank rank = 0; rank < data_parallel_size; ++rank) {
    if (auto endpoint = endpoint_for_rank(kv_events, rank); !endpoint) {
      return std::unexpected("--kv-events: " + endpoint.error());
    }
    if (!kv_events_replay.empty()) {
      if (auto endpoint = endpoint_for_rank(kv_events_replay, rank); !endpoint) {
        return std::unexpected("--kv-events-replay: " + endpoint.error());
      }
    }
  }
  return {};
}

struct EngineBridge::State {
  BridgeOptions options;
  // Bad input from the network or the engine is counted, and logged at most once per kind and
  // window (thread-safe: the ZMQ and NATS threads log here too).
  metrics::RateLimitedLog log;
  std::unique_ptr<nats::NatsClient> nats;
  // Speaks the worker side of the protocol on `nats`.
  std::optional<worker::WorkerPublisher> publisher;
  std::vector<nats::NatsSubscription> subscriptions;
  WorkerId worker_id = 0;
  Incarnation incarnation = 0;
  std::mt19937_64 random{std::random_device{}()};

  worker::WorkerInbox<InboxItem> inbox;

  // Set while registered (the engine answers).
  std::optional<EngineFacts> facts;
  std::optional<KvTranslator> translator;
  std::unique_ptr<ZmqKvSubscriber> subscriber;
  // Serves generate requests on its own threads; publishes through `nats`.
  std::unique_ptr<GenerateForwarder> generator;
  std::shared_ptr<metrics::MetricsRegistry> registry = std::make_shared<metrics::MetricsRegistry>();
  std::unique_ptr<metrics::MetricsHttpServer> metrics_server;
  std::atomic<bool> registered{false};
  RetiredTotals retired;
  // Events the decoder dropped (other KV cache groups, unknown tags), of the current translator.
  std::uint64_t other_group_events = 0;
  std::uint64_t unknown_events = 0;
  bool logged_waiting = false;
  // Whether the bridge said that its worker registers without a KV capacity (once per run).
  bool logged_no_capacity = false;
  // Whether the current incarnation was started by a restart seen between health probes, and the
  // ranks whose own restart signal has been seen since: a later signal of another rank belongs to
  // the same restart (only that rank is cleared), a second one of a seen rank is a new restart.
  bool restart_incarnation = false;
  std::vector<bool> restarted_ranks;
  std::uint64_t restarts_by_sequence = 0;
  std::uint64_t restarts_by_start_time = 0;
  BridgeStats stats;

  void enqueue(InboxItem item) { inbox.push(std::move(item)); }

  worker::WorkerInstance instance() const { return {worker_id, incarnation}; }

  httplib::Client http() const {
    httplib::Client client{options.engine_url};
    const auto timeout =
        std::chrono::duration_cast<std::chrono::microseconds>(options.http_timeout);
    client.set_connection_timeout(0, static_cast<time_t>(timeout.count()));
    client.set_read_timeout(0, static_cast<time_t>(timeout.count()));
    return client;
  }

  std::optional<std::string> get(const std::string& path) const {
    auto client = http();
    auto result = client.Get(path);
    if (!result || result->status != 200) return std::nullopt;
    return std::move(result->body);
  }

  // Why the engine's metrics gave no KV cache configuration, for the warnings.
  std::string_view no_config_reason() const {
    return options.engine == EngineKind::vllm ? "vllm:cache_config_info does not give it"
                                              : "SGLang does not publish it";
  }

  // Asks the engine what it serves; nullopt (logged) while it cannot say. The block size is
  // required (routers hash prompts in blocks of it); the KV capacity is not.
  std::optional<EngineFacts> discover_engine() {
    EngineFacts engine;
    const auto models = get("/v1/models");
    if (!models) return std::nullopt;
    try {
      const auto json = nlohmann::json::parse(*models);
      const auto& data = json.at("data");
      if (options.model.empty()) {
        engine.model = data.at(0).at("id").get<std::string>();
      } else {
        engine.model = options.model;
        bool served = false;
        for (const auto& entry : data) served = served || entry.value("id", "") == options.model;
        if (!served) spdlog::warn("kvr bridge: the engine does not list model '{}'", options.model);
      }
      engine.lora_adapters = lora_adapters_of(data, engine.model);
      for (const auto& entry : data) {
        if (entry.value("id", "") == engine.model && entry.contains("max_model_len")) {
          spdlog::info("kvr bridge: model '{}' with max length {}", engine.model,
                       entry.at("max_model_len").dump());
        }
      }
    } catch (const nlohmann::json::exception& error) {
      spdlog::warn("kvr bridge: unreadable /v1/models answer: {}", error.what());
      return std::nullopt;
    }
    engine.block_size = options.block_size;
    if (options.num_gpu_blocks != 0) engine.num_gpu_blocks = options.num_gpu_blocks;
    if (const auto metrics = get("/metrics")) {
      const auto samples = parse_prometheus_text(*metrics);
      const auto config = engine_cache_config(samples);
      if (engine.block_size == 0) engine.block_size = config.block_size.value_or(0);
      if (!engine.num_gpu_blocks && config.num_gpu_blocks.value_or(0) != 0) {
        engine.num_gpu_blocks = config.num_gpu_blocks;
      }
      engine.start_time = engine_start_time(samples);
    }
    if (engine.block_size == 0) {
      // Asked again at every health probe: said once per log window, not at each.
      log.warn("no-block-size",
               fmt::format("kvr bridge: the engine at {} reports no KV block size ({}); pass "
                           "--block-size. Not registering until then: routers cannot hash "
                           "prompts without it",
                           options.engine_url, no_config_reason()));
      return std::nullopt;
    }
    return engine;
  }

  // Registers the current incarnation with what the engine reported (the engine's batch budget
  // and concurrency are not known to the bridge: not sent).
  void publish_registration() {
    publisher->publish_registration(
        instance(), worker::WorkerDescription{.model = facts->model,
                                              .role = options.role,
                                              .routing_group = options.routing_group,
                                              .block_size = facts->block_size,
                                              .total_kv_blocks = facts->num_gpu_blocks,
                                              .data_parallel_size = options.data_parallel_size,
                                              .taints = options.taints,
                                              .publishes_kv_events = true,
                                              .liveness_ttl = options.liveness_ttl,
                                              .http_url = options.advertised_url(),
                                              .lora_adapters = facts->lora_adapters});
  }

  // A new incarnation with a fresh translator (the router drops the old one's KV picture when
  // it registers); false, logged, when the translator cannot be made.
  bool new_incarnation() {
    incarnation = random() | 1;
    auto created =
        KvTranslator::create(TranslatorOptions{.worker_id = worker_id,
                                               .incarnation = incarnation,
                                               .block_size = facts->block_size,
                                               .data_parallel_size = options.data_parallel_size,
                                               .capacity_blocks = facts->num_gpu_blocks});
    if (!created) {
      spdlog::error("kvr bridge: {}", created.error());
      return false;
    }
    translator = std::move(*created);
    restart_incarnation = false;
    restarted_ranks.assign(options.data_parallel_size, false);
    return true;
  }

  void register_worker(EngineFacts engine) {
    facts = std::move(engine);
    if (!new_incarnation()) {
      facts.reset();
      return;
    }
    // A fresh subscriber per engine start: the engine's sequence numbers restart with it.
    auto subscriber_or = ZmqKvSubscriber::start(
        ZmqSubscriberOptions{.endpoint = options.kv_events,
                             .replay_endpoint = options.kv_events_replay,
                             .topic = options.topic,
                             .data_parallel_size = options.data_parallel_size,
                             .receive_high_water_mark = options.zmq_high_water_mark},
        ZmqSubscriberCallbacks{
            .on_batch =
                [this](DpRank rank, EngineKvEventBatch batch) {
                  enqueue(BatchItem{rank, std::move(batch)});
                },
            .on_lost = [this](DpRank rank) { enqueue(LostItem{rank}); },
            .on_restart = [this](DpRank rank) { enqueue(RestartItem{rank}); },
            .on_malformed =
                [this](DpRank rank, const DecodeError& error) {
                  log.warn("malformed-kv-events",
                           fmt::format("kvr bridge: dropped a malformed KV event payload of rank "
                                       "{}: {}",
                                       rank, error.message()));
                }});
    if (!subscriber_or) {
      spdlog::error("kvr bridge: {}", subscriber_or.error());
      facts.reset();
      translator.reset();
      return;
    }
    subscriber = std::move(*subscriber_or);
    generator->set_model(facts->model);
    publish_registration();
    publish_heartbeat();
    ++stats.registrations;
    logged_waiting = false;
    spdlog::info(
        "kvr bridge: worker {} registered for {} engine at {} (model '{}', block size {}, {} KV "
        "blocks per rank, {} ranks)",
        worker_id, as_str(options.engine), options.engine_url, facts->model, facts->block_size,
        facts->num_gpu_blocks ? std::to_string(*facts->num_gpu_blocks) : "unknown",
        options.data_parallel_size);
    if (!facts->num_gpu_blocks && !logged_no_capacity) {
      logged_no_capacity = true;
      spdlog::warn(
          "kvr bridge: the engine reports no KV capacity ({}) and --num-gpu-blocks is not given: "
          "worker {} is registered without one. Routers then never count it as full by KV (a "
          "policy class's kv_busy_threshold) and leave it out of the fleet's KV usage "
          "(kv-capacity-pause) and KV total (the hit-rate capacity ceiling); its load reports "
          "carry no KV blocks used. Pass --num-gpu-blocks to have them",
          no_config_reason(), worker_id);
    }
  }

  void retire_counters() {
    retire_subscriber_counters();
    retire_translator_counters();
  }

  void retire_subscriber_counters() {
    if (subscriber) {
      const ZmqSubscriberStats zmq = subscriber->stats();
      retired.zmq.messages += zmq.messages;
      retired.zmq.batches += zmq.batches;
      retired.zmq.malformed_frames += zmq.malformed_frames;
      retired.zmq.malformed_payloads += zmq.malformed_payloads;
      retired.zmq.stale_messages += zmq.stale_messages;
      retired.zmq.gaps += zmq.gaps;
      retired.zmq.replays_filled += zmq.replays_filled;
      retired.zmq.replays_failed += zmq.replays_failed;
      retired.zmq.restarts += zmq.restarts;
    }
  }

  void retire_translator_counters() {
    if (translator) {
      const TranslatorStats& t = translator->stats();
      retired.translator.batches_translated += t.batches_translated;
      retired.translator.blocks_stored += t.blocks_stored;
      retired.translator.blocks_removed += t.blocks_removed;
      retired.translator.ranks_cleared += t.ranks_cleared;
      retired.translator.unknown_removed_blocks += t.unknown_removed_blocks;
      retired.translator.unknown_parents += t.unknown_parents;
      retired.translator.bad_stored_events += t.bad_stored_events;
      retired.translator.unknown_media += t.unknown_media;
      retired.translator.refused_events += t.refused_events;
      retired.translator.bad_rank_batches += t.bad_rank_batches;
    }
    retired.other_group_events += other_group_events;
    retired.unknown_events += unknown_events;
    other_group_events = 0;
    unknown_events = 0;
  }

  // Copies every counter into the registry that /metrics renders.
  void refresh_metrics() {
    if (!metrics_server) return;
    ZmqSubscriberStats zmq = retired.zmq;
    if (subscriber) {
      const ZmqSubscriberStats now = subscriber->stats();
      zmq.messages += now.messages;
      zmq.malformed_frames += now.malformed_frames;
      zmq.malformed_payloads += now.malformed_payloads;
      zmq.stale_messages += now.stale_messages;
      zmq.gaps += now.gaps;
      zmq.replays_filled += now.replays_filled;
      zmq.replays_failed += now.replays_failed;
    }
    TranslatorStats t = retired.translator;
    if (translator) {
      const TranslatorStats& now = translator->stats();
      t.blocks_stored += now.blocks_stored;
      t.blocks_removed += now.blocks_removed;
      t.unknown_removed_blocks += now.unknown_removed_blocks;
      t.unknown_parents += now.unknown_parents;
      t.bad_stored_events += now.bad_stored_events;
      t.unknown_media += now.unknown_media;
      t.refused_events += now.refused_events;
    }
    const auto as_double = [](std::uint64_t value) { return static_cast<double>(value); };
    auto& r = *registry;
    r.set("kvr_bridge_registered", {}, facts ? 1.0 : 0.0);
    r.set("kvr_bridge_registrations_total", {}, as_double(stats.registrations));
    r.set("kvr_bridge_engine_restarts_total", {{"signal", "zmq_sequence"}},
          as_double(restarts_by_sequence));
    r.set("kvr_bridge_engine_restarts_total", {{"signal", "start_time"}},
          as_double(restarts_by_start_time));
    r.set("kvr_bridge_zmq_messages_total", {}, as_double(zmq.messages));
    r.set("kvr_bridge_malformed_frames_total", {}, as_double(zmq.malformed_frames));
    r.set("kvr_bridge_malformed_payloads_total", {}, as_double(zmq.malformed_payloads));
    r.set("kvr_bridge_stale_messages_total", {}, as_double(zmq.stale_messages));
    r.set("kvr_bridge_sequence_gaps_total", {}, as_double(zmq.gaps));
    r.set("kvr_bridge_replays_total", {{"outcome", "filled"}}, as_double(zmq.replays_filled));
    r.set("kvr_bridge_replays_total", {{"outcome", "failed"}}, as_double(zmq.replays_failed));
    r.set("kvr_bridge_ranks_cleared_total", {}, as_double(stats.ranks_lost));
    r.set("kvr_bridge_unknown_removed_blocks_total", {}, as_double(t.unknown_removed_blocks));
    const std::pair<std::string_view, std::uint64_t> skipped[] = {
        {"unknown_parent", t.unknown_parents},
        {"bad_stored", t.bad_stored_events},
        {"unknown_medium", t.unknown_media},
        {"refused", t.refused_events},
        {"other_group", retired.other_group_events + other_group_events},
        {"unknown_type", retired.unknown_events + unknown_events}};
    for (const auto& [reason, count] : skipped) {
      r.set("kvr_bridge_skipped_events_total", {{"reason", std::string{reason}}}, as_double(count));
    }
    r.set("kvr_bridge_kv_batches_published_total", {}, as_double(stats.kv_batches_published));
    r.set("kvr_bridge_blocks_stored_total", {}, as_double(t.blocks_stored));
    r.set("kvr_bridge_blocks_removed_total", {}, as_double(t.blocks_removed));
    r.set("kvr_bridge_load_reports_total", {}, as_double(stats.load_reports));
    r.set("kvr_bridge_dumps_served_total", {}, as_double(stats.dumps_served));
    const GenerateForwarderStats g = generator->stats();
    const std::pair<std::string_view, std::uint64_t> outcomes[] = {{"completed", g.completed},
                                                                   {"cancelled", g.cancelled},
                                                                   {"failed", g.failed},
                                                                   {"refused", g.refused}};
    for (const auto& [outcome, count] : outcomes) {
      r.set("kvr_bridge_generate_requests_total", {{"outcome", std::string{outcome}}},
            as_double(count));
    }
  }

  void deregister_worker(std::string_view reason) {
    retire_counters();
    if (subscriber) {
      stats.malformed_payloads += subscriber->stats().malformed_payloads;
      subscriber->stop();
      subscriber.reset();
    }
    publisher->publish_deregistration(instance(), reason);
    facts.reset();
    translator.reset();
    ++stats.deregistrations;
    // Batches queued by the stopped subscriber belong to the gone incarnation.
    inbox.erase_if([](const InboxItem& item) {
      return std::holds_alternative<BatchItem>(item) || std::holds_alternative<LostItem>(item) ||
             std::holds_alternative<RestartItem>(item);
    });
  }

  // The engine restarted while it kept answering (faster than the health probe): the old
  // incarnation is deregistered and a new one registered with a fresh translator. The subscriber
  // keeps running, so the new engine's first batches, queued after the restart signal, are not
  // lost; they are translated for the new incarnation. `observed_start` is the start time that
  // revealed the restart, if that was the signal.
  void restart_worker(std::string_view signal, std::optional<double> observed_start) {
    ++stats.engine_restarts;
    (signal == "start_time" ? restarts_by_start_time : restarts_by_sequence) += 1;
    const Incarnation old = incarnation;
    retire_translator_counters();
    translator.reset();
    publisher->publish_deregistration({worker_id, old}, "engine restarted");
    ++stats.deregistrations;
    // What the new engine serves; the old facts when it cannot say right now.
    if (auto engine = discover_engine()) {
      facts = std::move(*engine);
    } else {
      // Unknown until the next scrape records it (which then is no restart).
      facts->start_time = observed_start;
    }
    if (!new_incarnation()) {
      deregister_worker("no translator for the restarted engine");
      return;
    }
    restart_incarnation = true;
    generator->set_model(facts->model);
    publish_registration();
    publish_heartbeat();
    ++stats.registrations;
    spdlog::warn(
        "kvr bridge: the engine at {} restarted between health probes ({}); worker {} "
        "deregistered incarnation {:x} and registered {:x} with a fresh KV picture",
        options.engine_url,
        signal == "start_time" ? "its process_start_time_seconds changed"
                               : "its KV event sequence numbers started over",
        worker_id, old, incarnation);
  }

  void handle_restart(DpRank rank) {
    if (!translator || rank >= restarted_ranks.size()) return;
    if (restart_incarnation && !restarted_ranks[rank]) {
      // The restart that started this incarnation, seen on another rank (or through the start
      // time) first: this rank's batches before the signal were the old engine's.
      restarted_ranks[rank] = true;
      spdlog::info("kvr bridge: rank {} of the restarted engine numbers its KV events anew", rank);
      publish_batch(translator->clear_rank(rank));
      return;
    }
    restart_worker("zmq_sequence", std::nullopt);
    restarted_ranks[rank] = true;
  }

  void publish_heartbeat() { publisher->publish_heartbeat(instance()); }

  void publish_load(const std::string& metrics) {
    if (!facts) return;
    const auto samples = parse_prometheus_text(metrics);
    if (const auto start = engine_start_time(samples)) {
      if (facts->start_time && *facts->start_time != *start) {
        restart_worker("start_time", start);
        if (!facts) return;
      } else {
        facts->start_time = start;
      }
    }
    std::vector<discovery::ConfirmedLoad> reports;
    for (const auto& rank : engine_load(samples, options.engine, options.data_parallel_size)) {
      // The engine's usage is a fraction: without a capacity it makes no block count, and 0 is
      // sent (routers read no KV usage of a worker without a capacity anyway).
      const double usage = rank.kv_usage.value_or(0.0);
      const double capacity = static_cast<double>(facts->num_gpu_blocks.value_or(0));
      reports.push_back(discovery::ConfirmedLoad{
          .active_requests = rank.running + rank.waiting,
          .waiting_requests = rank.waiting,
          .kv_blocks_used = static_cast<std::uint64_t>(usage * capacity + 0.5)});
    }
    publisher->publish_load(instance(), reports);
    ++stats.load_reports;
  }

  void publish_batch(const std::optional<KvEventBatch>& batch) {
    if (!batch) return;
    publisher->publish_kv_batch(*batch);
    ++stats.kv_batches_published;
  }

  void serve_dump(const nats::NatsMessage& message) {
    const auto rank = worker::read_dump_request(message, options.data_parallel_size);
    if (!rank) {
      ++stats.bad_messages;
      return;
    }
    // Unregistered: an empty dump of no incarnation; the router has dropped the worker anyway.
    KvDump dump{.worker = {worker_id, *rank}, .incarnation = incarnation};
    if (translator) {
      if (auto picture = translator->dump(*rank)) dump = std::move(*picture);
    }
    publisher->publish_dump(message.reply, dump);
    ++stats.dumps_served;
  }

  void handle(InboxItem& item) {
    if (auto* batch = std::get_if<BatchItem>(&item)) {
      other_group_events += batch->batch.other_group_events;
      unknown_events += batch->batch.unknown_events;
      if (translator) publish_batch(translator->translate(batch->rank, batch->batch));
    } else if (auto* lost = std::get_if<LostItem>(&item)) {
      if (!translator) return;
      ++stats.ranks_lost;
      spdlog::warn("kvr bridge: rank {} missed KV events the engine cannot replay; cleared",
                   lost->rank);
      publish_batch(translator->clear_rank(lost->rank));
    } else if (auto* dump = std::get_if<DumpItem>(&item)) {
      serve_dump(dump->message);
    } else if (auto* restart = std::get_if<RestartItem>(&item)) {
      handle_restart(restart->rank);
    } else if (auto* health = std::get_if<HealthItem>(&item)) {
      handle_health(health->healthy);
    } else if (auto* metrics = std::get_if<MetricsItem>(&item)) {
      publish_load(metrics->text);
    } else if (auto* models = std::get_if<ModelsItem>(&item)) {
      update_adapters(models->text);
    } else if (facts) {
      publish_registration();
    }
  }

  // Re-registers when the engine's LoRA adapters changed (a refresh: the index stays).
  void update_adapters(const std::string& text) {
    if (!facts) return;
    const auto json = nlohmann::json::parse(text, nullptr, false);
    if (!json.is_object() || !json.contains("data") || !json["data"].is_array()) {
      log.warn("models", "kvr bridge: unreadable /v1/models answer");
      return;
    }
    auto adapters = lora_adapters_of(json["data"], facts->model);
    if (adapters == facts->lora_adapters) return;
    spdlog::info("kvr bridge: the engine's LoRA adapters are now [{}]", fmt::join(adapters, ", "));
    facts->lora_adapters = std::move(adapters);
    publish_registration();
  }

  void handle_health(bool healthy) {
    if (healthy && !facts) {
      if (auto engine = discover_engine()) register_worker(std::move(*engine));
    } else if (!healthy && facts) {
      spdlog::warn("kvr bridge: the engine at {} stopped answering /health; deregistered",
                   options.engine_url);
      deregister_worker("engine stopped answering");
    } else if (!healthy && !logged_waiting) {
      spdlog::info("kvr bridge: waiting for the engine at {} to answer /health",
                   options.engine_url);
      logged_waiting = true;
    }
  }

  // The prober thread: asks /health every health interval and, while registered, /metrics every
  // load interval, and queues the answers, so that the run loop, which forwards KV events, never
  // waits on the engine's HTTP server.
  void probe(const std::stop_token& stop) {
    std::mutex mutex;
    std::condition_variable_any wake;
    auto next_health = Clock::now();
    auto next_load = Clock::now();
    auto next_models = Clock::now() + kModelsInterval;
    while (!stop.stop_requested()) {
      auto now = Clock::now();
      if (now >= next_health) {
        enqueue(HealthItem{get("/health").has_value()});
        now = Clock::now();
        next_health = now + options.health_interval;
      }
      if (now >= next_load) {
        // (Registration happens on the run loop: looked at every load interval.)
        if (registered) {
          if (auto text = get("/metrics")) enqueue(MetricsItem{std::move(*text)});
          now = Clock::now();
        }
        next_load = now + options.load_interval;
      }
      if (now >= next_models) {
        if (registered) {
          if (auto text = get("/v1/models")) enqueue(ModelsItem{std::move(*text)});
          now = Clock::now();
        }
        next_models = now + kModelsInterval;
      }
      std::unique_lock lock{mutex};
      wake.wait_until(lock, stop, std::min({next_health, next_load, next_models}),
                      [] { return false; });
    }
  }
};

EngineBridge::EngineBridge(std::unique_ptr<State> state) : state_(std::move(state)) {}

EngineBridge::~EngineBridge() {
  if (state_) {
    state_->metrics_server.reset();
    state_->subscriber.reset();
    state_->subscriptions.clear();
    // Before the NATS client: open streams still publish their last chunk.
    state_->generator.reset();
  }
}

WorkerId EngineBridge::worker_id() const { return state_->worker_id; }

std::optional<std::uint16_t> EngineBridge::metrics_port() const {
  if (!state_->metrics_server) return std::nullopt;
  return state_->metrics_server->port();
}

std::expected<std::unique_ptr<EngineBridge>, std::string> EngineBridge::create(
    BridgeOptions options) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  auto state = std::make_unique<State>();
  State* raw = state.get();
  // After a NATS reconnect, register again: a router that restarted meanwhile then asks for a
  // dump, which the bridge serves from its picture.
  auto client = nats::NatsClient::connect(
      options.nats,
      nats::NatsEventHandlers{.on_reconnected = [raw] { raw->enqueue(DiscoverItem{}); }});
  if (!client) return std::unexpected(client.error());
  state->nats = std::move(*client);
  state->options = std::move(options);
  state->worker_id =
      state->options.worker_id != 0 ? state->options.worker_id : (state->random() >> 16) + 1;
  state->publisher.emplace(*state->nats, state->options.ns, "kvr bridge");
  auto generator = GenerateForwarder::start(
      GenerateForwarderOptions{.engine_url = raw->options.engine_url,
                               .engine = raw->options.engine,
                               .worker_id = raw->worker_id,
                               .data_parallel_size = raw->options.data_parallel_size,
                               .concurrency = raw->options.max_concurrent_generates,
                               .read_timeout = raw->options.generate_read_timeout},
      [raw](const std::string& subject, const v1::GenerateChunk& chunk) {
        raw->publisher->publish(subject, chunk);
      });
  if (!generator) return std::unexpected(generator.error());
  state->generator = std::move(*generator);
  if (!raw->options.model.empty()) raw->generator->set_model(raw->options.model);
  // Generate requests and cancels go straight to the forwarder's threads; dumps to the run loop.
  auto subscriptions = raw->publisher->subscribe_worker(
      raw->worker_id,
      worker::WorkerSubjectHandlers{
          .on_generate =
              [raw](nats::NatsMessage message) {
                v1::GenerateRequest request;
                if (!request.ParseFromString(message.data)) {
                  raw->log.warn("malformed-generate",
                                "kvr bridge: dropped a malformed GenerateRequest");
                  return;
                }
                raw->generator->submit(std::move(request));
              },
          .on_cancel =
              [raw](nats::NatsMessage message) {
                v1::GenerateCancel request;
                if (!request.ParseFromString(message.data)) {
                  raw->log.warn("malformed-cancel",
                                "kvr bridge: dropped a malformed GenerateCancel");
                  return;
                }
                raw->generator->cancel(request.request_id());
              },
          .on_dump =
              [raw](nats::NatsMessage message) { raw->enqueue(DumpItem{std::move(message)}); }});
  if (!subscriptions) return std::unexpected(subscriptions.error());
  state->subscriptions = std::move(*subscriptions);
  auto discover = raw->publisher->subscribe_discover([raw] { raw->enqueue(DiscoverItem{}); });
  if (!discover) return std::unexpected(discover.error());
  state->subscriptions.push_back(std::move(*discover));
  if (auto flushed = state->nats->flush(std::chrono::seconds(5)); !flushed) {
    return std::unexpected(flushed.error());
  }
  if (state->options.metrics_port) {
    for (const BridgeMetric& metric : kBridgeMetrics) {
      state->registry->describe(
          std::string{metric.name},
          metric.counter ? metrics::MetricType::Counter : metrics::MetricType::Gauge,
          std::string{metric.help});
    }
    auto server = metrics::MetricsHttpServer::start(
        "127.0.0.1", *state->options.metrics_port, state->registry, [raw] {
          return raw->registered ? std::string{} : std::string{"the engine is not registered"};
        });
    if (!server) return std::unexpected("--metrics-port: " + server.error());
    state->metrics_server = std::move(*server);
    raw->refresh_metrics();
    spdlog::info("kvr bridge: metrics on http://127.0.0.1:{}/metrics",
                 state->metrics_server->port());
  }
  return std::unique_ptr<EngineBridge>(new EngineBridge(std::move(state)));
}

BridgeStats EngineBridge::run(std::stop_token stop) {
  State& state = *state_;
  worker::PeriodicTimer heartbeat{worker::heartbeat_interval(state.options.liveness_ttl),
                                  Clock::now()};
  std::jthread prober{[&state](std::stop_token probe_stop) { state.probe(probe_stop); }};
  std::deque<InboxItem> batch;
  while (!stop.stop_requested()) {
    const auto now = Clock::now();
    if (state.facts && heartbeat.fire(now)) state.publish_heartbeat();
    state.inbox.take_all(batch);
    for (InboxItem& item : batch) state.handle(item);
    batch.clear();
    state.registered = state.facts.has_value();
    state.refresh_metrics();

    if (state.facts) {
      state.inbox.wait_until(stop, heartbeat.next());
    } else {
      state.inbox.wait(stop);
    }
  }
  prober.request_stop();
  prober.join();
  if (state.facts) state.deregister_worker("bridge shutting down");
  state.publisher->flush(std::chrono::seconds(2));
  const GenerateForwarderStats generated = state.generator->stats();
  state.stats.generate_requests = generated.requests;
  state.stats.generate_completed = generated.completed;
  state.stats.generate_cancelled = generated.cancelled;
  state.stats.generate_failed = generated.failed;
  state.stats.generate_refused = generated.refused;
  return state.stats;
}

}  // namespace kvr::bridge
