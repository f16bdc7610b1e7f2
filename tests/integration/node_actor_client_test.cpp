// An actor client of a real `kvr node --actor-port`: connects through CAF's middleman to the
// published ingress actor and exchanges protobuf-carrying messages across processes.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <gtest/gtest.h>

#include "actors/actor_types.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_processes.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::free_port;
using testing::KvrProcesses;
using testing::NatsServer;
using testing::wait_until;

// A real nats-server, one `kvr mocker` worker and a `kvr node --actor-port`, and this process's
// actor system connected to the node's published ingress actor.
class NodeActorClientTest : public ::testing::Test {
 protected:
  ~NodeActorClientTest() override {
    // Drop the proxy before the system shuts down, so that nothing stays pinned to the node.
    ingress_ = caf::sec::cannot_connect_to_node;
    if (node_) node_->stop();
  }

  // Starts the processes (worker `worker_id`; `mocker_options` appended; a second worker
  // `second_worker` with `second_options`, when set) and connects.
  void start(const std::string& ns, WorkerId worker_id,
             const std::vector<std::string>& mocker_options = {},
             std::optional<WorkerId> second_worker = {},
             const std::vector<std::string>& second_options = {}) {
    std::string error;
    server_ = NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
    const KvrProcesses kvr{kvr::testing::kvr_binary(), server_->url(), ns, directory_.path()};
    mocker_ = kvr.start_mocker({.workers = 1,
                                .worker_id_base = worker_id,
                                .block_size = 16,
                                .liveness_ttl_ms = 2000,
                                .extra = mocker_options});
    ASSERT_TRUE(mocker_);
    if (second_worker) {
      second_mocker_ = kvr.start_mocker({.workers = 1,
                                         .worker_id_base = *second_worker,
                                         .block_size = 16,
                                         .liveness_ttl_ms = 2000,
                                         .extra = second_options},
                                        "mocker-second.log");
      ASSERT_TRUE(second_mocker_);
    }
    const std::uint16_t actor_port = free_port();
    node_ = kvr.start_node({.block_size = 16, .actor_port = actor_port});
    ASSERT_TRUE(node_);
    config_.set("scheduler.max-threads", 2);
    config_.load<caf::io::middleman>();
    config_.add_message_types<caf::id_block::kvr_actors>();
    system_.emplace(config_);
    ASSERT_TRUE(wait_until(
        [&] {
          ingress_ =
              system_->middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port);
          return static_cast<bool>(ingress_);
        },
        20s))
        << node_->log();
  }

  testing::TemporaryDirectory directory_;
  std::unique_ptr<NatsServer> server_;
  std::optional<ChildProcess> mocker_;
  std::optional<ChildProcess> second_mocker_;
  std::optional<ChildProcess> node_;
  caf::actor_system_config config_;
  std::optional<caf::actor_system> system_;
  caf::expected<actors::ingress_actor> ingress_{caf::sec::cannot_connect_to_node};
};

TEST_F(NodeActorClientTest, PublishedIngressRoutesAndAcceptsReports) {
  ASSERT_NO_FATAL_FAILURE(start("actors", 300));
  caf::actor_system& system = *system_;
  auto& ingress = ingress_;
  auto& node = node_;

  v1::RouteRequest request;
  request.set_model("mock-model");
  for (std::uint32_t token = 0; token < 40; ++token) request.mutable_tokens()->add_ids(token);
  v1::RouteDecision decision;
  int attempt = 0;
  {
    caf::scoped_actor self{system};
    // The worker may not have registered yet: ask until a decision names it.
    ASSERT_TRUE(wait_until(
        [&] {
          request.set_request_id("actor-" + std::to_string(++attempt));
          self->request(*ingress, 2s, actors::route_atom::value,
                        actors::RouteRequestMessage{request})
              .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                       [&](caf::error&) { decision.Clear(); });
          return decision.has_success();
        },
        20s))
        << node->log();
    EXPECT_EQ(decision.success().worker_id(), 300U);
    EXPECT_EQ(decision.request_id(), request.request_id());

    v1::LifecycleReport report;
    report.set_booking_id(decision.success().booking_id());
    report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
    v1::LifecycleAck ack;
    self->request(*ingress, 2s, actors::report_atom::value, actors::LifecycleReportMessage{report})
        .receive([&](actors::LifecycleAckMessage& reply) { ack = reply.value; },
                 [&](caf::error& failure) { ADD_FAILURE() << system.render(failure); });
    EXPECT_TRUE(ack.accepted()) << ack.message();

    request.clear_prompt();
    self->request(*ingress, 2s, actors::route_atom::value, actors::RouteRequestMessage{request})
        .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                 [&](caf::error& failure) { ADD_FAILURE() << system.render(failure); });
    ASSERT_TRUE(decision.has_error());
    EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  }
}

TEST_F(NodeActorClientTest, PublishedIngressServesGenerateWithAStreamToTheClientActor) {
  ASSERT_NO_FATAL_FAILURE(start("actorgen", 310, {"--time-scale", "20"}));
  caf::actor_system& system = *system_;
  auto& ingress = ingress_;
  auto& node = node_;

  v1::GenerateRequest request;
  request.mutable_route()->set_model("mock-model");
  for (std::uint32_t token = 0; token < 40; ++token) {
    request.mutable_route()->mutable_tokens()->add_ids(token);
  }
  request.set_max_output_tokens(5);
  {
    caf::scoped_actor self{system};
    v1::RouteDecision decision;
    int attempt = 0;
    // The worker may not have registered yet: ask until a decision names it.
    ASSERT_TRUE(wait_until(
        [&] {
          request.mutable_route()->set_request_id("actor-gen-" + std::to_string(++attempt));
          self->request(*ingress, 5s, actors::generate_atom::value,
                        actors::GenerateRequestMessage{request})
              .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                       [&](caf::error&) { decision.Clear(); });
          if (!decision.has_success()) {
            // A refused request still ends its stream: drain that end chunk.
            self->receive([](actors::chunk_atom, actors::GenerateChunkMessage&) {},
                          caf::after(1s) >> [] {});
          }
          return decision.has_success();
        },
        20s))
        << node->log();
    EXPECT_EQ(decision.success().worker_id(), 310U);

    // The stream: every generated token in order, the last chunk finished with "length".
    std::vector<std::uint32_t> tokens;
    bool finished = false;
    std::string finish_reason;
    std::uint32_t next_index = 0;
    while (!finished) {
      bool received = false;
      self->receive(
          [&](actors::chunk_atom, actors::GenerateChunkMessage& chunk) {
            received = true;
            EXPECT_EQ(chunk.value.request_id(), request.route().request_id());
            EXPECT_EQ(chunk.value.index(), next_index++);
            tokens.insert(tokens.end(), chunk.value.token_ids().begin(),
                          chunk.value.token_ids().end());
            finished = chunk.value.finished();
            finish_reason = chunk.value.finish_reason();
          },
          caf::after(10s) >> [] {});
      ASSERT_TRUE(received) << "no chunk within 10 s\n" << node->log();
    }
    EXPECT_EQ(tokens.size(), 5U);
    EXPECT_EQ(finish_reason, "length");
  }
}

// A model of one prefill and one decode worker: the actor client's generate request takes both
// hops in the node, and its stream is the decode worker's whole generation.
TEST_F(NodeActorClientTest, AnActorClientsGenerateRequestTakesThePrefillAndTheDecodeHop) {
  ASSERT_NO_FATAL_FAILURE(start("actorpd", 320, {"--time-scale", "20", "--role", "prefill"}, 321,
                                {"--time-scale", "20", "--role", "decode"}));
  caf::actor_system& system = *system_;
  auto& ingress = ingress_;
  auto& node = node_;

  v1::GenerateRequest request;
  request.mutable_route()->set_model("mock-model");
  for (std::uint32_t token = 0; token < 64; ++token) {
    request.mutable_route()->mutable_tokens()->add_ids(token);
  }
  request.set_max_output_tokens(5);
  caf::scoped_actor self{system};
  v1::RouteDecision decision;
  int attempt = 0;
  // Both workers must have registered: until then a request is served alone or refused, so the
  // test asks until the decision names the prefill worker (the first hop).
  std::vector<v1::GenerateChunk> chunks;
  ASSERT_TRUE(wait_until(
      [&] {
        request.mutable_route()->set_request_id("actor-pd-" + std::to_string(++attempt));
        self->request(*ingress, 5s, actors::generate_atom::value,
                      actors::GenerateRequestMessage{request})
            .receive([&](actors::RouteDecisionMessage& reply) { decision = reply.value; },
                     [&](caf::error&) { decision.Clear(); });
        // Whatever the decision, the stream ends: read it whole.
        chunks.clear();
        for (bool finished = false; !finished;) {
          bool received = false;
          self->receive(
              [&](actors::chunk_atom, actors::GenerateChunkMessage& chunk) {
                received = true;
                finished = chunk.value.finished();
                chunks.push_back(chunk.value);
              },
              caf::after(10s) >> [] {});
          if (!received) return false;
        }
        return decision.has_success() && decision.success().worker_id() == 320U;
      },
      20s))
      << node->log();
  ASSERT_EQ(chunks.size(), 5U);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].index(), i);
    EXPECT_EQ(chunks[i].worker_id(), 321U) << "generated by the decode worker";
  }
  EXPECT_EQ(chunks.back().finish_reason(), "length");
}

}  // namespace
}  // namespace kvr
