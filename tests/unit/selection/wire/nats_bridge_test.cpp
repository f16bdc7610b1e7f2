// The router node's NATS bridge against a real nats-server on loopback: each subscribed message
// reaches its sink decoded; a malformed one is counted on its subject's bad-message metric,
// dropped, and the next valid one still arrives; dump requests go out on the worker's dump subject
// and their replies come back to the kv_dump sink.
#include "selection/wire/nats_bridge.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/metrics/node_metrics.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;

constexpr std::string_view kNamespace = "bridge-test";
constexpr auto kDeadline = 5s;
// Not valid protobuf: every decoder refuses it before looking at fields.
const std::string kGarbage = "\xff\xff\xff not a protobuf message";

// What the bridge's sinks received, in arrival order per kind; waited on with a deadline.
class SinkRecorder {
 public:
  std::vector<discovery::WorkerRegistration> registrations;
  std::vector<WorkerLiveness> heartbeats;
  std::vector<WorkerLiveness> deregistrations;
  std::vector<WorkerLoadReport> loads;
  std::vector<KvEventBatch> kv_batches;
  std::vector<KvDump> kv_dumps;
  struct Route {
    RouteRequest request;
    std::string reply;
  };
  std::vector<Route> routes;
  struct Report {
    LifecycleReportData report;
    std::string reply;
  };
  std::vector<Report> reports;
  struct Generate {
    GenerateRequestData request;
    std::string reply;
  };
  std::vector<Generate> generates;
  std::vector<std::string> cancels;
  std::vector<std::pair<std::uint64_t, v1::GenerateChunk>> chunks;

  /// Sinks that record into this recorder.
  BridgeSinks sinks() {
    BridgeSinks sinks;
    sinks.registration = [this](discovery::WorkerRegistration value) {
      record([&] { registrations.push_back(std::move(value)); });
    };
    sinks.heartbeat = [this](WorkerLiveness value) {
      record([&] { heartbeats.push_back(value); });
    };
    sinks.deregistration = [this](WorkerLiveness value) {
      record([&] { deregistrations.push_back(value); });
    };
    sinks.load = [this](WorkerLoadReport value) {
      record([&] { loads.push_back(std::move(value)); });
    };
    sinks.kv_events = [this](KvEventBatch value) {
      record([&] { kv_batches.push_back(std::move(value)); });
    };
    sinks.kv_dump = [this](KvDump value) { record([&] { kv_dumps.push_back(std::move(value)); }); };
    sinks.route = [this](RouteRequest request, std::string reply,
                         std::chrono::steady_clock::time_point) {
      record([&] { routes.push_back({std::move(request), std::move(reply)}); });
    };
    sinks.report = [this](LifecycleReportData report, std::string reply) {
      record([&] { reports.push_back({std::move(report), std::move(reply)}); });
    };
    sinks.generate = [this](GenerateRequestData request, std::string reply,
                            std::chrono::steady_clock::time_point) {
      record([&] { generates.push_back({std::move(request), std::move(reply)}); });
    };
    sinks.generate_cancel = [this](std::string request_id) {
      record([&] { cancels.push_back(std::move(request_id)); });
    };
    sinks.chunk = [this](std::uint64_t stream_id, v1::GenerateChunk chunk) {
      record([&] { chunks.emplace_back(stream_id, std::move(chunk)); });
    };
    return sinks;
  }

  /// Waits until `condition` (read under the recorder's lock) holds; false at the deadline.
  bool wait_for(const std::function<bool()>& condition) {
    std::unique_lock lock{mutex_};
    return changed_.wait_for(lock, kDeadline, condition);
  }

  /// Runs `read` under the recorder's lock.
  template <class Reader>
  auto read(Reader reader) {
    std::lock_guard lock{mutex_};
    return reader();
  }

 private:
  void record(const std::function<void()>& append) {
    {
      std::lock_guard lock{mutex_};
      append();
    }
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
};

// A raw subscription of the test's own client that keeps what arrives; waited on with a deadline.
class Inbox {
 public:
  ::testing::AssertionResult listen(nats::NatsClient& client, const std::string& subject) {
    auto subscription = client.subscribe(subject, [this](nats::NatsMessage message) {
      {
        std::lock_guard lock{mutex_};
        messages_.push_back(std::move(message));
      }
      changed_.notify_all();
    });
    if (!subscription) return ::testing::AssertionFailure() << subscription.error();
    subscription_.emplace(std::move(*subscription));
    // The server has the subscription once it answered a flush: later publishes reach it.
    if (auto flushed = client.flush(kDeadline); !flushed) {
      return ::testing::AssertionFailure() << flushed.error();
    }
    return ::testing::AssertionSuccess();
  }

  /// The first message, once it arrived; nullopt at the deadline.
  std::optional<nats::NatsMessage> first() {
    std::unique_lock lock{mutex_};
    if (!changed_.wait_for(lock, kDeadline, [&] { return !messages_.empty(); })) {
      return std::nullopt;
    }
    return messages_.front();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<nats::NatsMessage> messages_;
  std::optional<nats::NatsSubscription> subscription_;  // last: unsubscribes first
};

v1::WorkerRegistration registration_wire(std::uint64_t worker_id) {
  v1::WorkerRegistration wire;
  wire.set_worker_id(worker_id);
  wire.set_incarnation(3);
  wire.set_model("model-a");
  wire.set_role(v1::WORKER_ROLE_AGGREGATED);
  wire.set_routing_group("group-a");
  wire.set_block_size(16);
  wire.set_total_kv_blocks(1000);
  wire.set_data_parallel_size(2);
  wire.add_taints("gpu=h100");
  wire.set_publishes_kv_events(true);
  wire.set_generate_subject(subjects::worker_generate(kNamespace, worker_id));
  wire.set_dump_subject(subjects::worker_dump(kNamespace, worker_id));
  return wire;
}

std::string heartbeat_bytes(std::uint64_t worker_id) {
  v1::WorkerHeartbeat wire;
  wire.set_worker_id(worker_id);
  wire.set_incarnation(3);
  return wire.SerializeAsString();
}

std::string deregistration_bytes(std::uint64_t worker_id) {
  v1::WorkerDeregistration wire;
  wire.set_worker_id(worker_id);
  wire.set_incarnation(3);
  wire.set_reason("shutdown");
  return wire.SerializeAsString();
}

std::string load_bytes(std::uint64_t worker_id) {
  v1::LoadMetrics wire;
  wire.set_worker_id(worker_id);
  wire.set_incarnation(3);
  auto* rank = wire.add_ranks();
  rank->set_dp_rank(1);
  rank->set_active_requests(4);
  rank->set_waiting_requests(1);
  rank->set_kv_blocks_used(120);
  return wire.SerializeAsString();
}

std::string kv_batch_bytes(std::uint64_t worker_id, std::uint64_t event_id) {
  v1::KvEventBatch wire;
  wire.set_worker_id(worker_id);
  wire.set_incarnation(3);
  wire.set_dp_rank(1);
  wire.set_event_id(event_id);
  auto* stored = wire.add_events()->mutable_stored();
  stored->add_block_hashes(0x1111);
  stored->add_block_hashes(0x2222);
  wire.add_events()->mutable_cleared();
  return wire.SerializeAsString();
}

v1::RouteRequest route_wire(const std::string& request_id) {
  v1::RouteRequest wire;
  wire.set_request_id(request_id);
  wire.set_model("model-a");
  wire.set_routing_group("group-a");
  wire.mutable_block_hashes()->add_hashes(11);
  wire.mutable_block_hashes()->add_hashes(22);
  wire.mutable_block_hashes()->set_prompt_tokens(40);
  wire.set_tenant("team-a");
  return wire;
}

std::string report_bytes(const std::string& booking_id) {
  v1::LifecycleReport wire;
  wire.set_booking_id(booking_id);
  wire.set_event(v1::LIFECYCLE_EVENT_ABORTED);
  wire.set_error("client went away");
  wire.set_abort_cause(v1::ABORT_CAUSE_CLIENT_CANCELLED);
  return wire.SerializeAsString();
}

std::string generate_bytes(const std::string& request_id) {
  v1::GenerateRequest wire;
  *wire.mutable_route() = route_wire(request_id);
  wire.set_max_output_tokens(8);
  wire.set_stream_subject("client.stream." + request_id);
  return wire.SerializeAsString();
}

std::string cancel_bytes(const std::string& request_id) {
  v1::GenerateCancel wire;
  wire.set_request_id(request_id);
  return wire.SerializeAsString();
}

class NatsBridgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = testing::NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
    nats::NatsOptions options;
    options.url = server_->url();
    BridgeOptions bridge_options;
    bridge_options.ns = std::string{kNamespace};
    auto bridge = NatsBridge::connect(options, bridge_options, registry_,
                                      std::make_shared<metrics::RateLimitedLog>());
    ASSERT_TRUE(bridge) << bridge.error();
    bridge_ = std::move(*bridge);
    auto started = bridge_->start(recorder_.sinks());
    ASSERT_TRUE(started) << started.error();
    auto client = nats::NatsClient::connect(options);
    ASSERT_TRUE(client) << client.error();
    client_ = std::move(*client);
  }

  void TearDown() override {
    // The bridge's subscriptions end before the recorder they deliver to.
    if (bridge_) bridge_->stop();
  }

  void publish(const std::string& subject, const std::string& bytes) {
    auto sent = client_->publish(subject, bytes);
    ASSERT_TRUE(sent) << sent.error();
  }
  void publish_request(const std::string& subject, const std::string& reply,
                       const std::string& bytes) {
    auto sent = client_->publish_request(subject, reply, bytes);
    ASSERT_TRUE(sent) << sent.error();
  }

  double bad_messages(std::string_view subject) const {
    return registry_->value(metrics::NodeMetrics::kBadMessages,
                            {{"subject", std::string{subject}}});
  }

  static std::string ns() { return std::string{kNamespace}; }

  std::unique_ptr<testing::NatsServer> server_;
  std::shared_ptr<metrics::MetricsRegistry> registry_ =
      std::make_shared<metrics::MetricsRegistry>();
  SinkRecorder recorder_;
  std::unique_ptr<NatsBridge> bridge_;
  std::unique_ptr<nats::NatsClient> client_;
};

TEST_F(NatsBridgeTest, RegistrationReachesItsSinkDecoded) {
  publish(subjects::worker_register(ns()), registration_wire(7).SerializeAsString());
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.registrations.empty(); }));
  const auto registration = recorder_.read([&] { return recorder_.registrations.front(); });
  EXPECT_EQ(registration.worker_id, 7U);
  EXPECT_EQ(registration.incarnation, 3U);
  EXPECT_EQ(registration.model, "model-a");
  EXPECT_EQ(registration.routing_group, "group-a");
  EXPECT_EQ(registration.role, WorkerType::Aggregated);
  EXPECT_EQ(registration.block_size, 16U);
  EXPECT_EQ(registration.total_kv_blocks, 1000U);
  EXPECT_EQ(registration.data_parallel_size, 2U);
  EXPECT_EQ(registration.taints, std::vector<std::string>{"gpu=h100"});
  EXPECT_EQ(registration.generate_subject, subjects::worker_generate(ns(), 7));
  EXPECT_EQ(registration.dump_subject, subjects::worker_dump(ns(), 7));
  EXPECT_EQ(bad_messages(subjects::worker_register(ns())), 0);
}

TEST_F(NatsBridgeTest, HeartbeatAndDeregistrationReachTheirSinksDecoded) {
  publish(subjects::worker_heartbeat(ns()), heartbeat_bytes(7));
  publish(subjects::worker_deregister(ns()), deregistration_bytes(8));
  ASSERT_TRUE(recorder_.wait_for(
      [&] { return !recorder_.heartbeats.empty() && !recorder_.deregistrations.empty(); }));
  recorder_.read([&] {
    EXPECT_EQ(recorder_.heartbeats.front().worker_id, 7U);
    EXPECT_EQ(recorder_.heartbeats.front().incarnation, 3U);
    EXPECT_EQ(recorder_.deregistrations.front().worker_id, 8U);
    EXPECT_EQ(recorder_.deregistrations.front().incarnation, 3U);
  });
}

TEST_F(NatsBridgeTest, LoadReportReachesItsSinkDecoded) {
  publish(subjects::worker_load(ns()), load_bytes(7));
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.loads.empty(); }));
  const auto load = recorder_.read([&] { return recorder_.loads.front(); });
  EXPECT_EQ(load.worker_id, 7U);
  EXPECT_EQ(load.incarnation, 3U);
  ASSERT_EQ(load.ranks.size(), 1U);
  EXPECT_EQ(load.ranks.front().first, 1U);
  EXPECT_EQ(load.ranks.front().second.active_requests, 4U);
  EXPECT_EQ(load.ranks.front().second.waiting_requests, 1U);
  EXPECT_EQ(load.ranks.front().second.kv_blocks_used, 120U);
}

TEST_F(NatsBridgeTest, KvBatchReachesItsSinkDecoded) {
  publish(subjects::kv_events(ns(), 7), kv_batch_bytes(7, 5));
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.kv_batches.empty(); }));
  const auto batch = recorder_.read([&] { return recorder_.kv_batches.front(); });
  EXPECT_EQ(batch.worker, (WorkerWithDpRank{7, 1}));
  EXPECT_EQ(batch.incarnation, 3U);
  EXPECT_EQ(batch.event_id, 5U);
  ASSERT_EQ(batch.events.size(), 2U);
  ASSERT_TRUE(std::holds_alternative<KvStoredEvent>(batch.events[0]));
  EXPECT_EQ(std::get<KvStoredEvent>(batch.events[0]).block_hashes,
            (std::vector<BlockHash>{0x1111, 0x2222}));
  EXPECT_TRUE(std::holds_alternative<KvClearedEvent>(batch.events[1]));
}

TEST_F(NatsBridgeTest, KvBatchClaimingAnotherWorkerIsCountedAndDropped) {
  // Worker 8's subject carrying worker 7's batch, then worker 8's own.
  publish(subjects::kv_events(ns(), 8), kv_batch_bytes(7, 1));
  publish(subjects::kv_events(ns(), 8), kv_batch_bytes(8, 1));
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.kv_batches.empty(); }));
  EXPECT_EQ(recorder_.read([&] { return recorder_.kv_batches.size(); }), 1U);
  EXPECT_EQ(recorder_.read([&] { return recorder_.kv_batches.front().worker.worker_id; }), 8U);
  EXPECT_EQ(bad_messages(subjects::kv_events_all(ns())), 1);
}

TEST_F(NatsBridgeTest, RouteRequestReachesItsSinkDecodedWithItsReplySubject) {
  const std::string reply = client_->new_inbox();
  publish_request(subjects::router_route(ns()), reply, route_wire("r1").SerializeAsString());
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.routes.empty(); }));
  const auto route = recorder_.read([&] { return recorder_.routes.front(); });
  EXPECT_EQ(route.reply, reply);
  EXPECT_EQ(route.request.client_id(), "r1");
  // Scoped to the client's connection: two clients may both use id "r1".
  EXPECT_NE(route.request.id(), "r1");
  EXPECT_EQ(route.request.partition.model, "model-a");
  EXPECT_EQ(route.request.partition.routing_group, "group-a");
  EXPECT_EQ(route.request.selection.block_hashes, (std::vector<BlockHash>{11, 22}));
  EXPECT_EQ(route.request.selection.prompt_tokens, 40U);
  EXPECT_EQ(route.request.tenant, "team-a");
}

TEST_F(NatsBridgeTest, MalformedRouteRequestIsAnsweredWithAnInvalidRequestError) {
  Inbox answers;
  const std::string reply = client_->new_inbox();
  ASSERT_TRUE(answers.listen(*client_, reply));
  publish_request(subjects::router_route(ns()), reply, kGarbage);
  const auto answer = answers.first();
  ASSERT_TRUE(answer);
  v1::RouteDecision decision;
  ASSERT_TRUE(decision.ParseFromString(answer->data));
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_EQ(bad_messages(subjects::router_route(ns())), 1);
  EXPECT_EQ(recorder_.read([&] { return recorder_.routes.size(); }), 0U);
}

TEST_F(NatsBridgeTest, LifecycleReportReachesItsSinkDecodedWithItsReplySubject) {
  const std::string reply = client_->new_inbox();
  publish_request(subjects::router_report(ns()), reply, report_bytes("booking-1"));
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.reports.empty(); }));
  const auto report = recorder_.read([&] { return recorder_.reports.front(); });
  EXPECT_EQ(report.reply, reply);
  EXPECT_EQ(report.report.booking_id, "booking-1");
  EXPECT_EQ(report.report.event, LifecycleEventKind::Aborted);
  EXPECT_EQ(report.report.error, "client went away");
  EXPECT_EQ(report.report.abort_cause, AbortCause::client_cancelled);
}

TEST_F(NatsBridgeTest, MalformedLifecycleReportIsRefusedWithANegativeAck) {
  Inbox answers;
  const std::string reply = client_->new_inbox();
  ASSERT_TRUE(answers.listen(*client_, reply));
  publish_request(subjects::router_report(ns()), reply, kGarbage);
  const auto answer = answers.first();
  ASSERT_TRUE(answer);
  v1::LifecycleAck ack;
  ASSERT_TRUE(ack.ParseFromString(answer->data));
  EXPECT_FALSE(ack.accepted());
  EXPECT_EQ(bad_messages(subjects::router_report(ns())), 1);
  EXPECT_EQ(recorder_.read([&] { return recorder_.reports.size(); }), 0U);
}

TEST_F(NatsBridgeTest, GenerateRequestAndCancelReachTheirSinksDecoded) {
  const std::string reply = client_->new_inbox();
  publish_request(subjects::router_generate(ns()), reply, generate_bytes("g1"));
  publish(subjects::router_generate_cancel(ns()), cancel_bytes("g1"));
  ASSERT_TRUE(recorder_.wait_for(
      [&] { return !recorder_.generates.empty() && !recorder_.cancels.empty(); }));
  recorder_.read([&] {
    const auto& generate = recorder_.generates.front();
    EXPECT_EQ(generate.reply, reply);
    EXPECT_EQ(generate.request.route.client_id(), "g1");
    EXPECT_EQ(generate.request.route.partition.model, "model-a");
    EXPECT_EQ(generate.request.stream_subject, "client.stream.g1");
    EXPECT_EQ(generate.request.wire.max_output_tokens(), 8U);
    EXPECT_EQ(recorder_.cancels.front(), "g1");
  });
}

TEST_F(NatsBridgeTest, WorkerChunkOnTheStreamInboxReachesItsSinkWithItsStreamId) {
  v1::GenerateChunk chunk;
  chunk.set_request_id("g1");
  chunk.set_index(2);
  chunk.add_token_ids(42);
  // A stream id that is no number is dropped; the next chunk still arrives.
  publish(bridge_->stream_inbox_prefix() + ".not-a-number", chunk.SerializeAsString());
  publish(bridge_->stream_inbox_prefix() + ".17", chunk.SerializeAsString());
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.chunks.empty(); }));
  recorder_.read([&] {
    ASSERT_EQ(recorder_.chunks.size(), 1U);
    EXPECT_EQ(recorder_.chunks.front().first, 17U);
    EXPECT_EQ(recorder_.chunks.front().second.request_id(), "g1");
    EXPECT_EQ(recorder_.chunks.front().second.index(), 2U);
  });
  EXPECT_EQ(bad_messages("generate_stream"), 1);
}

TEST_F(NatsBridgeTest, RequestDumpPublishesOnTheWorkersDumpSubjectAndTheReplyReachesItsSink) {
  const std::string dump_subject = subjects::worker_dump(ns(), 7);
  Inbox worker;
  ASSERT_TRUE(worker.listen(*client_, dump_subject));
  ASSERT_TRUE(bridge_->request_dump(dump_subject, WorkerWithDpRank{7, 1}));
  const auto request = worker.first();
  ASSERT_TRUE(request);
  v1::KvDumpRequest wire;
  ASSERT_TRUE(wire.ParseFromString(request->data));
  EXPECT_EQ(wire.worker_id(), 7U);
  EXPECT_EQ(wire.dp_rank(), 1U);
  ASSERT_FALSE(request->reply.empty()) << "the worker answers on the request's reply subject";

  // The worker's answer on that reply subject: garbage first, then its dump.
  publish(request->reply, kGarbage);
  v1::KvDumpReply reply;
  reply.set_worker_id(7);
  reply.set_incarnation(3);
  reply.set_dp_rank(1);
  reply.set_last_event_id(9);
  reply.add_stored()->add_block_hashes(0x3333);
  publish(request->reply, reply.SerializeAsString());
  ASSERT_TRUE(recorder_.wait_for([&] { return !recorder_.kv_dumps.empty(); }));
  const auto dump = recorder_.read([&] { return recorder_.kv_dumps.front(); });
  EXPECT_EQ(dump.worker, (WorkerWithDpRank{7, 1}));
  EXPECT_EQ(dump.incarnation, 3U);
  EXPECT_EQ(dump.last_event_id, 9U);
  ASSERT_EQ(dump.stored.size(), 1U);
  EXPECT_EQ(dump.stored.front().block_hashes, std::vector<BlockHash>{0x3333});
  EXPECT_EQ(bad_messages("kv_dump_reply"), 1);
}

// ---- malformed messages, one kind per case ------------------------------------------------

// One subscribed kind: where it is published, the subject its bad messages are counted under, a
// valid message, and how many the sink has received.
struct MessageKind {
  std::string name;
  std::function<std::string()> subject;
  std::function<std::string()> metric_subject;
  std::function<std::string()> valid;
  std::function<std::size_t(SinkRecorder&)> received;
};

void PrintTo(const MessageKind& kind, std::ostream* out) { *out << kind.name; }

std::vector<MessageKind> message_kinds() {
  const auto ns = [] { return std::string{kNamespace}; };
  return {
      {"registration", [=] { return subjects::worker_register(ns()); },
       [=] { return subjects::worker_register(ns()); },
       [] { return registration_wire(7).SerializeAsString(); },
       [](SinkRecorder& recorder) { return recorder.registrations.size(); }},
      {"heartbeat", [=] { return subjects::worker_heartbeat(ns()); },
       [=] { return subjects::worker_heartbeat(ns()); }, [] { return heartbeat_bytes(7); },
       [](SinkRecorder& recorder) { return recorder.heartbeats.size(); }},
      {"deregistration", [=] { return subjects::worker_deregister(ns()); },
       [=] { return subjects::worker_deregister(ns()); }, [] { return deregistration_bytes(7); },
       [](SinkRecorder& recorder) { return recorder.deregistrations.size(); }},
      {"load", [=] { return subjects::worker_load(ns()); },
       [=] { return subjects::worker_load(ns()); }, [] { return load_bytes(7); },
       [](SinkRecorder& recorder) { return recorder.loads.size(); }},
      // Counted under the wildcard subject the bridge subscribed.
      {"kv_events", [=] { return subjects::kv_events(ns(), 7); },
       [=] { return subjects::kv_events_all(ns()); }, [] { return kv_batch_bytes(7, 1); },
       [](SinkRecorder& recorder) { return recorder.kv_batches.size(); }},
      {"route", [=] { return subjects::router_route(ns()); },
       [=] { return subjects::router_route(ns()); },
       [] { return route_wire("r1").SerializeAsString(); },
       [](SinkRecorder& recorder) { return recorder.routes.size(); }},
      {"report", [=] { return subjects::router_report(ns()); },
       [=] { return subjects::router_report(ns()); }, [] { return report_bytes("booking-1"); },
       [](SinkRecorder& recorder) { return recorder.reports.size(); }},
      {"generate", [=] { return subjects::router_generate(ns()); },
       [=] { return subjects::router_generate(ns()); }, [] { return generate_bytes("g1"); },
       [](SinkRecorder& recorder) { return recorder.generates.size(); }},
      {"generate_cancel", [=] { return subjects::router_generate_cancel(ns()); },
       [=] { return subjects::router_generate_cancel(ns()); }, [] { return cancel_bytes("g1"); },
       [](SinkRecorder& recorder) { return recorder.cancels.size(); }},
  };
}

class NatsBridgeMalformedTest : public NatsBridgeTest,
                                public ::testing::WithParamInterface<MessageKind> {};

TEST_P(NatsBridgeMalformedTest, IsCountedAndDroppedAndTheNextValidOneStillArrives) {
  const MessageKind& kind = GetParam();
  publish(kind.subject(), kGarbage);
  publish(kind.subject(), kind.valid());
  // One publisher's messages reach a subscription in order: once the valid one is in, the
  // malformed one was handled before it.
  ASSERT_TRUE(recorder_.wait_for([&] { return kind.received(recorder_) >= 1; }));
  EXPECT_EQ(recorder_.read([&] { return kind.received(recorder_); }), 1U);
  EXPECT_EQ(bad_messages(kind.metric_subject()), 1);
}

std::string kind_name(const ::testing::TestParamInfo<MessageKind>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(EveryKind, NatsBridgeMalformedTest, ::testing::ValuesIn(message_kinds()),
                         kind_name);

}  // namespace
}  // namespace kvr

namespace kvr {
namespace {

// The worker feed: a node decodes the load and KV events of what it follows (a partition, or one
// worker of it), and nothing of the rest; the previous release's shared subjects still arrive.
class NatsBridgeFeedTest : public NatsBridgeTest {
 protected:
  // Published after the messages under test: once it arrives, the server has routed them.
  void publish_marker_and_wait(WorkerId marker) {
    publish(subjects::worker_load(ns()), load_bytes(marker));
    ASSERT_TRUE(recorder_.wait_for([&] {
      return std::ranges::any_of(
          recorder_.loads, [&](const WorkerLoadReport& load) { return load.worker_id == marker; });
    }));
  }

  std::set<WorkerId> loads_of() {
    return recorder_.read([&] {
      std::set<WorkerId> workers;
      for (const auto& load : recorder_.loads) workers.insert(load.worker_id);
      return workers;
    });
  }

  double decoded(std::string_view partition, std::string_view kind) const {
    return registry_->value(metrics::NodeMetrics::kWorkerMessagesDecoded,
                            {{"partition", std::string{partition}}, {"kind", std::string{kind}}});
  }
};

TEST_F(NatsBridgeFeedTest, AFollowedPartitionsMessagesArriveAndOtherPartitionsDoNot) {
  bridge_->follow("model-a/group-a", std::nullopt, "model-a/group-a");
  ASSERT_TRUE(bridge_->flush(kDeadline));
  // Worker 9's load goes out first: a subscription that (wrongly) took model-b's loads would
  // deliver it before worker 7's.
  publish(subjects::partition_load(ns(), "model-b/default", 9), load_bytes(9));
  publish(subjects::partition_load(ns(), "model-a/group-a", 7), load_bytes(7));
  publish(subjects::partition_kv_events(ns(), "model-a/group-a", 7), kv_batch_bytes(7, 1));
  // Loads and KV events come on subscriptions of their own, in no order between them.
  ASSERT_TRUE(recorder_.wait_for([&] {
    return !recorder_.kv_batches.empty() &&
           std::ranges::any_of(recorder_.loads,
                               [](const WorkerLoadReport& load) { return load.worker_id == 7; });
  }));
  ASSERT_NO_FATAL_FAILURE(publish_marker_and_wait(99));
  EXPECT_EQ(loads_of(), (std::set<WorkerId>{7, 99}));
  EXPECT_EQ(decoded("model-a/group-a", "load"), 1);
  EXPECT_EQ(decoded("model-a/group-a", "kv_events"), 1);
  EXPECT_EQ(
      registry_->value(metrics::NodeMetrics::kKvBlocksDecoded, {{"partition", "model-a/group-a"}}),
      2);
  EXPECT_EQ(decoded("previous_subjects", "load"), 1) << "the marker";
}

TEST_F(NatsBridgeFeedTest, AFollowedWorkerIsTheOnlyOneOfItsPartitionThatArrives) {
  bridge_->follow("model-a/default", 7, "model-a/default#1");
  ASSERT_TRUE(bridge_->flush(kDeadline));
  publish(subjects::partition_load(ns(), "model-a/default", 8), load_bytes(8));
  publish(subjects::partition_load(ns(), "model-a/default", 7), load_bytes(7));
  ASSERT_NO_FATAL_FAILURE(publish_marker_and_wait(99));
  ASSERT_TRUE(recorder_.wait_for([&] { return recorder_.loads.size() >= 2; }));
  EXPECT_EQ(loads_of(), (std::set<WorkerId>{7, 99}));
  EXPECT_EQ(decoded("model-a/default#1", "load"), 1);
  EXPECT_EQ(bridge_->followed(),
            (std::vector<std::pair<std::string, WorkerId>>{{"model-a/default", 7}}));
}

TEST_F(NatsBridgeFeedTest, AnUnfollowedPartitionIsNoLongerDecoded) {
  bridge_->follow("model-a/default", std::nullopt, "model-a/default");
  bridge_->unfollow("model-a/default", std::nullopt);
  ASSERT_TRUE(bridge_->flush(kDeadline));
  publish(subjects::partition_load(ns(), "model-a/default", 7), load_bytes(7));
  ASSERT_NO_FATAL_FAILURE(publish_marker_and_wait(99));
  EXPECT_EQ(loads_of(), (std::set<WorkerId>{99}));
  EXPECT_TRUE(bridge_->followed().empty());
}

TEST_F(NatsBridgeFeedTest, AMessageOnAnotherWorkersSubjectIsCountedAndDropped) {
  bridge_->follow("model-a/default", std::nullopt, "model-a/default");
  ASSERT_TRUE(bridge_->flush(kDeadline));
  // Worker 8's subjects carrying worker 7's messages, then worker 8's own: one subscription
  // delivers in order, so once worker 8's arrive the others were handled.
  publish(subjects::partition_load(ns(), "model-a/default", 8), load_bytes(7));
  publish(subjects::partition_kv_events(ns(), "model-a/default", 8), kv_batch_bytes(7, 1));
  publish(subjects::partition_load(ns(), "model-a/default", 8), load_bytes(8));
  publish(subjects::partition_kv_events(ns(), "model-a/default", 8), kv_batch_bytes(8, 1));
  ASSERT_TRUE(recorder_.wait_for(
      [&] { return !recorder_.loads.empty() && !recorder_.kv_batches.empty(); }));
  EXPECT_EQ(bad_messages(subjects::partition_load_all(ns(), "model-a/default")), 1);
  EXPECT_EQ(bad_messages(subjects::partition_kv_events_all(ns(), "model-a/default")), 1);
  EXPECT_EQ(loads_of(), (std::set<WorkerId>{8}));
  EXPECT_EQ(recorder_.read([&] { return recorder_.kv_batches.size(); }), 1U);
  EXPECT_EQ(recorder_.read([&] { return recorder_.kv_batches.front().worker.worker_id; }), 8U);
}

}  // namespace
}  // namespace kvr
