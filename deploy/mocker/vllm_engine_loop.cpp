#include "deploy/mocker/vllm_engine_loop.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "deploy/mocker/mock_tokenizer.hpp"
#include "deploy/mocker/vllm_engine_server.hpp"
#include "deploy/mocker/vllm_kv_event_sockets.hpp"

namespace kvr::mocker {
namespace {

using simulation::EngineRequestId;
using simulation::StepResult;

// The ids the engine generates: the mock tokenizer's words.
constexpr std::uint32_t kWordTokens = kVocabSize - kFirstWordToken;

// The index-th generated token, a word of the mock tokenizer: a function of the seed when the
// request has one (the same seed gives the same tokens, as a seeded sampler does), else of the
// request.
std::uint32_t generated_token(EngineRequestId id, const Sampling& sampling, std::uint64_t index) {
  if (sampling.seed) {
    std::uint64_t mixed = static_cast<std::uint64_t>(*sampling.seed) * 0x9E3779B97F4A7C15ULL +
                          (index + 1) * 0xBF58476D1CE4E5B9ULL;
    mixed ^= mixed >> 31;
    mixed *= 0x94D049BB133111EBULL;
    mixed ^= mixed >> 29;
    return kFirstWordToken + static_cast<std::uint32_t>(mixed % kWordTokens);
  }
  return kFirstWordToken + static_cast<std::uint32_t>((id * 7919 + index) % kWordTokens);
}

}  // namespace

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<TokenUpdate> wait_for_token(ResponseChannel& channel) {
  std::unique_lock lock{channel.mutex};
  channel.changed.wait(lock, [&] { return !channel.tokens.empty() || channel.closed; });
  if (channel.tokens.empty()) return std::nullopt;
  TokenUpdate update{.token = channel.tokens.front(), .cached_tokens = channel.cached_tokens};
  channel.tokens.pop_front();
  return update;
}

VllmEngineLoop::VllmEngineLoop(simulation::Engine engine, const VllmEngineOptions& options,
                               VllmKvEventSockets& sockets)
    : options_(options), sockets_(sockets), engine_(std::move(engine)) {
  hashers_.emplace_back(options_.engine.block_size);
  for (const std::string& adapter : options_.lora_adapters) {
    hashers_.emplace_back(options_.engine.block_size, adapter);
  }
}

VllmEngineLoop::~VllmEngineLoop() { stop(); }

void VllmEngineLoop::start(KvTransferSource source) {
  transfer_source_ = std::move(source);
  thread_ = std::thread{[this] { run(); }};
}

void VllmEngineLoop::stop() {
  {
    // Under the lock, so that the engine thread cannot miss the wake-up between its check and
    // its wait.
    std::lock_guard lock{inbox_mutex_};
    stopping_ = true;
  }
  inbox_signal_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::expected<AdmittedRequest, SubmitRefusal> VllmEngineLoop::submit(EngineSubmission submission) {
  AddItem item;
  item.hashes = hashers_[submission.lora].sequence_hashes(submission.tokens);
  item.submission = std::move(submission);
  item.id = next_request_id_++;
  item.channel = std::make_shared<ResponseChannel>();
  auto channel = item.channel;
  const EngineRequestId id = item.id;
  if (!enqueue(std::move(item))) return std::unexpected(SubmitRefusal{.shutting_down = true});
  std::unique_lock lock{channel->mutex};
  channel->changed.wait(lock, [&] { return channel->answered || channel->closed; });
  if (channel->closed) return std::unexpected(SubmitRefusal{.shutting_down = true});
  if (!channel->refusal.empty()) return std::unexpected(SubmitRefusal{.reason = channel->refusal});
  return AdmittedRequest{.id = id, .channel = channel};
}

void VllmEngineLoop::abort(EngineRequestId id) { enqueue(AbortItem{id}); }

EngineLoadSnapshot VllmEngineLoop::load() const {
  std::lock_guard lock{load_mutex_};
  return load_;
}

double VllmEngineLoop::now_ms() const {
  return std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
}

// False once the engine thread has ended: nobody would answer.
bool VllmEngineLoop::enqueue(InboxItem item) {
  {
    std::lock_guard lock{inbox_mutex_};
    if (engine_done_) return false;
    inbox_.push_back(std::move(item));
  }
  inbox_signal_.notify_one();
  return true;
}

void VllmEngineLoop::run() {
  std::deque<InboxItem> batch;
  while (true) {
    {
      std::lock_guard lock{inbox_mutex_};
      if (stopping_) break;
      batch.swap(inbox_);
    }
    for (InboxItem& item : batch) {
      if (auto* add_item = std::get_if<AddItem>(&item)) {
        add(*add_item);
      } else {
        abort_live(std::get<AbortItem>(item).id);
      }
    }
    batch.clear();
    const std::optional<double> next_ms = advance(now_ms());
    update_load();
    std::unique_lock lock{inbox_mutex_};
    auto ready = [&] { return !inbox_.empty() || stopping_; };
    if (next_ms) {
      inbox_signal_.wait_until(lock,
                               start_ + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double, std::milli>(*next_ms)),
                               ready);
    } else {
      inbox_signal_.wait(lock, ready);
    }
  }
  // Wake every response still waiting for an answer or a token.
  auto close = [](ResponseChannel& channel) {
    std::lock_guard lock{channel.mutex};
    channel.closed = true;
    channel.changed.notify_all();
  };
  for (auto& [id, request] : live_) close(*request.channel);
  std::lock_guard lock{inbox_mutex_};
  engine_done_ = true;
  for (InboxItem& item : inbox_) {
    if (auto* add_item = std::get_if<AddItem>(&item)) close(*add_item->channel);
  }
  inbox_.clear();
}

void VllmEngineLoop::add(AddItem& item) {
  auto answer = [&](std::string refusal) {
    std::lock_guard lock{item.channel->mutex};
    item.channel->answered = true;
    item.channel->refusal = std::move(refusal);
    item.channel->changed.notify_all();
  };
  EngineSubmission& submission = item.submission;
  simulation::EngineRequest request{.id = item.id,
                                    .block_hashes = item.hashes,
                                    .prompt_tokens = submission.tokens.size(),
                                    .output_tokens = submission.max_tokens,
                                    .kv_transfer = submission.kv_transfer.kv_transfer,
                                    .remote_blocks = submission.kv_transfer.remote_blocks};
  if (auto added = engine_.add_request(std::move(request), now_ms()); !added) {
    answer(std::string{simulation::as_str(added.error())});
    return;
  }
  block_tokens_.add_prompt(item.hashes, submission.tokens, submission.lora,
                           options_.engine.block_size);
  live_.emplace(item.id, LiveRequest{.channel = item.channel,
                                     .hashes = std::move(item.hashes),
                                     .prompt_tokens = submission.tokens.size(),
                                     .sampling = std::move(submission.sampling),
                                     .remote_decode = submission.kv_transfer.kv_transfer ==
                                                      simulation::KvTransfer::remote_decode});
  answer({});
}

void VllmEngineLoop::abort_live(EngineRequestId id) {
  auto found = live_.find(id);
  if (found == live_.end()) return;  // finished meanwhile
  engine_.abort_request(id);
  block_tokens_.release(found->second.hashes);
  live_.erase(found);
}

void VllmEngineLoop::publish_events(const std::vector<KvEvent>& events) {
  if (events.empty()) return;
  std::vector<const KvEvent*> packable;
  for (const KvEvent& event : events) {
    if (block_tokens_.has_tokens_for(event)) {
      packable.push_back(&event);
    } else {
      spdlog::error("kvr mocker: a stored block without known tokens; event dropped");
    }
  }
  block_tokens_.note_events(events);
  if (packable.empty()) return;
  sockets_.publish(encode_kv_event_batch(packable, block_tokens_, options_.engine.block_size,
                                         options_.lora_adapters, unix_seconds()));
}

void VllmEngineLoop::deliver(StepResult& result) {
  publish_events(result.kv_events);
  absl::flat_hash_map<EngineRequestId, bool> finished;
  for (const auto& done : result.completions) {
    finished[done.id] = true;
    // Even when the client left meanwhile: the blocks are held all the same.
    if (done.held_blocks > 0) {
      pending_releases_.emplace_back(result.end_ms() + engine_.transfer_ms(done.held_blocks),
                                     done.id);
    }
  }
  std::uint64_t generated = 0;
  std::uint64_t queries = 0;
  std::uint64_t hits = 0;
  std::uint64_t stopped = 0;
  auto emit = [&](EngineRequestId id, std::optional<std::uint64_t> cached) {
    auto found = live_.find(id);
    if (found == live_.end()) return;  // aborted while the step ran
    LiveRequest& request = found->second;
    const std::uint32_t token = generated_token(id, request.sampling, request.generated++);
    // A stop token ends the request early (after min_tokens), as in vLLM: it is the last
    // token sent, and the engine frees the request at once.
    const bool stop = !finished.contains(id) && request.generated >= request.sampling.min_tokens &&
                      request.sampling.stop_token_ids.contains(token);
    const bool last = finished.contains(id) || stop;
    ++generated;
    {
      ResponseChannel& channel = *request.channel;
      std::lock_guard lock{channel.mutex};
      if (cached) channel.cached_tokens = *cached;
      if (last && request.remote_decode) {
        channel.kv_transfer_params = kv_transfer_answer(
            transfer_source_, fmt::format("req-{:016x}", id), engine_.held_blocks(id));
      }
      channel.tokens.push_back(GeneratedToken{token, last, stop});
      channel.changed.notify_all();
    }
    if (cached) {
      queries += request.prompt_tokens;
      hits += *cached;
    }
    if (stop) {
      engine_.abort_request(id);
      ++stopped;
    }
    if (last) {
      block_tokens_.release(request.hashes);
      live_.erase(found);
    }
  };
  for (const auto& first : result.first_tokens) emit(first.id, first.cached_prompt_tokens);
  for (EngineRequestId id : result.next_tokens) emit(id, std::nullopt);
  std::lock_guard lock{load_mutex_};
  load_.generation_tokens += generated;
  load_.prefix_queries += queries;
  load_.prefix_hits += hits;
  load_.prompt_tokens += queries;
  load_.completed += result.completions.size() + stopped;
}

// Releases the held blocks whose modelled transfer is over; returns when the next one is.
std::optional<double> VllmEngineLoop::release_transfers(double now) {
  std::optional<double> next;
  std::size_t kept = 0;
  for (const auto& [release_ms, id] : pending_releases_) {
    if (release_ms <= now) {
      engine_.release_transfer(id);
      continue;
    }
    next = std::min(next.value_or(release_ms), release_ms);
    pending_releases_[kept++] = {release_ms, id};
  }
  pending_releases_.resize(kept);
  return next;
}

// Publishes the step that ended and starts the next; returns when the step in flight ends.
std::optional<double> VllmEngineLoop::step_engine(double now) {
  double step_start = now;
  if (in_flight_) {
    if (in_flight_->end_ms() > now) return in_flight_->end_ms();
    step_start = in_flight_->end_ms();
    StepResult done = std::move(*in_flight_);
    in_flight_.reset();
    deliver(done);
  }
  block_tokens_.sweep();
  if (!engine_.has_work()) return std::nullopt;
  in_flight_ = engine_.step(step_start);
  return in_flight_->end_ms();
}

// Advances the engine to `now`; returns when something is next due (nullopt: nothing is).
std::optional<double> VllmEngineLoop::advance(double now) {
  const std::optional<double> next_release = release_transfers(now);
  const std::optional<double> step_end = step_engine(now);
  if (!next_release) return step_end;
  return std::min(step_end.value_or(*next_release), *next_release);
}

void VllmEngineLoop::update_load() {
  const auto engine_load = engine_.load();
  std::lock_guard lock{load_mutex_};
  load_.running = engine_load.active_requests;
  load_.waiting = engine_load.waiting_requests;
  load_.kv_usage = engine_load.total_blocks == 0
                       ? 0.0
                       : static_cast<double>(engine_load.kv_blocks_used) /
                             static_cast<double>(engine_load.total_blocks);
}

}  // namespace kvr::mocker
