#include "actors/ingress/ingress_actor.hpp"

#include <caf/typed_event_based_actor.hpp>
#include <caf/typed_response_promise.hpp>

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
        // Delegated: the reservation actor answers the client itself and always answers (its
        // own request to the selector carries the timeout). A request/then here would add a
        // response hop and a timer on CAF's clock thread per decision, measured at several
        // microseconds of CPU each (tests/bench/node).
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        promise.delegate(config.reservation, route_atom::value,
                         RouteEnvelope{std::move(*request), {}, std::chrono::steady_clock::now()});
        return promise;
      },
      [self, config](report_atom,
                     LifecycleReportMessage& message) -> caf::result<LifecycleAckMessage> {
        auto report = decode_lifecycle_report(message.value, config.limits);
        if (!report) return LifecycleAckMessage{make_lifecycle_ack(false, report.error())};
        // Delegated as route requests are: the reservation actor always acknowledges.
        auto promise = self->make_response_promise<LifecycleAckMessage>();
        promise.delegate(config.reservation, report_atom::value,
                         ReportEnvelope{std::move(*report), {}});
        return promise;
      },
  };
}

}  // namespace kvr::actors
