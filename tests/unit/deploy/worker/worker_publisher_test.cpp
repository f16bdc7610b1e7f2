// The worker side of kvr's NATS protocol against a real nats-server on 127.0.0.1: what each
// message carries and on which subject, the worker's subscriptions and dump answers; and, without
// NATS, the heartbeat cadence on an injected clock and the run loop's inbox.
#include "deploy/worker/worker_publisher.hpp"

#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "deploy/worker/worker_inbox.hpp"
#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/subjects.hpp"
#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::worker {
namespace {

using namespace std::chrono_literals;
using nats::NatsClient;
using nats::NatsMessage;
using testing::NatsRecorder;

constexpr std::string_view kNamespace = "worker-lib";
constexpr auto kDeadline = 10s;

class WorkerPublisherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = testing::NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
    nats::NatsOptions options;
    options.url = server_->url();
    auto client = NatsClient::connect(options, {});
    ASSERT_TRUE(client) << client.error();
    client_ = std::move(*client);
    publisher_.emplace(*client_, std::string{kNamespace}, "test");
  }

  // The first message `subject` receives after `publish` runs, parsed as `Proto`.
  template <class Proto>
  Proto first_on(const std::string& subject, const std::function<void()>& publish) {
    NatsRecorder recorder;
    EXPECT_TRUE(recorder.listen(*client_, subject));
    publish();
    EXPECT_TRUE(recorder.wait_for(1, kDeadline));
    const auto decoded = recorder.decoded<Proto>();
    return decoded.empty() ? Proto{} : decoded.front();
  }

  std::unique_ptr<testing::NatsServer> server_;
  std::unique_ptr<NatsClient> client_;
  std::optional<WorkerPublisher> publisher_;
};

TEST_F(WorkerPublisherTest, RegistersWithTheDescriptionAndTheWorkersOwnSubjects) {
  const WorkerDescription description{.model = "m",
                                      .role = WorkerType::Prefill,
                                      .routing_group = "g",
                                      .block_size = 16,
                                      .total_kv_blocks = 2048,
                                      .data_parallel_size = 2,
                                      .taints = {"gpu=h100"},
                                      .max_num_batched_tokens = 8192,
                                      .max_num_seqs = 256,
                                      .publishes_kv_events = false,
                                      .liveness_ttl = 1500ms,
                                      .http_url = "http://10.0.0.7:8000"};
  const auto registration =
      first_on<v1::WorkerRegistration>(subjects::worker_register(kNamespace), [&] {
        publisher_->publish_registration({7, 0x51}, description);
      });
  EXPECT_EQ(registration.worker_id(), 7U);
  EXPECT_EQ(registration.incarnation(), 0x51U);
  EXPECT_EQ(registration.model(), "m");
  EXPECT_EQ(registration.role(), to_wire(WorkerType::Prefill));
  EXPECT_EQ(registration.routing_group(), "g");
  EXPECT_EQ(registration.block_size(), 16U);
  EXPECT_EQ(registration.total_kv_blocks(), 2048U);
  EXPECT_EQ(registration.data_parallel_size(), 2U);
  ASSERT_EQ(registration.taints_size(), 1);
  EXPECT_EQ(registration.taints(0), "gpu=h100");
  EXPECT_EQ(registration.max_num_batched_tokens(), 8192U);
  EXPECT_EQ(registration.max_num_seqs(), 256U);
  EXPECT_FALSE(registration.publishes_kv_events());
  EXPECT_EQ(registration.liveness_ttl_ms(), 1500U);
  EXPECT_EQ(registration.generate_subject(), subjects::worker_generate(kNamespace, 7));
  EXPECT_EQ(registration.dump_subject(), subjects::worker_dump(kNamespace, 7));
  EXPECT_EQ(registration.http_url(), "http://10.0.0.7:8000");
}

TEST_F(WorkerPublisherTest, AWorkerWithoutCapacityRegistersZeroTotalKvBlocks) {
  const WorkerDescription description{.model = "m", .block_size = 16};
  const auto registration =
      first_on<v1::WorkerRegistration>(subjects::worker_register(kNamespace), [&] {
        publisher_->publish_registration({7, 0x51}, description);
      });
  EXPECT_EQ(registration.worker_id(), 7U);
  EXPECT_EQ(registration.total_kv_blocks(), 0U) << "0 on the wire: the engine did not say";
}

TEST_F(WorkerPublisherTest, HeartbeatsAndDeregistrationsCarryTheIncarnation) {
  const auto heartbeat = first_on<v1::WorkerHeartbeat>(subjects::worker_heartbeat(kNamespace), [&] {
    publisher_->publish_heartbeat({7, 3});
  });
  EXPECT_EQ(heartbeat.worker_id(), 7U);
  EXPECT_EQ(heartbeat.incarnation(), 3U);
  EXPECT_GT(heartbeat.sent_at_unix_ms(), 0U);
  const auto deregistration =
      first_on<v1::WorkerDeregistration>(subjects::worker_deregister(kNamespace), [&] {
        publisher_->publish_deregistration({7, 3}, "done");
      });
  EXPECT_EQ(deregistration.worker_id(), 7U);
  EXPECT_EQ(deregistration.incarnation(), 3U);
  EXPECT_EQ(deregistration.reason(), "done");
}

TEST_F(WorkerPublisherTest, ReportsEachRanksLoadUnderItsIndex) {
  const discovery::ConfirmedLoad ranks[] = {
      {.active_requests = 3, .waiting_requests = 1, .kv_blocks_used = 40},
      {.active_requests = 5,
       .waiting_requests = 2,
       .active_decode_blocks = 9,
       .active_prefill_tokens = 100,
       .kv_blocks_used = 50}};
  const auto load = first_on<v1::LoadMetrics>(subjects::worker_load(kNamespace), [&] {
    publisher_->publish_load({7, 3}, ranks);
  });
  EXPECT_EQ(load.worker_id(), 7U);
  EXPECT_EQ(load.incarnation(), 3U);
  ASSERT_EQ(load.ranks_size(), 2);
  EXPECT_EQ(load.ranks(0).dp_rank(), 0U);
  EXPECT_EQ(load.ranks(0).active_requests(), 3U);
  EXPECT_EQ(load.ranks(0).waiting_requests(), 1U);
  EXPECT_EQ(load.ranks(0).active_decode_blocks(), 0U);
  EXPECT_EQ(load.ranks(0).kv_blocks_used(), 40U);
  EXPECT_EQ(load.ranks(1).dp_rank(), 1U);
  EXPECT_EQ(load.ranks(1).active_decode_blocks(), 9U);
  EXPECT_EQ(load.ranks(1).active_prefill_tokens(), 100U);
}

TEST_F(WorkerPublisherTest, PublishesKvBatchesOnTheSubjectOfTheirWorker) {
  const KvEventBatch batch{.worker = {9, 1},
                           .incarnation = 5,
                           .event_id = 12,
                           .events = {KvStoredEvent{.block_hashes = {100, 101}}}};
  const auto wire = first_on<v1::KvEventBatch>(subjects::kv_events(kNamespace, 9),
                                               [&] { publisher_->publish_kv_batch(batch); });
  EXPECT_EQ(wire.worker_id(), 9U);
  EXPECT_EQ(wire.dp_rank(), 1U);
  EXPECT_EQ(wire.incarnation(), 5U);
  EXPECT_EQ(wire.event_id(), 12U);
  EXPECT_EQ(wire.events_size(), 1);
}

TEST_F(WorkerPublisherTest, ARegisteredWorkersLoadAndKvEventsGoOnItsPartitionsSubjects) {
  // Published on subjects that name the partition, so that a node follows only its own.
  publisher_->publish_registration({9, 5},
                                   WorkerDescription{.model = "llama-3.1", .block_size = 16});
  const discovery::ConfirmedLoad ranks[] = {{.active_requests = 2}};
  const auto load =
      first_on<v1::LoadMetrics>(subjects::partition_load(kNamespace, "llama-3.1/default", 9), [&] {
        publisher_->publish_load({9, 5}, ranks);
      });
  EXPECT_EQ(load.worker_id(), 9U);
  EXPECT_EQ(load.ranks(0).active_requests(), 2U);
  const KvEventBatch batch{.worker = {9, 0}, .incarnation = 5, .event_id = 1};
  const auto wire =
      first_on<v1::KvEventBatch>(subjects::partition_kv_events(kNamespace, "llama-3.1/default", 9),
                                 [&] { publisher_->publish_kv_batch(batch); });
  EXPECT_EQ(wire.worker_id(), 9U);
  EXPECT_EQ(subjects::partition_kv_events(kNamespace, "llama-3.1/default", 9),
            "kvr." + std::string{kNamespace} + ".kv.llama-3=2E1/default.9");
}

TEST_F(WorkerPublisherTest, AnswersDumpRequestsOnTheirReplySubject) {
  std::promise<std::optional<DpRank>> read;
  auto subscriptions = publisher_->subscribe_worker(
      7, WorkerSubjectHandlers{.on_dump = [&](NatsMessage message) {
        const auto rank = read_dump_request(message, 2);
        if (rank)
          publisher_->publish_dump(
              message.reply, KvDump{.worker = {7, *rank}, .incarnation = 3, .last_event_id = 41});
        read.set_value(rank);
      }});
  ASSERT_TRUE(subscriptions) << subscriptions.error();
  EXPECT_EQ(subscriptions->size(), 1U);  // only the dump subject has a handler
  ASSERT_TRUE(client_->flush(kDeadline));
  v1::KvDumpRequest request;
  request.set_worker_id(7);
  request.set_dp_rank(1);
  auto reply = client_->request(subjects::worker_dump(kNamespace, 7), request.SerializeAsString(),
                                kDeadline);
  ASSERT_TRUE(reply) << reply.error();
  EXPECT_EQ(read.get_future().get(), DpRank{1});
  v1::KvDumpReply dump;
  ASSERT_TRUE(dump.ParseFromString(reply->data));
  EXPECT_EQ(dump.worker_id(), 7U);
  EXPECT_EQ(dump.dp_rank(), 1U);
  EXPECT_EQ(dump.incarnation(), 3U);
  EXPECT_EQ(dump.last_event_id(), 41U);
}

TEST(ReadDumpRequestTest, RefusesGarbageAMissingReplyAndRanksBeyondTheWorkers) {
  v1::KvDumpRequest request;
  request.set_worker_id(7);
  request.set_dp_rank(1);
  const std::string bytes = request.SerializeAsString();
  EXPECT_EQ(read_dump_request(NatsMessage{.subject = "s", .reply = "r", .data = bytes}, 2),
            DpRank{1});
  EXPECT_FALSE(read_dump_request(NatsMessage{.subject = "s", .reply = "", .data = bytes}, 2));
  EXPECT_FALSE(read_dump_request(NatsMessage{.subject = "s", .reply = "r", .data = bytes}, 1));
  EXPECT_FALSE(read_dump_request(NatsMessage{.subject = "s", .reply = "r", .data = "\xff\xff"}, 2));
}

TEST_F(WorkerPublisherTest, HandsGenerateCancelAndDiscoverToTheirHandlers) {
  WorkerInbox<std::string> arrived;
  auto subscriptions = publisher_->subscribe_worker(
      7, WorkerSubjectHandlers{
             .on_generate = [&](NatsMessage message) { arrived.push("generate:" + message.data); },
             .on_cancel = [&](NatsMessage message) { arrived.push("cancel:" + message.data); },
             .on_dump = [&](NatsMessage message) { arrived.push("dump:" + message.data); }});
  ASSERT_TRUE(subscriptions) << subscriptions.error();
  auto discover = publisher_->subscribe_discover([&] { arrived.push("discover"); });
  ASSERT_TRUE(discover) << discover.error();
  ASSERT_TRUE(client_->flush(kDeadline));
  const std::string generate = subjects::worker_generate(kNamespace, 7);
  ASSERT_TRUE(client_->publish(generate, "g"));
  ASSERT_TRUE(client_->publish(generate + ".cancel", "c"));
  ASSERT_TRUE(client_->publish(subjects::worker_dump(kNamespace, 7), "d"));
  ASSERT_TRUE(client_->publish(subjects::worker_discover(kNamespace), ""));

  std::vector<std::string> seen;
  const auto deadline = std::chrono::steady_clock::now() + kDeadline;
  std::stop_source never;
  while (seen.size() < 4 && std::chrono::steady_clock::now() < deadline) {
    arrived.wait_until(never.get_token(), deadline);
    std::deque<std::string> batch;
    arrived.take_all(batch);
    seen.insert(seen.end(), batch.begin(), batch.end());
  }
  std::ranges::sort(seen);
  EXPECT_EQ(seen, (std::vector<std::string>{"cancel:c", "discover", "dump:d", "generate:g"}));
}

TEST(PeriodicTimerTest, FiresWhenDueThenOneIntervalAfterEachFiring) {
  const PeriodicTimer::TimePoint start{};
  PeriodicTimer timer{100ms, start + 100ms};
  EXPECT_FALSE(timer.fire(start + 99ms));
  EXPECT_TRUE(timer.fire(start + 100ms));
  EXPECT_EQ(timer.next(), start + 200ms);
  EXPECT_FALSE(timer.fire(start + 150ms));
  // A late firing is not caught up: the next deadline counts from when it fired.
  EXPECT_TRUE(timer.fire(start + 350ms));
  EXPECT_EQ(timer.next(), start + 450ms);
}

TEST(PeriodicTimerTest, HeartbeatsThreeTimesPerLiveness) {
  EXPECT_EQ(heartbeat_interval(3000ms), 1000ms);
  EXPECT_EQ(heartbeat_interval(100ms), 33ms);
}

TEST(WorkerInboxTest, TakesEverythingQueuedInOrderAndDropsWhatItIsTold) {
  WorkerInbox<int> inbox;
  for (int i = 1; i <= 5; ++i) inbox.push(i);
  inbox.erase_if([](int item) { return item % 2 == 0; });
  std::deque<int> taken;
  inbox.take_all(taken);
  EXPECT_EQ(taken, (std::deque<int>{1, 3, 5}));
  taken.clear();
  inbox.take_all(taken);
  EXPECT_TRUE(taken.empty());
}

TEST(WorkerInboxTest, WakesTheLoopOnAPushFromAnotherThread) {
  WorkerInbox<int> inbox;
  std::stop_source never;
  std::jthread pusher{[&] { inbox.push(42); }};
  // The deadline is far: only the push can end the wait in time for the test.
  inbox.wait_until(never.get_token(), std::chrono::steady_clock::now() + 1h);
  std::deque<int> taken;
  inbox.take_all(taken);
  EXPECT_EQ(taken, std::deque<int>{42});
}

TEST(WorkerInboxTest, WakesTheLoopOnAStopRequest) {
  WorkerInbox<int> inbox;
  std::stop_source stop;
  std::jthread stopper{[&] { stop.request_stop(); }};
  inbox.wait(stop.get_token());
  EXPECT_TRUE(stop.stop_requested());
}

TEST(WorkerInboxTest, ReturnsAtTheDeadlineWhenNothingArrives) {
  WorkerInbox<int> inbox;
  std::stop_source never;
  inbox.wait_until(never.get_token(), std::chrono::steady_clock::now());
  std::deque<int> taken;
  inbox.take_all(taken);
  EXPECT_TRUE(taken.empty());
}

}  // namespace
}  // namespace kvr::worker
