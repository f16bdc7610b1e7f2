#include "actors/reservation/reservation_actor.hpp"

#include <limits>

#include <caf/actor_system.hpp>
#include <caf/sec.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "actors/actor_types.hpp"
#include "actors/support/request_error.hpp"
#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {
namespace {

using Self = reservation_actor::stateful_pointer<ReservationActorState>;
using DecisionPromise = caf::typed_response_promise<RouteDecisionMessage>;
using AckPromise = caf::typed_response_promise<LifecycleAckMessage>;

const route_target_actor& selector_for(Self self,
                                       const plugins::worker_selection::RoutingPartition& p) {
  return self->state.routes.selector_for(p);
}

// Sends a booking change to the partition's selector; the caller only logs a failure. Nobody
// waits for the answer, so it needs no timeout (a lost one only goes unlogged).
void update_booking(Self self, BookingUpdate update) {
  const route_target_actor& selector = selector_for(self, update.partition);
  self->request(selector, caf::infinite, booking_atom::value, std::move(update))
      .then([](const BookingUpdateReply&) {},
            [self](const caf::error& error) {
              self->state.config.log->warn(
                  "booking",
                  fmt::format("kvr node: booking update failed: {}", self->system().render(error)));
            });
}

// Tells the classifier actor (when the node runs one) a lifecycle event of a request; the event
// is built only then, so a node without a classifier pays nothing for it.
template <class MakeEvent>
void tell_classifier(Self self, const std::string& model, MakeEvent&& make_event) {
  const auto& classifier = self->state.config.classifier;
  if (classifier) {
    self->send(classifier, classify_atom::value,
               ClassifierEvent{model, plugins::request_classifier::ClassifyEvent{make_event()}});
  }
}

metrics::NodeMetrics node_metrics(Self self) {
  return metrics::NodeMetrics{*self->state.config.metrics};
}

void publish_open_bookings(Self self) {
  self->state.route_bookings_open.set(static_cast<double>(self->state.ledger->size()));
}

metrics::ValueHandle& decisions_counter(Self self, WorkerId worker) {
  auto& state = self->state;
  auto [it, inserted] = state.decisions_by_worker.try_emplace(worker);
  if (inserted) it->second = node_metrics(self).route_decisions(worker);
  return it->second;
}

// Publishes an answer with the others of this burst (burst_writer.hpp).
bool publish_answer(Self self, std::string_view subject, std::string_view data) {
  return self->state.answers.publish(self, *self->state.config.publisher, subject, data);
}

// Writes the answers published since the last write; their route latency ends here.
void flush_answers(Self self) {
  auto& state = self->state;
  state.answers.write(*state.config.publisher);
  const TimePoint now = state.config.clock->now();
  for (const TimePoint received : state.unflushed_routes) {
    state.route_latency.observe(std::chrono::duration<double>(now - received).count());
  }
  state.unflushed_routes.clear();
}

// Answers a route request: publishes on its reply subject (if any) and fulfils the promise.
// Returns false when publishing failed. Errors go through deliver_error, which counts them.
bool deliver_decision(Self self, const RouteEnvelope& envelope, DecisionPromise& promise,
                      v1::RouteDecision decision) {
  auto& state = self->state;
  bool delivered = true;
  if (!envelope.reply_subject.empty()) {
    delivered = publish_answer(self, envelope.reply_subject, decision.SerializeAsString());
    state.unflushed_routes.push_back(envelope.received);
  } else {
    const std::chrono::duration<double> elapsed = state.config.clock->now() - envelope.received;
    state.route_latency.observe(elapsed.count());
  }
  if (delivered && decision.has_success()) {
    if (envelope.request.query_only) {
      state.route_queries.add();
    } else {
      decisions_counter(self, decision.success().worker_id()).add();
    }
  }
  promise.deliver(RouteDecisionMessage{std::move(decision)});
  return delivered;
}

// Answers a route request with an error, counted by its code.
void deliver_error(Self self, const RouteEnvelope& envelope, DecisionPromise& promise, Error code,
                   std::string_view message) {
  node_metrics(self).route_errors(code).add();
  deliver_decision(self, envelope, promise,
                   encode_route_error(envelope.request.client_id(), code, message));
  // An admitted request that found no worker ends here (a query-only one was never admitted).
  if (envelope.request.query_only) return;
  tell_classifier(self, envelope.request.partition.model, [&] {
    return plugins::request_classifier::Aborted{envelope.request.id(), std::nullopt,
                                                std::string{message}};
  });
}

// Ends bookings that expired unreported, at most `limit` of them: the selector expires its own
// side of them (same expiry), so only the ledger and the metrics change here.
void expire_bookings(Self self, TimePoint now, std::size_t limit) {
  auto& state = self->state;
  const auto expired = state.ledger->expire(now, limit);
  if (expired.empty()) return;
  state.route_bookings_expired.add(static_cast<double>(expired.size()));
  publish_open_bookings(self);
  for (const Booking& booking : expired) {
    tell_classifier(self, booking.partition.model, [&] {
      return plugins::request_classifier::Aborted{booking.request_id, booking.worker,
                                                  "the booking expired unreported"};
    });
  }
}

// Registers a request to a selector; the expiry timer fails it after the selector timeout.
std::uint64_t add_pending(Self self) {
  auto& state = self->state;
  const std::uint64_t id = state.next_pending++;
  state.pending_deadlines.emplace_back(state.config.clock->now() + state.config.selector_timeout,
                                       id);
  return id;
}

// Answers a route request with the selector's reply.
void answer_route(Self self, ReservationActorState::PendingRoute& pending, SelectorReply& reply) {
  auto& state = self->state;
  const RouteRequest& request = pending.envelope.request;
  if (!reply.result) {
    deliver_error(self, pending.envelope, pending.promise, reply.result.error().code,
                  reply.result.error().message);
    return;
  }
  const RouteOutcome& outcome = *reply.result;
  if (request.query_only) {
    // Nothing was booked: the answer names no booking, and nobody reports on it.
    deliver_decision(
        self, pending.envelope, pending.promise,
        encode_route_success(request.client_id(), outcome,
                             RouteSuccessInfo{.policy = std::move(reply.policy),
                                              .generate_subject = std::move(reply.generate_subject),
                                              .http_url = std::move(reply.http_url)}));
    return;
  }
  // Booked by the selector; recorded here before the answer leaves.
  std::string booking_id = state.ledger->open(request.partition, request.id(), outcome.worker,
                                              outcome.booking_expires_at);
  publish_open_bookings(self);
  auto decision =
      encode_route_success(request.client_id(), outcome,
                           RouteSuccessInfo{.booking_id = booking_id,
                                            .booking_ttl = state.config.booking_ttl,
                                            .policy = std::move(reply.policy),
                                            .generate_subject = std::move(reply.generate_subject),
                                            .http_url = std::move(reply.http_url)});
  if (deliver_decision(self, pending.envelope, pending.promise, std::move(decision))) {
    tell_classifier(self, request.partition.model, [&] {
      return plugins::request_classifier::Sent{request.id(), outcome.worker};
    });
  } else {
    tell_classifier(self, request.partition.model, [&] {
      return plugins::request_classifier::Aborted{request.id(), std::nullopt,
                                                  "the decision could not be delivered"};
    });
    // Nobody learnt of this booking: roll it back.
    if (auto booking = state.ledger->close(booking_id)) {
      node_metrics(self).bookings_rolled_back().add();
      update_booking(self,
                     BookingUpdate{booking->partition,
                                   {booking->request_id, true, discovery::BookingEnd::cancelled,
                                    AffinityAction::abandon}});
    }
    publish_open_bookings(self);
  }
}

DecisionPromise handle_route(Self self, RouteEnvelope& envelope) {
  auto promise = self->make_response_promise<RouteDecisionMessage>();
  auto& state = self->state;
  // A few per request (kExpiriesPerRequest), as the selector does with bookings.
  expire_bookings(self, state.config.clock->now(), kExpiriesPerRequest);
  // The selector gets the request; the pending entry keeps what answering needs.
  RouteRequest selector_request = std::move(envelope.request);
  envelope.request.selection.request_id = selector_request.id();
  envelope.request.client_id_size = selector_request.client_id_size;
  envelope.request.partition = selector_request.partition;
  const std::uint64_t id = add_pending(self);
  state.pending_routes.emplace(id,
                               ReservationActorState::PendingRoute{std::move(envelope), promise});
  // No CAF timeout: the expiry timer answers a request its selector leaves unanswered, and a
  // late reply finds no pending entry (its booking then expires, as before).
  const route_target_actor& selector = selector_for(self, selector_request.partition);
  self->request(selector, caf::infinite, route_atom::value, std::move(selector_request))
      .then(
          [self, id](SelectorReply& reply) {
            auto pending = self->state.pending_routes.extract(id);
            if (!pending.empty()) answer_route(self, pending.mapped(), reply);
          },
          [self, id](caf::error& error) {
            auto pending = self->state.pending_routes.extract(id);
            if (pending.empty()) return;
            auto& waiting = pending.mapped();
            deliver_error(
                self, waiting.envelope, waiting.promise, request_error(error),
                fmt::format("the selector did not answer: {}", self->system().render(error)));
          });
  return promise;
}

void count_report(Self self, LifecycleEventKind event, bool accepted) {
  self->state.reports[static_cast<std::size_t>(event)][accepted ? 1 : 0].add();
}

// Publishes (when asked over NATS) and returns an ack.
void acknowledge(Self self, const ReportEnvelope& envelope, AckPromise& promise, bool accepted,
                 std::string_view message) {
  auto ack = encode_lifecycle_ack(accepted, message);
  if (!envelope.reply_subject.empty()) {
    publish_answer(self, envelope.reply_subject, ack.SerializeAsString());
  }
  promise.deliver(LifecycleAckMessage{std::move(ack)});
}

void deliver_ack(Self self, const ReportEnvelope& envelope, AckPromise& promise, bool accepted,
                 std::string_view message) {
  count_report(self, envelope.report.event, accepted);
  acknowledge(self, envelope, promise, accepted, message);
}

// What a report says about its worker's health: a first token or completion is a success; an
// abort counts against the worker only when its cause blames it (a client's own cancellation,
// or an abort that names no cause, never does).
std::optional<WorkerHealthReport> health_report(const LifecycleReportData& report,
                                                WorkerId worker) {
  if (report.event != LifecycleEventKind::Aborted) return WorkerHealthReport{worker, {}};
  switch (report.abort_cause) {
    case AbortCause::worker_failed:
      return WorkerHealthReport{worker, FailureCause::worker_failed};
    case AbortCause::first_token_timeout:
      return WorkerHealthReport{worker, FailureCause::first_token_timeout};
    case AbortCause::stream_timeout:
      return WorkerHealthReport{worker, FailureCause::stream_timeout};
    case AbortCause::unspecified:
    case AbortCause::client_cancelled:
      return std::nullopt;
  }
  return std::nullopt;
}

AckPromise handle_report(Self self, ReportEnvelope& envelope) {
  auto promise = self->make_response_promise<LifecycleAckMessage>();
  auto& state = self->state;
  const LifecycleReportData& report = envelope.report;
  const bool first_token = report.event == LifecycleEventKind::FirstToken;
  auto booking = first_token ? state.ledger->first_token(report.booking_id)
                             : state.ledger->close(report.booking_id);
  publish_open_bookings(self);
  if (!booking && booking.error() == BookingError::unknown_booking) {
    deliver_ack(self, envelope, promise, false,
                fmt::format("booking '{}': {}", report.booking_id, as_str(booking.error())));
    return promise;
  }
  if (!booking) {
    // A report the booking already took (a client asking again, docs/protocol.md), or a first
    // token its completion overtook: nothing is left to do, and nothing is wrong.
    state.reports_after_end[static_cast<std::size_t>(report.event)].add();
    acknowledge(self, envelope, promise, true,
                fmt::format("booking '{}': {}", report.booking_id, as_str(booking.error())));
    return promise;
  }
  namespace rc = plugins::request_classifier;
  if (first_token) {
    if (report.context_tokens && state.config.classifier) {
      self->send(state.config.classifier, classify_atom::value, booking->partition.model,
                 booking->request_id, *report.context_tokens);
    }
    tell_classifier(self, booking->partition.model, [&] {
      return rc::Responding{booking->request_id, booking->worker};
    });
  } else if (report.event == LifecycleEventKind::Completed) {
    tell_classifier(self, booking->partition.model, [&] {
      return rc::Completed{booking->request_id, booking->worker, report.context_tokens};
    });
  } else {
    tell_classifier(self, booking->partition.model, [&] {
      return rc::Aborted{booking->request_id, booking->worker,
                         report.error.empty() ? std::string{"aborted"} : report.error};
    });
  }
  BookingUpdate update{booking->partition,
                       {booking->request_id, !first_token,
                        report.event == LifecycleEventKind::Completed
                            ? discovery::BookingEnd::completed
                            : (report.error.empty() ? discovery::BookingEnd::cancelled
                                                    : discovery::BookingEnd::failed),
                        // Session affinity commits at the first token and ends with the request.
                        first_token ? AffinityAction::commit : AffinityAction::finish,
                        health_report(report, booking->worker.worker_id)}};
  if (envelope.reply_subject.empty() && !self->current_message_id().is_request()) {
    // Nobody waits for an ack (a NATS publish without a reply subject): the booking is ended, so
    // the report is accepted whatever the selector finds, and the booking update goes one way.
    // Without a sender, the selector's answer is dropped.
    count_report(self, report.event, true);
    caf::anon_send(selector_for(self, update.partition), booking_atom::value, std::move(update));
    return promise;
  }
  const std::uint64_t id = add_pending(self);
  state.pending_reports.emplace(id,
                                ReservationActorState::PendingReport{std::move(envelope), promise});
  const route_target_actor& selector = selector_for(self, update.partition);
  self->request(selector, caf::infinite, booking_atom::value, std::move(update))
      .then(
          [self, id](const BookingUpdateReply& reply) {
            auto pending = self->state.pending_reports.extract(id);
            if (pending.empty()) return;
            // A booking the selector no longer holds was released already (its worker left):
            // the report is still accepted, since the booking was open.
            deliver_ack(self, pending.mapped().envelope, pending.mapped().promise, true,
                        reply.applied
                            ? std::string{}
                            : fmt::format("booking already released ({})", reply.message));
          },
          [self, id](caf::error& error) {
            auto pending = self->state.pending_reports.extract(id);
            if (pending.empty()) return;
            deliver_ack(self, pending.mapped().envelope, pending.mapped().promise, true,
                        fmt::format("booking ended; the selector did not confirm: {}",
                                    self->system().render(error)));
          });
  return promise;
}

// Answers every request whose selector has not answered within the selector timeout.
void fail_overdue(Self self, TimePoint now) {
  auto& state = self->state;
  const auto timeout_ms = state.config.selector_timeout.count();
  while (!state.pending_deadlines.empty() && state.pending_deadlines.front().first <= now) {
    const std::uint64_t id = state.pending_deadlines.front().second;
    state.pending_deadlines.pop_front();
    if (auto route = state.pending_routes.extract(id); !route.empty()) {
      auto& [envelope, promise] = route.mapped();
      state.routes.cancel_route(self, envelope.request.partition, envelope.request.id());
      deliver_error(self, envelope, promise, Error::timeout,
                    fmt::format("the selector did not answer within {} ms", timeout_ms));
    } else if (auto report = state.pending_reports.extract(id); !report.empty()) {
      deliver_ack(
          self, report.mapped().envelope, report.mapped().promise, true,
          fmt::format("booking ended; the selector did not confirm within {} ms", timeout_ms));
    }
  }
}

}  // namespace

reservation_actor::behavior_type reservation_behavior(Self self, ReservationActorConfig config) {
  self->state.config = std::move(config);
  self->state.ledger.emplace(self->state.config.booking_id_prefix);
  self->state.routes = PartitionRoutes{self->state.config.discovery};
  const metrics::NodeMetrics metrics = node_metrics(self);
  self->state.route_latency = metrics.route_latency();
  self->state.route_bookings_open = metrics.route_bookings_open();
  self->state.route_bookings_expired = metrics.route_bookings_expired();
  self->state.route_queries = metrics.route_queries();
  for (const auto event : {LifecycleEventKind::FirstToken, LifecycleEventKind::Completed,
                           LifecycleEventKind::Aborted}) {
    for (const bool accepted : {false, true}) {
      self->state.reports[static_cast<std::size_t>(event)][accepted ? 1 : 0] =
          metrics.lifecycle_reports(as_str(event), accepted);
    }
    self->state.reports_after_end[static_cast<std::size_t>(event)] =
        metrics.lifecycle_reports_after_end(as_str(event));
  }
  publish_open_bookings(self);
  self->send(self->state.config.discovery, watch_atom::value, selector_subscriber_actor{self});
  self->delayed_send(self, self->state.config.tick_interval, expire_atom::value);
  return {
      [self](route_atom, RouteEnvelope& envelope) { return handle_route(self, envelope); },
      [self](report_atom, ReportEnvelope& envelope) { return handle_report(self, envelope); },
      [self](flush_atom) { flush_answers(self); },
      [self](selector_atom, std::string& model, std::string& group, selector_actor& selector) {
        self->state.routes.learn(std::move(model), std::move(group), selector);
      },
      [self](expire_atom) {
        auto& state = self->state;
        fail_overdue(self, state.config.clock->now());
        expire_bookings(self, state.config.clock->now(), std::numeric_limits<std::size_t>::max());
        self->delayed_send(self, state.config.tick_interval, expire_atom::value);
      },
  };
}

}  // namespace kvr::actors
