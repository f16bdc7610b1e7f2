// Two and three router nodes' cluster sessions against a real `nats-server -js` on loopback:
// every partition gets exactly one owner, the owners know each other's addresses, a node that
// stops stepping loses its partitions to the others once its leases age out, and a node that
// leaves hands its partitions back at once.
#include "selection/cluster/cluster_session.hpp"

#include <map>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "messages/nats/nats_client.hpp"
#include "selection/cluster/placement.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::cluster {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::NatsServer;
using testing::wait_until;

// Short leases, so that an expiry takes a second of the test, not the default's seconds.
PartitionLeaseOptions short_leases() {
  return PartitionLeaseOptions{.ttl = 900ms, .renew_interval = 200ms, .renew_deadline = 600ms};
}

struct Node {
  std::unique_ptr<nats::NatsClient> client;
  std::unique_ptr<JetStreamKv> members;
  std::unique_ptr<JetStreamKv> partitions;
  std::unique_ptr<ClusterSession> session;
  ClusterStep last;
};

class ClusterSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = NatsServer::start(&error, std::nullopt, {"-js"});
    ASSERT_TRUE(server_) << error;
    for (int i = 0; i < 12; ++i)
      partitions_.push_back(partition_key(fmt::format("m{}", i), "default"));
  }

  Node& add_node(std::string id) {
    auto node = std::make_unique<Node>();
    nats::NatsOptions options;
    options.url = server_->url();
    auto client = nats::NatsClient::connect(options);
    EXPECT_TRUE(client) << client.error();
    node->client = std::move(*client);
    const auto bucket = [&](std::string name) {
      auto kv = JetStreamKv::open_or_create(
          node->client->native_handle(),
          KvBucketOptions{.bucket = std::move(name), .ttl = short_leases().ttl, .timeout = 1000ms});
      EXPECT_TRUE(kv) << kv.error().message;
      return std::move(*kv);
    };
    node->members = bucket(members_bucket("test"));
    node->partitions = bucket(partitions_bucket("test"));
    node->session = std::make_unique<ClusterSession>(
        MemberRecord{.node_id = id,
                     .incarnation = next_incarnation_++,
                     .address = fmt::format("127.0.0.1:{}", 7000 + nodes_.size())},
        *node->members, *node->partitions, short_leases());
    nodes_[id] = std::move(node);
    return *nodes_[id];
  }

  // Steps every live node once, in id order.
  void step_all(const std::set<std::string>& paused = {}) {
    for (auto& [id, node] : nodes_) {
      if (paused.contains(id)) continue;
      node->last = node->session->step(Clock::now(), partitions_);
      for (const std::string& partition : node->last.prepare)
        node->session->mark_prepared(partition);
    }
  }

  // partition → owners that consider it theirs now.
  std::map<std::string, std::vector<std::string>> owners(const std::set<std::string>& paused = {}) {
    std::map<std::string, std::vector<std::string>> result;
    for (auto& [id, node] : nodes_) {
      if (paused.contains(id)) continue;
      for (const OwnedPartition& owned : node->session->keeper().owned(Clock::now())) {
        result[owned.partition].push_back(id);
      }
    }
    return result;
  }

  // Steps until every partition has exactly one owner among the nodes not paused, and that owner
  // is the one placement wants (handovers done). Never two owners at once on the way.
  bool converge(const std::set<std::string>& paused = {}) {
    std::vector<PlacementMember> live;
    for (const auto& [id, node] : nodes_) {
      if (!paused.contains(id)) live.push_back(PlacementMember{id, 1.0});
    }
    const auto wanted = assign(partitions_, live);
    return wait_until(
        [&] {
          step_all(paused);
          const auto now_owned = owners(paused);
          for (const auto& [partition, who] : now_owned) {
            EXPECT_EQ(who.size(), 1U) << partition << " has two owners";
          }
          if (now_owned.size() != partitions_.size()) return false;
          for (const auto& [partition, who] : now_owned) {
            if (who.size() != 1 || who.front() != wanted.at(partition)) return false;
          }
          return true;
        },
        20s);
  }

  std::unique_ptr<NatsServer> server_;
  std::vector<std::string> partitions_;
  std::map<std::string, std::unique_ptr<Node>> nodes_;
  std::uint64_t next_incarnation_ = 1;
};

TEST_F(ClusterSessionTest, ThreeNodesOwnEveryPartitionOnceAndKnowTheOthersOwners) {
  for (const char* id : {"node-a", "node-b", "node-c"}) add_node(id);
  ASSERT_TRUE(converge());
  std::map<std::string, std::size_t> per_node;
  for (const auto& [partition, who] : owners()) ++per_node[who.front()];
  ASSERT_EQ(per_node.size(), 3U) << "every node owns some partitions";
  for (const auto& [id, count] : per_node) EXPECT_LE(count, 6U) << id;
  // Each node learns where the partitions it does not own live, and the owners' addresses.
  step_all();
  for (const auto& [id, node] : nodes_) {
    EXPECT_EQ(node->last.members.size(), 3U);
    EXPECT_EQ(node->last.owned.size() + node->last.elsewhere.size(), partitions_.size()) << id;
    for (const auto& [partition, owner] : node->last.elsewhere) {
      EXPECT_NE(owner.node_id, id);
      EXPECT_FALSE(owner.address.empty()) << partition;
      EXPECT_GT(owner.epoch, 0U);
    }
  }
}

TEST_F(ClusterSessionTest, ANodeThatStopsSteppingLosesItsPartitionsToTheOthers) {
  for (const char* id : {"node-a", "node-b", "node-c"}) add_node(id);
  ASSERT_TRUE(converge());
  std::set<std::string> held_by_b;
  for (const auto& [partition, who] : owners()) {
    if (who.front() == "node-b") held_by_b.insert(partition);
  }
  ASSERT_FALSE(held_by_b.empty());
  // node-b hangs: its fence ends its own belief, its leases age out, the others take them.
  const std::set<std::string> paused{"node-b"};
  ASSERT_TRUE(converge(paused));
  EXPECT_TRUE(nodes_["node-b"]->session->keeper().owned(Clock::now()).empty())
      << "a node that cannot renew stops owning on its own clock";
  for (const auto& [partition, who] : owners(paused)) {
    EXPECT_NE(who.front(), "node-b") << partition;
  }
}

TEST_F(ClusterSessionTest, ANodeThatLeavesHandsItsPartitionsBackAtOnce) {
  for (const char* id : {"node-a", "node-b"}) add_node(id);
  ASSERT_TRUE(converge());
  nodes_["node-b"]->session->leave();
  EXPECT_TRUE(nodes_["node-b"]->session->keeper().owned(Clock::now()).empty());
  nodes_.erase("node-b");
  // Released leases are free at once: node-a takes them within a few steps, well before the TTL.
  const auto left = Clock::now();
  ASSERT_TRUE(converge());
  EXPECT_LT(Clock::now() - left, short_leases().ttl);
  EXPECT_EQ(nodes_["node-a"]->session->keeper().owned(Clock::now()).size(), partitions_.size());
}

}  // namespace
}  // namespace kvr::cluster
