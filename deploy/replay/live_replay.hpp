// Live trace replay (`kvr replay-live`): drives a running cluster (router nodes and workers on
// a NATS server) with a Mooncake trace in real time and measures what a client sees. Each request
// is routed over NATS request/reply (kvr.<ns>.router.route), dispatched to the chosen worker's
// generate subject, streamed back, and reported to the router (first token, completed, aborted)
// against its booking. Plain C++ over NatsClient: NATS callbacks only stamp and queue messages; one
// driver thread (the caller of run) owns every request's state.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "deploy/simulation/mooncake_trace.hpp"
#include "deploy/simulation/replay_report.hpp"
#include "messages/nats/nats_client.hpp"
#include "messages/nats/route_client.hpp"

namespace kvr::replay {

/// How to drive the cluster.
struct LiveReplayOptions {
  nats::NatsOptions nats;
  /// Subject namespace of the cluster: kvr.<namespace>.…
  std::string ns = "default";
  /// Model every request asks for (the workers' --model).
  std::string model = "mock-model";
  /// Divides the trace's inter-arrival times.
  double speedup = 1.0;
  /// Most requests in flight at once; an arrival beyond it waits (its wait counts in its TTFT).
  std::size_t concurrency = 256;
  /// A request not finished this long after it was sent is abandoned (cancelled at its worker,
  /// reported aborted to the router) and counted as failed.
  std::chrono::milliseconds request_timeout{60'000};
  /// When a route request is asked again (docs/protocol.md): its retry_after and max_attempts
  /// (the request_timeout bounds the whole request).
  nats::RouteRetryPolicy route_retry;
  /// Tokens per KV block for the requests' block hashes; 0: the workers' registrations say.
  std::uint32_t block_size = 0;
  /// Send the synthesized prompt tokens instead of precomputed block hashes (the router hashes
  /// them; larger messages).
  bool send_tokens = false;
  /// The tenant every request names (RouteRequest.tenant, for per-tenant admission); empty: none.
  std::string tenant;
  /// When > 0, request i of the trace names tenant "t{i mod tenants}" instead of `tenant`.
  std::size_t tenants = 0;
  /// How long to wait for the workers to announce themselves and for the router to route a
  /// probe request before giving up.
  std::chrono::milliseconds ready_timeout{15'000};
  /// How long to wait at the end for the router to acknowledge the last lifecycle reports.
  std::chrono::milliseconds ack_grace{2'000};
  /// Called on the driver thread whenever a request ends: (requests ended so far).
  std::function<void(std::size_t)> on_progress;
};

/// What a live run measured besides the common report.
struct LiveReplayResult {
  /// Completed and failed requests, hit rate, wall-clock TTFT/ITL/end-to-end, throughput, load
  /// imbalance over the fleet (tokens served per chosen worker), the ladder's predicted (the
  /// decisions' overlap) and delivered (the first chunks' cached tokens) rungs. No utilisation:
  /// the client cannot see it.
  simulation::PolicyReport report;
  /// Workers of the model that announced themselves (else the distinct workers chosen).
  std::size_t workers = 0;
  std::uint32_t block_size = 0;
  /// The hit rate of one infinite shared cache over the replayed requests.
  double infinite_cache_hit_rate = 0;
  /// The announced workers' KV blocks together (every rank's), 0 when none announced itself, and
  /// the hit rate of one LRU cache of that many blocks over the replayed requests.
  std::uint64_t fleet_kv_blocks = 0;
  double capacity_bound_hit_rate = 0;
  /// Policy instances the router named in its decisions.
  std::vector<std::string> policies;
  /// Route decisions per chosen worker.
  std::map<WorkerId, std::size_t> decisions_per_worker;
  /// Each completed request's worker and statistics, in trace order.
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  /// Client-observed route request → decision round trip, in ms.
  simulation::LatencySummary route_ms;
  std::size_t timed_out = 0;     ///< requests abandoned at their timeout
  std::size_t route_errors = 0;  ///< explicit error decisions, or no router answering
  /// Route requests asked again with a fresh id (no decision in time, or the partition moved).
  std::size_t route_asks_repeated = 0;
  /// Requests the router's admission control refused (an answered outcome of their own: neither
  /// route errors nor failed requests; the report's `failed` leaves them out).
  std::size_t rejected_by_admission = 0;
  /// The same, by RouteErrorCode name (ROUTE_ERROR_RATE_LIMITED, …).
  std::map<std::string, std::size_t> rejected_by_code;
  std::size_t worker_errors = 0;  ///< error or cancelled streams
  /// Arrivals that waited for the concurrency cap.
  std::size_t delayed_by_cap = 0;
  /// Lifecycle reports the router refused (unknown booking) or did not acknowledge in time.
  std::size_t reports_refused = 0;
  std::size_t reports_unacknowledged = 0;
};

/// A connection to the cluster, ready to replay.
class LiveReplay {
 public:
  /// Connects, asks the workers to announce themselves (learning the fleet and its block size),
  /// and waits until the router answers a probe route request, pinned to an announced worker so
  /// that it runs no policy choice (its booking is released at once).
  /// The error says what is missing (NATS, workers, a router, agreement on the block size).
  static std::expected<std::unique_ptr<LiveReplay>, std::string> connect(LiveReplayOptions options);

  ~LiveReplay();
  LiveReplay(const LiveReplay&) = delete;
  LiveReplay& operator=(const LiveReplay&) = delete;

  /// Replays `requests` at their arrival times divided by the speedup; returns when every request
  /// has ended (completed, failed or timed out).
  LiveReplayResult run(const std::vector<simulation::TraceRequest>& requests);

  /// The block size the requests are hashed with.
  std::uint32_t block_size() const;
  /// Workers of the model that announced themselves.
  std::size_t workers() const;

 private:
  struct State;
  explicit LiveReplay(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

/// The tenant trace request `index` names under `options` (empty: none).
std::string tenant_of(const LiveReplayOptions& options, std::size_t index);

/// The live-only figures as text lines, printed after the common table.
std::string format_live_summary(const LiveReplayResult& result);

/// The common JSON report (simulation::to_json) with a "live" object added (route round trip,
/// decisions per worker, timeouts, errors and admission rejections); keys stay sorted.
std::string live_report_json(const simulation::ReplayReport& report,
                             const LiveReplayResult& result);

}  // namespace kvr::replay
