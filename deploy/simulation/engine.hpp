// The simulated inference engine: a vLLM-style scheduler (waiting and running queues, a per-step
// token budget, chunked prefill, recompute preemption) over a KV block pool with prefix reuse,
// timed by a polynomial model on a logical clock. Plain C++: `kvr replay` runs one per simulated
// worker in process, `kvr mocker` drives one per data-parallel rank over NATS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "deploy/simulation/block_pool.hpp"
#include "deploy/simulation/engine_config.hpp"
#include "deploy/simulation/timing_model.hpp"
#include "discovery/load/predicted_load.hpp"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"

namespace kvr::simulation {

/// The caller's name for a request inside one engine (a replay index, or a mocker's sequence
/// number standing in for the request's string id); unique among the engine's live requests.
using EngineRequestId = std::uint64_t;

/// Hard bounds on what one request may ask of a simulated engine (the mocker's fleet and its
/// vLLM-compatible server); beyond them it is refused as absurd.
inline constexpr std::size_t kMaxPromptTokens = 1 << 22;
inline constexpr std::uint32_t kMaxOutputTokens = 1 << 20;

/// A request's part in disaggregated serving, named after vLLM's kv_transfer_params.
enum class KvTransfer : std::uint8_t {
  /// An ordinary request: prefilled and decoded here.
  none,
  /// vLLM's do_remote_decode (this engine is a prefill worker): the request produces one token
  /// (output_tokens is treated as 1) and completes as usual, but its blocks stay referenced, held
  /// for a decode worker to pull, until Engine::release_transfer(id) (or reset()). Held blocks
  /// count in kv_blocks_used and are never evicted; the request is no longer active or waiting.
  remote_decode,
  /// vLLM's do_remote_prefill (this engine is a decode worker): the prompt's KV arrives by
  /// transfer. Admitted like any request (it reuses its cached prefix; when the pool cannot fit
  /// the rest it waits in the queue), it then waits, neither running nor queued but with its
  /// blocks allocated, for TransferConfig latency_ms + ms_per_block x the blocks it pulls (scaled
  /// by time_scale). The transferred full hashed blocks are then committed (Stored events), they
  /// count as cached prompt tokens, and the request computes only its last prompt token, as vLLM
  /// does for the logits, before decoding normally. With nothing to pull it is an ordinary
  /// request.
  remote_prefill,
};

/// A request as the engine receives it.
struct EngineRequest {
  EngineRequestId id = 0;
  /// Chained hashes of the prompt's full blocks at the engine's block size, in order. May be
  /// shorter than the number of full blocks (the rest are computed but never cached); the last
  /// partial block never has a hash.
  std::vector<BlockHash> block_hashes;
  /// Prompt length in tokens, partial last block included; at least 1.
  std::uint64_t prompt_tokens = 0;
  /// Tokens to generate, the first included; at least 1.
  std::uint64_t output_tokens = 1;
  /// The request's part in disaggregated serving.
  KvTransfer kv_transfer = KvTransfer::none;
  /// remote_prefill: the most blocks the prefill worker can send (len(remote_block_ids)): the
  /// transfer brings the prompt blocks after the locally cached prefix, in order, up to this many
  /// (tokens beyond them are prefilled here). nullopt: every prompt block.
  std::optional<std::uint64_t> remote_blocks;
};

/// Why add_request refused a request.
enum class RequestError : std::uint8_t {
  duplicate_id,           ///< a live request already has this id
  empty_prompt,           ///< prompt_tokens is 0
  no_output_tokens,       ///< output_tokens is 0
  too_many_block_hashes,  ///< more hashes than the prompt has full blocks
  exceeds_kv_capacity,    ///< prompt and output together need more blocks than the pool has
};

/// The snake_case name of a request error, e.g. "exceeds_kv_capacity".
std::string_view as_str(RequestError error);

/// A request that produced its first token.
struct FirstToken {
  EngineRequestId id = 0;
  /// When the token exists: the end of the step that completed the prefill.
  double time_ms = 0.0;
  /// Prompt tokens reused from the pool at the request's first admission, plus those a
  /// remote_prefill request received by transfer.
  std::uint64_t cached_prompt_tokens = 0;
};

/// What happened to a request from arrival to completion, on the engine's clock.
struct RequestStats {
  EngineRequestId id = 0;
  double arrival_ms = 0.0;
  double first_token_ms = 0.0;
  double completion_ms = 0.0;
  std::uint64_t prompt_tokens = 0;
  /// Prompt tokens reused from the pool at the first admission (what routing aimed to maximise),
  /// plus those a remote_prefill request received by transfer.
  std::uint64_t cached_prompt_tokens = 0;
  std::uint64_t output_tokens = 0;
  /// The longest gap between two consecutive tokens (0 with a single token).
  double max_inter_token_ms = 0.0;
  /// How often the request was preempted and recomputed.
  std::uint32_t preemptions = 0;
  /// KvTransfer::remote_decode: the blocks it holds for the decode worker until
  /// Engine::release_transfer (Engine::held_blocks gives them); 0 for other requests.
  std::uint64_t held_blocks = 0;

  /// Time to first token.
  double ttft_ms() const { return first_token_ms - arrival_ms; }
  /// Mean inter-token latency over the tokens after the first (0 with a single token).
  double mean_inter_token_ms() const {
    return output_tokens > 1
               ? (completion_ms - first_token_ms) / static_cast<double>(output_tokens - 1)
               : 0.0;
  }
};

/// A KV transfer into this engine (a remote_prefill request) that ended.
struct TransferDone {
  EngineRequestId id = 0;
  /// The blocks pulled from the prefill worker: it may release the blocks it held for this
  /// request (Engine::release_transfer there).
  std::uint64_t blocks = 0;
};

/// Everything one scheduler iteration did. All tokens of a step appear at end_ms().
struct StepResult {
  double start_ms = 0.0;
  /// Scaled duration; 0 only when there was nothing to run (see Engine::step).
  double duration_ms = 0.0;
  /// Uncached prompt tokens computed (T in the timing model), re-prefills after preemption
  /// included.
  std::uint64_t prefill_tokens = 0;
  /// Requests that decoded one token.
  std::uint64_t decode_requests = 0;
  /// Referenced blocks / total blocks while the step ran (u in the timing model).
  double kv_utilisation = 0.0;
  /// The KV events of the step, in order; publish them as one batch.
  std::vector<KvEvent> kv_events;
  /// Requests whose first token appeared.
  std::vector<FirstToken> first_tokens;
  /// Requests that produced one more token after their first.
  std::vector<EngineRequestId> next_tokens;
  /// Requests that produced their last token; they have left the engine.
  std::vector<RequestStats> completions;
  /// Requests preempted back to the front of the waiting queue (their KV must be recomputed).
  std::vector<EngineRequestId> preempted;
  /// KV transfers that ended by end_ms() (their Stored events are in kv_events).
  std::vector<TransferDone> transfers_done;

  /// When the step's tokens exist and the next step can start.
  double end_ms() const { return start_ms + duration_ms; }
};

/// The engine's load as the router sees it (LoadMetrics of one rank).
struct EngineLoad {
  /// Requests in the running queue.
  std::uint64_t active_requests = 0;
  /// Requests in the waiting queue, and those receiving their KV by transfer (vLLM keeps those in
  /// its waiting queue too): they have no token yet.
  std::uint64_t waiting_requests = 0;
  /// Of waiting_requests, those receiving their KV by transfer.
  std::uint64_t transferring_requests = 0;
  /// Blocks referenced by requests, each counted once however many requests share it: running
  /// requests' blocks, and those allocated for a transfer or held for one (remote_decode).
  std::uint64_t active_decode_blocks = 0;
  /// Prompt tokens still to prefill: for running requests exactly; for waiting ones the prompt
  /// minus the prefix that was cached when they arrived (or were preempted) and what a transfer
  /// brings.
  std::uint64_t active_prefill_tokens = 0;
  /// Blocks held by requests (the referenced ones, transfers' included): the engine's KV usage as
  /// vLLM reports it, where cached blocks that no request holds are free (evictable).
  std::uint64_t kv_blocks_used = 0;
  /// Blocks in the pool.
  std::uint64_t total_blocks = 0;
};

/// The load report a worker running an engine publishes: running and waiting requests are both
/// active (as vLLM counts them), the waiting ones also on their own.
discovery::ConfirmedLoad load_report(const EngineLoad& load);

/// What reset() did.
struct ResetResult {
  /// A single Cleared event.
  std::vector<KvEvent> kv_events;
  /// The requests that were dropped: running ones, then those receiving KV by transfer, then
  /// waiting ones. Blocks held for transfers out (remote_decode) are dropped silently.
  std::vector<EngineRequestId> aborted;
};

/// One simulated engine rank. Each step (1) gives every decoding running request one token of the
/// budget, oldest first, (2) continues running prefills in chunks of the remaining budget, and
/// (3) admits waiting requests in arrival order while budget and max_num_seqs allow, reusing the
/// longest cached prefix of each. A running request that needs a block when none is free or
/// evictable preempts the most recently admitted request not yet in the step (vLLM's recompute
/// policy: its blocks are released and it returns to the front of the waiting queue); a decode
/// with no such victim preempts itself, a prefill chunk shrinks instead. A step costs
/// prefill_ms(T) + decode_ms(u) (see TimingConfig::mixed_step_cost). Only full prompt blocks with a
/// hash are cached: generated tokens occupy anonymous blocks that are never reused or announced.
///
/// KV transfers (KvTransfer): a remote_prefill request admitted from the waiting queue starts its
/// transfer at the step's start and is done at the end of the step during which its transfer
/// time runs out (or at the next step's start when the caller steps late); it runs from the next
/// step on. A step with only transfers to wait for lasts exactly until the earliest ends, so
/// drivers step as usual and need no timer of their own (next_transfer_end_ms() tells when that
/// is). Admission counts requests in transfer against max_num_seqs; they are never preempted. A
/// remote_decode request's blocks stay held after it completes until release_transfer().
class Engine {
 public:
  /// An engine with the given parameters, or the first invalid field.
  static std::expected<Engine, EngineConfigError> create(const EngineConfig& config);

  // Movable, so that a replay can keep its engines in a vector; requests stay where they are.
  Engine(Engine&&) noexcept = default;
  Engine& operator=(Engine&&) noexcept = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine() = default;

  /// Queues a request that arrived at now_ms; it is considered from the next step on.
  std::expected<void, RequestError> add_request(EngineRequest request, double now_ms);

  /// Drops a waiting, running or transferring request without a completion; false when the id is
  /// unknown (blocks held after a remote_decode completion are released by release_transfer).
  /// Its blocks are released (hashed ones stay cached), so no KV event results.
  bool abort_request(EngineRequestId id);

  /// Releases the blocks a completed remote_decode request held for its decode worker; they stay
  /// cached (evictable) like any finished request's. False when no blocks are held for `id`.
  bool release_transfer(EngineRequestId id);

  /// The blocks a completed remote_decode request holds, in prompt order (empty when none): their
  /// indexes stand for vLLM's remote_block_ids.
  std::span<const BlockIndex> held_blocks(EngineRequestId id) const;

  /// Whether step() would do anything: a KV transfer is in flight, or a request is waiting or
  /// running and the engine has not stalled (see step()).
  bool has_work() const {
    return !transferring_.empty() || (!stalled_ && (!running_.empty() || !waiting_.empty()));
  }

  /// When the earliest KV transfer in flight ends (nullopt: none is).
  std::optional<double> next_transfer_end_ms() const;

  /// How long pulling `blocks` KV blocks takes on this engine's clock: TransferConfig's
  /// latency_ms + ms_per_block x blocks, divided by time_scale.
  double transfer_ms(std::uint64_t blocks) const;

  /// Runs one scheduler iteration starting at now_ms and reports what it did. When has_work(),
  /// the step makes progress and duration_ms > 0: it computes tokens, or, when it has only KV
  /// transfers to wait for, it lasts until the earliest ends (no tokens; the transfer ends at
  /// end_ms()). One exception: blocks held for remote_decode transfers are never evicted, so they
  /// can leave no room for any request; such a step does nothing (duration_ms 0), and has_work()
  /// stays false (the engine has stalled) until a request is added or aborted or a transfer
  /// released. The caller starts the next step no earlier than this one's end_ms() (unchecked).
  StepResult step(double now_ms);

  /// As above, into `result`, whose containers are cleared and their memory reused: a caller
  /// that steps millions of times keeps one StepResult per engine instead of allocating.
  void step(double now_ms, StepResult& result);

  /// The load to report to the router.
  EngineLoad load() const;

  /// Prompt tokens of these block hashes that the pool would reuse now (full blocks only).
  std::uint64_t cached_prefix_tokens(std::span<const BlockHash> block_hashes) const;

  /// Drops every request and held transfer and empties the pool; the result carries the Cleared
  /// event.
  ResetResult reset();

  /// The current cache contents as Stored chains, for a router rebuilding its index.
  std::vector<KvStoredEvent> dump() const { return pool_.dump(); }

  /// The pool, for inspection.
  const BlockPool& pool() const { return pool_; }

  /// The parameters in use.
  const EngineConfig& config() const { return config_; }

 private:
  struct Sequence {
    EngineRequestId id = 0;
    std::vector<BlockHash> block_hashes;
    std::uint64_t prompt_tokens = 0;
    std::uint64_t output_tokens = 0;
    std::uint64_t generated_tokens = 0;
    // Tokens whose KV is in blocks; a decoding request has total_tokens() - 1.
    std::uint64_t computed_tokens = 0;
    std::vector<BlockIndex> blocks;
    // Leading blocks already hashed in the pool (reused or committed) or skipped as duplicates.
    std::size_t committed_blocks = 0;
    // This request's share of EngineLoad::active_prefill_tokens.
    std::uint64_t pending_prefill_tokens = 0;
    std::uint64_t cached_prompt_tokens = 0;
    std::uint64_t scheduled_in_step = 0;
    double arrival_ms = 0.0;
    double first_token_ms = 0.0;
    double last_token_ms = 0.0;
    double max_inter_token_ms = 0.0;
    std::uint32_t preemptions = 0;
    bool admitted_before = false;
    // True from admission until the step that computes its last pending token (its prefill, or
    // its recompute after preemption); such tokens count as prefill tokens.
    bool prefilling = true;
    bool finished = false;
    // remote_prefill until its transfer starts (then none: a recompute after preemption is local).
    KvTransfer kv_transfer = KvTransfer::none;
    std::uint64_t remote_blocks = 0;
    // While in transfer: when it ends, the blocks pulled, and the prompt tokens whose KV the
    // local prefix and the transfer together hold.
    double transfer_end_ms = 0.0;
    std::uint64_t transfer_blocks = 0;
    std::uint64_t transfer_kv_tokens = 0;

    std::uint64_t total_tokens() const { return prompt_tokens + generated_tokens; }
  };

  // What a remote_prefill request pulls, given the blocks of its prefix cached here.
  struct TransferPlan {
    std::uint64_t blocks = 0;
    // Prompt tokens whose KV is here once the transfer ends (the local prefix's included).
    std::uint64_t kv_tokens = 0;
  };

  struct ScheduledWork {
    Sequence* sequence = nullptr;
    std::uint64_t tokens = 0;
    bool prefill = false;
  };

  explicit Engine(const EngineConfig& config);

  std::uint64_t blocks_for(std::uint64_t tokens) const;
  std::size_t max_reusable_blocks(const Sequence& sequence) const;
  std::uint64_t estimate_pending_prefill(const Sequence& sequence) const;
  TransferPlan plan_transfer(const Sequence& sequence, std::size_t cached_blocks) const;
  // The prompt tokens a request has KV for once admitted with this plan, its last always excluded.
  std::uint64_t ready_tokens(const Sequence& sequence, std::size_t cached_blocks,
                             const TransferPlan& plan) const;
  void set_pending_prefill(Sequence& sequence, std::uint64_t tokens);

  void schedule_decodes(std::uint64_t& budget, StepResult& result);
  void schedule_running_prefills(std::uint64_t& budget, StepResult& result);
  void admit_waiting(std::uint64_t& budget, double now_ms, StepResult& result);
  void end_transfer(Sequence& sequence, StepResult& result);
  void complete_transfers(double until_ms, StepResult& result);
  void schedule(Sequence& sequence, std::uint64_t tokens, bool prefill);
  std::optional<std::uint64_t> reserve_slots(std::size_t running_index, std::uint64_t wanted,
                                             StepResult& result);
  std::optional<std::size_t> newest_unscheduled_after(std::size_t running_index) const;
  void preempt(std::size_t running_index, StepResult& result);
  void release_blocks(Sequence& sequence);
  void finish_step(double end_ms, StepResult& result);
  // Commits the hashed full blocks among the first kv_tokens tokens not yet committed.
  void commit_full_blocks(Sequence& sequence, std::uint64_t kv_tokens);

  EngineConfig config_;
  TimingModel timing_;
  BlockPool pool_;
  absl::flat_hash_map<EngineRequestId, std::unique_ptr<Sequence>> requests_;
  // Admission order, oldest first: the back is the first preemption victim.
  std::vector<Sequence*> running_;
  // Arrival order, except that preempted requests return to the front.
  std::deque<Sequence*> waiting_;
  // remote_prefill requests receiving their KV, in admission order.
  std::vector<Sequence*> transferring_;
  // Blocks completed remote_decode requests hold for their decode workers, in prompt order.
  absl::flat_hash_map<EngineRequestId, std::vector<BlockIndex>> held_transfers_;
  // This step's work in scheduling order, kept between steps to reuse its memory.
  std::vector<ScheduledWork> scheduled_;
  // The cached prefix of the request being admitted (scratch).
  std::vector<BlockIndex> matched_blocks_;
  std::uint64_t step_count_ = 0;
  std::uint64_t pending_prefill_tokens_ = 0;
  bool preempted_this_step_ = false;
  // A step found nothing to run and no transfer to wait for (held blocks fill the pool).
  bool stalled_ = false;
};

}  // namespace kvr::simulation
