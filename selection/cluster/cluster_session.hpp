// One router node's life in a cluster, one step at a time: announce itself in the members bucket,
// read the members and the partitions bucket, let its PartitionLeaseKeeper decide, run the KV calls
// the keeper asked for and feed their results back, and say what the node now owns, what it must
// warm up or drop, and who owns the rest. Plain C++ over two JetStreamKv buckets; every call blocks
// (bounded by the bucket's timeout), so the node's cluster actor runs it on a thread of its own.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "selection/cluster/cluster_values.hpp"
#include "selection/cluster/jetstream_kv.hpp"
#include "selection/cluster/partition_lease_keeper.hpp"

namespace kvr::cluster {

/// What one step found and decided.
struct ClusterStep {
  /// The partitions this node may serve now, with their epochs and fences.
  std::vector<OwnedPartition> owned;
  /// Partitions to warm up (selector, registrations, KV dumps) before taking them over, or kept
  /// warm while their handover is pending: each is named every step until the node owns it or
  /// gives it up (then it is in `drop`).
  std::vector<std::string> prepare;
  /// Partitions warmed up for nothing, or given up: their state can go.
  std::vector<std::string> drop;
  /// The owner of every leased partition this node does not own.
  std::map<std::string, PartitionOwner> elsewhere;
  /// The live members, this node included.
  std::vector<MemberRecord> members;
  /// KV calls that failed in this step (their effect is in `owned`: a failed renewal loses the
  /// partition), for the log and the renew-failure metric.
  std::vector<std::string> failures;
  /// Renewals that failed in this step.
  std::size_t renew_failures = 0;
  /// Leases this node handed over (or gave back) in this step.
  std::size_t released = 0;
};

/// One node's cluster membership.
class ClusterSession {
 public:
  /// `self` is this node's member record (its id, a fresh non-zero incarnation, its middleman
  /// address and capacity). The buckets must outlive the session; the partitions bucket's TTL is
  /// the leases' (options.ttl).
  ClusterSession(MemberRecord self, JetStreamKv& members, JetStreamKv& partitions,
                 PartitionLeaseOptions options);

  /// Called with the partitions a step is about to hand over, before their leases are written:
  /// it must return only once the node has stopped serving them (its selectors' fences may lie
  /// ahead of the keeper's decision), so that the successor never serves beside it.
  using StopServing = std::function<void(const std::vector<std::string>&)>;

  /// One step at `now` (read just before calling) over the partitions the node knows of.
  ClusterStep step(PartitionLeaseKeeper::Clock::time_point now,
                   const std::vector<std::string>& partitions,
                   const StopServing& stop_serving = {});

  /// The node finished warming `partition` up (again each step is harmless).
  void mark_prepared(const std::string& partition) {
    if (preparing_.contains(partition) && prepared_.insert(partition).second) {
      keeper_.mark_prepared(partition);
    }
  }

  /// Leaves the cluster: erases the member record and hands every lease back (their desired
  /// owners take them at their next step instead of after the TTL). Ownership ends at once.
  void leave();

  const PartitionLeaseKeeper& keeper() const { return keeper_; }
  const MemberRecord& self() const { return self_; }

 private:
  // Reads every lease and readiness record of the partitions bucket.
  std::expected<LeaseTable, KvError> read_table();
  std::expected<std::vector<MemberRecord>, KvError> read_members();
  void run(const LeaseAction& action, ClusterStep& result);

  MemberRecord self_;
  JetStreamKv* members_;
  JetStreamKv* partitions_;
  PartitionLeaseKeeper keeper_;
  // Asked to warm up and not owned yet; of those, the ones the node reported warm.
  std::set<std::string> preparing_;
  std::set<std::string> prepared_;
};

}  // namespace kvr::cluster
