#include "actors/cluster/forwarder_actor.hpp"

#include <charconv>

#include <caf/io/middleman.hpp>
#include <caf/io/middleman_actor.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/metrics/node_metrics.hpp"
#include "messages/subjects.hpp"
#include "selection/cluster/placement.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/lifecycle/request_lifecycle.hpp"
#include "selection/partition/shard_request.hpp"
#include "selection/wire/generate_messages.hpp"
#include "selection/wire/route_messages.hpp"

namespace kvr::actors {
namespace {

using Self = forwarder_actor::stateful_pointer<ForwarderActorState>;
using Clock = std::chrono::steady_clock;

metrics::NodeMetrics node_metrics(Self self) {
  return metrics::NodeMetrics{*self->state.config.metrics};
}

void publish(Self self, const std::string& subject, const std::string& bytes) {
  if (!subject.empty()) self->state.config.publisher->publish(subject, bytes);
}

std::string partition_of(const RouteRequest& request) {
  return cluster::partition_key(request.partition.model, request.partition.routing_group);
}

// Runs `use` with the ingress actor of the peer the table forwards to, connecting first when
// needed; an invalid handle when the peer cannot be reached.
void with_peer(Self self, const cluster::ForwardDecision& target,
               std::function<void(const ingress_actor&)> use) {
  auto& state = self->state;
  const std::string& node_id = target.node_id;
  auto& peer = state.peers[node_id];
  if (target.address && *target.address != peer.address) {
    peer.address = *target.address;  // restarted elsewhere: connect again
    peer.ingress = nullptr;
  }
  if (peer.ingress) return use(peer.ingress);
  peer.waiting.push_back(std::move(use));
  if (peer.connecting) return;
  const auto colon = peer.address.rfind(':');
  std::uint16_t port = 0;
  if (colon == std::string::npos || std::from_chars(peer.address.data() + colon + 1,
                                                    peer.address.data() + peer.address.size(), port)
                                            .ec != std::errc{}) {
    spdlog::warn("kvr node: cluster: member {} has no usable address '{}'", node_id, peer.address);
    auto waiting = std::move(peer.waiting);
    for (auto& callback : waiting) callback(ingress_actor{});
    return;
  }
  peer.connecting = true;
  const std::string host = peer.address.substr(0, colon);
  // Through CAF's OpenSSL module when the node loaded it: peers then accept only TLS.
  auto& system = self->system();
  const caf::io::middleman_actor connector = system.has_openssl_manager()
                                                 ? system.openssl_manager().actor_handle()
                                                 : system.middleman().actor_handle();
  self->request(connector, state.config.connect_timeout, caf::connect_atom::value, host, port)
      .then(
          [self, node_id](const caf::node_id&, caf::strong_actor_ptr& handle,
                          const std::set<std::string>&) {
            auto& connected = self->state.peers[node_id];
            connected.connecting = false;
            connected.ingress = caf::actor_cast<ingress_actor>(std::move(handle));
            if (connected.ingress) self->monitor(connected.ingress);
            auto waiting = std::move(connected.waiting);
            for (auto& callback : waiting) callback(connected.ingress);
          },
          [self, node_id](caf::error& error) {
            auto& failed = self->state.peers[node_id];
            failed.connecting = false;
            spdlog::warn("kvr node: cluster: cannot reach member {} at {}: {}", node_id,
                         failed.address, self->system().render(error));
            auto waiting = std::move(failed.waiting);
            for (auto& callback : waiting) callback(ingress_actor{});
          });
}

// ---- route ----------------------------------------------------------------------------------

// Answers a route request: on its NATS reply subject, and to the actor client that asked.
void answer_route(Self self, RouteJob& job, const v1::RouteDecision& decision) {
  publish(self, job.envelope.reply_subject, decision.SerializeAsString());
  job.promise.deliver(RouteDecisionMessage{decision});
}

void dispatch_route(Self self, RouteJob job, int waits);

// Serves a route request with this node's actors. Its answer comes back here rather than going
// to the client directly, so that a request the partition's changing hands refused is routed
// again at a later view.
void route_locally(Self self, RouteJob job, int waits) {
  const auto& config = self->state.config;
  auto keep = std::make_shared<RouteJob>(std::move(job));
  RouteEnvelope local = keep->envelope;
  local.reply_subject.clear();
  const auto answer = [self, keep, waits](RouteDecisionMessage& decision) {
    if (cluster::ForwardTable::may_await_view(waits) && decision.value.has_error() &&
        decision.value.error().code() == v1::ROUTE_ERROR_UNAVAILABLE) {
      self->state.awaiting_view.emplace_back(std::move(*keep), waits + 1);
      return;
    }
    answer_route(self, *keep, decision.value);
  };
  const auto failed = [self, keep](caf::error& error) {
    node_metrics(self).route_errors(Error::unavailable).add();
    answer_route(self, *keep,
                 encode_route_error(
                     keep->envelope.request.client_id(), Error::unavailable,
                     fmt::format("this node did not answer: {}", self->system().render(error))));
  };
  self->request(config.local.route, config.forward_timeout, route_atom::value, std::move(local))
      .then(answer, failed);
}

void forward_route(Self self, RouteJob job, const cluster::ForwardDecision& target, int waits);

ForwarderActorState::ShardedModel& sharded_model(Self self, const std::string& model,
                                                 const std::string& group, std::uint32_t shards) {
  auto& state = self->state;
  auto it = state.sharded.find({model, group});
  if (it == state.sharded.end() || it->second.map.shards() != shards) {
    it = state.sharded.insert_or_assign({model, group}, ForwarderActorState::ShardedModel{shards})
             .first;
  }
  return it->second;
}

// A request of a sharded model gets its shard, which names its partition ("<group>#<shard>"); a
// request whose group names a shard already (forwarded by another node, or a client's choice)
// keeps it.
void choose_shard(Self self, RouteRequest& request) {
  auto& state = self->state;
  const auto config = state.config.sharding.find(request.partition.model);
  if (config == state.config.sharding.end() || config->second.shards <= 1) return;
  std::string& group = request.partition.routing_group;
  if (cluster::split_shard_group(group).shard) return;
  auto& model = sharded_model(self, request.partition.model, group, config->second.shards);
  cluster::ShardRequest view = shard_request_of(request, model.block_size);
  view.block_hashes = shard_key_hashes(request, model.block_size, config->second.prefix_tokens,
                                       state.shard_key_scratch);
  const cluster::ShardChoice choice = model.balancer.choose(model.map, config->second, view);
  auto& series = choice.spilled() ? model.spilled[choice.shard] : model.home[choice.shard];
  if (!series) {
    series = node_metrics(self).shard_routes(cluster::partition_key(request.partition.model, group),
                                             choice.shard, choice.spilled() ? "spilled" : "home");
  }
  series->add();
  group = cluster::shard_group(group, choice.shard);
}

// Serves a route request here, forwards it to its partition's owner, or holds it for the next
// view, as the table says.
void dispatch_route(Self self, RouteJob job, int waits) {
  auto target = self->state.table.route(partition_of(job.envelope.request), waits);
  switch (target.action) {
    case cluster::ForwardDecision::Action::forward:
      return forward_route(self, std::move(job), target, waits);
    case cluster::ForwardDecision::Action::await_view:
      self->state.awaiting_view.emplace_back(std::move(job), waits + 1);
      return;
    case cluster::ForwardDecision::Action::serve_here:
      return route_locally(self, std::move(job), waits);
  }
}

void forward_route(Self self, RouteJob job, const cluster::ForwardDecision& target, int waits) {
  auto shared = std::make_shared<RouteJob>(std::move(job));
  const std::string& owner = target.node_id;
  with_peer(self, target, [self, shared, owner, waits](const ingress_actor& ingress) {
    const auto lost = [self, shared, owner](const std::string& why) {
      node_metrics(self).cluster_forwards("route", "owner_lost").add();
      node_metrics(self).route_errors(Error::owner_lost).add();
      answer_route(
          self, *shared,
          encode_route_error(
              shared->envelope.request.client_id(), Error::owner_lost,
              fmt::format("the partition's owner, node {}, did not answer: {}", owner, why)));
    };
    if (!ingress) {
      // Never sent: safe to try again at a later view (a connection that failed to come up).
      if (cluster::ForwardTable::may_await_view(waits)) {
        self->state.awaiting_view.emplace_back(std::move(*shared), waits + 1);
        return;
      }
      return lost("it cannot be reached");
    }
    const auto started = Clock::now();
    self->request(ingress, self->state.config.forward_timeout, route_atom::value,
                  RouteRequestMessage{encode_route_request(shared->envelope.request)},
                  std::string{request_scope(shared->envelope.request)})
        .then(
            [self, shared, started, waits](RouteDecisionMessage& decision) {
              // Not (or no longer) its partition: a later view names the new owner.
              if (cluster::ForwardTable::may_await_view(waits) && decision.value.has_error() &&
                  decision.value.error().code() == v1::ROUTE_ERROR_UNAVAILABLE) {
                self->state.awaiting_view.emplace_back(std::move(*shared), waits + 1);
                return;
              }
              const std::chrono::duration<double> took = Clock::now() - started;
              node_metrics(self).cluster_forward_latency().observe(took.count());
              node_metrics(self).cluster_forwards("route", "answered").add();
              answer_route(self, *shared, decision.value);
            },
            [self, lost](caf::error& error) { lost(self->system().render(error)); });
  });
}

// ---- report ---------------------------------------------------------------------------------

v1::LifecycleReport encode_report(const LifecycleReportData& report) {
  v1::LifecycleReport wire;
  wire.set_booking_id(report.booking_id);
  switch (report.event) {
    case LifecycleEventKind::FirstToken:
      wire.set_event(v1::LIFECYCLE_EVENT_FIRST_TOKEN);
      break;
    case LifecycleEventKind::Completed:
      wire.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
      break;
    case LifecycleEventKind::Aborted:
      wire.set_event(v1::LIFECYCLE_EVENT_ABORTED);
      break;
  }
  wire.set_error(report.error);
  wire.set_abort_cause(to_wire(report.abort_cause));
  return wire;
}

// Answers a report: on its NATS reply subject, and to the actor client that sent it.
void answer_report(Self self, ReportJob& job, const v1::LifecycleAck& ack) {
  publish(self, job.envelope.reply_subject, ack.SerializeAsString());
  job.promise.deliver(LifecycleAckMessage{ack});
}

void forward_report(Self self, ReportJob job, const cluster::ForwardDecision& target);

// Serves a report here (this node's reservation actor), forwards it to the node whose lease it
// names, or holds it for the next view, as the table says.
void dispatch_report(Self self, ReportJob job, int waits) {
  const auto target = self->state.table.report(job.envelope.report.booking_id, waits);
  switch (target.action) {
    case cluster::ForwardDecision::Action::forward:
      return forward_report(self, std::move(job), target);
    case cluster::ForwardDecision::Action::await_view:
      self->state.awaiting_reports.emplace_back(std::move(job), waits + 1);
      return;
    case cluster::ForwardDecision::Action::serve_here:
      job.promise.delegate(self->state.config.local.report, report_atom::value,
                           std::move(job.envelope));
      return;
  }
}

void forward_report(Self self, ReportJob job, const cluster::ForwardDecision& target) {
  auto shared = std::make_shared<ReportJob>(std::move(job));
  const std::string& owner = target.node_id;
  with_peer(self, target, [self, shared, owner](const ingress_actor& ingress) {
    const auto lost = [self, shared, owner](const std::string& why) {
      node_metrics(self).cluster_forwards("report", "owner_lost").add();
      answer_report(self, *shared,
                    encode_lifecycle_ack(false, fmt::format("owner_lost: the lease's node, {}, "
                                                            "did not answer: {}",
                                                            owner, why)));
    };
    if (!ingress) return lost("it cannot be reached");
    self->request(ingress, self->state.config.forward_timeout, report_atom::value,
                  LifecycleReportMessage{encode_report(shared->envelope.report)})
        .then(
            [self, shared](LifecycleAckMessage& ack) {
              node_metrics(self).cluster_forwards("report", "answered").add();
              answer_report(self, *shared, ack.value);
            },
            [self, lost](caf::error& error) { lost(self->system().render(error)); });
  });
}

// ---- generate -------------------------------------------------------------------------------

// An actor client gets its decision and stream from this node's stages directly.
void generate_locally(Self self, GenerateJob job) {
  job.promise.delegate(self->state.config.local.generate, generate_atom::value,
                       std::move(job.envelope));
}

// Sends a forwarded stream's chunk to its client: its actor, or its NATS stream subject.
void relay_chunk(Self self, const ForwarderActorState::ForwardedStream& stream,
                 const v1::GenerateChunk& chunk) {
  if (stream.job.envelope.stream_actor) {
    self->send(caf::actor_cast<stream_client_actor>(stream.job.envelope.stream_actor),
               chunk_atom::value, GenerateChunkMessage{chunk});
    return;
  }
  publish(self, stream.job.envelope.request.stream_subject, chunk.SerializeAsString());
}

void answer_generate(Self self, GenerateJob& job, const v1::RouteDecision& decision) {
  publish(self, job.envelope.reply_subject, decision.SerializeAsString());
  job.promise.deliver(RouteDecisionMessage{decision});
}

// Ends a forwarded stream whose owner went away: its decision (when none was given yet) and a
// final error chunk.
void end_stream(Self self, const std::string& request_id, const std::string& why) {
  auto node = self->state.streams.extract(request_id);
  if (node.empty()) return;
  ForwarderActorState::ForwardedStream& stream = node.mapped();
  node_metrics(self).cluster_forwards("generate", "owner_lost").add();
  node_metrics(self).route_errors(Error::owner_lost).add();
  const std::string message =
      fmt::format("the partition's owner, node {}, went away: {}", stream.owner, why);
  if (!stream.decided) {
    answer_generate(self, stream.job, encode_route_error(request_id, Error::owner_lost, message));
  }
  relay_chunk(self, stream,
              encode_end_chunk(request_id, 0, StreamEnd{"error", Error::owner_lost, message},
                               std::nullopt));
}

void route_generate(Self self, GenerateJob job, bool retried);

void forward_generate(Self self, GenerateJob job, const cluster::ForwardDecision& target,
                      bool retried) {
  const std::string request_id = job.envelope.request.route.id();
  auto& streams = self->state.streams;
  streams.insert_or_assign(request_id, ForwarderActorState::ForwardedStream{
                                           std::move(job), target.node_id, false, false, retried});
  with_peer(self, target, [self, request_id](const ingress_actor& ingress) {
    auto stream = self->state.streams.find(request_id);
    if (stream == self->state.streams.end()) return;  // cancelled meanwhile
    // Before any chunk, a lost owner gets the request once more, on the current view's owner.
    const auto lost = [self, request_id](const std::string& why) {
      auto it = self->state.streams.find(request_id);
      if (it == self->state.streams.end()) return;
      if (!it->second.first_chunk_seen && !it->second.decided && !it->second.retried) {
        GenerateJob again = std::move(it->second.job);
        self->state.streams.erase(it);
        node_metrics(self).generate_retries().add();
        return route_generate(self, std::move(again), true);
      }
      end_stream(self, request_id, why);
    };
    if (!ingress) return lost("it cannot be reached");
    self->request(ingress, self->state.config.forward_timeout, generate_atom::value,
                  GenerateRequestMessage{stream->second.job.envelope.request.wire})
        .then(
            [self, request_id](RouteDecisionMessage& decision) {
              auto it = self->state.streams.find(request_id);
              if (it == self->state.streams.end()) return;
              node_metrics(self).cluster_forwards("generate", "answered").add();
              it->second.decided = true;
              answer_generate(self, it->second.job, decision.value);
              // An error decision ends the stream there: its final chunk follows from the owner.
            },
            [self, lost](caf::error& error) { lost(self->system().render(error)); });
  });
}

void route_generate(Self self, GenerateJob job, bool retried) {
  const auto target = self->state.table.generate(partition_of(job.envelope.request.route));
  if (target.action != cluster::ForwardDecision::Action::forward) {
    return generate_locally(self, std::move(job));
  }
  forward_generate(self, std::move(job), target, retried);
}

void update_view(Self self, const ClusterView& view) {
  auto& state = self->state;
  state.table.apply(view.owned, view.elsewhere, view.members);
  // The owner serves its partitions' own subjects: a client that knows the model skips the hop.
  if (state.config.bridge) {
    for (auto it = state.served_subjects.begin(); it != state.served_subjects.end();) {
      if (state.table.owns(it->first)) {
        ++it;
        continue;
      }
      state.config.bridge->stop_route_subject(it->second);
      it = state.served_subjects.erase(it);
    }
    for (const std::string& partition : state.table.owned()) {
      if (state.served_subjects.contains(partition)) continue;
      std::string subject = subjects::router_partition_route(state.config.ns, partition);
      if (auto served = state.config.bridge->serve_route_subject(subject); !served) {
        spdlog::warn("kvr node: cluster: cannot serve {}: {}", subject, served.error());
        continue;
      }
      state.served_subjects.emplace(partition, std::move(subject));
    }
  }
}

}  // namespace

forwarder_actor::behavior_type forwarder_behavior(Self self, ForwarderActorConfig config) {
  self->state.config = std::move(config);
  self->state.table =
      cluster::ForwardTable{self->state.config.node_id, self->state.config.booking_id_prefix};
  // A peer whose connection dropped: its streams in flight end (or are retried before their
  // first chunk), and the next forward connects again.
  self->set_down_handler([self](caf::down_msg& message) {
    auto& state = self->state;
    for (auto& [node_id, peer] : state.peers) {
      if (!peer.ingress || peer.ingress.address() != message.source) continue;
      peer.ingress = nullptr;
      std::vector<std::string> lost;
      for (const auto& [request_id, stream] : state.streams) {
        if (stream.owner == node_id) lost.push_back(request_id);
      }
      for (const std::string& request_id : lost) {
        auto it = state.streams.find(request_id);
        if (it == state.streams.end()) continue;
        if (!it->second.first_chunk_seen && !it->second.decided && !it->second.retried) {
          GenerateJob again = std::move(it->second.job);
          state.streams.erase(it);
          route_generate(self, std::move(again), true);
        } else {
          end_stream(self, request_id, self->system().render(message.reason));
        }
      }
    }
  });
  return {
      // From NATS (no sender to answer: the envelope's subjects are) or from this node's
      // ingress for an actor client (answered to it).
      [self](route_atom, RouteEnvelope& envelope) -> caf::result<RouteDecisionMessage> {
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        choose_shard(self, envelope.request);
        dispatch_route(self, RouteJob{std::move(envelope), promise}, 0);
        return promise;
      },
      [self](report_atom, ReportEnvelope& envelope) -> caf::result<LifecycleAckMessage> {
        auto promise = self->make_response_promise<LifecycleAckMessage>();
        dispatch_report(self, ReportJob{std::move(envelope), promise}, 0);
        return promise;
      },
      [self](generate_atom, GenerateEnvelope& envelope) -> caf::result<RouteDecisionMessage> {
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        choose_shard(self, envelope.request.route);
        route_generate(self, GenerateJob{std::move(envelope), promise}, false);
        return promise;
      },
      [self](cancel_atom, std::string& request_id) {
        auto& state = self->state;
        const auto stream = state.streams.find(request_id);
        if (stream == state.streams.end()) {
          if (state.config.local.generate) {
            caf::anon_send(state.config.local.generate, cancel_atom::value, std::move(request_id));
          }
          return;
        }
        const auto peer = state.peers.find(stream->second.owner);
        if (peer != state.peers.end() && peer->second.ingress) {
          v1::GenerateCancel cancel;
          cancel.set_request_id(request_id);
          self->send(peer->second.ingress, cancel_atom::value, GenerateCancelMessage{cancel});
        }
      },
      [self](chunk_atom, GenerateChunkMessage& chunk) {
        auto& state = self->state;
        const auto stream = state.streams.find(chunk.value.request_id());
        if (stream == state.streams.end()) return;
        stream->second.first_chunk_seen = true;
        relay_chunk(self, stream->second, chunk.value);
        if (chunk.value.finished()) state.streams.erase(stream);
      },
      [self](shard_atom, ShardFleet& fleet) {
        const auto sharding = self->state.config.sharding.find(fleet.model);
        if (sharding == self->state.config.sharding.end()) return;
        auto& model =
            sharded_model(self, fleet.model, fleet.routing_group, sharding->second.shards);
        (void)model.map.assign(fleet.workers);
        model.block_size = fleet.block_size;
      },
      [self](shard_load_atom, ShardLoadData& load) {
        const auto sharding = self->state.config.sharding.find(load.model);
        // A node configured with another shard count: its loads describe other shards.
        if (sharding == self->state.config.sharding.end() ||
            sharding->second.shards != load.shards) {
          return;
        }
        auto& model = sharded_model(self, load.model, load.routing_group, load.shards);
        std::uint64_t tokens = 0;
        for (const std::uint64_t worker : load.worker_tokens) tokens += worker;
        model.published[load.shard] = tokens;
        model.balancer.set_load(load.shard, std::move(load.worker_tokens));
        std::uint64_t total = 0;
        for (const std::uint64_t shard : model.published) total += shard;
        const std::string partition = cluster::partition_key(load.model, load.routing_group);
        for (std::uint32_t shard = 0; shard < load.shards; ++shard) {
          node_metrics(self)
              .shard_load_share(partition, shard)
              .set(total == 0
                       ? 0.0
                       : static_cast<double>(model.published[shard]) / static_cast<double>(total));
        }
      },
      [self](ownership_atom, ClusterView& view) {
        update_view(self, view);
        auto waiting = std::move(self->state.awaiting_view);
        self->state.awaiting_view.clear();
        for (auto& [job, waits] : waiting) dispatch_route(self, std::move(job), waits);
        auto reports = std::move(self->state.awaiting_reports);
        self->state.awaiting_reports.clear();
        for (auto& [job, waits] : reports) dispatch_report(self, std::move(job), waits);
      },
  };
}

}  // namespace kvr::actors
