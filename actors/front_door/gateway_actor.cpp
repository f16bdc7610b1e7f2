#include "actors/front_door/gateway_actor.hpp"

#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>

#include "actors/caf_error.hpp"
#include "messages/metrics/rate_limited_log.hpp"

namespace kvr::actors {
namespace {

class ActorGateway final : public front_door::RoutingGateway {
 public:
  explicit ActorGateway(gateway_actor actor) : actor_(std::move(actor)) {}

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
