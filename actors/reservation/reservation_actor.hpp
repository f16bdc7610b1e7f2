// The reservation actor: one per node; the route-mode front of the selectors. For every route
// request it asks the partition's selector (through the discovery actor) to select and book,
// records the booking in the lease ledger, and only then delivers the decision (published on the
// request's NATS reply subject, or returned to an actor client). When publishing fails the
// booking is rolled back. Lifecycle reports release bookings through the ledger: first token,
// completion and abort each end a booking's part exactly once; unreported leases expire on a
// timer (the selectors expire the bookings themselves at the same deadline).
//
// State it owns: the LeaseLedger (lease id → partition, request id, worker, expiry).
// Messages it handles (atoms in actors/actor_types.hpp):
//   route(RouteEnvelope) → RouteDecisionMessage     — always a decision (success or error);
//   report(ReportEnvelope) → LifecycleAckMessage     — always an ack;
//   expire                                           — its own timer.
// Spawned by the router node. Every request it makes carries a finite timeout; it must never
// block, throw, or call NATS request().
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <caf/actor.hpp>
#include <caf/behavior.hpp>
#include <caf/stateful_actor.hpp>

#include "actors/metrics/metrics_registry.hpp"
#include "actors/metrics/rate_limited_log.hpp"
#include "actors/nats/nats_bridge.hpp"
#include "actors/reservation/lease_ledger.hpp"

namespace kvr::actors {

/// What the reservation actor is spawned with.
struct ReservationActorConfig {
  /// Delegates to the partition selectors.
  caf::actor discovery;
  std::shared_ptr<RouterPublisher> publisher;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  std::shared_ptr<metrics::RateLimitedLog> log;
  /// Lease ids start with this (unique per node start).
  std::string lease_prefix = "lease";
  /// Reported to callers in each decision (the selectors' booking TTL).
  std::chrono::milliseconds lease_ttl{120'000};
  /// How long a selector may take to answer.
  std::chrono::milliseconds selector_timeout{2'000};
  /// Period of the lease-expiry timer.
  std::chrono::milliseconds tick_interval{100};
};

/// The reservation actor's state.
struct ReservationActorState {
  static inline const char* name = "kvr.reservation";
  ReservationActorConfig config;
  std::optional<LeaseLedger> ledger;
};

/// The reservation actor's behaviour.
caf::behavior reservation_actor(caf::stateful_actor<ReservationActorState>* self,
                                ReservationActorConfig config);

}  // namespace kvr::actors
