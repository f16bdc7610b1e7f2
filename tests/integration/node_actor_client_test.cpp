// An actor client of a real `kvr node --actor-port`: connects through CAF's middleman to the
// published ingress actor and exchanges protobuf-carrying messages across processes.
#include <arpa/inet.h>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/actor_types.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::free_port;
using testing::NatsServer;
using testing::wait_until;

TEST(NodeActorClientTest, PublishedIngressRoutesAndAcceptsReports) {
  testing::TemporaryDirectory directory;
  std::string error;
  auto server = NatsServer::start(&error);
  ASSERT_TRUE(server) << error;
  auto mocker = ChildProcess::start(
      {KVR_BINARY, "mocker", "--nats", server->url(), "--namespace", "actors", "--workers", "1",
       "--worker-id-base", "300", "--block-size", "16", "--lease-ttl-ms", "2000"},
      directory.path() / "mocker.log");
  ASSERT_TRUE(mocker);
  const std::uint16_t actor_port = free_port();
  auto node =
      ChildProcess::start({KVR_BINARY, "node", "--nats", server->url(), "--namespace", "actors",
                           "--block-size", "16", "--actor-port", std::to_string(actor_port)},
                          directory.path() / "node.log");
  ASSERT_TRUE(node);

  caf::actor_system_config config;
  config.set("scheduler.max-threads", 2);
  config.load<caf::io::middleman>();
  config.add_message_types<caf::id_block::kvr_actors>();
  caf::actor_system system{config};
  caf::expected<actors::ingress_actor> ingress{caf::sec::cannot_connect_to_node};
  ASSERT_TRUE(wait_until(
      [&] {
        ingress = system.middleman().remote_actor<actors::ingress_actor>("127.0.0.1", actor_port);
        return static_cast<bool>(ingress);
      },
      20s))
      << node->log();

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
    report.set_lease_id(decision.success().lease_id());
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
  // Drop the proxy before the system shuts down, so that nothing stays pinned to the node.
  ingress = caf::sec::cannot_connect_to_node;
  node->stop();
}

}  // namespace
}  // namespace kvr
