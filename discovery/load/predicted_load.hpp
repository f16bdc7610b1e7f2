// Predicted load per (worker, rank): confirmed load metrics plus in-flight bookings, and the
// projection of a candidate request onto each rank that feeds the selection layer's LOAD signals.
//
// A worker's report already counts the requests it had received when it sent it, so adding every
// open booking to it would count those twice. The projection is therefore the last report plus
// what changed in the bookings since that report (bookings made minus bookings released); each
// report resets that change. Until the first report, the open bookings are the whole estimate.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "messages/ids.hpp"

namespace kvr::discovery {

/// Load a rank reported itself (kvr.v1.RankLoad).
struct ConfirmedLoad {
  std::uint32_t active_requests = 0;
  std::uint32_t waiting_requests = 0;
  std::uint64_t active_decode_blocks = 0;
  std::uint64_t active_prefill_tokens = 0;
  std::uint64_t kv_blocks_used = 0;

  friend bool operator==(const ConfirmedLoad&, const ConfirmedLoad&) = default;
};

/// Why a load operation was refused.
enum class LoadError : std::uint8_t {
  unknown_rank,              ///< the (worker, rank) is not tracked
  duplicate_rank,            ///< the (worker, rank) is already tracked
  duplicate_booking,         ///< a booking with this request id is open
  unknown_booking,           ///< no open booking has this request id (never booked or released)
  prefill_already_released,  ///< first token was already reported for this booking
};

/// The snake_case name of a load error.
std::string_view as_str(LoadError error);

/// A routed request's reservation on a rank, held until the request ends.
struct BookingRequest {
  std::string request_id;
  WorkerWithDpRank worker;
  std::vector<BlockHash> prompt_blocks;              ///< chained hashes of the prompt's full blocks
  std::uint64_t uncached_prefill_tokens = 0;         ///< prompt tokens the rank must compute
  std::chrono::steady_clock::time_point expires_at;  ///< released then if nothing else did
  /// The client whose per-client caps the booking counts against; empty: none.
  std::string client;
};

/// Told of each ended booking that named a client: (client, its prompt blocks).
using BookingEndObserver = std::function<void(std::string_view client, std::uint64_t blocks)>;

/// How a booking ended.
enum class BookingEnd : std::uint8_t { completed, cancelled, failed };

/// What one rank carries now, confirmed and booked.
struct RankLoadView {
  std::optional<ConfirmedLoad> confirmed;  ///< none until the rank reports metrics
  /// The rank's registered KV capacity; nullopt: its engine did not say (no KV usage then).
  std::optional<std::uint64_t> total_kv_blocks;
  std::uint32_t open_bookings = 0;
  std::uint64_t booked_prefill_tokens = 0;  ///< uncached prefill tokens before first token
  std::uint64_t booked_blocks = 0;          ///< distinct prompt blocks of open bookings
  /// Booking changes since the last confirmed report (or since tracking began): each booking
  /// adds, each release subtracts. May be negative: releases of requests the report counted.
  std::int64_t requests_since_report = 0;
  std::int64_t prefill_tokens_since_report = 0;
  std::int64_t blocks_since_report = 0;
};

/// A candidate request as the projection sees it.
struct CandidateRequest {
  std::uint64_t prompt_blocks = 0;            ///< full blocks of the prompt
  std::uint64_t uncached_prefill_tokens = 0;  ///< on this rank: prompt tokens minus cached ones
};

/// A rank's load if it took the candidate request; the selection layer's LOAD inputs.
struct LoadProjection {
  bool is_available = false;                ///< the rank has reported load at least once
  std::uint64_t active_requests = 0;        ///< confirmed + bookings since (without the candidate)
  std::uint64_t active_prefill_tokens = 0;  ///< confirmed + booked since + the candidate's uncached
  std::uint64_t decode_cost_blocks = 0;     ///< confirmed decode + booked since + the new blocks
  std::uint64_t new_blocks = 0;             ///< candidate blocks not already active on the rank
  std::optional<std::uint64_t> total_kv_blocks;  ///< nullopt: the rank registered no capacity

  friend bool operator==(const LoadProjection&, const LoadProjection&) = default;
};

/// Per-request scratch of the projection: how long a prefix of the candidate's prompt is
/// already active (booked) on each rank. Reuse one across requests; a warm prepare allocates
/// nothing.
class ProjectionScratch {
 private:
  friend class PredictedLoad;
  // Per rank slot; an entry counts only when its epoch is the current prepare's, so starting a
  // prepare never touches the whole array.
  struct RankPrefix {
    std::uint32_t epoch = 0;
    std::uint32_t blocks = 0;
  };
  std::vector<RankPrefix> prefix_;
  std::uint32_t epoch_ = 0;
};

/// Uncached prompt tokens when `cached_blocks` leading blocks of `block_size` tokens are reused.
constexpr std::uint64_t uncached_prefill_tokens(std::uint64_t prompt_tokens,
                                                std::uint64_t cached_blocks,
                                                std::uint64_t block_size) {
  const std::uint64_t cached = cached_blocks * block_size;
  return cached >= prompt_tokens ? 0 : prompt_tokens - cached;
}

/// Confirmed metrics and bookings of every tracked rank. Each booking is released exactly once:
/// its prefill tokens at first token (or at its end, if that comes first) and everything else at
/// completion, cancellation, failure, worker removal or expiry.
class PredictedLoad {
 public:
  PredictedLoad();

  /// Starts tracking a rank with no load; `total_kv_blocks` nullopt: its capacity is not known.
  std::expected<void, LoadError> add_rank(WorkerWithDpRank worker,
                                          std::optional<std::uint64_t> total_kv_blocks);

  /// Stops tracking every rank of a worker, releasing its bookings; returns how many.
  std::size_t remove_worker(WorkerId worker_id);

  /// Records a rank's latest load report.
  std::expected<void, LoadError> update_confirmed(WorkerWithDpRank worker, ConfirmedLoad load);

  /// Books a routed request on its rank.
  std::expected<void, LoadError> book(BookingRequest request);

  /// The request produced its first token: its prefill tokens are done.
  std::expected<void, LoadError> first_token(std::string_view request_id);

  /// The request ended: releases what it still holds.
  std::expected<void, LoadError> release(std::string_view request_id, BookingEnd end);

  /// Tells `observer` of every booking with a client that ends from now on, however it ends
  /// (release, expiry, its worker's removal); not of those still open when the load is destroyed.
  void on_booking_end(BookingEndObserver observer) { booking_end_ = std::move(observer); }

  /// Releases bookings whose expiry is at or before `now`, the earliest first and at most
  /// `limit` of them; returns how many.
  std::size_t expire(std::chrono::steady_clock::time_point now,
                     std::size_t limit = std::numeric_limits<std::size_t>::max());

  /// Once per request, before projecting: finds on every rank the longest prefix of
  /// `prompt_blocks` already active in open bookings.
  void prepare(std::span<const BlockHash> prompt_blocks, ProjectionScratch& scratch) const;

  /// The rank's load if it took the candidate prepared in `scratch`; nullopt for unknown ranks.
  std::optional<LoadProjection> project(WorkerWithDpRank worker, const CandidateRequest& candidate,
                                        const ProjectionScratch& scratch) const;

  /// What a rank carries now.
  std::optional<RankLoadView> rank_load(WorkerWithDpRank worker) const;

  std::size_t open_bookings() const { return bookings_.size(); }
  /// Prompt blocks over all open bookings (a block in several bookings counts in each): what
  /// the bookings keep in memory, and what the booked-blocks caps count.
  std::uint64_t booked_prompt_blocks() const { return booked_prompt_blocks_; }
  /// True while a booking with this request id is open.
  bool has_booking(std::string_view request_id) const;
  /// Distinct prompt blocks active in open bookings, over all ranks (tests check it drains).
  std::size_t active_block_count() const { return active_blocks_.size(); }
  /// Slots the ledger has allocated (tests check that it gives memory back after a burst).
  std::size_t ledger_capacity() const { return active_blocks_.capacity(); }

  /// Verifies that the ledger of active blocks equals the one recomputed from the open bookings
  /// and that every rank's booked_blocks matches it; the message names the first difference.
  /// For tests; O(bookings × prompt blocks).
  std::expected<void, std::string> check_consistency() const;

 private:
  // A small integer per tracked rank, so that ledger entries and scratch arrays are compact.
  using RankSlot = std::uint32_t;

  struct RankState {
    RankSlot slot = 0;
    RankLoadView view;
  };
  // A rank on which a prompt block is active, and in how many open bookings (a hash repeated
  // within one prompt counts once per occurrence).
  struct ActiveHolder {
    RankSlot slot = 0;
    std::uint32_t bookings = 0;
  };
  // A ledger entry: the one rank holding the block and its bookings, or kSharedSlot when several
  // ranks hold it, with the index of their list in shared_lists_.
  static constexpr RankSlot kSharedSlot = 0xFFFFFFFFU;
  struct LedgerEntry {
    RankSlot slot = 0;
    std::uint32_t bookings_or_list = 0;
  };
  struct BookingState {
    WorkerWithDpRank worker;
    std::vector<BlockHash> prompt_blocks;
    std::uint64_t prefill_tokens = 0;
    bool prefill_released = false;
    std::multimap<std::chrono::steady_clock::time_point, std::string>::iterator expiry;
    std::string client;
  };

  void release_booking(absl::flat_hash_map<std::string, BookingState>::iterator booking);
  // Gives the ledger's (and the bookings') memory back once most of their entries have left.
  void shrink_ledger_when_sparse();
  // Counts one more booking of `hash` on the rank; true when the block was not active there.
  bool activate(BlockHash hash, RankSlot slot);
  // Counts one booking less; true when the block is no longer active on the rank.
  bool deactivate(BlockHash hash, RankSlot slot);
  // The ranks (ascending) on which the block of a ledger entry is active; a plain entry's one
  // rank is written to `single`.
  std::span<const ActiveHolder> holders_of(const LedgerEntry& entry, ActiveHolder& single) const;
  // Starts loading a shared block's holder list (a second cache miss after its ledger slot).
  void prefetch_holders(BlockHash hash) const;

  absl::flat_hash_map<WorkerWithDpRank, RankState> ranks_;
  absl::flat_hash_map<std::string, BookingState> bookings_;
  std::multimap<std::chrono::steady_clock::time_point, std::string> expiries_;
  // The ledger of active prompt blocks: block -> the rank holding it in open bookings, with their
  // count. One lookup per block books or releases it, and one walk along a prompt answers every
  // rank's "how much of this prompt is already active here". It holds only the blocks of requests
  // in flight, in 16-byte entries, so it stays small, unlike the KV index. A block active on
  // several ranks (a shared system prompt) points to a list of its ranks, sorted, in
  // shared_lists_ (indexed, so a walk needs no second lookup); it returns to a plain entry when
  // one rank is left, and its list to free_lists_.
  absl::flat_hash_map<BlockHash, LedgerEntry> active_blocks_;
  std::vector<std::vector<ActiveHolder>> shared_lists_;
  std::vector<std::uint32_t> free_lists_;
  std::vector<RankSlot> free_slots_;
  RankSlot slot_count_ = 0;
  std::uint64_t booked_prompt_blocks_ = 0;
  BookingEndObserver booking_end_;
};

}  // namespace kvr::discovery
