#include "deploy/mocker/vllm_route_context.hpp"

#include <utility>

#include <fmt/format.h>

#include "deploy/mocker/vllm_engine_server.hpp"

namespace kvr::mocker {

VllmRouteContext::VllmRouteContext(const VllmEngineOptions& options, VllmEngineLoop& engine)
    : options_(options), engine_(engine), start_unix_seconds_(unix_seconds()) {}

const std::string& VllmRouteContext::model_name(std::uint32_t lora) const {
  return lora == 0 ? options_.model : options_.lora_adapters[lora - 1];
}

std::uint64_t VllmRouteContext::max_model_len() const {
  return std::uint64_t{options_.engine.block_size} * options_.engine.num_gpu_blocks;
}

std::expected<AdmittedRequest, HttpError> VllmRouteContext::submit(
    std::vector<std::uint32_t> tokens, std::uint32_t lora, const Generation& generation) const {
  auto admitted = engine_.submit(EngineSubmission{.tokens = std::move(tokens),
                                                  .lora = lora,
                                                  .max_tokens = generation.max_tokens,
                                                  .sampling = generation.sampling,
                                                  .kv_transfer = generation.kv_transfer});
  if (admitted) return std::move(*admitted);
  if (admitted.error().shutting_down) {
    return std::unexpected(
        HttpError{503, "the engine is shutting down", "ServiceUnavailableError"});
  }
  return std::unexpected(
      bad_request(fmt::format("the engine refused the request: {}", admitted.error().reason)));
}

}  // namespace kvr::mocker
