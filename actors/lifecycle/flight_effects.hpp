// What the lifecycle actor sends out for a request's flight: the client's first RouteDecision and
// stream (to an actor client or on its NATS subjects), booking changes to the partition's
// selector, cancels to workers, the node's metrics of each step, and refusals made before a
// request is taken.
#pragma once

#include <string>

#include "actors/lifecycle/lifecycle_actor.hpp"

namespace kvr::actors {

using LifecycleSelf = lifecycle_actor::stateful_pointer<LifecycleActorState>;

/// Sends the request's first RouteDecision (once): the response to an actor client, else on the
/// request's reply subject.
void publish_decision(LifecycleSelf self, GenerateFlight& flight,
                      const v1::RouteDecision& decision);

/// Sends one chunk of the client's stream: to its actor, else on its stream subject.
void send_chunk(LifecycleSelf self, const GenerateFlight& flight, const v1::GenerateChunk& chunk);

/// Ends the client's stream with kvr's final chunk (and the decision, if none was sent yet).
void end_client_stream(LifecycleSelf self, GenerateFlight& flight, const StreamEnd& end);

/// Sends a booking change to the partition's selector; a failure is only logged (the selector's
/// booking expiry releases a booking whose update was lost).
void send_booking(LifecycleSelf self, const GenerateFlight& flight, BookingChange change);

/// Tells `worker` (the client-facing attempt's, else the prefill hop's) to stop the request.
void cancel_at_worker(LifecycleSelf self, const GenerateFlight& flight, WorkerWithDpRank worker);

/// Records what `step` observed in the node's metrics: the cache outcome, timeouts, hop times,
/// retries and the request's outcome.
void record_step(LifecycleSelf self, const GenerateFlight& flight, const FlightStep& step);

/// Monitors an actor client while it has requests in flight (its end cancels them): counted per
/// flight, the first starts the monitoring and the last stops it.
void track_client(LifecycleSelf self, const stream_client_actor& client);
void untrack_client(LifecycleSelf self, const stream_client_actor& client);

/// Refuses a request before it is taken: its decision (the response to an actor client, else on
/// its reply subject) and the end of its stream.
caf::result<RouteDecisionMessage> refuse(LifecycleSelf self, const GenerateEnvelope& envelope,
                                         Error code, const std::string& message);

}  // namespace kvr::actors
