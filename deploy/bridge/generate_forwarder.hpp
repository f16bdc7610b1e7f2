// Serves kvr's generate protocol in front of an engine's OpenAI-compatible HTTP API: each
// `GenerateRequest` becomes a streaming `POST /v1/completions` (the prompt as token ids), each
// server-sent event a `GenerateChunk`, and a `GenerateCancel` closes the HTTP stream, which is how
// vLLM and SGLang learn to abort a request. Used by `kvr bridge`.
//
// The request body: {"model", "prompt": [token ids], "max_tokens", "stream": true,
// "stream_options": {"include_usage": true, "continuous_usage_stats": true},
// "return_token_ids": true}; with a cache namespace (a LoRA name, as the bridge's KV translation
// reads it) the model is that name, which is how the engines select an adapter. With more than one
// data-parallel rank the rank goes in the `X-data-parallel-rank` header. The request's
// `sampling` fields that are set are added under vLLM's names (temperature, top_p, top_k, min_p,
// seed, stop, stop_token_ids, presence_penalty, frequency_penalty, repetition_penalty, ignore_eos,
// min_tokens, include_stop_str_in_output, skip_special_tokens); the engine's defaults apply to the
// rest.
//
// The stream: `data: {json}` events separated by a blank line, ending with `data: [DONE]`. Each
// event's `choices[0]` gives the chunk's tokens (`token_ids`) and, on the last one,
// `finish_reason`; `usage.prompt_tokens_details.cached_tokens` (vLLM with
// --enable-prompt-tokens-details, per chunk with continuous usage stats) gives the first chunk's
// cached_prompt_tokens. An event `{"error": {...}}`, an HTTP status other than 200, an engine that
// cannot be reached or a stream that ends without a finish reason each end the stream with an
// error chunk: a caller never waits on silence.
//
// Disaggregated prefill/decode (vLLM only): a request's `kv_transfer_params` (a JSON object) goes
// into the body as its top-level `kv_transfer_params`, as vLLM's OpenAI server takes it (its
// NixlConnector and the other connectors that exchange parameters over HTTP read it). vLLM puts
// the prefill's answer (do_remote_prefill, remote_engine_id, remote_block_ids, remote_host,
// remote_port, ...) only in the top-level `kv_transfer_params` of a non-streaming response, never
// in a stream; so a request whose parameters say `"do_remote_decode": true` (the prefill hop) is
// sent with "stream": false and no stream_options, and without min_tokens (vLLM refuses
// min_tokens above max_tokens, and the prefill hop asks for one token), as vLLM's own P/D proxy
// sends it. Its JSON answer becomes the chunks: one with the generated token(s) and the cached
// prompt tokens, then the last, with the engine's finish reason and, when the answer carries
// them, its kv_transfer_params (re-serialised compactly, the same JSON object). An answer without
// them (vLLM gives none when the one token ended the request by a stop, or the engine has no KV
// connector) is passed on as it is; the router decides. Parameters that are not a JSON object (or
// nested deeper than 64) refuse the request with INVALID_REQUEST naming kv_transfer_params. The
// decode hop (`"do_remote_prefill": true`) streams as any request. SGLang's P/D exchange is not
// this one (the router sends the same request, with bootstrap_host, bootstrap_port and
// bootstrap_room, to the prefill and the decode server at once), so with an SGLang engine a
// request carrying kv_transfer_params is refused, and `kvr bridge` refuses to start in the prefill
// or decode role (BridgeOptions::validate). vLLM's P2pNcclConnector, whose proxy names both peers
// in the X-Request-Id before the prefill, is not supported either.
//
// Threads: a fixed pool of `concurrency` threads, each serving one HTTP stream at a time; further
// requests wait in a bounded queue, beyond which they are refused with an error chunk.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deploy/bridge/engine_metrics.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/ids.hpp"

namespace kvr::bridge {

/// What one server-sent event of a completions stream says.
struct CompletionEvent {
  bool done = false;  ///< `data: [DONE]`
  std::vector<std::uint32_t> token_ids;
  std::optional<std::string> finish_reason;
  std::optional<std::uint32_t> cached_prompt_tokens;
  std::optional<std::string> error;  ///< the engine reported an error in the stream
  bool has_choice = false;           ///< the event carried a choice (not only usage)
  /// The top-level `kv_transfer_params` object, serialised (vLLM's non-streaming answer).
  std::optional<std::string> kv_transfer_params;
};

/// Parses the data of one event, or a whole non-streaming answer (the same fields); an unreadable
/// one (not JSON, not an object, nested deeper than 64) is an error event naming why.
CompletionEvent parse_completion_event(std::string_view data);

/// Splits a byte stream of server-sent events into their data fields (multi-line data joined with
/// "\n"); bytes may arrive in any pieces. Lines other than `data:` (comments, `event:`, `id:`) are
/// ignored. Bounded: an event longer than max_event_bytes makes feed() return false.
class SseReader {
 public:
  explicit SseReader(std::size_t max_event_bytes = std::size_t{1} << 20)
      : max_event_bytes_(max_event_bytes) {}

  /// Appends bytes; calls `on_event` with each complete event's data. False when an event
  /// exceeded the bound or on_event returned false.
  bool feed(std::string_view bytes, const std::function<bool(std::string_view)>& on_event);

 private:
  std::string buffer_;
  std::string data_;
  bool has_data_ = false;
  std::size_t max_event_bytes_;
};

/// One completions request to the engine.
struct CompletionCall {
  std::string body;  ///< the JSON body
  /// Whether the answer is an event stream; false for a prefill hop (`"do_remote_decode": true`),
  /// whose kv_transfer_params vLLM returns only in a whole JSON answer.
  bool stream = true;
};

/// The completions request for `request`, or why it cannot be sent (no token ids, no output
/// tokens, kv_transfer_params that are not a JSON object).
std::expected<CompletionCall, std::string> completion_call(const v1::GenerateRequest& request,
                                                           std::string_view model);

struct GenerateForwarderOptions {
  std::string engine_url = "http://127.0.0.1:8000";
  /// SGLang engines refuse requests with kv_transfer_params (vLLM's exchange, not theirs).
  EngineKind engine = EngineKind::vllm;
  WorkerId worker_id = 0;
  std::uint32_t data_parallel_size = 1;
  /// HTTP streams at once (threads).
  std::uint32_t concurrency = 128;
  /// Requests waiting for a thread before further ones are refused.
  std::size_t max_queued = 4096;
  std::chrono::milliseconds connect_timeout{2000};
  /// Longest silence of the engine within one stream (a long queue or prefill must fit).
  std::chrono::milliseconds read_timeout{120'000};
};

/// Counters, readable from any thread.
struct GenerateForwarderStats {
  std::uint64_t requests = 0;   ///< generate requests received
  std::uint64_t completed = 0;  ///< streams the engine finished
  std::uint64_t cancelled = 0;  ///< streams ended by a cancel
  std::uint64_t failed = 0;     ///< streams ended by an HTTP or engine error
  std::uint64_t refused = 0;    ///< requests refused before reaching the engine
};

/// The pool of HTTP streams. Thread-safe.
class GenerateForwarder {
 public:
  /// Publishes one chunk on a stream subject (from a pool thread or the caller's).
  using Publish = std::function<void(const std::string& subject, const v1::GenerateChunk& chunk)>;

  /// Starts the threads; an error names the invalid option.
  static std::expected<std::unique_ptr<GenerateForwarder>, std::string> start(
      GenerateForwarderOptions options, Publish publish);
  /// Ends every stream, queued ones too, with an error chunk, and joins the threads.
  ~GenerateForwarder();
  GenerateForwarder(const GenerateForwarder&) = delete;
  GenerateForwarder& operator=(const GenerateForwarder&) = delete;

  /// The model name sent when a request has no cache namespace (the engine's served model).
  void set_model(std::string model);

  /// Queues a request; a refused one gets its error chunk at once.
  void submit(v1::GenerateRequest request);

  /// Ends the stream of `request_id`: its HTTP connection is closed and a "cancelled" chunk
  /// published. Unknown or finished ids are ignored.
  void cancel(const std::string& request_id);

  GenerateForwarderStats stats() const;

 private:
  struct State;
  explicit GenerateForwarder(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace kvr::bridge
