// One router node's partition leases: which leases to take, renew, hand over or give up, given
// the live members, the known partitions and the lease table last read from the partitions
// bucket; and which partitions the node may serve right now (the fence). Plain C++ on an injected
// time: the caller reads the buckets, runs the KV calls the keeper asks for and feeds the results
// back. Used by the node's cluster actor and the keeper's tests.
//
// Safety (never two owners at once) rests on three rules:
//  - A lease is only written by compare-and-set (create, or update over the revision read), so
//    one revision chain exists per partition and the latest write wins.
//  - A node counts a partition as owned only while its last successful write of the lease was
//    *sent* less than renew_deadline ago, and renew_deadline < ttl: the server stamps a write
//    no earlier than it was sent, so a lease that ages out has lost its owner's belief first.
//  - Another node takes a lease over only when its key is gone (aged out, so the old owner's
//    belief has ended), when the old owner wrote it as handed over to that node, or when the old
//    owner released it. It never updates over a live-looking lease just because its owner is
//    missing from the members bucket: a member record and a lease age out separately, and an
//    owner whose announcement lapsed may still be renewing in time.
//
// Handover (a member joins, so a partition's desired owner changes): the desired owner warms the
// partition up (PreparePartition; the node reports mark_prepared()), then writes the readiness
// key (AnnounceReady, refreshed every renew interval). The current owner, seeing its desired
// successor ready, stops serving and writes the lease as handed over to it (ReleaseLease), and
// the successor takes it by compare-and-set over that revision (AcquireLease) at its next step.
// The gap without an owner is one step of the successor: at most one renew interval when nodes
// step at that rate.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "selection/cluster/cluster_values.hpp"
#include "selection/cluster/placement.hpp"

namespace kvr::cluster {

/// Timing of a node's leases; validate() states the rules.
struct PartitionLeaseOptions {
  /// The partitions bucket's TTL: a lease not renewed for this long ages out.
  std::chrono::milliseconds ttl{3000};
  /// A held lease is renewed once its last successful write is this old.
  std::chrono::milliseconds renew_interval{1000};
  /// A partition counts as owned only while its last successful write was sent less than this
  /// long ago. Must leave room below ttl for clock-rate differences and the call's transit.
  std::chrono::milliseconds renew_deadline{2000};
  /// Slack of the bounded-load placement (placement.hpp).
  double load_slack = kDefaultLoadSlack;
};

/// A description of what is wrong with `options` (0 < renew_interval < renew_deadline < ttl,
/// load_slack ≥ 0), or nullopt.
std::optional<std::string> validate(const PartitionLeaseOptions& options);

/// A partition's lease as read from the partitions bucket.
struct LeaseRecord {
  LeaseValue value;
  std::uint64_t revision = 0;  ///< the lease's epoch
};

/// What the node last read from the partitions bucket. A partition missing from `leases` has no
/// lease key (never taken, aged out or erased).
struct LeaseTable {
  std::map<std::string, LeaseRecord> leases;  ///< by partition key
  std::map<std::string, ReadyValue> ready;    ///< readiness records, by partition key
};

/// Take the partition's lease: create its key (no over_revision) or update it over
/// over_revision; write `value`. Report with on_acquired().
struct AcquireLease {
  std::string partition;
  std::optional<std::uint64_t> over_revision;
  LeaseValue value;
};

/// Renew a held lease: update over `revision` with `value`. Report with on_renewed().
struct RenewLease {
  std::string partition;
  std::uint64_t revision = 0;
  LeaseValue value;
};

/// Give up a lease: update over `revision` with `value` (handed over to the successor, or with
/// no owner on shutdown). The node has already stopped serving the partition. Report with
/// on_released().
struct ReleaseLease {
  std::string partition;
  std::uint64_t revision = 0;
  LeaseValue value;
};

/// Start warming the partition up (selector, subscriptions, registrations and KV dumps) without
/// serving it, then call mark_prepared().
struct PreparePartition {
  std::string partition;
};

/// Put the partition's readiness key with `value` (not conditional).
struct AnnounceReady {
  std::string partition;
  ReadyValue value;
};

/// Erase the partition's readiness key: this node took the lease or is no longer its desired
/// owner.
struct WithdrawReady {
  std::string partition;
};

/// Drop the partition's warm state: this node prepared it but will not own it after all.
struct AbandonPartition {
  std::string partition;
};

/// One thing the node must do; KV calls in the order given.
using LeaseAction = std::variant<AcquireLease, RenewLease, ReleaseLease, PreparePartition,
                                 AnnounceReady, WithdrawReady, AbandonPartition>;

/// The lease decisions of one node. Not thread-safe: one owner (the node's cluster actor).
class PartitionLeaseKeeper {
 public:
  using Clock = std::chrono::steady_clock;

  /// `self` is this process: its member record's node id and incarnation. `options` must
  /// validate.
  PartitionLeaseKeeper(std::string node_id, std::uint64_t incarnation,
                       PartitionLeaseOptions options);

  /// Decides the next actions from the members and lease table just read and the partitions
  /// the node knows of (the lease table's partitions count too). `now` must be no later than
  /// the moment the returned KV calls are sent: ownership is timed from it. At most one KV call
  /// per partition is outstanding: a partition with a call in flight is left alone until its
  /// result is reported.
  std::vector<LeaseAction> step(Clock::time_point now, std::span<const MemberRecord> members,
                                std::span<const std::string> partitions, const LeaseTable& table);

  /// The result of an AcquireLease: the new revision, or nullopt when the call failed.
  void on_acquired(const std::string& partition, std::optional<std::uint64_t> revision);
  /// The result of a RenewLease; a failure (wrong revision, timeout, anything) loses the
  /// partition at once.
  void on_renewed(const std::string& partition, std::optional<std::uint64_t> revision);
  /// The result of a ReleaseLease (the partition stopped being owned when it was asked for).
  void on_released(const std::string& partition);
  /// The node finished warming `partition` up (after a PreparePartition).
  void mark_prepared(const std::string& partition);

  /// Gives every held lease up (shutdown): releases with no owner, so the desired owners take
  /// them at once instead of after the TTL; readiness is withdrawn. Ownership ends now.
  std::vector<LeaseAction> release_all();

  /// The partitions this node may serve at `now`, by partition key.
  std::vector<OwnedPartition> owned(Clock::time_point now) const;
  /// The partition's epoch when owned at `now`.
  std::optional<std::uint64_t> epoch_of(const std::string& partition, Clock::time_point now) const;
  /// When the first owned partition stops being owned unless renewed: a time to step again at
  /// the latest.
  std::optional<Clock::time_point> next_fence() const;

  const std::string& node_id() const { return node_id_; }
  std::uint64_t incarnation() const { return incarnation_; }

 private:
  struct Held {
    std::uint64_t revision = 0;
    Clock::time_point written_at;  ///< when the last successful write was sent
  };
  enum class CallKind : std::uint8_t { acquire, renew, release };
  struct Pending {
    CallKind kind = CallKind::acquire;
    Clock::time_point sent_at;
  };
  // A partition this node is the desired owner of but does not hold yet.
  struct Incoming {
    bool prepare_asked = false;
    bool prepared = false;
    std::optional<Clock::time_point> announced_at;
  };

  bool is_self(const std::string& node_id, std::uint64_t incarnation) const;
  bool holds(const std::string& partition, Clock::time_point now) const;
  LeaseValue own_value() const;
  void decide_held(const std::string& partition, const LeaseRecord* lease,
                   const std::optional<std::string>& desired, Clock::time_point now,
                   std::span<const MemberRecord> members, const LeaseTable& table,
                   std::vector<LeaseAction>& actions);
  void decide_free(const std::string& partition, const LeaseRecord* lease, bool desired_here,
                   Clock::time_point now, std::vector<LeaseAction>& actions);

  std::string node_id_;
  std::uint64_t incarnation_;
  PartitionLeaseOptions options_;
  std::map<std::string, Held> held_;
  std::map<std::string, Pending> pending_;
  std::map<std::string, Incoming> incoming_;
};

}  // namespace kvr::cluster
