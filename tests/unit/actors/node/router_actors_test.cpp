// The node's actors together, in one actor system without NATS: the discovery actor spawns a
// selector per partition, the reservation actor books and leases, the ingress actor answers
// actor clients. A fake publisher records what would go out on NATS.
#include <mutex>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "actors/discovery/discovery_actor.hpp"
#include "actors/ingress/ingress_actor.hpp"
#include "actors/reservation/reservation_actor.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/child_process.hpp"

namespace kvr::actors {
namespace {

using namespace std::chrono_literals;

class FakePublisher final : public RouterPublisher {
 public:
  bool publish(std::string_view subject, std::string_view data) override {
    std::lock_guard lock{mutex_};
    published_.emplace_back(subject, data);
    return !fail_publish_;
  }
  bool request_dump(std::string_view, WorkerWithDpRank worker) override {
    std::lock_guard lock{mutex_};
    dumps_.push_back(worker);
    return true;
  }
  bool request_discovery() override {
    std::lock_guard lock{mutex_};
    ++discovery_requests_;
    return true;
  }
  void fail_publish(bool fail) {
    std::lock_guard lock{mutex_};
    fail_publish_ = fail;
  }
  std::vector<WorkerWithDpRank> dumps() const {
    std::lock_guard lock{mutex_};
    return dumps_;
  }

 private:
  mutable std::mutex mutex_;
  bool fail_publish_ = false;
  std::vector<std::pair<std::string, std::string>> published_;
  std::vector<WorkerWithDpRank> dumps_;
  int discovery_requests_ = 0;
};

discovery::WorkerRegistration registration(WorkerId id) {
  discovery::WorkerRegistration result;
  result.worker_id = id;
  result.incarnation = 1;
  result.model = "m";
  result.block_size = 4;
  result.total_kv_blocks = 100;
  result.lease_ttl = 60s;
  result.generate_subject = "gen." + std::to_string(id);
  result.dump_subject = "dump." + std::to_string(id);
  return result;
}

RouteRequestData request(std::string id, std::string model = "m") {
  RouteRequestData data;
  data.request_id = std::move(id);
  data.partition.model = std::move(model);
  data.prompt_tokens = 8;
  data.block_hashes = {1, 2};
  return data;
}

class RouterActorsTest : public ::testing::Test {
 protected:
  RouterActorsTest() : system_(make_config()) {
    plugins::RouterPluginRegistry registry;
    EXPECT_TRUE(selection::register_builtin_policies(registry));
    auto resolved = registry.resolve_plugins(selection::RouterPolicyConfig{});
    EXPECT_TRUE(resolved);
    plugins_ = std::move(*resolved);

    SelectorActorConfig selector;
    selector.options.router.block_size = 4;
    selector.options.lease_ttl = 60s;
    selector.plugins = &plugins_;
    selector.publisher = publisher_;
    selector.metrics = metrics_;
    selector.log = log_;
    discovery_ = system_.spawn(discovery_actor, DiscoveryActorConfig{selector, {}});
    ReservationActorConfig reservation;
    reservation.discovery = discovery_;
    reservation.publisher = publisher_;
    reservation.metrics = metrics_;
    reservation.log = log_;
    reservation.lease_ttl = 60s;
    reservation_ = system_.spawn(reservation_actor, reservation);
    ingress_ = system_.spawn(ingress_actor_impl, IngressActorConfig{.reservation = reservation_,
                                                                    .block_size = 4,
                                                                    .limits = {},
                                                                    .metrics = metrics_,
                                                                    .timeout = 5s});
  }

  ~RouterActorsTest() override {
    for (const caf::actor& actor : {discovery_, reservation_}) {
      caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    }
    caf::anon_send_exit(ingress_, caf::exit_reason::user_shutdown);
  }

  static caf::actor_system_config& make_config() {
    static caf::actor_system_config* config = [] {
      auto* result = new caf::actor_system_config;
      result->set("scheduler.max-threads", 2);
      result->add_message_types<caf::id_block::kvr_actors>();
      return result;
    }();
    return *config;
  }

  // Registers workers and waits until the partition's selector holds them.
  void register_workers(std::initializer_list<WorkerId> ids) {
    for (WorkerId id : ids) caf::anon_send(discovery_, worker_up_atom::value, registration(id));
    ASSERT_TRUE(testing::wait_until(
        [&] {
          return metrics_->value("kvr_workers", {{"partition", "m/default"}}) == ids.size();
        },
        5s));
  }

  v1::RouteDecision route(RouteRequestData data) {
    caf::scoped_actor self{system_};
    v1::RouteDecision decision;
    self->request(reservation_, 5s, route_atom::value,
                  RouteEnvelope{std::move(data), {}, std::chrono::steady_clock::now()})
        .receive([&](RouteDecisionMessage& message) { decision = std::move(message.value); },
                 [&](caf::error& error) { ADD_FAILURE() << system_.render(error); });
    return decision;
  }

  v1::LifecycleAck report(const std::string& lease, LifecycleEventKind event) {
    caf::scoped_actor self{system_};
    v1::LifecycleAck ack;
    self->request(reservation_, 5s, report_atom::value,
                  ReportEnvelope{LifecycleReportData{lease, event, {}}, {}})
        .receive([&](LifecycleAckMessage& message) { ack = std::move(message.value); },
                 [&](caf::error& error) { ADD_FAILURE() << system_.render(error); });
    return ack;
  }

  double bookings() const {
    return metrics_->value("kvr_bookings_open", {{"partition", "m/default"}});
  }

  caf::actor_system system_;
  plugins::RouterPlugins plugins_;
  std::shared_ptr<FakePublisher> publisher_ = std::make_shared<FakePublisher>();
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<metrics::RateLimitedLog> log_ = std::make_shared<metrics::RateLimitedLog>();
  caf::actor discovery_;
  caf::actor reservation_;
  ingress_actor ingress_;
};

TEST_F(RouterActorsTest, UnknownPartitionGetsAnExplicitNoWorkersDecision) {
  const auto decision = route(request("r1", "other-model"));
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_NO_WORKERS);
  EXPECT_EQ(decision.request_id(), "r1");
}

TEST_F(RouterActorsTest, RouteBooksAndCompletionReleasesExactlyOnce) {
  register_workers({11, 12});
  const auto decision = route(request("r1"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_TRUE(decision.success().worker_id() == 11 || decision.success().worker_id() == 12);
  EXPECT_EQ(decision.success().generate_subject(),
            "gen." + std::to_string(decision.success().worker_id()));
  EXPECT_EQ(bookings(), 1);
  const std::string lease = decision.success().lease_id();
  EXPECT_TRUE(report(lease, LifecycleEventKind::FirstToken).accepted());
  EXPECT_FALSE(report(lease, LifecycleEventKind::FirstToken).accepted());
  EXPECT_EQ(bookings(), 1);
  EXPECT_TRUE(report(lease, LifecycleEventKind::Completed).accepted());
  EXPECT_EQ(bookings(), 0);
  EXPECT_FALSE(report(lease, LifecycleEventKind::Completed).accepted());
  EXPECT_FALSE(report("no-such-lease", LifecycleEventKind::Aborted).accepted());
}

TEST_F(RouterActorsTest, APickIsInPredictedLoadBeforeTheNextSelection) {
  register_workers({11, 12});
  // Equal caches and no load reports: only the bookings tell the workers apart.
  const auto first = route(request("r1"));
  const auto second = route(request("r2"));
  ASSERT_TRUE(first.has_success());
  ASSERT_TRUE(second.has_success());
  EXPECT_NE(first.success().worker_id(), second.success().worker_id());
  EXPECT_EQ(bookings(), 2);
}

TEST_F(RouterActorsTest, FailedDeliveryRollsTheBookingBack) {
  register_workers({11});
  publisher_->fail_publish(true);
  caf::scoped_actor self{system_};
  self->request(reservation_, 5s, route_atom::value,
                RouteEnvelope{request("r1"), "reply.subject", std::chrono::steady_clock::now()})
      .receive([](RouteDecisionMessage&) {}, [](caf::error&) {});
  EXPECT_TRUE(testing::wait_until([&] { return bookings() == 0; }, 5s));
  EXPECT_EQ(metrics_->value("kvr_bookings_rolled_back_total"), 1);
  EXPECT_EQ(metrics_->value("kvr_leases_open"), 0);
}

TEST_F(RouterActorsTest, EventIdGapAsksTheWorkerForADump) {
  register_workers({11});
  KvEventBatch batch;
  batch.worker = {11, 0};
  batch.incarnation = 1;
  batch.event_id = 5;  // 1..4 never arrived
  batch.events.push_back(KvStoredEvent{std::nullopt, {1, 2}, StorageTier::Device});
  caf::anon_send(discovery_, kv_events_atom::value, batch);
  EXPECT_TRUE(testing::wait_until([&] { return !publisher_->dumps().empty(); }, 5s));
  EXPECT_EQ(publisher_->dumps().front(), (WorkerWithDpRank{11, 0}));
}

TEST_F(RouterActorsTest, IngressAnswersActorClientsWithDecisionsAndErrors) {
  register_workers({11});
  caf::scoped_actor self{system_};
  v1::RouteRequest wire;
  wire.set_request_id("a1");
  wire.set_model("m");
  for (std::uint32_t token = 0; token < 9; ++token) wire.mutable_tokens()->add_ids(token);
  v1::RouteDecision decision;
  self->request(ingress_, 5s, route_atom::value, RouteRequestMessage{wire})
      .receive([&](RouteDecisionMessage& message) { decision = message.value; },
               [&](caf::error& error) { ADD_FAILURE() << system_.render(error); });
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(decision.success().worker_id(), 11U);

  wire.clear_prompt();
  self->request(ingress_, 5s, route_atom::value, RouteRequestMessage{wire})
      .receive([&](RouteDecisionMessage& message) { decision = message.value; },
               [&](caf::error& error) { ADD_FAILURE() << system_.render(error); });
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
}

}  // namespace
}  // namespace kvr::actors
