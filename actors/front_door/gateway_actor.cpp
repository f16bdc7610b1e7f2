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

gateway_actor::behavior_type gateway_behavior(gateway_actor::pointer self,
                                              GatewayActorConfig config) {
  return {
      [self, config](route_atom, RouteRequestMessage& message, DecisionCallback& callback) {
        const std::string request_id = message.value.request_id();
        self->request(config.ingress, config.route_timeout, route_atom::value, std::move(message))
            .then([callback](
                      RouteDecisionMessage& decision) { callback.done(std::move(decision.value)); },
                  [self, callback, request_id](caf::error& error) {
                    v1::RouteDecision decision;
                    decision.set_request_id(request_id);
                    auto* failure = decision.mutable_error();
                    failure->set_code(error == caf::sec::request_timeout
                                          ? v1::ROUTE_ERROR_TIMEOUT
                                          : v1::ROUTE_ERROR_UNAVAILABLE);
                    failure->set_message("the router did not decide: " +
                                         self->system().render(error));
                    callback.done(std::move(decision));
                  });
      },
      [self, config](generate_atom, GenerateRelayStart& start) {
        // Linked: a gateway that stops takes its relays with it, so that no callback runs into a
        // front door that is gone.
        auto relay = self->spawn<caf::linked>(relay_behavior, config.ingress, config.route_timeout,
                                              std::move(start.request), std::move(start.callbacks));
        start.relay(caf::actor_cast<caf::actor>(relay));
      },
      [self, config](report_atom, LifecycleReportMessage& message) {
        const std::string booking_id = message.value.booking_id();
        self->request(config.ingress, config.route_timeout, report_atom::value, std::move(message))
            .then(
                [config, booking_id](LifecycleAckMessage& ack) {
                  if (!ack.value.accepted()) {
                    config.log->warn("front-door-report",
                                     fmt::format("front door: the report of booking {} was "
                                                 "refused: {}",
                                                 booking_id, ack.value.message()));
                  }
                },
                [self, config, booking_id](caf::error& error) {
                  config.log->warn("front-door-report",
                                   fmt::format("front door: the report of booking {} failed: {}",
                                               booking_id, self->system().render(error)));
                });
      },
  };
}

std::shared_ptr<front_door::RoutingGateway> make_actor_gateway(gateway_actor actor) {
  return std::make_shared<ActorGateway>(std::move(actor));
}

}  // namespace kvr::actors
