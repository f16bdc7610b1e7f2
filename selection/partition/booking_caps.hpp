// Caps on what open bookings (route-mode bookings and generate requests in flight) may hold, so
// that clients that route and never report cannot grow a node's memory without bound: each booking
// keeps its prompt's block hashes until it ends (docs/protocol.md gives the bytes per block).
// A partition's selector counts its own bookings; the node's selectors share one NodeBookingTotals
// (atomics), so a node-wide cap holds across partitions, and one ClientBookingTotals, so that one
// client that never reports reaches its own cap long before the node's and cannot starve the
// others. Plain C++; the selector state checks the caps before selection and updates the totals
// when its bookings change.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <absl/container/flat_hash_map.h>
#include <absl/strings/string_view.h>

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
  client_bookings,
  client_blocks,
};
inline constexpr std::size_t kBookingCapKinds = 6;

/// "node", "partition" or "client".
constexpr std::string_view cap_scope(BookingCapKind kind) {
  switch (kind) {
    case BookingCapKind::node_bookings:
    case BookingCapKind::node_blocks:
      return "node";
    case BookingCapKind::partition_bookings:
    case BookingCapKind::partition_blocks:
      return "partition";
    case BookingCapKind::client_bookings:
    case BookingCapKind::client_blocks:
      return "client";
  }
  return "node";
}
/// "bookings" or "blocks".
constexpr std::string_view cap_resource(BookingCapKind kind) {
  return kind == BookingCapKind::node_bookings || kind == BookingCapKind::partition_bookings ||
                 kind == BookingCapKind::client_bookings
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

// Abseil's own string_view (not std's in this build) looks up std::string keys without a copy.
inline absl::string_view client_key(std::string_view client) {
  return {client.data(), client.size()};
}

/// What one client holds in open bookings.
struct ClientHeld {
  std::uint64_t bookings = 0;
  std::uint64_t blocks = 0;
};

/// The open bookings of each client over every selector of a node, and the per-client caps. A
/// client is the scope its request ids are kept in (selection/partition/route_request.hpp): a NATS
/// connection's inbox, a remote actor. An entry lives while its client holds a booking, so the
/// map is bounded by the node's open bookings. Shared by the selectors: one short lock per booking
/// made or ended. As with the node's caps, concurrent selectors may overshoot by one each.
class ClientBookingTotals {
 public:
  explicit ClientBookingTotals(BookingCaps per_client) : caps(per_client) {}

  const BookingCaps caps;

  ClientHeld held(std::string_view client) const {
    std::lock_guard lock{mutex_};
    const auto it = held_.find(client_key(client));
    return it == held_.end() ? ClientHeld{} : it->second;
  }
  /// The client opened `bookings` bookings of `blocks` prompt blocks in all.
  void add(std::string_view client, std::uint64_t bookings, std::uint64_t blocks) {
    std::lock_guard lock{mutex_};
    ClientHeld& held = held_[client_key(client)];
    held.bookings += bookings;
    held.blocks += blocks;
  }
  /// The client's bookings ended (never more than it added).
  void remove(std::string_view client, std::uint64_t bookings, std::uint64_t blocks) {
    std::lock_guard lock{mutex_};
    const auto it = held_.find(client_key(client));
    if (it == held_.end()) return;
    it->second.bookings -= std::min(bookings, it->second.bookings);
    it->second.blocks -= std::min(blocks, it->second.blocks);
    if (it->second.bookings == 0) held_.erase(it);
  }
  /// Clients holding a booking now.
  std::size_t clients() const {
    std::lock_guard lock{mutex_};
    return held_.size();
  }

 private:
  mutable std::mutex mutex_;
  absl::flat_hash_map<std::string, ClientHeld> held_;
};

/// One selector's share of the per-client totals: what each client holds in this partition, given
/// back when the selector goes (a retired partition holds nothing). Lives at a stable address
/// (the selector's booking ledger reports ended bookings to it).
class ClientBookingShare {
 public:
  explicit ClientBookingShare(std::shared_ptr<ClientBookingTotals> totals)
      : totals_(std::move(totals)) {}
  ClientBookingShare(const ClientBookingShare&) = delete;
  ClientBookingShare& operator=(const ClientBookingShare&) = delete;
  ~ClientBookingShare() {
    if (!totals_) return;
    for (const auto& [client, held] : held_) totals_->remove(client, held.bookings, held.blocks);
  }

  void add(std::string_view client, std::uint64_t blocks) {
    if (!totals_) return;
    ClientHeld& held = held_[client_key(client)];
    ++held.bookings;
    held.blocks += blocks;
    totals_->add(client, 1, blocks);
  }
  void remove(std::string_view client, std::uint64_t blocks) {
    if (!totals_) return;
    const auto it = held_.find(client_key(client));
    if (it == held_.end()) return;
    it->second.bookings -= std::min<std::uint64_t>(1, it->second.bookings);
    it->second.blocks -= std::min(blocks, it->second.blocks);
    if (it->second.bookings == 0) held_.erase(it);
    totals_->remove(client, 1, blocks);
  }

  const ClientBookingTotals* totals() const { return totals_.get(); }

 private:
  std::shared_ptr<ClientBookingTotals> totals_;
  absl::flat_hash_map<std::string, ClientHeld> held_;
};

/// Called when a cap refuses a route (for a metric); may be empty.
using BookingCapRefusalSink = std::function<void(BookingCapKind)>;

}  // namespace kvr
