// Fault: hostile peers on the peer ports. Two `kvr node --cluster` processes with mutual TLS
// (tests/data/tls), one publishing the ingress actor, over a nats-server with JetStream and one
// `kvr mocker` worker per model. An actor client with a certificate of the cluster's CA is served
// for every model, the partitions of the other node forwarded over its TLS cluster port. A client
// with another CA's certificate, or without TLS, is refused. Garbage on both ports (random bytes,
// an HTTP request, a plaintext CAF message header claiming 4 GB, a TLS record claiming 64 KB)
// costs the node under 10 MB and it keeps serving: in plaintext, CAF would have allocated the
// claimed length.
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
  // A CAF 0.17 message header (32 bytes, network order): operation, padding, flags, then the
  // payload length, here 4 GB - 16.
  std::string header(32, '\0');
  header[0] = 0;
  header[4] = '\xff';
  header[5] = '\xff';
  header[6] = '\xff';
  header[7] = '\xf0';
  payloads.push_back(header);
  // A TLS handshake record of the largest length its header can claim, cut short.
  payloads.push_back(std::string{"\x16\x03\x01\xff\xff", 5} + std::string(59, 'A'));
  return payloads;
}

class PeerPortsTest : public testing::KvrClusterTest {
 protected:
  PeerPortsTest() : KvrClusterTest(KVR_BINARY, std::string{kNamespace}, {}, {"-js"}) {}

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

  void TearDown() override {
    if (HasFailure()) {
      for (auto& node : nodes_) std::cerr << "---- node log\n" << node.log();
    }
  }

  double refused_handshakes(int node) {
    return testing::metric(
        testing::http_get(metrics_ports_[static_cast<std::size_t>(node)], "/metrics"),
        "kvr_peer_handshakes_refused_total");
  }

  double owner_metric(int node, int model_index) {
    return testing::metric(
        testing::http_get(metrics_ports_[static_cast<std::size_t>(node)], "/metrics"),
        fmt::format("kvr_cluster_partition_owned{{partition=\"{}/default\"}}", model(model_index)));
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
  constexpr int kRounds = 50;
  constexpr int kHeldOpen = 100;
  std::vector<int> held;
  for (const std::uint16_t port : {actor_port_, cluster_ports_[0]}) {
    for (int round = 0; round < kRounds; ++round) {
      for (const std::string& payload : payloads) {
        const int fd = connect_to(port);
        ASSERT_GE(fd, 0) << "port " << port << " refused a connection";
        (void)::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
        ::close(fd);
      }
    }
    // Connections left open after their garbage: what a slow attacker holds.
    for (int n = 0; n < kHeldOpen / 2; ++n) {
      const int fd = connect_to(port);
      ASSERT_GE(fd, 0);
      const std::string& payload = payloads[static_cast<std::size_t>(n) % payloads.size()];
      (void)::send(fd, payload.data(), payload.size(), MSG_NOSIGNAL);
      held.push_back(fd);
    }
  }
  // Still serving, over the actor port and (for node-b's partitions) the cluster port.
  EXPECT_TRUE(every_model_routes(system, *ingress, 1));
  const std::uint64_t after = testing::resident_kib(nodes_[0].pid());
  for (const int fd : held) ::close(fd);
  std::cout << fmt::format(
      "garbage: {} connections x {} payloads on 2 ports, {} held open; node-a RSS {} KiB -> {} "
      "KiB\n",
      kRounds, payloads.size(), held.size(), before, after);
  EXPECT_LT(after, before + 10 * 1024) << "RSS grew by more than 10 MB";
  // Every connection closed after its garbage is a refused handshake, counted.
  const double closed = 2.0 * kRounds * static_cast<double>(payloads.size());
  EXPECT_TRUE(wait_until([&] { return refused_handshakes(0) >= closed; }, 20s))
      << refused_handshakes(0) << " of " << closed;
  std::cout << fmt::format("node-a counted {} refused handshakes\n", refused_handshakes(0));
  for (auto& node : nodes_) EXPECT_TRUE(node.running());
}

}  // namespace
}  // namespace kvr
