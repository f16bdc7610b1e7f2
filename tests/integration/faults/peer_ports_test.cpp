// Fault: hostile peers on the peer ports, over a nats-server with JetStream and one `kvr mocker`
// worker per model.
//
// With mutual TLS (tests/data/tls): two `kvr node --cluster` processes, one publishing the ingress
// actor. An actor client with a certificate of the cluster's CA is served for every model, the
// partitions of the other node forwarded over its TLS cluster port. A client with another CA's
// certificate, or without TLS, is refused. Garbage on both ports (random bytes, an HTTP request,
// CAF message headers claiming 4 GB and 200 KB, a TLS record claiming 64 KB) costs the node under
// 10 MB and it keeps serving.
//
// In plaintext (loopback only): one node with both ports. The same garbage is refused before the
// claimed length is allocated (CAF alone would allocate it), and a client's message over
// --peer-max-message-bytes closes its connection; the node keeps serving every other client.
#include <array>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/remote_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/actor_types.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::free_port;
using testing::wait_until;

constexpr std::string_view kNamespace = "peers";
constexpr int kModels = 4;
constexpr int kNodes = 2;
// Garbage tests: rounds of every payload on its own connection, and connections held open, per
// peer port.
constexpr int kGarbageRounds = 50;
constexpr int kHeldOpenPerPort = 50;

std::string tls_file(const std::string& name) {
  return std::string{KVR_SOURCE_DIR} + "/tests/data/tls/" + name;
}
std::string model(int index) { return fmt::format("model-{}", index); }

// A connected loopback TCP socket, or -1.
int connect_to(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The payloads an outside tester sends to a peer port.
std::vector<std::string> garbage_payloads() {
  std::vector<std::string> payloads;
  std::mt19937 random{7};
  std::string bytes(64, '\0');
  for (char& byte : bytes) byte = static_cast<char>(random());
  payloads.push_back(bytes);
  payloads.emplace_back("GET / HTTP/1.1\r\nHost: node\r\n\r\n");
  // CAF 0.17 message headers (32 bytes, network order): operation (a client handshake, valid
  // with every other field zero), padding, flags, then the payload length: 4 GB - 16, and 200 KB
  // (over the handshake's limit, under the message limit of the plaintext node).
  for (const std::uint32_t claimed : {0xffff'fff0U, 200U * 1024}) {
    std::string header(32, '\0');
    header[0] = 1;
    for (int byte = 0; byte < 4; ++byte) {
      header[static_cast<std::size_t>(4 + byte)] = static_cast<char>(claimed >> (24 - 8 * byte));
    }
    payloads.push_back(header);
  }
  // A TLS handshake record of the largest length its header can claim, cut short.
  payloads.push_back(std::string{"\x16\x03\x01\xff\xff", 5} + std::string(59, 'A'));
  return payloads;
}

// Sends every payload to `port` on a connection of its own, `rounds` times, closing each; then
// leaves `held_open` connections open after their payload (what a slow attacker holds), returned.
std::vector<int> send_garbage(std::uint16_t port, const std::vector<std::string>& payloads,
                              int rounds, int held_open) {
  for (int round = 0; round < rounds; ++round) {
    for (const std::string& payload : payloads) {
      const int fd = connect_to(port);
      EXPECT_GE(fd, 0) << "port " << port << " refused a connection";
      if (fd < 0) continue;
      (void)::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
      ::close(fd);
    }
  }
  std::vector<int> held;
  for (int n = 0; n < held_open; ++n) {
    const int fd = connect_to(port);
    EXPECT_GE(fd, 0);
    if (fd < 0) continue;
    const std::string& payload = payloads[static_cast<std::size_t>(n) % payloads.size()];
    (void)::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
    held.push_back(fd);
  }
  return held;
}

// Workers for every model, actor clients, and the nodes' metrics; the fixtures below start the
// nodes.
class PeerPortsFixture : public testing::KvrClusterTest {
 protected:
  PeerPortsFixture()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}, {}, {"-js"}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    // Freed memory in ASan's quarantine would read as the node's growth.
    testing::use_small_asan_quarantine_in_children();
    for (int m = 0; m < kModels; ++m) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = static_cast<WorkerId>(100 + 10 * m),
                                        .block_size = 16,
                                        .liveness_ttl_ms = 2000,
                                        .extra = {"--model", model(m)}},
                                       fmt::format("mocker-{}.log", m));
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (auto& node : nodes_) std::cerr << "---- node log\n" << node.log();
    }
  }

  // Garbage on node 0's actor port and cluster port (send_garbage); the connections held open.
  std::vector<int> send_garbage_to_both_ports(const std::vector<std::string>& payloads) {
    std::vector<int> held;
    for (const std::uint16_t port : {actor_port_, cluster_ports_[0]}) {
      std::vector<int> open = send_garbage(port, payloads, kGarbageRounds, kHeldOpenPerPort);
      held.insert(held.end(), open.begin(), open.end());
    }
    return held;
  }

  double node_metric(int node, const std::string& name) {
    return testing::metric(
        testing::http_get(metrics_ports_[static_cast<std::size_t>(node)], "/metrics"), name);
  }
  double refused_handshakes(int node) {
    return node_metric(node, "kvr_peer_handshakes_refused_total");
  }

  double owner_metric(int node, int model_index) {
    return node_metric(node, fmt::format("kvr_cluster_partition_owned{{partition=\"{}/default\"}}",
                                         model(model_index)));
  }

  // An actor system with CAF's OpenSSL module and the given identity, or none (plaintext). The
  // system keeps a reference to its config: both live in one object.
  struct ClientSystem {
    caf::actor_system_config config;
    std::optional<caf::actor_system> system;
  };
  static std::unique_ptr<ClientSystem> client_system(const std::string& identity) {
    auto client = std::make_unique<ClientSystem>();
    caf::actor_system_config& config = client->config;
    config.set("scheduler.max-threads", 2);
    // A cluster node drops a connection silent for a second (docs/security.md).
    config.set("middleman.heartbeat-interval", caf::timespan{200ms});
    config.load<caf::io::middleman>();
    if (!identity.empty()) {
      config.load<caf::openssl::manager>();
      config.set("openssl.certificate", tls_file(identity + ".pem"));
      config.set("openssl.key", tls_file(identity + ".key"));
      config.set("openssl.cafile",
                 tls_file(identity == "rogue" ? "rogue-ca.pem" : "cluster-ca.pem"));
    }
    config.add_message_types<caf::id_block::kvr_actors>();
    client->system.emplace(config);
    return client;
  }

  // Routes one request of every model through `ingress` until each gets a decision (the owners
  // may not have heard their workers yet); true when all did.
  bool every_model_routes(caf::actor_system& system, const actors::ingress_actor& ingress,
                          int round) {
    caf::scoped_actor self{system};
    for (int m = 0; m < kModels; ++m) {
      int attempt = 0;
      std::string last_failure;
      const bool routed = wait_until(
          [&] {
            v1::RouteRequest request;
            request.set_request_id(fmt::format("peer-{}-{}-{}", round, m, ++attempt));
            request.set_model(model(m));
            for (std::uint32_t token : testing::prompt(64, 5000)) {
              request.mutable_tokens()->add_ids(token);
            }
            v1::RouteDecision decision;
            self->request(ingress, 5s, actors::route_atom::value,
                          actors::RouteRequestMessage{request})
                .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                         [&](caf::error& failure) { last_failure = system.render(failure); });
            if (decision.has_error()) last_failure = decision.error().message();
            if (!decision.has_success()) return false;
            v1::LifecycleReport report;
            report.set_booking_id(decision.success().booking_id());
            report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
            bool accepted = false;
            self->request(ingress, 5s, actors::report_atom::value,
                          actors::LifecycleReportMessage{report})
                .receive([&](actors::LifecycleAckMessage& ack) { accepted = ack.value.accepted(); },
                         [&](caf::error&) {});
            return accepted;
          },
          20s);
      if (!routed) {
        ADD_FAILURE() << model(m) << " got no decision: " << last_failure;
        return false;
      }
    }
    return true;
  }

  std::vector<ChildProcess> mockers_;
  std::vector<ChildProcess> nodes_;
  std::vector<std::uint16_t> metrics_ports_;
  std::vector<std::uint16_t> cluster_ports_;
  std::uint16_t actor_port_ = 0;
};

class PeerPortsTest : public PeerPortsFixture {
 protected:
  void SetUp() override {
    PeerPortsFixture::SetUp();
    if (HasFatalFailure()) return;
    actor_port_ = free_port();
    for (int n = 0; n < kNodes; ++n) {
      const std::string identity = n == 0 ? "node-a" : "node-b";
      const std::uint16_t metrics_port = free_port();
      const std::uint16_t cluster_port = free_port();
      auto node = kvr_->start_node(
          {.metrics_port = metrics_port,
           .actor_port = n == 0 ? std::optional<std::uint16_t>{actor_port_} : std::nullopt,
           .extra = {"--cluster", "--node-id", identity, "--cluster-port",
                     std::to_string(cluster_port), "--peer-tls-cert", tls_file(identity + ".pem"),
                     "--peer-tls-key", tls_file(identity + ".key"), "--peer-tls-ca",
                     tls_file("cluster-ca.pem")}},
          identity + ".log");
      ASSERT_TRUE(node);
      nodes_.push_back(std::move(*node));
      metrics_ports_.push_back(metrics_port);
      cluster_ports_.push_back(cluster_port);
      ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << nodes_.back().log();
    }
    // Every partition owned once, by either node, and each node owning one at least: some
    // requests to node-a are forwarded to node-b.
    ASSERT_TRUE(wait_until(
        [&] {
          std::array<int, kNodes> owned_by{};
          for (int m = 0; m < kModels; ++m) {
            int owners = 0;
            for (int n = 0; n < kNodes; ++n) {
              if (owner_metric(n, m) == 1) {
                ++owners;
                ++owned_by[static_cast<std::size_t>(n)];
              }
            }
            if (owners != 1) return false;
          }
          return owned_by[0] > 0 && owned_by[1] > 0;
        },
        20s));
  }
};

TEST_F(PeerPortsTest, ACertificateOfTheClusterCaIsServedForEveryPartition) {
  auto client = client_system("client");
  caf::actor_system& system = *client->system;
  auto ingress =
      caf::openssl::remote_actor<actors::ingress_actor>(system, "127.0.0.1", actor_port_);
  ASSERT_TRUE(ingress) << system.render(ingress.error());
  // node-b's partitions reach it over its TLS cluster port.
  EXPECT_TRUE(every_model_routes(system, *ingress, 0));
  EXPECT_GT(testing::metric(testing::http_get(metrics_ports_[0], "/metrics"),
                            "kvr_cluster_forwards_total"),
            0)
      << "node-a forwarded to node-b";
}

TEST_F(PeerPortsTest, AnotherCasCertificateAndPlaintextAreRefused) {
  for (const std::uint16_t port : {actor_port_, cluster_ports_[0]}) {
    auto rogue = client_system("rogue");
    auto refused =
        caf::openssl::remote_actor<actors::ingress_actor>(*rogue->system, "127.0.0.1", port);
    EXPECT_FALSE(refused) << "a rogue certificate on port " << port;
    auto plaintext = client_system("");
    auto also_refused =
        plaintext->system->middleman().remote_actor<actors::ingress_actor>("127.0.0.1", port);
    EXPECT_FALSE(also_refused) << "plaintext on port " << port;
  }
  // Each refusal is counted: two ports, two strangers each.
  EXPECT_TRUE(wait_until([&] { return refused_handshakes(0) >= 4; }, 20s)) << refused_handshakes(0);
  for (auto& node : nodes_) EXPECT_TRUE(node.running());
}

TEST_F(PeerPortsTest, GarbageOnBothPortsCostsUnder10MbAndTheNodeServes) {
  auto client = client_system("client");
  caf::actor_system& system = *client->system;
  auto ingress =
      caf::openssl::remote_actor<actors::ingress_actor>(system, "127.0.0.1", actor_port_);
  ASSERT_TRUE(ingress) << system.render(ingress.error());
  ASSERT_TRUE(every_model_routes(system, *ingress, 0));
  const std::uint64_t before = testing::resident_kib(nodes_[0].pid());
  ASSERT_GT(before, 0U);

  const std::vector<std::string> payloads = garbage_payloads();
  const std::vector<int> held = send_garbage_to_both_ports(payloads);
  // Still serving, over the actor port and (for node-b's partitions) the cluster port.
  EXPECT_TRUE(every_model_routes(system, *ingress, 1));
  const std::uint64_t after = testing::resident_kib(nodes_[0].pid());
  for (const int fd : held) ::close(fd);
  std::cout << fmt::format(
      "garbage: {} connections x {} payloads on 2 ports, {} held open; node-a RSS {} KiB -> {} "
      "KiB\n",
      kGarbageRounds, payloads.size(), held.size(), before, after);
  EXPECT_LT(after, before + 10 * 1024) << "RSS grew by more than 10 MB";
  // Every connection closed after its garbage is a refused handshake, counted.
  const double closed = 2.0 * kGarbageRounds * static_cast<double>(payloads.size());
  EXPECT_TRUE(wait_until([&] { return refused_handshakes(0) >= closed; }, 20s))
      << refused_handshakes(0) << " of " << closed;
  std::cout << fmt::format("node-a counted {} refused handshakes\n", refused_handshakes(0));
  for (auto& node : nodes_) EXPECT_TRUE(node.running());
}

// One plaintext node serving both peer ports, its messages limited to 256 KiB.
class PlaintextPeerPortsTest : public PeerPortsFixture {
 protected:
  static constexpr std::size_t kMaxMessageBytes = 256 * 1024;

  void SetUp() override {
    PeerPortsFixture::SetUp();
    if (HasFatalFailure()) return;
    actor_port_ = free_port();
    const std::uint16_t metrics_port = free_port();
    const std::uint16_t cluster_port = free_port();
    auto node =
        kvr_->start_node({.metrics_port = metrics_port,
                          .actor_port = actor_port_,
                          .extra = {"--cluster", "--node-id", "plain", "--cluster-port",
                                    std::to_string(cluster_port), "--peer-max-message-bytes",
                                    std::to_string(kMaxMessageBytes)}},
                         "plain.log");
    ASSERT_TRUE(node);
    nodes_.push_back(std::move(*node));
    metrics_ports_.push_back(metrics_port);
    cluster_ports_.push_back(cluster_port);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << nodes_.back().log();
    client_ = client_system("");
    auto ingress =
        client_->system->middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port_);
    ASSERT_TRUE(ingress) << client_->system->render(ingress.error());
    ingress_ = *ingress;
    ASSERT_TRUE(every_model_routes(*client_->system, ingress_, 0));
  }

  double refused_frames() { return node_metric(0, "kvr_peer_frames_refused_total"); }

  std::unique_ptr<ClientSystem> client_;
  actors::ingress_actor ingress_;
};

TEST_F(PlaintextPeerPortsTest, GarbageIsRefusedBeforeItsClaimedLengthIsAllocated) {
  const std::uint64_t before = testing::resident_kib(nodes_[0].pid());
  ASSERT_GT(before, 0U);
  const std::vector<std::string> payloads = garbage_payloads();
  const std::vector<int> held = send_garbage_to_both_ports(payloads);
  // The two headers claim 4 GB and 200 KB before any handshake: each is refused. Counted here on
  // the connections held open; a closed one may be reset before the node reads its bytes.
  const double claims = 2.0 * 2.0 * (kHeldOpenPerPort / static_cast<double>(payloads.size()));
  EXPECT_TRUE(wait_until([&] { return refused_frames() >= claims; }, 20s))
      << refused_frames() << " of " << claims;
  EXPECT_TRUE(every_model_routes(*client_->system, ingress_, 1));
  const std::uint64_t after = testing::resident_kib(nodes_[0].pid());
  for (const int fd : held) ::close(fd);
  std::cout << fmt::format(
      "plaintext garbage: {} connections x {} payloads on 2 ports, {} held open; RSS {} KiB -> {} "
      "KiB; {} frames refused\n",
      kGarbageRounds, payloads.size(), held.size(), before, after, refused_frames());
  EXPECT_LT(after, before + 10 * 1024) << "RSS grew by more than 10 MB";
  const double closed = 2.0 * kGarbageRounds * static_cast<double>(payloads.size());
  EXPECT_TRUE(wait_until([&] { return refused_handshakes(0) >= closed; }, 20s))
      << refused_handshakes(0) << " of " << closed;
  EXPECT_TRUE(nodes_[0].running());
}

TEST_F(PlaintextPeerPortsTest, AMessageOverTheLimitClosesItsConnectionAndOthersAreServed) {
  // 100,000 token ids of three bytes each: about 300 KB, over the node's 256 KiB.
  auto sender = client_system("");
  auto ingress =
      sender->system->middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port_);
  ASSERT_TRUE(ingress) << sender->system->render(ingress.error());
  v1::RouteRequest request;
  request.set_request_id("oversized");
  request.set_model(model(0));
  for (std::uint32_t token = 0; token < 100'000; ++token) {
    request.mutable_tokens()->add_ids(20'000 + token);
  }
  ASSERT_GT(request.ByteSizeLong(), kMaxMessageBytes);
  bool answered = false;
  caf::scoped_actor self{*sender->system};
  self->request(*ingress, 3s, actors::route_atom::value, actors::RouteRequestMessage{request})
      .receive([&](actors::RouteDecisionMessage&) { answered = true; },
               [&](caf::error&) { answered = false; });
  EXPECT_FALSE(answered) << "a message over --peer-max-message-bytes was read";
  EXPECT_TRUE(wait_until([&] { return refused_frames() >= 1; }, 10s)) << refused_frames();
  // The established client is served on, and so is a new one.
  EXPECT_TRUE(every_model_routes(*client_->system, ingress_, 1));
  auto fresh = client_system("");
  auto fresh_ingress =
      fresh->system->middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port_);
  ASSERT_TRUE(fresh_ingress) << fresh->system->render(fresh_ingress.error());
  EXPECT_TRUE(every_model_routes(*fresh->system, *fresh_ingress, 2));
  EXPECT_TRUE(nodes_[0].running());
}

}  // namespace
}  // namespace kvr
