#include "deploy/replay/live_replay.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/error.hpp"
#include "messages/subjects.hpp"

namespace kvr::replay {
namespace {

using Clock = std::chrono::steady_clock;
using nats::NatsClient;
using nats::NatsMessage;
using nats::NatsSubscription;

// A message for the driver thread, stamped when the client delivered it.
struct Incoming {
  std::string subject;
  std::string data;
  Clock::time_point received;
};

// What a message on the replay's inbox answers: <inbox>.<kind>.<request index>.
enum class InboxKind : char { Route = 'r', Stream = 's', Ack = 'a' };

enum class Phase : std::uint8_t { Waiting, Routing, Streaming, Done };

// One trace request's progress; owned by the driver thread.
struct LiveRequest {
  Phase phase = Phase::Waiting;
  Clock::time_point sent;
  // Route asks sent, and those not yet answered (docs/protocol.md: a client asks again).
  int route_asks = 0;
  int route_asks_unanswered = 0;
  std::string booking_id;
  std::string generate_subject;
  WorkerWithDpRank worker;
  bool first_token_seen = false;
  double first_token_ms = 0;
  std::uint64_t cached_prompt_tokens = 0;
  // The decision's overlap in tokens: what the router predicted cached.
  std::uint64_t predicted_cached_tokens = 0;
  std::uint64_t output_tokens = 0;
};

using simulation::ms_between;

std::string random_run_id() {
  std::random_device entropy;
  return fmt::format("{:08x}", entropy());
}

nlohmann::json latency_json(const simulation::LatencySummary& summary) {
  const auto rounded = [](double value) { return std::round(value * 1e6) / 1e6; };
  return nlohmann::json{{"max", rounded(summary.max)},
                        {"mean", rounded(summary.mean)},
                        {"p50", rounded(summary.p50)},
                        {"p90", rounded(summary.p90)},
                        {"p99", rounded(summary.p99)}};
}

}  // namespace

struct LiveReplay::State {
  LiveReplayOptions options;
  std::unique_ptr<NatsClient> client;
  std::string inbox;
  std::string run_id = random_run_id();
  std::uint32_t block_size = 0;
  std::size_t fleet_size = 0;
  // The announced workers' KV blocks, every rank's.
  std::uint64_t fleet_kv_blocks = 0;

  // Filled by the client's delivery thread, drained by the driver.
  std::mutex mutex;
  std::condition_variable signal;
  std::vector<Incoming> incoming;
  // Its callback uses the members above; ~State ends it (and the connection) first.
  std::optional<NatsSubscription> subscription;

  // The subscription, then the connection (whose closed callback queues a message), end before
  // the queue they fill.
  ~State() {
    subscription.reset();
    client.reset();
  }

  // ---- the driver's state during run() ----
  const std::vector<simulation::TraceRequest>* requests = nullptr;
  std::vector<std::vector<BlockHash>> hashes;
  std::vector<LiveRequest> live;
  std::vector<simulation::ReplayRequestOutcome> outcomes;
  std::map<std::string, std::size_t> failures;
  std::vector<double> route_rtts;
  std::set<std::string> policies;
  LiveReplayResult result;
  Clock::time_point start;
  double first_timestamp_ms = 0;
  std::size_t in_flight = 0;
  std::size_t ended = 0;
  // Set when the connection closed for good: nothing can be sent or received any more.
  bool connection_closed = false;
  // Lifecycle reports not acknowledged yet, by the number their ack subject carries: a report
  // that reached a hung node is sent again, as route requests are asked again.
  struct PendingReport {
    std::string payload;
    int sends = 0;
  };
  std::map<std::uint64_t, PendingReport> pending_reports;
  std::uint64_t next_report = 0;
  std::priority_queue<std::pair<Clock::time_point, std::uint64_t>,
                      std::vector<std::pair<Clock::time_point, std::uint64_t>>, std::greater<>>
      report_resends;
  std::priority_queue<std::pair<Clock::time_point, std::size_t>,
                      std::vector<std::pair<Clock::time_point, std::size_t>>, std::greater<>>
      deadlines;
  // When a request still routing asks again.
  std::priority_queue<std::pair<Clock::time_point, std::size_t>,
                      std::vector<std::pair<Clock::time_point, std::size_t>>, std::greater<>>
      next_asks;

  std::string request_id(std::size_t index) const {
    return fmt::format("live-{}-{}", run_id, index);
  }
  std::string reply_subject(InboxKind kind, std::size_t index) const {
    return fmt::format("{}.{}.{}", inbox, static_cast<char>(kind), index);
  }

  // When trace request `index` is due, on the driver's clock.
  Clock::time_point due(std::size_t index) const {
    const double offset_ms =
        (static_cast<double>((*requests)[index].timestamp_ms) - first_timestamp_ms) /
        options.speedup;
    return start + std::chrono::duration_cast<Clock::duration>(
                       std::chrono::duration<double, std::milli>(offset_ms));
  }

  v1::RouteRequest route_request(std::size_t index) const {
    const simulation::TraceRequest& trace = (*requests)[index];
    v1::RouteRequest request;
    request.set_request_id(request_id(index));
    request.set_model(options.model);
    request.set_expected_output_tokens(std::max<std::uint32_t>(1, trace.output_length));
    request.set_tenant(tenant_of(options, index));
    if (options.send_tokens) {
      for (std::uint32_t token : simulation::synthesize_prompt_tokens(trace)) {
        request.mutable_tokens()->add_ids(token);
      }
    } else {
      auto* block_hashes = request.mutable_block_hashes();
      block_hashes->set_prompt_tokens(trace.input_length);
      for (BlockHash hash : hashes[index]) block_hashes->add_hashes(hash);
    }
    return request;
  }

  void end(std::size_t index) {
    live[index].phase = Phase::Done;
    --in_flight;
    ++ended;
    if (options.on_progress) options.on_progress(ended);
  }

  void fail(std::size_t index, const std::string& reason) {
    ++failures[reason];
    end(index);
  }

  // `cause`: for an abort, who is to blame (the router's passive health counts the worker's).
  void report(const std::string& booking_id, v1::LifecycleEvent event, std::string_view error = {},
              v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED) {
    v1::LifecycleReport report;
    report.set_booking_id(booking_id);
    report.set_event(event);
    report.set_error(std::string{error});
    report.set_abort_cause(cause);
    const std::uint64_t number = next_report++;
    PendingReport& pending = pending_reports[number];
    pending.payload = report.SerializeAsString();
    send_report(number, pending, Clock::now());
  }

  void send_report(std::uint64_t number, PendingReport& pending, Clock::time_point now) {
    ++pending.sends;
    if (pending.sends < options.route_retry.max_attempts) {
      report_resends.emplace(now + options.route_retry.retry_after, number);
    }
    (void)client->publish_request(subjects::router_report(options.ns),
                                  reply_subject(InboxKind::Ack, number), pending.payload);
  }

  void resend_reports(Clock::time_point now) {
    while (!report_resends.empty() && report_resends.top().first <= now) {
      const std::uint64_t number = report_resends.top().second;
      report_resends.pop();
      auto pending = pending_reports.find(number);
      if (pending != pending_reports.end() && !connection_closed) {
        send_report(number, pending->second, now);
      }
    }
  }

  // Stops a streaming request at its worker and releases its booking.
  void abandon(std::size_t index, std::string_view why, v1::AbortCause cause) {
    LiveRequest& request = live[index];
    if (!request.generate_subject.empty()) {
      v1::GenerateCancel cancel;
      cancel.set_request_id(request_id(index));
      (void)client->publish(request.generate_subject + ".cancel", cancel.SerializeAsString());
    }
    report(request.booking_id, v1::LIFECYCLE_EVENT_ABORTED, why, cause);
  }

  void dispatch(std::size_t index, Clock::time_point now) {
    LiveRequest& request = live[index];
    request.phase = Phase::Routing;
    request.sent = now;
    ++in_flight;
    if (connection_closed) {
      ++result.route_errors;
      return fail(index, "the NATS connection closed");
    }
    deadlines.emplace(now + options.request_timeout, index);
    ask_route(index, now);
  }

  // Sends route ask number live[index].route_asks, with a fresh id after the first; every ask
  // replies to the request's one route inbox, where the first final decision wins and a later
  // success is released.
  void ask_route(std::size_t index, Clock::time_point now) {
    LiveRequest& request = live[index];
    v1::RouteRequest route = route_request(index);
    route.set_request_id(nats::attempt_request_id(route.request_id(), request.route_asks));
    if (request.route_asks > 0) ++result.route_asks_repeated;
    ++request.route_asks;
    if (request.route_asks < options.route_retry.max_attempts) {
      next_asks.emplace(now + options.route_retry.retry_after, index);
    }
    auto sent =
        client->publish_request(subjects::router_route(options.ns),
                                reply_subject(InboxKind::Route, index), route.SerializeAsString());
    if (sent) {
      ++request.route_asks_unanswered;
    } else if (request.route_asks_unanswered == 0 &&
               request.route_asks >= options.route_retry.max_attempts) {
      ++result.route_errors;
      fail(index, "cannot send the route request");
    }
  }

  void on_route_reply(std::size_t index, const Incoming& message) {
    LiveRequest& request = live[index];
    v1::RouteDecision decision;
    const bool parsed = decision.ParseFromString(message.data);
    if (request.phase != Phase::Routing) {
      // A decision that came after the request timed out: release its booking at once.
      if (parsed && decision.has_success()) {
        report(decision.success().booking_id(), v1::LIFECYCLE_EVENT_ABORTED, "client timed out",
               v1::ABORT_CAUSE_CLIENT_CANCELLED);
      }
      return;
    }
    --request.route_asks_unanswered;
    const bool asks_exhausted = request.route_asks >= options.route_retry.max_attempts;
    if (!parsed || message.data.empty() || nats::asks_for_retry(decision)) {
      // No responders (NATS's empty status message), garbage, or a partition that moved: the
      // request is answered by a later ask, unless none is left.
      if (!asks_exhausted && parsed && !message.data.empty()) {
        ask_route(index, message.received);
        return;
      }
      if (!asks_exhausted || request.route_asks_unanswered > 0) return;
    }
    route_rtts.push_back(ms_between(request.sent, message.received));
    if (!parsed) {
      ++result.route_errors;
      return fail(index, "route: undecodable RouteDecision");
    }
    if (decision.has_error() && is_admission_rejection(decision.error().code())) {
      // An answer, not a failure: the router is up and chose to refuse the request.
      ++result.rejected_by_admission;
      ++result.rejected_by_code[v1::RouteErrorCode_Name(decision.error().code())];
      return end(index);
    }
    if (decision.has_error()) {
      ++result.route_errors;
      return fail(index,
                  fmt::format("route: {}", v1::RouteErrorCode_Name(decision.error().code())));
    }
    if (!decision.has_success()) {
      // NATS answers a request nobody subscribes to with an empty status message.
      ++result.route_errors;
      return fail(index, "route: no router answered");
    }
    const v1::RouteSuccess& success = decision.success();
    request.booking_id = success.booking_id();
    request.generate_subject = success.generate_subject();
    request.worker = {success.worker_id(), success.dp_rank()};
    request.predicted_cached_tokens =
        (std::uint64_t{success.device_overlap_blocks()} + success.host_overlap_blocks() +
         success.disk_overlap_blocks()) *
        block_size;
    ++result.decisions_per_worker[success.worker_id()];
    policies.insert(success.policy());
    if (request.generate_subject.empty()) {
      ++result.worker_errors;
      report(request.booking_id, v1::LIFECYCLE_EVENT_ABORTED, "no generate subject",
             v1::ABORT_CAUSE_WORKER_FAILED);
      return fail(index, "route: the decision names no generate subject");
    }
    v1::GenerateRequest generate;
    *generate.mutable_route() = route_request(index);
    generate.set_max_output_tokens(std::max<std::uint32_t>(1, (*requests)[index].output_length));
    generate.set_dp_rank(success.dp_rank());
    generate.set_stream_subject(reply_subject(InboxKind::Stream, index));
    // With a reply subject, NATS answers at once (an empty message) when no worker subscribes.
    if (!client->publish_request(request.generate_subject, reply_subject(InboxKind::Stream, index),
                                 generate.SerializeAsString())) {
      ++result.worker_errors;
      // The client's own connection failed, not the worker.
      report(request.booking_id, v1::LIFECYCLE_EVENT_ABORTED, "dispatch failed",
             v1::ABORT_CAUSE_CLIENT_CANCELLED);
      return fail(index, "generate: cannot dispatch to the worker");
    }
    request.phase = Phase::Streaming;
  }

  void on_chunk(std::size_t index, const Incoming& message) {
    LiveRequest& request = live[index];
    if (request.phase != Phase::Streaming) return;  // after a timeout or the end
    v1::GenerateChunk chunk;
    if (!message.data.empty() && !chunk.ParseFromString(message.data)) {
      ++result.worker_errors;
      abandon(index, "undecodable chunk", v1::ABORT_CAUSE_WORKER_FAILED);
      return fail(index, "generate: undecodable GenerateChunk");
    }
    if (message.data.empty() || chunk.has_error() || chunk.finish_reason() == "error" ||
        chunk.finish_reason() == "cancelled") {
      ++result.worker_errors;
      const std::string reason = message.data.empty()
                                     ? std::string{"no worker subscribed to the generate subject"}
                                 : chunk.has_error() ? chunk.error().message()
                                                     : chunk.finish_reason();
      report(request.booking_id, v1::LIFECYCLE_EVENT_ABORTED, reason,
             v1::ABORT_CAUSE_WORKER_FAILED);
      return fail(index, fmt::format("worker: {}", reason));
    }
    const double now_ms = ms_between(start, message.received);
    if (!request.first_token_seen) {
      request.first_token_seen = true;
      request.first_token_ms = now_ms;
      request.cached_prompt_tokens = chunk.cached_prompt_tokens();
      report(request.booking_id, v1::LIFECYCLE_EVENT_FIRST_TOKEN);
    }
    request.output_tokens += static_cast<std::uint64_t>(chunk.token_ids_size());
    if (!chunk.finished()) return;
    report(request.booking_id, v1::LIFECYCLE_EVENT_COMPLETED);
    const simulation::TraceRequest& trace = (*requests)[index];
    simulation::RequestStats stats;
    stats.id = index;
    stats.arrival_ms = ms_between(start, due(index));
    stats.first_token_ms = request.first_token_ms;
    stats.completion_ms = now_ms;
    stats.prompt_tokens = trace.input_length;
    stats.cached_prompt_tokens = request.cached_prompt_tokens;
    stats.output_tokens = request.output_tokens;
    outcomes.push_back(simulation::ReplayRequestOutcome{
        .trace_index = index,
        .worker = request.worker,
        .stats = stats,
        .predicted_cached_tokens = request.predicted_cached_tokens});
    end(index);
  }

  void on_ack(std::uint64_t number, const Incoming& message) {
    // NATS's "no responders": the report is sent again at its time.
    if (message.data.empty()) return;
    // The first answer counts; a resent report's second one finds nothing pending.
    auto pending = pending_reports.find(number);
    if (pending == pending_reports.end()) return;
    pending_reports.erase(pending);
    // Reports are idempotent: whichever copy of a resent report is answered first, a refusal
    // means the booking expired or was never issued.
    v1::LifecycleAck ack;
    if (!ack.ParseFromString(message.data) || !ack.accepted()) ++result.reports_refused;
  }

  void handle(const Incoming& message) {
    if (message.subject.empty()) return on_connection_closed();
    // <inbox>.<kind>.<index>
    if (message.subject.size() < inbox.size() + 4) return;
    const std::string_view rest = std::string_view{message.subject}.substr(inbox.size() + 1);
    if (rest.size() < 3 || rest[1] != '.') return;
    std::size_t index = 0;  // a report's number for an ack
    const auto [end_of_number, parse_error] =
        std::from_chars(rest.data() + 2, rest.data() + rest.size(), index);
    if (parse_error != std::errc{} || end_of_number != rest.data() + rest.size()) return;
    if (static_cast<InboxKind>(rest[0]) == InboxKind::Ack) return on_ack(index, message);
    if (index >= live.size()) return;
    switch (static_cast<InboxKind>(rest[0])) {
      case InboxKind::Route:
        return on_route_reply(index, message);
      case InboxKind::Stream:
        return on_chunk(index, message);
      case InboxKind::Ack:
        return;
    }
  }

  // The client gave up reconnecting: every request in flight fails now instead of at its timeout.
  void on_connection_closed() {
    connection_closed = true;
    pending_reports.clear();
    for (std::size_t index = 0; index < live.size(); ++index) {
      if (live[index].phase == Phase::Routing || live[index].phase == Phase::Streaming) {
        ++result.route_errors;
        fail(index, "the NATS connection closed");
      }
    }
  }

  void expire(Clock::time_point now) {
    while (!next_asks.empty() && next_asks.top().first <= now) {
      const std::size_t index = next_asks.top().second;
      next_asks.pop();
      if (live[index].phase == Phase::Routing && !connection_closed) ask_route(index, now);
    }
    while (!deadlines.empty() && deadlines.top().first <= now) {
      const std::size_t index = deadlines.top().second;
      deadlines.pop();
      LiveRequest& request = live[index];
      if (request.phase == Phase::Routing) {
        ++result.timed_out;
        fail(index, "timed out waiting for a decision");
      } else if (request.phase == Phase::Streaming) {
        ++result.timed_out;
        abandon(index, "client timed out",
                request.first_token_seen ? v1::ABORT_CAUSE_STREAM_TIMEOUT
                                         : v1::ABORT_CAUSE_FIRST_TOKEN_TIMEOUT);
        fail(index, request.first_token_seen ? "timed out while streaming"
                                             : "timed out before the first token");
      }
    }
  }

  // Waits until `wake` or until a message arrives; returns what arrived.
  std::vector<Incoming> wait(std::optional<Clock::time_point> wake) {
    std::vector<Incoming> batch;
    std::unique_lock lock{mutex};
    const auto ready = [this] { return !incoming.empty(); };
    if (wake) {
      signal.wait_until(lock, *wake, ready);
    } else {
      signal.wait(lock, ready);
    }
    batch.swap(incoming);
    return batch;
  }

  LiveReplayResult run(const std::vector<simulation::TraceRequest>& trace) {
    requests = &trace;
    result = LiveReplayResult{};
    result.block_size = block_size;
    hashes.clear();
    hashes.reserve(trace.size());
    for (const auto& request : trace) {
      hashes.push_back(simulation::expand_to_block_hashes(request, block_size));
    }
    result.infinite_cache_hit_rate = simulation::infinite_cache_hit_rate(trace, hashes, block_size);
    result.fleet_kv_blocks = fleet_kv_blocks;
    result.capacity_bound_hit_rate =
        simulation::capacity_bound_hit_rate(trace, hashes, block_size, fleet_kv_blocks);
    live.assign(trace.size(), LiveRequest{});
    outcomes.clear();
    failures.clear();
    route_rtts.clear();
    policies.clear();
    in_flight = 0;
    ended = 0;
    pending_reports.clear();
    report_resends = {};
    deadlines = {};
    next_asks = {};
    first_timestamp_ms = trace.empty() ? 0 : static_cast<double>(trace.front().timestamp_ms);
    run_id = random_run_id();
    start = Clock::now();

    std::size_t next = 0;
    std::size_t counted_as_delayed = SIZE_MAX;
    std::vector<Incoming> batch;
    while (ended < trace.size()) {
      const Clock::time_point now = Clock::now();
      // Once the connection is closed, the arrivals left fail at once instead of at their time.
      while (next < trace.size() && (connection_closed || due(next) <= now)) {
        if (!connection_closed && in_flight >= options.concurrency) {
          if (counted_as_delayed != next) {
            ++result.delayed_by_cap;
            counted_as_delayed = next;
          }
          break;
        }
        dispatch(next++, now);
      }
      for (const Incoming& message : batch) handle(message);
      batch.clear();
      expire(Clock::now());
      resend_reports(Clock::now());
      if (ended == trace.size()) break;
      std::optional<Clock::time_point> wake;
      if (next < trace.size() && connection_closed) {
        wake = Clock::now();
      } else if (next < trace.size() && in_flight < options.concurrency) {
        wake = due(next);
      }
      for (const auto* timers : {&deadlines, &next_asks}) {
        if (!timers->empty()) {
          wake = wake ? std::min(*wake, timers->top().first) : timers->top().first;
        }
      }
      if (!report_resends.empty()) {
        wake = wake ? std::min(*wake, report_resends.top().first) : report_resends.top().first;
      }
      batch = wait(wake);
    }
    // The router acknowledges the last reports; bounded, so a silent router cannot hang the run.
    const Clock::time_point grace_end = Clock::now() + options.ack_grace;
    for (const Incoming& message : batch) handle(message);
    while (!pending_reports.empty() && Clock::now() < grace_end) {
      const Clock::time_point wake =
          report_resends.empty() ? grace_end : std::min(grace_end, report_resends.top().first);
      for (const Incoming& message : wait(wake)) handle(message);
      resend_reports(Clock::now());
    }
    result.reports_unacknowledged += pending_reports.size();

    std::ranges::sort(outcomes, {}, &simulation::ReplayRequestOutcome::trace_index);
    std::string label = "live";
    for (const std::string& policy : policies) {
      label += (label == "live" ? ":" : "+") + policy;
    }
    result.policies.assign(policies.begin(), policies.end());
    result.workers = fleet_size != 0 ? fleet_size : result.decisions_per_worker.size();
    result.report = simulation::make_policy_report(label, trace.size(), outcomes, result.workers);
    result.outcomes = std::move(outcomes);
    // make_policy_report counts every request without an outcome as failed; refusals are not.
    result.report.failed -= std::min(result.report.failed, result.rejected_by_admission);
    result.report.failures.assign(failures.begin(), failures.end());
    result.route_ms = simulation::summarize(std::move(route_rtts));
    route_rtts = {};
    requests = nullptr;
    return std::move(result);
  }
};

LiveReplay::LiveReplay(std::unique_ptr<State> state) : state_(std::move(state)) {}
LiveReplay::~LiveReplay() = default;

std::uint32_t LiveReplay::block_size() const { return state_->block_size; }
std::size_t LiveReplay::workers() const { return state_->fleet_size; }

LiveReplayResult LiveReplay::run(const std::vector<simulation::TraceRequest>& requests) {
  return state_->run(requests);
}

std::expected<std::unique_ptr<LiveReplay>, std::string> LiveReplay::connect(
    LiveReplayOptions options) {
  if (!subjects::is_valid_namespace(options.ns)) {
    return std::unexpected(
        fmt::format("--namespace '{}': use letters, digits, '_' and '-'", options.ns));
  }
  if (options.model.empty()) return std::unexpected("--model: empty");
  if (!(options.speedup > 0)) return std::unexpected("--speedup: must be positive");
  if (options.concurrency == 0) return std::unexpected("--concurrency: must be positive");
  auto state = std::make_unique<State>();
  state->options = std::move(options);
  const LiveReplayOptions& opts = state->options;
  // A closed connection (reconnects exhausted) reaches the driver as a message without subject.
  State* raw = state.get();
  nats::NatsEventHandlers handlers;
  handlers.on_closed = [raw] {
    {
      std::lock_guard lock{raw->mutex};
      raw->incoming.push_back(Incoming{{}, {}, Clock::now()});
    }
    raw->signal.notify_one();
  };
  auto client = NatsClient::connect(opts.nats, std::move(handlers));
  if (!client) return std::unexpected(client.error());
  state->client = std::move(*client);
  state->inbox = state->client->new_inbox();
  const Clock::time_point deadline = Clock::now() + opts.ready_timeout;

  // 1. Learn the fleet: every worker registers again when asked on the discover subject.
  struct Fleet {
    std::mutex mutex;
    std::condition_variable signal;
    std::map<WorkerId, std::uint32_t> block_sizes;
    std::map<WorkerId, std::uint64_t> kv_blocks;  // every rank's
    Clock::time_point last_seen;
  } fleet;
  {
    auto registrations = state->client->subscribe(
        subjects::worker_register(opts.ns), [&fleet, &opts](NatsMessage message) {
          v1::WorkerRegistration registration;
          if (!registration.ParseFromString(message.data) || registration.model() != opts.model) {
            return;
          }
          std::lock_guard lock{fleet.mutex};
          fleet.block_sizes[registration.worker_id()] = registration.block_size();
          // 0 when the worker registered no capacity: it adds none to the capacity ceiling.
          fleet.kv_blocks[registration.worker_id()] =
              registration.total_kv_blocks() *
              std::max<std::uint64_t>(1, registration.data_parallel_size());
          fleet.last_seen = Clock::now();
          fleet.signal.notify_all();
        });
    if (!registrations) return std::unexpected(registrations.error());
    if (auto asked = state->client->publish(subjects::worker_discover(opts.ns), ""); !asked) {
      return std::unexpected(asked.error());
    }
    // Registrations trickle in: wait for the first, then until none came for a short while.
    constexpr auto kQuiet = std::chrono::milliseconds(300);
    const Clock::time_point asked_at = Clock::now();
    std::unique_lock lock{fleet.mutex};
    for (;;) {
      const Clock::time_point now = Clock::now();
      Clock::time_point until = deadline;
      if (!fleet.block_sizes.empty()) {
        until = fleet.last_seen + kQuiet;
      } else if (opts.block_size != 0) {
        // Without registrations, a given block size lets the probe below decide.
        until = asked_at + 3 * kQuiet;
      }
      if (now >= std::min(until, deadline)) break;
      fleet.signal.wait_until(lock, std::min(until, deadline));
    }
  }  // unsubscribed here: the callback no longer runs
  state->fleet_size = fleet.block_sizes.size();
  for (const auto& [worker, blocks] : fleet.kv_blocks) state->fleet_kv_blocks += blocks;
  // The probe is pinned to a worker that announced itself: routed by its pin, it runs no policy
  // choice, so the policy's state (its random draws, a round-robin position) is the trace's alone.
  const std::optional<WorkerId> probe_worker =
      fleet.block_sizes.empty() ? std::nullopt
                                : std::optional<WorkerId>{fleet.block_sizes.begin()->first};
  if (opts.block_size != 0) {
    state->block_size = opts.block_size;
  } else {
    if (fleet.block_sizes.empty()) {
      return std::unexpected(fmt::format(
          "no worker of model '{}' announced itself on {} within {} ms (is a `kvr mocker` "
          "running in namespace '{}'? --block-size skips this for workers that do not answer {})",
          opts.model, subjects::worker_register(opts.ns), opts.ready_timeout.count(), opts.ns,
          subjects::worker_discover(opts.ns)));
    }
    std::set<std::uint32_t> sizes;
    for (const auto& [worker, size] : fleet.block_sizes) sizes.insert(size);
    if (sizes.size() != 1) {
      return std::unexpected(fmt::format(
          "the workers of model '{}' disagree on the block size ({}); pass --block-size",
          opts.model, fmt::join(sizes, ", ")));
    }
    state->block_size = *sizes.begin();
  }

  // 2. Wait for a router: a probe route request, retried until it is routed.
  std::string last_problem = "no answer";
  for (int attempt = 1;; ++attempt) {
    v1::RouteRequest probe;
    probe.set_request_id(fmt::format("live-{}-probe-{}", state->run_id, attempt));
    probe.set_model(opts.model);
    probe.mutable_block_hashes()->set_prompt_tokens(1);
    if (probe_worker) probe.mutable_pinned_worker()->set_worker_id(*probe_worker);
    auto reply = state->client->request(subjects::router_route(opts.ns), probe.SerializeAsString(),
                                        std::chrono::milliseconds(1000));
    v1::RouteDecision decision;
    if (!reply) {
      last_problem = reply.error();
    } else if (!decision.ParseFromString(reply->data)) {
      last_problem = "undecodable RouteDecision";
    } else if (decision.has_success()) {
      v1::LifecycleReport release;
      release.set_booking_id(decision.success().booking_id());
      release.set_event(v1::LIFECYCLE_EVENT_ABORTED);
      release.set_abort_cause(v1::ABORT_CAUSE_CLIENT_CANCELLED);
      (void)state->client->request(subjects::router_report(opts.ns), release.SerializeAsString(),
                                   std::chrono::milliseconds(1000));
      break;
    } else if (decision.has_error()) {
      const v1::RouteErrorCode code = decision.error().code();
      last_problem =
          fmt::format("{}: {}", v1::RouteErrorCode_Name(code), decision.error().message());
      if (code != v1::ROUTE_ERROR_NO_WORKERS && code != v1::ROUTE_ERROR_UNAVAILABLE &&
          code != v1::ROUTE_ERROR_TIMEOUT) {
        return std::unexpected("the router refused a probe request: " + last_problem);
      }
    }
    if (Clock::now() + std::chrono::milliseconds(100) >= deadline) {
      return std::unexpected(fmt::format("no router routed a probe request on {} within {} ms ({})",
                                         subjects::router_route(opts.ns),
                                         opts.ready_timeout.count(), last_problem));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  // 3. One subscription carries every reply: decisions, chunks and acks.
  auto subscription = state->client->subscribe(state->inbox + ".>", [raw](NatsMessage message) {
    Incoming item{std::move(message.subject), std::move(message.data), Clock::now()};
    {
      std::lock_guard lock{raw->mutex};
      raw->incoming.push_back(std::move(item));
    }
    raw->signal.notify_one();
  });
  if (!subscription) return std::unexpected(subscription.error());
  state->subscription = std::move(*subscription);
  if (auto flushed = state->client->flush(std::chrono::seconds(5)); !flushed) {
    return std::unexpected(flushed.error());
  }
  return std::unique_ptr<LiveReplay>(new LiveReplay(std::move(state)));
}

std::string tenant_of(const LiveReplayOptions& options, std::size_t index) {
  if (options.tenants > 0) return fmt::format("t{}", index % options.tenants);
  return options.tenant;
}

std::string format_live_summary(const LiveReplayResult& result) {
  std::string text = fmt::format(
      "live: policy {}; route round trip (client) mean {:.3f} p50 {:.3f} p99 {:.3f} max {:.3f} "
      "ms\n",
      result.policies.empty() ? std::string{"?"}
                              : fmt::format("{}", fmt::join(result.policies, "+")),
      result.route_ms.mean, result.route_ms.p50, result.route_ms.p99, result.route_ms.max);
  std::size_t least = SIZE_MAX;
  std::size_t most = 0;
  std::size_t total = 0;
  for (const auto& [worker, count] : result.decisions_per_worker) {
    least = std::min(least, count);
    most = std::max(most, count);
    total += count;
  }
  // Workers of the fleet that were never chosen count as zero.
  if (result.decisions_per_worker.size() < result.workers || least == SIZE_MAX) least = 0;
  text += fmt::format(
      "live: decisions per worker over {} workers: min {} mean {:.1f} max {}; timed out {}, "
      "route errors {}, route asks repeated {}, worker errors {}, arrivals held by --concurrency "
      "{}; lifecycle reports refused {}, unacknowledged {}\n",
      result.workers, least,
      result.workers == 0 ? 0.0 : static_cast<double>(total) / static_cast<double>(result.workers),
      most, result.timed_out, result.route_errors, result.route_asks_repeated, result.worker_errors,
      result.delayed_by_cap, result.reports_refused, result.reports_unacknowledged);
  text += fmt::format("live: rejected by admission: {}", result.rejected_by_admission);
  if (!result.rejected_by_code.empty()) {
    std::vector<std::string> codes;
    for (const auto& [code, count] : result.rejected_by_code) {
      codes.push_back(fmt::format("{} {}", code, count));
    }
    text += fmt::format(" ({})", fmt::join(codes, ", "));
  }
  text += '\n';
  return text;
}

std::string live_report_json(const simulation::ReplayReport& report,
                             const LiveReplayResult& result) {
  // nlohmann::json keeps object keys sorted, so the added section keeps the report's order.
  nlohmann::json json = nlohmann::json::parse(simulation::to_json(report));
  nlohmann::json decisions = nlohmann::json::object();
  for (const auto& [worker, count] : result.decisions_per_worker) {
    decisions[std::to_string(worker)] = count;
  }
  json["live"] = nlohmann::json{{"decisions_per_worker", std::move(decisions)},
                                {"delayed_by_concurrency_cap", result.delayed_by_cap},
                                {"policies", result.policies},
                                {"reports_refused", result.reports_refused},
                                {"rejected_by_admission", result.rejected_by_admission},
                                {"rejected_by_admission_codes", result.rejected_by_code},
                                {"reports_unacknowledged", result.reports_unacknowledged},
                                {"route_asks_repeated", result.route_asks_repeated},
                                {"route_errors", result.route_errors},
                                {"route_ms", latency_json(result.route_ms)},
                                {"timed_out", result.timed_out},
                                {"worker_errors", result.worker_errors}};
  return json.dump(2) + "\n";
}

}  // namespace kvr::replay
