#include "tests/testing/nats_recorder.hpp"

#include <condition_variable>
#include <map>
#include <random>
#include <utility>

#include "messages/subjects.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_processes.hpp"

namespace kvr::testing {

using namespace std::chrono_literals;
using nats::NatsClient;
using nats::NatsMessage;

::testing::AssertionResult NatsRecorder::listen(NatsClient& client, std::string_view subject,
                                                Handler on_message) {
  on_message_ = std::move(on_message);
  auto subscribed = client.subscribe(subject, [this](NatsMessage message) {
    if (on_message_) on_message_(message);
    std::lock_guard lock{mutex_};
    messages_.push_back(std::move(message));
  });
  if (!subscribed) return ::testing::AssertionFailure() << subscribed.error();
  subscription_.emplace(std::move(*subscribed));
  if (auto flushed = client.flush(2s); !flushed) {
    return ::testing::AssertionFailure() << "the server did not confirm the subscription to "
                                         << subject << ": " << flushed.error();
  }
  return ::testing::AssertionSuccess();
}

std::vector<NatsMessage> NatsRecorder::messages() const {
  std::lock_guard lock{mutex_};
  return messages_;
}

std::vector<std::string> NatsRecorder::payloads() const {
  std::lock_guard lock{mutex_};
  std::vector<std::string> payloads;
  payloads.reserve(messages_.size());
  for (const NatsMessage& message : messages_) payloads.push_back(message.data);
  return payloads;
}

std::size_t NatsRecorder::size() const {
  std::lock_guard lock{mutex_};
  return messages_.size();
}

bool NatsRecorder::wait_for(std::size_t count, std::chrono::milliseconds timeout) const {
  return wait_until([&] { return size() >= count; }, timeout);
}

::testing::AssertionResult ChunkStream::open(NatsClient& client, ChunkHandler on_chunk) {
  subject_ = client.new_inbox();
  NatsRecorder::Handler handler;
  if (on_chunk) {
    handler = [on_chunk = std::move(on_chunk)](const NatsMessage& message) {
      v1::GenerateChunk chunk;
      if (chunk.ParseFromString(message.data)) on_chunk(chunk);
    };
  }
  return recorder_.listen(client, subject_, std::move(handler));
}

bool ChunkStream::finished() const {
  const auto received = chunks();
  return !received.empty() && received.back().finished();
}

std::optional<v1::RouteDecision> request_route(NatsClient& client, std::string_view ns,
                                               const std::string& request,
                                               std::chrono::milliseconds timeout) {
  auto reply = client.request(subjects::router_route(ns), request, timeout);
  if (!reply) return std::nullopt;
  v1::RouteDecision decision;
  if (!decision.ParseFromString(reply->data)) return std::nullopt;
  return decision;
}

std::optional<v1::RouteDecision> request_route(NatsClient& client, std::string_view ns,
                                               const v1::RouteRequest& request,
                                               std::chrono::milliseconds timeout) {
  return request_route(client, ns, request.SerializeAsString(), timeout);
}

std::optional<v1::LifecycleAck> report_lifecycle(NatsClient& client, std::string_view ns,
                                                 const std::string& booking,
                                                 v1::LifecycleEvent event) {
  v1::LifecycleReport report;
  report.set_booking_id(booking);
  report.set_event(event);
  auto reply = client.request(subjects::router_report(ns), report.SerializeAsString(), 2s);
  if (!reply) return std::nullopt;
  v1::LifecycleAck ack;
  if (!ack.ParseFromString(reply->data)) return std::nullopt;
  return ack;
}

struct ReportingRouter::State {
  std::string ns;
  std::string inbox;
  std::mutex mutex;
  std::condition_variable arrived;
  std::uint64_t next_id = 0;
  // Decisions route() still waits for, by the id in their reply subject; nullopt until arrived.
  std::map<std::uint64_t, std::optional<v1::RouteDecision>> waiting;
};

ReportingRouter::~ReportingRouter() { subscription_.reset(); }

::testing::AssertionResult ReportingRouter::open(NatsClient& client, std::string_view ns) {
  auto state = std::make_shared<State>();
  state->ns = std::string{ns};
  std::random_device entropy;
  state->inbox = "_INBOX.kvr-test-route." + std::to_string(entropy()) + std::to_string(entropy());
  auto subscribed = client.subscribe(state->inbox + ".*", [state, &client](NatsMessage message) {
    v1::RouteDecision decision;
    if (!decision.ParseFromString(message.data)) return;
    const auto dot = message.subject.rfind('.');
    const std::uint64_t id = std::stoull(message.subject.substr(dot + 1));
    {
      std::lock_guard lock{state->mutex};
      auto waiting = state->waiting.find(id);
      if (waiting != state->waiting.end()) {
        waiting->second = std::move(decision);
        state->arrived.notify_all();
        return;
      }
    }
    // Too late for route(): released here, one way (the delivery thread must not wait).
    if (!decision.has_success()) return;
    v1::LifecycleReport report;
    report.set_booking_id(decision.success().booking_id());
    report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
    (void)client.publish(subjects::router_report(state->ns), report.SerializeAsString());
  });
  if (!subscribed) return ::testing::AssertionFailure() << subscribed.error();
  if (auto flushed = client.flush(2s); !flushed) {
    return ::testing::AssertionFailure()
           << "the server did not confirm the decisions' inbox: " << flushed.error();
  }
  subscription_.emplace(std::move(*subscribed));
  state_ = std::move(state);
  client_ = &client;
  return ::testing::AssertionSuccess();
}

std::optional<v1::RouteDecision> ReportingRouter::route(const v1::RouteRequest& request,
                                                        std::chrono::milliseconds timeout) {
  State& state = *state_;
  std::uint64_t id = 0;
  {
    std::lock_guard lock{state.mutex};
    id = ++state.next_id;
    state.waiting.emplace(id, std::nullopt);
  }
  std::optional<v1::RouteDecision> decision;
  if (client_->publish_request(subjects::router_route(state.ns),
                               state.inbox + "." + std::to_string(id),
                               request.SerializeAsString())) {
    std::unique_lock lock{state.mutex};
    state.arrived.wait_for(lock, timeout, [&] { return state.waiting.at(id).has_value(); });
    decision = std::move(state.waiting.at(id));
    // From here on a late decision is the subscription's to release.
    state.waiting.erase(id);
  } else {
    std::lock_guard lock{state.mutex};
    state.waiting.erase(id);
  }
  if (decision && decision->has_success()) {
    // Acked before the next request, so that the release is applied before it is routed.
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (report_lifecycle(*client_, state.ns, decision->success().booking_id(),
                           v1::LIFECYCLE_EVENT_COMPLETED)) {
        break;
      }
    }
  }
  return decision;
}

bool wait_until_routable(NatsClient& client, std::string_view ns, std::optional<WorkerId> worker,
                         const std::function<std::string()>& next_request_id,
                         std::chrono::milliseconds timeout) {
  ReportingRouter router;
  if (!router.open(client, ns)) return false;
  return wait_until(
      [&] {
        v1::RouteRequest request;
        request.set_request_id(next_request_id());
        request.set_model("mock-model");
        for (std::uint32_t token : prompt(32, 1)) request.mutable_tokens()->add_ids(token);
        if (worker) request.add_allowed_workers(*worker);
        const auto decision = router.route(request, 2s);
        if (!decision || !decision->has_success()) return false;
        return !worker || decision->success().worker_id() == *worker;
      },
      timeout);
}

}  // namespace kvr::testing
