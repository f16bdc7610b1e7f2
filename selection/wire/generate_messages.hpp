// The plain forms of generate (proxy) mode: a validated GenerateRequest, the request the node
// dispatches to a worker, a worker's GenerateChunk as the lifecycle sees it, and the chunk that
// ends a client's stream when kvr (not the worker) ends it. Used by the NATS bridge (decoding in
// its callback) and the lifecycle actor; unit-tested without CAF.
#pragma once

#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>

#include "kvr/v1/routing.pb.h"
#include "selection/lifecycle/stream_events.hpp"
#include "selection/wire/route_messages.hpp"

namespace kvr {

/// The largest max_output_tokens accepted (the simulated worker's bound).
inline constexpr std::uint32_t kMaxGenerateOutputTokens = std::uint32_t{1} << 20;

/// A validated generate request.
struct GenerateRequestData {
  /// The routing part.
  RouteRequest route;
  /// Where the client reads its GenerateChunk stream; empty when it streams to an actor.
  std::string stream_subject;
  /// The request as received; re-sent to the worker with the node's stream subject and rank.
  v1::GenerateRequest wire;
};

/// Where a client reads its response stream.
enum class StreamTo : std::uint8_t {
  subject,  ///< the request's NATS stream_subject (NATS clients)
  actor,    ///< the requesting actor (actor clients); stream_subject is ignored
};

/// Validates a wire request: its route as decode_route_request does, a non-empty bounded
/// stream subject when streaming to a subject, and output tokens in [1, kMaxGenerateOutputTokens]
/// (max_output_tokens, else route.expected_output_tokens). The failure's code is
/// Error::invalid_request.
std::expected<GenerateRequestData, RouteFailure> decode_generate_request(
    const v1::GenerateRequest& wire, const RouteDecodeLimits& limits = {},
    StreamTo stream_to = StreamTo::subject);

/// The request the node publishes on the chosen worker's generate subject: the client's request
/// with the node's `stream_subject` and the chosen rank.
v1::GenerateRequest encode_worker_generate_request(const GenerateRequestData& request, DpRank rank,
                                                   std::string_view stream_subject);

/// A worker's chunk as the lifecycle needs it; an error chunk (finish_reason "error" or an error
/// set) carries the error's message.
StreamChunk decode_stream_chunk(const v1::GenerateChunk& chunk);

/// The final chunk sent to the client when kvr ends its stream (`index`: chunks sent so far).
v1::GenerateChunk encode_end_chunk(std::string_view request_id, std::uint32_t index,
                                   const StreamEnd& end, std::optional<WorkerWithDpRank> worker);

/// The subject a worker serves cancellation on: its generate subject + ".cancel".
std::string worker_cancel_subject(std::string_view generate_subject);

}  // namespace kvr
