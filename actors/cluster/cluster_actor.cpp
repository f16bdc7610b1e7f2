#include "actors/cluster/cluster_actor.hpp"

#include <vector>

#include <caf/scoped_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/metrics/node_metrics.hpp"

namespace kvr::actors {
namespace {

using Self = cluster_actor::stateful_pointer<ClusterActorState>;

void step(Self self) {
  auto& state = self->state;
  cluster::ClusterSession& session = *state.config.link->session;
  const std::vector<std::string> partitions(state.partitions.begin(), state.partitions.end());
  // Before a lease is handed over, its selector stops: its fence may lie up to the renew
  // deadline ahead, and the successor may take the lease at its next step.
  const auto stop_serving = [self](const std::vector<std::string>& releasing) {
    caf::scoped_actor blocking{self->system()};
    blocking
        ->request(self->state.discovery, std::chrono::seconds(2), handover_atom::value, releasing)
        .receive([](bool) {},
                 [&](caf::error& error) {
                   spdlog::warn(
                       "kvr node: cluster: the discovery actor did not stop {} partitions: {}",
                       releasing.size(), self->system().render(error));
                 });
  };
  cluster::ClusterStep result =
      session.step(std::chrono::steady_clock::now(), partitions, stop_serving);
  metrics::NodeMetrics metrics{*state.config.metrics};
  for (const std::string& failure : result.failures) {
    spdlog::warn("kvr node: cluster: {}", failure);
  }
  if (result.released > 0) metrics.cluster_handovers().add(static_cast<double>(result.released));
  if (result.renew_failures > 0) {
    metrics.cluster_renew_failures().add(static_cast<double>(result.renew_failures));
  }
  std::set<std::string> owned;
  for (const auto& partition : result.owned) owned.insert(partition.partition);
  if (owned != state.owned) {
    spdlog::info("kvr node: cluster: owns {} of {} partitions ({} members)", owned.size(),
                 partitions.size(), result.members.size());
    for (const std::string& partition : state.owned) {
      if (!owned.contains(partition)) metrics.cluster_partition_owned(partition).set(0);
    }
    for (const std::string& partition : owned) metrics.cluster_partition_owned(partition).set(1);
    state.owned = std::move(owned);
  }
  metrics.cluster_owned_partitions().set(static_cast<double>(result.owned.size()));
  metrics.cluster_members().set(static_cast<double>(result.members.size()));
  ClusterView view{std::move(result.owned), std::move(result.prepare), std::move(result.drop),
                   std::move(result.elsewhere), std::move(result.members)};
  self->send(state.forwarder, ownership_atom::value, view);
  self->send(state.discovery, ownership_atom::value, std::move(view));
}

}  // namespace

cluster_actor::behavior_type cluster_behavior(Self self, ClusterActorConfig config) {
  self->state.config = std::move(config);
  self->set_exit_handler([self](caf::exit_msg& message) {
    if (self->state.config.link->session) self->state.config.link->session->leave();
    self->quit(message.reason);
  });
  return {
      [self](targets_atom, discovery_actor& discovery, forwarder_actor& forwarder,
             std::string& address) {
        auto& state = self->state;
        ClusterLink& link = *state.config.link;
        if (link.session) return;
        state.discovery = std::move(discovery);
        state.forwarder = std::move(forwarder);
        link.self.address = std::move(address);
        link.session = std::make_unique<cluster::ClusterSession>(link.self, *link.members,
                                                                 *link.partitions, link.leases);
        spdlog::info("kvr node: cluster: joined as {} at {}", link.self.node_id, link.self.address);
        self->send(self, step_atom::value);
      },
      [self](partition_atom, std::string& partition) {
        // A new partition is placed at the next step, within one interval.
        self->state.partitions.insert(std::move(partition));
      },
      [self](ready_atom, const std::string& partition) {
        if (self->state.config.link->session) {
          self->state.config.link->session->mark_prepared(partition);
        }
      },
      [self](step_atom) {
        step(self);
        // Four steps per renew interval: a lease is renewed soon after it is due, well before
        // its fence (renew deadline) ends it.
        self->delayed_send(self, self->state.config.link->leases.renew_interval / 4,
                           step_atom::value);
      },
  };
}

}  // namespace kvr::actors
