// The engine thread of `kvr mocker --speak vllm`: the simulated engine
// (deploy/simulation/engine.hpp) stepped in real time, each step's tokens handed to the HTTP
// responses waiting on them and its KV events published (vllm_kv_events.hpp,
// vllm_kv_event_sockets.hpp). VllmEngineServer owns and starts it; the HTTP routes submit prompts
// to it and read their tokens from a ResponseChannel.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <expected>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "deploy/mocker/kv_transfer_params.hpp"
#include "deploy/mocker/vllm_kv_events.hpp"
#include "deploy/simulation/engine.hpp"
#include "discovery/block_hash.hpp"

namespace kvr::mocker {

struct VllmEngineOptions;
class VllmKvEventSockets;

/// Now, in seconds since the Unix epoch: the stamp of KV event batches and answers' `created`.
double unix_seconds();

/// One generated token, as the engine thread tells a request's HTTP response.
struct GeneratedToken {
  std::uint32_t id = 0;
  bool last = false;
  bool stopped = false;  ///< the last token, and a stop token: finish_reason "stop"
};

/// The sampling parameters the simulated engine honours (the others are accepted and ignored).
struct Sampling {
  std::optional<std::int64_t> seed;
  absl::flat_hash_set<std::uint32_t> stop_token_ids;
  std::uint32_t min_tokens = 0;
};

/// The engine thread's side of one request and its HTTP response's, guarded by `mutex`.
struct ResponseChannel {
  std::mutex mutex;
  std::condition_variable changed;
  bool answered = false;              ///< the engine accepted or refused the request
  std::string refusal;                ///< non-empty: refused, why
  std::deque<GeneratedToken> tokens;  ///< produced, not yet written
  std::uint64_t cached_tokens = 0;
  /// A prefill hop's answer for its decode hop, set before its last token (null otherwise).
  nlohmann::json kv_transfer_params;
  bool closed = false;  ///< the server is stopping
};

/// A token taken from a channel, with the prompt tokens the prefix cache served.
struct TokenUpdate {
  GeneratedToken token;
  std::uint64_t cached_tokens = 0;
};

/// Waits for the channel's next token; nullopt when the server stops.
std::optional<TokenUpdate> wait_for_token(ResponseChannel& channel);

/// A prompt for the engine and what to generate from it.
struct EngineSubmission {
  std::vector<std::uint32_t> tokens;
  std::uint32_t lora = 0;  ///< 0: the served model; i: the i-th LoRA adapter
  std::uint32_t max_tokens = 0;
  Sampling sampling;
  KvTransferRequest kv_transfer;
};

/// A request the engine admitted: its tokens arrive on `channel`.
struct AdmittedRequest {
  simulation::EngineRequestId id = 0;
  std::shared_ptr<ResponseChannel> channel;
};

/// Why a request was not admitted.
struct SubmitRefusal {
  bool shutting_down = false;  ///< true: the engine is stopping; false: it refused the request
  std::string reason;          ///< the engine's reason for a refusal
};

/// What /metrics reports of the engine.
struct EngineLoadSnapshot {
  std::uint64_t running = 0;
  std::uint64_t waiting = 0;
  double kv_usage = 0;
  std::uint64_t prefix_queries = 0;
  std::uint64_t prefix_hits = 0;
  std::uint64_t prompt_tokens = 0;
  std::uint64_t generation_tokens = 0;
  std::uint64_t completed = 0;
};

/// The engine, its thread and its inbox. submit(), abort() and load() may be called from any
/// thread; everything else of the engine is the engine thread's.
class VllmEngineLoop {
 public:
  /// `options` and `sockets` must outlive the loop.
  VllmEngineLoop(simulation::Engine engine, const VllmEngineOptions& options,
                 VllmKvEventSockets& sockets);
  ~VllmEngineLoop();
  VllmEngineLoop(const VllmEngineLoop&) = delete;
  VllmEngineLoop& operator=(const VllmEngineLoop&) = delete;

  /// Starts the engine thread; a prefill hop names `source` as where its KV can be pulled from.
  void start(KvTransferSource source);

  /// Ends the engine thread, closing every channel (which frees the responses waiting on them).
  void stop();

  /// Hands a prompt to the engine and waits until it is admitted.
  std::expected<AdmittedRequest, SubmitRefusal> submit(EngineSubmission submission);

  /// Aborts a request whose client went away (nothing if it has finished).
  void abort(simulation::EngineRequestId id);

  /// The engine's load and counters as of its last iteration.
  EngineLoadSnapshot load() const;

 private:
  struct AddItem {
    simulation::EngineRequestId id = 0;
    EngineSubmission submission;
    std::vector<BlockHash> hashes;
    std::shared_ptr<ResponseChannel> channel;
  };
  struct AbortItem {
    simulation::EngineRequestId id = 0;
  };
  using InboxItem = std::variant<AddItem, AbortItem>;

  struct LiveRequest {
    std::shared_ptr<ResponseChannel> channel;
    std::vector<BlockHash> hashes;
    std::uint64_t prompt_tokens = 0;
    std::uint64_t generated = 0;
    Sampling sampling;
    bool remote_decode = false;  // a prefill hop: its answer carries kv_transfer_params
  };

  using Clock = std::chrono::steady_clock;

  double now_ms() const;
  bool enqueue(InboxItem item);
  void run();
  void add(AddItem& item);
  void abort_live(simulation::EngineRequestId id);
  void publish_events(const std::vector<KvEvent>& events);
  void deliver(simulation::StepResult& result);
  std::optional<double> release_transfers(double now);
  std::optional<double> step_engine(double now);
  std::optional<double> advance(double now);
  void update_load();

  const VllmEngineOptions& options_;
  VllmKvEventSockets& sockets_;
  simulation::Engine engine_;
  // By LoRA: [0] the served model's, [i] the i-th adapter's, in the adapter's namespace, so that
  // an adapter's blocks are cached apart as vLLM's (whose block hashes include the LoRA) are.
  std::vector<discovery::BlockHasher> hashers_;
  Clock::time_point start_ = Clock::now();
  KvTransferSource transfer_source_;

  std::mutex inbox_mutex_;
  std::condition_variable inbox_signal_;
  std::deque<InboxItem> inbox_;
  bool stopping_ = false;     // guarded by inbox_mutex_
  bool engine_done_ = false;  // guarded by inbox_mutex_
  std::atomic<simulation::EngineRequestId> next_request_id_{1};

  // Engine thread only.
  absl::flat_hash_map<simulation::EngineRequestId, LiveRequest> live_;
  BlockTokenTable block_tokens_;
  std::optional<simulation::StepResult> in_flight_;
  // Prefill hops' held blocks: (when the modelled transfer is over, request). There is no side
  // channel from the decode engine, so they are released on the model the decode side waits on.
  std::vector<std::pair<double, simulation::EngineRequestId>> pending_releases_;

  mutable std::mutex load_mutex_;
  EngineLoadSnapshot load_;

  std::thread thread_;
};

}  // namespace kvr::mocker
