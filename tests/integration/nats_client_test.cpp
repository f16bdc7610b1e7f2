// The NATS client wrapper against a real nats-server on loopback, with nats.c's own socket
// threads and with kvr's socket loop (NatsOptions::deferred_publish): every test runs in both.
#include "messages/nats/nats_client.hpp"

#include <algorithm>
#include <atomic>
#include <deque>
#include <expected>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <time.h>

#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::nats {
namespace {

using namespace std::chrono_literals;
using testing::NatsRecorder;
using testing::NatsServer;
using testing::TemporaryDirectory;
using testing::wait_until;

class NatsClientTest : public ::testing::TestWithParam<bool> {
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
    options.deferred_publish = socket_loop();
    auto client = NatsClient::connect(options, std::move(handlers));
    EXPECT_TRUE(client) << client.error();
    return client ? std::move(*client) : nullptr;
  }

  static bool socket_loop() { return GetParam(); }

  std::unique_ptr<NatsServer> server_;
};

double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

// True once the process spent less than `budget` seconds of CPU time over some `window` of wall
// time; false when no such window ended within `timeout`. The windows slide with the samples, so
// a busy moment (the test's own, a sanitizer's) fails no test, and a thread that never stops
// spinning fails every window.
bool becomes_cpu_quiet(std::chrono::milliseconds window, double budget,
                       std::chrono::milliseconds timeout) {
  std::deque<std::pair<std::chrono::steady_clock::time_point, double>> samples;
  return wait_until(
      [&] {
        const auto now = std::chrono::steady_clock::now();
        const double cpu = process_cpu_seconds();
        samples.emplace_back(now, cpu);
        // The newest sample at least a window old starts the window.
        while (samples.size() > 1 && now - samples[1].first >= window) samples.pop_front();
        return now - samples.front().first >= window && cpu - samples.front().second < budget;
      },
      timeout);
}

TEST_P(NatsClientTest, PublishReachesSubscriber) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.events"));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(publisher->publish("kvr.test.events", std::to_string(i)));
  ASSERT_TRUE(inbox.wait_for(3, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"0", "1", "2"}));
}

// Delivered messages are freed in batches after the handler got its copy: every copy must stay
// intact while the message behind it waits to be freed, across batch boundaries and sizes.
TEST_P(NatsClientTest, DeliveredCopiesStayIntactWhileMessagesAreFreedInBatches) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  constexpr int kMessages = 300;  // several batches of 32, and some by size
  auto payload = [](int i) {
    return std::string(static_cast<std::size_t>(i * 97 % 20'000), 'a' + i % 26);
  };
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.batch.*"));
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(publisher->publish("kvr.test.batch." + std::to_string(i), payload(i)));
  }
  ASSERT_TRUE(inbox.wait_for(kMessages, 10s));
  const auto received = inbox.messages();
  ASSERT_EQ(received.size(), std::size_t{kMessages});
  for (int i = 0; i < kMessages; ++i) {
    const NatsMessage& message = received[static_cast<std::size_t>(i)];
    EXPECT_EQ(message.subject + "|" + message.data,
              "kvr.test.batch." + std::to_string(i) + "|" + payload(i))
        << "message " << i;
  }
}

TEST_P(NatsClientTest, RequestGetsReplyFromResponder) {
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

TEST_P(NatsClientTest, RequestWithoutResponderFailsFast) {
  auto requester = connect();
  ASSERT_TRUE(requester);
  auto reply = requester->request("kvr.test.nobody", "hi", 2s);
  ASSERT_FALSE(reply);
  EXPECT_NE(reply.error().find("kvr.test.nobody"), std::string::npos);
}

TEST_P(NatsClientTest, ConnectFailsClearlyWhenNoServer) {
  NatsOptions options;
  options.url = server_->url();
  server_->stop();
  options.connect_timeout = 500ms;
  auto client = NatsClient::connect(options);
  ASSERT_FALSE(client);
  EXPECT_NE(client.error().find("cannot connect"), std::string::npos);
}

TEST_P(NatsClientTest, ReconnectsAfterServerRestartAndKeepsSubscriptions) {
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

TEST_P(NatsClientTest, DestroyingSubscriptionStopsDelivery) {
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

// With the socket loop a deferred publish stays in the buffer until its publisher flushes, and a
// flush writes the burst in order; with nats.c's threads it is an ordinary publish.
TEST_P(NatsClientTest, DeferredPublishesGoOutWhenFlushed) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.deferred"));
  const auto published = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(publisher->publish_deferred("kvr.test.deferred", std::to_string(i)));
  }
  if (socket_loop()) {
    // The loop writes an unflushed message only after 50 ms of quiet; before that nothing may
    // arrive. Instead of waiting a while for what should not come, the subscriber sends a marker
    // through the server after the burst: anything the publisher had written at once would reach
    // the subscriber ahead of it, so nothing may arrive before the marker. (A marker back later
    // than 40 ms after the burst proves nothing either way, as the loop may have written the
    // burst by then; the test then checks only the order below.)
    ASSERT_TRUE(subscriber->publish("kvr.test.deferred", "marker"));
    ASSERT_TRUE(wait_until(
        [&] {
          const auto received = inbox.payloads();
          return std::ranges::find(received, "marker") != received.end();
        },
        5s));
    const bool in_time = std::chrono::steady_clock::now() - published < 40ms;
    const auto early = inbox.payloads();
    if (in_time) {
      EXPECT_EQ(early.front(), "marker") << early.size() - 1 << " arrived before the flush";
    }
  }
  publisher->flush_deferred();
  ASSERT_TRUE(inbox.wait_for(socket_loop() ? 6 : 5, 5s));
  auto received = inbox.payloads();
  std::erase(received, "marker");
  EXPECT_EQ(received, (std::vector<std::string>{"0", "1", "2", "3", "4"}));
}

// An immediate publish writes what deferred ones left in the buffer, in publish order.
TEST_P(NatsClientTest, ImmediatePublishWritesEarlierDeferredOnes) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.mixed"));
  ASSERT_TRUE(publisher->publish_deferred("kvr.test.mixed", "deferred"));
  ASSERT_TRUE(publisher->publish("kvr.test.mixed", "immediate"));
  ASSERT_TRUE(inbox.wait_for(2, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"deferred", "immediate"}));
}

// A publisher that never flushes loses nothing: the loop writes what waited through a quiet period.
TEST_P(NatsClientTest, UnflushedDeferredPublishIsWrittenByTheLoop) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.forgotten"));
  ASSERT_TRUE(publisher->publish_deferred("kvr.test.forgotten", "late"));
  ASSERT_TRUE(inbox.wait_for(1, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"late"}));
}

// Threads publishing and flushing at once: every message arrives once and the connection stays
// up (a write of an already emptied buffer must not look like a closed socket).
TEST_P(NatsClientTest, ConcurrentPublishersAndFlushesKeepTheConnection) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  std::atomic<int> received{0};
  auto subscription =
      subscriber->subscribe("kvr.test.concurrent", [&](NatsMessage) { ++received; });
  ASSERT_TRUE(subscription) << subscription.error();
  ASSERT_TRUE(subscriber->flush(2s));
  constexpr int kThreads = 4;
  constexpr int kPerThread = 2'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if ((i + t) % 2 == 0) {
          EXPECT_TRUE(publisher->publish("kvr.test.concurrent", "now"));
        } else {
          EXPECT_TRUE(publisher->publish_deferred("kvr.test.concurrent", "later"));
          publisher->flush_deferred();
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_TRUE(wait_until([&] { return received.load() == kThreads * kPerThread; }, 10s))
      << received.load() << " of " << kThreads * kPerThread;
  EXPECT_EQ(publisher->reconnects(), 0U);
  EXPECT_TRUE(publisher->connected());
  // Then every thread goes quiet: none spins on a socket it no longer needs to watch. Soon after
  // the burst the process spends less than a third of a 300 ms window on the CPU, where a thread
  // spinning on an always-writable socket would use all of every window.
  EXPECT_TRUE(becomes_cpu_quiet(300ms, 0.1, 3s)) << "a thread kept running while idle";
}

// A burst far larger than the socket takes at once: the flush writes what fits and the loop
// writes the rest when the socket drains; every message arrives, in order.
TEST_P(NatsClientTest, ABurstLargerThanTheSocketBufferArrivesWhole) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  constexpr int kMessages = 16'000;
  const std::string payload(1'024, 'x');
  std::atomic<int> received{0};
  std::atomic<int> out_of_order{0};
  auto subscription = subscriber->subscribe("kvr.test.big", [&](NatsMessage message) {
    if (message.data.substr(0, message.data.find('|')) != std::to_string(received.load())) {
      ++out_of_order;
    }
    ++received;
  });
  ASSERT_TRUE(subscription) << subscription.error();
  ASSERT_TRUE(subscriber->flush(2s));
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(publisher->publish_deferred("kvr.test.big", std::to_string(i) + "|" + payload));
  }
  publisher->flush_deferred();
  ASSERT_TRUE(wait_until([&] { return received.load() == kMessages; }, 20s))
      << received.load() << " of " << kMessages;
  EXPECT_EQ(out_of_order.load(), 0);
  EXPECT_EQ(publisher->reconnects(), 0U);
}

// Closing the client writes what is still buffered before the socket goes.
TEST_P(NatsClientTest, ClosingTheClientWritesDeferredPublishes) {
  auto publisher = connect();
  auto subscriber = connect();
  ASSERT_TRUE(publisher && subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.closing"));
  ASSERT_TRUE(publisher->publish_deferred("kvr.test.closing", "last words"));
  publisher.reset();
  ASSERT_TRUE(inbox.wait_for(1, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"last words"}));
}

// Deferred publishing across a server restart: the loop follows the new socket.
TEST_P(NatsClientTest, DeferredPublishWorksAfterReconnect) {
  std::atomic<int> reconnected{0};
  auto publisher = connect({.on_reconnected = [&] { ++reconnected; }});
  ASSERT_TRUE(publisher);
  std::string error;
  ASSERT_TRUE(server_->restart(&error)) << error;
  ASSERT_TRUE(wait_until([&] { return reconnected.load() > 0 && publisher->connected(); }, 10s));
  auto subscriber = connect();
  ASSERT_TRUE(subscriber);
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(*subscriber, "kvr.test.reconnected"));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(publisher->publish_deferred("kvr.test.reconnected", std::to_string(i)));
  }
  publisher->flush_deferred();
  ASSERT_TRUE(inbox.wait_for(3, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"0", "1", "2"}));
}

// A server of its own, started with `args`, and clients to it with the given credentials/TLS.
class SecuredServer {
 public:
  explicit SecuredServer(std::vector<std::string> args) {
    std::string error;
    server_ = NatsServer::start(&error, std::nullopt, std::move(args));
    EXPECT_TRUE(server_) << error;
  }
  bool up() const { return server_ != nullptr; }
  std::expected<std::unique_ptr<NatsClient>, std::string> connect(NatsOptions options) const {
    options.url = server_->url();
    options.connect_timeout = 2s;
    options.max_reconnects = 0;
    return NatsClient::connect(options);
  }

 private:
  std::unique_ptr<NatsServer> server_;
};

// A message published by `client` comes back to its own subscription.
void expect_round_trip(NatsClient& client) {
  NatsRecorder inbox;
  ASSERT_TRUE(inbox.listen(client, "kvr.test.secured"));
  ASSERT_TRUE(client.publish_deferred("kvr.test.secured", "one"));
  client.flush_deferred();
  ASSERT_TRUE(client.publish("kvr.test.secured", "two"));
  ASSERT_TRUE(inbox.wait_for(2, 5s));
  EXPECT_EQ(inbox.payloads(), (std::vector<std::string>{"one", "two"}));
}

TEST_P(NatsClientTest, UserAndPasswordAreSentAndAWrongOneIsRefusedClearly) {
  SecuredServer server{{"--user", "router", "--pass", "s3cret"}};
  ASSERT_TRUE(server.up());
  NatsOptions options;
  options.deferred_publish = socket_loop();
  options.user = "router";
  options.password = "wrong";
  auto refused = server.connect(options);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().find("cannot connect"), std::string::npos) << refused.error();
  options.password = "s3cret";
  auto client = server.connect(options);
  ASSERT_TRUE(client) << client.error();
  expect_round_trip(**client);
}

TEST_P(NatsClientTest, TokenIsSentAndAWrongOneIsRefusedClearly) {
  SecuredServer server{{"--auth", "t0ken-for-kvr"}};
  ASSERT_TRUE(server.up());
  NatsOptions options;
  options.deferred_publish = socket_loop();
  options.token = "not-the-token";
  auto refused = server.connect(options);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().find("cannot connect"), std::string::npos) << refused.error();
  options.token = "t0ken-for-kvr";
  auto client = server.connect(options);
  ASSERT_TRUE(client) << client.error();
  expect_round_trip(**client);
}

// TLS verified against the server's certificate; with the socket loop asked for, a TLS
// connection keeps the NATS C client's threads and deferred publishes still arrive.
TEST_P(NatsClientTest, TlsConnectionVerifiesTheServerAndCarriesMessages) {
  TemporaryDirectory trusted;
  TemporaryDirectory stranger;
  std::string error;
  ASSERT_TRUE(testing::make_self_signed_certificate(trusted.path(), &error)) << error;
  ASSERT_TRUE(testing::make_self_signed_certificate(stranger.path(), &error)) << error;
  const std::string cert = (trusted.path() / "cert.pem").string();
  SecuredServer server{
      {"--tls", "--tlscert", cert, "--tlskey", (trusted.path() / "key.pem").string()}};
  ASSERT_TRUE(server.up());

  NatsOptions options;
  options.deferred_publish = socket_loop();
  auto plain = server.connect(options);
  ASSERT_FALSE(plain) << "a plain connection to a TLS-only server";
  options.tls_ca_file = (stranger.path() / "cert.pem").string();
  auto unverified = server.connect(options);
  ASSERT_FALSE(unverified) << "a server certificate from another CA was accepted";
  options.tls_ca_file = cert;
  auto client = server.connect(options);
  ASSERT_TRUE(client) << client.error();
  expect_round_trip(**client);
}

INSTANTIATE_TEST_SUITE_P(SocketModes, NatsClientTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& mode) {
                           return mode.param ? "KvrSocketLoop" : "NatsThreads";
                         });

}  // namespace
}  // namespace kvr::nats
