// `kvr node --cluster` as real processes: a nats-server with JetStream on loopback, one `kvr
// mocker` worker for each of 12 models and three router nodes. Every partition is owned by exactly
// one node, spread over the three; a route sent to the namespace's queue group, whichever node
// takes it, is answered (by the owner, forwarded over CAF's middleman), and its lifecycle report
// reaches the node that holds the booking, so no report is refused and no booking is left open.
// Killed with SIGKILL, a node's partitions are owned again by the others; a fourth node joins
// without a failed request; a node hung by SIGSTOP loses its leases and comes back without two
// nodes booking one partition; the cluster reconverges after a nats-server restart. And `kvr
// replay-live` through two and three nodes: every report reaches its booking.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include "actors/actor_types.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/nats/route_client.hpp"
#include "messages/subjects.hpp"
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
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "cluster";
constexpr int kModels = 12;
constexpr int kNodes = 3;

// The value of one series in a /metrics text; 0 when absent.
double metric(const std::string& text, const std::string& series) {
  const std::string line_start = series + " ";
  for (std::size_t at = text.find(line_start); at != std::string::npos;
       at = text.find(line_start, at + 1)) {
    if (at == 0 || text[at - 1] == '\n') return std::stod(text.substr(at + line_start.size()));
  }
  return 0;
}

std::string model(int index) { return fmt::format("model-{}", index); }
std::string owned_series(int index) {
  return fmt::format("kvr_cluster_partition_owned{{partition=\"{}/default\"}}", model(index));
}

class NodeClusterTest : public testing::KvrClusterTest {
 protected:
  NodeClusterTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}, {}, {"-js"}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    for (int m = 0; m < kModels; ++m) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = static_cast<WorkerId>(100 + 10 * m),
                                        .block_size = 16,
                                        .num_gpu_blocks = 512,
                                        .liveness_ttl_ms = 1000,
                                        .extra = {"--model", model(m)}},
                                       fmt::format("mocker-{}.log", m));
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    }
    for (int n = 0; n < kNodes; ++n) ASSERT_NO_FATAL_FAILURE(start_node());
    // Routes ask again as the shipped clients do (a hung node keeps its share of the queue group).
    auto router = nats::RouteClient::open(*client_, subjects::router_route(kNamespace),
                                          subjects::router_report(kNamespace));
    ASSERT_TRUE(router) << router.error();
    router_.emplace(std::move(*router));
  }

  // Starts node-<next index>, with short leases (1.5 s), and waits for its /healthz.
  void start_node() {
    const int n = static_cast<int>(nodes_.size());
    const std::uint16_t port = free_port();
    // node-0 also publishes the ingress actor clients use.
    if (n == 0) actor_port_ = free_port();
    auto node = kvr_->start_node(
        {.metrics_port = port,
         .actor_port = n == 0 ? std::optional<std::uint16_t>{actor_port_} : std::nullopt,
         .nats_reconnect_wait_ms = 100,
         .extra = {"--cluster", "--node-id", fmt::format("node-{}", n), "--cluster-lease-ttl-ms",
                   "1500"}},
        fmt::format("node-{}.log", n));
    ASSERT_TRUE(node);
    nodes_.push_back(std::move(*node));
    metrics_ports_.push_back(port);
    ASSERT_TRUE(testing::wait_until_healthy(port, 20s));
  }

  // Routes one request of every model until each is answered with a decision (the owners have
  // heard their workers); reports each completed.
  void wait_until_every_model_routes(int request) {
    for (int m = 0; m < kModels; ++m) {
      ASSERT_TRUE(wait_until(
          [&] {
            const auto decision = route(m, request);
            if (!decision || !decision->has_success()) return false;
            (void)testing::report_lifecycle(*client_, kNamespace, decision->success().booking_id(),
                                            v1::LIFECYCLE_EVENT_COMPLETED);
            return true;
          },
          20s))
          << model(m);
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (std::size_t n = 0; n < nodes_.size(); ++n) {
        std::cerr << "---- node-" << n << " log\n" << nodes_[n].log();
      }
    }
  }

  std::string metrics_of(int node) { return testing::http_get(metrics_ports_[node], "/metrics"); }

  // partition index → the nodes (among `live`) that own it now.
  std::map<int, std::vector<int>> owners(const std::set<int>& live) {
    std::map<int, std::vector<int>> result;
    for (int n : live) {
      const std::string text = metrics_of(n);
      for (int m = 0; m < kModels; ++m) {
        if (metric(text, owned_series(m)) == 1) result[m].push_back(n);
      }
    }
    return result;
  }

  // Waits until every partition has exactly one owner among `live` and the owners match a
  // balanced placement: every live node owns between one and ⌈1.1 · partitions / nodes⌉.
  bool balanced(const std::set<int>& live, std::chrono::milliseconds timeout) {
    const std::size_t cap = (11 * kModels + 10 * live.size() - 1) / (10 * live.size());
    return wait_until(
        [&] {
          const auto now = owners(live);
          if (now.size() != static_cast<std::size_t>(kModels)) return false;
          std::map<int, std::size_t> per_node;
          for (const auto& [partition, who] : now) {
            if (who.size() != 1) return false;
            ++per_node[who.front()];
          }
          if (per_node.size() != live.size()) return false;
          return std::ranges::all_of(per_node,
                                     [&](const auto& entry) { return entry.second <= cap; });
        },
        timeout);
  }

  // Waits until every partition has exactly one owner among `live`.
  bool each_partition_owned_once(const std::set<int>& live, std::chrono::milliseconds timeout) {
    return wait_until(
        [&] {
          const auto now = owners(live);
          if (now.size() != static_cast<std::size_t>(kModels)) return false;
          for (const auto& [partition, who] : now) {
            if (who.size() != 1) return false;
          }
          return true;
        },
        timeout);
  }

  std::optional<v1::RouteDecision> route(int model_index, int request) {
    v1::RouteRequest wire;
    wire.set_request_id(fmt::format("r-{}-{}", model_index, request));
    wire.set_model(model(model_index));
    for (std::uint32_t token : prompt(64, 1000 * static_cast<std::uint32_t>(request))) {
      wire.mutable_tokens()->add_ids(token);
    }
    auto routed = router_->route(wire);
    if (!routed) return std::nullopt;
    return std::move(routed->decision);
  }

  std::vector<ChildProcess> mockers_;
  std::vector<ChildProcess> nodes_;
  std::vector<std::uint16_t> metrics_ports_;
  std::uint16_t actor_port_ = 0;
  std::optional<nats::RouteClient> router_;
};

TEST_F(NodeClusterTest, EveryPartitionHasOneOwnerAndEveryNodeAnswersForIt) {
  // Placement spreads the twelve partitions over the three nodes, none owning more than five
  // (at most 6/4/2, as the issue asks; the bound is ⌈1.1 · 12 / 3⌉).
  ASSERT_TRUE(balanced({0, 1, 2}, 20s));
  // Until each owner has heard its worker, a route may find none: wait for every model.
  for (int m = 0; m < kModels; ++m) {
    ASSERT_TRUE(wait_until(
        [&] {
          const auto decision = route(m, 0);
          if (!decision || !decision->has_success()) return false;
          return testing::report_lifecycle(*client_, kNamespace, decision->success().booking_id(),
                                           v1::LIFECYCLE_EVENT_COMPLETED)
              .has_value();
        },
        20s))
        << model(m);
  }

  // Requests land on any node (one queue group); each is answered, and each report reaches the
  // node that holds its booking.
  int answered = 0;
  int reports_accepted = 0;
  for (int request = 1; request <= 8; ++request) {
    for (int m = 0; m < kModels; ++m) {
      const auto decision = route(m, request);
      ASSERT_TRUE(decision) << model(m) << " request " << request << ": no answer";
      ASSERT_TRUE(decision->has_success()) << decision->DebugString();
      ++answered;
      for (auto event : {v1::LIFECYCLE_EVENT_FIRST_TOKEN, v1::LIFECYCLE_EVENT_COMPLETED}) {
        const auto ack = testing::report_lifecycle(*client_, kNamespace,
                                                   decision->success().booking_id(), event);
        ASSERT_TRUE(ack);
        EXPECT_TRUE(ack->accepted()) << ack->DebugString();
        if (ack->accepted()) ++reports_accepted;
      }
    }
  }
  EXPECT_EQ(answered, 8 * kModels);
  EXPECT_EQ(reports_accepted, 2 * 8 * kModels);
  double forwarded = 0;
  double bookings = 0;
  for (int n = 0; n < kNodes; ++n) {
    const std::string text = metrics_of(n);
    forwarded += metric(text, "kvr_cluster_forwards_total{kind=\"route\",outcome=\"answered\"}");
    for (int m = 0; m < kModels; ++m) {
      bookings +=
          metric(text, fmt::format("kvr_bookings_open{{partition=\"{}/default\"}}", model(m)));
    }
  }
  EXPECT_GT(forwarded, 0) << "with three nodes, some requests land away from their owner";
  EXPECT_EQ(bookings, 0) << "every booking was released by its report";

  // A client that knows the model asks the partition's own subject: its owner answers, and
  // nothing is forwarded.
  for (int m = 0; m < kModels; ++m) {
    v1::RouteRequest wire;
    wire.set_request_id(fmt::format("direct-{}", m));
    wire.set_model(model(m));
    for (std::uint32_t token : prompt(64, 5000)) wire.mutable_tokens()->add_ids(token);
    const auto reply =
        client_->request(subjects::router_partition_route(kNamespace, model(m) + "/default"),
                         wire.SerializeAsString(), 5s);
    ASSERT_TRUE(reply) << model(m) << ": " << reply.error();
    v1::RouteDecision decision;
    ASSERT_TRUE(decision.ParseFromString(reply->data));
    ASSERT_TRUE(decision.has_success()) << decision.DebugString();
    const auto ack = testing::report_lifecycle(
        *client_, kNamespace, decision.success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
    EXPECT_TRUE(ack && ack->accepted());
  }
  double forwarded_after = 0;
  for (int n = 0; n < kNodes; ++n) {
    forwarded_after +=
        metric(metrics_of(n), "kvr_cluster_forwards_total{kind=\"route\",outcome=\"answered\"}");
  }
  EXPECT_EQ(forwarded_after, forwarded) << "requests on a partition's subject reach its owner";
}

TEST_F(NodeClusterTest, AKilledNodesPartitionsAreOwnedAgainAndAnswered) {
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 20s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(0));
  std::map<int, int> owned_per_node;
  for (const auto& [partition, who] : owners({0, 1, 2})) ++owned_per_node[who.front()];
  const int victim = owned_per_node.begin()->first;
  std::set<int> live{0, 1, 2};
  live.erase(victim);
  nodes_[victim].signal(SIGKILL);
  (void)nodes_[victim].stop();
  const auto killed = std::chrono::steady_clock::now();
  // A steady request stream through the failover: every request gets an answer (a decision, or
  // an explicit error while the partition has no owner), none is lost or hangs, and once the
  // lease TTL (1.5 s) has passed every model is served again, within a few seconds.
  std::set<int> served_again;
  int request = 100;
  while (served_again.size() < static_cast<std::size_t>(kModels) &&
         std::chrono::steady_clock::now() - killed < 10s) {
    for (int m = 0; m < kModels; ++m, ++request) {
      const auto decision = route(m, request);
      ASSERT_TRUE(decision) << model(m) << ": no answer during the failover";
      if (decision->has_success()) {
        served_again.insert(m);
        continue;
      }
      const auto code = decision->error().code();
      EXPECT_TRUE(code == v1::ROUTE_ERROR_OWNER_LOST || code == v1::ROUTE_ERROR_UNAVAILABLE ||
                  code == v1::ROUTE_ERROR_NO_WORKERS)
          << decision->DebugString();
    }
  }
  EXPECT_EQ(served_again.size(), static_cast<std::size_t>(kModels));
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s);
  ASSERT_TRUE(each_partition_owned_once(live, 10s));
  for (int n : live) EXPECT_TRUE(nodes_[n].running()) << "node-" << n;
}

// Without JetStream on the server, a node asked to join a cluster stops at startup and says why.
TEST(NodeClusterStartupTest, WithoutJetStreamTheNodeStopsNamingIt) {
  testing::TemporaryDirectory directory;
  std::string error;
  auto server = testing::NatsServer::start(&error);
  ASSERT_TRUE(server) << error;
  const testing::KvrProcesses kvr{kvr::testing::kvr_binary(), server->url(), "nojs",
                                  directory.path()};
  auto node = kvr.start_node({.extra = {"--cluster", "--node-id", "lonely"}});
  ASSERT_TRUE(node);
  const auto status = node->wait(20s);
  ASSERT_TRUE(status.has_value()) << node->log();
  EXPECT_NE(*status, 0);
  EXPECT_NE(node->log().find("JetStream is not enabled"), std::string::npos) << node->log();
}

TEST_F(NodeClusterTest, ANodeThatJoinsTakesItsShareWithoutAFailedRequest) {
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 20s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(0));
  ASSERT_NO_FATAL_FAILURE(start_node());  // node-3
  // Requests keep flowing while partitions are handed to the new node: none fails.
  int request = 1;
  bool handed_over = false;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!handed_over && std::chrono::steady_clock::now() < deadline) {
    for (int m = 0; m < kModels; ++m, ++request) {
      const auto decision = route(m, request);
      ASSERT_TRUE(decision) << model(m) << ": no answer during the handover";
      ASSERT_TRUE(decision->has_success()) << decision->DebugString();
      const auto ack = testing::report_lifecycle(
          *client_, kNamespace, decision->success().booking_id(), v1::LIFECYCLE_EVENT_COMPLETED);
      ASSERT_TRUE(ack && ack->accepted()) << (ack ? ack->DebugString() : "no ack");
    }
    const auto now = owners({0, 1, 2, 3});
    handed_over =
        now.size() == static_cast<std::size_t>(kModels) &&
        std::ranges::all_of(now, [](const auto& entry) { return entry.second.size() == 1; }) &&
        std::ranges::any_of(now, [](const auto& entry) { return entry.second.front() == 3; });
  }
  EXPECT_TRUE(handed_over) << "node-3 was given no partition";
  double handovers = 0;
  for (int n = 0; n < 3; ++n) handovers += metric(metrics_of(n), "kvr_cluster_handovers_total");
  EXPECT_GT(handovers, 0) << "the old owners counted what they handed over";
}

TEST_F(NodeClusterTest, AHungNodeLosesItsLeasesAndComesBackWithoutDoubleOwnership) {
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 20s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(0));
  std::map<int, int> owned_per_node;
  for (const auto& [partition, who] : owners({0, 1, 2})) ++owned_per_node[who.front()];
  const int victim = owned_per_node.begin()->first;
  nodes_[victim].signal(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  std::set<int> others{0, 1, 2};
  others.erase(victim);
  // Its leases age out and the others take them; requests for them are answered again, and go
  // on being answered while it stays hung for 10 s.
  ASSERT_TRUE(each_partition_owned_once(others, 10s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(1));
  for (int request = 1000; std::chrono::steady_clock::now() - stopped < 10s;) {
    for (int m = 0; m < kModels; ++m, ++request) {
      const auto decision = route(m, request);
      ASSERT_TRUE(decision) << model(m) << ": no answer while a node hangs";
      EXPECT_TRUE(decision->has_success()) << decision->DebugString();
      if (decision->has_success()) {
        (void)testing::report_lifecycle(*client_, kNamespace, decision->success().booking_id(),
                                        v1::LIFECYCLE_EVENT_COMPLETED);
      }
    }
  }
  nodes_[victim].signal(SIGCONT);
  // Back, it finds its fence passed and its leases taken. While it rejoins (and may be handed
  // partitions back), every request is answered, and bookings open on one node per partition
  // only: the requests below are never reported, so a node that booked while another owned the
  // partition would still show them.
  const auto deadline = std::chrono::steady_clock::now() + 4s;
  int request = 2;
  while (std::chrono::steady_clock::now() < deadline) {
    for (int m = 0; m < kModels; ++m, ++request) {
      const auto decision = route(m, request);
      ASSERT_TRUE(decision) << model(m) << ": no answer";
      EXPECT_TRUE(decision->has_success()) << decision->DebugString();
    }
  }
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 10s));
  for (int m = 0; m < kModels; ++m) {
    int nodes_with_bookings = 0;
    for (int n = 0; n < kNodes; ++n) {
      if (metric(metrics_of(n),
                 fmt::format("kvr_bookings_open{{partition=\"{}/default\"}}", model(m))) > 0) {
        ++nodes_with_bookings;
      }
    }
    EXPECT_LE(nodes_with_bookings, 1) << model(m) << " is booked on two nodes";
    if (nodes_with_bookings > 1) {
      for (int n = 0; n < kNodes; ++n) {
        const std::string text = metrics_of(n);
        std::cerr << "node-" << n << " owned " << metric(text, owned_series(m)) << " bookings "
                  << metric(text,
                            fmt::format("kvr_bookings_open{{partition=\"{}/default\"}}", model(m)))
                  << "\n";
      }
    }
  }
  for (int n = 0; n < kNodes; ++n) EXPECT_TRUE(nodes_[n].running()) << "node-" << n;
}

TEST_F(NodeClusterTest, TheClusterReconvergesAfterANatsServerRestart) {
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 20s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(0));
  server_->stop();
  // Without NATS nobody can renew: every node stops serving what it held.
  ASSERT_TRUE(wait_until([&] { return owners({0, 1, 2}).empty(); }, 10s));
  std::string error;
  ASSERT_TRUE(server_->restart(&error)) << error;
  ASSERT_TRUE(each_partition_owned_once({0, 1, 2}, 20s));
  ASSERT_TRUE(wait_until([&] { return client_->connected(); }, 10s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(1));
  for (int n = 0; n < kNodes; ++n) EXPECT_TRUE(nodes_[n].running()) << "node-" << n;
}

// An actor client of node-0's published ingress: every model is answered, its reports accepted
// and a generate request streamed, whichever node owns the partition.
TEST_F(NodeClusterTest, AnActorClientOfOneNodeIsServedForEveryPartition) {
  ASSERT_TRUE(balanced({0, 1, 2}, 20s));
  ASSERT_NO_FATAL_FAILURE(wait_until_every_model_routes(0));
  caf::actor_system_config config;
  config.set("scheduler.max-threads", 2);
  config.load<caf::io::middleman>();
  config.add_message_types<caf::id_block::kvr_actors>();
  caf::actor_system system{config};
  auto ingress = system.middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port_);
  ASSERT_TRUE(ingress) << system.render(ingress.error());
  const auto owned = owners({0, 1, 2});
  int elsewhere = 0;
  {
    caf::scoped_actor self{system};
    for (int m = 0; m < kModels; ++m) {
      if (owned.at(m).front() != 0) ++elsewhere;
      v1::RouteRequest request;
      request.set_request_id(fmt::format("actor-{}", m));
      request.set_model(model(m));
      for (std::uint32_t token : prompt(64, 7000)) request.mutable_tokens()->add_ids(token);
      v1::RouteDecision decision;
      self->request(*ingress, 10s, actors::route_atom::value, actors::RouteRequestMessage{request})
          .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                   [&](caf::error& failure) { ADD_FAILURE() << system.render(failure); });
      ASSERT_TRUE(decision.has_success()) << decision.DebugString();
      v1::LifecycleReport report;
      report.set_booking_id(decision.success().booking_id());
      report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
      v1::LifecycleAck ack;
      self->request(*ingress, 10s, actors::report_atom::value,
                    actors::LifecycleReportMessage{report})
          .receive([&](actors::LifecycleAckMessage& reply) { ack = reply.value; },
                   [&](caf::error& failure) { ADD_FAILURE() << system.render(failure); });
      EXPECT_TRUE(ack.accepted()) << model(m) << ": " << ack.message();
    }
    EXPECT_GT(elsewhere, 0) << "some partitions live on the other nodes";

    // A generate request for a partition another node owns streams back through node-0.
    int remote = 0;
    while (owned.at(remote).front() == 0) ++remote;
    v1::GenerateRequest generate;
    generate.mutable_route()->set_request_id("actor-generate");
    generate.mutable_route()->set_model(model(remote));
    for (std::uint32_t token : prompt(64, 9000)) {
      generate.mutable_route()->mutable_tokens()->add_ids(token);
    }
    generate.set_max_output_tokens(4);
    v1::RouteDecision decision;
    self->request(*ingress, 10s, actors::generate_atom::value,
                  actors::GenerateRequestMessage{generate})
        .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                 [&](caf::error& failure) { ADD_FAILURE() << system.render(failure); });
    ASSERT_TRUE(decision.has_success()) << decision.DebugString();
    std::size_t tokens = 0;
    bool finished = false;
    while (!finished) {
      bool received = false;
      self->receive(
          [&](actors::chunk_atom, actors::GenerateChunkMessage& chunk) {
            received = true;
            tokens += static_cast<std::size_t>(chunk.value.token_ids_size());
            finished = chunk.value.finished();
          },
          caf::after(20s) >> [] {});
      ASSERT_TRUE(received) << "no chunk within 20 s";
    }
    EXPECT_EQ(tokens, 4U);
  }
  ingress = caf::sec::cannot_connect_to_node;  // drop the proxy before the system stops
}

// `kvr replay-live` through two and three cluster nodes: one model (one partition, one owner),
// every request answered wherever it lands, every lifecycle report accepted by the node that
// holds its booking, and no booking left open on any node at the end.
class LiveClusterTest : public testing::KvrClusterTest, public ::testing::WithParamInterface<int> {
 protected:
  LiveClusterTest() : KvrClusterTest(kvr::testing::kvr_binary(), "livecluster", {}, {"-js"}) {}
};

TEST_P(LiveClusterTest, EveryReportReachesItsBookingAndNoBookingIsLeftOpen) {
  const int nodes = GetParam();
  auto mocker = kvr_->start_mocker({.workers = 4, .block_size = 64, .time_scale = "50"});
  ASSERT_TRUE(mocker);
  std::vector<ChildProcess> routers;
  std::vector<std::uint16_t> ports;
  for (int n = 0; n < nodes; ++n) {
    ports.push_back(free_port());
    auto node = kvr_->start_node({.block_size = 64,
                                  .metrics_port = ports.back(),
                                  .extra = {"--cluster", "--node-id", fmt::format("live-{}", n),
                                            "--cluster-lease-ttl-ms", "1500"}},
                                 fmt::format("node-{}.log", n));
    ASSERT_TRUE(node);
    routers.push_back(std::move(*node));
    ASSERT_TRUE(testing::wait_until_healthy(ports.back(), 20s));
  }
  const auto json_path = directory_.path() / "live.json";
  auto replay = kvr_->start({"replay-live"},
                            {"--quiet", "--limit", "100", "--speedup", "20", "--timeout", "60",
                             "--json", json_path.string()},
                            "replay.log");
  ASSERT_TRUE(replay);
  const auto status = replay->wait(150s);
  ASSERT_EQ(status, 0) << replay->log();
  const std::string report = testing::read_file(json_path);
  EXPECT_NE(report.find("\"completed\": 100"), std::string::npos) << report;

  double refused = 0;
  double forwarded = 0;
  for (int n = 0; n < nodes; ++n) {
    const std::string text = testing::http_get(ports[n], "/metrics");
    for (std::size_t at = text.find("kvr_lifecycle_reports_total{"); at != std::string::npos;
         at = text.find("kvr_lifecycle_reports_total{", at + 1)) {
      const std::string line = text.substr(at, text.find('\n', at) - at);
      if (line.find("accepted=\"false\"") != std::string::npos) {
        const double count = std::stod(line.substr(line.rfind(' ') + 1));
        refused += count;
        if (count > 0) ADD_FAILURE() << "node " << n << ": " << line;
      }
    }
    forwarded += metric(text, "kvr_cluster_forwards_total{kind=\"report\",outcome=\"answered\"}");
  }
  EXPECT_EQ(refused, 0) << "every report found the node that holds its booking";
  EXPECT_GT(forwarded, 0) << "with several nodes, some reports land away from their booking";
  for (int n = 0; n < nodes; ++n) {
    EXPECT_TRUE(wait_until(
        [&] {
          return metric(testing::http_get(ports[n], "/metrics"),
                        "kvr_bookings_open{partition=\"mock-model/default\"}") == 0;
        },
        10s))
        << "node " << n << " keeps bookings open";
  }
}

INSTANTIATE_TEST_SUITE_P(Nodes, LiveClusterTest, ::testing::Values(2, 3));

}  // namespace
}  // namespace kvr
