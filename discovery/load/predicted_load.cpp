#include "discovery/load/predicted_load.hpp"

#include <algorithm>
#include <utility>

#include "messages/check.hpp"

namespace kvr::discovery {
namespace {

// A reported count adjusted by the bookings' change since the report; never below zero, since a
// report that missed some requests cannot make a rank carry negative load.
std::uint64_t plus_change(std::uint64_t reported, std::int64_t change) {
  const std::int64_t total = static_cast<std::int64_t>(reported) + change;
  return total < 0 ? 0 : static_cast<std::uint64_t>(total);
}

// Prompt blocks are looked up this many positions ahead, so that the ledger's misses overlap.
constexpr std::size_t kLedgerPrefetchDistance = 8;
// A shared block's holder list is fetched this many positions ahead: its slot is in cache by
// then, and the list is a second, separate miss.
constexpr std::size_t kListPrefetchDistance = 4;

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

std::expected<void, LoadError> PredictedLoad::add_rank(
    WorkerWithDpRank worker, std::optional<std::uint64_t> total_kv_blocks) {
  if (ranks_.contains(worker)) return std::unexpected(LoadError::duplicate_rank);
  RankState& state = ranks_[worker];
  if (!free_slots_.empty()) {
    state.slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    state.slot = slot_count_++;
  }
  state.view.total_kv_blocks = total_kv_blocks;
  return {};
}

std::size_t PredictedLoad::remove_worker(WorkerId worker_id) {
  std::vector<std::string> doomed;
  for (const auto& [request_id, booking] : bookings_) {
    if (booking.worker.worker_id == worker_id) doomed.push_back(request_id);
  }
  for (const std::string& request_id : doomed) release_booking(bookings_.find(as_key(request_id)));
  // Releasing the bookings took the ranks' blocks out of the ledger, so their slots are free.
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    if (it->first.worker_id == worker_id) {
      free_slots_.push_back(it->second.slot);
      ranks_.erase(it++);
    } else {
      ++it;
    }
  }
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
  // A block shared with requests already active on the rank is counted once.
  const std::span<const BlockHash> blocks = request.prompt_blocks;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i + kLedgerPrefetchDistance < blocks.size())
      active_blocks_.prefetch(blocks[i + kLedgerPrefetchDistance]);
    if (activate(blocks[i], state.slot)) {
      ++state.view.booked_blocks;
      ++state.view.blocks_since_report;
    }
  }
  ++state.view.open_bookings;
  ++state.view.requests_since_report;
  state.view.booked_prefill_tokens += request.uncached_prefill_tokens;
  state.view.prefill_tokens_since_report +=
      static_cast<std::int64_t>(request.uncached_prefill_tokens);
  booked_prompt_blocks_ += blocks.size();
  const auto expiry = expiries_.emplace(request.expires_at, request.request_id);
  bookings_.emplace(
      std::move(request.request_id),
      BookingState{request.worker, std::move(request.prompt_blocks),
                   request.uncached_prefill_tokens, false, expiry, std::move(request.client)});
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

std::size_t PredictedLoad::expire(std::chrono::steady_clock::time_point now, std::size_t limit) {
  std::size_t released = 0;
  while (released < limit && !expiries_.empty() && expiries_.begin()->first <= now) {
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
  const std::span<const BlockHash> blocks = state.prompt_blocks;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i + kLedgerPrefetchDistance < blocks.size())
      active_blocks_.prefetch(blocks[i + kLedgerPrefetchDistance]);
    if (i + kListPrefetchDistance < blocks.size()) {
      prefetch_holders(blocks[i + kListPrefetchDistance]);
    }
    if (deactivate(blocks[i], rank.slot)) {
      --rank.view.booked_blocks;
      --rank.view.blocks_since_report;
    }
  }
  booked_prompt_blocks_ -= blocks.size();
  if (booking_end_ && !state.client.empty()) booking_end_(state.client, blocks.size());
  expiries_.erase(state.expiry);
  bookings_.erase(booking);
  shrink_ledger_when_sparse();
}

void PredictedLoad::shrink_ledger_when_sparse() {
  // A hash map keeps its capacity when entries leave: after a burst of long prompts the ledger
  // would hold its peak size (17 bytes a slot) for good. Shrunk once it is a quarter full, so a
  // rehash (linear in what is left) happens only after at least three times as many releases.
  constexpr std::size_t kMinShrinkCapacity = std::size_t{1} << 16;
  if (const std::size_t capacity = active_blocks_.capacity();
      capacity >= kMinShrinkCapacity && active_blocks_.size() < capacity / 4) {
    active_blocks_.rehash(0);
  }
  // The same for the bookings themselves (about 100 bytes a slot): a flood of small bookings.
  if (const std::size_t capacity = bookings_.capacity();
      capacity >= kMinShrinkCapacity && bookings_.size() < capacity / 4) {
    bookings_.rehash(0);
  }
}

bool PredictedLoad::activate(BlockHash hash, RankSlot slot) {
  const auto [position, inserted] = active_blocks_.try_emplace(hash, LedgerEntry{slot, 0});
  LedgerEntry& entry = position->second;
  if (entry.slot == slot) return entry.bookings_or_list++ == 0;
  if (entry.slot != kSharedSlot) {
    // A second rank: both move to a shared list.
    std::uint32_t list_index = 0;
    if (!free_lists_.empty()) {
      list_index = free_lists_.back();
      free_lists_.pop_back();
    } else {
      list_index = static_cast<std::uint32_t>(shared_lists_.size());
      shared_lists_.emplace_back();
    }
    std::vector<ActiveHolder>& holders = shared_lists_[list_index];
    const ActiveHolder first{entry.slot, entry.bookings_or_list};
    const ActiveHolder second{slot, 1};
    holders.assign({slot < first.slot ? second : first, slot < first.slot ? first : second});
    entry = LedgerEntry{kSharedSlot, list_index};
    return true;
  }
  std::vector<ActiveHolder>& holders = shared_lists_[entry.bookings_or_list];
  const auto holder = std::ranges::lower_bound(holders, slot, {}, &ActiveHolder::slot);
  if (holder != holders.end() && holder->slot == slot) return holder->bookings++ == 0;
  holders.insert(holder, ActiveHolder{slot, 1});
  return true;
}

bool PredictedLoad::deactivate(BlockHash hash, RankSlot slot) {
  // Every block of an open booking is in the ledger (check_consistency verifies it).
  const auto position = active_blocks_.find(hash);
  KVR_ASSERT(position != active_blocks_.end());
  LedgerEntry& entry = position->second;
  if (entry.slot == slot) {
    if (--entry.bookings_or_list > 0) return false;
    active_blocks_.erase(position);
    return true;
  }
  KVR_ASSERT(entry.slot == kSharedSlot);
  const std::uint32_t list_index = entry.bookings_or_list;
  std::vector<ActiveHolder>& holders = shared_lists_[list_index];
  const auto holder = std::ranges::lower_bound(holders, slot, {}, &ActiveHolder::slot);
  KVR_ASSERT(holder != holders.end() && holder->slot == slot);
  if (--holder->bookings > 0) return false;
  holders.erase(holder);
  if (holders.size() == 1) {
    entry = LedgerEntry{holders.front().slot, holders.front().bookings};
    holders.clear();
    free_lists_.push_back(list_index);
  }
  return true;
}

void PredictedLoad::prefetch_holders(BlockHash hash) const {
  if (free_lists_.size() == shared_lists_.size()) return;  // no block is shared: no list to load
  const auto position = active_blocks_.find(hash);
  if (position != active_blocks_.end() && position->second.slot == kSharedSlot) {
    __builtin_prefetch(shared_lists_[position->second.bookings_or_list].data());
  }
}

std::span<const PredictedLoad::ActiveHolder> PredictedLoad::holders_of(const LedgerEntry& entry,
                                                                       ActiveHolder& single) const {
  if (entry.slot == kSharedSlot) return shared_lists_[entry.bookings_or_list];
  single = ActiveHolder{entry.slot, entry.bookings_or_list};
  return {&single, 1};
}

void PredictedLoad::prepare(std::span<const BlockHash> prompt_blocks,
                            ProjectionScratch& scratch) const {
  if (scratch.prefix_.size() < slot_count_) scratch.prefix_.resize(slot_count_);
  if (++scratch.epoch_ == 0) {
    // Epoch wrapped: stale stamps could look current, so reset them once every 2^32 prepares.
    for (ProjectionScratch::RankPrefix& prefix : scratch.prefix_) prefix = {};
    scratch.epoch_ = 1;
  }
  // Walk the prompt while some rank still has every block so far active. A rank's entry counts
  // the leading blocks it has active; at each depth only the ranks that reached it and hold the
  // block move on, so the others keep the depth they reached. Marks instead of a merge of sorted
  // lists: holder lists are long when many open bookings share a prefix.
  for (std::size_t depth = 0; depth < prompt_blocks.size(); ++depth) {
    if (depth + kLedgerPrefetchDistance < prompt_blocks.size()) {
      active_blocks_.prefetch(prompt_blocks[depth + kLedgerPrefetchDistance]);
    }
    if (depth + kListPrefetchDistance < prompt_blocks.size()) {
      prefetch_holders(prompt_blocks[depth + kListPrefetchDistance]);
    }
    const auto position = active_blocks_.find(prompt_blocks[depth]);
    if (position == active_blocks_.end()) return;
    const auto reached = static_cast<std::uint32_t>(depth);
    bool any_moved_on = false;
    ActiveHolder single;
    for (const ActiveHolder& holder : holders_of(position->second, single)) {
      ProjectionScratch::RankPrefix& prefix = scratch.prefix_[holder.slot];
      if (depth == 0) {
        prefix = {scratch.epoch_, 1};
      } else if (prefix.epoch == scratch.epoch_ && prefix.blocks == reached) {
        prefix.blocks = reached + 1;
      } else {
        continue;
      }
      any_moved_on = true;
    }
    if (!any_moved_on) return;
  }
}

std::optional<LoadProjection> PredictedLoad::project(WorkerWithDpRank worker,
                                                     const CandidateRequest& candidate,
                                                     const ProjectionScratch& scratch) const {
  const auto it = ranks_.find(worker);
  if (it == ranks_.end()) return std::nullopt;
  const RankState& state = it->second;
  const bool prepared =
      state.slot < scratch.prefix_.size() && scratch.prefix_[state.slot].epoch == scratch.epoch_;
  const std::uint64_t active_prefix = prepared ? scratch.prefix_[state.slot].blocks : 0;
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

std::expected<void, std::string> PredictedLoad::check_consistency() const {
  // The ledger recomputed from the open bookings: (block, rank slot) -> bookings.
  absl::flat_hash_map<std::pair<BlockHash, RankSlot>, std::uint32_t> expected;
  for (const auto& [request_id, booking] : bookings_) {
    const auto rank = ranks_.find(booking.worker);
    if (rank == ranks_.end()) return std::unexpected("booking " + request_id + " on no rank");
    for (const BlockHash hash : booking.prompt_blocks) ++expected[{hash, rank->second.slot}];
  }
  absl::flat_hash_map<RankSlot, std::uint64_t> blocks_per_slot;
  std::size_t entries = 0;
  std::size_t shared_entries = 0;
  for (const auto& [hash, entry] : active_blocks_) {
    const std::string where = "block " + std::to_string(hash) + ": ";
    if (entry.slot == kSharedSlot) {
      if (entry.bookings_or_list >= shared_lists_.size()) {
        return std::unexpected(where + "shared list index out of range");
      }
      ++shared_entries;
    }
    ActiveHolder single;
    const std::span<const ActiveHolder> holders = holders_of(entry, single);
    if (entry.slot == kSharedSlot && holders.size() < 2) {
      return std::unexpected(where + "shared by fewer than two ranks");
    }
    for (std::size_t i = 0; i < holders.size(); ++i) {
      if (i > 0 && holders[i - 1].slot >= holders[i].slot) {
        return std::unexpected(where + "holders not sorted");
      }
      const auto want = expected.find({hash, holders[i].slot});
      if (want == expected.end() || want->second != holders[i].bookings) {
        return std::unexpected(where + "booking count differs from the open bookings");
      }
      ++blocks_per_slot[holders[i].slot];
      ++entries;
    }
  }
  if (entries != expected.size()) return std::unexpected("ledger misses blocks of open bookings");
  // Every list in use belongs to exactly one shared entry; the others are free and empty.
  if (shared_entries + free_lists_.size() != shared_lists_.size()) {
    return std::unexpected("shared lists in use differ from the shared entries");
  }
  for (const std::uint32_t list_index : free_lists_) {
    if (list_index >= shared_lists_.size() || !shared_lists_[list_index].empty()) {
      return std::unexpected("a free shared list is in use");
    }
  }
  for (const auto& [worker, rank] : ranks_) {
    const auto counted = blocks_per_slot.find(rank.slot);
    const std::uint64_t held = counted == blocks_per_slot.end() ? 0 : counted->second;
    if (held != rank.view.booked_blocks) {
      return std::unexpected("rank " + std::to_string(worker.worker_id) + "/" +
                             std::to_string(worker.dp_rank) + ": booked_blocks differs");
    }
  }
  return {};
}

}  // namespace kvr::discovery
