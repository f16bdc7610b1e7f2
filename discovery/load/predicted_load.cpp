#include "discovery/load/predicted_load.hpp"

#include <algorithm>

namespace kvr::discovery {
namespace {

// A reported count adjusted by the bookings' change since the report; never below zero, since a
// report that missed some requests cannot make a rank carry negative load.
std::uint64_t plus_change(std::uint64_t reported, std::int64_t change) {
  const std::int64_t total = static_cast<std::int64_t>(reported) + change;
  return total < 0 ? 0 : static_cast<std::uint64_t>(total);
}

// Bookings are kvr's own decisions, not a publisher's claims, so the active-block index needs
// no capacity bound beyond the bookings themselves.
constexpr std::uint64_t kUnboundedBlocks = std::uint64_t{1} << 40;

// Debian's abseil has its own string_view type for heterogeneous lookup.
absl::string_view as_key(std::string_view text) { return {text.data(), text.size()}; }

}  // namespace

std::string_view as_str(LoadError error) {
  switch (error) {
    case LoadError::unknown_rank:
      return "unknown_rank";
    case LoadError::duplicate_rank:
      return "duplicate_rank";
    case LoadError::duplicate_booking:
      return "duplicate_booking";
    case LoadError::unknown_booking:
      return "unknown_booking";
    case LoadError::prefill_already_released:
      return "prefill_already_released";
  }
  return "unknown";
}

PredictedLoad::PredictedLoad() = default;

std::expected<void, LoadError> PredictedLoad::add_rank(WorkerWithDpRank worker,
                                                       std::uint64_t total_kv_blocks) {
  if (ranks_.contains(worker)) return std::unexpected(LoadError::duplicate_rank);
  const auto slot = active_blocks_.add_worker(worker, {kUnboundedBlocks, 0, false});
  if (!slot) return std::unexpected(LoadError::duplicate_rank);
  RankState& state = ranks_[worker];
  state.slot = *slot;
  state.view.total_kv_blocks = total_kv_blocks;
  return {};
}

std::size_t PredictedLoad::remove_worker(WorkerId worker_id) {
  std::vector<std::string> doomed;
  for (const auto& [request_id, booking] : bookings_) {
    if (booking.worker.worker_id == worker_id) doomed.push_back(request_id);
  }
  for (const std::string& request_id : doomed) release_booking(bookings_.find(as_key(request_id)));
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    if (it->first.worker_id == worker_id) {
      ranks_.erase(it++);
    } else {
      ++it;
    }
  }
  active_blocks_.remove_worker(worker_id);
  return doomed.size();
}

std::expected<void, LoadError> PredictedLoad::update_confirmed(WorkerWithDpRank worker,
                                                               ConfirmedLoad load) {
  const auto it = ranks_.find(worker);
  if (it == ranks_.end()) return std::unexpected(LoadError::unknown_rank);
  RankLoadView& view = it->second.view;
  view.confirmed = load;
  view.requests_since_report = 0;
  view.prefill_tokens_since_report = 0;
  view.blocks_since_report = 0;
  return {};
}

std::expected<void, LoadError> PredictedLoad::book(BookingRequest request) {
  const auto rank = ranks_.find(request.worker);
  if (rank == ranks_.end()) return std::unexpected(LoadError::unknown_rank);
  if (bookings_.contains(request.request_id)) {
    return std::unexpected(LoadError::duplicate_booking);
  }
  RankState& state = rank->second;
  // A block shared with requests already active on the rank is counted once; the newly active
  // blocks form chains continuing blocks that are already active, indexed as Stored events.
  KvStoredEvent stored;
  for (std::size_t i = 0; i < request.prompt_blocks.size(); ++i) {
    const BlockHash hash = request.prompt_blocks[i];
    if (++state.block_refs[hash] == 1) {
      ++state.view.booked_blocks;
      ++state.view.blocks_since_report;
      if (stored.block_hashes.empty() && i > 0) stored.parent_hash = request.prompt_blocks[i - 1];
      stored.block_hashes.push_back(hash);
    } else if (!stored.block_hashes.empty()) {
      (void)active_blocks_.apply_event(request.worker, stored);
      stored = {};
    }
  }
  // A prompt whose hashes do not chain may be refused by the index; the counts above stay exact
  // and only that rank's new-block estimate is less precise.
  if (!stored.block_hashes.empty()) (void)active_blocks_.apply_event(request.worker, stored);
  ++state.view.open_bookings;
  ++state.view.requests_since_report;
  state.view.booked_prefill_tokens += request.uncached_prefill_tokens;
  state.view.prefill_tokens_since_report +=
      static_cast<std::int64_t>(request.uncached_prefill_tokens);
  const auto expiry = expiries_.emplace(request.expires_at, request.request_id);
  bookings_.emplace(std::move(request.request_id),
                    BookingState{request.worker, std::move(request.prompt_blocks),
                                 request.uncached_prefill_tokens, false, expiry});
  return {};
}

bool PredictedLoad::has_booking(std::string_view request_id) const {
  return bookings_.contains(as_key(request_id));
}

std::expected<void, LoadError> PredictedLoad::first_token(std::string_view request_id) {
  const auto it = bookings_.find(as_key(request_id));
  if (it == bookings_.end()) return std::unexpected(LoadError::unknown_booking);
  BookingState& booking = it->second;
  if (booking.prefill_released) return std::unexpected(LoadError::prefill_already_released);
  booking.prefill_released = true;
  RankLoadView& view = ranks_[booking.worker].view;
  view.booked_prefill_tokens -= booking.prefill_tokens;
  view.prefill_tokens_since_report -= static_cast<std::int64_t>(booking.prefill_tokens);
  return {};
}

std::expected<void, LoadError> PredictedLoad::release(std::string_view request_id,
                                                      BookingEnd /*end*/) {
  const auto it = bookings_.find(as_key(request_id));
  if (it == bookings_.end()) return std::unexpected(LoadError::unknown_booking);
  release_booking(it);
  return {};
}

std::size_t PredictedLoad::expire(std::chrono::steady_clock::time_point now) {
  std::size_t released = 0;
  while (!expiries_.empty() && expiries_.begin()->first <= now) {
    release_booking(bookings_.find(expiries_.begin()->second));
    ++released;
  }
  return released;
}

void PredictedLoad::release_booking(
    absl::flat_hash_map<std::string, BookingState>::iterator booking) {
  BookingState& state = booking->second;
  RankState& rank = ranks_[state.worker];
  if (!state.prefill_released) {
    rank.view.booked_prefill_tokens -= state.prefill_tokens;
    rank.view.prefill_tokens_since_report -= static_cast<std::int64_t>(state.prefill_tokens);
  }
  --rank.view.open_bookings;
  --rank.view.requests_since_report;
  // Leaf first, so that dropping a block never cascades over blocks other bookings still hold.
  KvRemovedEvent removed;
  for (auto it = state.prompt_blocks.rbegin(); it != state.prompt_blocks.rend(); ++it) {
    const auto ref = rank.block_refs.find(*it);
    if (ref == rank.block_refs.end()) continue;  // a hash repeated within the prompt
    if (--ref->second == 0) {
      rank.block_refs.erase(ref);
      --rank.view.booked_blocks;
      --rank.view.blocks_since_report;
      removed.block_hashes.push_back(*it);
    }
  }
  if (!removed.block_hashes.empty()) (void)active_blocks_.apply_event(state.worker, removed);
  expiries_.erase(state.expiry);
  bookings_.erase(booking);
}

void PredictedLoad::prepare(std::span<const BlockHash> prompt_blocks,
                            ProjectionScratch& scratch) const {
  active_blocks_.find_matches(prompt_blocks, scratch.active_prefix_);
  scratch.prompt_blocks_ = prompt_blocks.size();
}

std::optional<LoadProjection> PredictedLoad::project(WorkerWithDpRank worker,
                                                     const CandidateRequest& candidate,
                                                     const ProjectionScratch& scratch) const {
  const auto it = ranks_.find(worker);
  if (it == ranks_.end()) return std::nullopt;
  const RankState& state = it->second;
  const WorkerMatch* active = scratch.active_prefix_.find(state.slot);
  const std::uint64_t active_prefix = active ? active->matched_blocks() : 0;
  LoadProjection projection;
  projection.is_available = state.view.confirmed.has_value();
  const ConfirmedLoad confirmed = state.view.confirmed.value_or(ConfirmedLoad{});
  projection.active_requests =
      plus_change(confirmed.active_requests, state.view.requests_since_report);
  projection.active_prefill_tokens =
      plus_change(confirmed.active_prefill_tokens, state.view.prefill_tokens_since_report) +
      candidate.uncached_prefill_tokens;
  projection.new_blocks =
      candidate.prompt_blocks - std::min(candidate.prompt_blocks, active_prefix);
  projection.decode_cost_blocks =
      plus_change(confirmed.active_decode_blocks, state.view.blocks_since_report) +
      projection.new_blocks;
  projection.total_kv_blocks = state.view.total_kv_blocks;
  return projection;
}

std::optional<RankLoadView> PredictedLoad::rank_load(WorkerWithDpRank worker) const {
  const auto it = ranks_.find(worker);
  if (it == ranks_.end()) return std::nullopt;
  return it->second.view;
}

}  // namespace kvr::discovery
