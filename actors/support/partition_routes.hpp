// Where an actor sends a partition's route requests and booking updates: straight to the
// partition's selector once the discovery actor has announced it, else to the discovery actor,
// which delegates or answers that the partition has no workers. Shared by the reservation and the
// lifecycle actors, so that both take one hop to a known partition.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>

#include "actors/actor_types.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::actors {

/// A partition → selector map fed by the discovery actor's announcements (selector_atom).
class PartitionRoutes {
 public:
  PartitionRoutes() = default;
  explicit PartitionRoutes(route_target_actor discovery) : discovery_(std::move(discovery)) {}

  const route_target_actor& discovery() const { return discovery_; }

  /// Records a selector the discovery actor announced; an invalid handle: the partition's selector
  /// was retired (cluster mode), so its requests go to the discovery actor again.
  void learn(std::string model, std::string routing_group, const selector_actor& selector) {
    if (!selector) {
      selectors_.erase(std::pair{std::move(model), std::move(routing_group)});
      return;
    }
    selectors_[std::pair{std::move(model), std::move(routing_group)}] = selector;
  }

  /// Tells the partition's selector that the caller gave up on a route request it sent, so that
  /// a request still waiting in the partition's queue is never booked.
  template <class Self>
  void cancel_route(Self* self, const plugins::worker_selection::RoutingPartition& partition,
                    const std::string& request_id) const {
    self->send(selector_for(partition), cancel_atom::value, partition.model,
               partition.routing_group, request_id);
  }

  /// The partition's selector, or the discovery actor while it is not announced (yet).
  const route_target_actor& selector_for(
      const plugins::worker_selection::RoutingPartition& partition) const {
    const auto it = selectors_.find(
        std::pair<std::string_view, std::string_view>{partition.model, partition.routing_group});
    return it == selectors_.end() ? discovery_ : it->second;
  }

 private:
  // Hashes and compares (model, routing group) keys, owned or viewed, so that looking up a
  // request's partition copies no string.
  struct KeyHash {
    using is_transparent = void;
    std::size_t operator()(std::pair<std::string_view, std::string_view> key) const {
      return absl::HashOf(key.first, key.second);
    }
  };
  struct KeyEq {
    using is_transparent = void;
    bool operator()(std::pair<std::string_view, std::string_view> a,
                    std::pair<std::string_view, std::string_view> b) const {
      return a == b;
    }
  };

  route_target_actor discovery_;
  // Each selector's handle, as the route target it is to the actors that hold these routes.
  absl::flat_hash_map<std::pair<std::string, std::string>, route_target_actor, KeyHash, KeyEq>
      selectors_;
};

}  // namespace kvr::actors
