// The router-node benchmarks' shared workload and measurements: a fleet of 64 simulated workers
// (registrations, idle load reports, a KV cache of shared documents), a pool of route requests
// whose prompts extend those documents, latency percentiles, and the node's own histograms read
// from its Prometheus text. Plain C++ (no CAF, no NATS), used by both benchmark translation units.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "discovery/catalog/worker_registration.hpp"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/kv_event.hpp"

namespace kvr::bench {

inline constexpr std::uint32_t kBlockSize = 16;
inline constexpr std::size_t kWorkers = 64;
inline constexpr std::string_view kModel = "bench-model";
inline constexpr WorkerId kFirstWorker = 1000;

/// What the simulated fleet holds and what clients ask for; built once, deterministically.
class Workload {
 public:
  /// 512 documents of 64 blocks, each cached on two workers (16 per worker); 4,096 requests, each
  /// a document's first 32..64 blocks plus 4 blocks of its own.
  Workload();

  /// The registration of worker `index` (0 .. kWorkers-1).
  discovery::WorkerRegistration registration(std::size_t index) const;
  /// The KV events that store worker `index`'s documents (event id 1).
  KvEventBatch kv_events(std::size_t index) const;
  /// Tokens in the prompt of request `index` (modulo the pool).
  std::size_t prompt_blocks(std::size_t index) const;
  /// The route request `index` (modulo the pool) with `request_id`.
  v1::RouteRequest route_request(std::size_t index, std::string_view request_id) const;
  /// Distinct blocks in the fleet's caches (what the index holds once every event arrived).
  std::size_t distinct_blocks() const;
  std::size_t pool_size() const { return prompts_.size(); }

 private:
  std::vector<std::vector<BlockHash>> documents_;
  std::vector<std::vector<BlockHash>> prompts_;
};

/// The wire forms a worker publishes.
v1::WorkerRegistration to_wire(const discovery::WorkerRegistration& registration);
v1::LoadMetrics idle_load_wire(const discovery::WorkerRegistration& registration);

/// Serialised route requests whose id is patched in place: the id is the first field, so
/// templates serialised with a fixed-width id stay valid with any other id of that width.
class RequestTemplates {
 public:
  static constexpr std::size_t kIdWidth = 16;
  explicit RequestTemplates(const Workload& workload);
  /// The bytes of request `sequence` (its id is sequence as 16 hex digits) written to `out`.
  void render(std::uint64_t sequence, std::string& out) const;

 private:
  std::vector<std::string> templates_;
};

/// Percentiles of latencies in microseconds (nearest rank).
struct LatencyPercentiles {
  double mean_us = 0;
  double p50_us = 0;
  double p90_us = 0;
  double p99_us = 0;
  double max_us = 0;
};
LatencyPercentiles percentiles(std::vector<double> microseconds);

/// One Prometheus histogram series: cumulative counts per upper bound, +Inf last.
struct HistogramSnapshot {
  std::vector<std::pair<double, double>> buckets;  ///< (le seconds, cumulative count)
  double sum = 0;
  double count = 0;
};
/// Reads histogram `name` (its unlabelled series) from Prometheus text; the pages of several nodes
/// joined add up.
HistogramSnapshot read_histogram(std::string_view text, std::string_view name);
/// The observations between two snapshots: mean, and p50/p99 interpolated inside their bucket.
LatencyPercentiles histogram_delta(const HistogramSnapshot& before, const HistogramSnapshot& after);

/// The bookkeeping of a closed-loop run shared by the NATS loads: every slot sends its next
/// request when the previous one finished, until `total` requests were issued or the deadline
/// passed. Thread-safe: slots finish on the clients' delivery threads.
class ClosedLoop {
 public:
  /// Starts a run of `slots` slots.
  void begin(std::size_t total, std::size_t slots, std::chrono::milliseconds max_duration);
  /// The number (0, 1, ...) of a slot's next request; none when the run is over, and the slot
  /// is then finished.
  std::optional<std::uint64_t> next_request();
  /// Finishes a slot whose request could not be sent.
  void finish_slot();
  /// Waits until every slot finished, or the deadline plus `grace` passed (a lost reply leaves its
  /// slot open); then late replies issue nothing more. Returns the slots left open.
  std::size_t wait(std::chrono::milliseconds grace);

 private:
  std::atomic<std::size_t> total_{0};
  std::atomic<std::uint64_t> issued_{0};
  std::chrono::steady_clock::time_point deadline_;
  std::atomic<std::size_t> open_slots_{0};
  std::mutex mutex_;
  std::condition_variable done_;
};

/// CPU time (user + system) this process has used, in seconds.
double process_cpu_seconds();
/// CPU time (user + system) process `pid` has used, in seconds (0 when unreadable).
double process_cpu_seconds(int pid);

}  // namespace kvr::bench
