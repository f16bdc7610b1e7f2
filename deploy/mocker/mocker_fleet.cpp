#include "deploy/mocker/mocker_fleet.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_map.h"
#include "deploy/mocker/kv_transfer_params.hpp"
#include "deploy/simulation/engine.hpp"
#include "deploy/worker/worker_inbox.hpp"
#include "deploy/worker/worker_publisher.hpp"
#include "discovery/block_hash.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/metrics/rate_limited_log.hpp"
#include "messages/subjects.hpp"

namespace kvr::mocker {
namespace {

using Clock = std::chrono::steady_clock;
using simulation::Engine;
using simulation::EngineRequest;
using simulation::EngineRequestId;
using simulation::StepResult;

// GenerateRequest.kv_transfer_params' documented bound.
constexpr std::size_t kMaxKvTransferParamsBytes = 64 * 1024;

// What a NATS callback hands to the fleet thread.
enum class InboxKind : std::uint8_t { Generate, Cancel, Dump, Discover };

struct InboxItem {
  InboxKind kind;
  WorkerId worker = 0;
  nats::NatsMessage message;
};

struct RankState {
  Engine engine;
  EventId next_event_id = 1;
  // A step runs from its start to step_end_ms; its tokens appear (are published) at the end.
  std::optional<StepResult> in_flight;
  // Prefill hops' held blocks: (when the modelled transfer is over, engine request id).
  std::vector<std::pair<double, EngineRequestId>> pending_releases;
};

struct WorkerState {
  WorkerId id = 0;
  Incarnation incarnation = 0;

  worker::WorkerInstance instance() const { return {id, incarnation}; }
  std::vector<RankState> ranks;
  std::vector<nats::NatsSubscription> subscriptions;
};

// A generation being streamed back to its caller.
struct Stream {
  std::string request_id;
  std::string stream_subject;
  WorkerId worker = 0;
  DpRank rank = 0;
  std::uint32_t next_index = 0;
  std::uint64_t cached_prompt_tokens = 0;
  // A prefill hop (do_remote_decode): its last chunk carries the decode hop's kv_transfer_params.
  bool remote_decode = false;
};

}  // namespace

std::expected<void, std::string> MockerOptions::validate() const {
  if (!subjects::is_valid_namespace(ns)) {
    return std::unexpected("--namespace must be non-empty and use only [A-Za-z0-9_-]");
  }
  if (workers == 0 || workers > 4096) return std::unexpected("--workers must be in [1, 4096]");
  if (data_parallel_size == 0 || data_parallel_size > 64) {
    return std::unexpected("--data-parallel-size must be in [1, 64]");
  }
  if (model.empty()) return std::unexpected("--model must not be empty");
  if (liveness_ttl < std::chrono::milliseconds(100)) {
    return std::unexpected("--liveness-ttl-ms must be at least 100");
  }
  if (load_interval < std::chrono::milliseconds(1)) {
    return std::unexpected("--load-interval-ms must be at least 1");
  }
  if (auto valid = engine.validate(); !valid) return std::unexpected(valid.error().message());
  return {};
}

struct MockerFleet::State {
  MockerOptions options;
  std::unique_ptr<nats::NatsClient> nats;
  // Set when the fleet closes its connection on purpose: that end is no outage.
  std::atomic<bool> closing{false};
  // Bad input from the network is counted, and logged at most once per kind and window.
  metrics::RateLimitedLog log;
  // Speaks the worker side of the protocol on `nats`.
  std::optional<worker::WorkerPublisher> publisher;
  // What every worker of the fleet registers as.
  worker::WorkerDescription description;
  std::vector<WorkerState> workers;
  absl::flat_hash_map<WorkerId, std::size_t> worker_index;
  std::optional<nats::NatsSubscription> discover_subscription;

  worker::WorkerInbox<InboxItem> inbox;

  absl::flat_hash_map<EngineRequestId, Stream> streams;
  // (worker, caller's request id) → engine request id, for cancellation.
  absl::flat_hash_map<std::pair<WorkerId, std::string>, EngineRequestId> by_request_id;
  EngineRequestId next_request_id = 1;
  Clock::time_point start = Clock::now();
  MockerStats stats;

  double now_ms() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }

  void enqueue(InboxKind kind, WorkerId worker, nats::NatsMessage message) {
    inbox.push(InboxItem{kind, worker, std::move(message)});
  }

  void publish_registrations() {
    for (const WorkerState& worker : workers) {
      publisher->publish_registration(worker.instance(), description);
    }
  }

  void publish_heartbeats() {
    for (const WorkerState& worker : workers) publisher->publish_heartbeat(worker.instance());
  }

  void publish_load() {
    std::vector<discovery::ConfirmedLoad> ranks;
    for (const WorkerState& worker : workers) {
      ranks.clear();
      for (const RankState& rank : worker.ranks) {
        ranks.push_back(simulation::load_report(rank.engine.load()));
      }
      publisher->publish_load(worker.instance(), ranks);
    }
  }

  void publish_deregistrations() {
    for (const WorkerState& worker : workers) {
      publisher->publish_deregistration(worker.instance(), "mocker shutting down");
    }
  }

  void publish_kv_events(WorkerState& worker, DpRank rank, std::vector<KvEvent>& events) {
    if (events.empty() || !options.publish_kv_events) {
      events.clear();
      return;
    }
    RankState& state = worker.ranks[rank];
    KvEventBatch batch{.worker = {worker.id, rank},
                       .incarnation = worker.incarnation,
                       .event_id = state.next_event_id++,
                       .events = std::move(events)};
    events.clear();
    publisher->publish_kv_batch(batch);
    ++stats.kv_event_batches;
  }

  void publish_chunk(const Stream& stream, std::uint32_t index, std::vector<std::uint32_t> tokens,
                     bool finished, std::string_view finish_reason,
                     const v1::RouteError* error = nullptr,
                     std::string_view kv_transfer_params = {}) {
    v1::GenerateChunk chunk;
    chunk.set_request_id(stream.request_id);
    chunk.set_index(index);
    for (std::uint32_t token : tokens) chunk.add_token_ids(token);
    chunk.set_worker_id(stream.worker);
    chunk.set_dp_rank(stream.rank);
    if (index == 0)
      chunk.set_cached_prompt_tokens(static_cast<std::uint32_t>(stream.cached_prompt_tokens));
    chunk.set_finished(finished);
    chunk.set_finish_reason(std::string{finish_reason});
    if (error != nullptr) *chunk.mutable_error() = *error;
    if (!kv_transfer_params.empty()) chunk.set_kv_transfer_params(std::string{kv_transfer_params});
    publisher->publish(stream.stream_subject, chunk);
  }

  void reject_generate(const std::string& stream_subject, const std::string& request_id,
                       WorkerId worker, std::string_view reason) {
    ++stats.rejected_requests;
    log.warn("generate-rejected", fmt::format("mocker: worker {} rejects generate '{}': {}", worker,
                                              request_id, reason));
    if (stream_subject.empty()) return;
    v1::RouteError error;
    error.set_code(v1::ROUTE_ERROR_INVALID_REQUEST);
    error.set_message(std::string{reason});
    publish_chunk(
        Stream{.request_id = request_id, .stream_subject = stream_subject, .worker = worker}, 0, {},
        true, "error", &error);
  }

  void handle_generate(WorkerState& worker, const nats::NatsMessage& message) {
    v1::GenerateRequest request;
    if (!request.ParseFromString(message.data)) {
      ++stats.bad_messages;
      log.warn("malformed-GenerateRequest",
               fmt::format("mocker: worker {} dropped a malformed GenerateRequest", worker.id));
      return;
    }
    ++stats.generate_requests;
    const auto& route = request.route();
    const std::string& stream_subject = request.stream_subject();
    if (stream_subject.empty()) {
      reject_generate({}, route.request_id(), worker.id, "stream_subject is empty");
      return;
    }
    if (request.dp_rank() >= worker.ranks.size()) {
      reject_generate(stream_subject, route.request_id(), worker.id, "dp_rank out of range");
      return;
    }
    const auto kv_transfer = read_kv_transfer(request.kv_transfer_params());
    if (!kv_transfer) {
      reject_generate(stream_subject, route.request_id(), worker.id, kv_transfer.error());
      return;
    }
    const bool remote_decode = kv_transfer->kv_transfer == simulation::KvTransfer::remote_decode;
    std::uint32_t output_tokens = request.max_output_tokens();
    if (output_tokens == 0 && route.has_expected_output_tokens()) {
      output_tokens = route.expected_output_tokens();
    }
    // A prefill hop makes one token whatever it asks for.
    if (remote_decode) output_tokens = 1;
    if (output_tokens == 0 || output_tokens > simulation::kMaxOutputTokens) {
      reject_generate(stream_subject, route.request_id(), worker.id,
                      "max_output_tokens must be in [1, 1048576]");
      return;
    }
    EngineRequest engine_request{.id = next_request_id,
                                 .output_tokens = output_tokens,
                                 .kv_transfer = kv_transfer->kv_transfer,
                                 .remote_blocks = kv_transfer->remote_blocks};
    if (route.has_tokens()) {
      const auto& ids = route.tokens().ids();
      if (ids.empty() || static_cast<std::size_t>(ids.size()) > simulation::kMaxPromptTokens) {
        reject_generate(stream_subject, route.request_id(), worker.id, "prompt is empty or absurd");
        return;
      }
      const discovery::BlockHasher hasher{options.engine.block_size, route.cache_namespace()};
      engine_request.block_hashes = hasher.sequence_hashes(
          std::span<const std::uint32_t>{ids.data(), static_cast<std::size_t>(ids.size())});
      engine_request.prompt_tokens = static_cast<std::uint64_t>(ids.size());
    } else if (route.has_block_hashes()) {
      const auto& hashes = route.block_hashes();
      engine_request.prompt_tokens = hashes.prompt_tokens();
      engine_request.block_hashes.assign(hashes.hashes().begin(), hashes.hashes().end());
      if (engine_request.prompt_tokens == 0 ||
          engine_request.prompt_tokens > simulation::kMaxPromptTokens) {
        reject_generate(stream_subject, route.request_id(), worker.id,
                        "prompt_tokens is 0 or absurd");
        return;
      }
    } else {
      reject_generate(stream_subject, route.request_id(), worker.id, "the request has no prompt");
      return;
    }
    const auto key = std::make_pair(worker.id, route.request_id());
    if (by_request_id.contains(key)) {
      reject_generate(stream_subject, route.request_id(), worker.id, "duplicate request id");
      return;
    }
    RankState& rank = worker.ranks[request.dp_rank()];
    if (auto added = rank.engine.add_request(std::move(engine_request), now_ms()); !added) {
      reject_generate(stream_subject, route.request_id(), worker.id,
                      simulation::as_str(added.error()));
      return;
    }
    streams.emplace(next_request_id, Stream{.request_id = route.request_id(),
                                            .stream_subject = stream_subject,
                                            .worker = worker.id,
                                            .rank = request.dp_rank(),
                                            .remote_decode = remote_decode});
    by_request_id.emplace(key, next_request_id);
    ++next_request_id;
  }

  // GenerateRequest.kv_transfer_params: empty for an ordinary request, else vLLM's JSON object.
  static std::expected<KvTransferRequest, std::string> read_kv_transfer(std::string_view text) {
    if (text.empty()) return KvTransferRequest{};
    if (text.size() > kMaxKvTransferParamsBytes) {
      return std::unexpected("kv_transfer_params exceeds 64 KiB");
    }
    const auto params = nlohmann::json::parse(text, nullptr, false);
    if (params.is_discarded() || !params.is_object()) {
      return std::unexpected("kv_transfer_params must be a JSON object");
    }
    return read_kv_transfer_params(params);
  }

  void handle_cancel(WorkerState& worker, const nats::NatsMessage& message) {
    v1::GenerateCancel cancel;
    if (!cancel.ParseFromString(message.data)) {
      ++stats.bad_messages;
      log.warn("malformed-GenerateCancel",
               fmt::format("mocker: worker {} dropped a malformed GenerateCancel", worker.id));
      return;
    }
    auto found = by_request_id.find(std::make_pair(worker.id, cancel.request_id()));
    if (found == by_request_id.end()) return;  // already finished: nothing to cancel
    const EngineRequestId id = found->second;
    by_request_id.erase(found);
    auto stream = streams.extract(id);
    if (stream.empty()) return;
    worker.ranks[stream.mapped().rank].engine.abort_request(id);
    publish_chunk(stream.mapped(), stream.mapped().next_index, {}, true, "cancelled");
    ++stats.cancelled_requests;
  }

  void handle_dump(WorkerState& worker, const nats::NatsMessage& message) {
    const auto requested =
        worker::read_dump_request(message, static_cast<std::uint32_t>(worker.ranks.size()));
    if (!requested) {
      ++stats.bad_messages;
      log.warn("malformed-KvDumpRequest",
               fmt::format("mocker: worker {} dropped a malformed KvDumpRequest", worker.id));
      return;
    }
    const DpRank rank_id = *requested;
    RankState& rank = worker.ranks[rank_id];
    // The running step already changed the pool: announce its events before the dump so that
    // last_event_id covers everything the dump contains.
    if (rank.in_flight) publish_kv_events(worker, rank_id, rank.in_flight->kv_events);
    KvDump dump{.worker = {worker.id, rank_id},
                .incarnation = worker.incarnation,
                .last_event_id = rank.next_event_id - 1,
                .stored = rank.engine.dump()};
    publisher->publish_dump(message.reply, dump);
    ++stats.dumps_served;
  }

  std::uint32_t token_for(EngineRequestId id, std::uint32_t index) const {
    // Synthetic output tokens; deterministic so streams are reproducible.
    return static_cast<std::uint32_t>((id * 7919 + index) % 32000);
  }

  // What rank `rank` of `worker` names as the source of its prefill hops' KV.
  static KvTransferSource transfer_source(WorkerId worker, DpRank rank) {
    return KvTransferSource{.engine_id = fmt::format("kvr-mocker-{}-{}", worker, rank),
                            .host = "127.0.0.1",
                            .port = static_cast<std::uint16_t>(kNixlSideChannelPort + rank)};
  }

  // Publishes what a finished step produced.
  void deliver(WorkerState& worker, DpRank rank_id, StepResult& result) {
    RankState& rank = worker.ranks[rank_id];
    publish_kv_events(worker, rank_id, result.kv_events);
    absl::flat_hash_map<EngineRequestId, bool> finished;
    for (const auto& done : result.completions) {
      finished[done.id] = true;
      // Held for the decode worker even when the caller cancelled meanwhile; with no side channel
      // from it, released when the modelled transfer of that many blocks would be over.
      if (done.held_blocks > 0) {
        rank.pending_releases.emplace_back(
            result.end_ms() + rank.engine.transfer_ms(done.held_blocks), done.id);
      }
    }
    auto emit = [&](EngineRequestId id, std::optional<std::uint64_t> cached) {
      auto stream = streams.find(id);
      if (stream == streams.end()) return;  // cancelled while the step ran
      if (cached) stream->second.cached_prompt_tokens = *cached;
      const std::uint32_t index = stream->second.next_index++;
      const bool last = finished.contains(id);
      std::string kv_transfer_params;
      if (last && stream->second.remote_decode) {
        kv_transfer_params =
            kv_transfer_answer(transfer_source(worker.id, rank_id), stream->second.request_id,
                               rank.engine.held_blocks(id))
                .dump();
      }
      publish_chunk(stream->second, index, {token_for(id, index)}, last, last ? "length" : "",
                    nullptr, kv_transfer_params);
      if (last) {
        by_request_id.erase(std::make_pair(worker.id, stream->second.request_id));
        streams.erase(stream);
        ++stats.completed_requests;
      }
    };
    for (const auto& first : result.first_tokens) emit(first.id, first.cached_prompt_tokens);
    for (EngineRequestId id : result.next_tokens) emit(id, std::nullopt);
  }

  // Releases the rank's held blocks whose modelled transfer is over; returns when the next is.
  static std::optional<double> release_transfers(RankState& rank, double now) {
    std::optional<double> next;
    std::size_t kept = 0;
    for (const auto& [release_ms, id] : rank.pending_releases) {
      if (release_ms <= now) {
        rank.engine.release_transfer(id);
        continue;
      }
      next = std::min(next.value_or(release_ms), release_ms);
      rank.pending_releases[kept++] = {release_ms, id};
    }
    rank.pending_releases.resize(kept);
    return next;
  }

  // Advances every engine to `now`; returns when the next step ends or held blocks are due for
  // release (nullopt when idle).
  std::optional<double> advance(double now) {
    std::optional<double> next_wake;
    for (WorkerState& worker : workers) {
      for (std::size_t r = 0; r < worker.ranks.size(); ++r) {
        RankState& rank = worker.ranks[r];
        if (const std::optional<double> release = release_transfers(rank, now)) {
          next_wake = std::min(next_wake.value_or(*release), *release);
        }
        double step_start = now;
        if (rank.in_flight) {
          if (rank.in_flight->end_ms() > now) {
            next_wake =
                std::min(next_wake.value_or(rank.in_flight->end_ms()), rank.in_flight->end_ms());
            continue;
          }
          step_start = rank.in_flight->end_ms();
          StepResult done = std::move(*rank.in_flight);
          rank.in_flight.reset();
          deliver(worker, static_cast<DpRank>(r), done);
        }
        if (rank.engine.has_work()) {
          // Steps run back to back from the previous step's end, so a late wake-up does not
          // stretch simulated time; an idle engine starts at once.
          rank.in_flight = rank.engine.step(step_start);
          next_wake =
              std::min(next_wake.value_or(rank.in_flight->end_ms()), rank.in_flight->end_ms());
        }
      }
    }
    return next_wake;
  }
};

MockerFleet::MockerFleet(std::unique_ptr<State> state) : state_(std::move(state)) {}
MockerFleet::~MockerFleet() {
  if (state_) {
    state_->discover_subscription.reset();
    for (auto& worker : state_->workers) worker.subscriptions.clear();
    // Closed before the inbox its reconnect handler writes to is destroyed.
    state_->closing.store(true);
    state_->nats.reset();
  }
}

std::expected<std::unique_ptr<MockerFleet>, std::string> MockerFleet::create(
    MockerOptions options) {
  if (auto valid = options.validate(); !valid) return std::unexpected(valid.error());
  auto state = std::make_unique<State>();
  options.nats.use_global_message_delivery = true;  // 3 subscriptions per worker share threads
  State* raw = state.get();
  // A router that lost its view during the outage (or started meanwhile) hears of every worker
  // again as soon as this process is back; the fleet thread publishes the registrations.
  nats::NatsEventHandlers handlers;
  handlers.on_disconnected = [raw] {
    if (!raw->closing.load()) spdlog::warn("mocker: NATS connection lost; reconnecting");
  };
  handlers.on_reconnected = [raw] {
    spdlog::info("mocker: NATS reconnected; registering every worker again");
    raw->enqueue(InboxKind::Discover, 0, {});
  };
  auto client = nats::NatsClient::connect(options.nats, std::move(handlers));
  if (!client) return std::unexpected(client.error());
  state->nats = std::move(*client);
  state->options = std::move(options);
  const MockerOptions& opts = state->options;
  state->publisher.emplace(*state->nats, opts.ns, "mocker");
  state->description =
      worker::WorkerDescription{.model = opts.model,
                                .role = opts.role,
                                .routing_group = opts.routing_group,
                                .block_size = opts.engine.block_size,
                                .total_kv_blocks = opts.engine.num_gpu_blocks,
                                .data_parallel_size = opts.data_parallel_size,
                                .taints = opts.taints,
                                .max_num_batched_tokens = opts.engine.max_num_batched_tokens,
                                .max_num_seqs = opts.engine.max_num_seqs,
                                .publishes_kv_events = opts.publish_kv_events,
                                .liveness_ttl = opts.liveness_ttl};

  std::random_device entropy;
  std::mt19937_64 random{(static_cast<std::uint64_t>(entropy()) << 32) ^ entropy()};
  const WorkerId base = opts.worker_id_base != 0 ? opts.worker_id_base : (random() >> 16) + 1;
  for (std::uint32_t i = 0; i < opts.workers; ++i) {
    WorkerState worker;
    worker.id = base + i;
    worker.incarnation = random() | 1;
    for (std::uint32_t r = 0; r < opts.data_parallel_size; ++r) {
      auto engine = Engine::create(opts.engine);
      if (!engine) return std::unexpected(engine.error().message());
      worker.ranks.push_back(RankState{.engine = std::move(*engine)});
    }
    const WorkerId id = worker.id;
    const auto to_inbox = [raw, id](InboxKind kind) {
      return [raw, id, kind](nats::NatsMessage message) {
        raw->enqueue(kind, id, std::move(message));
      };
    };
    auto subscriptions = raw->publisher->subscribe_worker(
        id, worker::WorkerSubjectHandlers{.on_generate = to_inbox(InboxKind::Generate),
                                          .on_cancel = to_inbox(InboxKind::Cancel),
                                          .on_dump = to_inbox(InboxKind::Dump)});
    if (!subscriptions) return std::unexpected(subscriptions.error());
    worker.subscriptions = std::move(*subscriptions);
    state->worker_index.emplace(id, state->workers.size());
    state->workers.push_back(std::move(worker));
  }
  auto discover =
      raw->publisher->subscribe_discover([raw] { raw->enqueue(InboxKind::Discover, 0, {}); });
  if (!discover) return std::unexpected(discover.error());
  state->discover_subscription = std::move(*discover);
  if (auto flushed = state->nats->flush(std::chrono::seconds(5)); !flushed) {
    return std::unexpected(flushed.error());
  }
  return std::unique_ptr<MockerFleet>(new MockerFleet(std::move(state)));
}

std::vector<WorkerId> MockerFleet::worker_ids() const {
  std::vector<WorkerId> ids;
  for (const auto& worker : state_->workers) ids.push_back(worker.id);
  return ids;
}

MockerStats MockerFleet::run(std::stop_token stop) {
  State& state = *state_;
  state.publish_registrations();
  state.publish_heartbeats();
  state.publish_load();
  worker::PeriodicTimer heartbeat{
      worker::heartbeat_interval(state.options.liveness_ttl),
      Clock::now() + worker::heartbeat_interval(state.options.liveness_ttl)};
  worker::PeriodicTimer load{state.options.load_interval,
                             Clock::now() + state.options.load_interval};

  std::deque<InboxItem> batch;
  while (!stop.stop_requested()) {
    state.inbox.take_all(batch);
    for (InboxItem& item : batch) {
      if (item.kind == InboxKind::Discover) {
        state.publish_registrations();
        continue;
      }
      WorkerState& worker = state.workers[state.worker_index.at(item.worker)];
      switch (item.kind) {
        case InboxKind::Generate:
          state.handle_generate(worker, item.message);
          break;
        case InboxKind::Cancel:
          state.handle_cancel(worker, item.message);
          break;
        case InboxKind::Dump:
          state.handle_dump(worker, item.message);
          break;
        case InboxKind::Discover:
          break;
      }
    }
    batch.clear();

    const std::optional<double> next_step_ms = state.advance(state.now_ms());
    const auto now = Clock::now();
    if (heartbeat.fire(now)) state.publish_heartbeats();
    if (load.fire(now)) state.publish_load();
    auto wake = std::min(heartbeat.next(), load.next());
    if (next_step_ms) {
      wake = std::min(wake,
                      state.start + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double, std::milli>(*next_step_ms)));
    }
    state.inbox.wait_until(stop, wake);
  }
  state.publish_deregistrations();
  state.publisher->flush(std::chrono::seconds(2));
  return state.stats;
}

}  // namespace kvr::mocker
