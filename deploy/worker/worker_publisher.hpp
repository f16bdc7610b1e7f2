// The worker side of kvr's NATS protocol (docs/protocol.md), shared by `kvr mocker` (many
// simulated workers on one connection) and `kvr bridge` (one engine's worker): the worker's
// subscriptions, its registration, heartbeats, load reports, KV event batches, answers to dump
// requests and its deregistration, and the heartbeat cadence its liveness asks for. What a worker
// says is its owner's business; how it is said on the wire is this file's.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "discovery/load/predicted_load.hpp"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"
#include "messages/nats/nats_client.hpp"
#include "messages/worker_role.hpp"

namespace google::protobuf {
class MessageLite;
}

namespace kvr::worker {

/// One worker incarnation: the pair every message of the worker carries.
struct WorkerInstance {
  WorkerId id = 0;
  Incarnation incarnation = 0;
};

/// What a worker tells routers about itself when it registers (v1::WorkerRegistration).
struct WorkerDescription {
  std::string model;
  WorkerType role = WorkerType::Aggregated;
  std::string routing_group = "default";
  /// Tokens per KV block.
  std::uint32_t block_size = 0;
  /// KV capacity per data-parallel rank, in blocks; nullopt: not known (sent as 0).
  std::optional<std::uint64_t> total_kv_blocks;
  std::uint32_t data_parallel_size = 1;
  std::vector<std::string> taints;
  /// The engine's token budget per step and concurrency per rank; 0: not known (not sent).
  std::uint32_t max_num_batched_tokens = 0;
  std::uint32_t max_num_seqs = 0;
  /// false: the router predicts the worker's cache (approximate mode).
  bool publishes_kv_events = true;
  /// Routers remove a worker that has not been heard from for this long.
  std::chrono::milliseconds liveness_ttl{3000};
  /// The engine's HTTP base URL as routers reach it; empty: reached over NATS only.
  std::string http_url;
  /// LoRA adapters the engine serves on top of `model`.
  std::vector<std::string> lora_adapters;
};

/// How often a worker heartbeats: three times per `liveness_ttl`, so that one lost heartbeat never
/// costs its liveness.
constexpr std::chrono::milliseconds heartbeat_interval(std::chrono::milliseconds liveness_ttl) {
  return liveness_ttl / 3;
}

/// A repeating deadline on a clock the caller reads (so tests and loops pass the time in).
class PeriodicTimer {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;

  /// First due at `first_due`, then every `interval` after each firing.
  PeriodicTimer(Duration interval, TimePoint first_due) : interval_(interval), next_(first_due) {}

  /// True when the deadline has come at `now`; the next one is then `now` plus the interval
  /// (a late firing is not caught up).
  bool fire(TimePoint now) {
    if (now < next_) return false;
    next_ = now + interval_;
    return true;
  }

  /// When it is next due.
  TimePoint next() const { return next_; }

 private:
  Duration interval_;
  TimePoint next_;
};

/// The rank a well-formed dump request asks for: a KvDumpRequest with a reply subject, for a rank
/// below `data_parallel_size`; nullopt for anything else (the caller counts and drops it).
std::optional<DpRank> read_dump_request(const nats::NatsMessage& message,
                                        std::uint32_t data_parallel_size);

/// What arrives on one worker's subjects; each handler runs on a NATS delivery thread.
struct WorkerSubjectHandlers {
  /// A GenerateRequest on kvr.<ns>.worker.<id>.generate.
  std::function<void(nats::NatsMessage)> on_generate;
  /// A GenerateCancel on the generate subject's ".cancel".
  std::function<void(nats::NatsMessage)> on_cancel;
  /// A KvDumpRequest on the worker's dump subject.
  std::function<void(nats::NatsMessage)> on_dump;
};

/// Publishes the worker side of the protocol for the workers of one process, in namespace `ns`,
/// on a connection it does not own. Any thread may call it (the client is thread-safe); a failed
/// publish is logged as "<log_prefix>: <error>" and otherwise ignored: the next heartbeat or
/// report carries the same news.
class WorkerPublisher {
 public:
  WorkerPublisher(nats::NatsClient& nats, std::string ns, std::string log_prefix);

  /// The subject namespace.
  const std::string& ns() const { return ns_; }

  /// Subscribes `worker`'s generate, cancel and dump subjects (a handler left empty is not
  /// subscribed); the subscriptions end when the returned handles are destroyed.
  std::expected<std::vector<nats::NatsSubscription>, std::string> subscribe_worker(
      WorkerId worker, WorkerSubjectHandlers handlers);

  /// Subscribes the routers' discovery requests, after which every worker registers again.
  std::expected<nats::NatsSubscription, std::string> subscribe_discover(
      std::function<void()> on_discover);

  /// The registration of `worker` (generate and dump subjects in this namespace).
  void publish_registration(const WorkerInstance& worker, const WorkerDescription& description);
  /// One heartbeat of `worker`, stamped with the wall clock.
  void publish_heartbeat(const WorkerInstance& worker);
  /// The load of `worker`'s ranks, rank r at index r (fields a worker does not know left 0),
  /// stamped with the wall clock, on its partition's load subject (subjects::partition_load; the
  /// previous release's shared subject before the worker registered).
  void publish_load(const WorkerInstance& worker, std::span<const discovery::ConfirmedLoad> ranks);
  /// `worker` leaves routing for `reason`.
  void publish_deregistration(const WorkerInstance& worker, std::string_view reason);
  /// One KV event batch, on the KV event subject of the batch's worker and its partition
  /// (subjects::partition_kv_events).
  void publish_kv_batch(const KvEventBatch& batch);
  /// Answers a dump request on its reply subject.
  void publish_dump(const std::string& reply_subject, const KvDump& dump);
  /// Any protobuf message on `subject`, logged on failure like the rest.
  void publish(const std::string& subject, const google::protobuf::MessageLite& message);

  /// Waits up to `timeout` until the server has everything published so far; logs a failure.
  void flush(std::chrono::milliseconds timeout);

 private:
  void warn(std::string_view error) const;
  /// The partition key `worker` registered with; empty before its registration.
  std::string partition_of(WorkerId worker) const;

  nats::NatsClient& nats_;
  std::string ns_;
  std::string log_prefix_;
  /// Each worker's partition, from its registration: its load and KV events go on subjects that
  /// name it, so that a node subscribes only to the partitions it serves.
  mutable std::mutex partitions_mutex_;
  std::map<WorkerId, std::string> partitions_;
};

}  // namespace kvr::worker
