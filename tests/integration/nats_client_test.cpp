// The NATS client wrapper against a real nats-server on loopback.
#include "actors/nats/nats_client.hpp"

#include <atomic>
#include <mutex>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/nats_server.hpp"

namespace kvr::actors::nats {
namespace {

using namespace std::chrono_literals;
using testing::NatsServer;
using testing::wait_until;

class NatsClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string error;
    server_ = NatsServer::start(&error);
    ASSERT_TRUE(server_) << error;
  }

  std::unique_ptr<NatsClient> connect(NatsEventHandlers handlers = {}) {
    NatsOptions options;
    options.url = server_->url();
    options.reconnect_wait = 50ms;
    auto client = NatsClient::connect(options, std::move(handlers));
    EXPECT_TRUE(client) << client.error();
    return client ? std::move(*client) : nullptr;
  }

  std::unique_ptr<NatsServer> server_;
};

TEST_F(NatsClientTest, PublishReachesSubscriber) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  std::mutex mutex;
  std::vector<std::string> received;
  auto subscription = subscriber->subscribe("kvr.test.events", [&](NatsMessage message) {
    std::lock_guard lock{mutex};
    received.push_back(message.data);
  });
  ASSERT_TRUE(subscription) << subscription.error();
  ASSERT_TRUE(subscriber->flush(2s));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(publisher->publish("kvr.test.events", std::to_string(i)));
  ASSERT_TRUE(wait_until(
      [&] {
        std::lock_guard lock{mutex};
        return received.size() == 3;
      },
      5s));
  std::lock_guard lock{mutex};
  EXPECT_EQ(received, (std::vector<std::string>{"0", "1", "2"}));
}

// Delivered messages are freed in batches after the handler got its copy: every copy must stay
// intact while the message behind it waits to be freed, across batch boundaries and sizes.
TEST_F(NatsClientTest, DeliveredCopiesStayIntactWhileMessagesAreFreedInBatches) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  constexpr int kMessages = 300;  // several batches of 32, and some by size
  auto payload = [](int i) {
    return std::string(static_cast<std::size_t>(i * 97 % 20'000), 'a' + i % 26);
  };
  std::mutex mutex;
  std::vector<std::string> received;
  auto subscription = subscriber->subscribe("kvr.test.batch.*", [&](NatsMessage message) {
    std::lock_guard lock{mutex};
    received.push_back(message.subject + "|" + message.data);
  });
  ASSERT_TRUE(subscription) << subscription.error();
  ASSERT_TRUE(subscriber->flush(2s));
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(publisher->publish("kvr.test.batch." + std::to_string(i), payload(i)));
  }
  ASSERT_TRUE(wait_until(
      [&] {
        std::lock_guard lock{mutex};
        return received.size() == kMessages;
      },
      10s));
  std::lock_guard lock{mutex};
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(received[static_cast<std::size_t>(i)],
              "kvr.test.batch." + std::to_string(i) + "|" + payload(i))
        << "message " << i;
  }
}

TEST_F(NatsClientTest, RequestGetsReplyFromResponder) {
  auto responder = connect();
  auto requester = connect();
  ASSERT_TRUE(responder && requester);
  auto subscription = responder->subscribe(
      "kvr.test.echo",
      [&](NatsMessage message) { (void)responder->publish(message.reply, "echo:" + message.data); },
      "kvr-router");
  ASSERT_TRUE(subscription);
  ASSERT_TRUE(responder->flush(2s));
  auto reply = requester->request("kvr.test.echo", "hi", 2s);
  ASSERT_TRUE(reply) << reply.error();
  EXPECT_EQ(reply->data, "echo:hi");
}

TEST_F(NatsClientTest, RequestWithoutResponderFailsFast) {
  auto requester = connect();
  ASSERT_TRUE(requester);
  auto reply = requester->request("kvr.test.nobody", "hi", 2s);
  ASSERT_FALSE(reply);
  EXPECT_NE(reply.error().find("kvr.test.nobody"), std::string::npos);
}

TEST_F(NatsClientTest, ConnectFailsClearlyWhenNoServer) {
  NatsOptions options;
  options.url = server_->url();
  server_->stop();
  options.connect_timeout = 500ms;
  auto client = NatsClient::connect(options);
  ASSERT_FALSE(client);
  EXPECT_NE(client.error().find("cannot connect"), std::string::npos);
}

TEST_F(NatsClientTest, ReconnectsAfterServerRestartAndKeepsSubscriptions) {
  std::atomic<int> reconnected{0};
  auto client = connect({.on_reconnected = [&] { ++reconnected; }});
  ASSERT_TRUE(client);
  std::atomic<int> received{0};
  auto subscription = client->subscribe("kvr.test.after", [&](NatsMessage) { ++received; });
  ASSERT_TRUE(subscription);
  ASSERT_TRUE(client->flush(2s));

  std::string error;
  ASSERT_TRUE(server_->restart(&error)) << error;
  ASSERT_TRUE(wait_until([&] { return reconnected.load() > 0 && client->connected(); }, 10s));
  EXPECT_EQ(client->reconnects(), 1U);
  ASSERT_TRUE(client->publish("kvr.test.after", "x"));
  ASSERT_TRUE(client->flush(2s));
  EXPECT_TRUE(wait_until([&] { return received.load() == 1; }, 5s));
}

TEST_F(NatsClientTest, DestroyingSubscriptionStopsDelivery) {
  auto client = connect();
  ASSERT_TRUE(client);
  std::atomic<int> received{0};
  {
    auto subscription = client->subscribe("kvr.test.gone", [&](NatsMessage) { ++received; });
    ASSERT_TRUE(subscription);
    ASSERT_TRUE(client->flush(2s));
  }
  ASSERT_TRUE(client->publish("kvr.test.gone", "x"));
  ASSERT_TRUE(client->flush(2s));
  EXPECT_EQ(received.load(), 0);
}

}  // namespace
}  // namespace kvr::actors::nats
