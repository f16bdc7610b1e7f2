#include "actors/front_door/gateway_actor.hpp"

#include <mutex>

#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>

#include "actors/caf_error.hpp"
#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::actors {
namespace {

// The relay of one generate stream: the actor client the ingress streams the answer to. It asks
// for the generation, hands the first decision and every chunk to the front door's callbacks, and
// ends with the last chunk, a failed decision, or the client's cancel (passed on to the node).
using relay_actor =
    caf::typed_actor<caf::reacts_to<chunk_atom, GenerateChunkMessage>, caf::reacts_to<cancel_atom>>;

struct RelayState {
  front_door::GenerateCallbacks callbacks;
  std::string request_id;
};

relay_actor::behavior_type relay_behavior(relay_actor::stateful_pointer<RelayState> self,
                                          ingress_actor ingress, std::chrono::milliseconds timeout,
                                          v1::GenerateRequest request,
                                          front_door::GenerateCallbacks callbacks) {
  self->state.callbacks = std::move(callbacks);
  self->state.request_id = request.route().request_id();
  self->request(ingress, timeout, generate_atom::value, GenerateRequestMessage{std::move(request)})
      .then(
          [self](RouteDecisionMessage& decision) {
            const bool dispatched = decision.value.has_success();
            self->state.callbacks.decision(std::move(decision.value));
            if (!dispatched) self->quit();
          },
          [self](caf::error& error) {
            v1::RouteDecision decision;
            decision.set_request_id(self->state.request_id);
            auto* failure = decision.mutable_error();
            failure->set_code(error == caf::sec::request_timeout ? v1::ROUTE_ERROR_TIMEOUT
                                                                 : v1::ROUTE_ERROR_UNAVAILABLE);
            failure->set_message("the router did not decide: " + self->system().render(error));
            self->state.callbacks.decision(std::move(decision));
            self->quit();
          });
  return {
      [self](chunk_atom, GenerateChunkMessage& chunk) {
        const bool last = chunk.value.finished();
        self->state.callbacks.chunk(std::move(chunk.value));
        if (last) self->quit();
      },
      [self, ingress](cancel_atom) {
        v1::GenerateCancel cancel;
        cancel.set_request_id(self->state.request_id);
        self->send(ingress, cancel_atom::value, GenerateCancelMessage{std::move(cancel)});
        self->quit();
      },
  };
}

// The front door's handle on a relay: a cancel that comes before the gateway spawned the relay
// is passed on as soon as it exists.
class RelayHandle final : public front_door::GenerateStream {
 public:
  void cancel() override {
    std::lock_guard lock{mutex_};
    cancelled_ = true;
    if (relay_) caf::anon_send(caf::actor_cast<relay_actor>(relay_), cancel_atom::value);
  }
  void attach(caf::actor relay) {
    std::lock_guard lock{mutex_};
    relay_ = std::move(relay);
    if (cancelled_) caf::anon_send(caf::actor_cast<relay_actor>(relay_), cancel_atom::value);
  }

 private:
  std::mutex mutex_;
  bool cancelled_ = false;
  caf::actor relay_;
};

class ActorGateway final : public front_door::RoutingGateway {
 public:
  explicit ActorGateway(gateway_actor actor) : actor_(std::move(actor)) {}

  std::shared_ptr<front_door::GenerateStream> generate(
      v1::GenerateRequest request, front_door::GenerateCallbacks callbacks) override {
    auto handle = std::make_shared<RelayHandle>();
    caf::anon_send(actor_, generate_atom::value,
                   GenerateRelayStart{std::move(request), std::move(callbacks),
                                      [handle](caf::actor relay) { handle->attach(relay); }});
    return handle;
  }

  void route(v1::RouteRequest request, std::function<void(v1::RouteDecision)> done) override {
    caf::anon_send(actor_, route_atom::value, RouteRequestMessage{std::move(request)},
                   DecisionCallback{std::move(done)});
  }

  void report(v1::LifecycleReport report) override {
    caf::anon_send(actor_, report_atom::value, LifecycleReportMessage{std::move(report)});
  }

 private:
  gateway_actor actor_;
};

}  // namespace

namespace {

using GatewaySelf = gateway_actor::stateful_pointer<GatewayState>;

v1::RouteDecision route_error(const std::string& request_id, v1::RouteErrorCode code,
                              std::string message) {
  v1::RouteDecision decision;
  decision.set_request_id(request_id);
  auto* failure = decision.mutable_error();
  failure->set_code(code);
  failure->set_message(std::move(message));
  return decision;
}

// One sweep timer for every request in flight (armed while any is): a CAF timeout per request
// would wake CAF's clock thread on each one's way in.
void arm_sweep(GatewaySelf self) {
  auto& state = self->state;
  if (state.sweep_armed || state.deadlines.empty()) return;
  state.sweep_armed = true;
  self->delayed_send(self, state.config.sweep_interval, tick_atom::value);
}

// Starts the deadline of request `id`; the entry's own deadlines come first, so this one only
// catches an answer that never comes.
std::uint64_t track(GatewaySelf self) {
  auto& state = self->state;
  // Answers come mostly in order: the deadlines of those already answered leave from the front
  // as new ones come, rather than a timeout later.
  while (!state.deadlines.empty() && !state.routes.contains(state.deadlines.front().second) &&
         !state.reports.contains(state.deadlines.front().second)) {
    state.deadlines.pop_front();
  }
  const std::uint64_t id = state.next_id++;
  state.deadlines.emplace_back(state.config.clock->now() + state.config.route_timeout, id);
  arm_sweep(self);
  return id;
}

void abort_booking(GatewaySelf self, const v1::RouteSuccess& success) {
  v1::LifecycleReport report;
  report.set_booking_id(success.booking_id());
  report.set_event(v1::LIFECYCLE_EVENT_ABORTED);
  report.set_abort_cause(v1::ABORT_CAUSE_CLIENT_CANCELLED);
  report.set_error("the front door stopped waiting for the decision");
  self->send(self, report_atom::value, LifecycleReportMessage{std::move(report)});
}

void sweep(GatewaySelf self) {
  auto& state = self->state;
  state.sweep_armed = false;
  const TimePoint now = state.config.clock->now();
  const auto waited = fmt::format("no answer within {} ms", state.config.route_timeout.count());
  while (!state.deadlines.empty() && state.deadlines.front().first <= now) {
    const std::uint64_t id = state.deadlines.front().second;
    state.deadlines.pop_front();
    if (auto route = state.routes.extract(id); !route.empty()) {
      auto& pending = route.mapped();
      pending.done(route_error(pending.request_id, v1::ROUTE_ERROR_TIMEOUT,
                               "the router did not decide: " + waited));
    } else if (auto report = state.reports.extract(id); !report.empty()) {
      state.config.log->warn(
          "front-door-report",
          fmt::format("front door: the report of booking {} failed: {}", report.mapped(), waited));
    }
  }
  arm_sweep(self);
}

}  // namespace

GatewayState::~GatewayState() {
  // The gateway stopped (the node shuts down): every route still waiting gets its answer.
  for (auto& [id, pending] : routes) {
    pending.done(route_error(pending.request_id, v1::ROUTE_ERROR_UNAVAILABLE,
                             "the router is shutting down"));
  }
}

gateway_actor::behavior_type gateway_behavior(GatewaySelf self, GatewayActorConfig config) {
  self->state.config = std::move(config);
  return {
      [self](route_atom, RouteRequestMessage& message, DecisionCallback& callback) {
        const std::uint64_t id = track(self);
        self->state.routes.emplace(
            id, GatewayState::PendingRoute{message.value.request_id(), std::move(callback.done)});
        self->request(self->state.config.ingress, caf::infinite, route_atom::value,
                      std::move(message))
            .then(
                [self, id](RouteDecisionMessage& decision) {
                  auto route = self->state.routes.extract(id);
                  if (!route.empty()) return route.mapped().done(std::move(decision.value));
                  // Answered after its deadline, which the front door has been told of: nobody
                  // will report on this booking, so it ends now rather than at its expiry.
                  if (decision.value.has_success()) abort_booking(self, decision.value.success());
                },
                [self, id](caf::error& error) {
                  auto route = self->state.routes.extract(id);
                  if (route.empty()) return;
                  auto& pending = route.mapped();
                  pending.done(
                      route_error(pending.request_id, v1::ROUTE_ERROR_UNAVAILABLE,
                                  "the router did not decide: " + self->system().render(error)));
                });
      },
      [self](generate_atom, GenerateRelayStart& start) {
        // Linked: a gateway that stops takes its relays with it, so that no callback runs into a
        // front door that is gone.
        const auto& settings = self->state.config;
        auto relay =
            self->spawn<caf::linked>(relay_behavior, settings.ingress, settings.route_timeout,
                                     std::move(start.request), std::move(start.callbacks));
        start.relay(caf::actor_cast<caf::actor>(relay));
      },
      [self](report_atom, LifecycleReportMessage& message) {
        const std::uint64_t id = track(self);
        self->state.reports.emplace(id, message.value.booking_id());
        self->request(self->state.config.ingress, caf::infinite, report_atom::value,
                      std::move(message))
            .then(
                [self, id](LifecycleAckMessage& ack) {
                  auto report = self->state.reports.extract(id);
                  if (report.empty() || ack.value.accepted()) return;
                  self->state.config.log->warn(
                      "front-door-report",
                      fmt::format("front door: the report of booking {} was refused: {}",
                                  report.mapped(), ack.value.message()));
                },
                [self, id](caf::error& error) {
                  auto report = self->state.reports.extract(id);
                  if (report.empty()) return;
                  self->state.config.log->warn(
                      "front-door-report",
                      fmt::format("front door: the report of booking {} failed: {}",
                                  report.mapped(), self->system().render(error)));
                });
      },
      [self](tick_atom) { sweep(self); },
  };
}

std::shared_ptr<front_door::RoutingGateway> make_actor_gateway(gateway_actor actor) {
  return std::make_shared<ActorGateway>(std::move(actor));
}

}  // namespace kvr::actors
