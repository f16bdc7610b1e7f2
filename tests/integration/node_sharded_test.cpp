// Sharded partitions with real processes: a nats-server with JetStream, one `kvr mocker` of eight
// workers of one model, and `kvr node --cluster --partition-shards shard-model=4` processes. Each
// shard is a partition leased by one node, placed evenly, and holds its share of the workers; a
// request sent to the queue group, whichever node takes it, is answered by its shard's owner, and
// every turn of a conversation goes to its prefix's shard. Killed with SIGKILL, a node's shards
// are served again within the lease TTL while the other shards never fail a request; a node that
// joins takes shards without a failed request.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/route_client.hpp"
#include "messages/subjects.hpp"
#include "selection/cluster/sharding.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::free_port;
using testing::metric;
using testing::wait_until;

constexpr std::string_view kNamespace = "sharded";
constexpr std::string_view kModel = "shard-model";
constexpr std::uint32_t kShards = 4;
constexpr int kWorkers = 8;
constexpr WorkerId kFirstWorker = 500;

std::string shard_partition(std::uint32_t shard) {
  return fmt::format("{}/default#{}", kModel, shard);
}

// The shard of each worker, as every node computes it from the same registrations.
cluster::ShardMap shard_map() {
  std::vector<cluster::ShardedWorker> fleet;
  for (int w = 0; w < kWorkers; ++w) {
    fleet.push_back({kFirstWorker + static_cast<WorkerId>(w),
                     static_cast<std::uint8_t>(WorkerType::Aggregated)});
  }
  cluster::ShardMap map{kShards};
  (void)map.assign(fleet);
  return map;
}

// Turn `turn` of conversation `conversation`: the conversation's own 96 opening tokens (past the
// 64-token shard prefix), then 32 tokens of the turn.
std::vector<std::uint32_t> conversation_prompt(int conversation, int turn) {
  std::vector<std::uint32_t> tokens;
  for (std::uint32_t i = 0; i < 96; ++i) {
    tokens.push_back(1'000'000 + 1000 * static_cast<std::uint32_t>(conversation) + i);
  }
  for (std::uint32_t i = 0; i < 32; ++i) {
    tokens.push_back(5'000'000 + 100 * static_cast<std::uint32_t>(turn) + i);
  }
  return tokens;
}

class NodeShardedTest : public testing::KvrClusterTest {
 protected:
  NodeShardedTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}, {}, {"-js"}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    // The workers' liveness is the default 3 s: a loaded machine can hold a heartbeat past a
    // shorter one, and a worker that drops out of the fleet reassigns the shards until it is back.
    auto mocker = kvr_->start_mocker({.workers = kWorkers,
                                      .worker_id_base = kFirstWorker,
                                      .block_size = 16,
                                      .num_gpu_blocks = 512,
                                      .liveness_ttl_ms = 3000,
                                      .extra = {"--model", std::string{kModel}}},
                                     "mocker.log");
    ASSERT_TRUE(mocker);
    mocker_.emplace(std::move(*mocker));
    for (int n = 0; n < 2; ++n) ASSERT_NO_FATAL_FAILURE(start_node());
    auto router = nats::RouteClient::open(*client_, subjects::router_route(kNamespace),
                                          subjects::router_report(kNamespace));
    ASSERT_TRUE(router) << router.error();
    router_.emplace(std::move(*router));
  }

  void TearDown() override {
    if (HasFailure()) {
      for (std::size_t n = 0; n < nodes_.size(); ++n) {
        std::cerr << "---- node-" << n << " log\n" << nodes_[n].log();
      }
    }
  }

  // Starts node-<next index> with short leases (1.5 s) and waits for its /healthz. This client
  // releases each booking at once, faster than the shards publish their load, so a node would
  // count its requests against their shards until then and spill later turns elsewhere: a high
  // miss cost keeps every request on its prefix's shard (spills: sharding_test, the replay).
  void start_node() {
    const int n = static_cast<int>(nodes_.size());
    const std::uint16_t port = free_port();
    auto node = kvr_->start_node(
        {.metrics_port = port,
         .extra = {"--cluster", "--node-id", fmt::format("node-{}", n), "--cluster-lease-ttl-ms",
                   "1500", "--partition-shards", fmt::format("{}={}", kModel, kShards),
                   "--shard-prefix-tokens", "64", "--shard-miss-cost", "1000"}},
        fmt::format("node-{}.log", n));
    ASSERT_TRUE(node);
    nodes_.push_back(std::move(*node));
    metrics_ports_.push_back(port);
    ASSERT_TRUE(testing::wait_until_healthy(port, 20s));
  }

  std::string metrics_of(int node) { return testing::http_get(metrics_ports_[node], "/metrics"); }

  // shard → the nodes (among `live`) that own it now.
  std::map<std::uint32_t, std::vector<int>> owners(const std::set<int>& live) {
    std::map<std::uint32_t, std::vector<int>> result;
    for (int n : live) {
      const std::string text = metrics_of(n);
      for (std::uint32_t shard = 0; shard < kShards; ++shard) {
        const std::string series =
            fmt::format("kvr_cluster_partition_owned{{partition=\"{}\"}}", shard_partition(shard));
        if (metric(text, series) == 1) result[shard].push_back(n);
      }
    }
    return result;
  }

  // Waits until every shard has exactly one owner among `live`, each live node owning an equal
  // share (shards / nodes, rounded up).
  bool evenly_owned(const std::set<int>& live, std::chrono::milliseconds timeout) {
    const std::size_t share = (kShards + live.size() - 1) / live.size();
    return wait_until(
        [&] {
          const auto now = owners(live);
          if (now.size() != kShards) return false;
          std::map<int, std::size_t> per_node;
          for (const auto& [shard, who] : now) {
            if (who.size() != 1) return false;
            ++per_node[who.front()];
          }
          return per_node.size() == std::min<std::size_t>(live.size(), kShards) &&
                 std::ranges::all_of(per_node,
                                     [&](const auto& entry) { return entry.second <= share; });
        },
        timeout);
  }

  std::optional<v1::RouteDecision> route(int conversation, int turn, int attempt = 0) {
    v1::RouteRequest wire;
    wire.set_request_id(fmt::format("c{}-t{}-a{}", conversation, turn, attempt));
    wire.set_model(std::string{kModel});
    for (std::uint32_t token : conversation_prompt(conversation, turn)) {
      wire.mutable_tokens()->add_ids(token);
    }
    auto routed = router_->route(wire);
    if (!routed) return std::nullopt;
    return std::move(routed->decision);
  }

  bool completed(const v1::RouteDecision& decision) {
    const auto ack = testing::report_lifecycle(
        *client_, kNamespace, decision.success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
    return ack && ack->accepted();
  }

  // Routes conversations until each of them is answered (every shard's owner has heard its
  // workers), returning the shard each conversation's first turn went to.
  std::map<int, std::uint32_t> warm_up(int conversations) {
    const cluster::ShardMap map = shard_map();
    std::map<int, std::uint32_t> shard_of;
    for (int c = 0; c < conversations; ++c) {
      int attempt = 0;
      EXPECT_TRUE(wait_until(
          [&] {
            const auto decision = route(c, 0, attempt++);
            if (!decision || !decision->has_success()) return false;
            shard_of[c] = *map.shard_of(decision->success().worker_id());
            return completed(*decision);
          },
          20s))
          << "conversation " << c;
    }
    return shard_of;
  }

  std::optional<ChildProcess> mocker_;
  std::vector<ChildProcess> nodes_;
  std::vector<std::uint16_t> metrics_ports_;
  std::optional<nats::RouteClient> router_;
};

TEST_F(NodeShardedTest, EachShardHasOneOwnerItsWorkersAndEveryConversationItsShard) {
  ASSERT_TRUE(evenly_owned({0, 1}, 20s));
  constexpr int kConversations = 24;
  const std::map<int, std::uint32_t> first_shard = warm_up(kConversations);
  ASSERT_EQ(first_shard.size(), static_cast<std::size_t>(kConversations));

  // Later turns, sent to the queue group (either node takes each), meet their conversation's
  // shard; the conversations spread over the shards.
  const cluster::ShardMap map = shard_map();
  std::set<std::uint32_t> shards_used;
  for (int turn = 1; turn <= 3; ++turn) {
    for (int c = 0; c < kConversations; ++c) {
      const auto decision = route(c, turn);
      ASSERT_TRUE(decision) << "conversation " << c << " turn " << turn << ": no answer";
      ASSERT_TRUE(decision->has_success()) << decision->DebugString();
      const std::uint32_t shard = *map.shard_of(decision->success().worker_id());
      EXPECT_EQ(shard, first_shard.at(c)) << "conversation " << c << " turn " << turn;
      shards_used.insert(shard);
      EXPECT_TRUE(completed(*decision));
    }
  }
  EXPECT_GE(shards_used.size(), 3U);
  // Each owner routes only its shards' workers, two each; every request's shard was chosen once,
  // on the node that took it; no booking is left open.
  double chosen = 0;
  double bookings = 0;
  const auto owned = owners({0, 1});
  for (int n = 0; n < 2; ++n) {
    const std::string text = metrics_of(n);
    for (std::uint32_t shard = 0; shard < kShards; ++shard) {
      const std::string partition = shard_partition(shard);
      if (owned.at(shard).front() == n) {
        EXPECT_EQ(metric(text, fmt::format("kvr_workers{{partition=\"{}\"}}", partition)),
                  kWorkers / kShards)
            << partition << " on node-" << n;
      }
      bookings += metric(text, fmt::format("kvr_bookings_open{{partition=\"{}\"}}", partition));
      for (const std::string_view outcome : {"home", "spilled"}) {
        chosen += metric(
            text, fmt::format("kvr_shard_routes_total{{partition=\"{}/default\",shard=\"{}\","
                              "outcome=\"{}\"}}",
                              kModel, shard, outcome));
      }
    }
  }
  EXPECT_GE(chosen, 4 * kConversations);
  EXPECT_EQ(bookings, 0);
}

// The load and KV event messages decoded per shard, on `node`, since the node started.
std::map<std::uint32_t, double> decoded_per_shard(const std::string& metrics) {
  std::map<std::uint32_t, double> decoded;
  for (std::uint32_t shard = 0; shard < kShards; ++shard) {
    for (const std::string_view kind : {"load", "kv_events"}) {
      decoded[shard] += metric(
          metrics, fmt::format("kvr_worker_messages_decoded_total{{partition=\"{}\",kind=\"{}\"}}",
                               shard_partition(shard), kind));
    }
  }
  return decoded;
}

TEST_F(NodeShardedTest, EachNodeDecodesOnlyTheWorkerMessagesOfItsShards) {
  ASSERT_TRUE(evenly_owned({0, 1}, 20s));
  (void)warm_up(8);  // every owner has its workers
  const auto owned = owners({0, 1});
  std::vector<std::map<std::uint32_t, double>> before;
  for (int n = 0; n < 2; ++n) before.push_back(decoded_per_shard(metrics_of(n)));
  // The workers report their load ten times a second: within a few seconds every owner has
  // decoded more of its shards' messages, and neither node any of the other's.
  ASSERT_TRUE(wait_until(
      [&] {
        for (int n = 0; n < 2; ++n) {
          const auto now = decoded_per_shard(metrics_of(n));
          for (std::uint32_t shard = 0; shard < kShards; ++shard) {
            if (owned.at(shard).front() == n && now.at(shard) <= before[n].at(shard) + 10) {
              return false;
            }
          }
        }
        return true;
      },
      10s));
  for (int n = 0; n < 2; ++n) {
    const auto now = decoded_per_shard(metrics_of(n));
    for (std::uint32_t shard = 0; shard < kShards; ++shard) {
      if (owned.at(shard).front() == n) continue;
      EXPECT_EQ(now.at(shard), before[n].at(shard))
          << "node-" << n << " decoded messages of " << shard_partition(shard);
    }
    EXPECT_EQ(metric(metrics_of(n),
                     "kvr_worker_messages_decoded_total{partition=\"previous_subjects\","
                     "kind=\"load\"}"),
              0)
        << "kvr mocker publishes on the partition's subjects";
  }
}

TEST_F(NodeShardedTest, AKilledOwnersShardsAreServedAgainWhileTheOthersNeverFail) {
  ASSERT_TRUE(evenly_owned({0, 1}, 20s));
  constexpr int kConversations = 16;
  const std::map<int, std::uint32_t> shard_of = warm_up(kConversations);
  const auto before = owners({0, 1});
  const int victim = before.begin()->second.front();
  const int survivor = 1 - victim;
  nodes_[victim].signal(SIGKILL);
  (void)nodes_[victim].stop();
  const auto killed = std::chrono::steady_clock::now();

  // A steady stream through the failover: every request is answered; the survivor's shards
  // never fail one, the victim's are refused explicitly until their leases are taken over.
  std::set<int> served_again;
  int turn = 1;
  while (served_again.size() < static_cast<std::size_t>(kConversations) &&
         std::chrono::steady_clock::now() - killed < 10s) {
    for (int c = 0; c < kConversations; ++c) {
      const auto decision = route(c, turn);
      ASSERT_TRUE(decision) << "conversation " << c << ": no answer during the failover";
      const bool victims_shard = before.at(shard_of.at(c)).front() == victim;
      if (decision->has_success()) {
        served_again.insert(c);
        EXPECT_TRUE(completed(*decision));
        continue;
      }
      EXPECT_TRUE(victims_shard) << "a shard of the surviving node failed a request: "
                                 << decision->DebugString();
      const auto code = decision->error().code();
      EXPECT_TRUE(code == v1::ROUTE_ERROR_OWNER_LOST || code == v1::ROUTE_ERROR_UNAVAILABLE ||
                  code == v1::ROUTE_ERROR_NO_WORKERS)
          << decision->DebugString();
    }
    ++turn;
  }
  EXPECT_EQ(served_again.size(), static_cast<std::size_t>(kConversations));
  // The lease TTL (1.5 s) and a step.
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s);
  ASSERT_TRUE(evenly_owned({survivor}, 10s));
  EXPECT_TRUE(nodes_[survivor].running());
}

TEST_F(NodeShardedTest, ANodeThatJoinsTakesShardsWithoutAFailedRequest) {
  ASSERT_TRUE(evenly_owned({0, 1}, 20s));
  constexpr int kConversations = 12;
  (void)warm_up(kConversations);
  ASSERT_NO_FATAL_FAILURE(start_node());  // node-2
  ASSERT_NO_FATAL_FAILURE(start_node());  // node-3
  // Requests keep flowing while shards are handed to the new nodes: none fails.
  int turn = 1;
  bool spread = false;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!spread && std::chrono::steady_clock::now() < deadline) {
    for (int c = 0; c < kConversations; ++c) {
      const auto decision = route(c, turn);
      ASSERT_TRUE(decision) << "conversation " << c << ": no answer during the handover";
      ASSERT_TRUE(decision->has_success()) << decision->DebugString();
      EXPECT_TRUE(completed(*decision));
    }
    ++turn;
    const auto now = owners({0, 1, 2, 3});
    spread =
        now.size() == kShards &&
        std::ranges::all_of(now, [](const auto& entry) { return entry.second.size() == 1; }) &&
        std::set<int>{now.at(0).front(), now.at(1).front(), now.at(2).front(), now.at(3).front()}
                .size() == 4;
  }
  EXPECT_TRUE(spread) << "four nodes do not own one shard each";
}

}  // namespace
}  // namespace kvr
