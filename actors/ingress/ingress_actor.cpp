#include "actors/ingress/ingress_actor.hpp"

#include <caf/actor_system.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>
#include <fmt/format.h>

namespace kvr::actors {

ingress_actor::behavior_type ingress_actor_impl(ingress_actor::pointer self,
                                                IngressActorConfig config) {
  return {
      [self, config](route_atom,
                     RouteRequestMessage& message) -> caf::result<RouteDecisionMessage> {
        config.metrics->add("kvr_route_requests_total", {{"ingress", "actor"}});
        const v1::RouteRequest& wire = message.value;
        auto request = decode_route_request(wire, config.block_size, config.limits);
        if (!request) {
          config.metrics->add("kvr_route_errors_total",
                              {{"code", std::string{as_str(request.error().code)}}});
          return RouteDecisionMessage{
              make_route_error(wire.request_id(), request.error().code, request.error().message)};
        }
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        const std::string request_id = request->request_id;
        self->request(config.reservation, config.timeout, route_atom::value,
                      RouteEnvelope{std::move(*request), {}, std::chrono::steady_clock::now()})
            .then(
                [promise](RouteDecisionMessage& decision) mutable {
                  promise.deliver(std::move(decision));
                },
                [self, promise, request_id](caf::error& error) mutable {
                  promise.deliver(RouteDecisionMessage{make_route_error(
                      request_id, Error::timeout,
                      fmt::format("not decided in time: {}", self->system().render(error)))});
                });
        return promise;
      },
      [self, config](report_atom,
                     LifecycleReportMessage& message) -> caf::result<LifecycleAckMessage> {
        auto report = decode_lifecycle_report(message.value, config.limits);
        if (!report) return LifecycleAckMessage{make_lifecycle_ack(false, report.error())};
        auto promise = self->make_response_promise<LifecycleAckMessage>();
        self->request(config.reservation, config.timeout, report_atom::value,
                      ReportEnvelope{std::move(*report), {}})
            .then([promise](LifecycleAckMessage& ack) mutable { promise.deliver(std::move(ack)); },
                  [self, promise](caf::error& error) mutable {
                    promise.deliver(LifecycleAckMessage{
                        make_lifecycle_ack(false, fmt::format("not acknowledged in time: {}",
                                                              self->system().render(error)))});
                  });
        return promise;
      },
  };
}

}  // namespace kvr::actors
