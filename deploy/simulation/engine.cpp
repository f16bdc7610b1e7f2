#include "deploy/simulation/engine.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "messages/check.hpp"

namespace kvr::simulation {

std::string_view as_str(RequestError error) {
  switch (error) {
    case RequestError::duplicate_id:
      return "duplicate_id";
    case RequestError::empty_prompt:
      return "empty_prompt";
    case RequestError::no_output_tokens:
      return "no_output_tokens";
    case RequestError::too_many_block_hashes:
      return "too_many_block_hashes";
    case RequestError::exceeds_kv_capacity:
      return "exceeds_kv_capacity";
  }
  return "unknown";
}

std::expected<Engine, EngineConfigError> Engine::create(const EngineConfig& config) {
  if (auto valid = config.validate(); !valid) return std::unexpected(std::move(valid.error()));
  return Engine(config);
}

Engine::Engine(const EngineConfig& config)
    : config_(config), timing_(config.timing), pool_(config.num_gpu_blocks) {}

std::expected<void, RequestError> Engine::add_request(EngineRequest request, double now_ms) {
  // A prefill worker's hop: one token, then the KV is handed over.
  if (request.kv_transfer == KvTransfer::remote_decode) request.output_tokens = 1;
  if (request.prompt_tokens == 0) return std::unexpected(RequestError::empty_prompt);
  if (request.output_tokens == 0) return std::unexpected(RequestError::no_output_tokens);
  if (request.block_hashes.size() > request.prompt_tokens / config_.block_size) {
    return std::unexpected(RequestError::too_many_block_hashes);
  }
  // The last token's KV is never computed, so a request holds at most prompt + output - 1
  // tokens. A request that cannot fit in the whole pool would be preempted forever.
  if (blocks_for(request.prompt_tokens + request.output_tokens - 1) > config_.num_gpu_blocks) {
    return std::unexpected(RequestError::exceeds_kv_capacity);
  }
  // Held blocks are released by id, so that id stays taken until then.
  if (held_transfers_.contains(request.id)) return std::unexpected(RequestError::duplicate_id);
  auto [slot, inserted] = requests_.try_emplace(request.id);
  if (!inserted) return std::unexpected(RequestError::duplicate_id);

  slot->second = std::make_unique<Sequence>();
  Sequence& sequence = *slot->second;
  sequence.id = request.id;
  sequence.block_hashes = std::move(request.block_hashes);
  sequence.prompt_tokens = request.prompt_tokens;
  sequence.output_tokens = request.output_tokens;
  sequence.arrival_ms = now_ms;
  sequence.kv_transfer = request.kv_transfer;
  sequence.remote_blocks =
      request.remote_blocks.value_or(std::numeric_limits<std::uint64_t>::max());
  sequence.blocks.reserve(blocks_for(sequence.prompt_tokens + sequence.output_tokens - 1));
  set_pending_prefill(sequence, estimate_pending_prefill(sequence));
  waiting_.push_back(&sequence);
  stalled_ = false;
  return {};
}

bool Engine::abort_request(EngineRequestId id) {
  const auto found = requests_.find(id);
  if (found == requests_.end()) return false;
  Sequence* sequence = found->second.get();
  if (const auto running = std::ranges::find(running_, sequence); running != running_.end()) {
    running_.erase(running);
    release_blocks(*sequence);
  } else if (const auto transferring = std::ranges::find(transferring_, sequence);
             transferring != transferring_.end()) {
    transferring_.erase(transferring);
    release_blocks(*sequence);
  } else {
    waiting_.erase(std::ranges::find(waiting_, sequence));
  }
  set_pending_prefill(*sequence, 0);
  requests_.erase(found);
  stalled_ = false;
  return true;
}

bool Engine::release_transfer(EngineRequestId id) {
  const auto found = held_transfers_.find(id);
  if (found == held_transfers_.end()) return false;
  // Tail first, as release_blocks does.
  for (auto block = found->second.rbegin(); block != found->second.rend(); ++block) {
    pool_.release(*block);
  }
  held_transfers_.erase(found);
  stalled_ = false;
  return true;
}

std::span<const BlockIndex> Engine::held_blocks(EngineRequestId id) const {
  const auto found = held_transfers_.find(id);
  if (found == held_transfers_.end()) return {};
  return found->second;
}

std::optional<double> Engine::next_transfer_end_ms() const {
  std::optional<double> earliest;
  for (const Sequence* sequence : transferring_) {
    earliest = std::min(earliest.value_or(sequence->transfer_end_ms), sequence->transfer_end_ms);
  }
  return earliest;
}

StepResult Engine::step(double now_ms) {
  StepResult result;
  step(now_ms, result);
  return result;
}

void Engine::step(double now_ms, StepResult& result) {
  result.start_ms = now_ms;
  result.duration_ms = 0.0;
  result.prefill_tokens = 0;
  result.decode_requests = 0;
  result.kv_utilisation = 0.0;
  result.kv_events.clear();
  result.first_tokens.clear();
  result.next_tokens.clear();
  result.completions.clear();
  result.preempted.clear();
  result.transfers_done.clear();
  // Transfers that ended while the caller was not stepping join this step.
  complete_transfers(now_ms, result);
  if (!has_work()) {
    pool_.take_events(result.kv_events);
    return;
  }

  ++step_count_;
  scheduled_.clear();
  preempted_this_step_ = false;
  std::uint64_t budget = config_.max_num_batched_tokens;
  schedule_decodes(budget, result);
  schedule_running_prefills(budget, result);
  // As in vLLM, a step that had to preempt admits nobody: the preempted requests are at the front
  // of the queue and would otherwise be readmitted into the very shortage that evicted them.
  if (!preempted_this_step_) admit_waiting(budget, now_ms, result);
  if (scheduled_.empty()) {
    result.kv_utilisation =
        static_cast<double>(pool_.active_blocks()) / static_cast<double>(pool_.total_blocks());
    if (const std::optional<double> transfer_end = next_transfer_end_ms()) {
      // Nothing to compute until a transfer ends: the step waits for it. Transfers that ended by
      // now were completed above and those admitted now last a positive time, so this is > 0.
      result.duration_ms = *transfer_end - now_ms;
      // By the end itself, not end_ms(), which rounding may put an ulp before it.
      complete_transfers(*transfer_end, result);
    } else {
      // Only blocks held for transfers out can leave no room at all; until one is released (or
      // the requests change), stepping again would do nothing again. A step that preempted did
      // change the queues, so the next one decides.
      stalled_ = !preempted_this_step_;
    }
    pool_.take_events(result.kv_events);
    return;
  }

  for (const ScheduledWork& work : scheduled_) {
    if (work.prefill) {
      result.prefill_tokens += work.tokens;
    } else {
      ++result.decode_requests;
    }
  }
  // Measured after this step's allocations: the KV the batch's attention actually reads.
  result.kv_utilisation =
      static_cast<double>(pool_.active_blocks()) / static_cast<double>(pool_.total_blocks());
  result.duration_ms =
      timing_.step_ms(result.prefill_tokens, result.decode_requests, result.kv_utilisation);
  finish_step(result.end_ms(), result);
  complete_transfers(result.end_ms(), result);
  pool_.take_events(result.kv_events);
}

EngineLoad Engine::load() const {
  EngineLoad load;
  load.active_requests = running_.size();
  load.waiting_requests = waiting_.size() + transferring_.size();
  load.transferring_requests = transferring_.size();
  load.active_decode_blocks = pool_.active_blocks();
  load.active_prefill_tokens = pending_prefill_tokens_;
  // As vLLM and SGLang report KV usage: evictable cached blocks count as free.
  load.kv_blocks_used = pool_.active_blocks();
  load.total_blocks = pool_.total_blocks();
  return load;
}

std::uint64_t Engine::cached_prefix_tokens(std::span<const BlockHash> block_hashes) const {
  if (!config_.enable_prefix_caching) return 0;
  return pool_.match_prefix(block_hashes).blocks * config_.block_size;
}

ResetResult Engine::reset() {
  ResetResult result;
  result.aborted.reserve(running_.size() + transferring_.size() + waiting_.size());
  for (const Sequence* sequence : running_) result.aborted.push_back(sequence->id);
  for (const Sequence* sequence : transferring_) result.aborted.push_back(sequence->id);
  for (const Sequence* sequence : waiting_) result.aborted.push_back(sequence->id);
  running_.clear();
  transferring_.clear();
  waiting_.clear();
  requests_.clear();
  held_transfers_.clear();
  stalled_ = false;
  pending_prefill_tokens_ = 0;
  pool_.clear();
  result.kv_events = pool_.take_events();
  return result;
}

std::uint64_t Engine::blocks_for(std::uint64_t tokens) const {
  return (tokens + config_.block_size - 1) / config_.block_size;
}

std::size_t Engine::max_reusable_blocks(const Sequence& sequence) const {
  if (!config_.enable_prefix_caching) return 0;
  // At least one token must be computed to produce the next token, so a fully cached prompt
  // still recomputes its last block (vLLM does the same).
  const std::uint64_t limit = (sequence.total_tokens() - 1) / config_.block_size;
  return static_cast<std::size_t>(std::min<std::uint64_t>(sequence.block_hashes.size(), limit));
}

std::uint64_t Engine::estimate_pending_prefill(const Sequence& sequence) const {
  const std::span<const BlockHash> reusable(sequence.block_hashes.data(),
                                            max_reusable_blocks(sequence));
  const std::size_t cached_blocks = pool_.match_prefix(reusable).blocks;
  return sequence.total_tokens() -
         ready_tokens(sequence, cached_blocks, plan_transfer(sequence, cached_blocks));
}

Engine::TransferPlan Engine::plan_transfer(const Sequence& sequence,
                                           std::size_t cached_blocks) const {
  if (sequence.kv_transfer != KvTransfer::remote_prefill) return {};
  // Every prompt block after the local prefix, the partial last one included (vLLM pulls all of
  // them), as far as the prefill worker has them.
  const std::uint64_t missing = blocks_for(sequence.prompt_tokens) - cached_blocks;
  const std::uint64_t blocks = std::min(missing, sequence.remote_blocks);
  return TransferPlan{.blocks = blocks,
                      .kv_tokens = std::min<std::uint64_t>(
                          sequence.prompt_tokens, (cached_blocks + blocks) * config_.block_size)};
}

std::uint64_t Engine::ready_tokens(const Sequence& sequence, std::size_t cached_blocks,
                                   const TransferPlan& plan) const {
  if (plan.blocks == 0) return cached_blocks * config_.block_size;
  // The last prompt token is computed here for its logits, as vLLM recomputes it.
  return std::min(plan.kv_tokens, sequence.total_tokens() - 1);
}

double Engine::transfer_ms(std::uint64_t blocks) const {
  return (config_.transfer.latency_ms +
          config_.transfer.ms_per_block * static_cast<double>(blocks)) /
         config_.timing.time_scale;
}

void Engine::set_pending_prefill(Sequence& sequence, std::uint64_t tokens) {
  pending_prefill_tokens_ = pending_prefill_tokens_ - sequence.pending_prefill_tokens + tokens;
  sequence.pending_prefill_tokens = tokens;
}

void Engine::schedule(Sequence& sequence, std::uint64_t tokens, bool prefill) {
  sequence.scheduled_in_step = step_count_;
  scheduled_.push_back(ScheduledWork{&sequence, tokens, prefill});
}

void Engine::schedule_decodes(std::uint64_t& budget, StepResult& result) {
  for (std::size_t index = 0; index < running_.size() && budget > 0; ++index) {
    Sequence& sequence = *running_[index];
    if (sequence.prefilling) continue;
    // Without a slot the request preempted itself; it was the newest, so nothing follows it.
    if (!reserve_slots(index, 1, result)) break;
    schedule(sequence, 1, false);
    --budget;
  }
}

void Engine::schedule_running_prefills(std::uint64_t& budget, StepResult& result) {
  for (std::size_t index = 0; index < running_.size() && budget > 0; ++index) {
    Sequence& sequence = *running_[index];
    if (!sequence.prefilling) continue;
    const std::uint64_t wanted =
        std::min(sequence.total_tokens() - sequence.computed_tokens, budget);
    // A prefilling request never preempts itself, so a value is always returned.
    const std::uint64_t granted = reserve_slots(index, wanted, result).value_or(0);
    if (granted == 0) continue;
    schedule(sequence, granted, true);
    budget -= granted;
  }
}

void Engine::admit_waiting(std::uint64_t& budget, double now_ms, StepResult& result) {
  // Requests in transfer will run, so they take their seats now.
  while (budget > 0 && !waiting_.empty() &&
         running_.size() + transferring_.size() < config_.max_num_seqs) {
    Sequence& sequence = *waiting_.front();
    const std::span<const BlockHash> reusable(sequence.block_hashes.data(),
                                              max_reusable_blocks(sequence));
    const PrefixMatch match = pool_.match_prefix(reusable, matched_blocks_);
    const TransferPlan transfer = plan_transfer(sequence, match.blocks);
    const std::uint64_t ready = ready_tokens(sequence, match.blocks, transfer);
    const double transfer_end_ms =
        now_ms + (transfer.blocks == 0 ? 0.0 : transfer_ms(transfer.blocks));
    // A transfer of no measurable time ends at once and the request runs in this very step.
    const bool waits_for_transfer = transfer_end_ms > now_ms;
    const std::uint64_t wanted =
        waits_for_transfer ? 0 : std::min(sequence.total_tokens() - ready, budget);
    // A transfer fills whole blocks, the partial last one included.
    const std::uint64_t new_blocks =
        std::max<std::uint64_t>(match.blocks + transfer.blocks, blocks_for(ready + wanted)) -
        match.blocks;
    // Reused blocks that are cached now stop being evictable once acquired, so they do not count
    // towards the room for new blocks. Admission never preempts: first come, first served.
    if (pool_.available_blocks() - match.unreferenced < new_blocks) break;
    waiting_.pop_front();

    for (const BlockIndex block : matched_blocks_) {
      pool_.acquire_block(block);
      sequence.blocks.push_back(block);
    }
    [[maybe_unused]] const std::size_t allocated = pool_.allocate_run(new_blocks, sequence.blocks);
    KVR_ASSERT(allocated == new_blocks);
    sequence.computed_tokens = ready;
    sequence.committed_blocks = match.blocks;
    sequence.prefilling = true;
    if (!sequence.admitted_before) {
      sequence.admitted_before = true;
      // Transferred tokens count as cached: this engine computed none of them.
      sequence.cached_prompt_tokens = ready;
    }
    set_pending_prefill(sequence, sequence.total_tokens() - ready);
    // The KV comes once: a recompute after preemption is local.
    if (sequence.kv_transfer == KvTransfer::remote_prefill) sequence.kv_transfer = KvTransfer::none;
    if (transfer.blocks > 0) {
      sequence.transfer_end_ms = transfer_end_ms;
      sequence.transfer_blocks = transfer.blocks;
      sequence.transfer_kv_tokens = transfer.kv_tokens;
      if (waits_for_transfer) {
        transferring_.push_back(&sequence);
        continue;
      }
      end_transfer(sequence, result);
    }
    running_.push_back(&sequence);
    schedule(sequence, wanted, true);
    budget -= wanted;
  }
}

void Engine::end_transfer(Sequence& sequence, StepResult& result) {
  // The transferred KV is as good as computed: a router learns from the Stored events that this
  // engine now holds the prompt's blocks.
  commit_full_blocks(sequence, sequence.transfer_kv_tokens);
  result.transfers_done.push_back(TransferDone{sequence.id, sequence.transfer_blocks});
}

void Engine::complete_transfers(double until_ms, StepResult& result) {
  // In admission order, so that requests join the running queue deterministically.
  std::size_t kept = 0;
  for (Sequence* sequence : transferring_) {
    if (sequence->transfer_end_ms > until_ms) {
      transferring_[kept++] = sequence;
      continue;
    }
    end_transfer(*sequence, result);
    running_.push_back(sequence);
    stalled_ = false;
  }
  transferring_.resize(kept);
}

std::optional<std::uint64_t> Engine::reserve_slots(std::size_t running_index, std::uint64_t wanted,
                                                   StepResult& result) {
  Sequence& sequence = *running_[running_index];
  const std::uint64_t block_size = config_.block_size;
  // Nearly every decode fits in the blocks it holds; checked by a product, since this runs for
  // every running request in every step and a division is slow.
  if (sequence.computed_tokens + wanted <= sequence.blocks.size() * block_size) return wanted;
  const std::uint64_t needed_blocks = blocks_for(sequence.computed_tokens + wanted);
  // What the pool can give at once, as a run; the loop then handles a shortage.
  pool_.allocate_run(needed_blocks - sequence.blocks.size(), sequence.blocks);
  while (sequence.blocks.size() < needed_blocks) {
    if (const std::optional<BlockIndex> block = pool_.allocate()) {
      sequence.blocks.push_back(*block);
      continue;
    }
    if (const std::optional<std::size_t> victim = newest_unscheduled_after(running_index)) {
      preempt(*victim, result);
      continue;
    }
    if (!sequence.prefilling) {
      // A decode is the newest request without a slot: vLLM preempts it rather than stall.
      preempt(running_index, result);
      return std::nullopt;
    }
    // A prefill chunk shrinks to the blocks it holds; the decodes around it will free more.
    break;
  }
  const std::uint64_t capacity = sequence.blocks.size() * block_size;
  return std::min(wanted, capacity - sequence.computed_tokens);
}

std::optional<std::size_t> Engine::newest_unscheduled_after(std::size_t running_index) const {
  // Victims are newer than the request that needs room (lower priority, as in vLLM) and not yet
  // part of this step, so no scheduled work has to be undone.
  for (std::size_t index = running_.size(); index > running_index + 1; --index) {
    if (running_[index - 1]->scheduled_in_step != step_count_) return index - 1;
  }
  return std::nullopt;
}

void Engine::preempt(std::size_t running_index, StepResult& result) {
  Sequence* sequence = running_[running_index];
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(running_index));
  release_blocks(*sequence);
  sequence->computed_tokens = 0;
  sequence->committed_blocks = 0;
  sequence->prefilling = true;
  ++sequence->preemptions;
  // Estimated after the release: the hashed blocks just freed are cached and likely reused.
  set_pending_prefill(*sequence, estimate_pending_prefill(*sequence));
  waiting_.push_front(sequence);
  result.preempted.push_back(sequence->id);
  preempted_this_step_ = true;
}

void Engine::release_blocks(Sequence& sequence) {
  // Tail first: the LRU then evicts a prompt's last blocks before its first ones, which other
  // prompts are more likely to share.
  for (auto block = sequence.blocks.rbegin(); block != sequence.blocks.rend(); ++block) {
    pool_.release(*block);
  }
  sequence.blocks.clear();
}

void Engine::commit_full_blocks(Sequence& sequence, std::uint64_t kv_tokens) {
  if (!config_.enable_prefix_caching) return;
  const std::size_t full_blocks = static_cast<std::size_t>(
      std::min<std::uint64_t>(kv_tokens / config_.block_size, sequence.block_hashes.size()));
  const std::size_t first = sequence.committed_blocks;
  if (first >= full_blocks) return;
  const std::optional<BlockHash> parent =
      first == 0 ? std::nullopt : std::optional(sequence.block_hashes[first - 1]);
  pool_.commit_run(std::span(sequence.blocks).subspan(first, full_blocks - first),
                   std::span(sequence.block_hashes).subspan(first, full_blocks - first), parent);
  sequence.committed_blocks = full_blocks;
}

void Engine::finish_step(double end_ms, StepResult& result) {
  bool any_finished = false;
  for (const ScheduledWork& work : scheduled_) {
    Sequence& sequence = *work.sequence;
    sequence.computed_tokens += work.tokens;
    if (work.prefill) {
      // Blocks become reusable only once computed, so requests admitted in this same step could
      // not have matched them (vLLM caches blocks after the forward pass too).
      commit_full_blocks(sequence, sequence.computed_tokens);
      set_pending_prefill(sequence, sequence.total_tokens() - sequence.computed_tokens);
    }
    if (sequence.computed_tokens < sequence.total_tokens()) continue;  // more prefill chunks

    ++sequence.generated_tokens;
    sequence.prefilling = false;
    if (sequence.generated_tokens == 1) {
      sequence.first_token_ms = end_ms;
      result.first_tokens.push_back(FirstToken{sequence.id, end_ms, sequence.cached_prompt_tokens});
    } else {
      sequence.max_inter_token_ms =
          std::max(sequence.max_inter_token_ms, end_ms - sequence.last_token_ms);
      result.next_tokens.push_back(sequence.id);
    }
    sequence.last_token_ms = end_ms;
    if (sequence.generated_tokens < sequence.output_tokens) continue;

    std::uint64_t held_blocks = 0;
    if (sequence.kv_transfer == KvTransfer::remote_decode && !sequence.blocks.empty()) {
      // Kept referenced for the decode worker to pull, until release_transfer.
      held_blocks = sequence.blocks.size();
      held_transfers_.emplace(sequence.id, std::move(sequence.blocks));
      sequence.blocks.clear();
    } else {
      release_blocks(sequence);
    }
    sequence.finished = true;
    any_finished = true;
    result.completions.push_back(RequestStats{
        .id = sequence.id,
        .arrival_ms = sequence.arrival_ms,
        .first_token_ms = sequence.first_token_ms,
        .completion_ms = end_ms,
        .prompt_tokens = sequence.prompt_tokens,
        .cached_prompt_tokens = sequence.cached_prompt_tokens,
        .output_tokens = sequence.generated_tokens,
        .max_inter_token_ms = sequence.max_inter_token_ms,
        .preemptions = sequence.preemptions,
        .held_blocks = held_blocks,
    });
  }
  if (!any_finished) return;
  std::erase_if(running_, [](const Sequence* sequence) { return sequence->finished; });
  for (const RequestStats& completed : result.completions) requests_.erase(completed.id);
}

discovery::ConfirmedLoad load_report(const EngineLoad& load) {
  return discovery::ConfirmedLoad{
      .active_requests = static_cast<std::uint32_t>(load.active_requests + load.waiting_requests),
      .waiting_requests = static_cast<std::uint32_t>(load.waiting_requests),
      .active_decode_blocks = load.active_decode_blocks,
      .active_prefill_tokens = load.active_prefill_tokens,
      .kv_blocks_used = load.kv_blocks_used};
}

}  // namespace kvr::simulation
