// `kvr node` in route mode as a real process, with real `kvr mocker` workers and a real
// nats-server on loopback: decisions over NATS request/reply, KV-aware routing to the worker that
// holds a prefix, lifecycle reports and booking expiry (observed on /metrics), a killed worker
// leaving routing, a nats-server restart, and bad messages on every subscribed subject.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>

#include <gtest/gtest.h>
#include <signal.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::free_port;
using testing::http_get;
using testing::metric;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "node";
constexpr WorkerId kFirstWorker = 100;
constexpr WorkerId kSecondFleetWorker = 200;
constexpr std::uint32_t kBlockSize = 16;

class NodeTest : public testing::KvrClusterTest {
 protected:
  NodeTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace},
                       testing::reconnecting_client()) {}

  void TearDown() override {
    // Log files help when something failed.
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
      if (server_) std::cerr << "---- nats-server log\n" << server_->process().log();
    }
  }

  std::optional<ChildProcess> start_mocker(WorkerId base, int workers, const std::string& log) {
    return kvr_->start_mocker({.workers = workers,
                               .worker_id_base = base,
                               .block_size = kBlockSize,
                               .num_gpu_blocks = 512,
                               .time_scale = "20",
                               .liveness_ttl_ms = 600,
                               .load_interval_ms = 50,
                               .nats_reconnect_wait_ms = 50},
                              log);
  }

  // Starts two mocker workers and the node; returns once a route succeeds.
  void start_cluster(const std::string& booking_ttl_secs = "60") {
    mocker_ = start_mocker(kFirstWorker, 2, "mocker.log");
    ASSERT_TRUE(mocker_);
    metrics_port_ = free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize,
                              .metrics_port = metrics_port_,
                              .booking_ttl_secs = booking_ttl_secs,
                              .nats_reconnect_wait_ms = 50});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    ASSERT_TRUE(testing::wait_until_routable(
        *client_, kNamespace, std::nullopt, [&] { return next_id(); }, 20s))
        << node_->log();
  }

  std::string next_id() { return "req-" + std::to_string(++request_counter_); }

  std::optional<v1::RouteDecision> route(const std::vector<std::uint32_t>& tokens,
                                         const std::string& request_id,
                                         std::vector<WorkerId> allowed = {}) {
    v1::RouteRequest request;
    request.set_request_id(request_id);
    request.set_model("mock-model");
    for (std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
    for (WorkerId id : allowed) request.add_allowed_workers(id);
    return send_route(request.SerializeAsString());
  }

  std::optional<v1::RouteDecision> send_route(const std::string& bytes) {
    return testing::request_route(*client_, kNamespace, bytes);
  }

  std::optional<v1::LifecycleAck> report(const std::string& booking, v1::LifecycleEvent event) {
    return testing::report_lifecycle(*client_, kNamespace, booking, event);
  }

  std::string metrics_text() { return http_get(metrics_port_, "/metrics"); }

  // Sends a generate request straight to a worker and waits for its last chunk.
  void generate_on(WorkerId worker, const std::vector<std::uint32_t>& tokens) {
    ChunkStream stream;
    ASSERT_TRUE(stream.open(*client_));
    v1::GenerateRequest request;
    request.mutable_route()->set_request_id(next_id());
    for (std::uint32_t token : tokens) request.mutable_route()->mutable_tokens()->add_ids(token);
    request.set_max_output_tokens(2);
    request.set_stream_subject(stream.subject());
    ASSERT_TRUE(client_->publish(subjects::worker_generate(kNamespace, worker),
                                 request.SerializeAsString()));
    ASSERT_TRUE(wait_until([&] { return stream.finished(); }, 10s));
  }

  std::optional<ChildProcess> mocker_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
  int request_counter_ = 0;
};

TEST_F(NodeTest, RoutesToMockerWorkersAndToTheWorkerHoldingThePrefix) {
  start_cluster();
  std::set<WorkerId> chosen;
  for (int i = 0; i < 6; ++i) {
    auto decision = route(prompt(48, 1000 + 100 * i), next_id());
    ASSERT_TRUE(decision && decision->has_success());
    chosen.insert(decision->success().worker_id());
    EXPECT_EQ(decision->success().policy(), "default");
    EXPECT_EQ(decision->success().generate_subject(),
              subjects::worker_generate(kNamespace, decision->success().worker_id()));
    report(decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
  }
  for (WorkerId id : chosen) EXPECT_TRUE(id == kFirstWorker || id == kFirstWorker + 1) << id;

  // Worker 101 computes a prefix; once its KV events reached the node, kv-cost routes there.
  const auto tokens = prompt(128, 50'000);
  generate_on(kFirstWorker + 1, tokens);
  std::optional<v1::RouteDecision> decision;
  ASSERT_TRUE(wait_until(
      [&] {
        decision = route(tokens, next_id());
        if (!decision || !decision->has_success()) return false;
        report(decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
        return decision->success().device_overlap_blocks() >= 8;
      },
      10s));
  EXPECT_EQ(decision->success().worker_id(), kFirstWorker + 1);
  EXPECT_GT(metric(metrics_text(), "kvr_index_blocks"), 0);
}

// Warm start: a node started while its workers sit idle sees no KV event, so only the dump it
// asks each worker for at registration shows what the workers hold.
TEST_F(NodeTest, ANodeStartedBesideIdleWorkersLearnsTheirCacheFromDumps) {
  start_cluster();
  const auto tokens = prompt(128, 60'000);
  generate_on(kFirstWorker, tokens);
  const auto routes_to_cache = [&] {
    const auto decision = route(tokens, next_id());
    if (!decision || !decision->has_success()) return false;
    report(decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
    return decision->success().worker_id() == kFirstWorker &&
           decision->success().device_overlap_blocks() >= 8;
  };
  ASSERT_TRUE(wait_until(routes_to_cache, 10s));

  // A new node replaces this one while the workers stay idle.
  ASSERT_EQ(node_->stop(), 0) << node_->log();
  metrics_port_ = free_port();
  node_ = kvr_->start_node(
      {.block_size = kBlockSize, .metrics_port = metrics_port_, .nats_reconnect_wait_ms = 50},
      "node-2.log");
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  const auto started = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_until(routes_to_cache, 10s)) << node_->log();
  std::printf("[ warm start ] the new node routed to the cache %.0f ms after /healthz answered\n",
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
                  .count());
  EXPECT_GE(metric(metrics_text(), "kvr_index_blocks"), 8);
}

TEST_F(NodeTest, ReportsReleaseBookingsAndUnreportedBookingsExpire) {
  start_cluster("1");
  const auto bookings = [&] { return metric(metrics_text(), "kvr_bookings_open"); };
  ASSERT_TRUE(wait_until([&] { return bookings() == 0; }, 5s));

  auto decision = route(prompt(40, 7), next_id());
  ASSERT_TRUE(decision && decision->has_success());
  EXPECT_EQ(decision->success().booking_ttl_ms(), 1000U);
  EXPECT_EQ(bookings(), 1);
  const std::string booking = decision->success().booking_id();
  auto ack = report(booking, v1::LIFECYCLE_EVENT_FIRST_TOKEN);
  ASSERT_TRUE(ack);
  EXPECT_TRUE(ack->accepted()) << ack->message();
  EXPECT_EQ(bookings(), 1);
  ack = report(booking, v1::LIFECYCLE_EVENT_COMPLETED);
  ASSERT_TRUE(ack);
  EXPECT_TRUE(ack->accepted()) << ack->message();
  EXPECT_EQ(bookings(), 0);
  ack = report(booking, v1::LIFECYCLE_EVENT_COMPLETED);
  ASSERT_TRUE(ack);
  // Released exactly once: a repeat (a client's resend) is acknowledged and changes nothing.
  EXPECT_TRUE(ack->accepted()) << ack->message();
  EXPECT_NE(ack->message().find("already_ended"), std::string::npos) << ack->message();
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metric(metrics_text(), R"(kvr_lifecycle_reports_after_end_total{event="completed")"),
            1);

  // A report published without a reply subject (nobody waits for an ack) releases too.
  const std::string accepted_completions =
      R"(kvr_lifecycle_reports_total{event="completed",accepted="true")";
  const double completions_before = metric(metrics_text(), accepted_completions);
  decision = route(prompt(40, 8), next_id());
  ASSERT_TRUE(decision && decision->has_success());
  EXPECT_EQ(bookings(), 1);
  v1::LifecycleReport fire_and_forget;
  fire_and_forget.set_booking_id(decision->success().booking_id());
  fire_and_forget.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
  ASSERT_TRUE(
      client_->publish(subjects::router_report(kNamespace), fire_and_forget.SerializeAsString()));
  EXPECT_TRUE(wait_until([&] { return bookings() == 0; }, 5s));
  EXPECT_TRUE(wait_until(
      [&] { return metric(metrics_text(), accepted_completions) == completions_before + 1; }, 5s));
  ack = report(decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
  ASSERT_TRUE(ack);
  EXPECT_NE(ack->message().find("already_ended"), std::string::npos)
      << "its booking ended with the first report: " << ack->message();

  // Never reported: released by expiry.
  const double expired_before = metric(metrics_text(), "kvr_route_bookings_expired_total");
  decision = route(prompt(40, 9), next_id());
  ASSERT_TRUE(decision && decision->has_success());
  EXPECT_EQ(bookings(), 1);
  EXPECT_TRUE(wait_until([&] { return bookings() == 0; }, 5s));
  EXPECT_TRUE(wait_until(
      [&] { return metric(metrics_text(), "kvr_route_bookings_expired_total") > expired_before; },
      5s));
  ack = report(decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
  ASSERT_TRUE(ack);
  EXPECT_FALSE(ack->accepted()) << "an expired booking refuses its report";
}

TEST_F(NodeTest, AKilledWorkerLeavesRoutingWithinItsTtl) {
  start_cluster();
  auto second = start_mocker(kSecondFleetWorker, 1, "second.log");
  ASSERT_TRUE(second);
  ASSERT_TRUE(wait_until(
      [&] {
        auto decision = route(prompt(20, 1), next_id(), {kSecondFleetWorker});
        return decision && decision->has_success() &&
               decision->success().worker_id() == kSecondFleetWorker;
      },
      10s));
  second->signal(SIGKILL);
  ASSERT_TRUE(second->wait(5s));
  // The lease is 600 ms; expiry runs every 100 ms.
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_until(
      [&] {
        auto decision = route(prompt(20, 1), next_id(), {kSecondFleetWorker});
        return decision && decision->has_error();
      },
      5s));
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 3s);
  for (int i = 0; i < 10; ++i) {
    auto decision = route(prompt(20, 300 + i), next_id());
    ASSERT_TRUE(decision && decision->has_success());
    EXPECT_NE(decision->success().worker_id(), kSecondFleetWorker);
  }
}

TEST_F(NodeTest, ServesAgainAfterTheNatsServerRestarts) {
  start_cluster();
  server_->stop();
  std::string error;
  ASSERT_TRUE(server_->restart(&error)) << error;
  ASSERT_TRUE(wait_until(
      [&] {
        auto decision = route(prompt(32, 5), next_id());
        return decision && decision->has_success();
      },
      20s));
  ASSERT_TRUE(node_->running());
  EXPECT_GE(metric(metrics_text(), "kvr_nats_reconnects_total"), 1);
  EXPECT_EQ(metric(metrics_text(), "kvr_nats_connected"), 1);
}

TEST_F(NodeTest, BadMessagesOnEverySubjectAreCountedAndDropped) {
  start_cluster();
  const std::string garbage = "\xff\xff\xff\x01 not protobuf";
  const std::vector<std::string> worker_subjects{
      subjects::worker_register(kNamespace), subjects::worker_heartbeat(kNamespace),
      subjects::worker_deregister(kNamespace), subjects::worker_load(kNamespace),
      subjects::kv_events(kNamespace, kFirstWorker)};
  for (const auto& subject : worker_subjects) ASSERT_TRUE(client_->publish(subject, garbage));

  // Absurd values in well-formed messages.
  v1::WorkerRegistration registration;
  registration.set_worker_id(999);
  registration.set_model("mock-model");
  registration.set_role(v1::WORKER_ROLE_AGGREGATED);
  registration.set_block_size(kBlockSize);
  registration.set_total_kv_blocks(std::uint64_t{1} << 60);
  ASSERT_TRUE(
      client_->publish(subjects::worker_register(kNamespace), registration.SerializeAsString()));
  v1::LoadMetrics load;
  load.set_worker_id(kFirstWorker);
  auto* rank = load.add_ranks();
  rank->set_active_requests(1);
  rank->set_waiting_requests(1'000'000);
  ASSERT_TRUE(client_->publish(subjects::worker_load(kNamespace), load.SerializeAsString()));
  v1::KvEventBatch batch;
  batch.set_worker_id(kFirstWorker + 1);  // on worker 100's subject
  batch.set_event_id(1);
  ASSERT_TRUE(
      client_->publish(subjects::kv_events(kNamespace, kFirstWorker), batch.SerializeAsString()));

  // Requests get an explicit answer.
  auto bad_route = send_route(garbage);
  ASSERT_TRUE(bad_route);
  ASSERT_TRUE(bad_route->has_error());
  EXPECT_EQ(bad_route->error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  v1::RouteRequest absurd;
  absurd.set_request_id("absurd");
  absurd.set_model("mock-model");
  absurd.mutable_block_hashes()->set_prompt_tokens(4'000'000'000U);
  bad_route = send_route(absurd.SerializeAsString());
  ASSERT_TRUE(bad_route && bad_route->has_error());
  EXPECT_EQ(bad_route->error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_EQ(bad_route->request_id(), "absurd");
  auto reply = client_->request(subjects::router_report(kNamespace), garbage, 2s);
  ASSERT_TRUE(reply) << reply.error();
  v1::LifecycleAck ack;
  ASSERT_TRUE(ack.ParseFromString(reply->data));
  EXPECT_FALSE(ack.accepted());

  std::vector<std::string> every_subject = worker_subjects;
  every_subject.push_back(subjects::router_route(kNamespace));
  every_subject.push_back(subjects::router_report(kNamespace));
  every_subject[4] = subjects::kv_events_all(kNamespace);  // counted under the subscription
  // Registration, load and KV events got garbage and an absurd message each; each subscription
  // delivers in order, but the subscriptions run apart, so wait for every count.
  auto bad_messages = [&](const std::string& text, const std::string& subject) {
    return metric(text, "kvr_bad_messages_total{subject=\"" + subject + "\"");
  };
  ASSERT_TRUE(wait_until(
      [&] {
        const std::string text = metrics_text();
        for (const auto& subject : every_subject) {
          if (bad_messages(text, subject) < 1) return false;
        }
        return bad_messages(text, worker_subjects[0]) >= 2 &&
               bad_messages(text, worker_subjects[3]) >= 2 &&
               bad_messages(text, every_subject[4]) >= 2;
      },
      5s))
      << metrics_text();

  auto decision = route(prompt(32, 77), next_id());
  ASSERT_TRUE(decision && decision->has_success());
  EXPECT_TRUE(node_->running());
}

}  // namespace
}  // namespace kvr

namespace kvr {
namespace {

TEST_F(NodeTest, AFloodOfBadMessagesLeavesMemoryBoundedAndServing) {
  // Freed memory in ASan's quarantine would read as the node's growth.
  testing::use_small_asan_quarantine_in_children();
  start_cluster();
  const auto bad_total = [&] { return metric(metrics_text(), "kvr_bad_messages_total"); };
  // A first round grows the node to its working size (buffers, log rate limiter, metrics).
  const auto flood = [&](int rounds, int offset) {
    for (int i = 0; i < rounds; ++i) {
      // Garbage, an absurd registration per distinct worker id (never admitted), and an absurd
      // KV batch for a real worker: none of them may leave state behind.
      ASSERT_TRUE(client_->publish(subjects::worker_load(kNamespace), "\xff\xfe garbage"));
      v1::WorkerRegistration registration;
      registration.set_worker_id(static_cast<WorkerId>(1'000'000 + offset + i));
      registration.set_model("mock-model");
      registration.set_role(v1::WORKER_ROLE_AGGREGATED);
      registration.set_block_size(kBlockSize + 1);  // another block size: refused
      registration.set_total_kv_blocks(std::uint64_t{1} << 60);
      ASSERT_TRUE(client_->publish(subjects::worker_register(kNamespace),
                                   registration.SerializeAsString()));
      v1::KvEventBatch batch;
      batch.set_worker_id(kFirstWorker);
      batch.set_event_id(static_cast<std::uint64_t>(1'000'000 + offset + i));
      auto* stored = batch.add_events()->mutable_stored();
      stored->set_has_parent(true);
      stored->set_parent_hash(0x1234'5678'9ABC'DEF0ULL + static_cast<std::uint64_t>(i));
      for (int b = 0; b < 64; ++b) stored->add_block_hashes(static_cast<std::uint64_t>(i * 64 + b));
      ASSERT_TRUE(client_->publish(subjects::kv_events(kNamespace, kFirstWorker),
                                   batch.SerializeAsString()));
    }
    ASSERT_TRUE(client_->flush(5s));
  };
  constexpr int kRounds = 3000;
  flood(kRounds, 0);
  ASSERT_TRUE(wait_until([&] { return bad_total() >= 2 * kRounds; }, 30s)) << bad_total();
  const std::uint64_t settled = testing::resident_kib(node_->pid());
  ASSERT_GT(settled, 0U);
  const double before = bad_total();
  flood(kRounds, kRounds);
  ASSERT_TRUE(wait_until([&] { return bad_total() >= before + 2 * kRounds; }, 30s)) << bad_total();
  const std::uint64_t after = testing::resident_kib(node_->pid());
  // Three thousand more rejected messages of each kind may not grow the node by more than a
  // few MiB (allocator noise), far below what keeping any of them would cost.
  EXPECT_LT(after, settled + 8 * 1024) << "RSS " << settled << " KiB -> " << after << " KiB";
  auto decision = route(prompt(32, 7), next_id());
  ASSERT_TRUE(decision);
  EXPECT_TRUE(decision->has_success()) << decision->DebugString();
}

}  // namespace
}  // namespace kvr
