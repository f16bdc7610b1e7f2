#include "selection/wire/generate_messages.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvr {

std::expected<GenerateRequestData, RouteFailure> decode_generate_request(
    const v1::GenerateRequest& wire, const RouteDecodeLimits& limits, StreamTo stream_to) {
  const auto invalid = [](std::string message) {
    return std::unexpected(RouteFailure{Error::invalid_request, std::move(message)});
  };
  if (!wire.has_route()) return invalid("route: missing");
  if (wire.route().query_only()) return invalid("route.query_only: a generate request is served");
  if (stream_to == StreamTo::subject) {
    if (wire.stream_subject().empty()) return invalid("stream_subject: empty");
    // Subjects are bounded like ids, with room for an inbox prefix.
    if (wire.stream_subject().size() > limits.max_id_length * 2) {
      return invalid(fmt::format("stream_subject: longer than {} bytes", limits.max_id_length * 2));
    }
    if (wire.stream_subject().find_first_of(" \t\r\n*>") != std::string::npos) {
      return invalid("stream_subject: contains whitespace or a wildcard");
    }
  }
  std::uint32_t output_tokens = wire.max_output_tokens();
  if (output_tokens == 0 && wire.route().has_expected_output_tokens()) {
    output_tokens = wire.route().expected_output_tokens();
  }
  if (output_tokens == 0 || output_tokens > kMaxGenerateOutputTokens) {
    return invalid(fmt::format("max_output_tokens: must be in [1, {}]", kMaxGenerateOutputTokens));
  }
  if (!wire.kv_transfer_params().empty()) {
    // They name hosts a decode worker pulls KV from: only the router sets them (a client's would
    // let it point an engine at any address).
    return invalid(
        "kv_transfer_params: set by the router for the hops of a disaggregated model; a client "
        "may not send them");
  }
  auto route = decode_route_request(wire.route(), limits);
  if (!route) return std::unexpected(std::move(route.error()));
  GenerateRequestData data;
  data.route = std::move(*route);
  if (stream_to == StreamTo::subject) data.stream_subject = wire.stream_subject();
  data.wire = wire;
  return data;
}

std::optional<std::string> kv_transfer_params_error(std::string_view params) {
  if (params.size() > kMaxKvTransferParamsBytes) {
    return fmt::format("longer than {} bytes", kMaxKvTransferParamsBytes);
  }
  const auto parsed = nlohmann::json::parse(params, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return std::string{"not valid JSON"};
  if (!parsed.is_object()) return std::string{"not a JSON object"};
  return std::nullopt;
}

v1::GenerateRequest encode_worker_generate_request(const GenerateRequestData& request, DpRank rank,
                                                   std::string_view stream_subject,
                                                   const WorkerHop& hop) {
  v1::GenerateRequest dispatched = request.wire;
  dispatched.set_dp_rank(rank);
  dispatched.set_stream_subject(std::string{stream_subject});
  if (hop.max_output_tokens) dispatched.set_max_output_tokens(*hop.max_output_tokens);
  if (!hop.kv_transfer_params.empty()) {
    dispatched.set_kv_transfer_params(std::string{hop.kv_transfer_params});
  }
  return dispatched;
}

std::optional<std::string> too_large_for_workers(const GenerateRequestData& request,
                                                 std::size_t max_payload) {
  if (max_payload == 0) return std::nullopt;
  const std::size_t limit = max_payload - std::min(max_payload, kWorkerRequestHeadroom);
  const std::size_t size = request.wire.ByteSizeLong();
  if (size <= limit) return std::nullopt;
  const auto ids = static_cast<std::size_t>(request.wire.route().tokens().ids_size());
  const std::size_t tokens_that_fit = ids == 0 ? 0 : ids * limit / size;
  return fmt::format(
      "the request is {} bytes; a worker can be sent at most {} over NATS (the server's "
      "max_payload {} less {} for the node's own fields), about {} prompt tokens: shorten the "
      "prompt, raise nats-server's max_payload, or give the workers an HTTP URL",
      size, limit, max_payload, kWorkerRequestHeadroom, tokens_that_fit);
}

StreamChunk decode_stream_chunk(const v1::GenerateChunk& chunk) {
  StreamChunk plain;
  plain.worker = WorkerWithDpRank{chunk.worker_id(), chunk.dp_rank()};
  plain.index = chunk.index();
  plain.tokens = static_cast<std::size_t>(chunk.token_ids_size());
  plain.finished = chunk.finished();
  if (chunk.has_error() || chunk.finish_reason() == "error") {
    plain.error = chunk.has_error() && !chunk.error().message().empty()
                      ? chunk.error().message()
                      : std::string{"the worker reported an error"};
  }
  plain.finish_reason = chunk.finish_reason();
  plain.cached_prompt_tokens = chunk.cached_prompt_tokens();
  if (!chunk.kv_transfer_params().empty()) {
    plain.kv_transfer_params = chunk.kv_transfer_params();
    plain.kv_transfer_params_error = kv_transfer_params_error(plain.kv_transfer_params);
  }
  return plain;
}

v1::GenerateChunk encode_end_chunk(std::string_view request_id, std::uint32_t index,
                                   const StreamEnd& end, std::optional<WorkerWithDpRank> worker) {
  v1::GenerateChunk chunk;
  chunk.set_request_id(std::string{request_id});
  chunk.set_index(index);
  if (worker) {
    chunk.set_worker_id(worker->worker_id);
    chunk.set_dp_rank(worker->dp_rank);
  }
  chunk.set_finished(true);
  chunk.set_finish_reason(end.finish_reason);
  if (end.error) {
    auto* error = chunk.mutable_error();
    error->set_code(to_route_error_code(*end.error));
    error->set_message(end.message);
  }
  return chunk;
}

std::string worker_cancel_subject(std::string_view generate_subject) {
  return std::string{generate_subject} + ".cancel";
}

}  // namespace kvr
