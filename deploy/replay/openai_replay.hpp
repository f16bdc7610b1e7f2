// Live trace replay through an OpenAI-compatible HTTP API (`kvr replay-live --openai-url`): each
// trace request is sent, at its arrival time, as a streamed chat completion or completion to a
// kvr node's front door (or straight to the engines, round robin, for a baseline), and what the
// client sees is measured: time to the first streamed token, inter-token time, the cached prompt
// tokens the engine reports in its usage, the worker the node names (x-kvr-worker-id). Plain C++
// on Boost.Asio: one thread, one connection per request.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "deploy/simulation/mooncake_trace.hpp"
#include "deploy/simulation/replay_report.hpp"

namespace kvr::replay {

enum class OpenAiApi : std::uint8_t {
  /// /chat/completions, the prompt as one user message of text (one character per trace token).
  chat,
  /// /completions, the prompt as the trace's token ids (no rendering needed).
  completions,
};

struct OpenAiReplayOptions {
  /// Base URLs ending in /v1 (http:// only); requests go to them in turn.
  std::vector<std::string> base_urls;
  std::string model = "mock-model";
  OpenAiApi api = OpenAiApi::chat;
  double speedup = 1.0;
  /// Most requests in flight; an arrival beyond it waits (its wait counts in its TTFT).
  std::size_t concurrency = 256;
  /// Latencies from the moment a request is sent instead of its arrival: with every request due
  /// at once (a high speedup), the load is closed-loop at `concurrency` streams and TTFT is the
  /// service's alone.
  bool measure_from_send = false;
  /// The first this many requests are left out of the front door's added latency: a closed loop
  /// sends its first `concurrency` at one instant, and they queue behind each other.
  std::size_t warmup = 0;
  /// A request not finished this long after it was sent is abandoned and counted as failed.
  std::chrono::milliseconds request_timeout{60'000};
  /// Sent as x-kvr-tenant; empty: none. With `tenants` > 0, request i names "t{i mod tenants}".
  std::string tenant;
  std::size_t tenants = 0;
  /// Called whenever a request ends: (requests ended so far).
  std::function<void(std::size_t)> on_progress;
};

struct OpenAiReplayResult {
  /// Completed and failed requests, the engines' hit rate (their reported cached tokens, the
  /// ladder's delivered rung), the node's predicted one (x-kvr-cached-tokens, through a front
  /// door only), wall-clock TTFT/ITL/end-to-end, throughput and the imbalance over the workers
  /// named.
  simulation::PolicyReport report;
  /// Each completed request's worker and statistics, in trace order.
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  /// Requests per worker the node named (per base URL when none is named: engines reached
  /// directly).
  std::map<std::string, std::size_t> requests_per_worker;
  /// Answers other than 200, by status.
  std::map<unsigned, std::size_t> errors_by_status;
  /// 429 answers (admission), counted apart from the failed requests.
  std::size_t rejected_by_admission = 0;
  std::size_t timed_out = 0;
  /// Streams that ended with an error event or broke off.
  std::size_t stream_errors = 0;
  /// Arrivals that waited for the concurrency cap.
  std::size_t delayed_by_cap = 0;
};

/// Replays `requests` at their arrival times divided by the speedup; returns when every request
/// has ended.
OpenAiReplayResult run_openai_replay(const OpenAiReplayOptions& options,
                                     const std::vector<simulation::TraceRequest>& requests);

/// The prompt text of a chat request: one printable character per trace token, each block of the
/// trace's hash ids written the same way wherever it appears (so prefixes shared in the trace are
/// shared in the text).
std::string synthesize_prompt_text(const simulation::TraceRequest& request);

/// The OpenAI-only figures as text lines, printed after the common table.
std::string format_openai_summary(const OpenAiReplayResult& result);

}  // namespace kvr::replay
