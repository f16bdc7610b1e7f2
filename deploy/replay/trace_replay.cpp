#include "deploy/replay/trace_replay.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <queue>
#include <unordered_map>

#include <fmt/format.h>

#include "classifiers/queue/policy_class_config.hpp"
#include "deploy/simulation/engine.hpp"
#include "messages/check.hpp"
#include "selection/admission/admission_state.hpp"
#include "selection/lifecycle/request_flight.hpp"
#include "selection/partition/partition_router.hpp"
#include "selection/partition/shard_request.hpp"

namespace kvr::replay {
namespace {

namespace rc = plugins::request_classifier;
using simulation::Engine;
using simulation::EngineRequestId;
using simulation::StepResult;

constexpr std::string_view kReplayModel = "replay";

enum class EventKind : std::uint8_t {
  StepEnd,     // a worker's engine step finishes: its tokens and events exist now
  KvDelivery,  // a worker's KV event batch reaches the router
  LoadReport,  // a worker's load report reaches the router
  // The router's admission timer: a classifier's wake-up, due time or wait limit, or a queued
  // request's due time or wait limit, has come (the worker bits are unused).
  RouterTimer,
};

// A worker's event in the queue. Sixteen bytes, so that the heap moves whole aligned entries:
// the replay pushes and pops one per engine step, millions per run. `order` packs the
// scheduling sequence (high bits: ties go by scheduling order, so the replay is deterministic),
// the kind and the worker index.
struct Event {
  static constexpr unsigned kWorkerBits = 22;
  static constexpr unsigned kKindBits = 2;
  static constexpr unsigned kSequenceShift = kWorkerBits + kKindBits;

  double time_ms = 0;
  std::uint64_t order = 0;

  EventKind kind() const {
    return static_cast<EventKind>((order >> kWorkerBits) & ((1U << kKindBits) - 1));
  }
  std::uint32_t worker() const {
    return static_cast<std::uint32_t>(order & ((std::uint64_t{1} << kWorkerBits) - 1));
  }
  bool operator>(const Event& other) const {
    return time_ms != other.time_ms ? time_ms > other.time_ms : order > other.order;
  }
};

std::chrono::steady_clock::time_point logical_time(double ms) {
  return std::chrono::steady_clock::time_point{
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double, std::milli>(ms))};
}

// The first logical time, in ms, at which `at` has come: converting to ms rounds, and a timer
// that fired a nanosecond early would find nothing due and be armed again for the same time.
double at_or_after(std::chrono::steady_clock::time_point at) {
  double ms = std::chrono::duration<double, std::milli>(at.time_since_epoch()).count();
  while (logical_time(ms) < at) ms = std::nextafter(ms, std::numeric_limits<double>::infinity());
  return ms;
}

std::string request_id(std::size_t index) { return fmt::format("r{}", index); }

// A prefill hop's answer: the simulated engines need no parameters for the decode worker to pull
// the KV (the replay knows where it is), but the flight passes an answer on only with some.
constexpr std::string_view kReplayTransferParams = R"({"replay":true})";

// The trace index request_id() encoded.
std::uint32_t trace_index_of(std::string_view id) {
  std::uint32_t index = 0;
  const auto [end, error] = std::from_chars(id.data() + 1, id.data() + id.size(), index);
  KVR_CHECK(!id.empty() && error == std::errc{} && end == id.data() + id.size());
  return index;
}

// The partition core's settings for a replay: the node's, with the replay's block size, seed and
// classes, and bookings and workers' liveness that never expire (the simulated lifecycle reports
// every request).
PartitionRouterOptions make_router_options(const ReplayOptions& options,
                                           const plugins::RouterPlugins& plugins) {
  PartitionRouterOptions router;
  router.options.partition.model = std::string{kReplayModel};
  router.options.router = options.router;
  router.options.router.block_size = options.engine.block_size;
  router.options.router.seed = options.seed;
  router.options.booking_ttl = std::chrono::hours(24 * 365);
  router.options.registration.max_liveness_ttl = std::chrono::hours(24 * 365);
  router.affinity = options.session_affinity;
  const classifiers::PolicyClassConfig fallback =
      classifiers::default_policy_class(options.queue_threshold);
  KVR_CHECK(classifiers::validate_policy_class(fallback).has_value());
  router.policy_classes = classifiers::resolve_policy_classes(plugins.policy_classes, fallback);
  router.queue_max_wait = options.admission_max_wait;
  router.report_kv_usage = plugins.request_classifier.has_value();
  return router;
}

// A queue's refusal (its limits, a due time or wait limit) rather than a failure to place.
bool refused_by_queue(Error code) {
  return code == Error::overloaded || code == Error::due_time_expired || code == Error::timeout;
}

// The whole state of one policy's replay.
class PolicyRun {
 public:
  PolicyRun(const TraceReplay& replay, const std::vector<simulation::TraceRequest>& requests,
            const std::vector<std::vector<BlockHash>>& block_hashes,
            const plugins::RouterPlugins& plugins)
      : options_(replay.options()),
        requests_(requests),
        block_hashes_(block_hashes),
        tenants_(replay.tenants()),
        plugins_(plugins),
        shard_map_(replay.options().sharding.shards),
        balancer_(replay.options().sharding.shards),
        kv_usage_(replay.options().sharding.shards),
        requests_per_shard_(replay.options().sharding.shards, 0) {
    for (std::uint32_t shard = 0; shard < options_.sharding.shards; ++shard) {
      routers_.push_back(std::make_unique<PartitionRouter>(
          make_router_options(replay.options(), plugins), plugins));
    }
  }

  std::vector<simulation::ReplayRequestOutcome> run(std::size_t policy_index) {
    start_fleet();
    start_admission();
    // Arrivals are known up front, so they are read in (time, trace index) order from a sorted
    // list instead of sitting in the heap: the heap then holds only the few events of the workers.
    // An arrival goes before a worker event due at the same time, as it would if every arrival
    // had been scheduled first.
    std::vector<std::uint32_t> arrivals(requests_.size());
    arrival_ms_.resize(requests_.size());
    shard_of_request_.assign(requests_.size(), kNoShard);
    for (std::size_t i = 0; i < arrivals.size(); ++i) {
      arrivals[i] = static_cast<std::uint32_t>(i);
      arrival_ms_[i] = static_cast<double>(requests_[i].timestamp_ms) / options_.speedup;
    }
    std::ranges::stable_sort(arrivals, {}, [&](std::uint32_t index) { return arrival_ms_[index]; });
    std::size_t routed = 0;
    while (routed < arrivals.size() || !queue_.empty()) {
      if (routed < arrivals.size() &&
          (queue_.empty() || arrival_ms_[arrivals[routed]] <= queue_.top().time_ms)) {
        const std::uint32_t index = arrivals[routed];
        now_ms_ = arrival_ms_[index];
        arrive(index, now_ms_);
        ++routed;
        if (options_.on_progress) options_.on_progress(policy_index, routed);
        continue;
      }
      const Event event = queue_.top();
      queue_.pop();
      now_ms_ = event.time_ms;
      switch (event.kind()) {
        case EventKind::StepEnd:
          finish_step(event.worker(), event.time_ms);
          break;
        case EventKind::KvDelivery:
          deliver_kv(event.worker(), event.time_ms);
          break;
        case EventKind::LoadReport:
          deliver_load(event.worker(), event.time_ms);
          break;
        case EventKind::RouterTimer:
          on_router_timer(event.time_ms);
          break;
      }
    }
    // Every wait is bounded (admission_max_wait), so nothing is left; if something were, it
    // would be reported rather than lost.
    if (!deferred_.empty()) failures_["still deferred by admission at the end"] += deferred_.size();
    std::size_t queued = 0;
    for (const auto& router : routers_) queued += router->gauges().queued;
    if (queued > 0) failures_["still queued at the end"] += queued;
    std::ranges::sort(outcomes_, {}, &simulation::ReplayRequestOutcome::trace_index);
    return std::move(outcomes_);
  }

  /// Engine time summed over every worker, in ms.
  double busy_ms() const { return busy_ms_; }
  /// The policy's (predicted, observed) times to first token, when it predicts them.
  const std::vector<std::pair<double, double>>& ttft_predictions() const {
    return ttft_predictions_;
  }
  /// What the policy learnt by the end: partition-wide values by name (per shard when sharded),
  /// and the range of its per-worker factors.
  std::vector<std::pair<std::string, double>> learnt_values() const {
    std::vector<std::pair<std::string, double>> learnt;
    std::optional<std::pair<double, double>> factors;
    for (std::size_t shard = 0; shard < routers_.size(); ++shard) {
      for (const auto& [role, value] : routers_[shard]->state().learnt_values()) {
        if (!value.worker) {
          learnt.emplace_back(
              routers_.size() == 1 ? value.name : fmt::format("shard{}.{}", shard, value.name),
              value.value);
        } else if (!factors) {
          factors.emplace(value.value, value.value);
        } else {
          factors->first = std::min(factors->first, value.value);
          factors->second = std::max(factors->second, value.value);
        }
      }
    }
    if (factors) {
      learnt.emplace_back("worker_factor_min", factors->first);
      learnt.emplace_back("worker_factor_max", factors->second);
    }
    return learnt;
  }
  /// Disaggregated serving: the core's decisions, by reason.
  const std::array<std::size_t, kDisaggregationReasons>& decisions() const { return decisions_; }
  /// Sharded partitions: requests routed by each shard (a disaggregated request once), and those
  /// that spilled from their prefix's shard to another.
  const std::vector<std::size_t>& requests_per_shard() const { return requests_per_shard_; }
  std::size_t spills() const { return spills_; }
  /// Requests the router could not place, by message.
  const std::map<std::string, std::size_t>& failures() const { return failures_; }
  /// Requests admission or the queue refused: (trace index, error code), in the order refused.
  const std::vector<std::pair<std::uint32_t, Error>>& rejections() const { return rejections_; }

 private:
  // One replayed request from its admission to its end: its flight (the core a node's lifecycle
  // actor keeps per request) and what the simulation keeps beside it.
  struct ReplayedRequest {
    // A node's default flight settings. Its deadlines are never ticked: the simulated engines
    // never fail or fall silent, and the report shows waits however long they grow.
    ReplayedRequest(std::uint32_t index, std::size_t prompt_tokens, RouteRequest admitted)
        : flight(request_id(index), prompt_tokens), request(std::move(admitted)) {}

    RequestFlight flight;
    // As admission let it in: every route the flight asks for starts from it.
    RouteRequest request;
    bool route_pending = false;
    // The last dispatch's hop, and the prefill worker of its prefill hop.
    FlightHop hop = FlightHop::single;
    std::optional<WorkerWithDpRank> prefill_worker;
    // The worker (1-based; 0: none) whose engine holds the prompt's blocks for the decode hop
    // until they are pulled, and how many.
    std::uint32_t kv_holder = 0;
    std::uint64_t held_blocks = 0;
    std::optional<CacheOutcome> cache;
    // What ended it without completing: the queue's refusal, else this failure message.
    std::optional<Error> refused;
    std::string failure;
  };

  void schedule(double time_ms, EventKind kind, std::uint32_t worker) {
    queue_.push(
        Event{time_ms, (next_sequence_++ << Event::kSequenceShift) |
                           (std::uint64_t{static_cast<std::uint8_t>(kind)} << Event::kWorkerBits) |
                           worker});
  }

  // Registers every worker with its shard's core, the prefill and decode workers each spread
  // over the shards.
  void start_fleet() {
    KVR_CHECK(options_.workers < (std::size_t{1} << Event::kWorkerBits));
    pending_batches_.resize(options_.workers);
    pending_loads_.resize(options_.workers);
    std::vector<cluster::ShardedWorker> fleet;
    for (std::size_t w = 0; w < options_.workers; ++w) {
      fleet.push_back({w + 1, static_cast<std::uint8_t>(role_of(w))});
    }
    (void)shard_map_.assign(fleet);
    const auto zero = logical_time(0);
    for (std::size_t w = 0; w < options_.workers; ++w) {
      const std::uint32_t shard = *shard_map_.shard_of(w + 1);
      shard_of_worker_.push_back(shard);
      PartitionRouter& router = *routers_[shard];
      const std::size_t registered = router.gauges().workers;
      discovery::WorkerRegistration registration;
      registration.worker_id = w + 1;
      registration.incarnation = 1;
      registration.model = std::string{kReplayModel};
      registration.block_size = options_.engine.block_size;
      registration.total_kv_blocks = options_.engine.num_gpu_blocks;
      registration.max_num_batched_tokens = options_.engine.max_num_batched_tokens;
      registration.max_num_seqs = options_.engine.max_num_seqs;
      registration.liveness_ttl = std::chrono::hours(24 * 365);
      registration.role = role_of(w);
      router.register_worker(std::move(registration), zero, effects_);
      KVR_CHECK(router.gauges().workers == registered + 1);
      // Workers report their (empty) load at start, as a live worker does.
      router.update_load({w + 1, 1, {{0, discovery::ConfirmedLoad{}}}}, zero, effects_);
      effects_.clear();
      engines_.push_back(*Engine::create(options_.engine));
      stepping_.push_back(false);
      in_flight_.emplace_back();
      next_event_id_.push_back(1);
      last_load_report_.push_back(0);
    }
  }

  // The classifier (told the fleet as it registered) and the queue, when the plugins configure
  // them; without either, every request goes straight to selection as before.
  void start_admission() {
    if (!plugins_.request_classifier) return;
    std::vector<rc::ClassifierWorker> workers;
    for (std::size_t w = 0; w < options_.workers; ++w) {
      workers.emplace_back(WorkerWithDpRank{w + 1, 0}, options_.engine.num_gpu_blocks);
    }
    // As in a node, a classifier that cannot be built fails every request it would classify.
    // The replay's fleet never changes, and its context lives as long as the classifier.
    classifier_context_ =
        std::make_unique<rc::RequestClassifierContext>(options_.engine.block_size, workers);
    auto classifier = build_classifier(plugins_.request_classifier->factory, *classifier_context_);
    if (!classifier) {
      admission_failure_ = "the request classifier could not be built: " + classifier.error();
      return;
    }
    // Wakers only mark their request; settle() polls it in the same step, as the classifier
    // actor does in the same turn.
    admission_ = std::make_unique<AdmissionState>(
        std::move(*classifier), [] {},
        std::chrono::duration_cast<AdmissionState::Duration>(options_.admission_max_wait));
  }

  bool disaggregated() const { return options_.prefill_workers > 0; }

  WorkerType role_of(std::size_t w) const {
    if (!disaggregated()) return WorkerType::Aggregated;
    return w < options_.prefill_workers ? WorkerType::Prefill : WorkerType::Decode;
  }

  PartitionRouter& router_of_request(std::uint32_t index) {
    KVR_CHECK(shard_of_request_[index] != kNoShard);
    return *routers_[shard_of_request_[index]];
  }

  // Takes what a core just put in the shared effects that is per shard: its queue's next
  // wake-up (the earliest over all shards is kept) and its KV usage (summed for the classifier).
  void absorb(std::uint32_t shard) {
    if (const auto wake = std::exchange(effects_.wake_at, std::nullopt)) {
      if (!router_wake_at_ || *wake < *router_wake_at_) router_wake_at_ = *wake;
      arm_timer(*wake);
    }
    if (const auto usage = std::exchange(effects_.kv_usage, std::nullopt)) {
      kv_usage_[shard] = *usage;
      kv_usage_changed_ = true;
    }
  }

  // The shard a new request goes to: its prompt prefix's, unless another is the faster way, as
  // the shards last published their load (every load_interval_ms, as their owners do).
  std::uint32_t enter_shard(const RouteRequest& request, std::uint32_t index) {
    if (now_ms_ - last_load_publish_ms_ >= options_.sharding.load_interval_ms) {
      last_load_publish_ms_ = now_ms_;
      publish_shard_loads();
    }
    const cluster::ShardChoice choice = balancer_.choose(
        shard_map_, options_.sharding, shard_request_of(request, options_.engine.block_size));
    shard_of_request_[index] = choice.shard;
    ++requests_per_shard_[choice.shard];
    if (choice.spilled()) ++spills_;
    return choice.shard;
  }

  // Each shard's load as its owner publishes it (SelectorState::work_ahead_tokens).
  void publish_shard_loads() {
    for (std::uint32_t shard = 0; shard < routers_.size(); ++shard) {
      balancer_.set_load(shard, routers_[shard]->state().work_ahead_tokens());
    }
  }

  // The route request of trace index `index`.
  RouteRequest make_request(std::uint32_t index) const {
    const simulation::TraceRequest& trace = requests_[index];
    RouteRequest request{.selection = {.request_id = request_id(index),
                                       .prompt_tokens = trace.input_length,
                                       .block_hashes = block_hashes_[index],
                                       .expected_output_tokens = trace.output_length}};
    if (!tenants_.empty()) request.tenant = tenants_.names[tenants_.of_request[index]];
    if (routers_.front()->affinity().enabled()) {
      if (auto session = session_of(trace)) {
        request.selection.session.emplace(std::move(*session), std::nullopt, std::nullopt,
                                          std::nullopt);
      }
    }
    return request;
  }

  void arrive(std::uint32_t index, double now) {
    RouteRequest request = make_request(index);
    // The node's tick: idle session bindings expire (bookings and workers' liveness never do here).
    if (routers_.front()->affinity().enabled() && now - last_tick_ms_ >= kTickMs) {
      last_tick_ms_ = now;
      for (std::uint32_t shard = 0; shard < routers_.size(); ++shard) {
        routers_[shard]->tick(logical_time(now), effects_);
        absorb(shard);
      }
    }
    if (!admission_failure_.empty()) {
      ++failures_[admission_failure_];
    } else if (admission_) {
      const auto at = logical_time(now);
      auto outcome = admission_->admit(request.id(), classify_request(request, at), at);
      if (outcome) {
        decide(*outcome, request, index, now);
      } else {
        deferred_.emplace(index, std::move(request));
      }
    } else {
      enter_partition(request, index, now);
    }
    settle(now);
  }

  // The session a trace request belongs to: its first session_key_blocks hash ids (a
  // conversation's turns share their opening); none for a shorter request.
  std::optional<std::string> session_of(const simulation::TraceRequest& trace) const {
    const std::size_t blocks = options_.session_key_blocks;
    if (blocks == 0 || trace.hash_ids.size() < blocks) return std::nullopt;
    std::string id = "s";
    for (std::size_t i = 0; i < blocks; ++i) {
      fmt::format_to(std::back_inserter(id), "-{}", trace.hash_ids[i]);
    }
    return id;
  }

  // An admission decision for `request`: on to the queue with the classifier's overrides, or
  // refused.
  void decide(const AdmissionOutcome& outcome, RouteRequest& request, std::uint32_t index,
              double now) {
    if (!outcome.admitted()) {
      rejections_.emplace_back(index, outcome.rejection().code);
      return;
    }
    apply_admission(request, outcome.request());
    enter_partition(request, index, now);
  }

  // A decision that poll_due() made for a deferred request.
  void decide_deferred(const AdmissionOutcome& outcome, double now) {
    const std::uint32_t index = trace_index_of(outcome.request_id);
    auto node = deferred_.extract(index);
    KVR_CHECK(!node.empty());
    decide(outcome, node.mapped(), index, now);
  }

  // An admitted request goes to its partition: its flight starts with a route, which the core
  // answers now, or later with another input's effects when the request waits in the queue.
  void enter_partition(RouteRequest& request, std::uint32_t index, double now) {
    const std::size_t prompt_tokens = request.selection.prompt_tokens;
    auto [it, inserted] = flights_.try_emplace(index, index, prompt_tokens, std::move(request));
    KVR_CHECK(inserted);
    carry_out_flight(index, it->second.flight.start(logical_time(now)), now);
  }

  // Carries out what the request's flight decided, in FlightStep's order, as a node's lifecycle
  // actor does. Replay has no client stream: held and forwarded chunks need nothing.
  void carry_out_flight(std::uint32_t index, FlightResult result, double now,
                        const simulation::RequestStats* done = nullptr) {
    if (!result) {
      // The simulation feeds only what happens in order: a refused input is a bug here, and the
      // figures of a replay that went on would be wrong.
      std::fprintf(stderr, "kvr replay: %s\n", result.error().message.c_str());
      KVR_CHECK(result.has_value());
    }
    FlightStep& step = *result;
    ReplayedRequest& replayed = flights_.at(index);
    if (step.warning) replayed.failure = *step.warning;
    if (step.cancel_at_worker) {
      const std::size_t w = step.cancel_at_worker->worker_id - 1;
      // A worker that holds KV for the request's decode hop has no request left to abort.
      if (engines_[w].abort_request(index) && !stepping_[w] && engines_[w].has_work()) {
        start_step(w, now);
      }
    }
    if (step.first_token) change_booking(*step.first_token, now);
    if (step.release) change_booking(*step.release, now);
    if (admission_) {
      if (step.context_tokens) {
        admission_->observe_progress(replayed.flight.request_id(), *step.context_tokens);
      }
      for (const auto& event : step.classifier_events) admission_->on_event(event);
    }
    if (step.cache_outcome) replayed.cache = step.cache_outcome;
    if (step.completed) {
      KVR_CHECK(done != nullptr);
      record_outcome(index, replayed, *done);
    } else if (step.end_stream) {
      // Ended without completing: a refusal is an answer, counted by its code; anything else
      // fails the request, counted by what failed it.
      if (replayed.refused) {
        rejections_.emplace_back(index, *replayed.refused);
      } else {
        ++failures_[replayed.failure.empty() ? step.end_stream->message : replayed.failure];
      }
    }
    // Both may end or forget the flight: each looks it up again.
    if (step.dispatch) dispatch(index, *step.dispatch, now);
    if (step.route) route_flight(index, *step.route, now);
    forget_if_ended(index, now);
  }

  // The completed request's outcome: the engine's statistics, latencies from its arrival.
  void record_outcome(std::uint32_t index, const ReplayedRequest& replayed,
                      const simulation::RequestStats& done) {
    KVR_CHECK(replayed.cache.has_value());
    simulation::ReplayRequestOutcome outcome{
        .trace_index = index, .worker = *replayed.flight.worker(), .stats = done};
    // The flight's cache outcome: what the engine that computed the prompt reused (for a
    // disaggregated request its prefill worker's: the transferred KV is no cache hit) against
    // what the router predicted there.
    outcome.predicted_cached_tokens = replayed.cache->predicted_cached_tokens;
    outcome.stats.cached_prompt_tokens = replayed.cache->delivered_cached_tokens;
    // The engine saw the request when the router dispatched it; its latencies count from its
    // arrival, admission and queue waits included (the same time when nothing waited). A decode
    // hop's request started at its prefill hop.
    outcome.dispatched_ms =
        replayed.hop == FlightHop::decode ? arrival_ms_[index] : done.arrival_ms;
    outcome.stats.arrival_ms = arrival_ms_[index];
    outcome.prefill_worker = replayed.prefill_worker;
    outcome.retries = replayed.flight.retries();
    outcomes_.push_back(std::move(outcome));
  }

  // Routes the request as its flight asks, from the admitted request: the first route picks the
  // request's shard, the decode hop and any retry stay on it (it has decode workers as well).
  void route_flight(std::uint32_t index, const FlightRouteRequest& route, double now) {
    const auto it = flights_.find(index);
    if (it == flights_.end()) return;
    RouteRequest request = routed_as(it->second.request, route);
    it->second.route_pending = true;
    const std::uint32_t shard = shard_of_request_[index] == kNoShard ? enter_shard(request, index)
                                                                     : shard_of_request_[index];
    auto reply = routers_[shard]->route(request, index, logical_time(now), effects_);
    absorb(shard);
    if (reply) answer(index, std::move(*reply), now);
  }

  // The core's answer to the route of trace index `index`, for its flight.
  void answer(std::uint32_t index, RouteReply reply, double now) {
    ReplayedRequest& replayed = flights_.at(index);
    replayed.route_pending = false;
    if (!reply.result) {
      const RouteFailure& failure = reply.result.error();
      if (refused_by_queue(failure.code)) {
        replayed.refused = failure.code;
      } else {
        replayed.failure = failure.message;
      }
      carry_out_flight(
          index, replayed.flight.route_failed(failure.code, failure.message, logical_time(now)),
          now);
      return;
    }
    if (reply.disaggregation) ++decisions_[static_cast<std::size_t>(reply.disaggregation->reason)];
    const std::uint64_t prompt_tokens = replayed.request.selection.prompt_tokens;
    const FlightRoute route{
        .worker = reply.result->worker,
        .prefill_hop = reply.disaggregation && reply.disaggregation->prefill_hop(),
        // The router's overlap in tokens, capped at the prompt as the booking counts it.
        .predicted_cached_tokens =
            prompt_tokens - std::min(prompt_tokens, reply.result->uncached_prefill_tokens),
        .transfer_valid = reply.disaggregation ? std::optional{reply.disaggregation->transfer_valid}
                                               : std::nullopt};
    carry_out_flight(index, replayed.flight.routed(route, logical_time(now)), now);
  }

  // Sends the request to the engine of the worker its flight chose, for the hop it names.
  void dispatch(std::uint32_t index, const FlightDispatch& hop, double now) {
    ReplayedRequest& replayed = flights_.at(index);
    const simulation::TraceRequest& trace = requests_[index];
    simulation::EngineRequest engine_request{.id = index,
                                             .block_hashes = block_hashes_[index],
                                             .prompt_tokens = trace.input_length,
                                             .output_tokens = hop.max_output_tokens.value_or(
                                                 std::max<std::uint32_t>(1, trace.output_length))};
    if (hop.hop == FlightHop::prefill) {
      // A new prefill hop: KV that an earlier one holds is no longer wanted.
      release_held_kv(replayed, index, now);
      engine_request.kv_transfer = simulation::KvTransfer::remote_decode;
      replayed.prefill_worker = hop.worker;
    } else if (hop.hop == FlightHop::decode) {
      // The decode worker pulls what the prefill worker's engine holds; the parameters (the
      // flight's, kReplayTransferParams) stand for where that is.
      engine_request.kv_transfer = simulation::KvTransfer::remote_prefill;
      engine_request.remote_blocks = replayed.held_blocks;
    }
    replayed.hop = hop.hop;
    const std::size_t w = hop.worker.worker_id - 1;
    if (auto added = engines_[w].add_request(std::move(engine_request), now); !added) {
      // The request is at fault, not the worker: it needs more than an engine has, and every
      // engine of the replay's fleet is alike. It ends unretried and blames no worker, as the
      // front door treats an engine's 4xx answer.
      replayed.failure = fmt::format("engine refused: {}", simulation::as_str(added.error()));
      carry_out_flight(index, replayed.flight.abort(Error::invalid_request, replayed.failure), now);
      return;
    }
    if (!stepping_[w]) start_step(w, now);
  }

  // The engine's first token of trace index `index` on worker `w`: the worker's first chunk,
  // with the prompt tokens its engine served from cache.
  void first_chunk(std::size_t w, const simulation::FirstToken& first, double now) {
    const auto index = static_cast<std::uint32_t>(first.id);
    const StreamChunk chunk{.worker = {w + 1, 0},
                            .index = 0,
                            .tokens = 1,
                            .cached_prompt_tokens = first.cached_prompt_tokens};
    carry_out_flight(index, flights_.at(index).flight.on_chunk(chunk, logical_time(now)), now);
  }

  // The engine completed trace index `index` on worker `w`: the worker's final chunk; a prefill
  // hop's carries its answer, the engine holding the prompt's blocks for a decode worker.
  void last_chunk(std::size_t w, const simulation::RequestStats& done, double now) {
    const auto index = static_cast<std::uint32_t>(done.id);
    ReplayedRequest& replayed = flights_.at(index);
    StreamChunk chunk{.worker = {w + 1, 0},
                      .index = 1,
                      .tokens = static_cast<std::size_t>(done.output_tokens - 1),
                      .finished = true,
                      .finish_reason = "length"};
    if (replayed.hop == FlightHop::prefill) {
      replayed.kv_holder = static_cast<std::uint32_t>(w + 1);
      replayed.held_blocks = done.held_blocks;
      chunk.kv_transfer_params = kReplayTransferParams;
    }
    carry_out_flight(index, replayed.flight.on_chunk(chunk, logical_time(now)), now, &done);
  }

  // The prefill worker's engine no longer holds the request's blocks for a decode worker: they
  // were pulled, a new prefill hop replaces them, or the request ended.
  void release_held_kv(ReplayedRequest& replayed, std::uint32_t index, double now) {
    if (replayed.kv_holder == 0) return;
    const std::size_t w = replayed.kv_holder - 1;
    (void)engines_[w].release_transfer(index);
    replayed.kv_holder = 0;
    // Held blocks may have stalled it (a pool full of them): the freed ones let it run again.
    if (!stepping_[w] && engines_[w].has_work()) start_step(w, now);
  }

  // Forgets a flight that ended and has no route in flight.
  void forget_if_ended(std::uint32_t index, double now) {
    const auto it = flights_.find(index);
    if (it == flights_.end() || !it->second.flight.ended() || it->second.route_pending) return;
    release_held_kv(it->second, index, now);
    flights_.erase(it);
  }

  void change_booking(const BookingChange& change, double now) {
    const std::size_t earlier_events = effects_.events.size();
    const std::uint32_t index = trace_index_of(change.request_id);
    const std::uint32_t shard = shard_of_request_[index];
    (void)router_of_request(index).change_booking(change, logical_time(now), effects_);
    absorb(shard);
    for (std::size_t i = earlier_events; i < effects_.events.size(); ++i) {
      if (const auto* predicted =
              std::get_if<partition_event::TtftPredicted>(&effects_.events[i])) {
        ttft_predictions_.emplace_back(1000 * predicted->predicted_seconds,
                                       1000 * predicted->observed_seconds);
      }
    }
  }

  // Carries out the core's effects: answers to requests that waited, the fleet's KV usage for
  // the classifier, the queue's next wake-up. Returns whether any request was answered.
  bool carry_out(double now) {
    bool answered = false;
    while (!effects_.answers.empty() || kv_usage_changed_) {
      auto answers = std::move(effects_.answers);
      effects_.answers.clear();
      if (std::exchange(kv_usage_changed_, false) && admission_) {
        std::uint64_t used = 0;
        std::uint64_t total = 0;
        for (const auto& usage : kv_usage_) {
          used += usage.used;
          total += usage.total;
        }
        if (total > 0) {
          admission_->on_fleet_load(rc::FleetLoad{
              .kv_usage = std::min(1.0, static_cast<double>(used) / static_cast<double>(total)),
              .at = logical_time(now)});
        }
      }
      for (auto& [ticket, reply] : answers) {
        answer(static_cast<std::uint32_t>(ticket), std::move(reply), now);
        answered = true;
      }
    }
    effects_.clear();
    return answered;
  }

  // After anything that may free capacity or wake the classifier: carries out the core's effects
  // and polls the woken admission futures, as a node does in the same actor turn.
  void settle(double now) {
    const auto at = logical_time(now);
    for (;;) {
      bool decided = carry_out(now);
      if (admission_ && admission_->has_woken()) {
        for (const auto& outcome : admission_->poll_due(at)) {
          decide_deferred(outcome, now);
          decided = true;
        }
      }
      decided = carry_out(now) || decided;
      // Dispatches tell the classifier Sent, which may wake more futures; a classifier that
      // only wakes itself again without deciding is polled at the next event instead.
      if (!decided || !admission_ || !admission_->has_woken()) break;
    }
    if (admission_) {
      if (const auto next = admission_->next_deadline()) arm_timer(*next);
    }
  }

  // Schedules one timer event for `at` (an admission deadline or the queue's wake-up), unless one
  // is scheduled for that time or earlier.
  void arm_timer(TimePoint at) {
    if (timer_armed_for_ && *timer_armed_for_ <= at) return;
    timer_armed_for_ = at;
    schedule(std::max(now_ms_, at_or_after(at)), EventKind::RouterTimer, 0);
  }

  void on_router_timer(double now) {
    const auto at = logical_time(now);
    if (timer_armed_for_ && *timer_armed_for_ <= at) timer_armed_for_.reset();
    if (admission_) {
      for (const auto& outcome : admission_->poll_due(at)) decide_deferred(outcome, now);
    }
    if (router_wake_at_ && *router_wake_at_ <= at) {
      router_wake_at_.reset();
      // Waking a core whose own deadline is later only re-arms it.
      for (std::uint32_t shard = 0; shard < routers_.size(); ++shard) {
        routers_[shard]->wake(at, effects_);
        absorb(shard);
      }
    }
    settle(now);
    // Later deadlines than the one handled: armed again.
    if (router_wake_at_) arm_timer(*router_wake_at_);
  }

  void start_step(std::size_t w, double now) {
    engines_[w].step(now, in_flight_[w]);
    busy_ms_ += in_flight_[w].duration_ms;
    stepping_[w] = true;
    schedule(in_flight_[w].end_ms(), EventKind::StepEnd, static_cast<std::uint32_t>(w));
  }

  void finish_step(std::uint32_t w, double now) {
    StepResult& result = in_flight_[w];
    for (const auto& first : result.first_tokens) first_chunk(w, first, now);
    for (const auto& done : result.completions) last_chunk(w, done, now);
    // The decode workers have pulled these: their prefill workers let the blocks go.
    for (const auto& transfer : result.transfers_done) {
      if (const auto it = flights_.find(static_cast<std::uint32_t>(transfer.id));
          it != flights_.end()) {
        release_held_kv(it->second, it->first, now);
      }
    }
    const double delivery = now + options_.kv_event_delay_ms;
    if (!result.kv_events.empty()) {
      pending_batches_[w].push_back(KvEventBatch{.worker = {w + 1, 0},
                                                 .incarnation = 1,
                                                 .event_id = next_event_id_[w]++,
                                                 .events = std::move(result.kv_events)});
      schedule(delivery, EventKind::KvDelivery, w);
    }
    const bool idle = !engines_[w].has_work();
    if (idle || now - last_load_report_[w] >= options_.load_report_interval_ms) {
      last_load_report_[w] = now;
      pending_loads_[w].push_back(simulation::load_report(engines_[w].load()));
      schedule(delivery, EventKind::LoadReport, w);
    }
    if (idle) {
      stepping_[w] = false;
    } else {
      start_step(w, now);
    }
    // First tokens and completions free capacity: queued and deferred requests may go now.
    settle(now);
  }

  // Every delivery comes kv_event_delay_ms after its step ended, and steps end in time order, so
  // each worker's batches and reports arrive in the order they were sent: the front is due.
  void deliver_kv(std::uint32_t w, double now) {
    routers_[shard_of_worker_[w]]->apply_kv_events(pending_batches_[w].front(), logical_time(now),
                                                   effects_);
    absorb(shard_of_worker_[w]);
    pending_batches_[w].pop_front();
    effects_.clear();
  }

  void deliver_load(std::uint32_t w, double now) {
    routers_[shard_of_worker_[w]]->update_load({w + 1, 1, {{0, pending_loads_[w].front()}}},
                                               logical_time(now), effects_);
    absorb(shard_of_worker_[w]);
    pending_loads_[w].pop_front();
    // A report may show a worker less busy than the router predicted.
    settle(now);
  }

  const ReplayOptions& options_;
  const std::vector<simulation::TraceRequest>& requests_;
  const std::vector<std::vector<BlockHash>>& block_hashes_;
  const TenantAssignment& tenants_;
  const plugins::RouterPlugins& plugins_;
  // One core per shard (one when unsharded), and which shard owns each worker (by index).
  std::vector<std::unique_ptr<PartitionRouter>> routers_;
  cluster::ShardMap shard_map_;
  cluster::ShardBalancer balancer_;
  double last_load_publish_ms_ = -std::numeric_limits<double>::infinity();
  std::vector<std::uint32_t> shard_of_worker_;
  // Per shard: its latest KV usage, and whether one changed since the classifier was told.
  std::vector<PartitionKvUsage> kv_usage_;
  bool kv_usage_changed_ = false;
  // Per trace index: the shard routing it (kNoShard: not routed yet).
  static constexpr std::uint32_t kNoShard = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint32_t> shard_of_request_;
  std::vector<std::size_t> requests_per_shard_;
  std::size_t spills_ = 0;
  std::vector<std::pair<double, double>> ttft_predictions_;
  PartitionEffects effects_;
  std::vector<Engine> engines_;
  std::vector<bool> stepping_;
  std::vector<StepResult> in_flight_;
  std::vector<EventId> next_event_id_;
  std::vector<double> last_load_report_;
  double busy_ms_ = 0;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::uint64_t next_sequence_ = 0;
  // Per worker, sent and not yet delivered, oldest first.
  std::vector<std::deque<KvEventBatch>> pending_batches_;
  std::vector<std::deque<discovery::ConfirmedLoad>> pending_loads_;
  std::vector<simulation::ReplayRequestOutcome> outcomes_;
  std::vector<double> arrival_ms_;  // per trace index
  // Requests admitted and not yet ended (or with a route still in the core), by trace index.
  std::unordered_map<std::uint32_t, ReplayedRequest> flights_;
  std::array<std::size_t, kDisaggregationReasons> decisions_{};
  double now_ms_ = 0;  // the time of the arrival or event being handled
  std::map<std::string, std::size_t> failures_;
  std::vector<std::pair<std::uint32_t, Error>> rejections_;

  // Why the configured classifier could not be built (start_admission()); empty: it was.
  std::string admission_failure_;
  // Admission, when configured (start_admission()); null: every request goes straight to its
  // partition.
  std::unique_ptr<plugins::request_classifier::RequestClassifierContext> classifier_context_;
  std::unique_ptr<AdmissionState> admission_;
  // Requests whose admission future is pending, by trace index.
  std::unordered_map<std::uint32_t, RouteRequest> deferred_;
  // The time of the earliest router timer event scheduled and not yet handled.
  std::optional<TimePoint> timer_armed_for_;
  // The queue's wake-up the core asked for and has not had yet.
  std::optional<TimePoint> router_wake_at_;
  // The node's tick period, and when the last tick ran.
  static constexpr double kTickMs = 100.0;
  double last_tick_ms_ = 0;
};

}  // namespace

TraceReplay::TraceReplay(std::string trace_name, std::vector<simulation::TraceRequest> requests,
                         ReplayOptions options, TenantAssignment tenants)
    : trace_name_(std::move(trace_name)),
      requests_(std::move(requests)),
      options_(std::move(options)),
      tenants_(std::move(tenants)) {
  KVR_CHECK(tenants_.empty() || tenants_.of_request.size() == requests_.size());
  block_hashes_.reserve(requests_.size());
  for (const auto& request : requests_) {
    block_hashes_.push_back(
        simulation::expand_to_block_hashes(request, options_.engine.block_size));
  }
}

std::vector<simulation::TenantReport> TraceReplay::tenant_reports(
    const std::vector<simulation::ReplayRequestOutcome>& outcomes,
    const std::vector<std::pair<std::uint32_t, Error>>& rejections) const {
  std::vector<simulation::TenantReport> reports(tenants_.names.size());
  std::vector<std::vector<double>> ttft(tenants_.names.size());
  std::vector<std::map<std::string, std::size_t>> rejected(tenants_.names.size());
  for (std::size_t i = 0; i < reports.size(); ++i) reports[i].tenant = tenants_.names[i];
  for (const std::uint32_t tenant : tenants_.of_request) ++reports[tenant].requests;
  for (const auto& outcome : outcomes) {
    const std::uint32_t tenant = tenants_.of_request[outcome.trace_index];
    ++reports[tenant].completed;
    ttft[tenant].push_back(outcome.stats.ttft_ms());
  }
  for (const auto& [index, code] : rejections) {
    ++rejected[tenants_.of_request[index]][std::string{as_str(code)}];
  }
  for (std::size_t i = 0; i < reports.size(); ++i) {
    reports[i].ttft_ms = simulation::summarize(std::move(ttft[i]));
    reports[i].rejected.assign(rejected[i].begin(), rejected[i].end());
  }
  return reports;
}

double TraceReplay::infinite_cache_hit_rate() const {
  return simulation::infinite_cache_hit_rate(requests_, block_hashes_, options_.engine.block_size);
}

std::uint64_t TraceReplay::fleet_kv_blocks() const {
  return std::uint64_t{options_.workers} * options_.engine.num_gpu_blocks;
}

double TraceReplay::capacity_bound_hit_rate() const {
  return simulation::capacity_bound_hit_rate(requests_, block_hashes_, options_.engine.block_size,
                                             fleet_kv_blocks());
}

std::string_view TraceReplay::model() { return kReplayModel; }

simulation::PolicyReport TraceReplay::run(
    const std::string& label, const plugins::RouterPlugins& plugins, std::size_t policy_index,
    std::vector<simulation::ReplayRequestOutcome>* outcomes_out) const {
  PolicyRun run{*this, requests_, block_hashes_, plugins};
  const auto outcomes = run.run(policy_index);
  simulation::PolicyReport report =
      simulation::make_policy_report(label, requests_.size(), outcomes, options_.workers);
  report.failures.assign(run.failures().begin(), run.failures().end());
  std::map<std::string, std::size_t> rejected;
  for (const auto& [index, code] : run.rejections()) ++rejected[std::string{as_str(code)}];
  report.rejected.assign(rejected.begin(), rejected.end());
  // make_policy_report counts every request without an outcome as failed; refusals are not.
  report.failed -= std::min(report.failed, run.rejections().size());
  if (!tenants_.empty()) report.tenants = tenant_reports(outcomes, run.rejections());
  for (std::size_t reason = 0; reason < kDisaggregationReasons; ++reason) {
    if (run.decisions()[reason] == 0) continue;
    report.disaggregation.emplace_back(
        std::string{as_str(static_cast<DisaggregationReason>(reason))}, run.decisions()[reason]);
  }
  if (options_.sharding.shards > 1) {
    report.shard_requests = run.requests_per_shard();
    report.shard_spills = run.spills();
  }
  if (!run.ttft_predictions().empty()) {
    report.ttft_calibration =
        simulation::make_calibration_report(run.ttft_predictions(), run.learnt_values());
  }
  if (outcomes_out != nullptr) *outcomes_out = outcomes;
  if (report.makespan_s > 0) {
    report.utilization =
        run.busy_ms() / (1000.0 * report.makespan_s * static_cast<double>(options_.workers));
  }
  return report;
}

}  // namespace kvr::replay
