// The routes of `kvr mocker --speak vllm` that give a prompt's token ids without serving it, as
// vLLM's: POST /tokenize, POST /detokenize, and (unless render_endpoints is false, as a vLLM
// without them) POST /v1/completions/render and POST /v1/chat/completions/render. Registered by
// VllmEngineServer.
#pragma once

#include "deploy/mocker/vllm_route_context.hpp"

namespace kvr::mocker {

/// Registers the tokenize, detokenize and render routes (a VllmRouteGroup).
void add_vllm_render_routes(httplib::Server& http, VllmRouteContext& context);

}  // namespace kvr::mocker
