// The node's actors together, in one actor system without NATS, on CAF's deterministic test
// coordinator (no actor runs until the test runs the scheduler, after every send) and an injected
// clock: the discovery actor spawns a selector per partition, the reservation actor books and
// bookings, the ingress actor answers actor clients (route, report, and generate with its stream).
// A fake publisher records what would go out on NATS. The classifier actor sits in front of the
// reservation and lifecycle actors when a request classifier is configured. Timers fire only when
// the test moves CAF's clock (advance_time) or sends the timer's message itself.
#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "actors/classifier/classifier_actor.hpp"
#include "actors/discovery/discovery_actor.hpp"
#include "actors/ingress/ingress_actor.hpp"
#include "actors/lifecycle/lifecycle_actor.hpp"
#include "actors/reservation/reservation_actor.hpp"
#include "classifiers/builtin/kv_capacity_pause.hpp"
#include "classifiers/builtin/max_in_flight.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/cache_mismatch_detector.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/policies/soft_affinity_load_guard/soft_affinity_load_guard_policy.hpp"
#include "tests/unit/actors/coordinated_actors.hpp"

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
  // Held back until flush_deferred(), as the NATS connection's buffer holds them.
  bool publish_deferred(std::string_view subject, std::string_view data) override {
    std::lock_guard lock{mutex_};
    deferred_.emplace_back(subject, data);
    return !fail_publish_;
  }
  void flush_deferred() override {
    std::lock_guard lock{mutex_};
    if (deferred_.empty()) return;
    ++flushes_;
    published_.insert(published_.end(), deferred_.begin(), deferred_.end());
    deferred_.clear();
  }
  std::size_t unflushed() const {
    std::lock_guard lock{mutex_};
    return deferred_.size();
  }
  int flushes() const {
    std::lock_guard lock{mutex_};
    return flushes_;
  }
  bool request_dump(std::string_view, WorkerWithDpRank worker) override {
    std::lock_guard lock{mutex_};
    dumps_.push_back(worker);
    return true;
  }
  bool request_reregistration() override {
    std::lock_guard lock{mutex_};
    ++reregistration_requests_;
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
  /// Messages published on `subject` so far.
  /// The first of `workers` whose generate subject ("gen.<id>") got a request; 0: none yet.
  WorkerId dispatched_to(std::initializer_list<WorkerId> workers) const {
    for (WorkerId id : workers) {
      if (!published_on("gen." + std::to_string(id)).empty()) return id;
    }
    return 0;
  }
  std::vector<std::string> published_on(std::string_view subject) const {
    std::lock_guard lock{mutex_};
    std::vector<std::string> result;
    for (const auto& [published_subject, data] : published_) {
      if (published_subject == subject) result.push_back(data);
    }
    return result;
  }

 private:
  mutable std::mutex mutex_;
  bool fail_publish_ = false;
  std::vector<std::pair<std::string, std::string>> published_;
  std::vector<std::pair<std::string, std::string>> deferred_;
  int flushes_ = 0;
  std::vector<WorkerWithDpRank> dumps_;
  int reregistration_requests_ = 0;
};

discovery::WorkerRegistration registration(WorkerId id) {
  discovery::WorkerRegistration result;
  result.worker_id = id;
  result.incarnation = 1;
  result.model = "m";
  result.block_size = 4;
  result.total_kv_blocks = 100;
  result.liveness_ttl = 60s;
  result.generate_subject = "gen." + std::to_string(id);
  result.dump_subject = "dump." + std::to_string(id);
  return result;
}

RouteRequest request(std::string id, std::string model = "m") {
  RouteRequest data;
  data.selection.request_id = std::move(id);
  data.partition.model = std::move(model);
  data.selection.prompt_tokens = 8;
  data.selection.block_hashes = {1, 2};
  return data;
}

// A generate request streaming to `stream_subject`, carrying its id on the wire too.
GenerateRequestData generate_request(std::string id, std::string stream_subject) {
  GenerateRequestData generate;
  generate.route = request(id);
  generate.stream_subject = std::move(stream_subject);
  generate.wire.mutable_route()->set_request_id(std::move(id));
  return generate;
}

// What the test's client actors were answered and streamed.
struct Answers {
  std::vector<v1::RouteDecision> decisions;
  std::vector<v1::LifecycleAck> acks;
  std::vector<v1::GenerateChunk> chunks;
};

// The test's actors are spawned with an argument: CAF 0.17's initialisation of an actor without
// one binds a null reference, which UBSan reports.

// Requests one route decision of `entry`.
void route_client(caf::event_based_actor* self, const route_entry_actor& entry,
                  RouteEnvelope envelope, Answers* answers) {
  self->request(entry, caf::infinite, route_atom::value, std::move(envelope))
      .then(
          [answers](RouteDecisionMessage& message) {
            answers->decisions.push_back(std::move(message.value));
          },
          [](caf::error& error) { ADD_FAILURE() << "route failed: " << caf::to_string(error); });
}

// Requests one lifecycle ack of `entry`.
void report_client(caf::event_based_actor* self, const report_entry_actor& entry,
                   ReportEnvelope envelope, Answers* answers) {
  self->request(entry, caf::infinite, report_atom::value, std::move(envelope))
      .then(
          [answers](LifecycleAckMessage& message) {
            answers->acks.push_back(std::move(message.value));
          },
          [](caf::error& error) { ADD_FAILURE() << "report failed: " << caf::to_string(error); });
}

// Records the decisions sent to it as plain messages: the answers to what the test sent on its
// behalf (caf::send_as), not as requests.
caf::behavior decision_recorder(caf::event_based_actor*, Answers* answers) {
  return {[answers](RouteDecisionMessage& message) {
    answers->decisions.push_back(std::move(message.value));
  }};
}

// An actor client of the ingress: makes the requests the test tells it to (route, forwarded route,
// generate; a cancel it sends on), records the answers and the chunks streamed to it.
caf::behavior ingress_client(caf::event_based_actor* self, const ingress_actor& ingress,
                             Answers* answers) {
  const auto record = [answers](RouteDecisionMessage& message) {
    answers->decisions.push_back(std::move(message.value));
  };
  const auto fail = [](caf::error& error) {
    ADD_FAILURE() << "ingress request failed: " << caf::to_string(error);
  };
  return {
      [=](route_atom, RouteRequestMessage& message) {
        self->request(ingress, caf::infinite, route_atom::value, std::move(message))
            .then(record, fail);
      },
      [=](route_atom, RouteRequestMessage& message, std::string& scope) {
        self->request(ingress, caf::infinite, route_atom::value, std::move(message),
                      std::move(scope))
            .then(record, fail);
      },
      [=](generate_atom, GenerateRequestMessage& message) {
        self->request(ingress, caf::infinite, generate_atom::value, std::move(message))
            .then(record, fail);
      },
      [=](cancel_atom, GenerateCancelMessage& message) {
        self->send(ingress, cancel_atom::value, std::move(message));
      },
      [answers](chunk_atom, GenerateChunkMessage& message) {
        answers->chunks.push_back(std::move(message.value));
      },
  };
}

class RouterActorsTest : public ::testing::Test {
 protected:
  RouterActorsTest()
      : system_(testing::coordinated_config()),
        scheduler_(dynamic_cast<caf::scheduler::test_coordinator&>(system_.scheduler())) {
    plugins::RouterPluginRegistry registry;
    EXPECT_TRUE(selection::register_builtin_policies(registry));
    auto resolved = registry.resolve_plugins(selection::RouterPolicyConfig{});
    EXPECT_TRUE(resolved);
    plugins_ = std::move(*resolved);
    metrics::NodeMetrics::describe(*metrics_);  // the histograms are recorded only once described

    discovery_ =
        system_.spawn(discovery_behavior, DiscoveryActorConfig{selector_config(metrics_), {}});
    reservation_ =
        own(system_.spawn(reservation_behavior, reservation_config(discovery_, metrics_)));
    lifecycle_ = own(system_.spawn(lifecycle_behavior, lifecycle_config("node.streams", 60s)));
    IngressActorConfig ingress;
    ingress.metrics = metrics_;
    ingress.clock = clock_;
    ingress.entry = RequestEntry::local({}, reservation_, lifecycle_);
    ingress_ = own(system_.spawn(ingress_behavior, std::move(ingress)));
    scheduler_.run();
  }

  ~RouterActorsTest() override {
    caf::anon_send_exit(lifecycle_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(discovery_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(reservation_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(ingress_, caf::exit_reason::user_shutdown);
    for (const caf::actor& actor : owned_)
      caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  // An actor the test spawned, ended with the fixture (also when the test stops at a failed
  // assertion: a live actor would keep the actor system's shutdown waiting).
  template <class Handle>
  Handle own(Handle actor) {
    owned_.push_back(caf::actor_cast<caf::actor>(actor));
    return actor;
  }

  // Sends a message and handles it (and whatever it causes).
  template <class Target, class... Ts>
  void send(const Target& target, Ts&&... xs) {
    caf::anon_send(target, std::forward<Ts>(xs)...);
    scheduler_.run();
  }

  // Registers workers: the partition's selector then holds them.
  void register_workers(std::initializer_list<WorkerId> ids) {
    for (WorkerId id : ids) send(discovery_, worker_up_atom::value, registration(id));
    ASSERT_EQ(metrics_->value("kvr_workers", {{"partition", "m/default"}}), ids.size());
  }

  // The selectors' settings every test starts from, writing metrics to `metrics`; their expiry
  // tick never fires (an hour, and the test moves CAF's clock less).
  SelectorActorConfig selector_config(std::shared_ptr<metrics::MetricsRegistry> metrics) {
    SelectorActorConfig selector;
    selector.options.router.block_size = 4;
    selector.options.booking_ttl = 60s;
    selector.plugins = &plugins_;
    selector.publisher = publisher_;
    selector.metrics = std::move(metrics);
    selector.log = log_;
    selector.clock = clock_;
    selector.tick_interval = 1h;
    return selector;
  }

  ReservationActorConfig reservation_config(discovery_actor discovery,
                                            std::shared_ptr<metrics::MetricsRegistry> metrics) {
    ReservationActorConfig reservation;
    reservation.discovery = std::move(discovery);
    reservation.publisher = publisher_;
    reservation.metrics = std::move(metrics);
    reservation.log = log_;
    reservation.clock = clock_;
    reservation.booking_ttl = 60s;
    reservation.tick_interval = 1h;  // the tests that need it send the tick
    return reservation;
  }

  LifecycleActorConfig lifecycle_config(std::string stream_inbox_prefix,
                                        std::chrono::milliseconds first_token_timeout) {
    LifecycleActorConfig lifecycle;
    lifecycle.discovery = discovery_;
    lifecycle.publisher = publisher_;
    lifecycle.metrics = metrics_;
    lifecycle.log = log_;
    lifecycle.clock = clock_;
    lifecycle.stream_inbox_prefix = std::move(stream_inbox_prefix);
    lifecycle.first_token_timeout = first_token_timeout;
    lifecycle.cache_mismatch = cache_mismatch_;
    return lifecycle;
  }

  v1::RouteDecision route(RouteRequest data) { return route_via(reservation_, std::move(data)); }

  // The decision `entry` answers a route request with (tests with their own set of actors).
  v1::RouteDecision route_via(const route_entry_actor& entry, RouteRequest data) {
    const std::size_t before = answers_.decisions.size();
    system_.spawn(route_client, entry, RouteEnvelope{std::move(data), {}, clock_->now()},
                  &answers_);
    scheduler_.run();
    if (answers_.decisions.size() != before + 1) {
      ADD_FAILURE() << "the route request got no answer";
      return {};
    }
    return answers_.decisions.back();
  }

  v1::LifecycleAck report(const std::string& booking, LifecycleEventKind event) {
    return report_via(reservation_, booking, event);
  }

  v1::LifecycleAck report_via(const report_entry_actor& entry, const std::string& booking,
                              LifecycleEventKind event, std::string reason = {},
                              AbortCause cause = AbortCause::unspecified,
                              std::optional<std::uint64_t> context_tokens = std::nullopt) {
    const std::size_t before = answers_.acks.size();
    system_.spawn(
        report_client, entry,
        ReportEnvelope{
            LifecycleReportData{booking, event, std::move(reason), cause, context_tokens}, {}},
        &answers_);
    scheduler_.run();
    if (answers_.acks.size() != before + 1) {
      ADD_FAILURE() << "the report got no ack";
      return {};
    }
    return answers_.acks.back();
  }

  // Where a client the test spawns records what it gets (lives as long as the fixture).
  Answers& new_answers() { return client_answers_.emplace_back(); }

  // An actor client of `ingress` (by default the fixture's), recording into `answers`.
  caf::actor spawn_client(Answers& answers, const ingress_actor& ingress = {}) {
    auto client = own(system_.spawn(ingress_client, ingress ? ingress : ingress_, &answers));
    scheduler_.run();
    return client;
  }

  // Tells the actor client `client` to make a request of its ingress (route, a forwarded route,
  // generate) and returns the decision it got.
  template <class... Ts>
  v1::RouteDecision ask(const caf::actor& client, Answers& answers, Ts&&... xs) {
    const std::size_t before = answers.decisions.size();
    send(client, std::forward<Ts>(xs)...);
    if (answers.decisions.size() != before + 1) {
      ADD_FAILURE() << "the actor client got no decision";
      return {};
    }
    return answers.decisions.back();
  }

  // Sends a generate request to the ingress as the actor client `client` and returns its decision.
  v1::RouteDecision generate(const caf::actor& client, Answers& answers, v1::GenerateRequest wire) {
    return ask(client, answers, generate_atom::value, GenerateRequestMessage{std::move(wire)});
  }

  // Ends `actor` (as its client or node would) and handles what that causes.
  template <class Handle>
  void send_exit(const Handle& actor) {
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  double bookings() const {
    return metrics_->value("kvr_bookings_open", {{"partition", "m/default"}});
  }

  caf::actor_system system_;
  caf::scheduler::test_coordinator& scheduler_;
  plugins::RouterPlugins plugins_;
  std::shared_ptr<FakePublisher> publisher_ = std::make_shared<FakePublisher>();
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<metrics::RateLimitedLog> log_ = std::make_shared<metrics::RateLimitedLog>();
  std::shared_ptr<ManualClock> clock_ = std::make_shared<ManualClock>();
  std::shared_ptr<metrics::CacheMismatchDetector> cache_mismatch_ =
      std::make_shared<metrics::CacheMismatchDetector>(clock_);
  Answers answers_;
  // The test's clients' answers: kept until every actor has ended, since actors that end at
  // teardown still stream their last chunks to their clients.
  std::deque<Answers> client_answers_;
  std::vector<caf::actor> owned_;
  discovery_actor discovery_;
  reservation_actor reservation_;
  lifecycle_actor lifecycle_;
  ingress_actor ingress_;
};

TEST_F(RouterActorsTest, UnknownPartitionGetsAnExplicitNoWorkersDecision) {
  const auto decision = route(request("r1", "other-model"));
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_NO_WORKERS);
  EXPECT_EQ(decision.request_id(), "r1");
}

// Route mode counts an error under the code's short name, as generate mode and the ingresses do.
TEST_F(RouterActorsTest, RouteModeCountsAnErrorUnderItsShortCode) {
  ASSERT_TRUE(route(request("r1", "other-model")).has_error());
  EXPECT_EQ(metrics_->value("kvr_route_errors_total", {{"code", "no_workers"}}), 1);
  EXPECT_EQ(metrics_->total("kvr_route_errors_total"), 1);
}

// Reports are idempotent (a client sends one again when its ack is late): a repeat is
// acknowledged and counted apart, and changes nothing; a booking never issued is refused.
TEST_F(RouterActorsTest, RouteBooksAndCompletionReleasesExactlyOnce) {
  register_workers({11, 12});
  const auto decision = route(request("r1"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_TRUE(decision.success().worker_id() == 11 || decision.success().worker_id() == 12);
  EXPECT_EQ(decision.success().generate_subject(),
            "gen." + std::to_string(decision.success().worker_id()));
  EXPECT_EQ(bookings(), 1);
  const std::string booking = decision.success().booking_id();
  EXPECT_TRUE(report(booking, LifecycleEventKind::FirstToken).accepted());
  const auto repeated_first_token = report(booking, LifecycleEventKind::FirstToken);
  EXPECT_TRUE(repeated_first_token.accepted());
  EXPECT_EQ(repeated_first_token.message(),
            fmt::format("booking '{}': first_token_repeated", booking));
  EXPECT_EQ(bookings(), 1);
  EXPECT_TRUE(report(booking, LifecycleEventKind::Completed).accepted());
  EXPECT_EQ(bookings(), 0);
  const auto repeated_completion = report(booking, LifecycleEventKind::Completed);
  EXPECT_TRUE(repeated_completion.accepted());
  EXPECT_EQ(repeated_completion.message(), fmt::format("booking '{}': already_ended", booking));
  EXPECT_EQ(bookings(), 0);
  EXPECT_FALSE(report("no-such-booking", LifecycleEventKind::Aborted).accepted());

  auto count = [&](const char* event, const char* accepted) {
    return metrics_->value("kvr_lifecycle_reports_total",
                           {{"event", event}, {"accepted", accepted}});
  };
  EXPECT_EQ(count("first_token", "true"), 1);
  EXPECT_EQ(count("completed", "true"), 1);
  EXPECT_EQ(count("aborted", "false"), 1);
  EXPECT_EQ(metrics_->value("kvr_lifecycle_reports_after_end_total", {{"event", "first_token"}}),
            1);
  EXPECT_EQ(metrics_->value("kvr_lifecycle_reports_after_end_total", {{"event", "completed"}}), 1);
}

// The selector runs its partition's policy factories when it is spawned: a factory that throws is
// counted and logged once then, before any request, and each request of that role is refused
// naming the policy and the cause without running the factory again.
TEST_F(RouterActorsTest, AThrowingPolicyFactoryIsCountedOnceWhenItsPartitionIsCreated) {
  using plugins::worker_selection::WorkerSelectionPolicy;
  auto calls = std::make_shared<int>(0);
  plugins_.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] =
      plugins::RouterPlugins::WorkerSelection{
          "fragile", "fragile",
          [calls](const plugins::worker_selection::RouterConfig&, WorkerType,
                  const plugins::worker_selection::RoutingPartition&) -> WorkerSelectionPolicy {
            ++*calls;
            throw std::runtime_error("no GPU budget");
          }};
  const metrics::Labels failures{{"partition", "m/default"}, {"role", "aggregated"}};
  register_workers({11});
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(metrics_->value("kvr_policy_build_failures_total", failures), 1);

  for (const char* id : {"r1", "r2"}) {
    const auto decision = route(request(id));
    ASSERT_TRUE(decision.has_error()) << id;
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_POLICY_FAILED);
    EXPECT_NE(decision.error().message().find("'fragile'"), std::string::npos)
        << decision.error().message();
    EXPECT_NE(decision.error().message().find("no GPU budget"), std::string::npos)
        << decision.error().message();
  }
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(metrics_->value("kvr_policy_build_failures_total", failures), 1);
  EXPECT_EQ(bookings(), 0);
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
  send(reservation_, route_atom::value,
       RouteEnvelope{request("r1"), "reply.subject", clock_->now()});
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_bookings_rolled_back_total"), 1);
  EXPECT_EQ(metrics_->value("kvr_route_bookings_open"), 0);
}

// NATS answers are published deferred and written by a flush queued behind the reservation's
// backlog: a burst of requests gets every answer written, none is left in the buffer, and each
// request's route latency is recorded once, when its answer was written.
TEST_F(RouterActorsTest, EveryNatsAnswerOfABurstIsFlushed) {
  register_workers({11, 12});
  constexpr int kRequests = 20;
  Answers& answers = new_answers();
  auto client = own(system_.spawn(decision_recorder, &answers));
  // The whole burst is in the reservation's mailbox before it runs.
  for (int i = 0; i < kRequests; ++i) {
    caf::send_as(client, reservation_, route_atom::value,
                 RouteEnvelope{request("burst-" + std::to_string(i)), "burst." + std::to_string(i),
                               clock_->now()});
  }
  scheduler_.run();
  ASSERT_EQ(answers.decisions.size(), static_cast<std::size_t>(kRequests));
  for (const auto& decision : answers.decisions) EXPECT_TRUE(decision.has_success());
  EXPECT_EQ(publisher_->unflushed(), 0U);
  for (int i = 0; i < kRequests; ++i) {
    const auto published = publisher_->published_on("burst." + std::to_string(i));
    ASSERT_EQ(published.size(), 1U) << "request " << i;
    v1::RouteDecision decision;
    ASSERT_TRUE(decision.ParseFromString(published[0]));
    EXPECT_EQ(decision.request_id(), "burst-" + std::to_string(i));
  }
  EXPECT_GE(publisher_->flushes(), 1);
  EXPECT_LE(publisher_->flushes(), kRequests);
  EXPECT_NE(metrics_->render().find("kvr_route_latency_seconds_count " + std::to_string(kRequests)),
            std::string::npos);
}

TEST_F(RouterActorsTest, EventIdGapAsksTheWorkerForADump) {
  register_workers({11});
  KvEventBatch batch;
  batch.worker = {11, 0};
  batch.incarnation = 1;
  batch.event_id = 5;  // 1..4 never arrived
  batch.events.push_back(KvStoredEvent{std::nullopt, {1, 2}, StorageTier::Device});
  send(discovery_, kv_events_atom::value, batch);
  EXPECT_EQ(publisher_->dumps(), (std::vector<WorkerWithDpRank>{{11, 0}}));
}

TEST_F(RouterActorsTest, IngressAnswersActorClientsWithDecisionsAndErrors) {
  register_workers({11});
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers);
  v1::RouteRequest wire;
  wire.set_request_id("a1");
  wire.set_model("m");
  for (std::uint32_t token = 0; token < 9; ++token) wire.mutable_tokens()->add_ids(token);
  v1::RouteDecision decision = ask(client, answers, route_atom::value, RouteRequestMessage{wire});
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(decision.success().worker_id(), 11U);

  wire.clear_prompt();
  decision = ask(client, answers, route_atom::value, RouteRequestMessage{wire});
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
}

// Request ids are unique per client: two actor clients may use the same one, a client reusing
// its own open id is refused, and a forwarded request keeps the scope of the node it entered.
TEST_F(RouterActorsTest, RequestIdsAreScopedToTheirClient) {
  register_workers({11});
  v1::RouteRequest wire;
  wire.set_request_id("same");
  wire.set_model("m");
  for (std::uint32_t token = 0; token < 9; ++token) wire.mutable_tokens()->add_ids(token);
  Answers& first_answers = new_answers();
  Answers& second_answers = new_answers();
  const caf::actor first = spawn_client(first_answers);
  const caf::actor second = spawn_client(second_answers);
  const auto ask_first = [&](auto... scope) {
    return ask(first, first_answers, route_atom::value, RouteRequestMessage{wire}, scope...);
  };
  const auto ask_second = [&](auto... scope) {
    return ask(second, second_answers, route_atom::value, RouteRequestMessage{wire}, scope...);
  };
  const v1::RouteDecision a = ask_first();
  ASSERT_TRUE(a.has_success()) << a.error().message();
  EXPECT_EQ(a.request_id(), "same");
  const v1::RouteDecision b = ask_second();
  ASSERT_TRUE(b.has_success()) << b.error().message();
  EXPECT_EQ(b.request_id(), "same");
  EXPECT_NE(a.success().booking_id(), b.success().booking_id());
  // The first client's id is still open.
  const v1::RouteDecision again = ask_first();
  ASSERT_TRUE(again.has_error());
  EXPECT_EQ(again.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_NE(again.error().message().find("already routed"), std::string::npos)
      << again.error().message();
  EXPECT_EQ(again.request_id(), "same");
  // Forwarded requests of one NATS client, whichever node and actor forwarded them.
  const v1::RouteDecision forwarded = ask_first(std::string{"_INBOX.client."});
  ASSERT_TRUE(forwarded.has_success()) << forwarded.error().message();
  EXPECT_EQ(forwarded.request_id(), "same");
  const v1::RouteDecision forwarded_again = ask_second(std::string{"_INBOX.client."});
  ASSERT_TRUE(forwarded_again.has_error());
  EXPECT_EQ(forwarded_again.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  // Released, the id is free again for its client.
  ASSERT_TRUE(report(a.success().booking_id(), LifecycleEventKind::Completed).accepted());
  EXPECT_TRUE(ask_first().has_success());
}

TEST_F(RouterActorsTest, GenerateIsRetriedOnceWhenItsWorkerLeavesBeforeTheFirstToken) {
  register_workers({11, 12});
  GenerateRequestData generate = generate_request("g1", "client.stream");
  generate.wire.set_max_output_tokens(2);
  send(lifecycle_, generate_atom::value, GenerateEnvelope{generate, "client.reply", clock_->now()});
  // Dispatched to one worker, with the node's own stream subject.
  const WorkerId first = publisher_->dispatched_to({11, 12});
  ASSERT_NE(first, 0U);
  const WorkerId second = first == 11 ? 12 : 11;
  v1::GenerateRequest dispatched;
  ASSERT_TRUE(
      dispatched.ParseFromString(publisher_->published_on("gen." + std::to_string(first))[0]));
  EXPECT_EQ(dispatched.stream_subject(), "node.streams.1");
  // The decision left with the lifecycle actor's next write (burst_writer.hpp).
  EXPECT_EQ(publisher_->published_on("client.reply").size(), 1U);
  EXPECT_EQ(bookings(), 1);

  // The worker deregisters before its first token: the request moves to the other worker.
  send(discovery_, worker_down_atom::value, WorkerLiveness{first, 1});
  ASSERT_EQ(publisher_->published_on("gen." + std::to_string(second)).size(), 1U);
  EXPECT_EQ(metrics_->value("kvr_generate_retries_total"), 1);
  EXPECT_EQ(bookings(), 1);  // the failed attempt's booking left with its worker

  v1::GenerateChunk chunk;
  chunk.set_request_id("g1");
  chunk.set_worker_id(second);
  chunk.add_token_ids(7);
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  chunk.set_index(1);
  chunk.set_finished(true);
  chunk.set_finish_reason("length");
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  ASSERT_EQ(publisher_->published_on("client.stream").size(), 2U);
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 0);
  // A chunk after the end changes nothing.
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  EXPECT_EQ(metrics_->value("kvr_generate_stale_chunks_total"), 1);
  EXPECT_EQ(publisher_->published_on("client.stream").size(), 2U);
  EXPECT_EQ(publisher_->unflushed(), 0U);  // nothing relayed is left unwritten
}

TEST_F(RouterActorsTest, GenerateRecordsTheFirstChunksCachedTokensAgainstTheRoutesOverlap) {
  register_workers({11});
  // Worker 11 holds the request's first block: the route's overlap is 1 block of 4 tokens.
  KvEventBatch batch;
  batch.worker = {11, 0};
  batch.incarnation = 1;
  batch.event_id = 1;
  batch.events.push_back(KvStoredEvent{std::nullopt, {1}, StorageTier::Device});
  send(discovery_, kv_events_atom::value, batch);
  send(lifecycle_, generate_atom::value,
       GenerateEnvelope{generate_request("g-cache", "client.stream"), {}, clock_->now()});
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 1U);

  v1::GenerateChunk chunk;
  chunk.set_request_id("g-cache");
  chunk.set_worker_id(11);
  chunk.set_cached_prompt_tokens(4);
  chunk.add_token_ids(7);
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  const metrics::Labels model{{"model", "m"}};
  EXPECT_EQ(metrics_->value("kvr_prompt_tokens_total", model), 8);
  EXPECT_EQ(metrics_->value("kvr_predicted_cached_tokens_total", model), 4);
  EXPECT_EQ(metrics_->value("kvr_engine_cached_tokens_total", model), 4);
  const std::string text = metrics_->render();
  EXPECT_NE(text.find("kvr_cached_tokens_difference_bucket{model=\"m\",le=\"-1\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvr_cached_tokens_difference_bucket{model=\"m\",le=\"0\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(cache_mismatch_->window("m").requests, 1U);

  // Later chunks carry no cached tokens to count.
  chunk.set_index(1);
  chunk.set_finished(true);
  chunk.set_finish_reason("length");
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  EXPECT_EQ(publisher_->published_on("client.stream").size(), 2U);
  EXPECT_EQ(metrics_->value("kvr_prompt_tokens_total", model), 8);
  EXPECT_EQ(cache_mismatch_->window("m").requests, 1U);
}

TEST_F(RouterActorsTest, GenerateWithoutAnyOtherWorkerEndsWithAnExplicitError) {
  register_workers({11});
  GenerateRequestData generate;
  generate.route = request("g2");
  generate.stream_subject = "client.stream";
  send(lifecycle_, generate_atom::value, GenerateEnvelope{generate, {}, clock_->now()});
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 1U);
  send(discovery_, worker_down_atom::value, WorkerLiveness{11, 1});
  ASSERT_EQ(publisher_->published_on("client.stream").size(), 1U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("client.stream")[0]));
  EXPECT_TRUE(end.finished());
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_NE(end.error().code(), v1::ROUTE_ERROR_UNSPECIFIED);
  EXPECT_EQ(bookings(), 0);
}

// The wire request an actor client sends for generate: 9 tokens of model "m", 2 output tokens.
v1::GenerateRequest actor_generate_request(const std::string& id) {
  v1::GenerateRequest wire;
  wire.mutable_route()->set_request_id(id);
  wire.mutable_route()->set_model("m");
  for (std::uint32_t token = 0; token < 9; ++token) {
    wire.mutable_route()->mutable_tokens()->add_ids(token);
  }
  wire.set_max_output_tokens(2);
  return wire;
}

TEST_F(RouterActorsTest, ActorClientGenerateGetsTheDecisionAndTheStream) {
  register_workers({11});
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers);
  const v1::RouteDecision decision = generate(client, answers, actor_generate_request("ag1"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(decision.success().worker_id(), 11U);
  EXPECT_EQ(decision.request_id(), "ag1");
  // The decision leaves just before the dispatch.
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 1U);
  v1::GenerateRequest dispatched;
  ASSERT_TRUE(dispatched.ParseFromString(publisher_->published_on("gen.11")[0]));
  EXPECT_EQ(dispatched.stream_subject(), "node.streams.1");

  v1::GenerateChunk chunk;
  chunk.set_request_id("ag1");
  chunk.set_worker_id(11);
  chunk.add_token_ids(7);
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  chunk.set_index(1);
  chunk.set_finished(true);
  chunk.set_finish_reason("length");
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  ASSERT_EQ(answers.chunks.size(), 2U);
  EXPECT_EQ(answers.chunks[0].index(), 0U);
  EXPECT_FALSE(answers.chunks[0].finished());
  EXPECT_TRUE(answers.chunks[1].finished());
  EXPECT_EQ(answers.chunks[1].finish_reason(), "length");
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 0);
}

TEST_F(RouterActorsTest, ActorClientCancelEndsTheStreamAndTellsTheWorker) {
  register_workers({11});
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers);
  const v1::RouteDecision decision = generate(client, answers, actor_generate_request("ag2"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  v1::GenerateCancel cancel;
  cancel.set_request_id("ag2");
  send(client, cancel_atom::value, GenerateCancelMessage{cancel});
  ASSERT_EQ(answers.chunks.size(), 1U);
  EXPECT_TRUE(answers.chunks[0].finished());
  EXPECT_EQ(answers.chunks[0].finish_reason(), "cancelled");
  EXPECT_EQ(publisher_->published_on("gen.11.cancel").size(), 1U);
  EXPECT_EQ(bookings(), 0);
}

TEST_F(RouterActorsTest, ATerminatedActorClientCancelsItsRequests) {
  register_workers({11});
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers);
  const v1::RouteDecision decision = generate(client, answers, actor_generate_request("ag3"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(bookings(), 1);
  // The client terminates before any chunk.
  send_exit(client);
  EXPECT_TRUE(answers.chunks.empty());
  EXPECT_EQ(publisher_->published_on("gen.11.cancel").size(), 1U);
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 0);
}

TEST_F(RouterActorsTest, AnInvalidActorGenerateGetsAnErrorDecisionAndNoDispatch) {
  register_workers({11});
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers);
  v1::GenerateRequest wire = actor_generate_request("ag4");
  wire.set_max_output_tokens(0);
  wire.mutable_route()->clear_expected_output_tokens();
  const v1::RouteDecision decision = generate(client, answers, wire);
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_NE(decision.error().message().find("max_output_tokens"), std::string::npos);
  EXPECT_TRUE(publisher_->published_on("gen.11").empty());
  EXPECT_EQ(bookings(), 0);
}

TEST_F(RouterActorsTest, RouteModeReportsCommitAndAbandonHardSessionBindings) {
  // A second set of discovery and reservation actors whose selectors keep hard session affinity.
  SelectorActorConfig selector = selector_config(metrics_);
  selector.affinity.ttl = std::chrono::seconds(60);
  selector.affinity.mode = SessionAffinityMode::hard;
  auto discovery = own(system_.spawn(discovery_behavior, DiscoveryActorConfig{selector, {}}));
  auto reservation =
      own(system_.spawn(reservation_behavior, reservation_config(discovery, metrics_)));
  for (WorkerId id : {21, 22, 23}) {
    auto worker = registration(id);
    worker.model = "sessions";
    send(discovery, worker_up_atom::value, worker);
  }
  ASSERT_EQ(metrics_->value("kvr_workers", {{"partition", "sessions/default"}}), 3);
  const metrics::Labels partition{{"partition", "sessions/default"}};
  int counter = 0;
  const auto route_session = [&] {
    RouteRequest data = request("s-" + std::to_string(++counter), "sessions");
    data.selection.block_hashes = {static_cast<BlockHash>(1000 + counter)};  // unrelated prompts
    data.selection.session.emplace("session-1", std::nullopt, std::nullopt, std::nullopt);
    return route_via(reservation, std::move(data));
  };
  const auto report_on = [&](const std::string& booking, LifecycleEventKind event,
                             std::string reason = {}) {
    return report_via(reservation, booking, event, std::move(reason)).accepted();
  };

  // Bound at selection; aborted before its first token: the provisional binding is dropped.
  auto decision = route_session();
  ASSERT_TRUE(decision.has_success());
  EXPECT_EQ(metrics_->value("kvr_session_bindings", partition), 1);
  EXPECT_TRUE(report_on(decision.success().booking_id(), LifecycleEventKind::Aborted, "failed"));
  EXPECT_EQ(metrics_->value("kvr_session_bindings", partition), 0);

  // Bound again, confirmed by the first token: every later request goes to the same worker.
  decision = route_session();
  ASSERT_TRUE(decision.has_success());
  const WorkerId bound = decision.success().worker_id();
  EXPECT_TRUE(report_on(decision.success().booking_id(), LifecycleEventKind::FirstToken));
  EXPECT_TRUE(report_on(decision.success().booking_id(), LifecycleEventKind::Completed));
  EXPECT_EQ(metrics_->value("kvr_session_bindings", partition), 1);
  std::vector<std::string> open_bookings;
  for (int i = 0; i < 6; ++i) {
    // Left open, so that the bound worker is the busiest: only the binding sends them there.
    decision = route_session();
    ASSERT_TRUE(decision.has_success());
    EXPECT_EQ(decision.success().worker_id(), bound);
    open_bookings.push_back(decision.success().booking_id());
  }
  for (const auto& booking : open_bookings) {
    EXPECT_TRUE(report_on(booking, LifecycleEventKind::Completed));
  }
  send_exit(discovery);
  send_exit(reservation);
}

// A selector that never answers: it counts the route requests and booking updates it is handed
// and leaves each unanswered. Dynamically typed (it answers only part of the discovery actor's
// interface); the reservation actor gets it as its discovery actor through an unchecked actor_cast.
caf::behavior silent_selector(caf::event_based_actor* self,
                              std::shared_ptr<std::atomic<int>> received) {
  return {
      [self, received](route_atom, const RouteRequest&) {
        ++*received;
        (void)self->make_response_promise();
      },
      [self, received](booking_atom, const BookingUpdate&) {
        ++*received;
        (void)self->make_response_promise();
      },
      [](watch_atom, const selector_subscriber_actor&) {},
      // The reservation gives up on a request it timed out: nothing of it waits here.
      [](cancel_atom, const std::string&, const std::string&, const std::string&) {},
  };
}

TEST_F(RouterActorsTest, RequestsReleaseExpiredBookingsAFewAtATimeBetweenTicks) {
  // Bookings of 300 ms and a tick that never comes: only the requests themselves end the expired
  // bookings and release their bookings, four per request in each actor. Time moves only when
  // the test advances it.
  auto metrics = std::make_shared<metrics::MetricsRegistry>();
  auto clock = std::make_shared<ManualClock>();
  SelectorActorConfig selector = selector_config(metrics);
  selector.options.booking_ttl = 300ms;
  selector.tick_interval = 1h;
  selector.clock = clock;
  auto discovery = own(system_.spawn(discovery_behavior, DiscoveryActorConfig{selector, {}}));
  ReservationActorConfig config = reservation_config(discovery, metrics);
  config.booking_ttl = 300ms;
  config.tick_interval = 1h;
  config.clock = clock;
  auto reservation = own(system_.spawn(reservation_behavior, config));
  for (WorkerId id : {11, 12}) send(discovery, worker_up_atom::value, registration(id));
  const metrics::Labels partition{{"partition", "m/default"}};
  ASSERT_EQ(metrics->value("kvr_workers", partition), 2);
  auto route_on = [&](std::string id) {
    return route_via(reservation, request(std::move(id))).has_success();
  };
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(route_on(fmt::format("early{}", i)));
  EXPECT_EQ(metrics->value("kvr_bookings_open", partition), 6);
  EXPECT_EQ(metrics->value("kvr_route_bookings_open"), 6);
  clock->advance(400ms);
  ASSERT_TRUE(route_on("late"));
  // Four of the six expired bookings ended, and the new one is open.
  EXPECT_EQ(metrics->value("kvr_bookings_open", partition), 3);
  EXPECT_EQ(metrics->value("kvr_route_bookings_open"), 3);
  EXPECT_EQ(metrics->value("kvr_route_bookings_expired_total"), 4);
  ASSERT_TRUE(route_on("later"));
  EXPECT_EQ(metrics->value("kvr_bookings_open", partition), 2);
  EXPECT_EQ(metrics->value("kvr_route_bookings_expired_total"), 6);
  send_exit(reservation);
  send_exit(discovery);
}

TEST_F(RouterActorsTest, ARequestItsSelectorLeavesUnansweredFailsWithATimeoutOnTheTick) {
  auto received = std::make_shared<std::atomic<int>>(0);
  auto silent = own(system_.spawn(silent_selector, received));
  auto clock = std::make_shared<ManualClock>();
  ReservationActorConfig config =
      reservation_config(caf::actor_cast<discovery_actor>(silent), metrics_);
  config.selector_timeout = 100ms;
  config.tick_interval = 1h;  // the test sends the ticks
  config.clock = clock;
  auto reservation = own(system_.spawn(reservation_behavior, config));
  Answers& answers = new_answers();
  auto client = own(system_.spawn(decision_recorder, &answers));
  scheduler_.run();
  caf::send_as(client, reservation, route_atom::value,
               RouteEnvelope{request("slow"), "client.reply", clock->now()});
  scheduler_.run();
  ASSERT_EQ(received->load(), 1);
  // A tick just before the selector timeout leaves the request waiting.
  clock->advance(99ms);
  send(reservation, expire_atom::value);
  EXPECT_TRUE(answers.decisions.empty());
  EXPECT_TRUE(publisher_->published_on("client.reply").empty());
  EXPECT_EQ(publisher_->unflushed(), 0U);
  // The first tick at the timeout fails it, not the client's own timeout.
  clock->advance(1ms);
  send(reservation, expire_atom::value);
  ASSERT_EQ(answers.decisions.size(), 1U);
  const v1::RouteDecision& decision = answers.decisions[0];
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_EQ(decision.request_id(), "slow");
  EXPECT_EQ(received->load(), 1);
  // The NATS client got the same answer on its reply subject (written by the queued flush).
  EXPECT_EQ(publisher_->published_on("client.reply").size(), 1U);

  // No such booking: refused at once, without the selector.
  EXPECT_FALSE(report_via(reservation, "booking-1", LifecycleEventKind::Completed).accepted());
  EXPECT_EQ(received->load(), 1);
  send_exit(reservation);
  send_exit(silent);
}

TEST_F(RouterActorsTest, NoFirstChunkInTimeCountsAsAFailureRetriedOnceThenAnError) {
  register_workers({11, 12});
  auto impatient = own(system_.spawn(lifecycle_behavior, lifecycle_config("fast.streams", 50ms)));
  scheduler_.run();
  GenerateRequestData generate;
  generate.route = request("g3");
  generate.stream_subject = "impatient.stream";
  send(impatient, generate_atom::value, GenerateEnvelope{generate, {}, clock_->now()});
  ASSERT_EQ(publisher_->published_on("gen.11").size() + publisher_->published_on("gen.12").size(),
            1U);
  // Neither worker answers: the first-token timer (CAF's clock) fires for each attempt in turn;
  // both get the request once, then the client gets an error.
  scheduler_.advance_time(50ms);
  scheduler_.run();
  EXPECT_TRUE(publisher_->published_on("impatient.stream").empty());
  scheduler_.advance_time(50ms);
  scheduler_.run();
  ASSERT_EQ(publisher_->published_on("impatient.stream").size(), 1U);
  EXPECT_EQ(publisher_->published_on("gen.11").size(), 1U);
  EXPECT_EQ(publisher_->published_on("gen.12").size(), 1U);
  EXPECT_EQ(publisher_->published_on("gen.11.cancel").size(), 1U);
  EXPECT_EQ(publisher_->published_on("gen.12.cancel").size(), 1U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("impatient.stream")[0]));
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_WORKER_FAILED);
  EXPECT_EQ(metrics_->value("kvr_generate_first_token_timeouts_total"), 2);
  EXPECT_EQ(bookings(), 0);
  // Each timeout was reported against its worker (passive health): one each is not enough to
  // eject either.
  EXPECT_EQ(metrics_->value("kvr_worker_failures_total",
                            {{"partition", "m/default"}, {"cause", "first_token_timeout"}}),
            2);
  EXPECT_EQ(metrics_->total("kvr_worker_ejections_total"), 0);
  send_exit(impatient);
}

// A response whose worker goes quiet ends with an explicit error one stall timeout after its last
// chunk (CAF's clock), the worker told to stop and blamed for a stream timeout.
TEST_F(RouterActorsTest, AResponseThatGoesQuietEndsWithAnErrorAfterTheStallTimeout) {
  register_workers({11});
  LifecycleActorConfig config = lifecycle_config("stall.streams", 60s);
  config.stream_stall_timeout = 100ms;
  auto lifecycle = own(system_.spawn(lifecycle_behavior, std::move(config)));
  scheduler_.run();
  send(lifecycle, generate_atom::value,
       GenerateEnvelope{generate_request("s1", "quiet.stream"), {}, clock_->now()});
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 1U);
  v1::GenerateChunk chunk;
  chunk.set_request_id("s1");
  chunk.set_worker_id(11);
  chunk.add_token_ids(7);
  send(lifecycle, chunk_atom::value, ChunkEnvelope{1, chunk});
  scheduler_.advance_time(60ms);
  scheduler_.run();
  chunk.set_index(1);
  send(lifecycle, chunk_atom::value, ChunkEnvelope{1, chunk});
  // 120 ms after the first chunk but 60 ms after the last: still flowing.
  scheduler_.advance_time(60ms);
  scheduler_.run();
  ASSERT_EQ(publisher_->published_on("quiet.stream").size(), 2U);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 1);
  scheduler_.advance_time(40ms);
  scheduler_.run();
  ASSERT_EQ(publisher_->published_on("quiet.stream").size(), 3U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("quiet.stream")[2]));
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_NE(end.error().message().find("no chunk for 100 ms after chunk 1"), std::string::npos)
      << end.error().message();
  EXPECT_EQ(publisher_->published_on("gen.11.cancel").size(), 1U);
  EXPECT_EQ(metrics_->value("kvr_generate_stream_stalls_total"), 1);
  EXPECT_EQ(metrics_->value("kvr_worker_failures_total",
                            {{"partition", "m/default"}, {"cause", "stream_timeout"}}),
            1);
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 0);
  send_exit(lifecycle);
}

// The node's NATS connection drops: chunks sent meanwhile are lost, so every stream in flight,
// responding or not yet, ends at once with an explicit error and its booking released; nothing
// is blamed on the workers.
TEST_F(RouterActorsTest, LosingNatsEndsEveryStreamInFlightWithAnExplicitError) {
  register_workers({11, 12});
  send(lifecycle_, generate_atom::value,
       GenerateEnvelope{generate_request("n1", "first.stream"), {}, clock_->now()});
  const WorkerId first = publisher_->dispatched_to({11, 12});
  ASSERT_NE(first, 0U);
  send(lifecycle_, generate_atom::value,
       GenerateEnvelope{generate_request("n2", "second.stream"), {}, clock_->now()});
  v1::GenerateChunk chunk;
  chunk.set_request_id("n1");
  chunk.set_worker_id(first);
  chunk.add_token_ids(7);
  send(lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  ASSERT_EQ(publisher_->published_on("first.stream").size(), 1U);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 2);

  send(lifecycle_, nats_link_atom::value, false);
  for (const std::string stream : {"first.stream", "second.stream"}) {
    const auto published = publisher_->published_on(stream);
    ASSERT_FALSE(published.empty()) << stream;
    v1::GenerateChunk end;
    ASSERT_TRUE(end.ParseFromString(published.back())) << stream;
    EXPECT_EQ(end.finish_reason(), "error") << stream;
    EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_UNAVAILABLE) << stream;
    EXPECT_NE(end.error().message().find("lost its NATS connection"), std::string::npos)
        << end.error().message();
  }
  EXPECT_EQ(metrics_->value("kvr_generate_nats_losses_total"), 2);
  EXPECT_EQ(metrics_->value("kvr_generate_in_flight"), 0);
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->total("kvr_worker_failures_total"), 0);
  // The link's return changes nothing more.
  send(lifecycle_, nats_link_atom::value, true);
  EXPECT_EQ(metrics_->value("kvr_generate_nats_losses_total"), 2);
}

// Route mode: an abort counts against its worker only when its cause blames the worker; three
// in a row eject it (the default), and with two workers only one may be ejected.
TEST_F(RouterActorsTest, RouteModeAbortsCountAgainstTheWorkerOnlyWhenTheirCauseBlamesIt) {
  register_workers({11, 12});
  int next = 0;
  const auto route_and_abort = [&](AbortCause cause) {
    const auto decision = route(request("h" + std::to_string(next++)));
    EXPECT_TRUE(decision.has_success()) << decision.error().message();
    EXPECT_TRUE(report_via(reservation_, decision.success().booking_id(),
                           LifecycleEventKind::Aborted, "gave up", cause)
                    .accepted());
    return decision.success().worker_id();
  };
  for (int i = 0; i < 20; ++i) route_and_abort(AbortCause::client_cancelled);
  for (int i = 0; i < 20; ++i) route_and_abort(AbortCause::unspecified);
  EXPECT_EQ(metrics_->total("kvr_worker_failures_total"), 0);
  EXPECT_EQ(metrics_->total("kvr_worker_ejections_total"), 0);

  std::map<WorkerId, int> blamed;
  while (metrics_->total("kvr_worker_ejections_total") == 0 && next < 200) {
    ++blamed[route_and_abort(AbortCause::worker_failed)];
  }
  EXPECT_EQ(metrics_->value("kvr_worker_ejections_total", {{"partition", "m/default"}}), 1);
  EXPECT_EQ(metrics_->value("kvr_workers_ejected", {{"partition", "m/default"}}), 1);
  // Ejected: the one that reached three first. Every route now goes to the other one, and its
  // own failures cannot eject it (the cap keeps one of two in routing).
  const WorkerId ejected = blamed[11] >= 3 ? 11 : 12;
  const WorkerId other = ejected == 11 ? 12 : 11;
  for (int i = 0; i < 10; ++i) EXPECT_EQ(route_and_abort(AbortCause::first_token_timeout), other);
  EXPECT_EQ(metrics_->value("kvr_workers_ejected", {{"partition", "m/default"}}), 1);
  EXPECT_GT(metrics_->value("kvr_worker_failures_total",
                            {{"partition", "m/default"}, {"cause", "first_token_timeout"}}),
            0);
}

// ---- admission: the classifier actor in front of the reservation and lifecycle actors ----------

namespace rc = plugins::request_classifier;

// The lifecycle events a classifier was told, as "kind id worker".
struct ClassifierEventLog {
  mutable std::mutex mutex;
  std::vector<std::string> events;
  /// "<event> <request id> <context tokens>": each event with its request's progress then.
  std::vector<std::string> progress;
  /// The fleet loads the classifier was told, in order.
  std::vector<double> loads;

  std::vector<double> loads_snapshot() const {
    std::lock_guard lock{mutex};
    return loads;
  }

  std::vector<std::string> snapshot() const {
    std::lock_guard lock{mutex};
    return events;
  }
};

// Records every event, then hands it to the classifier under test.
class RecordingClassifier final : public rc::RequestClassifier {
 public:
  RecordingClassifier(std::unique_ptr<rc::RequestClassifier> inner,
                      std::shared_ptr<ClassifierEventLog> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  rc::AdmissionFuture classify(rc::ClassifyRequest request) override {
    // A copy shares the request's progress, as a classifier that tracks its requests keeps them.
    if (const auto id = request.request_id()) kept_.insert_or_assign(std::string{*id}, request);
    return inner_->classify(std::move(request));
  }
  void on_event(const rc::ClassifyEvent& event) override {
    std::visit(
        [this](const auto& e) {
          using E = std::decay_t<decltype(e)>;
          const char* kind = std::is_same_v<E, rc::Sent>         ? "sent"
                             : std::is_same_v<E, rc::Responding> ? "responding"
                             : std::is_same_v<E, rc::Completed>  ? "completed"
                                                                 : "aborted";
          std::string worker;
          if constexpr (std::is_same_v<E, rc::Aborted>) {
            worker = e.worker ? std::to_string(e.worker->worker_id) : "-";
          } else {
            worker = std::to_string(e.worker.worker_id);
          }
          std::lock_guard lock{log_->mutex};
          log_->events.push_back(fmt::format("{} {} {}", kind, e.request_id, worker));
          if (const auto kept = kept_.find(e.request_id); kept != kept_.end()) {
            log_->progress.push_back(fmt::format("{} {} {}", kind, e.request_id,
                                                 kept->second.progress().context_tokens()));
          }
        },
        event);
    inner_->on_event(event);
  }
  void on_fleet_load(const rc::FleetLoad& load) override {
    {
      std::lock_guard lock{log_->mutex};
      log_->loads.push_back(load.kv_usage);
    }
    inner_->on_fleet_load(load);
  }

 private:
  std::unique_ptr<rc::RequestClassifier> inner_;
  std::shared_ptr<ClassifierEventLog> log_;
  std::map<std::string, rc::ClassifyRequest> kept_;
};

// Rejects every request as overloaded, naming why.
class RejectingClassifier final : public rc::RequestClassifier {
 public:
  rc::AdmissionFuture classify(rc::ClassifyRequest) override {
    return rc::AdmissionFuture::rejected(rc::ClassifierError::overloaded("the fleet is full"));
  }
};

// Names a worker for each request, every rank of it: the worker id after the request id's last
// '-' ("r3-12" → worker 12).
class TargetingClassifier final : public rc::RequestClassifier {
 public:
  rc::AdmissionFuture classify(rc::ClassifyRequest request) override {
    const std::string_view id = request.request_id().value_or("");
    request.set_worker_selection_target(
        static_cast<WorkerId>(std::stoull(std::string{id.substr(id.rfind('-') + 1)})));
    return rc::AdmissionFuture::ready(std::move(request));
  }
};

// Never admits: defers every request, keeping a Waker it never fires.
class NeverAdmittingClassifier final : public rc::RequestClassifier {
 public:
  rc::AdmissionFuture classify(rc::ClassifyRequest) override {
    return rc::AdmissionFuture::deferred([this](rc::PollContext& context) {
      wakers_.push_back(context.waker());
      return rc::Poll::pending();
    });
  }

 private:
  std::vector<rc::Waker> wakers_;
};

class ClassifierActorsTest : public RouterActorsTest {
 protected:
  ~ClassifierActorsTest() override {
    for (const caf::actor& actor : {caf::actor_cast<caf::actor>(classifier_),
                                    caf::actor_cast<caf::actor>(admitted_reservation_),
                                    caf::actor_cast<caf::actor>(admitted_lifecycle_)}) {
      if (actor) caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
    }
    scheduler_.run();
  }

  // A classifier actor with its own reservation and lifecycle actors, wired as the node does.
  // With `feed_fleet_load`, the fixture's discovery is replaced by one whose selectors tell the
  // classifier actor their KV usage, as the node wires them.
  void start(std::function<std::unique_ptr<rc::RequestClassifier>()> make_inner,
             const std::function<void(ClassifierActorConfig&)>& adjust = {},
             bool feed_fleet_load = false) {
    ClassifierActorConfig settings;
    auto log = events_;
    settings.factory = [make_inner, log](const rc::RequestClassifierContext&) {
      return std::make_unique<RecordingClassifier>(make_inner(), log);
    };
    settings.publisher = publisher_;
    settings.metrics = metrics_;
    settings.clock = clock_;
    if (adjust) adjust(settings);
    classifier_ = system_.spawn(classifier_behavior, std::move(settings));
    if (feed_fleet_load) {
      send_exit(discovery_);
      SelectorActorConfig selector = selector_config(metrics_);
      selector.classifier = classifier_;
      discovery_ = own(system_.spawn(discovery_behavior, DiscoveryActorConfig{selector, {}}));
    }
    ReservationActorConfig reservation = reservation_config(discovery_, metrics_);
    reservation.classifier = classifier_;
    admitted_reservation_ = own(system_.spawn(reservation_behavior, std::move(reservation)));
    LifecycleActorConfig lifecycle = lifecycle_config("admitted.streams", 60s);
    lifecycle.classifier = classifier_;
    admitted_lifecycle_ = own(system_.spawn(lifecycle_behavior, std::move(lifecycle)));
    send(classifier_, targets_atom::value, admitted_reservation_, admitted_lifecycle_);
  }

  static std::unique_ptr<rc::RequestClassifier> max_in_flight(std::uint32_t limit) {
    return std::make_unique<classifiers::builtin::MaxInFlightClassifier>(
        classifiers::builtin::MaxInFlightParameters{.max_in_flight = limit});
  }

  v1::RouteDecision decision_on(const std::string& subject) const {
    v1::RouteDecision decision;
    const auto published = publisher_->published_on(subject);
    EXPECT_EQ(published.size(), 1U) << subject;
    if (!published.empty()) {
      EXPECT_TRUE(decision.ParseFromString(published.front()));
    }
    return decision;
  }

  std::shared_ptr<ClassifierEventLog> events_ = std::make_shared<ClassifierEventLog>();
  classifier_actor classifier_;
  reservation_actor admitted_reservation_;
  lifecycle_actor admitted_lifecycle_;
};

TEST_F(ClassifierActorsTest, ARejectedRouteRequestGetsAnExplicitErrorWithTheReason) {
  register_workers({11});
  start([] { return std::make_unique<RejectingClassifier>(); });
  const v1::RouteDecision decision = route_via(classifier_, request("r1"));
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.request_id(), "r1");
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_OVERLOADED);
  EXPECT_EQ(decision.error().message(), "the fleet is full");
  EXPECT_EQ(bookings(), 0);  // never reached the selector
  EXPECT_EQ(metrics_->value("kvr_route_errors_total", {{"code", "overloaded"}}), 1);

  // Over NATS, the decision goes to the reply subject; a generate request's stream also ends.
  send(classifier_, route_atom::value, RouteEnvelope{request("r2"), "reply.r2", clock_->now()});
  GenerateRequestData generate = generate_request("g1", "client.stream");
  send(classifier_, generate_atom::value,
       GenerateEnvelope{generate, "client.reply", clock_->now()});
  EXPECT_EQ(decision_on("reply.r2").error().code(), v1::ROUTE_ERROR_OVERLOADED);
  EXPECT_EQ(decision_on("client.reply").error().code(), v1::ROUTE_ERROR_OVERLOADED);
  ASSERT_EQ(publisher_->published_on("client.stream").size(), 1U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("client.stream")[0]));
  EXPECT_TRUE(end.finished());
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_OVERLOADED);
  EXPECT_TRUE(publisher_->published_on("gen.11").empty());
}

// Classifiers decide aggregated and decode admission only: prefill and encode requests pass the
// classifier actor untouched, and it is told none of their lifecycle events.
TEST_F(ClassifierActorsTest, PrefillAndEncodeRequestsSkipTheClassifier) {
  for (const auto& [id, role] :
       {std::pair{WorkerId{21}, WorkerType::Prefill}, std::pair{WorkerId{22}, WorkerType::Encode},
        std::pair{WorkerId{23}, WorkerType::Decode}}) {
    discovery::WorkerRegistration worker = registration(id);
    worker.role = role;
    send(discovery_, worker_up_atom::value, worker);
  }
  start([] { return std::make_unique<RejectingClassifier>(); });
  for (const auto role : {WorkerType::Prefill, WorkerType::Encode}) {
    RouteRequest hop = request(std::string{as_str(role)});
    hop.worker_type = role;
    const v1::RouteDecision decision = route_via(classifier_, hop);
    ASSERT_TRUE(decision.has_success()) << as_str(role) << ": " << decision.error().message();
  }
  // Decode (and aggregated) admission runs the classifier, which refuses.
  RouteRequest decode = request("decode");
  decode.worker_type = WorkerType::Decode;
  const v1::RouteDecision refused = route_via(classifier_, decode);
  ASSERT_TRUE(refused.has_error());
  EXPECT_EQ(refused.error().message(), "the fleet is full");
  EXPECT_TRUE(events_->snapshot().empty());
}

// A query-only request is answered with the decision a route would get and holds nothing: the
// classifier is not asked (nor told of it), no booking opens, and it counts as a query, not a
// decision.
TEST_F(ClassifierActorsTest, AQueryOnlyRequestSkipsAdmissionAndBooksNothing) {
  register_workers({11});
  start([] { return std::make_unique<RejectingClassifier>(); });
  RouteRequest query = request("probe");
  query.query_only = true;
  const v1::RouteDecision decision = route_via(classifier_, query);
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  EXPECT_EQ(decision.request_id(), "probe");
  EXPECT_EQ(decision.success().worker_id(), 11U);
  EXPECT_TRUE(decision.success().booking_id().empty());
  EXPECT_EQ(decision.success().booking_ttl_ms(), 0U);
  EXPECT_FALSE(decision.success().costs().empty());
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(metrics_->value("kvr_route_queries_total"), 1);
  EXPECT_EQ(metrics_->total("kvr_route_decisions_total"), 0);
  EXPECT_TRUE(events_->snapshot().empty());

  // The same request without the flag meets the classifier, which refuses it.
  const v1::RouteDecision refused = route_via(classifier_, request("probe"));
  ASSERT_TRUE(refused.has_error());
  EXPECT_EQ(refused.error().message(), "the fleet is full");
}

// A classifier factory that returns nothing fails its model's requests with an explicit
// POLICY_FAILED naming the cause, counted once (it is not retried per request); the classifier
// actor keeps serving.
TEST_F(ClassifierActorsTest, AClassifierFactoryReturningNothingRefusesItsModelsRequests) {
  register_workers({11});
  start({}, [](ClassifierActorConfig& settings) {
    settings.factory =
        [](const rc::RequestClassifierContext&) -> std::unique_ptr<rc::RequestClassifier> {
      return nullptr;
    };
  });
  for (const char* id : {"r1", "r2"}) {
    const v1::RouteDecision decision = route_via(classifier_, request(id));
    ASSERT_TRUE(decision.has_error()) << id;
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_POLICY_FAILED);
    EXPECT_NE(decision.error().message().find("returned no classifier"), std::string::npos)
        << decision.error().message();
  }
  EXPECT_EQ(metrics_->value("kvr_classifier_faults_total", {{"model", "m"}, {"stage", "build"}}),
            1);
  EXPECT_EQ(bookings(), 0);
}

TEST_F(ClassifierActorsTest, AClassifierFactoryThatThrowsRefusesItsModelsRequests) {
  register_workers({11});
  start({}, [](ClassifierActorConfig& settings) {
    settings.factory =
        [](const rc::RequestClassifierContext&) -> std::unique_ptr<rc::RequestClassifier> {
      throw std::runtime_error("no admission budget configured");
    };
  });
  const v1::RouteDecision decision = route_via(classifier_, request("r1"));
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_POLICY_FAILED);
  EXPECT_NE(decision.error().message().find("no admission budget configured"), std::string::npos)
      << decision.error().message();
  EXPECT_EQ(metrics_->value("kvr_classifier_faults_total", {{"model", "m"}, {"stage", "build"}}),
            1);
}

// The classifier actor builds a model's classifier when the model's first selector describes its
// partition: a factory that throws is counted and logged once then, before any request, and the
// model's requests are refused naming the cause without running the factory again.
TEST_F(ClassifierActorsTest, AThrowingClassifierFactoryIsCountedOnceWhenItsPartitionIsCreated) {
  auto calls = std::make_shared<int>(0);
  start(
      {},
      [calls](ClassifierActorConfig& settings) {
        settings.factory =
            [calls](const rc::RequestClassifierContext&) -> std::unique_ptr<rc::RequestClassifier> {
          ++*calls;
          throw std::runtime_error("no admission budget configured");
        };
      },
      /*feed_fleet_load=*/true);
  const metrics::Labels build{{"model", "m"}, {"stage", "build"}};
  EXPECT_EQ(*calls, 0) << "no partition yet";
  register_workers({11});
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(metrics_->value("kvr_classifier_faults_total", build), 1);

  for (const char* id : {"r1", "r2"}) {
    const v1::RouteDecision decision = route_via(classifier_, request(id));
    ASSERT_TRUE(decision.has_error()) << id;
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_POLICY_FAILED);
    EXPECT_NE(decision.error().message().find("no admission budget configured"), std::string::npos)
        << decision.error().message();
  }
  EXPECT_EQ(*calls, 1);
  EXPECT_EQ(metrics_->value("kvr_classifier_faults_total", build), 1);
}

// A classifier whose on_event throws loses that event, counted; requests are still served.
TEST_F(ClassifierActorsTest, AnEventHookThatThrowsIsCountedAndServingGoesOn) {
  struct ThrowingOnEvents final : rc::RequestClassifier {
    void on_event(const rc::ClassifyEvent&) override {
      throw std::runtime_error("bad bookkeeping");
    }
  };
  register_workers({11});
  start([] { return std::make_unique<ThrowingOnEvents>(); });
  for (const char* id : {"r1", "r2"}) {
    const v1::RouteDecision decision = route_via(classifier_, request(id));
    ASSERT_TRUE(decision.has_success()) << decision.error().message();
  }
  // Each admitted request's Sent event reached the hook, which threw.
  EXPECT_EQ(metrics_->value("kvr_classifier_faults_total", {{"model", "m"}, {"stage", "event"}}),
            2);
}

TEST_F(ClassifierActorsTest, MaxInFlightOneAnswersTheSecondRouteOnlyAfterTheFirstCompletes) {
  register_workers({11, 12});
  start([] { return max_in_flight(1); });
  // Both in the classifier's mailbox before it runs: it sees r1 first, and defers r2 at once.
  caf::anon_send(classifier_, route_atom::value,
                 RouteEnvelope{request("r1"), "reply.r1", clock_->now()});
  caf::anon_send(classifier_, route_atom::value,
                 RouteEnvelope{request("r2"), "reply.r2", clock_->now()});
  scheduler_.run();
  // r1's decision was written and its Sent reached the classifier.
  const v1::RouteDecision first = decision_on("reply.r1");
  ASSERT_TRUE(first.has_success()) << first.error().message();
  EXPECT_EQ(events_->snapshot(),
            std::vector<std::string>{fmt::format("sent r1 {}", first.success().worker_id())});
  // Sent frees nothing: r2 is still waiting.
  EXPECT_TRUE(publisher_->published_on("reply.r2").empty());
  EXPECT_EQ(bookings(), 1);

  // The client's reports say the request's context: 9 tokens at its first, 40 at its end.
  EXPECT_TRUE(report_via(admitted_reservation_, first.success().booking_id(),
                         LifecycleEventKind::FirstToken, {}, AbortCause::unspecified, 9)
                  .accepted());
  EXPECT_EQ(events_->snapshot().size(), 2U);
  EXPECT_TRUE(publisher_->published_on("reply.r2").empty());  // nor does the first token
  EXPECT_TRUE(report_via(admitted_reservation_, first.success().booking_id(),
                         LifecycleEventKind::Completed, {}, AbortCause::unspecified, 40)
                  .accepted());
  const v1::RouteDecision second = decision_on("reply.r2");
  ASSERT_TRUE(second.has_success()) << second.error().message();
  EXPECT_EQ(second.request_id(), "r2");
  const auto worker = first.success().worker_id();
  EXPECT_EQ(events_->snapshot(),
            (std::vector<std::string>{fmt::format("sent r1 {}", worker),
                                      fmt::format("responding r1 {}", worker),
                                      fmt::format("completed r1 {}", worker),
                                      fmt::format("sent r2 {}", second.success().worker_id())}));
  std::lock_guard lock{events_->mutex};
  EXPECT_EQ(events_->progress, (std::vector<std::string>{"sent r1 8", "responding r1 9",
                                                         "completed r1 40", "sent r2 8"}));
}

TEST_F(ClassifierActorsTest, GenerateWithARetryTellsTheClassifierTwoSentsInOrder) {
  register_workers({11, 12});
  start([] { return max_in_flight(2); });
  GenerateRequestData generate = generate_request("g1", "client.stream");
  generate.wire.set_max_output_tokens(2);
  send(classifier_, generate_atom::value,
       GenerateEnvelope{generate, "client.reply", clock_->now()});
  const WorkerId first = publisher_->dispatched_to({11, 12});
  ASSERT_NE(first, 0U);
  const WorkerId second = first == 11 ? 12 : 11;
  // The worker leaves before its first token: the request is retried on the other one.
  send(discovery_, worker_down_atom::value, WorkerLiveness{first, 1});
  ASSERT_EQ(publisher_->published_on("gen." + std::to_string(second)).size(), 1U);
  v1::GenerateChunk chunk;
  chunk.set_request_id("g1");
  chunk.set_worker_id(second);
  chunk.add_token_ids(7);
  send(admitted_lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  chunk.set_index(1);
  chunk.set_finished(true);
  chunk.set_finish_reason("length");
  send(admitted_lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  EXPECT_EQ(events_->snapshot(), (std::vector<std::string>{
                                     fmt::format("sent g1 {}", first),
                                     fmt::format("sent g1 {}", second),
                                     fmt::format("responding g1 {}", second),
                                     fmt::format("completed g1 {}", second),
                                 }));
  EXPECT_EQ(publisher_->published_on("client.stream").size(), 2U);
  // The request's progress, shared by its retry: its 8 prompt tokens, then one per chunk, raised
  // before the classifier hears of the chunk.
  std::lock_guard lock{events_->mutex};
  EXPECT_EQ(events_->progress, (std::vector<std::string>{"sent g1 8", "sent g1 8",
                                                         "responding g1 9", "completed g1 10"}));
}

TEST_F(ClassifierActorsTest, CancellingADeferredGenerateEndsItsStreamAndFreesNothing) {
  register_workers({11});
  start([] { return max_in_flight(1); });
  GenerateRequestData generate = generate_request("g1", "g1.stream");
  caf::anon_send(classifier_, generate_atom::value,
                 GenerateEnvelope{generate, "g1.reply", clock_->now()});
  generate.route = request("g2");
  generate.stream_subject = "g2.stream";
  generate.wire.mutable_route()->set_request_id("g2");
  caf::anon_send(classifier_, generate_atom::value,
                 GenerateEnvelope{generate, "g2.reply", clock_->now()});
  caf::anon_send(classifier_, cancel_atom::value, std::string{"g2"});
  scheduler_.run();
  ASSERT_EQ(publisher_->published_on("g2.stream").size(), 1U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("g2.stream")[0]));
  EXPECT_TRUE(end.finished());
  EXPECT_EQ(end.finish_reason(), "cancelled");
  // g1 is still served, g2 never reached a worker.
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 1U);
  v1::GenerateRequest dispatched;
  ASSERT_TRUE(dispatched.ParseFromString(publisher_->published_on("gen.11")[0]));
  EXPECT_EQ(dispatched.route().request_id(), "g1");
}

// A request the classifier never admits is refused with a timeout once it has waited max_wait on
// the classifier's clock; its future is dropped and it never reaches a worker.
TEST_F(ClassifierActorsTest, ARequestWaitingPastTheWaitLimitGetsATimeout) {
  register_workers({11});
  auto clock = std::make_shared<ManualClock>();
  start([] { return std::make_unique<NeverAdmittingClassifier>(); },
        [clock](ClassifierActorConfig& settings) {
          settings.clock = clock;
          settings.max_wait = 200ms;
        });
  Answers& answers = new_answers();
  auto client = own(system_.spawn(decision_recorder, &answers));
  // Sent as the client (its decision comes back to it), not as a request.
  caf::send_as(client, classifier_, route_atom::value,
               RouteEnvelope{request("r1"), {}, clock->now()});
  GenerateRequestData generate = generate_request("g1", "g1.stream");
  // Anonymous, so that its decision goes only to the reply subject.
  caf::anon_send(classifier_, generate_atom::value,
                 GenerateEnvelope{generate, "g1.reply", clock->now()});
  scheduler_.run();  // both arrived (and wait) before the clock moves
  // Just before the limit both still wait.
  clock->advance(199ms);
  send(classifier_, wake_atom::value);
  EXPECT_TRUE(answers.decisions.empty());
  EXPECT_TRUE(publisher_->published_on("g1.reply").empty());
  clock->advance(1ms);
  send(classifier_, wake_atom::value);
  ASSERT_EQ(answers.decisions.size(), 1U);
  const v1::RouteDecision& decision = answers.decisions[0];
  ASSERT_TRUE(decision.has_error());
  EXPECT_EQ(decision.request_id(), "r1");
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_NE(decision.error().message().find("waited for admission"), std::string::npos)
      << decision.error().message();
  // The generate client gets the same decision and the error end of its stream.
  EXPECT_EQ(decision_on("g1.reply").error().code(), v1::ROUTE_ERROR_TIMEOUT);
  ASSERT_EQ(publisher_->published_on("g1.stream").size(), 1U);
  v1::GenerateChunk end;
  ASSERT_TRUE(end.ParseFromString(publisher_->published_on("g1.stream")[0]));
  EXPECT_TRUE(end.finished());
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_EQ(metrics_->value("kvr_route_errors_total", {{"code", "timeout"}}), 2);
  // Dropped, not admitted: nothing was booked or sent, and the classifier was told nothing.
  send(classifier_, wake_atom::value);
  EXPECT_EQ(answers.decisions.size(), 1U);
  EXPECT_EQ(bookings(), 0);
  EXPECT_TRUE(publisher_->published_on("gen.11").empty());
  EXPECT_TRUE(events_->snapshot().empty());
}

// The selectors feed the classifier the fleet's KV usage from load reports: kv-capacity-pause
// defers a new session while usage is above pause_above and admits it once usage falls.
TEST_F(ClassifierActorsTest, LoadReportsPauseAndResumeNewSessionsWithKvCapacityPause) {
  start(
      [] {
        return std::make_unique<classifiers::builtin::KvCapacityPauseClassifier>(
            classifiers::builtin::KvCapacityPauseParameters{.pause_above = 0.5,
                                                            .resume_below = 0.3});
      },
      {}, true);
  register_workers({11});  // 100 KV blocks
  const auto report = [&](std::uint64_t used) {
    send(discovery_, load_atom::value,
         WorkerLoadReport{11, 1, {{0, discovery::ConfirmedLoad{.kv_blocks_used = used}}}});
  };
  const auto turn = [](std::string id, std::string session) {
    RouteRequest route = request(std::move(id));
    route.selection.session = SessionContext{std::move(session), std::nullopt, false, std::nullopt};
    return route;
  };
  // A running session, admitted before the fleet fills.
  ASSERT_TRUE(route_via(classifier_, turn("s1", "running")).has_success());
  report(90);
  ASSERT_FALSE(events_->loads_snapshot().empty());
  EXPECT_NEAR(events_->loads_snapshot().back(), 0.9, 0.011);  // 90 of 100 (+ s1's booking)
  // A new session is deferred; a turn of the running one, sent after it, is admitted and routed.
  Answers& waiting = new_answers();
  auto client = own(system_.spawn(decision_recorder, &waiting));
  caf::send_as(client, classifier_, route_atom::value,
               RouteEnvelope{turn("new1", "new"), {}, clock_->now()});
  ASSERT_TRUE(route_via(classifier_, turn("s2", "running")).has_success());
  EXPECT_TRUE(waiting.decisions.empty()) << "the new session was admitted during the pause";
  // Usage falls below resume_below: the new session is admitted and routed.
  report(10);
  ASSERT_EQ(waiting.decisions.size(), 1U) << "the new session was never admitted";
  EXPECT_EQ(waiting.decisions[0].request_id(), "new1");
  EXPECT_TRUE(waiting.decisions[0].has_success()) << waiting.decisions[0].error().message();
  EXPECT_LT(events_->loads_snapshot().back(), 0.3);
}

// A worker that registered no KV capacity is left out of the fleet's usage: kv-capacity-pause
// pauses on the usage of the workers with one, whatever the other reports.
TEST_F(ClassifierActorsTest, KvCapacityPauseLeavesAWorkerWithoutCapacityOutOfTheFleetsUsage) {
  start(
      [] {
        return std::make_unique<classifiers::builtin::KvCapacityPauseClassifier>(
            classifiers::builtin::KvCapacityPauseParameters{.pause_above = 0.5,
                                                            .resume_below = 0.3});
      },
      {}, true);
  register_workers({11});  // 100 KV blocks
  discovery::WorkerRegistration unknown = registration(12);
  unknown.total_kv_blocks.reset();
  send(discovery_, worker_up_atom::value, unknown);
  ASSERT_EQ(metrics_->value("kvr_workers", {{"partition", "m/default"}}), 2);
  const auto report = [&](WorkerId worker, std::uint64_t used) {
    send(discovery_, load_atom::value,
         WorkerLoadReport{worker, 1, {{0, discovery::ConfirmedLoad{.kv_blocks_used = used}}}});
  };
  const auto turn = [](std::string id, std::string session) {
    RouteRequest route = request(std::move(id));
    route.selection.session = SessionContext{std::move(session), std::nullopt, false, std::nullopt};
    return route;
  };
  report(12, 100'000);  // nothing a capacity of its own could hold: read as no usage at all
  report(11, 40);
  ASSERT_FALSE(events_->loads_snapshot().empty());
  EXPECT_NEAR(events_->loads_snapshot().back(), 0.4, 1e-9) << "40 of worker 11's 100 blocks";
  ASSERT_TRUE(route_via(classifier_, turn("s1", "first")).has_success());
  report(11, 60);
  EXPECT_NEAR(events_->loads_snapshot().back(), 0.6, 0.011);  // 60 (+ s1's booking) of 100
  Answers& waiting = new_answers();
  auto client = own(system_.spawn(decision_recorder, &waiting));
  caf::send_as(client, classifier_, route_atom::value,
               RouteEnvelope{turn("new1", "new"), {}, clock_->now()});
  EXPECT_TRUE(waiting.decisions.empty()) << "a new session was admitted above pause_above";
}

// With no worker that registered a capacity there is no fleet usage: kv-capacity-pause never
// pauses, however full the workers say they are.
TEST_F(ClassifierActorsTest, KvCapacityPauseNeverPausesAFleetWithoutCapacities) {
  start(
      [] {
        return std::make_unique<classifiers::builtin::KvCapacityPauseClassifier>(
            classifiers::builtin::KvCapacityPauseParameters{.pause_above = 0.5,
                                                            .resume_below = 0.3});
      },
      {}, true);
  discovery::WorkerRegistration unknown = registration(12);
  unknown.total_kv_blocks.reset();
  send(discovery_, worker_up_atom::value, unknown);
  ASSERT_EQ(metrics_->value("kvr_workers", {{"partition", "m/default"}}), 1);
  send(discovery_, load_atom::value,
       WorkerLoadReport{12, 1, {{0, discovery::ConfirmedLoad{.kv_blocks_used = 100'000}}}});
  EXPECT_TRUE(events_->loads_snapshot().empty()) << "a fleet load without a capacity";
  for (int i = 0; i < 3; ++i) {
    RouteRequest route = request("new" + std::to_string(i));
    route.selection.session =
        SessionContext{"session" + std::to_string(i), std::nullopt, false, std::nullopt};
    const v1::RouteDecision decision = route_via(classifier_, std::move(route));
    EXPECT_TRUE(decision.has_success()) << decision.error().message();
  }
}

// Through the node's actors, a classifier's target reaches the partition's policy as the
// selection's affinity_target: soft-affinity-load-guard serves each request on the worker its
// classifier named, which kv-cost alone would not.
TEST_F(ClassifierActorsTest, APolicyReceivesTheTargetItsClassifierSet) {
  selection::RouterPolicyConfig config;
  config.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] =
      std::string{selection::policies::kSoftAffinityLoadGuardPolicyType};
  plugins::RouterPluginRegistry registry;
  ASSERT_TRUE(selection::register_builtin_policies(registry));
  auto resolved = registry.resolve_plugins(config);
  ASSERT_TRUE(resolved) << resolved.error().message();
  plugins_ = std::move(*resolved);  // before the first registration creates the selector
  register_workers({11, 12});
  start([] { return std::make_unique<TargetingClassifier>(); });
  for (int i = 0; i < 6; ++i) {
    const WorkerId target = i % 3 == 0 ? 11 : 12;
    const v1::RouteDecision decision =
        route_via(classifier_, request(fmt::format("r{}-{}", i, target)));
    ASSERT_TRUE(decision.has_success()) << decision.error().message();
    EXPECT_EQ(decision.success().worker_id(), target) << "request " << i;
    EXPECT_TRUE(report_via(admitted_reservation_, decision.success().booking_id(),
                           LifecycleEventKind::Completed)
                    .accepted());
  }
}

// The selectors describe their partitions to the classifier actor: a model's classifier is created
// when its first partition is, with the block size and the worker ranks its selectors know by then
// (the configured block size, no worker yet), and the context it may keep follows the fleet
// afterwards.
TEST_F(ClassifierActorsTest, AModelsClassifierContextFollowsTheFleetItsSelectorsDescribe) {
  auto contexts = std::make_shared<std::vector<std::pair<std::size_t, std::size_t>>>();
  auto kept = std::make_shared<const rc::RequestClassifierContext*>(nullptr);
  start([] { return max_in_flight(8); },
        [contexts, kept](ClassifierActorConfig& settings) {
          settings.factory = [contexts, kept, inner = settings.factory](
                                 const rc::RequestClassifierContext& context) {
            // (block size, workers)
            contexts->emplace_back(context.block_size(), context.workers().size());
            *kept = &context;
            return inner(context);
          };
        },
        /*feed_fleet_load=*/true);
  register_workers({11, 12});
  ASSERT_EQ(contexts->size(), 1U);
  EXPECT_EQ((*contexts)[0], (std::pair<std::size_t, std::size_t>{4, 0}));
  const rc::RequestClassifierContext& context = **kept;
  EXPECT_EQ(context.workers().size(), 2U) << "two workers joined";
  const v1::RouteDecision decision = route_via(classifier_, request("r1"));
  ASSERT_TRUE(decision.has_success()) << decision.error().message();
  send(discovery_, worker_up_atom::value, registration(13));
  EXPECT_EQ(context.workers().size(), 3U) << "a worker joined";
  send(discovery_, worker_down_atom::value, WorkerLiveness{11, 1});
  ASSERT_EQ(context.workers().size(), 2U) << "a worker left";
  EXPECT_NE(context.workers()[0].worker().worker_id, 11U);
  EXPECT_NE(context.workers()[1].worker().worker_id, 11U);
  EXPECT_EQ(context.block_size(), 4U);
  EXPECT_EQ(contexts->size(), 1U) << "the classifier is not built again";
}

// Actor clients through an ingress wired to the classifier, as the node wires it: a client that
// terminates while its request waits for admission drops it (the next request is not queued
// behind it), and the admitted request's stream is served as usual.
TEST_F(ClassifierActorsTest, ATerminatedActorClientDropsItsWaitingRequest) {
  register_workers({11});
  start([] { return max_in_flight(1); });
  IngressActorConfig settings;
  settings.metrics = metrics_;
  settings.clock = clock_;
  settings.entry = RequestEntry::local(classifier_, admitted_reservation_, admitted_lifecycle_);
  auto ingress = own(system_.spawn(ingress_behavior, std::move(settings)));
  Answers& answers = new_answers();
  const caf::actor client = spawn_client(answers, ingress);
  const v1::RouteDecision first = generate(client, answers, actor_generate_request("ag1"));
  ASSERT_TRUE(first.has_success()) << first.error().message();
  Answers& gone_answers = new_answers();
  const caf::actor gone = spawn_client(gone_answers, ingress);
  send(gone, generate_atom::value, GenerateRequestMessage{actor_generate_request("ag2")});
  // ag2 reached the classifier and waits behind ag1 before its client ends.
  ASSERT_EQ(metrics_->value("kvr_generate_requests_total", {{"ingress", "actor"}}), 2);
  EXPECT_TRUE(gone_answers.decisions.empty());
  send_exit(gone);
  v1::GenerateChunk chunk;
  chunk.set_request_id("ag1");
  chunk.set_worker_id(11);
  chunk.add_token_ids(7);
  chunk.set_finished(true);
  chunk.set_finish_reason("length");
  send(admitted_lifecycle_, chunk_atom::value, ChunkEnvelope{1, chunk});
  ASSERT_EQ(answers.chunks.size(), 1U);
  EXPECT_TRUE(answers.chunks[0].finished());
  // ag3 is admitted at once: nothing waits before it any more.
  const v1::RouteDecision third = generate(client, answers, actor_generate_request("ag3"));
  ASSERT_TRUE(third.has_success()) << third.error().message();
  ASSERT_EQ(publisher_->published_on("gen.11").size(), 2U);
  v1::GenerateRequest dispatched;
  ASSERT_TRUE(dispatched.ParseFromString(publisher_->published_on("gen.11")[1]));
  EXPECT_EQ(dispatched.route().request_id(), "ag3");
  const auto events = events_->snapshot();
  EXPECT_EQ(std::count(events.begin(), events.end(), "sent ag2 11"), 0);
  send_exit(ingress);
}

// ---- the admission queue in the selector --------------------------------------------------------

// A discovery actor whose selectors queue (one class `default`, busy above 4 active prefill tokens:
// one 8-token request makes a worker busy) and a reservation actor in front of it, on a manual
// clock.
class QueueActorsTest : public RouterActorsTest {
 protected:
  ~QueueActorsTest() override {
    if (queue_reservation_)
      caf::anon_send_exit(queue_reservation_, caf::exit_reason::user_shutdown);
    if (queue_discovery_) caf::anon_send_exit(queue_discovery_, caf::exit_reason::user_shutdown);
    scheduler_.run();
  }

  void start(classifiers::PolicyClassConfig policy_class,
             std::chrono::milliseconds selector_timeout = 5s) {
    SelectorActorConfig selector = selector_config(metrics_);
    selector.policy_classes = {std::move(policy_class)};
    selector.queue_max_wait = 10s;
    queue_discovery_ = own(system_.spawn(discovery_behavior, DiscoveryActorConfig{selector, {}}));
    ReservationActorConfig reservation = reservation_config(queue_discovery_, metrics_);
    reservation.selector_timeout = selector_timeout;
    queue_reservation_ = own(system_.spawn(reservation_behavior, std::move(reservation)));
    send(queue_discovery_, worker_up_atom::value, registration(11));
    ASSERT_EQ(metrics_->value("kvr_workers", {{"partition", "m/default"}}), 1);
  }

  static classifiers::PolicyClassConfig busy_class() {
    classifiers::PolicyClassConfig config;
    config.name = "default";
    config.prefill_busy_threshold = 4;
    return config;
  }

  // Routes over "NATS": the decision is published on reply.<id>.
  void send_route(RouteRequest data) {
    const std::string reply = "reply." + data.id();
    send(queue_reservation_, route_atom::value,
         RouteEnvelope{std::move(data), reply, clock_->now()});
  }
  bool answered(const std::string& id) const {
    return publisher_->published_on("reply." + id).size() == 1U;
  }
  double depth() const {
    return metrics_->value("kvr_queue_depth", {{"partition", "m/default"}, {"class", "default"}});
  }
  double queue_outcome(std::string_view outcome) const {
    return metrics_->value(
        "kvr_queue_outcomes_total",
        {{"partition", "m/default"}, {"class", "default"}, {"outcome", std::string{outcome}}});
  }

  discovery_actor queue_discovery_;
  reservation_actor queue_reservation_;
};

TEST_F(QueueActorsTest, AQueuedRouteIsAnsweredWhenTheFirstTokenFreesItsWorker) {
  start(busy_class());
  send_route(request("r1"));
  ASSERT_TRUE(answered("r1"));
  send_route(request("r2"));
  ASSERT_EQ(depth(), 1);
  EXPECT_FALSE(answered("r2"));
  EXPECT_EQ(bookings(), 1);

  const v1::RouteDecision first = [&] {
    v1::RouteDecision decision;
    EXPECT_TRUE(decision.ParseFromString(publisher_->published_on("reply.r1")[0]));
    return decision;
  }();
  ASSERT_TRUE(first.has_success());
  clock_->advance(250ms);
  EXPECT_TRUE(
      report_via(queue_reservation_, first.success().booking_id(), LifecycleEventKind::FirstToken)
          .accepted());
  ASSERT_TRUE(answered("r2"));
  v1::RouteDecision second;
  ASSERT_TRUE(second.ParseFromString(publisher_->published_on("reply.r2")[0]));
  ASSERT_TRUE(second.has_success()) << second.error().message();
  EXPECT_EQ(second.success().worker_id(), 11U);
  EXPECT_EQ(bookings(), 2);
  EXPECT_EQ(depth(), 0);
  EXPECT_EQ(queue_outcome("dispatched"), 1);
  // It waited the 250 ms the clock moved.
  const std::string rendered = metrics_->render();
  EXPECT_NE(rendered.find("kvr_queue_wait_seconds_count{class=\"default\"} 1\n"), std::string::npos)
      << rendered;
  EXPECT_NE(rendered.find("kvr_queue_wait_seconds_sum{class=\"default\"} 0.25\n"),
            std::string::npos)
      << rendered;
}

TEST_F(QueueActorsTest, AClassOverItsLimitRefusesTheNewcomerWithQueueFull) {
  classifiers::PolicyClassConfig limited = busy_class();
  limited.request_queue_limit_per_worker = 1;
  start(limited);
  send_route(request("r1"));
  ASSERT_TRUE(answered("r1"));
  send_route(request("r2"));
  send_route(request("r3"));
  ASSERT_TRUE(answered("r3"));
  v1::RouteDecision refused;
  ASSERT_TRUE(refused.ParseFromString(publisher_->published_on("reply.r3")[0]));
  ASSERT_TRUE(refused.has_error());
  EXPECT_EQ(refused.error().code(), v1::ROUTE_ERROR_OVERLOADED);
  EXPECT_NE(refused.error().message().find("queue_full"), std::string::npos)
      << refused.error().message();
  EXPECT_FALSE(answered("r2"));
  EXPECT_EQ(depth(), 1);
  EXPECT_EQ(queue_outcome("queue_full"), 1);
}

TEST_F(QueueActorsTest, ADueTimeThatPassesWhileQueuedRefusesWithDueTimeExpired) {
  start(busy_class());
  send_route(request("r1"));
  ASSERT_TRUE(answered("r1"));
  RouteRequest due = request("r2");
  due.due_at = clock_->now() + 50ms;
  send_route(std::move(due));
  ASSERT_EQ(depth(), 1);
  clock_->advance(60ms);
  // Any turn of the selector that could dispatch first refuses what is overdue (here a load
  // report that frees nothing); its own wake-up timer does the same at the due time.
  send(queue_discovery_, load_atom::value,
       WorkerLoadReport{11, 1, {{0, discovery::ConfirmedLoad{.active_prefill_tokens = 8}}}});
  ASSERT_TRUE(answered("r2"));
  v1::RouteDecision expired;
  ASSERT_TRUE(expired.ParseFromString(publisher_->published_on("reply.r2")[0]));
  ASSERT_TRUE(expired.has_error());
  EXPECT_EQ(expired.error().code(), v1::ROUTE_ERROR_DUE_TIME_EXPIRED);
  EXPECT_EQ(bookings(), 1);
  EXPECT_EQ(queue_outcome("due_time_expired"), 1);
}

TEST_F(QueueActorsTest, ARouteItsCallerGaveUpOnLeavesTheQueueUnbooked) {
  start(busy_class(), /*selector_timeout=*/100ms);
  send_route(request("r1"));
  ASSERT_TRUE(answered("r1"));
  send_route(request("r2"));
  ASSERT_EQ(depth(), 1);
  // The reservation's deadline passes: it answers timeout and tells the selector.
  clock_->advance(100ms);
  send(queue_reservation_, expire_atom::value);
  ASSERT_TRUE(answered("r2"));
  v1::RouteDecision timed_out;
  ASSERT_TRUE(timed_out.ParseFromString(publisher_->published_on("reply.r2")[0]));
  EXPECT_EQ(timed_out.error().code(), v1::ROUTE_ERROR_TIMEOUT);
  EXPECT_EQ(queue_outcome("cancelled"), 1);
  EXPECT_EQ(depth(), 0);
  // Freed capacity finds nothing to dispatch: r2 is never booked.
  v1::RouteDecision first;
  ASSERT_TRUE(first.ParseFromString(publisher_->published_on("reply.r1")[0]));
  EXPECT_TRUE(
      report_via(queue_reservation_, first.success().booking_id(), LifecycleEventKind::Completed)
          .accepted());
  EXPECT_EQ(bookings(), 0);
  EXPECT_EQ(queue_outcome("dispatched"), 0);
}

}  // namespace
}  // namespace kvr::actors
