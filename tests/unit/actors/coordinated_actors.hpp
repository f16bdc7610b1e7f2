// What the actor unit tests share: an actor system on CAF's deterministic test coordinator (no
// thread runs an actor until the test runs the scheduler; timers fire only when it triggers
// them), the built-in policies, a described metrics registry, and a publisher that records what
// the actors would send on NATS.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "messages/clock.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/metrics/node_metrics.hpp"
#include "messages/metrics/rate_limited_log.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::testing {

/// Publishes nothing; keeps the dumps asked for and counts the re-registration requests.
class RecordingPublisher final : public RouterPublisher {
 public:
  bool publish(std::string_view, std::string_view) override { return true; }
  bool request_dump(std::string_view, WorkerWithDpRank worker) override {
    dumps.push_back(worker);
    return true;
  }
  bool request_reregistration() override {
    ++reregistrations;
    return true;
  }
  std::vector<WorkerWithDpRank> dumps;
  int reregistrations = 0;
};

/// The test coordinator's configuration, with the node's message types (one per process: CAF
/// keeps a pointer to it).
inline caf::actor_system_config& coordinated_config() {
  static caf::actor_system_config* config = [] {
    auto* result = new caf::actor_system_config;
    result->set("scheduler.policy", caf::atom("testing"));
    result->set("logger.file-verbosity", caf::atom("quiet"));
    result->add_message_types<caf::id_block::kvr_actors>();
    return result;
  }();
  return *config;
}

/// A fixture owning the coordinated actor system and the node services its actors share.
class CoordinatedActorsTest : public ::testing::Test {
 protected:
  CoordinatedActorsTest()
      : system_(coordinated_config()),
        scheduler_(dynamic_cast<caf::scheduler::test_coordinator&>(system_.scheduler())) {
    plugins::RouterPluginRegistry registry;
    EXPECT_TRUE(selection::register_builtin_policies(registry));
    auto resolved = registry.resolve_plugins(selection::RouterPolicyConfig{});
    EXPECT_TRUE(resolved);
    plugins_ = std::move(*resolved);
    metrics::NodeMetrics::describe(*metrics_);
  }

  /// The node's services as the fixture fakes them: the recording publisher, the registry, a
  /// log and the manual clock.
  actors::NodeServices services() const {
    return actors::NodeServices{publisher_, metrics_, std::make_shared<metrics::RateLimitedLog>(),
                                clock_};
  }

  caf::actor_system system_;
  caf::scheduler::test_coordinator& scheduler_;
  plugins::RouterPlugins plugins_;
  std::shared_ptr<RecordingPublisher> publisher_ = std::make_shared<RecordingPublisher>();
  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  std::shared_ptr<ManualClock> clock_ = std::make_shared<ManualClock>();
};

}  // namespace kvr::testing
