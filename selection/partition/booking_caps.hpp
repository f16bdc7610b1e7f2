// Caps on what open bookings (route-mode bookings and generate requests in flight) may hold, so
// that clients that route and never report cannot grow a node's memory without bound: each booking
// keeps its prompt's block hashes until it ends (docs/protocol.md gives the bytes per block).
// A partition's selector counts its own bookings; the node's selectors share one NodeBookingTotals
// (atomics), so a node-wide cap holds across partitions. Plain C++; the selector state checks the
// caps before selection and updates the totals when its bookings change.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <utility>

namespace kvr {

/// Limits on open bookings; 0: no limit.
struct BookingCaps {
  std::uint64_t max_bookings = 0;  ///< open bookings
  std::uint64_t max_blocks = 0;    ///< prompt blocks over all open bookings

  friend bool operator==(const BookingCaps&, const BookingCaps&) = default;
};

/// Which cap refused a route.
enum class BookingCapKind : std::uint8_t {
  node_bookings,
  node_blocks,
  partition_bookings,
  partition_blocks,
};

/// "node" or "partition".
constexpr std::string_view cap_scope(BookingCapKind kind) {
  return kind == BookingCapKind::node_bookings || kind == BookingCapKind::node_blocks ? "node"
                                                                                      : "partition";
}
/// "bookings" or "blocks".
constexpr std::string_view cap_resource(BookingCapKind kind) {
  return kind == BookingCapKind::node_bookings || kind == BookingCapKind::partition_bookings
             ? "bookings"
             : "blocks";
}

/// The open bookings of every selector of a node, and the node's caps. Shared by the selectors
/// (each on its own thread): relaxed atomics, read once per route and written once per booking
/// change. A cap checked before booking may be overshot by the bookings other selectors make at
/// the same moment (at most one each), never more.
struct NodeBookingTotals {
  explicit NodeBookingTotals(BookingCaps node_caps = {}) : caps(node_caps) {}

  const BookingCaps caps;
  std::atomic<std::uint64_t> bookings{0};
  std::atomic<std::uint64_t> blocks{0};
};

/// One selector's share of the node totals: updated to its current bookings by set(), and given
/// back when destroyed (a retired partition holds nothing). Movable, not copyable.
class NodeBookingShare {
 public:
  NodeBookingShare() = default;
  explicit NodeBookingShare(std::shared_ptr<NodeBookingTotals> totals)
      : totals_(std::move(totals)) {}
  NodeBookingShare(NodeBookingShare&& other) noexcept
      : totals_(std::move(other.totals_)), bookings_(other.bookings_), blocks_(other.blocks_) {
    other.bookings_ = 0;
    other.blocks_ = 0;
  }
  NodeBookingShare& operator=(NodeBookingShare&& other) noexcept {
    if (this != &other) {
      set(0, 0);
      totals_ = std::move(other.totals_);
      bookings_ = std::exchange(other.bookings_, 0);
      blocks_ = std::exchange(other.blocks_, 0);
    }
    return *this;
  }
  NodeBookingShare(const NodeBookingShare&) = delete;
  NodeBookingShare& operator=(const NodeBookingShare&) = delete;
  ~NodeBookingShare() { set(0, 0); }

  /// This selector now holds `bookings` bookings of `blocks` prompt blocks in all.
  void set(std::uint64_t bookings, std::uint64_t blocks) {
    if (!totals_) return;
    // Unsigned wrap-around adds the (possibly negative) change.
    if (bookings != bookings_) {
      totals_->bookings.fetch_add(bookings - bookings_, std::memory_order_relaxed);
      bookings_ = bookings;
    }
    if (blocks != blocks_) {
      totals_->blocks.fetch_add(blocks - blocks_, std::memory_order_relaxed);
      blocks_ = blocks;
    }
  }

  const NodeBookingTotals* totals() const { return totals_.get(); }

 private:
  std::shared_ptr<NodeBookingTotals> totals_;
  std::uint64_t bookings_ = 0;
  std::uint64_t blocks_ = 0;
};

/// Called when a cap refuses a route (for a metric); may be empty.
using BookingCapRefusalSink = std::function<void(BookingCapKind)>;

}  // namespace kvr
