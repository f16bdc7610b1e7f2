// The routes of `kvr mocker --speak vllm` that describe the engine rather than serve a prompt:
// GET /health, GET /v1/models (the served model, then each LoRA adapter) and GET /metrics
// (Prometheus text with vLLM's metric names). Registered by VllmEngineServer.
#pragma once

#include "deploy/mocker/vllm_route_context.hpp"

namespace kvr::mocker {

/// Registers /health, /v1/models and /metrics (a VllmRouteGroup).
void add_vllm_info_routes(httplib::Server& http, VllmRouteContext& context);

}  // namespace kvr::mocker
