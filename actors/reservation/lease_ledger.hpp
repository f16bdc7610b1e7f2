// The reservation ledger of route mode: lease id → (partition, request id, worker, expiry), so
// that a lifecycle report finds the selector holding its booking, and every booking is ended
// exactly once (report, rollback or expiry). Owned by the reservation actor; plain C++ with the
// time passed in.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <expected>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>

#include "messages/ids.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::actors {

/// One open lease.
struct Lease {
  std::string lease_id;
  plugins::worker_selection::RoutingPartition partition;
  std::string request_id;
  WorkerWithDpRank worker;
  std::chrono::steady_clock::time_point expires_at;
  bool first_token_reported = false;
};

/// Why a report could not be applied to a lease.
enum class LeaseError : std::uint8_t {
  unknown_lease,         ///< never issued, already ended, or expired
  first_token_repeated,  ///< the first token of this lease was already reported
  already_ended,         ///< a first token for a lease its completion or abort ended just before
};

/// "unknown_lease", "first_token_repeated" or "already_ended".
std::string_view as_str(LeaseError error);

/// Open leases by id, with an expiry order.
class LeaseLedger {
 public:
  /// Lease ids are "<id_prefix>-<counter>"; give each node (and each start) its own prefix.
  explicit LeaseLedger(std::string id_prefix);

  /// Records a booked request and returns its new lease id.
  std::string open(plugins::worker_selection::RoutingPartition partition, std::string request_id,
                   WorkerWithDpRank worker, std::chrono::steady_clock::time_point expires_at);

  /// Marks the lease's first token; the lease stays open. Fails when unknown or repeated, and
  /// with already_ended for one of the last kRecentlyEnded leases close() ended: reports travel
  /// independently (in a cluster, through different nodes), so a completion may overtake its
  /// first token.
  std::expected<Lease, LeaseError> first_token(std::string_view lease_id);

  /// Ends the lease (completed, aborted, or rolled back) and returns it; the caller releases
  /// the booking. Fails when the lease is unknown, so a booking is never released twice.
  std::expected<Lease, LeaseError> close(std::string_view lease_id);

  /// Ends the leases whose expiry is at or before `now`, the earliest first and at most `limit`
  /// of them, and returns them.
  std::vector<Lease> expire(std::chrono::steady_clock::time_point now,
                            std::size_t limit = std::numeric_limits<std::size_t>::max());

  /// The open lease with this id, or nullptr.
  const Lease* find(std::string_view lease_id) const;

  std::size_t size() const { return leases_.size(); }

  /// How many ended leases first_token() still recognises.
  static constexpr std::size_t kRecentlyEnded = 8192;

 private:
  // Leases are keyed by their counter: an id is "<prefix>-<counter>", so a lookup parses the
  // counter back instead of hashing and comparing strings.
  std::optional<std::uint64_t> counter_of(std::string_view lease_id) const;
  // Drops heap entries of leases that already ended once they outnumber the open leases.
  void compact_expiries();

  std::string id_prefix_;
  std::uint64_t next_id_ = 1;
  absl::flat_hash_map<std::uint64_t, Lease> leases_;
  // The counters of the last leases close() ended, oldest first, and the same as a set.
  std::deque<std::uint64_t> ended_order_;
  absl::flat_hash_set<std::uint64_t> ended_;
  // (expiry, counter), earliest on top; an entry whose lease ended is skipped when it surfaces.
  using Expiry = std::pair<std::chrono::steady_clock::time_point, std::uint64_t>;
  std::vector<Expiry> expiries_;
};

}  // namespace kvr::actors
