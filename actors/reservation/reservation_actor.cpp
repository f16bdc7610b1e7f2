#include "actors/reservation/reservation_actor.hpp"

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/response_promise.hpp>
#include <caf/sec.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/actor_types.hpp"

namespace kvr::actors {
namespace {

using Clock = std::chrono::steady_clock;
using Self = caf::stateful_actor<ReservationActorState>*;

// The project error a failed request to a selector stands for.
Error request_error(const caf::error& error) {
  if (error.category() == caf::atom("kvr")) return static_cast<Error>(error.code());
  if (error.category() == caf::atom("system") &&
      error.code() == static_cast<std::uint8_t>(caf::sec::request_timeout)) {
    return Error::timeout;
  }
  return Error::unavailable;
}

// Sends a booking change to the partition's selector; the caller only logs a failure.
void update_booking(Self self, BookingUpdate update) {
  self->request(self->state.config.discovery, self->state.config.selector_timeout,
                booking_atom::value, std::move(update))
      .then([](const BookingUpdateReply&) {},
            [self](const caf::error& error) {
              self->state.config.log->warn(
                  "booking",
                  fmt::format("kvr node: booking update failed: {}", self->system().render(error)));
            });
}

void publish_leases_gauge(Self self) {
  self->state.config.metrics->set("kvr_leases_open", {},
                                  static_cast<double>(self->state.ledger->size()));
}

// Answers a route request: publishes on its reply subject (if any) and fulfils the promise.
// Returns false when publishing failed.
bool deliver_decision(Self self, const RouteEnvelope& envelope, caf::response_promise& promise,
                      v1::RouteDecision decision) {
  auto& config = self->state.config;
  bool delivered = true;
  if (!envelope.reply_subject.empty()) {
    delivered = config.publisher->publish(envelope.reply_subject, decision.SerializeAsString());
  }
  if (decision.has_error()) {
    config.metrics->add("kvr_route_errors_total",
                        {{"code", v1::RouteErrorCode_Name(decision.error().code())}});
  } else if (delivered) {
    config.metrics->add("kvr_route_decisions_total",
                        {{"worker", std::to_string(decision.success().worker_id())}});
  }
  const std::chrono::duration<double> elapsed = Clock::now() - envelope.received;
  config.metrics->observe("kvr_route_latency_seconds", {}, elapsed.count());
  promise.deliver(RouteDecisionMessage{std::move(decision)});
  return delivered;
}

caf::response_promise handle_route(Self self, RouteEnvelope& envelope) {
  auto promise = self->make_response_promise();
  auto& config = self->state.config;
  // The selector gets the request; the envelope keeps what answering needs.
  RouteRequestData selector_request = std::move(envelope.request);
  envelope.request.request_id = selector_request.request_id;
  envelope.request.partition = selector_request.partition;
  self->request(config.discovery, config.selector_timeout, route_atom::value,
                std::move(selector_request))
      .then(
          [self, envelope, promise](SelectorReply& reply) mutable {
            auto& state = self->state;
            const RouteRequestData& request = envelope.request;
            if (!reply.result) {
              deliver_decision(self, envelope, promise,
                               make_route_error(request.request_id, reply.result.error().code,
                                                reply.result.error().message));
              return;
            }
            const RouteOutcome& outcome = *reply.result;
            // Booked by the selector; recorded here before the answer leaves.
            std::string lease_id = state.ledger->open(request.partition, request.request_id,
                                                      outcome.worker, outcome.lease_expires_at);
            publish_leases_gauge(self);
            auto decision = make_route_success(
                request.request_id, outcome,
                RouteSuccessInfo{.lease_id = lease_id,
                                 .lease_ttl = state.config.lease_ttl,
                                 .policy = std::move(reply.policy),
                                 .generate_subject = std::move(reply.generate_subject)});
            if (!deliver_decision(self, envelope, promise, std::move(decision))) {
              // Nobody learnt of this booking: roll it back.
              if (auto lease = state.ledger->close(lease_id)) {
                state.config.metrics->add("kvr_bookings_rolled_back_total");
                update_booking(
                    self, BookingUpdate{lease->partition, lease->request_id, true,
                                        discovery::BookingEnd::cancelled, AffinityAction::abandon});
              }
              publish_leases_gauge(self);
            }
          },
          [self, envelope, promise](caf::error& error) mutable {
            deliver_decision(self, envelope, promise,
                             make_route_error(envelope.request.request_id, request_error(error),
                                              fmt::format("the selector did not answer: {}",
                                                          self->system().render(error))));
          });
  return promise;
}

// Publishes (when asked over NATS) and returns an ack; counts the report.
void deliver_ack(Self self, const ReportEnvelope& envelope, caf::response_promise& promise,
                 bool accepted, std::string_view message) {
  auto& config = self->state.config;
  config.metrics->add("kvr_lifecycle_reports_total",
                      {{"event", std::string{as_str(envelope.report.event)}},
                       {"accepted", accepted ? "true" : "false"}});
  auto ack = make_lifecycle_ack(accepted, message);
  if (!envelope.reply_subject.empty()) {
    config.publisher->publish(envelope.reply_subject, ack.SerializeAsString());
  }
  promise.deliver(LifecycleAckMessage{std::move(ack)});
}

caf::response_promise handle_report(Self self, ReportEnvelope& envelope) {
  auto promise = self->make_response_promise();
  auto& state = self->state;
  const LifecycleReportData& report = envelope.report;
  const bool first_token = report.event == LifecycleEventKind::FirstToken;
  auto lease = first_token ? state.ledger->first_token(report.lease_id)
                           : state.ledger->close(report.lease_id);
  publish_leases_gauge(self);
  if (!lease) {
    deliver_ack(self, envelope, promise, false,
                fmt::format("lease '{}': {}", report.lease_id, as_str(lease.error())));
    return promise;
  }
  BookingUpdate update{lease->partition, lease->request_id, !first_token,
                       report.event == LifecycleEventKind::Completed
                           ? discovery::BookingEnd::completed
                           : (report.error.empty() ? discovery::BookingEnd::cancelled
                                                   : discovery::BookingEnd::failed),
                       // Session affinity commits at the first token and ends with the request.
                       first_token ? AffinityAction::commit : AffinityAction::finish};
  self->request(state.config.discovery, state.config.selector_timeout, booking_atom::value,
                std::move(update))
      .then(
          [self, envelope, promise](const BookingUpdateReply& reply) mutable {
            // A booking the selector no longer holds was released already (its worker left):
            // the report is still accepted, since the lease was open.
            deliver_ack(self, envelope, promise, true,
                        reply.applied
                            ? std::string{}
                            : fmt::format("booking already released ({})", reply.message));
          },
          [self, envelope, promise](caf::error& error) mutable {
            deliver_ack(self, envelope, promise, true,
                        fmt::format("lease ended; the selector did not confirm: {}",
                                    self->system().render(error)));
          });
  return promise;
}

}  // namespace

caf::behavior reservation_actor(Self self, ReservationActorConfig config) {
  self->state.config = std::move(config);
  self->state.ledger.emplace(self->state.config.lease_prefix);
  publish_leases_gauge(self);
  self->delayed_send(self, self->state.config.tick_interval, expire_atom::value);
  return {
      [self](route_atom, RouteEnvelope& envelope) { return handle_route(self, envelope); },
      [self](report_atom, ReportEnvelope& envelope) { return handle_report(self, envelope); },
      [self](expire_atom) {
        auto& state = self->state;
        const auto expired = state.ledger->expire(Clock::now());
        if (!expired.empty()) {
          state.config.metrics->add("kvr_leases_expired_total", {},
                                    static_cast<double>(expired.size()));
          publish_leases_gauge(self);
        }
        self->delayed_send(self, state.config.tick_interval, expire_atom::value);
      },
  };
}

}  // namespace kvr::actors
