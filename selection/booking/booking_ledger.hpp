// The booking ledger of route mode: booking id (a booking's id as the client holds it, the
// RouteDecision's `booking_id`) → (partition, request id, worker, expiry), so that a lifecycle
// report finds the selector holding its booking, and every booking is ended exactly once (report,
// rollback or expiry). Owned by the reservation actor; plain C++ with the time passed in.
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

namespace kvr {

/// One open booking: a routed request's claim on its worker, until reported or expired.
struct Booking {
  /// The booking's id on the wire (RouteDecision and LifecycleReport `booking_id`).
  std::string booking_id;
  plugins::worker_selection::RoutingPartition partition;
  std::string request_id;
  WorkerWithDpRank worker;
  std::chrono::steady_clock::time_point expires_at;
  bool first_token_reported = false;
};

/// Why a report could not be applied to a booking.
enum class BookingError : std::uint8_t {
  unknown_booking,       ///< never issued, expired, or ended too long ago to be remembered
  first_token_repeated,  ///< the first token of this booking was already reported
  already_ended,         ///< one of the last kRecentlyEnded bookings a completion or abort ended
};

/// "unknown_booking", "first_token_repeated" or "already_ended".
std::string_view as_str(BookingError error);

/// Open bookings by id, with an expiry order.
class BookingLedger {
 public:
  /// Booking ids are "<id_prefix>-<counter>"; give each node (and each start) its own prefix.
  explicit BookingLedger(std::string id_prefix);

  /// Records a booked request and returns its new booking id.
  std::string open(plugins::worker_selection::RoutingPartition partition, std::string request_id,
                   WorkerWithDpRank worker, std::chrono::steady_clock::time_point expires_at);

  /// Marks the booking's first token; the booking stays open. Fails when unknown or repeated, and
  /// with already_ended for one of the last kRecentlyEnded bookings close() ended: reports travel
  /// independently (in a cluster, through different nodes), so a completion may overtake its
  /// first token.
  std::expected<Booking, BookingError> first_token(std::string_view booking_id);

  /// Ends the booking (completed, aborted, or rolled back) and returns it; the caller releases
  /// it at its selector. Fails when the booking is not open, so one is never released twice:
  /// with already_ended for one of the last kRecentlyEnded bookings close() ended (a client that
  /// sent its report again, docs/protocol.md), else unknown_booking.
  std::expected<Booking, BookingError> close(std::string_view booking_id);

  /// Ends the bookings whose expiry is at or before `now`, the earliest first and at most `limit`
  /// of them, and returns them.
  std::vector<Booking> expire(std::chrono::steady_clock::time_point now,
                              std::size_t limit = std::numeric_limits<std::size_t>::max());

  /// The open booking with this id, or nullptr.
  const Booking* find(std::string_view booking_id) const;

  std::size_t size() const { return bookings_.size(); }

  /// How many ended bookings first_token() and close() still recognise.
  static constexpr std::size_t kRecentlyEnded = 8192;

 private:
  // Bookings are keyed by their counter: an id is "<prefix>-<counter>", so a lookup parses the
  // counter back instead of hashing and comparing strings.
  std::optional<std::uint64_t> counter_of(std::string_view booking_id) const;
  // Why the booking with this counter is not open: ended recently, or unknown.
  BookingError not_open(std::optional<std::uint64_t> counter) const;
  // Drops heap entries of bookings that already ended once they outnumber the open bookings.
  void compact_expiries();

  std::string id_prefix_;
  std::uint64_t next_id_ = 1;
  absl::flat_hash_map<std::uint64_t, Booking> bookings_;
  // The counters of the last bookings close() ended, oldest first, and the same as a set.
  std::deque<std::uint64_t> ended_order_;
  absl::flat_hash_set<std::uint64_t> ended_;
  // (expiry, counter), earliest on top; an entry whose booking ended is skipped when it surfaces.
  using Expiry = std::pair<std::chrono::steady_clock::time_point, std::uint64_t>;
  std::vector<Expiry> expiries_;
};

}  // namespace kvr
