#include "actors/classifier/classifier_actor.hpp"

#include <set>
#include <vector>

#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/metrics/node_metrics.hpp"
#include "selection/lifecycle/request_lifecycle.hpp"

namespace kvr::actors {
namespace {

namespace rc = plugins::request_classifier;
using Self = classifier_actor::stateful_pointer<ClassifierActorState>;
using DecisionPromise = caf::typed_response_promise<RouteDecisionMessage>;
using Waiting = ClassifierActorState::Waiting;
using AdmittingRoute = ClassifierActorState::WaitingRoute;
using WaitingGenerate = ClassifierActorState::WaitingGenerate;

metrics::NodeMetrics node_metrics(Self self) {
  return metrics::NodeMetrics{*self->state.config.metrics};
}

// Brings `context` to the fleet the model's selectors described so far: the block size of its
// first partition that knows one, and the ranks of every partition.
void describe_fleet(Self self, const std::string& model, rc::RequestClassifierContext& context) {
  std::uint32_t block_size = 0;
  std::vector<rc::ClassifierWorker> workers;
  if (const auto fleet = self->state.fleets.find(model); fleet != self->state.fleets.end()) {
    for (const auto& [group, partition] : fleet->second) {
      if (block_size == 0) block_size = partition.block_size;
      workers.insert(workers.end(), partition.workers.begin(), partition.workers.end());
    }
  }
  context.update(block_size, std::move(workers));
}

// The model's admission state, created at its first partition's description (or its first
// request or load report, should one come first) with a context that follows the model's fleet
// from then on (file comment of classifier_actor.hpp).
ClassifierActorState::Model& model_for(Self self, const std::string& model) {
  auto& models = self->state.models;
  auto it = models.find(model);
  if (it != models.end()) return it->second;
  auto context =
      std::make_unique<rc::RequestClassifierContext>(0, std::span<const rc::ClassifierWorker>{});
  describe_fleet(self, model, *context);
  auto classifier = build_classifier(self->state.config.factory, *context);
  if (!classifier) {
    node_metrics(self).classifier_faults(model, "build").add();
    std::string failure = fmt::format("the request classifier of model '{}' could not be built: {}",
                                      model, classifier.error());
    spdlog::error("kvr node: {}", failure);
    return models
        .emplace(model, ClassifierActorState::Model{nullptr, nullptr, std::move(failure), {}})
        .first->second;
  }
  // A Waker only enqueues a wake message (it may fire inside the classifier or on any thread);
  // the address is weak, so a late Waker finds no actor instead of keeping it alive.
  const caf::actor_addr address = self->address();
  auto admission = std::make_unique<AdmissionState>(
      std::move(*classifier),
      [address] {
        if (auto strong = caf::actor_cast<caf::strong_actor_ptr>(address)) {
          caf::anon_send(caf::actor_cast<classifier_actor>(strong), wake_atom::value);
        }
      },
      self->state.config.max_wait);
  // Counted every time, logged once per model and hook: a classifier that throws on every
  // event would otherwise flood the log.
  admission->on_fault([metrics = node_metrics(self), model, logged = std::set<std::string>{}](
                          std::string_view stage, std::string_view what) mutable {
    metrics.classifier_faults(model, stage).add();
    if (logged.emplace(stage).second) {
      spdlog::error(
          "kvr node: the request classifier of model '{}' threw from {} (counted in "
          "kvr_classifier_faults_total, logged once): {}",
          model, stage == "event" ? "on_event" : "on_fleet_load", what);
    }
  });
  return models
      .emplace(model, ClassifierActorState::Model{std::move(context), std::move(admission), {}, {}})
      .first->second;
}

// Refuses a generate request with its decision and the final chunk of its stream, as the
// lifecycle actor refuses one it cannot serve.
void end_generate(Self self, WaitingGenerate& waiting, Error code, const std::string& message,
                  const char* finish_reason) {
  auto& config = self->state.config;
  const GenerateEnvelope& envelope = waiting.envelope;
  const std::string& request_id = envelope.request.route.id();
  const v1::RouteDecision decision = encode_route_error(request_id, code, message);
  const v1::GenerateChunk end = encode_end_chunk(
      request_id, 0,
      StreamEnd{finish_reason,
                std::string_view{finish_reason} == "error" ? std::optional{code} : std::nullopt,
                message},
      std::nullopt);
  if (envelope.stream_actor) {
    // The decision leaves before the stream's end, as for a request that was served.
    waiting.promise.deliver(RouteDecisionMessage{decision});
    self->send(caf::actor_cast<stream_client_actor>(envelope.stream_actor), chunk_atom::value,
               GenerateChunkMessage{end});
    return;
  }
  if (!envelope.reply_subject.empty()) {
    config.publisher->publish(envelope.reply_subject, decision.SerializeAsString());
  }
  config.publisher->publish(envelope.request.stream_subject, end.SerializeAsString());
  waiting.promise.deliver(RouteDecisionMessage{decision});  // nobody waits: dropped
}

void reject(Self self, Waiting& waiting, const AdmissionRejected& rejection) {
  node_metrics(self).route_errors(rejection.code).add();
  if (auto* route = std::get_if<AdmittingRoute>(&waiting)) {
    const v1::RouteDecision decision =
        encode_route_error(route->envelope.request.client_id(), rejection.code, rejection.message,
                           rejection.retry_after);
    if (!route->envelope.reply_subject.empty()) {
      self->state.config.publisher->publish(route->envelope.reply_subject,
                                            decision.SerializeAsString());
    }
    route->promise.deliver(RouteDecisionMessage{decision});
    return;
  }
  end_generate(self, std::get<WaitingGenerate>(waiting), rejection.code, rejection.message,
               "error");
}

// As the reference specifies, classifiers decide aggregated and decode admission only: a prefill or
// an encode request is a hop of a request that was admitted already (or is never classified), so
// it goes straight on.
bool runs_admission(WorkerType worker_type) {
  return worker_type == WorkerType::Aggregated || worker_type == WorkerType::Decode;
}

void hand_on(Self self, Waiting& waiting, const rc::ClassifyRequest& admitted) {
  auto& config = self->state.config;
  if (auto* route = std::get_if<AdmittingRoute>(&waiting)) {
    apply_admission(route->envelope.request, admitted);
    route->promise.delegate(config.reservation, route_atom::value, std::move(route->envelope));
    return;
  }
  auto& generate = std::get<WaitingGenerate>(waiting);
  apply_admission(generate.envelope.request.route, admitted);
  generate.promise.delegate(config.lifecycle, generate_atom::value, std::move(generate.envelope));
}

// Counts an actor client's waiting requests: the first is monitored, the last stops it.
void track_client(Self self, const Waiting& waiting) {
  const auto* generate = std::get_if<WaitingGenerate>(&waiting);
  if (generate == nullptr || !generate->envelope.stream_actor) return;
  const caf::actor& client = generate->envelope.stream_actor;
  if (++self->state.monitored_clients[client.address()] == 1) self->monitor(client);
}
void untrack_client(Self self, const Waiting& waiting) {
  const auto* generate = std::get_if<WaitingGenerate>(&waiting);
  if (generate == nullptr || !generate->envelope.stream_actor) return;
  auto& clients = self->state.monitored_clients;
  const auto it = clients.find(generate->envelope.stream_actor.address());
  if (it == clients.end() || --it->second > 0) return;
  self->demonitor(it->first);
  clients.erase(it);
}

void settle(Self self, ClassifierActorState::Model& model, AdmissionOutcome& outcome) {
  auto node = model.waiting.extract(outcome.request_id);
  if (node.empty()) return;
  untrack_client(self, node.mapped());
  if (outcome.admitted()) {
    node_metrics(self).admission_decisions("admitted").add();
    hand_on(self, node.mapped(), outcome.request());
  } else {
    node_metrics(self).admission_decisions("rejected", as_str(outcome.rejection().code)).add();
    reject(self, node.mapped(), outcome.rejection());
  }
}

// Arms one delayed wake message at the earliest wake time, due time or wait limit of all models,
// unless one is on its way for that time or earlier.
void arm_timer(Self self) {
  auto& state = self->state;
  std::optional<rc::TimePoint> next;
  for (const auto& [name, model] : state.models) {
    if (!model.admission) continue;
    if (const auto deadline = model.admission->next_deadline();
        deadline && (!next || *deadline < *next)) {
      next = deadline;
    }
  }
  if (!next || (state.armed_for && *state.armed_for <= *next)) return;
  state.armed_for = next;
  const auto now = state.config.clock->now();
  const auto delay = *next > now
                         ? std::chrono::duration_cast<std::chrono::microseconds>(*next - now)
                         : std::chrono::microseconds{0};
  self->delayed_send(self, delay, wake_atom::value);
}

// Polls what is due in one model and settles the decisions.
void drive(Self self, ClassifierActorState::Model& model) {
  if (!model.admission) return;
  const auto now = self->state.config.clock->now();
  const auto deadline = model.admission->next_deadline();
  if (!model.admission->has_woken() && !(deadline && *deadline <= now)) return;
  auto outcomes = model.admission->poll_due(now);
  for (auto& outcome : outcomes) settle(self, model, outcome);
}

template <class WaitingKind>
void admit(Self self, const std::string& model_name, std::string request_id,
           const RouteRequest& request, WaitingKind waiting) {
  auto& model = model_for(self, model_name);
  if (!model.admission) {
    Waiting refused{std::move(waiting)};
    reject(self, refused, AdmissionRejected{Error::policy_failed, model.failure});
    return;
  }
  auto [it, inserted] = model.waiting.try_emplace(request_id, std::move(waiting));
  if (!inserted) {
    Waiting duplicate{std::move(waiting)};
    reject(self, duplicate,
           AdmissionRejected{
               Error::invalid_request,
               fmt::format("request '{}' is already waiting for admission", request_id)});
    return;
  }
  track_client(self, it->second);
  const auto now = self->state.config.clock->now();
  if (auto outcome = model.admission->admit(request_id, classify_request(request, now), now)) {
    settle(self, model, *outcome);
  } else {
    node_metrics(self).admission_decisions("deferred").add();
  }
  arm_timer(self);
}

}  // namespace

classifier_actor::behavior_type classifier_behavior(Self self, ClassifierActorConfig config) {
  self->state.config = std::move(config);
  // Shutdown: no undecided request is left without an answer.
  self->set_exit_handler([self](caf::exit_msg& message) {
    for (auto& [name, model] : self->state.models) {
      for (auto& [request_id, waiting] : model.waiting) {
        model.admission->cancel(request_id, "the router node is shutting down");
        reject(self, waiting,
               AdmissionRejected{Error::unavailable, "the router node is shutting down"});
      }
      model.waiting.clear();
    }
    self->quit(message.reason);
  });
  // An actor client that terminated waits for nothing: drop its undecided requests.
  self->set_down_handler([self](caf::down_msg& message) {
    self->state.monitored_clients.erase(message.source);
    for (auto& [name, model] : self->state.models) {
      std::vector<std::string> gone;
      for (const auto& [request_id, waiting] : model.waiting) {
        const auto* generate = std::get_if<WaitingGenerate>(&waiting);
        if (generate != nullptr && generate->envelope.stream_actor &&
            generate->envelope.stream_actor.address() == message.source) {
          gone.push_back(request_id);
        }
      }
      for (const std::string& request_id : gone) {
        model.admission->cancel(request_id, "the client actor terminated");
        model.waiting.erase(request_id);
      }
    }
    arm_timer(self);
  });
  return {
      [self](route_atom, RouteEnvelope& envelope) -> caf::result<RouteDecisionMessage> {
        // A query-only probe holds nothing, so admission has nothing to account.
        if (!runs_admission(envelope.request.worker_type) || envelope.request.query_only) {
          return self->make_response_promise<RouteDecisionMessage>().delegate(
              self->state.config.reservation, route_atom::value, std::move(envelope));
        }
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        const std::string model = envelope.request.partition.model;
        const std::string request_id = envelope.request.id();
        const RouteRequest request = envelope.request;
        admit(self, model, request_id, request, AdmittingRoute{std::move(envelope), promise});
        return promise;
      },
      [self](generate_atom, GenerateEnvelope& envelope) -> caf::result<RouteDecisionMessage> {
        if (!runs_admission(envelope.request.route.worker_type)) {
          return self->make_response_promise<RouteDecisionMessage>().delegate(
              self->state.config.lifecycle, generate_atom::value, std::move(envelope));
        }
        auto promise = self->make_response_promise<RouteDecisionMessage>();
        const std::string model = envelope.request.route.partition.model;
        const std::string request_id = envelope.request.route.id();
        const RouteRequest request = envelope.request.route;
        admit(self, model, request_id, request, WaitingGenerate{std::move(envelope), promise});
        return promise;
      },
      [self](cancel_atom, std::string& request_id) {
        for (auto& [name, model] : self->state.models) {
          auto node = model.waiting.extract(request_id);
          if (node.empty()) continue;
          model.admission->cancel(request_id, "cancelled by the client");
          untrack_client(self, node.mapped());
          if (auto* generate = std::get_if<WaitingGenerate>(&node.mapped())) {
            end_generate(self, *generate, Error::unavailable,
                         fmt::format("request '{}' cancelled: cancelled by the client", request_id),
                         "cancelled");
          }
          arm_timer(self);
          return;
        }
        // Admitted (or unknown here): the lifecycle actor ends it and reports Aborted.
        self->send(self->state.config.lifecycle, cancel_atom::value, std::move(request_id));
      },
      [self](classify_atom, ClassifierEvent& event) {
        auto it = self->state.models.find(event.model);
        if (it == self->state.models.end() || !it->second.admission) return;
        it->second.admission->on_event(event.event);
        // Wakers fired by the event are polled in this turn; their wake message finds nothing.
        drive(self, it->second);
        arm_timer(self);
      },
      [self](kv_usage_atom, const std::string& model_name, const std::string& group,
             std::uint64_t used, std::uint64_t total) {
        auto& partitions = self->state.fleet_blocks[model_name];
        partitions[group] = {used, total};
        std::uint64_t fleet_used = 0;
        std::uint64_t fleet_total = 0;
        for (const auto& [name, blocks] : partitions) {
          fleet_used += blocks.first;
          fleet_total += blocks.second;
        }
        if (fleet_total == 0) return;
        auto& model = model_for(self, model_name);
        if (!model.admission) return;
        model.admission->on_fleet_load(rc::FleetLoad{
            .kv_usage = static_cast<double>(fleet_used) / static_cast<double>(fleet_total),
            .at = self->state.config.clock->now()});
        drive(self, model);
        arm_timer(self);
      },
      [self](fleet_atom, PartitionFleet& fleet) {
        const std::string model = fleet.model;
        auto& partitions = self->state.fleets[model];
        std::string group = fleet.routing_group;
        partitions.insert_or_assign(std::move(group), std::move(fleet));
        const auto it = self->state.models.find(model);
        if (it == self->state.models.end()) {
          // The model's first partition was just created: its classifier is built now, so that a
          // factory that fails is reported before the model's first request.
          (void)model_for(self, model);
        } else if (it->second.context) {
          describe_fleet(self, model, *it->second.context);
        }
      },
      [self](classify_atom, const std::string& model, const std::string& request_id,
             std::uint64_t context_tokens) {
        if (const auto it = self->state.models.find(model);
            it != self->state.models.end() && it->second.admission) {
          it->second.admission->observe_progress(request_id, context_tokens);
        }
      },
      [self](targets_atom, reservation_actor& reservation, lifecycle_actor& lifecycle) {
        self->state.config.reservation = std::move(reservation);
        self->state.config.lifecycle = std::move(lifecycle);
      },
      [self](wake_atom) {
        auto& state = self->state;
        if (state.armed_for && *state.armed_for <= state.config.clock->now()) {
          state.armed_for.reset();
        }
        for (auto& [name, model] : state.models) drive(self, model);
        arm_timer(self);
      },
  };
}

}  // namespace kvr::actors
