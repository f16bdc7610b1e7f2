// The actor API of a kvr node: what an out-of-process CAF client needs to talk to the ingress actor
// a node publishes on its --actor-port (docs/actor-client.md). The messages are kvr's protobuf
// messages (messages/kvr/v1/routing.proto) carried through CAF as their serialised bytes.
// Installed with the SDK (<kvr/actors/client/ingress_protocol.hpp>, target kvr::actor_client);
// the node's own actor types (actors/actor_types.hpp) build on it.
#pragma once

#include <string>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/meta/load_callback.hpp>
#include <caf/meta/save_callback.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/sec.hpp>
#include <caf/type_id.hpp>
#include <caf/typed_actor.hpp>

#include "kvr/v1/routing.pb.h"

namespace kvr::actors {

/// A protobuf message carried through CAF as its serialised bytes.
template <class Proto>
struct ProtoMessage {
  Proto value;
};

/// RouteRequest → RouteDecision, LifecycleReport → LifecycleAck, GenerateRequest → RouteDecision
/// plus a GenerateChunk stream, GenerateCancel (messages/kvr/v1/routing.proto).
using RouteRequestMessage = ProtoMessage<v1::RouteRequest>;
using RouteDecisionMessage = ProtoMessage<v1::RouteDecision>;
using LifecycleReportMessage = ProtoMessage<v1::LifecycleReport>;
using LifecycleAckMessage = ProtoMessage<v1::LifecycleAck>;
using GenerateRequestMessage = ProtoMessage<v1::GenerateRequest>;
using GenerateChunkMessage = ProtoMessage<v1::GenerateChunk>;
using GenerateCancelMessage = ProtoMessage<v1::GenerateCancel>;

/// Bytes that do not parse as the message fail the receiving side's deserialisation.
template <class Inspector, class Proto>
typename Inspector::result_type inspect(Inspector& f, ProtoMessage<Proto>& x) {
  std::string bytes;
  return f(caf::meta::type_name("kvr::actors::ProtoMessage"),
           caf::meta::save_callback([&]() -> caf::error {
             if (!x.value.SerializeToString(&bytes)) {
               return caf::make_error(caf::sec::invalid_argument);
             }
             return caf::none;
           }),
           bytes, caf::meta::load_callback([&]() -> caf::error {
             if (!x.value.ParseFromString(bytes)) {
               return caf::make_error(caf::sec::invalid_argument);
             }
             return caf::none;
           }));
}

}  // namespace kvr::actors

// A client registers this block: config.add_message_types<caf::id_block::kvr_actors>(). Atoms have
// at most 10 characters in CAF 0.17.
CAF_BEGIN_TYPE_ID_BLOCK(kvr_actors, caf::first_custom_type_id)
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::RouteRequestMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::RouteDecisionMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::LifecycleReportMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::LifecycleAckMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::GenerateRequestMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::GenerateChunkMessage))
CAF_ADD_TYPE_ID(kvr_actors, (kvr::actors::GenerateCancelMessage))
CAF_ADD_ATOM(kvr_actors, kvr::actors, route_atom, "route")
CAF_ADD_ATOM(kvr_actors, kvr::actors, report_atom, "report")
CAF_ADD_ATOM(kvr_actors, kvr::actors, generate_atom, "generate")
CAF_ADD_ATOM(kvr_actors, kvr::actors, cancel_atom, "cancel")
CAF_ADD_ATOM(kvr_actors, kvr::actors, chunk_atom, "chunk")
CAF_END_TYPE_ID_BLOCK(kvr_actors)

namespace kvr::actors {

/// An actor client's generate stream: the chunks of its response, the last with `finished` set.
using stream_client_actor = caf::typed_actor<
    // one chunk of the response
    caf::reacts_to<chunk_atom, GenerateChunkMessage>>;

/// The published ingress actor, the request API for actor clients (local or remote):
///  - route: a RouteRequest → its RouteDecision (success with a booking, or an explicit error);
///  - report: a LifecycleReport against a booking → LifecycleAck;
///  - generate: a GenerateRequest (its stream_subject is ignored) → the first RouteDecision, and
///    the response streamed to the requesting actor as (chunk_atom, GenerateChunkMessage)
///    messages, the last with `finished` set; the node retries a worker failure before the first
///    token as over NATS. A client that terminates cancels its requests;
///  - cancel: a GenerateCancel for a request the client started here.
/// A remote client registers caf::id_block::kvr_actors with its actor_system_config and
/// connects with middleman().remote_actor<ingress_actor>(host, port).
using ingress_actor = caf::typed_actor<
    caf::replies_to<route_atom, RouteRequestMessage>::with<RouteDecisionMessage>,
    // A route request another node forwards, with its client's scope (scope_request_id).
    caf::replies_to<route_atom, RouteRequestMessage, std::string>::with<RouteDecisionMessage>,
    caf::replies_to<report_atom, LifecycleReportMessage>::with<LifecycleAckMessage>,
    caf::replies_to<generate_atom, GenerateRequestMessage>::with<RouteDecisionMessage>,
    caf::reacts_to<cancel_atom, GenerateCancelMessage>>;

}  // namespace kvr::actors
