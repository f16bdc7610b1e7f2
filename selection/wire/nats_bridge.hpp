// The router node's NATS bridge: subscribes to the worker subjects (registration, heartbeat,
// deregistration, load, KV events, dump replies) and to the router's request subjects (route,
// report, generate, in the shared queue group; generate.cancel for every node) and to the node's
// stream inbox where workers publish generate chunks; each callback only decodes and validates the
// message and hands the plain result to a sink (which anon_sends to an actor). Bad messages are
// counted per subject, logged rate-limited and dropped; an invalid route request is answered at
// once with an explicit RouteDecision error. Actors publish through the RouterPublisher interface.
// Plain C++ (no CAF): the node wires the sinks to its actors.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "messages/nats/nats_client.hpp"
#include "selection/wire/generate_messages.hpp"
#include "selection/wire/route_messages.hpp"
#include "selection/wire/shard_messages.hpp"
#include "selection/wire/worker_messages.hpp"

namespace kvr {

/// What actors may publish; thread-safe. An interface so that actor tests can use a fake.
class RouterPublisher {
 public:
  virtual ~RouterPublisher() = default;
  /// Publishes `data` on `subject` (e.g. a reply); false when it could not be sent.
  virtual bool publish(std::string_view subject, std::string_view data) = 0;
  /// Publishes but may hold the message until flush_deferred(), so that an actor answering a
  /// burst of requests sends the burst in one write. Whoever publishes deferred must flush.
  virtual bool publish_deferred(std::string_view subject, std::string_view data) {
    return publish(subject, data);
  }
  /// Sends every message published deferred so far.
  virtual void flush_deferred() {}
  /// The largest message publish() can send; 0: no limit known.
  virtual std::size_t max_payload() const { return 0; }
  /// Asks one worker rank for a KV dump on its dump subject; the reply reaches the kv_dump sink.
  virtual bool request_dump(std::string_view dump_subject, WorkerWithDpRank worker) = 0;
  /// Asks every worker to register again (subjects::worker_discover).
  virtual bool request_reregistration() = 0;
};

/// The worker messages a node follows: each partition it serves, or for a sharded partition each
/// worker of the shards it serves, has its load and KV event subjects subscribed (worker
/// registrations and heartbeats reach every node). An interface so that actor tests can use a
/// fake; thread-safe.
class WorkerFeed {
 public:
  virtual ~WorkerFeed() = default;
  /// Subscribes the load and KV events of every worker of `partition` ("<model>/<routing
  /// group>"), or of `worker` only, counting what is decoded under `label` (the partition served,
  /// a shard's "<model>/<group>#<shard>"). Following again changes nothing but the label.
  virtual void follow(const std::string& partition, std::optional<WorkerId> worker,
                      const std::string& label) = 0;
  /// Ends a follow() of the same partition and worker; nothing when there is none.
  virtual void unfollow(const std::string& partition, std::optional<WorkerId> worker) = 0;
};

/// Where decoded messages go. Each runs on a NATS delivery thread and must not block.
struct BridgeSinks {
  std::function<void(discovery::WorkerRegistration)> registration;
  std::function<void(WorkerLiveness)> heartbeat;
  std::function<void(WorkerLiveness)> deregistration;
  std::function<void(WorkerLoadReport)> load;
  std::function<void(KvEventBatch)> kv_events;
  std::function<void(KvDump)> kv_dump;
  /// A valid route request, the subject to answer on (empty: none), and when it arrived.
  std::function<void(RouteRequest, std::string reply,
                     std::chrono::steady_clock::time_point received)>
      route;
  /// A valid lifecycle report and the subject to acknowledge on (empty: none).
  std::function<void(LifecycleReportData, std::string reply)> report;
  /// A valid generate request, the subject its first RouteDecision goes to (empty: none), and
  /// when it arrived. Without this sink the generate subjects are not subscribed.
  std::function<void(GenerateRequestData, std::string reply,
                     std::chrono::steady_clock::time_point received)>
      generate;
  /// A client's GenerateCancel: the request id.
  std::function<void(std::string request_id)> generate_cancel;
  /// A worker's chunk on the stream inbox `<stream_inbox_prefix()>.<stream id>`.
  std::function<void(std::uint64_t stream_id, v1::GenerateChunk chunk)> chunk;
  /// Sharded partitions: a shard's published load. Without this sink the subject is not
  /// subscribed.
  std::function<void(ShardLoadData)> shard_load;
  /// The connection was lost (the client reconnects by itself): what the node hears of its
  /// workers now says nothing about them.
  std::function<void()> disconnected;
  /// The connection came back after an outage (subscriptions are restored by the client).
  std::function<void()> reconnected;
};

/// Settings of the bridge.
struct BridgeOptions {
  std::string ns = "default";
  WorkerMessageLimits worker_limits;
  RouteDecodeLimits route_limits;
  /// Stamps each request's arrival (the reservation actor measures route latency from it).
  std::shared_ptr<const Clock> clock = Clock::steady();
};

/// One NATS connection with the router's subscriptions.
class NatsBridge final : public RouterPublisher, public WorkerFeed {
 public:
  /// Connects; subscribes nothing yet. Counts reconnects and bad messages in `registry`.
  static std::expected<std::unique_ptr<NatsBridge>, std::string> connect(
      const nats::NatsOptions& nats_options, BridgeOptions options,
      std::shared_ptr<metrics::MetricsRegistry> registry,
      std::shared_ptr<metrics::RateLimitedLog> log);

  ~NatsBridge() override;
  NatsBridge(const NatsBridge&) = delete;
  NatsBridge& operator=(const NatsBridge&) = delete;

  /// Subscribes every subject, delivering to `sinks`; call once.
  std::expected<void, std::string> start(BridgeSinks sinks);
  /// Unsubscribes (waiting for running callbacks); afterwards no sink is called again, and the
  /// connection's end is no outage (nothing is logged or told for it).
  void stop();
  /// Stops taking new requests (router.route, router.generate and the partitions' route subjects)
  /// while everything else goes on: worker messages, reports, cancels and the streams in flight.
  void stop_intake();

  bool publish(std::string_view subject, std::string_view data) override;
  std::size_t max_payload() const override;
  bool publish_deferred(std::string_view subject, std::string_view data) override;
  void flush_deferred() override;
  bool request_dump(std::string_view dump_subject, WorkerWithDpRank worker) override;
  bool request_reregistration() override;

  /// True while connected to a server.
  bool connected() const;
  /// Waits until the server has seen everything published so far.
  bool flush(std::chrono::milliseconds timeout);

  /// Workers publish generate chunks for this node on `<prefix>.<stream id>`.
  const std::string& stream_inbox_prefix() const { return stream_inbox_prefix_; }

  /// Copies the NATS client's per-subscription drop counts (slow consumer) into the registry.
  void refresh_drop_counts();

  /// The subjects subscribed, for logs and tests.
  const std::vector<std::string>& subjects() const { return subjects_; }

  /// Cluster mode: serves route requests on `subject` (a partition's own subject, see
  /// subjects::router_partition_route) as on router.route, until stop_route_subject(). Thread-
  /// safe; serving a subject twice is a no-op.
  std::expected<void, std::string> serve_route_subject(const std::string& subject);
  void stop_route_subject(const std::string& subject);

  void follow(const std::string& partition, std::optional<WorkerId> worker,
              const std::string& label) override;
  void unfollow(const std::string& partition, std::optional<WorkerId> worker) override;
  /// The partitions and workers followed, as (partition, worker or 0), for tests.
  std::vector<std::pair<std::string, WorkerId>> followed() const;

 private:
  NatsBridge(BridgeOptions options, std::shared_ptr<metrics::MetricsRegistry> registry,
             std::shared_ptr<metrics::RateLimitedLog> log);

  /// A subscription's metrics label with its bad-message counter, resolved once.
  struct BadMessageCounter {
    std::string subject;
    metrics::ValueHandle count;
  };
  BadMessageCounter bad_message_counter(std::string subject) const;
  /// Counts, logs (rate-limited) and drops a bad message received on `bad.subject`.
  void drop(const BadMessageCounter& bad, std::string_view reason);
  /// Subscribes router.generate, router.generate.cancel and the stream inbox.
  std::expected<void, std::string> subscribe_generate();
  /// A route request received on `subject`: decoded and handed to the route sink, or refused.
  void on_route(const BadMessageCounter& bad, nats::NatsMessage message);
  /// `intake`: a subscription that brings new requests (stop_intake() ends it).
  std::expected<void, std::string> subscribe(std::string subject,
                                             std::function<void(nats::NatsMessage)> handler,
                                             std::string_view queue_group = {},
                                             bool intake = false);

  BridgeOptions options_;
  std::shared_ptr<metrics::MetricsRegistry> registry_;
  std::shared_ptr<metrics::RateLimitedLog> log_;
  std::unique_ptr<nats::NatsClient> client_;
  std::string dump_inbox_prefix_;
  std::string stream_inbox_prefix_;
  std::atomic<std::uint64_t> next_dump_id_{1};
  metrics::ValueHandle route_requests_;
  metrics::ValueHandle generate_requests_;
  BridgeSinks sinks_;
  std::atomic<bool> started_{false};
  /// Set by stop(): the connection is being closed on purpose.
  std::atomic<bool> stopping_{false};
  /// Cleared by stop_intake(): no route subject is served again.
  std::atomic<bool> intake_open_{true};
  // Guards subjects_ and subscriptions_ against a scrape (refresh_drop_counts) during stop().
  mutable std::mutex subscriptions_mutex_;
  /// When the connection was last lost (the clock's ticks), for the reconnect's log line.
  std::atomic<Clock::duration::rep> disconnected_at_{0};
  std::vector<std::string> subjects_;
  std::vector<nats::NatsSubscription> subscriptions_;
  /// Per subscription: whether it brings new requests.
  std::vector<bool> intake_;
  std::mutex route_subjects_mutex_;
  std::map<std::string, nats::NatsSubscription> route_subjects_;

  /// What is decoded on a followed subject, counted under its label.
  struct FeedCounters {
    metrics::ValueHandle load;
    metrics::ValueHandle kv_events;
    metrics::ValueHandle kv_blocks;
  };
  FeedCounters feed_counters(const std::string& label) const;
  /// A load report or KV event batch received on `subject`: decoded, checked against the worker
  /// the subject names, counted and handed to its sink.
  void on_feed_load(const BadMessageCounter& bad, const FeedCounters& counters,
                    const nats::NatsMessage& message);
  void on_feed_kv_events(const BadMessageCounter& bad, const FeedCounters& counters,
                         const nats::NatsMessage& message);
  /// A worker publishing on the previous release's subjects is logged once (the first few
  /// thousand such workers).
  void note_previous_subject(WorkerId worker, std::string_view subject);
  struct Followed {
    std::string label;
    std::vector<nats::NatsSubscription> subscriptions;
  };
  mutable std::mutex feed_mutex_;
  std::map<std::pair<std::string, WorkerId>, Followed> followed_;
  std::mutex previous_subject_mutex_;
  std::set<WorkerId> previous_subject_workers_;
};

}  // namespace kvr
