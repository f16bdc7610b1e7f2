#include "selection/wire/nats_bridge.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "messages/metrics/node_metrics.hpp"
#include "messages/subjects.hpp"

namespace kvr {
namespace {

// The label of what arrives on the previous release's shared load and KV event subjects.
const std::string kPreviousSubjects = "previous_subjects";

// The worker id a feed subject ends with; 0 when it ends with none.
WorkerId worker_of_subject(std::string_view subject) {
  const std::string_view last = subject.substr(subject.rfind('.') + 1);
  WorkerId worker = 0;
  const auto [end, error] = std::from_chars(last.data(), last.data() + last.size(), worker);
  return error == std::errc{} && end == last.data() + last.size() ? worker : 0;
}

// kvr.<ns>.workers.load, or kvr.<ns>.kv.<worker id>.
bool previous_subject(std::string_view subject, std::string_view ns) {
  return subject == subjects::worker_load(ns) || std::ranges::count(subject, '.') == 3;
}

}  // namespace

NatsBridge::NatsBridge(BridgeOptions options, std::shared_ptr<metrics::MetricsRegistry> registry,
                       std::shared_ptr<metrics::RateLimitedLog> log)
    : options_(std::move(options)), registry_(std::move(registry)), log_(std::move(log)) {}

std::expected<std::unique_ptr<NatsBridge>, std::string> NatsBridge::connect(
    const nats::NatsOptions& nats_options, BridgeOptions options,
    std::shared_ptr<metrics::MetricsRegistry> registry,
    std::shared_ptr<metrics::RateLimitedLog> log) {
  if (!subjects::is_valid_namespace(options.ns)) {
    return std::unexpected(
        fmt::format("namespace '{}': use letters, digits, '_' and '-'", options.ns));
  }
  std::unique_ptr<NatsBridge> bridge{
      new NatsBridge(std::move(options), std::move(registry), std::move(log))};
  NatsBridge* self = bridge.get();
  nats::NatsEventHandlers handlers;
  handlers.on_disconnected = [self] {
    metrics::NodeMetrics{*self->registry_}.nats_connected().set(0);
    if (self->stopping_.load(std::memory_order_acquire)) return;  // closed on purpose
    self->disconnected_at_.store(self->options_.clock->now().time_since_epoch().count(),
                                 std::memory_order_relaxed);
    spdlog::warn(
        "kvr node: NATS connection lost; reconnecting. Workers' liveness is held until it returns "
        "(no worker is expired for heartbeats the node cannot receive)");
    if (self->started_.load(std::memory_order_acquire) && self->sinks_.disconnected) {
      self->sinks_.disconnected();
    }
  };
  handlers.on_reconnected = [self] {
    const metrics::NodeMetrics metrics{*self->registry_};
    metrics.nats_connected().set(1);
    metrics.nats_reconnects().add();
    const Clock::duration outage{self->options_.clock->now().time_since_epoch().count() -
                                 self->disconnected_at_.load(std::memory_order_relaxed)};
    spdlog::info(
        "kvr node: NATS reconnected after {} ms; workers' liveness held through the outage now run "
        "one TTL from here; asking every worker to register again and for its KV state",
        std::chrono::duration_cast<std::chrono::milliseconds>(outage).count());
    if (self->started_.load(std::memory_order_acquire) && self->sinks_.reconnected) {
      self->sinks_.reconnected();
    }
  };
  handlers.on_error = [self](std::string_view error) {
    self->log_->warn("nats-error", fmt::format("kvr node: NATS error: {}", error));
  };
  auto client = nats::NatsClient::connect(nats_options, std::move(handlers));
  if (!client) return std::unexpected(client.error());
  bridge->client_ = std::move(*client);
  const metrics::NodeMetrics metrics{*bridge->registry_};
  bridge->route_requests_ = metrics.route_requests("nats");
  bridge->generate_requests_ = metrics.generate_requests("nats");
  metrics::NodeMetrics{*bridge->registry_}.nats_connected().set(bridge->client_->connected() ? 1
                                                                                             : 0);
  bridge->dump_inbox_prefix_ = bridge->client_->new_inbox();
  bridge->stream_inbox_prefix_ = bridge->client_->new_inbox();
  return bridge;
}

NatsBridge::~NatsBridge() {
  stop();
  // Close the connection while the sinks and the registry the connection callbacks use are alive.
  client_.reset();
}

void NatsBridge::on_route(const BadMessageCounter& bad, nats::NatsMessage message) {
  const auto received = options_.clock->now();
  route_requests_.add();
  v1::RouteRequest wire;
  std::expected<RouteRequest, RouteFailure> request =
      wire.ParseFromString(message.data)
          ? decode_route_request(wire, options_.route_limits)
          : std::unexpected(
                RouteFailure{Error::invalid_request, "RouteRequest: not a valid protobuf message"});
  if (!request) {
    drop(bad, request.error().message);
    metrics::NodeMetrics{*registry_}.route_errors(request.error().code).add();
    if (!message.reply.empty()) {
      (void)publish(message.reply, encode_route_error(wire.request_id(), request.error().code,
                                                      request.error().message)
                                       .SerializeAsString());
    }
    return;
  }
  // Request ids are unique per client: the reply prefix names the client's connection.
  std::string client{kNatsScope};
  client += nats_client_of(message.reply);
  scope_request_id(*request, client);
  sinks_.route(std::move(*request), std::move(message.reply), received);
}

std::expected<void, std::string> NatsBridge::serve_route_subject(const std::string& subject) {
  std::lock_guard lock{route_subjects_mutex_};
  if (!started_.load() || !intake_open_.load() || route_subjects_.contains(subject)) return {};
  // In the routers' queue group: while a partition changes hands, both owners may be subscribed,
  // and each request still reaches one of them.
  auto subscription = client_->subscribe(
      subject,
      [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
        on_route(bad, std::move(message));
      },
      subjects::kRouterQueueGroup);
  if (!subscription) return std::unexpected(subscription.error());
  route_subjects_.emplace(subject, std::move(*subscription));
  return {};
}

void NatsBridge::stop_route_subject(const std::string& subject) {
  std::optional<nats::NatsSubscription> stopped;
  {
    std::lock_guard lock{route_subjects_mutex_};
    auto node = route_subjects_.extract(subject);
    if (!node.empty()) stopped.emplace(std::move(node.mapped()));
  }
  // Unsubscribed outside the lock: it waits for a running callback.
}

void NatsBridge::refresh_drop_counts() {
  const metrics::NodeMetrics metrics{*registry_};
  std::lock_guard lock{subscriptions_mutex_};
  for (std::size_t i = 0; i < subscriptions_.size() && i < subjects_.size(); ++i) {
    metrics.nats_dropped(subjects_[i]).set(static_cast<double>(subscriptions_[i].dropped()));
  }
}

NatsBridge::BadMessageCounter NatsBridge::bad_message_counter(std::string subject) const {
  auto count = metrics::NodeMetrics{*registry_}.bad_messages(subject);
  return BadMessageCounter{std::move(subject), count};
}

void NatsBridge::drop(const BadMessageCounter& bad, std::string_view reason) {
  bad.count.add();
  // A flood of bad messages costs a counter increment each; only an admitted line is formatted.
  const auto suppressed = log_->admit(bad.subject);
  if (!suppressed) return;
  if (*suppressed == 0) {
    spdlog::warn("kvr node: dropped a bad message on {}: {}", bad.subject, reason);
  } else {
    spdlog::warn("kvr node: dropped a bad message on {}: {} ({} similar messages suppressed)",
                 bad.subject, reason, *suppressed);
  }
}

std::expected<void, std::string> NatsBridge::subscribe(
    std::string subject, std::function<void(nats::NatsMessage)> handler,
    std::string_view queue_group, bool intake) {
  auto subscription = client_->subscribe(subject, std::move(handler), queue_group);
  if (!subscription) return std::unexpected(subscription.error());
  std::lock_guard lock{subscriptions_mutex_};
  subscriptions_.push_back(std::move(*subscription));
  subjects_.push_back(std::move(subject));
  intake_.push_back(intake);
  return {};
}

NatsBridge::FeedCounters NatsBridge::feed_counters(const std::string& label) const {
  const metrics::NodeMetrics metrics{*registry_};
  return FeedCounters{.load = metrics.worker_messages_decoded(label, "load"),
                      .kv_events = metrics.worker_messages_decoded(label, "kv_events"),
                      .kv_blocks = metrics.kv_blocks_decoded(label)};
}

void NatsBridge::note_previous_subject(WorkerId worker, std::string_view subject) {
  constexpr std::size_t kMaxRemembered = 4096;
  {
    const std::lock_guard lock{previous_subject_mutex_};
    if (previous_subject_workers_.size() >= kMaxRemembered ||
        !previous_subject_workers_.insert(worker).second) {
      return;
    }
  }
  spdlog::warn(
      "kvr node: worker {} publishes on the previous release's subject {}; the next "
      "release drops it: publish load on kvr.{}.load.<partition>.<worker id> and KV "
      "events on kvr.{}.kv.<partition>.<worker id> (docs/protocol.md)",
      worker, subject, options_.ns, options_.ns);
}

void NatsBridge::on_feed_load(const BadMessageCounter& bad, const FeedCounters& counters,
                              const nats::NatsMessage& message) {
  auto load = decode_worker_load(message.data, options_.worker_limits);
  if (!load) return drop(bad, load.error());
  const bool previous = previous_subject(message.subject, options_.ns);
  if (!previous && worker_of_subject(message.subject) != load->worker_id) {
    return drop(bad, fmt::format("LoadMetrics of worker {} arrived on {}", load->worker_id,
                                 message.subject));
  }
  if (previous) note_previous_subject(load->worker_id, message.subject);
  counters.load.add();
  sinks_.load(std::move(*load));
}

void NatsBridge::on_feed_kv_events(const BadMessageCounter& bad, const FeedCounters& counters,
                                   const nats::NatsMessage& message) {
  auto batch = decode_kv_events(message.data, options_.worker_limits);
  if (!batch) return drop(bad, batch.error());
  // The subject names the publisher: a batch claiming another worker's id is refused.
  if (worker_of_subject(message.subject) != batch->worker.worker_id) {
    return drop(bad, fmt::format("KvEventBatch of worker {} arrived on {}", batch->worker.worker_id,
                                 message.subject));
  }
  if (previous_subject(message.subject, options_.ns)) {
    note_previous_subject(batch->worker.worker_id, message.subject);
  }
  std::size_t blocks = 0;
  for (const KvEvent& event : batch->events) {
    if (const auto* stored = std::get_if<KvStoredEvent>(&event)) {
      blocks += stored->block_hashes.size();
    } else if (const auto* removed = std::get_if<KvRemovedEvent>(&event)) {
      blocks += removed->block_hashes.size();
    }
  }
  counters.kv_events.add();
  counters.kv_blocks.add(static_cast<double>(blocks));
  sinks_.kv_events(std::move(*batch));
}

void NatsBridge::follow(const std::string& partition, std::optional<WorkerId> worker,
                        const std::string& label) {
  const std::pair<std::string, WorkerId> key{partition, worker.value_or(0)};
  const std::lock_guard lock{feed_mutex_};
  if (!started_.load(std::memory_order_acquire) || stopping_.load(std::memory_order_acquire)) {
    return;
  }
  if (const auto it = followed_.find(key); it != followed_.end() && it->second.label == label) {
    return;
  }
  const std::string& ns = options_.ns;
  const std::string load_subject = worker ? subjects::partition_load(ns, partition, *worker)
                                          : subjects::partition_load_all(ns, partition);
  const std::string kv_subject = worker ? subjects::partition_kv_events(ns, partition, *worker)
                                        : subjects::partition_kv_events_all(ns, partition);
  const FeedCounters counters = feed_counters(label);
  Followed followed{label, {}};
  // Bad messages are counted per partition (its wildcard subject), never per worker.
  auto load = client_->subscribe(
      load_subject,
      [this, bad = bad_message_counter(subjects::partition_load_all(ns, partition)),
       counters](nats::NatsMessage message) { on_feed_load(bad, counters, message); });
  auto kv = client_->subscribe(
      kv_subject,
      [this, bad = bad_message_counter(subjects::partition_kv_events_all(ns, partition)),
       counters](nats::NatsMessage message) { on_feed_kv_events(bad, counters, message); });
  if (!load || !kv) {
    log_->warn("follow", fmt::format("kvr node: cannot subscribe {}: {}", kv_subject,
                                     !load ? load.error() : kv.error()));
    return;
  }
  followed.subscriptions.push_back(std::move(*load));
  followed.subscriptions.push_back(std::move(*kv));
  followed_.insert_or_assign(key, std::move(followed));
}

void NatsBridge::unfollow(const std::string& partition, std::optional<WorkerId> worker) {
  std::optional<Followed> ended;
  {
    const std::lock_guard lock{feed_mutex_};
    const auto it = followed_.find({partition, worker.value_or(0)});
    if (it == followed_.end()) return;
    ended.emplace(std::move(it->second));
    followed_.erase(it);
  }
  // Destroyed here, outside the lock: it waits for a running callback.
}

std::vector<std::pair<std::string, WorkerId>> NatsBridge::followed() const {
  const std::lock_guard lock{feed_mutex_};
  std::vector<std::pair<std::string, WorkerId>> keys;
  for (const auto& [key, followed] : followed_) keys.push_back(key);
  return keys;
}

std::expected<void, std::string> NatsBridge::start(BridgeSinks sinks) {
  sinks_ = std::move(sinks);
  started_.store(true, std::memory_order_release);
  const std::string& ns = options_.ns;
  const WorkerMessageLimits& limits = options_.worker_limits;

  // Each handler captures the subject it was subscribed with: that is the metrics label.
  std::string subject = subjects::worker_register(ns);
  auto subscribed = subscribe(
      subject, [this, bad = bad_message_counter(subject), &limits](nats::NatsMessage message) {
        auto registration = decode_worker_registration(message.data, limits);
        if (!registration) return drop(bad, registration.error());
        sinks_.registration(std::move(*registration));
      });
  if (subscribed) {
    subject = subjects::worker_heartbeat(ns);
    subscribed =
        subscribe(subject, [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          auto heartbeat = decode_worker_heartbeat(message.data);
          if (!heartbeat) return drop(bad, heartbeat.error());
          sinks_.heartbeat(*heartbeat);
        });
  }
  if (subscribed) {
    subject = subjects::worker_deregister(ns);
    subscribed =
        subscribe(subject, [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          auto deregistration = decode_worker_deregistration(message.data);
          if (!deregistration) return drop(bad, deregistration.error());
          sinks_.deregistration(*deregistration);
        });
  }
  // The previous release's shared load and KV event subjects: every node decodes them.
  if (subscribed) {
    subject = subjects::worker_load(ns);
    subscribed = subscribe(
        subject,
        [this, bad = bad_message_counter(subject), counters = feed_counters(kPreviousSubjects)](
            nats::NatsMessage message) { on_feed_load(bad, counters, message); });
  }
  if (subscribed) {
    subject = subjects::kv_events_all(ns);
    subscribed = subscribe(
        subject,
        [this, bad = bad_message_counter(subject), counters = feed_counters(kPreviousSubjects)](
            nats::NatsMessage message) { on_feed_kv_events(bad, counters, message); });
  }
  if (subscribed) {
    subject = dump_inbox_prefix_ + ".*";
    subscribed = subscribe(subject, [this, bad = bad_message_counter("kv_dump_reply"),
                                     &limits](nats::NatsMessage message) {
      auto dump = decode_kv_dump_reply(message.data, limits);
      if (!dump) return drop(bad, dump.error());
      sinks_.kv_dump(std::move(*dump));
    });
  }
  if (subscribed) {
    subject = subjects::router_route(ns);
    subscribed = subscribe(
        subject,
        [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          on_route(bad, std::move(message));
        },
        subjects::kRouterQueueGroup, /*intake=*/true);
  }
  if (subscribed) {
    subject = subjects::router_report(ns);
    subscribed = subscribe(
        subject,
        [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          v1::LifecycleReport wire;
          auto report =
              wire.ParseFromString(message.data)
                  ? decode_lifecycle_report(wire, options_.route_limits)
                  : std::unexpected(std::string{"LifecycleReport: not a valid protobuf message"});
          if (!report) {
            drop(bad, report.error());
            if (!message.reply.empty()) {
              (void)publish(message.reply,
                            encode_lifecycle_ack(false, report.error()).SerializeAsString());
            }
            return;
          }
          sinks_.report(std::move(*report), std::move(message.reply));
        },
        subjects::kRouterQueueGroup);
  }
  if (subscribed && sinks_.generate) subscribed = subscribe_generate();
  if (subscribed && sinks_.shard_load) {
    subject = subjects::router_shard_load(ns);
    subscribed =
        subscribe(subject, [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          auto load = decode_shard_load(message.data);
          if (!load) return drop(bad, load.error());
          sinks_.shard_load(std::move(*load));
        });
  }
  if (!subscribed) return std::unexpected(subscribed.error());
  if (!client_->flush(std::chrono::seconds(5))) {
    return std::unexpected("NATS server did not confirm the subscriptions");
  }
  return {};
}

std::expected<void, std::string> NatsBridge::subscribe_generate() {
  const std::string& ns = options_.ns;
  std::string subject = subjects::router_generate(ns);
  auto subscribed = subscribe(
      subject,
      [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
        const auto received = options_.clock->now();
        generate_requests_.add();
        v1::GenerateRequest wire;
        auto request =
            wire.ParseFromString(message.data)
                ? decode_generate_request(wire, options_.route_limits)
                : std::unexpected(RouteFailure{Error::invalid_request,
                                               "GenerateRequest: not a valid protobuf message"});
        if (!request) {
          drop(bad, request.error().message);
          metrics::NodeMetrics{*registry_}.route_errors(request.error().code).add();
          const std::string& request_id = wire.route().request_id();
          if (!message.reply.empty()) {
            (void)publish(message.reply, encode_route_error(request_id, request.error().code,
                                                            request.error().message)
                                             .SerializeAsString());
          }
          // A client that only reads its stream learns of the refusal there.
          if (!wire.stream_subject().empty() &&
              wire.stream_subject().find_first_of(" \t\r\n*>") == std::string::npos) {
            (void)publish(
                wire.stream_subject(),
                encode_end_chunk(request_id, 0,
                                 StreamEnd{"error", request.error().code, request.error().message},
                                 std::nullopt)
                    .SerializeAsString());
          }
          return;
        }
        sinks_.generate(std::move(*request), std::move(message.reply), received);
      },
      subjects::kRouterQueueGroup, /*intake=*/true);
  if (subscribed) {
    subject = subjects::router_generate_cancel(ns);
    // No queue group: only the node serving the request acts on it.
    subscribed =
        subscribe(subject, [this, bad = bad_message_counter(subject)](nats::NatsMessage message) {
          v1::GenerateCancel cancel;
          if (!cancel.ParseFromString(message.data) || cancel.request_id().empty() ||
              cancel.request_id().size() > options_.route_limits.max_id_length) {
            return drop(bad, "GenerateCancel: not a valid message or a bad request_id");
          }
          sinks_.generate_cancel(std::move(*cancel.mutable_request_id()));
        });
  }
  if (subscribed) {
    subject = stream_inbox_prefix_ + ".*";
    subscribed = subscribe(
        subject, [this, bad = bad_message_counter("generate_stream")](nats::NatsMessage message) {
          const std::string_view name = message.subject;
          const std::size_t dot = name.rfind('.');
          std::uint64_t stream_id = 0;
          const auto digits = name.substr(dot + 1);
          const auto parsed =
              std::from_chars(digits.data(), digits.data() + digits.size(), stream_id);
          v1::GenerateChunk chunk;
          if (dot == std::string_view::npos || parsed.ec != std::errc{} ||
              parsed.ptr != digits.data() + digits.size() || !chunk.ParseFromString(message.data)) {
            return drop(bad, "GenerateChunk: not a valid message or stream id");
          }
          sinks_.chunk(stream_id, std::move(chunk));
        });
  }
  return subscribed;
}

void NatsBridge::stop_intake() {
  // Destroyed outside the locks: destroying a subscription waits for its running callback.
  std::vector<nats::NatsSubscription> stopped;
  {
    std::lock_guard lock{subscriptions_mutex_};
    for (std::size_t i = subscriptions_.size(); i-- > 0;) {
      if (!intake_[i]) continue;
      stopped.push_back(std::move(subscriptions_[i]));
      subscriptions_.erase(subscriptions_.begin() + static_cast<std::ptrdiff_t>(i));
      subjects_.erase(subjects_.begin() + static_cast<std::ptrdiff_t>(i));
      intake_.erase(intake_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  std::map<std::string, nats::NatsSubscription> route_subjects;
  {
    std::lock_guard lock{route_subjects_mutex_};
    intake_open_.store(false);
    route_subjects.swap(route_subjects_);
  }
  stopped.clear();
  route_subjects.clear();
  (void)client_->flush(std::chrono::seconds(2));  // the server stops sending them here
}

void NatsBridge::stop() {
  stopping_.store(true, std::memory_order_release);
  // Destroying a subscription waits for its running callback; after this no sink runs.
  std::vector<nats::NatsSubscription> stopped;
  {
    std::lock_guard lock{subscriptions_mutex_};
    stopped.swap(subscriptions_);
    intake_.clear();
  }
  stopped.clear();
  {
    std::lock_guard lock{route_subjects_mutex_};
    route_subjects_.clear();
  }
  std::map<std::pair<std::string, WorkerId>, Followed> followed;
  {
    const std::lock_guard lock{feed_mutex_};
    followed.swap(followed_);
  }
  followed.clear();
  started_.store(false, std::memory_order_release);
}

bool NatsBridge::publish(std::string_view subject, std::string_view data) {
  auto sent = client_->publish(subject, data);
  if (!sent) log_->warn("publish", fmt::format("kvr node: {}", sent.error()));
  return sent.has_value();
}

std::size_t NatsBridge::max_payload() const { return client_->max_payload(); }

bool NatsBridge::publish_deferred(std::string_view subject, std::string_view data) {
  auto sent = client_->publish_deferred(subject, data);
  if (!sent) log_->warn("publish", fmt::format("kvr node: {}", sent.error()));
  return sent.has_value();
}

void NatsBridge::flush_deferred() { client_->flush_deferred(); }

bool NatsBridge::request_dump(std::string_view dump_subject, WorkerWithDpRank worker) {
  v1::KvDumpRequest request;
  request.set_worker_id(worker.worker_id);
  request.set_dp_rank(worker.dp_rank);
  const std::string reply = fmt::format("{}.{}", dump_inbox_prefix_,
                                        next_dump_id_.fetch_add(1, std::memory_order_relaxed));
  auto sent = client_->publish_request(dump_subject, reply, request.SerializeAsString());
  if (!sent) log_->warn("dump", fmt::format("kvr node: {}", sent.error()));
  return sent.has_value();
}

bool NatsBridge::request_reregistration() {
  return publish(subjects::worker_discover(options_.ns), "");
}

bool NatsBridge::connected() const { return client_ && client_->connected(); }

bool NatsBridge::flush(std::chrono::milliseconds timeout) {
  return client_->flush(timeout).has_value();
}

}  // namespace kvr
