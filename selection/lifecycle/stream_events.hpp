// A generate response stream as the node sees it: a worker's chunk, and the end kvr puts on a
// client's stream. Shared vocabulary of the lifecycle, the wire codecs and the lifecycle actor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "messages/error.hpp"
#include "messages/ids.hpp"

namespace kvr {

/// One chunk of a worker's response stream (kvr.v1.GenerateChunk), as the lifecycle needs it.
struct StreamChunk {
  /// The worker that sent it.
  WorkerWithDpRank worker;
  /// 0, 1, 2 ... per attempt.
  std::uint32_t index = 0;
  /// Output tokens the chunk carries.
  std::size_t tokens = 0;
  /// The last chunk of the response.
  bool finished = false;
  /// Set: the worker failed the request (finish_reason "error").
  std::optional<std::string> error;
};

/// The final chunk the node sends the client when kvr, not the worker, ends the stream.
struct StreamEnd {
  /// "error" or "cancelled" (kvr.v1.GenerateChunk.finish_reason).
  std::string finish_reason;
  /// The error code for "error".
  std::optional<Error> error;
  std::string message;
};

}  // namespace kvr
