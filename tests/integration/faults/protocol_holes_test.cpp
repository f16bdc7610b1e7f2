// Smaller holes, closed, against `kvr node` as a real process (a real nats-server, a `kvr mocker`
// worker, raw NATS clients on loopback): a registration announcing a subject nobody can serve or
// the routers' own is refused and logged, an explicit liveness_ttl_ms of 0 is refused while an
// absent one means the default, and two clients may use the same request id.
#include <iostream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::free_port;
using testing::http_get;
using testing::metric;
using testing::wait_until;

constexpr std::string_view kNamespace = "holes";
constexpr std::uint32_t kBlockSize = 16;

class ProtocolHolesTest : public testing::KvrClusterTest {
 protected:
  ProtocolHolesTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    // Freed memory in ASan's quarantine would read as the node's growth.
    testing::use_small_asan_quarantine_in_children();
    auto mocker = kvr_->start_mocker(
        {.workers = 1, .worker_id_base = 1, .block_size = kBlockSize, .liveness_ttl_ms = 10'000});
    ASSERT_TRUE(mocker);
    mocker_ = std::move(*mocker);
    metrics_port_ = free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize, .metrics_port = metrics_port_});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    ASSERT_TRUE(
        wait_until([&] { return route(*client_, "mock-model", "probe").has_success(); }, 20s));
  }

  void TearDown() override {
    if (HasFailure() && node_) std::cerr << "---- node log\n" << node_->log();
  }

  v1::RouteDecision route(nats::NatsClient& client, const std::string& model,
                          const std::string& request_id) {
    v1::RouteRequest request;
    request.set_request_id(request_id);
    request.set_model(model);
    for (std::uint32_t token = 0; token < 40; ++token) request.mutable_tokens()->add_ids(token);
    v1::RouteDecision decision;
    auto reply =
        client.request(subjects::router_route(kNamespace), request.SerializeAsString(), 5s);
    EXPECT_TRUE(reply) << reply.error();
    if (reply) {
      EXPECT_TRUE(decision.ParseFromString(reply->data));
    }
    return decision;
  }

  // A registration of worker `id` for model `model` as a worker would publish it.
  static v1::WorkerRegistration registration(WorkerId id, const std::string& model) {
    v1::WorkerRegistration wire;
    wire.set_worker_id(id);
    wire.set_incarnation(1);
    wire.set_model(model);
    wire.set_role(v1::WORKER_ROLE_AGGREGATED);
    wire.set_block_size(kBlockSize);
    wire.set_total_kv_blocks(1000);
    wire.set_publishes_kv_events(false);
    return wire;
  }

  double node_metric(const std::string& prefix) {
    return metric(http_get(metrics_port_, "/metrics"), prefix);
  }

  // Publishes the registration and waits until the node counted it refused and, unless empty,
  // logged `logged` (the node logs one refusal per subject every 5 s, counting the others).
  void expect_refused(const v1::WorkerRegistration& wire, const std::string& logged = {}) {
    const std::string refused = "kvr_bad_messages_total{subject=\"kvr.holes.workers.register\"}";
    const double before = node_metric(refused);
    ASSERT_TRUE(client_->publish(subjects::worker_register(kNamespace), wire.SerializeAsString()));
    EXPECT_TRUE(wait_until([&] { return node_metric(refused) > before; }, 5s));
    if (!logged.empty()) {
      EXPECT_TRUE(wait_until([&] { return node_->log().find(logged) != std::string::npos; }, 5s))
          << "not logged: " << logged;
    }
    // The worker is not routable.
    const v1::RouteDecision decision = route(*client_, wire.model(), "after-" + wire.model());
    ASSERT_TRUE(decision.has_error());
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_NO_WORKERS) << decision.error().message();
  }

  std::optional<testing::ChildProcess> mocker_;
  std::optional<testing::ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
};

TEST_F(ProtocolHolesTest, RegistrationsWithSubjectsNobodyCanServeAreRefusedAndLogged) {
  auto wire = registration(50, "spaced");
  wire.set_generate_subject("a b");
  expect_refused(wire,
                 "WorkerRegistration of worker 50: generate_subject: 'a b' contains whitespace");
  // Within the log's window the next ones are counted (their reasons: the unit tests).
  wire = registration(51, "wildcard");
  wire.set_generate_subject("kvr.>");
  expect_refused(wire);
  wire = registration(52, "hijack");
  wire.set_generate_subject(subjects::router_generate(kNamespace));
  expect_refused(wire);
  wire = registration(53, "dumps");
  wire.set_dump_subject(subjects::router_route(kNamespace));
  expect_refused(wire);
  // The node still serves its worker.
  EXPECT_TRUE(route(*client_, "mock-model", "still-served").has_success());
}

TEST_F(ProtocolHolesTest, AnExplicitZeroLivenessTtlIsRefusedAndAnAbsentOneMeansTheDefault) {
  auto wire = registration(60, "zero-ttl");
  wire.set_liveness_ttl_ms(0);
  expect_refused(wire, "WorkerRegistration of worker 60: liveness_ttl_ms: 0 is not a liveness TTL");
  wire.clear_liveness_ttl_ms();
  ASSERT_TRUE(client_->publish(subjects::worker_register(kNamespace), wire.SerializeAsString()));
  EXPECT_TRUE(wait_until(
      [&] { return node_metric("kvr_workers{partition=\"zero-ttl/default\"}") == 1; }, 5s));
  const v1::RouteDecision decision = route(*client_, "zero-ttl", "default-ttl");
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(decision.success().worker_id(), 60U);
}

TEST_F(ProtocolHolesTest, TwoClientsMayUseTheSameRequestId) {
  auto first = nats::NatsClient::connect({.url = server_->url()});
  auto second = nats::NatsClient::connect({.url = server_->url()});
  ASSERT_TRUE(first && second);
  const v1::RouteDecision a = route(**first, "mock-model", "shared-id");
  ASSERT_TRUE(a.has_success()) << a.error().message();
  EXPECT_EQ(a.request_id(), "shared-id");
  const v1::RouteDecision b = route(**second, "mock-model", "shared-id");
  ASSERT_TRUE(b.has_success()) << b.error().message();
  EXPECT_EQ(b.request_id(), "shared-id");
  // One client reusing its own open id is still refused.
  const v1::RouteDecision again = route(**first, "mock-model", "shared-id");
  ASSERT_TRUE(again.has_error());
  EXPECT_EQ(again.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_NE(again.error().message().find("already routed"), std::string::npos)
      << again.error().message();
  EXPECT_EQ(again.request_id(), "shared-id");
}

// 1,000 registrations of about 60 bytes, each claiming 1,024 data-parallel ranks (a million rank
// entries, which took a node to gigabytes before it had caps): the node admits what its
// --router-max-rank-entries (16,384 by default) holds, refuses the rest, counted, and keeps
// serving its worker; its memory grows by tens of MB, not gigabytes.
TEST_F(ProtocolHolesTest, ThousandsOfRankClaimsAreRefusedBeyondTheNodesRankEntries) {
  constexpr int kRegistrations = 1000;
  constexpr std::uint32_t kRanks = 1024;
  const std::uint64_t before = testing::resident_kib(node_->pid());
  ASSERT_GT(before, 0U);
  for (int n = 0; n < kRegistrations; ++n) {
    auto wire =
        registration(static_cast<WorkerId>(10'000 + n), fmt::format("rank-flood-{}", n % 4));
    wire.set_data_parallel_size(kRanks);
    ASSERT_TRUE(client_->publish(subjects::worker_register(kNamespace), wire.SerializeAsString()));
  }
  ASSERT_TRUE(client_->flush(10s));
  const auto over_models = [&](const std::string& series) {
    const std::string text = http_get(metrics_port_, "/metrics");
    double sum = 0;
    for (int m = 0; m < 4; ++m) sum += metric(text, fmt::format(fmt::runtime(series), m));
    return sum;
  };
  const auto admitted = [&] {
    return over_models("kvr_workers{{partition=\"rank-flood-{}/default\"}}");
  };
  const auto refused = [&] {
    return over_models(
        "kvr_worker_messages_refused_total{{partition=\"rank-flood-{}/default\","
        "kind=\"registration\"}}");
  };
  // The default 16,384 rank entries hold 16 such workers, less the mocker's one rank.
  EXPECT_TRUE(wait_until([&] { return admitted() + refused() >= kRegistrations; }, 60s))
      << admitted() << " admitted, " << refused() << " refused";
  EXPECT_EQ(admitted(), 15);
  EXPECT_EQ(refused(), kRegistrations - 15);
  EXPECT_TRUE(route(*client_, "mock-model", "served-after-the-flood").has_success());
  const std::uint64_t after = testing::resident_kib(node_->pid());
  std::cout << fmt::format("{} registrations x {} ranks: {} admitted; node RSS {} -> {} KiB\n",
                           kRegistrations, kRanks, admitted(), before, after);
  EXPECT_LT(after, before + 100 * 1024);
}

}  // namespace
}  // namespace kvr
