// What the HTTP route groups of `kvr mocker --speak vllm` share (VllmRouteContext) and the form of
// a group's registration (VllmRouteGroup). VllmEngineServer builds the context and calls every
// group of its list once, before the server starts; a new API is a new group in that list.
#pragma once

#include <atomic>
#include <cstdint>
#include <expected>
#include <string>
#include <vector>

#include "deploy/mocker/vllm_engine_loop.hpp"
#include "deploy/mocker/vllm_request.hpp"

namespace httplib {
class Server;
}  // namespace httplib

namespace kvr::mocker {

struct VllmEngineOptions;

/// Calls of the endpoints that give a prompt's token ids without serving it (on /metrics as
/// kvr_mock_render_requests_total).
struct RenderCalls {
  std::atomic<std::uint64_t> chat_render{0};
  std::atomic<std::uint64_t> completions_render{0};
  std::atomic<std::uint64_t> tokenize{0};
};

/// What every route of one engine reaches; it outlives the HTTP server's handlers, which may use
/// it from any server thread.
class VllmRouteContext {
 public:
  /// `options` and `engine` must outlive the context.
  VllmRouteContext(const VllmEngineOptions& options, VllmEngineLoop& engine);

  const VllmEngineOptions& options() const { return options_; }
  VllmEngineLoop& engine() const { return engine_; }

  /// Unix time the engine started, published as prometheus_client's process_start_time_seconds:
  /// a bridge reads a change of it as an engine restart.
  double start_unix_seconds() const { return start_unix_seconds_; }

  /// The name answers carry for a request of `lora` (0: the served model).
  const std::string& model_name(std::uint32_t lora) const;

  /// The context length vLLM reports: every GPU block's tokens.
  std::uint64_t max_model_len() const;

  /// Hands a prompt to the engine and waits until it is admitted; its tokens then arrive on the
  /// channel. The error is the answer: 503 while the engine shuts down, 400 when it refuses.
  std::expected<AdmittedRequest, HttpError> submit(std::vector<std::uint32_t> tokens,
                                                   std::uint32_t lora,
                                                   const Generation& generation) const;

  RenderCalls& render_calls() { return render_calls_; }

  /// A fresh id for a render endpoint's answer.
  std::uint64_t next_render_id() { return next_render_id_++; }

 private:
  const VllmEngineOptions& options_;
  VllmEngineLoop& engine_;
  double start_unix_seconds_;
  RenderCalls render_calls_;
  std::atomic<std::uint64_t> next_render_id_{1};
};

/// Registers one group of routes on `http`; the handlers keep a reference to `context`.
using VllmRouteGroup = void (*)(httplib::Server& http, VllmRouteContext& context);

}  // namespace kvr::mocker
