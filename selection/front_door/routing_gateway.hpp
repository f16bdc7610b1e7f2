// How the front door reaches the router: route requests and lifecycle reports, as a NATS or actor
// client would send them. The node implements it with an actor in front of its entry (so cluster
// mode forwards to the partition's owner as for any client); tests implement it by hand.
#pragma once

#include <functional>

#include "kvr/v1/routing.pb.h"

namespace kvr::front_door {

class RoutingGateway {
 public:
  virtual ~RoutingGateway() = default;
  /// Routes and books; `done` runs exactly once, on any thread, with a success or an explicit
  /// error.
  virtual void route(v1::RouteRequest request, std::function<void(v1::RouteDecision)> done) = 0;
  /// First token, completion or abort of a booking; fire and forget (the node logs a refusal).
  virtual void report(v1::LifecycleReport report) = 0;
};

}  // namespace kvr::front_door
