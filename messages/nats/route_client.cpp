#include "messages/nats/route_client.hpp"

#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace kvr::nats {
namespace {

using Clock = std::chrono::steady_clock;

// One ask's answer: a decision, or nullopt for NATS's "no responders" (an empty status message)
// and anything that is not a RouteDecision.
struct Arrival {
  int attempt = 0;
  std::optional<v1::RouteDecision> decision;
};

// Parses "<call>.<attempt>", the part of a reply subject after the inbox and its dot.
std::optional<std::pair<std::uint64_t, int>> parse_reply_tail(std::string_view tail) {
  const std::size_t dot = tail.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  std::uint64_t call = 0;
  int attempt = 0;
  const auto [call_end, call_error] = std::from_chars(tail.data(), tail.data() + dot, call);
  const auto [attempt_end, attempt_error] =
      std::from_chars(tail.data() + dot + 1, tail.data() + tail.size(), attempt);
  if (call_error != std::errc{} || call_end != tail.data() + dot || attempt_error != std::errc{} ||
      attempt_end != tail.data() + tail.size()) {
    return std::nullopt;
  }
  return std::pair{call, attempt};
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
  // The calls route() still waits on, and what came for each.
  std::map<std::uint64_t, std::vector<Arrival>> waiting;

  // Releases a booking nobody will use; one way, so that a delivery thread never waits.
  void release(const v1::RouteDecision& decision) const {
    if (!decision.has_success()) return;
    v1::LifecycleReport report;
    report.set_booking_id(decision.success().booking_id());
    report.set_event(v1::LIFECYCLE_EVENT_ABORTED);
    report.set_abort_cause(v1::ABORT_CAUSE_CLIENT_CANCELLED);
    report.set_error("another ask of the same request was answered first");
    (void)client->publish(report_subject, report.SerializeAsString());
  }

  void on_reply(NatsMessage message) {
    if (message.subject.size() <= inbox.size() + 1) return;
    const auto ids = parse_reply_tail(std::string_view{message.subject}.substr(inbox.size() + 1));
    if (!ids) return;
    Arrival arrival{.attempt = ids->second, .decision = std::nullopt};
    if (!message.data.empty()) {
      v1::RouteDecision decision;
      if (decision.ParseFromString(message.data)) arrival.decision = std::move(decision);
    }
    {
      std::lock_guard lock{mutex};
      if (auto call = waiting.find(ids->first); call != waiting.end()) {
        call->second.push_back(std::move(arrival));
        arrived.notify_all();
        return;
      }
    }
    // The call ended with another ask's decision (or its timeout): this one is not used.
    if (arrival.decision) release(*arrival.decision);
  }
};

RouteClient::RouteClient(NatsClient& client, std::shared_ptr<State> state)
    : client_(&client), state_(std::move(state)) {}
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
  return RouteClient{client, std::move(state)};
}

std::expected<RoutedDecision, std::string> RouteClient::route(const v1::RouteRequest& request,
                                                              const RouteRetryPolicy& policy) {
  State& state = *state_;
  const int max_attempts = std::max(1, policy.max_attempts);
  std::uint64_t call = 0;
  {
    std::lock_guard lock{state.mutex};
    call = ++state.next_call;
    state.waiting.emplace(call, std::vector<Arrival>{});
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
    auto published = client_->publish_request(state.route_subject,
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
  std::vector<Arrival> extra;
  {
    std::unique_lock lock{state.mutex};
    std::vector<Arrival>& arrivals = state.waiting.at(call);
    while (!answer) {
      const Clock::time_point wake =
          sent < max_attempts ? std::min(next_ask(), deadline) : deadline;
      state.arrived.wait_until(lock, wake, [&] { return !arrivals.empty(); });
      std::vector<Arrival> batch = std::exchange(arrivals, {});
      bool ask_now = false;
      for (Arrival& arrival : batch) {
        if (answer) {
          extra.push_back(std::move(arrival));
          continue;
        }
        --unanswered;
        if (!arrival.decision) {
          ++no_responders;
        } else if (asks_for_retry(*arrival.decision)) {
          // Another node, or the partition's new owner, answers: no reason to wait.
          retry_answer = std::move(arrival.decision);
          ask_now = true;
        } else {
          answer = std::move(arrival.decision);
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
  for (const Arrival& arrival : extra) {
    if (arrival.decision) state.release(*arrival.decision);
  }
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
