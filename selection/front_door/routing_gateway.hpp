// How the front door reaches the router: route requests and lifecycle reports, as a NATS or actor
// client would send them, and generate streams for workers it cannot forward to. The node
// implements it with an actor in front of its entry (so cluster mode forwards to the partition's
// owner as for any client); tests implement it by hand.
#pragma once

#include <functional>
#include <memory>

#include "kvr/v1/routing.pb.h"

namespace kvr::front_door {

/// Where a generate stream's answer goes; each runs on any thread.
struct GenerateCallbacks {
  /// The first decision, exactly once: the worker the request was dispatched to, or an explicit
  /// error (then no chunk follows).
  std::function<void(v1::RouteDecision)> decision;
  /// The answer's chunks in order, the last with `finished` set (an error ends it too).
  std::function<void(v1::GenerateChunk)> chunk;
};

/// A generate stream in flight.
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  /// The client went away: the node cancels the request at its worker and ends its booking; no
  /// callback runs after it returns, or soon after.
  virtual void cancel() = 0;
};

class RoutingGateway {
 public:
  virtual ~RoutingGateway() = default;
  /// Routes and books; `done` runs exactly once, on any thread, with a success or an explicit
  /// error.
  virtual void route(v1::RouteRequest request, std::function<void(v1::RouteDecision)> done) = 0;
  /// First token, completion or abort of a booking; fire and forget (the node logs a refusal).
  virtual void report(v1::LifecycleReport report) = 0;
  /// Generates through the node (kvr's generate API over NATS: the node routes, dispatches,
  /// retries a worker failure before the first token, and ends the booking itself).
  virtual std::shared_ptr<GenerateStream> generate(v1::GenerateRequest request,
                                                   GenerateCallbacks callbacks) = 0;
};

}  // namespace kvr::front_door
