#include "deploy/replay/trace_replay.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <queue>

#include <fmt/format.h>

#include "actors/selector/selector_state.hpp"
#include "deploy/simulation/engine.hpp"
#include "messages/check.hpp"

namespace kvr::replay {
namespace {

using simulation::Engine;
using simulation::StepResult;

constexpr std::string_view kReplayModel = "replay";

enum class EventKind : std::uint8_t {
  StepEnd,     // a worker's engine step finishes: its tokens and events exist now
  KvDelivery,  // a worker's KV event batch reaches the router
  LoadReport,  // a worker's load report reaches the router
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

std::string request_id(std::size_t index) { return fmt::format("r{}", index); }

// The whole state of one policy's replay.
class PolicyRun {
 public:
  PolicyRun(const TraceReplay& replay, const std::vector<simulation::TraceRequest>& requests,
            const std::vector<std::vector<BlockHash>>& block_hashes,
            const plugins::RouterPlugins& plugins)
      : options_(replay.options()),
        requests_(requests),
        block_hashes_(block_hashes),
        selector_(make_selector_options(replay.options()), plugins) {}

  std::vector<simulation::ReplayRequestOutcome> run(std::size_t policy_index,
                                                    std::map<std::string, std::size_t>& failures) {
    start_fleet();
    // Arrivals are known up front, so they are read in (time, trace index) order from a sorted
    // list instead of sitting in the heap: the heap then holds only the few events of the workers.
    // An arrival goes before a worker event due at the same time, as it would if every arrival
    // had been scheduled first.
    std::vector<std::uint32_t> arrivals(requests_.size());
    std::vector<double> arrival_ms(requests_.size());
    for (std::size_t i = 0; i < arrivals.size(); ++i) {
      arrivals[i] = static_cast<std::uint32_t>(i);
      arrival_ms[i] = static_cast<double>(requests_[i].timestamp_ms) / options_.speedup;
    }
    std::ranges::stable_sort(arrivals, {}, [&](std::uint32_t index) { return arrival_ms[index]; });
    std::size_t routed = 0;
    while (routed < arrivals.size() || !queue_.empty()) {
      if (routed < arrivals.size() &&
          (queue_.empty() || arrival_ms[arrivals[routed]] <= queue_.top().time_ms)) {
        const std::uint32_t index = arrivals[routed];
        arrive(index, arrival_ms[index], failures);
        ++routed;
        if (options_.on_progress) options_.on_progress(policy_index, routed);
        continue;
      }
      const Event event = queue_.top();
      queue_.pop();
      switch (event.kind()) {
        case EventKind::StepEnd:
          finish_step(event.worker(), event.time_ms);
          break;
        case EventKind::KvDelivery:
          deliver_kv(event.worker());
          break;
        case EventKind::LoadReport:
          deliver_load(event.worker());
          break;
      }
    }
    std::ranges::sort(outcomes_, {}, &simulation::ReplayRequestOutcome::trace_index);
    return std::move(outcomes_);
  }

  /// Engine time summed over every worker, in ms.
  double busy_ms() const { return busy_ms_; }

 private:
  static actors::SelectorOptions make_selector_options(const ReplayOptions& options) {
    actors::SelectorOptions selector;
    selector.partition.model = std::string{kReplayModel};
    selector.router = options.router;
    selector.router.block_size = options.engine.block_size;
    selector.router.seed = options.seed;
    // Every booking is released by the simulated lifecycle; none should ever expire.
    selector.lease_ttl = std::chrono::hours(24 * 365);
    selector.registration.max_lease_ttl = std::chrono::hours(24 * 365);
    return selector;
  }

  void schedule(double time_ms, EventKind kind, std::uint32_t worker) {
    queue_.push(
        Event{time_ms, (next_sequence_++ << Event::kSequenceShift) |
                           (std::uint64_t{static_cast<std::uint8_t>(kind)} << Event::kWorkerBits) |
                           worker});
  }

  void start_fleet() {
    KVR_CHECK(options_.workers < (std::size_t{1} << Event::kWorkerBits));
    pending_batches_.resize(options_.workers);
    pending_loads_.resize(options_.workers);
    const auto zero = logical_time(0);
    for (std::size_t w = 0; w < options_.workers; ++w) {
      discovery::WorkerRegistration registration;
      registration.worker_id = w + 1;
      registration.incarnation = 1;
      registration.model = std::string{kReplayModel};
      registration.block_size = options_.engine.block_size;
      registration.total_kv_blocks = options_.engine.num_gpu_blocks;
      registration.max_num_batched_tokens = options_.engine.max_num_batched_tokens;
      registration.max_num_seqs = options_.engine.max_num_seqs;
      registration.lease_ttl = std::chrono::hours(24 * 365);
      auto registered = selector_.register_worker(std::move(registration), zero);
      KVR_CHECK(registered.has_value());
      // Workers report their (empty) load at start, as a live worker does.
      (void)selector_.update_load({w + 1, 0}, discovery::ConfirmedLoad{});
      engines_.push_back(*Engine::create(options_.engine));
      stepping_.push_back(false);
      in_flight_.emplace_back();
      next_event_id_.push_back(1);
      last_load_report_.push_back(0);
    }
  }

  void arrive(std::uint32_t index, double now, std::map<std::string, std::size_t>& failures) {
    const simulation::TraceRequest& trace = requests_[index];
    const std::vector<BlockHash>& hashes = block_hashes_[index];
    const std::string id = request_id(index);
    actors::RouteRequest request{.selection = {.request_id = id,
                                               .prompt_tokens = trace.input_length,
                                               .block_hashes = hashes,
                                               .expected_output_tokens = trace.output_length}};
    auto routed = selector_.route(request, logical_time(now));
    if (!routed) {
      ++failures[routed.error().message];
      return;
    }
    const std::size_t w = routed->worker.worker_id - 1;
    auto added = engines_[w].add_request(
        simulation::EngineRequest{.id = index,
                                  .block_hashes = hashes,
                                  .prompt_tokens = trace.input_length,
                                  .output_tokens = std::max<std::uint32_t>(1, trace.output_length)},
        now);
    if (!added) {
      ++failures[fmt::format("engine refused: {}", simulation::as_str(added.error()))];
      (void)selector_.release(id, discovery::BookingEnd::failed);
      return;
    }
    if (!stepping_[w]) start_step(w, now);
  }

  void start_step(std::size_t w, double now) {
    engines_[w].step(now, in_flight_[w]);
    busy_ms_ += in_flight_[w].duration_ms;
    stepping_[w] = true;
    schedule(in_flight_[w].end_ms(), EventKind::StepEnd, static_cast<std::uint32_t>(w));
  }

  void finish_step(std::uint32_t w, double now) {
    StepResult& result = in_flight_[w];
    for (const auto& first : result.first_tokens) {
      (void)selector_.first_token(request_id(first.id));
    }
    for (const auto& done : result.completions) {
      (void)selector_.release(request_id(done.id), discovery::BookingEnd::completed);
      outcomes_.push_back(simulation::ReplayRequestOutcome{
          .trace_index = done.id, .worker = {w + 1, 0}, .stats = done});
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
      const simulation::EngineLoad load = engines_[w].load();
      pending_loads_[w].push_back(discovery::ConfirmedLoad{
          .active_requests =
              static_cast<std::uint32_t>(load.active_requests + load.waiting_requests),
          .waiting_requests = static_cast<std::uint32_t>(load.waiting_requests),
          .active_decode_blocks = load.active_decode_blocks,
          .active_prefill_tokens = load.active_prefill_tokens,
          .kv_blocks_used = load.kv_blocks_used});
      schedule(delivery, EventKind::LoadReport, w);
    }
    if (idle) {
      stepping_[w] = false;
    } else {
      start_step(w, now);
    }
  }

  // Every delivery comes kv_event_delay_ms after its step ended, and steps end in time order, so
  // each worker's batches and reports arrive in the order they were sent: the front is due.
  void deliver_kv(std::uint32_t w) {
    (void)selector_.apply_kv_events(pending_batches_[w].front());
    pending_batches_[w].pop_front();
  }

  void deliver_load(std::uint32_t w) {
    (void)selector_.update_load({w + 1, 0}, pending_loads_[w].front());
    pending_loads_[w].pop_front();
  }

  const ReplayOptions& options_;
  const std::vector<simulation::TraceRequest>& requests_;
  const std::vector<std::vector<BlockHash>>& block_hashes_;
  actors::SelectorState selector_;
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
};

}  // namespace

TraceReplay::TraceReplay(std::string trace_name, std::vector<simulation::TraceRequest> requests,
                         ReplayOptions options)
    : trace_name_(std::move(trace_name)),
      requests_(std::move(requests)),
      options_(std::move(options)) {
  block_hashes_.reserve(requests_.size());
  for (const auto& request : requests_) {
    block_hashes_.push_back(
        simulation::expand_to_block_hashes(request, options_.engine.block_size));
  }
}

double TraceReplay::infinite_cache_hit_rate() const {
  return simulation::infinite_cache_hit_rate(requests_, block_hashes_, options_.engine.block_size);
}

simulation::PolicyReport TraceReplay::run(const std::string& label,
                                          const plugins::RouterPlugins& plugins,
                                          std::size_t policy_index) const {
  std::map<std::string, std::size_t> failures;
  PolicyRun run{*this, requests_, block_hashes_, plugins};
  const auto outcomes = run.run(policy_index, failures);
  simulation::PolicyReport report =
      simulation::make_policy_report(label, requests_.size(), outcomes, options_.workers);
  report.failures.assign(failures.begin(), failures.end());
  if (report.makespan_s > 0) {
    report.utilization =
        run.busy_ms() / (1000.0 * report.makespan_s * static_cast<double>(options_.workers));
  }
  return report;
}

}  // namespace kvr::replay
