// The JetStream key-value bucket against a real `nats-server -js` on loopback: create, get,
// compare-and-set, put, erase, keys, the TTL's unit (a key ages out after it), an existing
// bucket's settings, and the error a server without JetStream gives.
#include "selection/cluster/jetstream_kv.hpp"

#include <algorithm>

#include <gtest/gtest.h>

#include "messages/nats/nats_client.hpp"
#include "tests/testing/nats_server.hpp"

namespace kvr::cluster {
namespace {

using namespace std::chrono_literals;
using testing::NatsServer;
using testing::wait_until;

class JetStreamKvTest : public ::testing::Test {
 protected:
  void SetUp() override { start_server({"-js"}); }

  void start_server(std::vector<std::string> args) {
    std::string error;
    // The server's store directory (-sd) is its own temporary one: JetStream files stay apart.
    server_ = NatsServer::start(&error, std::nullopt, std::move(args));
    ASSERT_TRUE(server_) << error;
    nats::NatsOptions options;
    options.url = server_->url();
    auto client = nats::NatsClient::connect(options);
    ASSERT_TRUE(client) << client.error();
    client_ = std::move(*client);
  }

  std::unique_ptr<JetStreamKv> open(std::string bucket, std::chrono::milliseconds ttl = 0ms) {
    KvBucketOptions options;
    options.bucket = std::move(bucket);
    options.ttl = ttl;
    auto kv = JetStreamKv::open_or_create(client_->native_handle(), options);
    EXPECT_TRUE(kv) << kv.error().message;
    return kv ? std::move(*kv) : nullptr;
  }

  void TearDown() override {
    client_.reset();
    server_.reset();
  }

  std::unique_ptr<NatsServer> server_;
  std::unique_ptr<nats::NatsClient> client_;
};

TEST_F(JetStreamKvTest, CreateSucceedsOnlyOnAnEmptyKey) {
  auto kv = open("kvr_test_create");
  ASSERT_TRUE(kv);
  const auto revision = kv->create("lease.m/default", "owner-a");
  ASSERT_TRUE(revision) << revision.error().message;
  EXPECT_GT(*revision, 0u);

  const auto again = kv->create("lease.m/default", "owner-b");
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, KvErrorCode::already_exists) << again.error().message;

  const auto entry = kv->get("lease.m/default");
  ASSERT_TRUE(entry) << entry.error().message;
  EXPECT_EQ(entry->value, "owner-a");
  EXPECT_EQ(entry->revision, *revision);
}

TEST_F(JetStreamKvTest, UpdateIsACompareAndSetOnTheRevision) {
  auto kv = open("kvr_test_update");
  ASSERT_TRUE(kv);
  const auto first = kv->create("k", "one");
  ASSERT_TRUE(first);

  const auto stale = kv->update("k", "two", *first + 100);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().code, KvErrorCode::wrong_revision) << stale.error().message;
  EXPECT_EQ(kv->get("k")->value, "one");

  const auto second = kv->update("k", "two", *first);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_GT(*second, *first);
  EXPECT_EQ(kv->get("k")->value, "two");

  // The revision just replaced is spent: a second writer holding it loses.
  const auto loser = kv->update("k", "three", *first);
  ASSERT_FALSE(loser);
  EXPECT_EQ(loser.error().code, KvErrorCode::wrong_revision);
  EXPECT_EQ(kv->get("k")->revision, *second);

  const auto no_revision = kv->update("k", "x", 0);
  ASSERT_FALSE(no_revision);
  EXPECT_EQ(no_revision.error().code, KvErrorCode::invalid_argument);
}

TEST_F(JetStreamKvTest, GetOfAMissingKeyIsNotFound) {
  auto kv = open("kvr_test_get");
  ASSERT_TRUE(kv);
  const auto entry = kv->get("nothing.here");
  ASSERT_FALSE(entry);
  EXPECT_EQ(entry.error().code, KvErrorCode::not_found) << entry.error().message;
}

TEST_F(JetStreamKvTest, EraseRemovesTheKeyAndCreateWorksAgain) {
  auto kv = open("kvr_test_erase");
  ASSERT_TRUE(kv);
  ASSERT_TRUE(kv->put("a", "1"));
  ASSERT_TRUE(kv->put("b", "2"));
  ASSERT_TRUE(kv->erase("a"));
  const auto gone = kv->get("a");
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.error().code, KvErrorCode::not_found);
  const auto keys = kv->keys();
  ASSERT_TRUE(keys) << keys.error().message;
  EXPECT_EQ(*keys, (std::vector<std::string>{"b"}));
  EXPECT_TRUE(kv->create("a", "again"));
  EXPECT_EQ(kv->get("a")->value, "again");
}

TEST_F(JetStreamKvTest, KeysListsEveryKeyWithAValue) {
  auto kv = open("kvr_test_keys");
  ASSERT_TRUE(kv);
  const auto empty = kv->keys();
  ASSERT_TRUE(empty) << empty.error().message;
  EXPECT_TRUE(empty->empty());
  for (const auto* key : {"lease.a/default", "lease.b/default", "ready.a/default"}) {
    ASSERT_TRUE(kv->put(key, "v"));
  }
  auto keys = kv->keys();
  ASSERT_TRUE(keys) << keys.error().message;
  std::ranges::sort(*keys);
  EXPECT_EQ(*keys,
            (std::vector<std::string>{"lease.a/default", "lease.b/default", "ready.a/default"}));
}

TEST_F(JetStreamKvTest, AKeyAgesOutAfterTheTtl) {
  auto kv = open("kvr_test_ttl", 1000ms);
  ASSERT_TRUE(kv);
  // The server holds the TTL as given: the unit handed to it is right.
  EXPECT_EQ(kv->ttl(), 1000ms);
  const auto revision = kv->create("lease.m/default", "owner");
  ASSERT_TRUE(revision);
  ASSERT_TRUE(kv->get("lease.m/default")) << "gone at once: the TTL reached the server too short";

  // Gone within a few TTLs, with no delete marker: get says not found, create works again, and
  // a compare-and-set over the old revision fails.
  EXPECT_TRUE(wait_until(
      [&] {
        const auto entry = kv->get("lease.m/default");
        return !entry && entry.error().code == KvErrorCode::not_found;
      },
      5000ms));
  const auto stale = kv->update("lease.m/default", "late renewal", *revision);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().code, KvErrorCode::wrong_revision) << stale.error().message;
  EXPECT_TRUE(kv->create("lease.m/default", "new owner"));
}

TEST_F(JetStreamKvTest, AnExistingBucketKeepsItsSettings) {
  auto first = open("kvr_test_existing", 2000ms);
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->put("k", "v"));
  auto second = open("kvr_test_existing", 5000ms);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->ttl(), 2000ms);
  EXPECT_EQ(second->get("k")->value, "v");
}

TEST_F(JetStreamKvTest, ATtlBelowTheServersMinimumOf100MsIsRefused) {
  KvBucketOptions options;
  options.bucket = "kvr_test_short";
  options.ttl = 10ms;
  const auto kv = JetStreamKv::open_or_create(client_->native_handle(), options);
  ASSERT_FALSE(kv);
  EXPECT_EQ(kv.error().code, KvErrorCode::invalid_argument);
}

TEST_F(JetStreamKvTest, AServerWithoutJetStreamGivesAClearError) {
  client_.reset();
  start_server({});
  KvBucketOptions options;
  options.bucket = "kvr_test_nojs";
  options.ttl = 3000ms;
  const auto kv = JetStreamKv::open_or_create(client_->native_handle(), options);
  ASSERT_FALSE(kv);
  EXPECT_EQ(kv.error().code, KvErrorCode::jetstream_not_enabled) << kv.error().message;
  EXPECT_NE(
      kv.error().message.find("JetStream is not enabled on the NATS server (start it with -js)"),
      std::string::npos)
      << kv.error().message;
}

}  // namespace
}  // namespace kvr::cluster
