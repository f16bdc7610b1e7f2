// `kvr mocker` as a real process against a real nats-server, observed from the NATS side:
// registration, heartbeats, load, KV events, generate (streaming, cancellation), dumps,
// re-registration on discovery, bad input, clean shutdown, and disaggregated serving's prefill and
// decode hops (kv_transfer_params).
#include <algorithm>
#include <atomic>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include "discovery/block_hash.hpp"
#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/nats_recorder.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::NatsRecorder;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "mock";
constexpr WorkerId kFirstWorker = 100;
constexpr std::uint32_t kBlockSize = 16;
// Real milliseconds of a transfer's fixed cost, 500 ms at the fixture's time scale of 20: long
// enough for load reports to show a prefill worker holding the blocks.
constexpr std::string_view kTransferLatencyMs = "10000";
// The parameters a router sends with a prefill hop, as vLLM's disaggregated proxy does.
constexpr std::string_view kPrefillHop =
    R"({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,)"
    R"("remote_block_ids":null,"remote_host":null,"remote_port":null})";

class MockerTest : public testing::KvrClusterTest {
 protected:
  MockerTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_TRUE(registrations_.listen(*client_, subjects::worker_register(kNamespace)));
    ASSERT_TRUE(heartbeats_.listen(*client_, subjects::worker_heartbeat(kNamespace)));
    ASSERT_TRUE(loads_.listen(*client_, subjects::every_load(kNamespace)));
    ASSERT_TRUE(deregistrations_.listen(*client_, subjects::worker_deregister(kNamespace)));
    ASSERT_TRUE(kv_events_.listen(*client_, subjects::every_kv_events(kNamespace)));

    mocker_ =
        kvr_->start_mocker({.workers = 2,
                            .worker_id_base = kFirstWorker,
                            .block_size = kBlockSize,
                            .num_gpu_blocks = 512,
                            .time_scale = "20",
                            .liveness_ttl_ms = 600,
                            .load_interval_ms = 50,
                            .extra = {"--transfer-latency-ms", std::string{kTransferLatencyMs}}});
    ASSERT_TRUE(mocker_);
    ASSERT_TRUE(registrations_.wait_for(2, 10s)) << mocker_->log();
  }

  // Sends a generate request and collects its chunks until the finished one (or the timeout).
  std::vector<v1::GenerateChunk> generate(
      WorkerId worker, const std::string& request_id, const std::vector<std::uint32_t>& tokens,
      std::uint32_t output_tokens, std::function<void(const v1::GenerateChunk&)> on_chunk = {},
      std::string_view kv_transfer_params = {}) {
    ChunkStream stream;
    EXPECT_TRUE(stream.open(*client_, std::move(on_chunk)));
    v1::GenerateRequest request;
    request.mutable_route()->set_request_id(request_id);
    for (std::uint32_t token : tokens) request.mutable_route()->mutable_tokens()->add_ids(token);
    request.set_max_output_tokens(output_tokens);
    request.set_stream_subject(stream.subject());
    request.set_kv_transfer_params(std::string{kv_transfer_params});
    EXPECT_TRUE(client_->publish(subjects::worker_generate(kNamespace, worker),
                                 request.SerializeAsString()));
    EXPECT_TRUE(wait_until([&] { return stream.finished(); }, 20s)) << mocker_->log();
    return stream.chunks();
  }

  NatsRecorder registrations_, heartbeats_, loads_, deregistrations_, kv_events_;
  std::optional<ChildProcess> mocker_;
};

TEST_F(MockerTest, RegistersEveryWorkerWithItsEngineShape) {
  std::map<WorkerId, v1::WorkerRegistration> by_id;
  for (auto& registration : registrations_.decoded<v1::WorkerRegistration>()) {
    by_id[registration.worker_id()] = registration;
  }
  ASSERT_EQ(by_id.size(), 2U);
  const auto& first = by_id.at(kFirstWorker);
  EXPECT_EQ(first.block_size(), kBlockSize);
  EXPECT_EQ(first.total_kv_blocks(), 512U);
  EXPECT_EQ(first.role(), v1::WORKER_ROLE_AGGREGATED);
  EXPECT_EQ(first.generate_subject(), subjects::worker_generate(kNamespace, kFirstWorker));
  EXPECT_TRUE(first.publishes_kv_events());
  EXPECT_NE(first.incarnation(), 0U);
  EXPECT_TRUE(by_id.contains(kFirstWorker + 1));
}

TEST_F(MockerTest, SendsHeartbeatsAndLoadMetrics) {
  ASSERT_TRUE(wait_until([&] { return heartbeats_.size() >= 4 && loads_.size() >= 4; }, 5s));
  const auto loads = loads_.decoded<v1::LoadMetrics>();
  ASSERT_FALSE(loads.empty());
  ASSERT_EQ(loads.front().ranks_size(), 1);
  EXPECT_EQ(loads.front().ranks(0).active_requests(), 0U);
}

TEST_F(MockerTest, GenerateStreamsEveryTokenThenStoresThePromptBlocks) {
  const auto tokens = prompt(64, 1000);
  const auto chunks = generate(kFirstWorker, "r1", tokens, 5);
  ASSERT_EQ(chunks.size(), 5U);
  for (std::uint32_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].index(), i);
    EXPECT_EQ(chunks[i].token_ids_size(), 1);
    EXPECT_EQ(chunks[i].request_id(), "r1");
    EXPECT_EQ(chunks[i].worker_id(), kFirstWorker);
  }
  EXPECT_TRUE(chunks.back().finished());
  EXPECT_EQ(chunks.back().finish_reason(), "length");
  EXPECT_EQ(chunks.front().cached_prompt_tokens(), 0U);

  // The prompt's full blocks were announced, hashed by kvr's rule, on the worker's subject.
  const auto expected = discovery::BlockHasher{kBlockSize}.sequence_hashes(tokens);
  ASSERT_TRUE(wait_until([&] { return kv_events_.size() >= 1; }, 5s));
  std::vector<BlockHash> stored;
  std::uint64_t last_event_id = 0;
  for (const auto& batch : kv_events_.decoded<v1::KvEventBatch>()) {
    EXPECT_EQ(batch.worker_id(), kFirstWorker);
    EXPECT_GT(batch.event_id(), last_event_id);
    last_event_id = batch.event_id();
    for (const auto& event : batch.events()) {
      if (event.has_stored()) {
        stored.insert(stored.end(), event.stored().block_hashes().begin(),
                      event.stored().block_hashes().end());
      }
    }
  }
  EXPECT_EQ(stored, expected);
}

TEST_F(MockerTest, RepeatedPromptIsServedFromCache) {
  const auto tokens = prompt(96, 7);
  generate(kFirstWorker, "first", tokens, 2);
  const auto again = generate(kFirstWorker, "second", tokens, 2);
  ASSERT_FALSE(again.empty());
  EXPECT_GE(again.front().cached_prompt_tokens(), 80U);
}

TEST_F(MockerTest, DumpReturnsTheCachedChains) {
  const auto tokens = prompt(48, 50);
  generate(kFirstWorker + 1, "d1", tokens, 2);
  v1::KvDumpRequest request;
  request.set_worker_id(kFirstWorker + 1);
  auto reply = client_->request(subjects::worker_dump(kNamespace, kFirstWorker + 1),
                                request.SerializeAsString(), 5s);
  ASSERT_TRUE(reply) << reply.error();
  v1::KvDumpReply dump;
  ASSERT_TRUE(dump.ParseFromString(reply->data));
  EXPECT_EQ(dump.worker_id(), kFirstWorker + 1);
  EXPECT_GE(dump.last_event_id(), 1U);
  std::vector<BlockHash> dumped;
  for (const auto& chain : dump.stored()) {
    dumped.insert(dumped.end(), chain.block_hashes().begin(), chain.block_hashes().end());
  }
  EXPECT_EQ(dumped, discovery::BlockHasher{kBlockSize}.sequence_hashes(tokens));
}

TEST_F(MockerTest, CancelEndsTheStreamEarly) {
  std::atomic<bool> cancelled{false};
  const auto chunks =
      generate(kFirstWorker, "long", prompt(32, 3), 5000, [&](const v1::GenerateChunk& chunk) {
        if (chunk.index() == 2 && !cancelled.exchange(true)) {
          v1::GenerateCancel cancel;
          cancel.set_request_id("long");
          (void)client_->publish(subjects::worker_generate(kNamespace, kFirstWorker) + ".cancel",
                                 cancel.SerializeAsString());
        }
      });
  ASSERT_FALSE(chunks.empty());
  EXPECT_TRUE(chunks.back().finished());
  EXPECT_EQ(chunks.back().finish_reason(), "cancelled");
  EXPECT_LT(chunks.size(), 1000U);
}

TEST_F(MockerTest, BadInputIsDroppedAndServingContinues) {
  ASSERT_TRUE(
      client_->publish(subjects::worker_generate(kNamespace, kFirstWorker), "\xff\xff garbage"));
  // A request that cannot fit the pool gets an explicit error, not silence.
  const auto rejected = generate(kFirstWorker, "huge", prompt(512 * kBlockSize + 1, 0), 1);
  ASSERT_EQ(rejected.size(), 1U);
  EXPECT_EQ(rejected.front().finish_reason(), "error");
  EXPECT_EQ(rejected.front().error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  const auto served = generate(kFirstWorker, "after", prompt(20, 1), 3);
  EXPECT_EQ(served.size(), 3U);
}

TEST_F(MockerTest, PrefillHopMakesOneTokenAndAnswersWithTheDecodeHopsParameters) {
  const auto tokens = prompt(40, 3000);  // two full blocks and a partial one
  const auto chunks = generate(kFirstWorker, "p1", tokens, 8, {}, kPrefillHop);
  ASSERT_EQ(chunks.size(), 1U);
  EXPECT_TRUE(chunks[0].finished());
  EXPECT_EQ(chunks[0].finish_reason(), "length");
  EXPECT_EQ(chunks[0].token_ids_size(), 1);
  const auto params = nlohmann::json::parse(chunks[0].kv_transfer_params(), nullptr, false);
  ASSERT_TRUE(params.is_object()) << chunks[0].kv_transfer_params();
  EXPECT_EQ(params.at("do_remote_prefill"), true);
  EXPECT_EQ(params.at("do_remote_decode"), false);
  EXPECT_EQ(params.at("remote_block_ids").size(), 3U);
  EXPECT_EQ(params.at("remote_engine_id"), "kvr-mocker-" + std::to_string(kFirstWorker) + "-0");
  EXPECT_EQ(params.at("remote_request_id"), "p1");
  EXPECT_EQ(params.at("remote_host"), "127.0.0.1");
  EXPECT_TRUE(params.at("remote_port").is_number_integer());
  EXPECT_EQ(params.at("tp_size"), 1);
}

TEST_F(MockerTest, PrefillWorkerHoldsTheBlocksForTheModelledTransferThenFreesThem) {
  const std::size_t loads_before = loads_.size();
  generate(kFirstWorker, "held", prompt(40, 4000), 1, {}, kPrefillHop);
  // Load reports of the prefill worker from the hop on, in order.
  const auto blocks_used = [&] {
    std::vector<std::uint64_t> used;
    const auto loads = loads_.decoded<v1::LoadMetrics>();
    for (std::size_t i = loads_before; i < loads.size(); ++i) {
      if (loads[i].worker_id() == kFirstWorker) used.push_back(loads[i].ranks(0).kv_blocks_used());
    }
    return used;
  };
  ASSERT_TRUE(wait_until([&] { return std::ranges::count(blocks_used(), 3U) > 0; }, 10s))
      << mocker_->log();
  ASSERT_TRUE(wait_until(
      [&] {
        const auto used = blocks_used();
        const auto held = std::ranges::find(used, 3U);
        return std::find(held, used.end(), 0U) != used.end();
      },
      10s))
      << mocker_->log();
}

TEST_F(MockerTest, DecodeHopServesTheWholeOutputCountingTheTransferredPromptAsCached) {
  const auto tokens = prompt(40, 5000);
  const auto prefill = generate(kFirstWorker, "d-prefill", tokens, 1, {}, kPrefillHop);
  ASSERT_EQ(prefill.size(), 1U);
  ASSERT_FALSE(prefill[0].kv_transfer_params().empty());
  const std::size_t batches_before = kv_events_.size();

  const auto chunks =
      generate(kFirstWorker + 1, "d-decode", tokens, 5, {}, prefill[0].kv_transfer_params());
  ASSERT_EQ(chunks.size(), 5U);
  EXPECT_TRUE(chunks.back().finished());
  EXPECT_EQ(chunks.back().finish_reason(), "length");
  EXPECT_TRUE(chunks.back().kv_transfer_params().empty());
  // Every prompt token but the last came by transfer; the last is computed for its logits.
  EXPECT_EQ(chunks.front().cached_prompt_tokens(), tokens.size() - 1);

  // The decode worker announced the transferred blocks as its own.
  const auto expected = discovery::BlockHasher{kBlockSize}.sequence_hashes(tokens);
  std::vector<BlockHash> stored;
  ASSERT_TRUE(wait_until(
      [&] {
        stored.clear();
        const auto batches = kv_events_.decoded<v1::KvEventBatch>();
        for (std::size_t i = batches_before; i < batches.size(); ++i) {
          if (batches[i].worker_id() != kFirstWorker + 1) continue;
          for (const auto& event : batches[i].events()) {
            if (!event.has_stored()) continue;
            stored.insert(stored.end(), event.stored().block_hashes().begin(),
                          event.stored().block_hashes().end());
          }
        }
        return stored == expected;
      },
      10s))
      << "stored " << stored.size() << " of " << expected.size() << " blocks";
}

TEST_F(MockerTest, MalformedTransferParamsGetAnErrorChunkNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "kv_transfer_params"},
      {"[1, 2]", "kv_transfer_params"},
      {R"({"do_remote_prefill": true, "remote_block_ids": "0,1"})",
       "kv_transfer_params.remote_block_ids"},
      {R"({"do_remote_decode": "yes"})", "kv_transfer_params.do_remote_decode"}};
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const auto& [params, field] = bad[i];
    const auto chunks =
        generate(kFirstWorker, "bad-" + std::to_string(i), prompt(20, 6000), 2, {}, params);
    ASSERT_EQ(chunks.size(), 1U) << params;
    EXPECT_EQ(chunks[0].finish_reason(), "error") << params;
    EXPECT_EQ(chunks[0].error().code(), v1::ROUTE_ERROR_INVALID_REQUEST) << params;
    EXPECT_NE(chunks[0].error().message().find(field), std::string::npos)
        << params << ": " << chunks[0].error().message();
  }
  // The worker keeps serving.
  EXPECT_EQ(generate(kFirstWorker, "after-bad", prompt(20, 6000), 2).size(), 2U);
}

TEST_F(MockerTest, ReRegistersWhenARouterAsksForDiscovery) {
  const std::size_t before = registrations_.size();
  ASSERT_TRUE(client_->publish(subjects::worker_discover(kNamespace), ""));
  EXPECT_TRUE(wait_until([&] { return registrations_.size() >= before + 2; }, 5s));
}

TEST_F(MockerTest, DeregistersOnCleanShutdown) {
  mocker_->signal(SIGTERM);
  const auto status = mocker_->wait(10s);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(*status, 0) << mocker_->log();
  ASSERT_TRUE(client_->flush(2s));
  ASSERT_TRUE(wait_until([&] { return deregistrations_.size() >= 2; }, 5s));
  std::set<WorkerId> ids;
  for (const auto& message : deregistrations_.decoded<v1::WorkerDeregistration>()) {
    ids.insert(message.worker_id());
  }
  EXPECT_EQ(ids, (std::set<WorkerId>{kFirstWorker, kFirstWorker + 1}));
}

}  // namespace
}  // namespace kvr
