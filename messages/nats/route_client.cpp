#include "messages/nats/route_client.hpp"

#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace kvr::nats {
namespace {

using Clock = std::chrono::steady_clock;

// Parses the call id of a reply subject's tail after the inbox: "<call>.<ask>".
std::optional<std::uint64_t> call_of(std::string_view tail) {
  const std::size_t dot = tail.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  std::uint64_t call = 0;
  const auto [end, error] = std::from_chars(tail.data(), tail.data() + dot, call);
  if (error != std::errc{} || end != tail.data() + dot) return std::nullopt;
  return call;
}

}  // namespace

std::string attempt_request_id(std::string_view request_id, int attempt) {
  if (attempt == 0) return std::string{request_id};
  return fmt::format("{}~{}", request_id, attempt);
}

bool asks_for_retry(const v1::RouteDecision& decision) {
  if (!decision.has_error()) return false;
  const v1::RouteErrorCode code = decision.error().code();
  return code == v1::ROUTE_ERROR_OWNER_LOST || code == v1::ROUTE_ERROR_UNAVAILABLE;
}

struct RouteClient::State {
  NatsClient* client = nullptr;
  std::string route_subject;
  std::string report_subject;
  std::string inbox;
  std::optional<NatsSubscription> subscription;

  std::mutex mutex;
  std::condition_variable arrived;
  std::uint64_t next_call = 0;
  // The calls route() still waits on, and what came for each: a decision, or nullopt for NATS's
  // "no responders" (an empty status message) and anything that is not a RouteDecision.
  std::map<std::uint64_t, std::vector<std::optional<v1::RouteDecision>>> waiting;

  // Releases a booking nobody will use; one way, so that a delivery thread never waits.
  void release(const v1::RouteDecision& decision) const {
    // A query-only decision books nothing.
    if (!decision.has_success() || decision.success().booking_id().empty()) return;
    v1::LifecycleReport report;
    report.set_booking_id(decision.success().booking_id());
    report.set_event(v1::LIFECYCLE_EVENT_ABORTED);
    report.set_abort_cause(v1::ABORT_CAUSE_CLIENT_CANCELLED);
    report.set_error("another ask of the same request was answered first");
    (void)client->publish(report_subject, report.SerializeAsString());
  }

  void on_reply(NatsMessage message) {
    if (message.subject.size() <= inbox.size() + 1) return;
    const auto call_id = call_of(std::string_view{message.subject}.substr(inbox.size() + 1));
    if (!call_id) return;
    std::optional<v1::RouteDecision> arrival;
    if (!message.data.empty()) {
      v1::RouteDecision decision;
      if (decision.ParseFromString(message.data)) arrival = std::move(decision);
    }
    {
      std::lock_guard lock{mutex};
      if (auto call = waiting.find(*call_id); call != waiting.end()) {
        call->second.push_back(std::move(arrival));
        arrived.notify_all();
        return;
      }
    }
    // The call ended with another ask's decision (or its timeout): this one is not used.
    if (arrival) release(*arrival);
  }
};

RouteClient::RouteClient(std::shared_ptr<State> state) : state_(std::move(state)) {}
RouteClient::RouteClient(RouteClient&&) noexcept = default;
RouteClient& RouteClient::operator=(RouteClient&&) noexcept = default;

RouteClient::~RouteClient() {
  // The delivery thread uses the state: stop it first.
  if (state_) state_->subscription.reset();
}

std::expected<RouteClient, std::string> RouteClient::open(NatsClient& client,
                                                          std::string route_subject,
                                                          std::string report_subject) {
  auto state = std::make_shared<State>();
  state->client = &client;
  state->route_subject = std::move(route_subject);
  state->report_subject = std::move(report_subject);
  state->inbox = client.new_inbox();
  auto subscribed = client.subscribe(state->inbox + ".>", [raw = state.get()](NatsMessage message) {
    raw->on_reply(std::move(message));
  });
  if (!subscribed) return std::unexpected(subscribed.error());
  state->subscription.emplace(std::move(*subscribed));
  // A request sent before the server knows the subscription could lose its answer.
  if (auto flushed = client.flush(std::chrono::milliseconds{2000}); !flushed) {
    return std::unexpected("the server did not confirm the decisions' inbox: " + flushed.error());
  }
  return RouteClient{std::move(state)};
}

std::expected<RoutedDecision, std::string> RouteClient::route(const v1::RouteRequest& request,
                                                              const RouteRetryPolicy& policy) {
  State& state = *state_;
  const int max_attempts = std::max(1, policy.max_attempts);
  std::uint64_t call = 0;
  {
    std::lock_guard lock{state.mutex};
    call = ++state.next_call;
    state.waiting.emplace(call, std::vector<std::optional<v1::RouteDecision>>{});
  }
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + policy.timeout;
  int sent = 0;
  int unanswered = 0;
  int no_responders = 0;
  std::string send_error;
  std::optional<v1::RouteDecision> retry_answer;  // the last "ask again" decision, if nothing else
  v1::RouteRequest ask = request;
  const auto send = [&] {
    ask.set_request_id(attempt_request_id(request.request_id(), sent));
    auto published = state.client->publish_request(state.route_subject,
                                                   fmt::format("{}.{}.{}", state.inbox, call, sent),
                                                   ask.SerializeAsString());
    ++sent;
    if (published) {
      ++unanswered;
    } else {
      send_error = published.error();
    }
  };
  const auto next_ask = [&] { return start + policy.retry_after * sent; };

  send();
  std::optional<v1::RouteDecision> answer;
  std::vector<v1::RouteDecision> extra;
  {
    std::unique_lock lock{state.mutex};
    auto& arrivals = state.waiting.at(call);
    while (!answer) {
      const Clock::time_point wake =
          sent < max_attempts ? std::min(next_ask(), deadline) : deadline;
      state.arrived.wait_until(lock, wake, [&] { return !arrivals.empty(); });
      auto batch = std::exchange(arrivals, {});
      bool ask_now = false;
      for (auto& arrival : batch) {
        if (answer) {
          if (arrival) extra.push_back(std::move(*arrival));
          continue;
        }
        --unanswered;
        if (!arrival) {
          ++no_responders;
        } else if (asks_for_retry(*arrival)) {
          // Another node, or the partition's new owner, answers: no reason to wait.
          retry_answer = std::move(arrival);
          ask_now = true;
        } else {
          answer = std::move(arrival);
        }
      }
      if (answer) break;
      const Clock::time_point now = Clock::now();
      if (now >= deadline) break;
      const bool idle = unanswered <= 0;
      if (sent < max_attempts && ((ask_now && idle) || now >= next_ask())) {
        lock.unlock();
        send();
        lock.lock();
      } else if (idle && sent >= max_attempts) {
        break;  // every ask answered, none finally
      }
    }
    // From here on a late answer is the subscription's to release.
    state.waiting.erase(call);
  }
  for (const v1::RouteDecision& decision : extra) state.release(decision);
  if (!answer && retry_answer) answer = std::move(retry_answer);
  if (!answer) {
    if (!send_error.empty() && unanswered <= 0 && no_responders == 0) {
      return std::unexpected("cannot send the route request: " + send_error);
    }
    if (no_responders > 0 && no_responders == sent) {
      return std::unexpected(
          fmt::format("no router node subscribes to {} ({} asks)", state.route_subject, sent));
    }
    return std::unexpected(fmt::format("no decision within {} ms ({} asks, {} without responders)",
                                       policy.timeout.count(), sent, no_responders));
  }
  answer->set_request_id(request.request_id());
  return RoutedDecision{.decision = std::move(*answer), .attempts = sent};
}

}  // namespace kvr::nats
