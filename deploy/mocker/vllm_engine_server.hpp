// `kvr mocker --speak vllm`: the simulated engine (deploy/simulation/engine.hpp) behind vLLM's own
// wire formats instead of kvr's NATS protocol, so that `kvr bridge` and kvr's OpenAI-compatible
// front door can be tested end to end against what a real vLLM serves:
//  - HTTP (cpp-httplib), with vLLM's error object {"error": {message, type, param, code}} (400 for
//    a bad body, 404 for another model):
//    - POST /v1/completions (prompt: token ids, or text through the mock tokenizer,
//      deploy/mocker/mock_tokenizer.hpp) and POST /v1/chat/completions (messages through the mock
//      tokenizer's chat template): one engine queue for both, answered as one JSON object or
//      streamed as `data: {json}\n\n` events ending `data: [DONE]` (stream_options include_usage
//      and continuous_usage_stats); every usage has prompt_tokens_details.cached_tokens, the
//      prompt tokens the engine's prefix cache served. A client that goes away aborts its request.
//    - POST /v1/completions/render (an array, one object per prompt) and POST
//      /v1/chat/completions/render (one object): {request_id, token_ids, features: null,
//      sampling_params, model, stream}, the very ids the engine would serve (and publish KV events
//      for); absent with render_endpoints false, so that a front door's fallback can be tested.
//    - POST /tokenize ({prompt} or {messages}) → {count, max_model_len, tokens, token_strs} and
//      POST /detokenize ({tokens}) → {prompt}.
//    - GET /v1/models (the served model, then each LoRA adapter with its parent and root, as
//      vLLM lists them), GET /health and GET /metrics (Prometheus text with vLLM's metric names:
//      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
//      vllm:cache_config_info, vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total,
//      prometheus_client's process_start_time_seconds, and the mock's own
//      kvr_mock_render_requests_total{endpoint} counting render and tokenize calls).
//    Sampling parameters are accepted with vLLM's type checks; seed (the tokens follow it),
//    stop_token_ids (finish_reason "stop") and min_tokens are honoured, the rest ignored.
//  - Disaggregated serving as vLLM's NixlConnector speaks it: /v1/completions and
//    /v1/chat/completions take a top-level `kv_transfer_params` object. {"do_remote_decode": true}
//    makes a prefill hop (one token; the prompt's blocks held for the decode worker) whose answer
//    carries, at its top level, the parameters the decode hop passes on ({"do_remote_prefill":
//    true, "remote_block_ids": [...], "remote_engine_id", ...}); every other non-streaming answer
//    has "kv_transfer_params": null, as vLLM's. A streamed answer never carries them: vLLM's
//    stream responses have no such field (its proxies send the prefill hop with stream=false).
//    {"do_remote_prefill": true, ...} makes a decode hop that pulls the prompt's blocks it does not
//    hold, at most len(remote_block_ids), waiting for the modelled transfer (TransferConfig) and
//    counting them as cached. With no side channel between engines, a prefill engine releases its
//    held blocks when the modelled transfer of that many blocks would be over. Roles are not
//    checked (vLLM does not check them either).
//  - ZMQ PUB: the engine's KV events as msgpack KVEventBatch in vLLM's three-frame messages
//    (topic, 8-byte big-endian sequence from 0, payload), encoded as vLLM's msgspec Structs with
//    array_like=True and omit_defaults=True: [ts, [events...], dp_rank], each event tagged by its
//    class name first: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, "GPU"]
//    (an adapter's blocks: lora_id its 1-based index, then lora_name),
//    ["BlockRemoved", hashes, "GPU"], ["AllBlocksCleared"].
//  - ZMQ ROUTER: vLLM's replay service: (identity, "", start sequence) is answered with every
//    buffered batch from there, then sequence -1 with an empty payload.
// The engine's block hashes are kvr's chained hashes multiplied by an odd constant (a bijection),
// so a bridge that forwarded them unchanged, instead of recomputing kvr's from the tokens, would
// route nowhere. A request's `model` is the served model or one of its LoRA adapters (each answer
// echoes it); as in vLLM, an adapter's blocks are cached apart from the base model's (their hashes
// are kvr's in the adapter's namespace). Only text content is accepted.
//
// Where each part lives: the engine thread in vllm_engine_loop.hpp, the KV event encoding in
// vllm_kv_events.hpp and its sockets in vllm_kv_event_sockets.hpp, kv_transfer_params in
// kv_transfer_params.hpp, request reading in vllm_request.hpp, and the HTTP routes in groups
// (vllm_route_context.hpp: vllm_info_routes, vllm_completion_routes, vllm_render_routes).
#pragma once

#include <cstdint>
#include <expected>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "deploy/simulation/engine_config.hpp"

namespace kvr::tokenizer {
class PromptTokenizer;
}  // namespace kvr::tokenizer

namespace kvr::mocker {

/// One vLLM-speaking engine.
struct VllmEngineOptions {
  std::string model = "mock-model";
  /// Interface every socket binds to.
  std::string host = "127.0.0.1";
  std::uint16_t http_port = 8000;
  std::uint16_t kv_events_port = 5557;
  /// 0: no replay socket.
  std::uint16_t replay_port = 5558;
  /// The ZMQ topic of every KV event message (vLLM's default is empty).
  std::string topic;
  /// Batches the replay socket keeps (vLLM keeps 10,000).
  std::size_t replay_buffer = 10'000;
  /// Fault injection: every nth batch is not sent live (it stays replayable); 0: none.
  std::uint32_t skip_every = 0;
  /// HTTP server threads (each streaming response holds one).
  std::uint32_t http_threads = 64;
  /// Serve /v1/completions/render and /v1/chat/completions/render (false: 404, as a vLLM without
  /// them answers).
  bool render_endpoints = true;
  /// LoRA adapters served besides `model` (vLLM's --lora-modules), by name; adapter i (0-based)
  /// has lora_id i + 1 in KV events.
  std::vector<std::string> lora_adapters;
  /// A real model's tokenizer and chat template for prompts (render, tokenize, generation);
  /// null: the mock tokenizer (deploy/mocker/mock_tokenizer.hpp).
  std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer;
  simulation::EngineConfig engine;
};

/// Adapter names must be non-empty, unique and other than the served model's; the error says
/// which is not.
std::expected<void, std::string> check_lora_adapters(std::string_view model,
                                                     const std::vector<std::string>& adapters);

/// The engine's threads and sockets; stops when destroyed.
class VllmEngineServer {
 public:
  /// Binds every socket (an error names which) and starts serving.
  static std::expected<std::unique_ptr<VllmEngineServer>, std::string> start(
      VllmEngineOptions options);
  ~VllmEngineServer();
  VllmEngineServer(const VllmEngineServer&) = delete;
  VllmEngineServer& operator=(const VllmEngineServer&) = delete;

  /// "http://host:port".
  std::string url() const;

 private:
  struct State;
  explicit VllmEngineServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvr::mocker
