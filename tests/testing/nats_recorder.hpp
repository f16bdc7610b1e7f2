// Observing kvr from the NATS side in tests: a subscription that records what it receives, a
// client's generate stream, and the router's request/reply subjects asked as a client would.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "messages/ids.hpp"
#include "messages/nats/nats_client.hpp"

namespace kvr::testing {

/// Records every message one subscription receives, in arrival order. Declare it after the client
/// it listens on: it unsubscribes when destroyed, which must happen before the client closes.
class NatsRecorder {
 public:
  using Handler = std::function<void(const nats::NatsMessage&)>;

  NatsRecorder() = default;
  NatsRecorder(const NatsRecorder&) = delete;
  NatsRecorder& operator=(const NatsRecorder&) = delete;

  /// Subscribes to `subject` on `client` and waits until the server confirms the subscription, so
  /// that whatever is published afterwards is recorded. `on_message`, when given, sees each
  /// message before it is recorded, on the client's delivery thread.
  ::testing::AssertionResult listen(nats::NatsClient& client, std::string_view subject,
                                    Handler on_message = {});

  std::vector<nats::NatsMessage> messages() const;
  /// The payloads of messages().
  std::vector<std::string> payloads() const;
  std::size_t size() const;
  /// Waits until at least `count` messages arrived; false when `timeout` passed first.
  bool wait_for(std::size_t count, std::chrono::milliseconds timeout) const;

  /// The payloads that parse as `Proto`, in arrival order; the rest are skipped.
  template <class Proto>
  std::vector<Proto> decoded() const {
    std::vector<Proto> result;
    for (const auto& message : messages()) {
      Proto proto;
      if (proto.ParseFromString(message.data)) result.push_back(std::move(proto));
    }
    return result;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<nats::NatsMessage> messages_;
  Handler on_message_;
  std::optional<nats::NatsSubscription> subscription_;  // last: unsubscribes first
};

/// A client's generate stream: a fresh inbox of the client's and the chunks that arrived on it.
class ChunkStream {
 public:
  using ChunkHandler = std::function<void(const v1::GenerateChunk&)>;

  /// Subscribes to a new inbox of `client`'s and waits until the server confirms it.
  /// `on_chunk`, when given, sees each chunk as it arrives, on the client's delivery thread.
  ::testing::AssertionResult open(nats::NatsClient& client, ChunkHandler on_chunk = {});

  /// The subject to name as GenerateRequest::stream_subject.
  const std::string& subject() const { return subject_; }
  /// The chunks so far, in arrival order (payloads that are no chunk are skipped).
  std::vector<v1::GenerateChunk> chunks() const { return recorder_.decoded<v1::GenerateChunk>(); }
  std::size_t size() const { return chunks().size(); }
  /// True once the last chunk so far is a finished one.
  bool finished() const;

 private:
  std::string subject_;
  NatsRecorder recorder_;
};

/// Asks the router of namespace `ns` for a decision on `request` (serialized bytes, so that a test
/// can send anything); nullopt when no parseable decision came within `timeout`.
std::optional<v1::RouteDecision> request_route(
    nats::NatsClient& client, std::string_view ns, const std::string& request,
    std::chrono::milliseconds timeout = std::chrono::seconds(2));
std::optional<v1::RouteDecision> request_route(
    nats::NatsClient& client, std::string_view ns, const v1::RouteRequest& request,
    std::chrono::milliseconds timeout = std::chrono::seconds(2));

/// Reports `event` of `booking` to the router of namespace `ns`; its ack, or nullopt when no
/// parseable ack came within 2 s.
std::optional<v1::LifecycleAck> report_lifecycle(nats::NatsClient& client, std::string_view ns,
                                                 const std::string& booking,
                                                 v1::LifecycleEvent event);

/// Route requests, as a client that reports every booking would send them, so that routing for a
/// test's own sake (a readiness probe, a look at the node's choice) leaves no load behind on the
/// worker it picked: each successful decision is reported completed and acked before route()
/// returns, and a decision that arrives after route() gave up on it (a slow node) is reported
/// completed when it arrives. Otherwise the number of probes a slow machine needs would decide
/// how much phantom load the next request meets. Destroy it before its client.
class ReportingRouter {
 public:
  ReportingRouter() = default;
  ReportingRouter(const ReportingRouter&) = delete;
  ReportingRouter& operator=(const ReportingRouter&) = delete;
  ~ReportingRouter();

  /// Subscribes the decisions' inbox on `client`, for the router of namespace `ns`.
  ::testing::AssertionResult open(nats::NatsClient& client, std::string_view ns);
  bool is_open() const { return client_ != nullptr; }

  /// The router's decision on `request`, its booking already released; nullopt when no
  /// parseable decision came within `timeout`.
  std::optional<v1::RouteDecision> route(const v1::RouteRequest& request,
                                         std::chrono::milliseconds timeout);

 private:
  struct State;
  nats::NatsClient* client_ = nullptr;
  std::shared_ptr<State> state_;
  std::optional<nats::NatsSubscription> subscription_;
};

/// Route probes until the router of namespace `ns` routes a request (for model "mock-model", 32
/// tokens, each probe's booking released through a ReportingRouter) to `worker`, or to any worker
/// when `worker` is unset: how a test knows that registrations reached the router. Each probe's
/// request id is `next_request_id()`. False when `timeout` passed first.
bool wait_until_routable(nats::NatsClient& client, std::string_view ns,
                         std::optional<WorkerId> worker,
                         const std::function<std::string()>& next_request_id,
                         std::chrono::milliseconds timeout);

}  // namespace kvr::testing
