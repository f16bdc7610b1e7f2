// A generate response stream as the node sees it: a worker's chunk, and the end kvr puts on a
// client's stream. Shared vocabulary of the lifecycle, the wire codecs and the lifecycle actor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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
  /// The engine's finish reason on the last chunk ("stop", "length", ...).
  std::string finish_reason;
  /// Prompt tokens the worker's engine served from its cache (reported on the first chunk).
  std::uint64_t cached_prompt_tokens = 0;
  /// A prefill hop's answer on its last chunk: where a decode worker can pull the KV.
  std::string kv_transfer_params;
  /// Why kv_transfer_params cannot be passed on (not a JSON object, too long); empty: they can.
  std::optional<std::string> kv_transfer_params_error;
};

/// What the node asks of a prefill worker (vLLM's NIXL exchange): prefill, keep the KV for a
/// decode worker to pull, and answer with where it is.
inline constexpr std::string_view kRemoteDecodeTransferParams =
    R"({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,)"
    R"("remote_block_ids":null,"remote_host":null,"remote_port":null})";

/// The final chunk the node sends the client when kvr, not the worker, ends the stream.
struct StreamEnd {
  /// "error" or "cancelled" (kvr.v1.GenerateChunk.finish_reason).
  std::string finish_reason;
  /// The error code for "error".
  std::optional<Error> error;
  std::string message;
};

}  // namespace kvr
