// The reservation actor: one per node; the route-mode front of the selectors. For every route
// request it asks the partition's selector (directly once the discovery actor announced it, through
// that actor before) to select and book, records the booking in the booking ledger, and only then
// delivers the decision (published on the request's NATS reply subject, or returned to an actor
// client). When publishing fails the booking is rolled back. Lifecycle reports release bookings
// through the ledger: first token, completion and abort each end a booking's part exactly once;
// unreported bookings expire on a timer (the selectors expire the bookings themselves at the same
// deadline).
//
// State it owns: the BookingLedger (booking id → partition, request id, worker, expiry) and each
// partition's selector.
// Messages it handles (its typed interface, `reservation_actor`, in actors/actor_types.hpp):
//   route(RouteEnvelope) → RouteDecisionMessage     — always a decision (success or error);
//   report(ReportEnvelope) → LifecycleAckMessage     — always an ack;
//   selector(model, group, selector)                 — from the discovery actor: requests of that
//                                                      partition go to its selector directly;
//   expire                                           — internal, its own timer: ends the
//                                                      bookings not reported in time;
//   flush                                            — internal: writes the NATS answers of the
//                                                      burst (burst_writer.hpp).
// Spawned by the router node. Every route request and report it hands to a selector is answered
// within the selector timeout: the expiry timer fails those still unanswered (one sweep instead of
// a CAF clock timer per request, which costs the clock thread a wake-up each). It must never
// block, throw, or call NATS request().
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>
#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "actors/support/burst_writer.hpp"
#include "actors/support/partition_routes.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/booking/booking_ledger.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

/// What the reservation actor is spawned with.
struct ReservationActorConfig : NodeServices {
  /// Delegates to the partition selectors; tells this actor of each selector so that it can
  /// address known partitions directly (one message hop fewer per request).
  discovery_actor discovery;
  /// Booking ids (the bookings' ids on the wire) start with this (unique per node start).
  std::string booking_id_prefix = "booking";
  /// Reported to callers in each decision (the selectors' booking TTL).
  std::chrono::milliseconds booking_ttl{120'000};
  /// How long a selector may take to answer (enforced by the expiry timer: up to one tick late).
  std::chrono::milliseconds selector_timeout{2'000};
  /// Period of the booking-expiry timer.
  std::chrono::milliseconds tick_interval{100};
  /// When the node runs a request classifier: told each admitted request's lifecycle (Sent at
  /// the decision, Responding at FIRST_TOKEN, Completed, Aborted at ABORTED, booking expiry, a
  /// failed delivery or a route error). Null: no messages.
  classifier_actor classifier;
};

/// The reservation actor's state.
struct ReservationActorState {
  static inline const char* name = "kvr.reservation";
  ReservationActorConfig config;
  std::optional<BookingLedger> ledger;
  /// Each partition's selector, as the discovery actor announced it.
  PartitionRoutes routes;

  /// A route request or lifecycle report waiting for its selector, and how to answer it.
  struct PendingRoute {
    RouteEnvelope envelope;
    caf::typed_response_promise<RouteDecisionMessage> promise;
  };
  struct PendingReport {
    ReportEnvelope envelope;
    caf::typed_response_promise<LifecycleAckMessage> promise;
  };
  /// Waiting requests by sequence number, and their deadlines oldest first (the selector timeout
  /// is fixed, so deadlines arrive in order); answered ones are skipped when their deadline comes.
  std::uint64_t next_pending = 1;
  absl::flat_hash_map<std::uint64_t, PendingRoute> pending_routes;
  absl::flat_hash_map<std::uint64_t, PendingReport> pending_reports;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::uint64_t>> pending_deadlines;
  /// NATS answers (decisions, acks) leave together, one write per burst.
  BurstWriter answers;
  /// When each route request whose answer waits for that write arrived: its route latency ends
  /// when the answer is written.
  std::vector<std::chrono::steady_clock::time_point> unflushed_routes;
  /// The series written per request, resolved once (decisions per worker on first use).
  metrics::HistogramHandle route_latency;
  metrics::ValueHandle route_bookings_open;
  metrics::ValueHandle route_bookings_expired;
  /// kvr_lifecycle_reports_total by event (LifecycleEventKind) and accepted (0: false, 1: true).
  std::array<std::array<metrics::ValueHandle, 2>, 3> reports;
  /// Query-only route requests answered with a decision.
  metrics::ValueHandle route_queries;
  /// kvr_lifecycle_reports_after_end_total by event.
  std::array<metrics::ValueHandle, 3> reports_after_end;
  absl::flat_hash_map<WorkerId, metrics::ValueHandle> decisions_by_worker;
};

/// The reservation actor's behaviour.
reservation_actor::behavior_type reservation_behavior(
    reservation_actor::stateful_pointer<ReservationActorState> self, ReservationActorConfig config);

}  // namespace kvr::actors
