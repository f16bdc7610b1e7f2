// OpenAI's text generation routes on `kvr mocker --speak vllm`: POST /v1/completions and POST
// /v1/chat/completions, one engine queue for both, answered as one JSON object or as a stream of
// `data: {json}\n\n` events ending `data: [DONE]`, as vLLM answers. Registered by VllmEngineServer.
#pragma once

#include "deploy/mocker/vllm_route_context.hpp"

namespace kvr::mocker {

/// Registers /v1/completions and /v1/chat/completions (a VllmRouteGroup).
void add_vllm_completion_routes(httplib::Server& http, VllmRouteContext& context);

}  // namespace kvr::mocker
