// The plain forms of generate (proxy) mode: a validated GenerateRequest, the request the node
// dispatches to a worker, a worker's GenerateChunk as the lifecycle sees it, and the chunk that
// ends a client's stream when kvr (not the worker) ends it. Used by the NATS bridge (decoding in
// its callback) and the lifecycle actor; unit-tested without CAF.
#pragma once

#include <cstddef>
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

/// Validates a wire request: no kv_transfer_params (the router's own), its route as
/// decode_route_request does, a non-empty bounded
/// stream subject when streaming to a subject, and output tokens in [1, kMaxGenerateOutputTokens]
/// (max_output_tokens, else route.expected_output_tokens). The failure's code is
/// Error::invalid_request.
std::expected<GenerateRequestData, RouteFailure> decode_generate_request(
    const v1::GenerateRequest& wire, const RouteDecodeLimits& limits = {},
    StreamTo stream_to = StreamTo::subject);

/// The largest kv_transfer_params accepted from a client or a prefill worker, in bytes.
inline constexpr std::size_t kMaxKvTransferParamsBytes = 64 * 1024;

/// What a worker's copy of a request may add to the client's: the node's stream subject, the
/// rank, a hop's output tokens and a decode hop's kv_transfer_params.
inline constexpr std::size_t kWorkerRequestHeadroom = kMaxKvTransferParamsBytes + 1024;

/// Why `request` cannot be sent to a worker when a message is at most `max_payload` bytes (NATS's
/// max_payload; 0: no limit), naming the limit and about how many prompt tokens fit; nullopt
/// when it can. Checked before routing, so that such a request is refused up front rather than
/// failing at dispatch (where it would be taken for the worker's fault).
std::optional<std::string> too_large_for_workers(const GenerateRequestData& request,
                                                 std::size_t max_payload);

/// Why a prefill worker's `params` cannot be passed on to the decode hop (empty: they can): not a
/// JSON object, or longer than kMaxKvTransferParamsBytes.
std::optional<std::string> kv_transfer_params_error(std::string_view params);

/// One hop of a disaggregated request, as the worker is sent it.
struct WorkerHop {
  /// Replaces the request's max_output_tokens (the prefill hop: 1).
  std::optional<std::uint32_t> max_output_tokens;
  /// Replaces the request's kv_transfer_params; empty: left as the client sent them.
  std::string_view kv_transfer_params;
};

/// The request the node publishes on the chosen worker's generate subject: the client's request
/// with the node's `stream_subject`, the chosen rank and, for a hop of a disaggregated request,
/// the hop's output tokens and transfer parameters.
v1::GenerateRequest encode_worker_generate_request(const GenerateRequestData& request, DpRank rank,
                                                   std::string_view stream_subject,
                                                   const WorkerHop& hop = {});

/// A worker's chunk as the lifecycle needs it; an error chunk (finish_reason "error" or an error
/// set) carries the error's message.
StreamChunk decode_stream_chunk(const v1::GenerateChunk& chunk);

/// The final chunk sent to the client when kvr ends its stream (`index`: chunks sent so far).
v1::GenerateChunk encode_end_chunk(std::string_view request_id, std::uint32_t index,
                                   const StreamEnd& end, std::optional<WorkerWithDpRank> worker);

/// The subject a worker serves cancellation on: its generate subject + ".cancel".
std::string worker_cancel_subject(std::string_view generate_subject);

}  // namespace kvr
