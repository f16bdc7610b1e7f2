// Worker registration validation (plain and from the wire), liveness TTLs, and the discovery
// state's cascade of removals to the KV index and the bookings.
#include "discovery/catalog/worker_catalog.hpp"

#include <algorithm>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "discovery/partition_workers.hpp"

namespace kvr::discovery {
namespace {

const std::chrono::steady_clock::time_point kStart{};
using std::chrono::milliseconds;

WorkerRegistration registration(WorkerId id = 7, Incarnation incarnation = 1) {
  WorkerRegistration worker;
  worker.worker_id = id;
  worker.incarnation = incarnation;
  worker.model = "llama";
  worker.block_size = 16;
  worker.total_kv_blocks = 1000;
  worker.data_parallel_size = 2;
  worker.liveness_ttl = milliseconds(1000);
  return worker;
}

v1::WorkerRegistration wire_registration() {
  v1::WorkerRegistration wire;
  wire.set_worker_id(7);
  wire.set_incarnation(3);
  wire.set_model("llama");
  wire.set_role(v1::WORKER_ROLE_PREFILL);
  wire.set_block_size(16);
  wire.set_total_kv_blocks(500);
  wire.add_taints("gpu=h100");
  wire.set_publishes_kv_events(true);
  return wire;
}

TEST(WorkerRegistrationTest, ConvertsTheWireFormWithDefaults) {
  const auto converted = registration_from_proto(wire_registration(), {});
  ASSERT_TRUE(converted) << converted.error().message();
  EXPECT_EQ(converted->role, WorkerType::Prefill);
  EXPECT_EQ(converted->data_parallel_size, 1U);
  EXPECT_EQ(converted->routing_group, "default");
  EXPECT_EQ(converted->liveness_ttl, RegistrationLimits{}.default_liveness_ttl);
  EXPECT_EQ(converted->taints, std::vector<std::string>{"gpu=h100"});
}

TEST(WorkerRegistrationTest, KeepsTheHttpUrlWithoutItsTrailingSlashAndRefusesABadOne) {
  auto wire = wire_registration();
  EXPECT_EQ(registration_from_proto(wire, {})->http_url, "") << "absent: reached over NATS only";
  wire.set_http_url("http://10.0.0.7:8000/");
  const auto converted = registration_from_proto(wire, {});
  ASSERT_TRUE(converted) << converted.error().message();
  EXPECT_EQ(converted->http_url, "http://10.0.0.7:8000");
  wire.set_http_url("10.0.0.7:8000");
  const auto refused = registration_from_proto(wire, {});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message(),
            "http_url: '10.0.0.7:8000' is not an http:// or https:// URL");
  wire.set_http_url("http://" + std::string(300, 'a'));
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "http_url") << "overlong";
}

TEST(WorkerRegistrationTest, NamesTheBadField) {
  auto wire = wire_registration();
  wire.set_role(v1::WORKER_ROLE_UNSPECIFIED);
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "role");
  wire = wire_registration();
  wire.set_worker_id(0);
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "worker_id");
  RegistrationLimits strict;
  strict.required_block_size = 32;
  const auto error = registration_from_proto(wire_registration(), strict).error();
  EXPECT_EQ(error.field, "block_size");
  EXPECT_EQ(error.message(), "block_size: 16 differs from the router's 32");
  for (const std::uint32_t absurd : {4097U, 1'000'000'000U, 4'294'967'295U}) {
    wire = wire_registration();
    wire.set_block_size(absurd);
    const auto refused = registration_from_proto(wire, {});
    ASSERT_FALSE(refused) << absurd;
    EXPECT_EQ(refused.error().message(),
              "block_size: " + std::to_string(absurd) + " is more than 4096 tokens");
  }
  wire = wire_registration();
  wire.set_block_size(4096);
  EXPECT_TRUE(registration_from_proto(wire, {})) << "the largest size is accepted";
  wire = wire_registration();
  wire.set_liveness_ttl_ms(5);
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "liveness_ttl_ms");
  wire = wire_registration();
  wire.set_data_parallel_size(100000);
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "data_parallel_size");
  wire = wire_registration();
  wire.add_taints("");
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "taints");
  wire = wire_registration();
  wire.add_lora_adapters("");
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "lora_adapters");
  wire = wire_registration();
  wire.add_lora_adapters(wire.model());
  EXPECT_EQ(registration_from_proto(wire, {}).error().field, "lora_adapters");
}

TEST(WorkerRegistrationTest, ZeroOrAbsentTotalKvBlocksIsAWorkerWithoutCapacity) {
  auto wire = wire_registration();
  wire.set_total_kv_blocks(0);
  const auto zero = registration_from_proto(wire, {});
  ASSERT_TRUE(zero) << zero.error().message();
  EXPECT_EQ(zero->total_kv_blocks, std::nullopt);
  wire.clear_total_kv_blocks();
  const auto absent = registration_from_proto(wire, {});
  ASSERT_TRUE(absent) << absent.error().message();
  EXPECT_EQ(absent->total_kv_blocks, std::nullopt);
  EXPECT_EQ(registration_from_proto(wire_registration(), {})->total_kv_blocks, 500U);
  // The plain form says "unknown" with nullopt; an explicit 0 there is a caller's mistake.
  auto plain = registration();
  plain.total_kv_blocks.reset();
  EXPECT_TRUE(validate_registration(plain, {}));
  plain.total_kv_blocks = 0;
  EXPECT_EQ(validate_registration(plain, {}).error().field, "total_kv_blocks");
}

TEST(WorkerRegistrationTest, ACapacityAboveTheLimitIsStillRefused) {
  auto wire = wire_registration();
  wire.set_total_kv_blocks(kMaxKvBlocksPerRank);
  EXPECT_TRUE(registration_from_proto(wire, {})) << "the largest capacity is accepted";
  wire.set_total_kv_blocks(kMaxKvBlocksPerRank + 1);
  const auto refused = registration_from_proto(wire, {});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().message(), "total_kv_blocks: more than 67108864 per rank");
  RegistrationLimits small;
  small.max_kv_blocks_per_rank = 100;
  wire.set_total_kv_blocks(101);
  EXPECT_EQ(registration_from_proto(wire, small).error().field, "total_kv_blocks");
  wire.set_total_kv_blocks(0);
  EXPECT_TRUE(registration_from_proto(wire, small)) << "no capacity is within any limit";
}

TEST(WorkerRegistrationTest, CarriesTheLoraAdapters) {
  auto wire = wire_registration();
  wire.add_lora_adapters("sql");
  wire.add_lora_adapters("chat");
  const auto registration = registration_from_proto(wire, {});
  ASSERT_TRUE(registration) << registration.error().message();
  EXPECT_EQ(registration->lora_adapters, (std::vector<std::string>{"sql", "chat"}));
}

TEST(WorkerRegistrationTest, AnExplicitZeroLivenessTtlIsRefusedWhileAbsenceMeansTheDefault) {
  auto wire = wire_registration();
  ASSERT_FALSE(wire.has_liveness_ttl_ms());
  const auto absent = registration_from_proto(wire, {});
  ASSERT_TRUE(absent) << absent.error().message();
  EXPECT_EQ(absent->liveness_ttl, RegistrationLimits{}.default_liveness_ttl);
  wire.set_liveness_ttl_ms(0);
  const auto zero = registration_from_proto(wire, {});
  ASSERT_FALSE(zero) << "an explicit 0 became " << zero->liveness_ttl.count() << " ms";
  EXPECT_EQ(zero.error().field, "liveness_ttl_ms");
  EXPECT_NE(zero.error().reason.find("leave the field out for the default of 10000 ms"),
            std::string::npos)
      << zero.error().reason;
  // On the wire, an explicit 0 and an absent field differ.
  v1::WorkerRegistration parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire.SerializeAsString()));
  EXPECT_TRUE(parsed.has_liveness_ttl_ms());
}

TEST(WorkerRegistrationTest, RefusesSubjectsTheNodeCannotOrMustNotPublishTo) {
  const std::pair<const char*, const char*> refused[] = {
      {"a b", "whitespace"},
      {"kvr.gen.worker.7.generate\n", "whitespace"},
      {"kvr.>", "wildcard"},
      {"kvr.*.worker", "wildcard"},
      {"kvr..worker", "empty token"},
      {".kvr", "empty token"},
      {"kvr.", "empty token"},
      {"kvr.default.router.route", "routers' own subject space (kvr.<namespace>.router.)"},
      {"kvr.other.router.generate", "routers' own subject space"},
      {"kvr.default.workers.register", "kvr.<namespace>.workers."},
      {"kvr.default.kv.7", "kvr.<namespace>.kv."},
      {"_INBOX.abc.1", "reply inbox"},
      {"$JS.API.STREAM.CREATE", "system subject"},
  };
  for (const std::string field : {"generate_subject", "dump_subject"}) {
    for (const auto& [subject, why] : refused) {
      auto wire = wire_registration();
      std::string value = subject;
      if (field == "generate_subject") {
        wire.set_generate_subject(value);
      } else {
        wire.set_dump_subject(value);
      }
      const auto converted = registration_from_proto(wire, {});
      ASSERT_FALSE(converted) << field << " " << subject << " was accepted";
      EXPECT_EQ(converted.error().field, field);
      EXPECT_NE(converted.error().reason.find(why), std::string::npos)
          << subject << ": " << converted.error().reason;
    }
  }
  // A control character is shown escaped, not written into the log line.
  auto wire = wire_registration();
  wire.set_generate_subject("a\nb");
  EXPECT_NE(registration_from_proto(wire, {}).error().reason.find("'a\\x0ab'"), std::string::npos);
  // The default subjects, and other literal ones, pass; empty ones mean "not served".
  wire = wire_registration();
  wire.set_generate_subject("kvr.default.worker.7.generate");
  wire.set_dump_subject("kvr.default.worker.7.dump");
  EXPECT_TRUE(registration_from_proto(wire, {}));
  wire.set_generate_subject("engines.gpu-3.generate");
  wire.set_dump_subject("");
  EXPECT_TRUE(registration_from_proto(wire, {}));
}

TEST(WorkerCatalogTest, LeasesRenewOnHeartbeatAndExpire) {
  WorkerCatalog catalog;
  ASSERT_EQ(catalog.register_worker(registration(), kStart), RegistrationChange::added);
  ASSERT_TRUE(catalog.heartbeat(7, 1, kStart + milliseconds(800)));
  EXPECT_EQ(catalog.heartbeat(7, 2, kStart).error(), CatalogError::stale_incarnation);
  EXPECT_EQ(catalog.heartbeat(8, 1, kStart).error(), CatalogError::unknown_worker);
  std::vector<WorkerId> expired;
  catalog.expire(kStart + milliseconds(1000), expired);
  EXPECT_TRUE(expired.empty());
  catalog.expire(kStart + milliseconds(1800), expired);
  EXPECT_EQ(expired, std::vector<WorkerId>{7});
  EXPECT_EQ(catalog.find(7), nullptr);
}

TEST(WorkerCatalogTest, TellsRefreshFromRestart) {
  WorkerCatalog catalog;
  ASSERT_TRUE(catalog.register_worker(registration(), kStart));
  EXPECT_EQ(catalog.register_worker(registration(), kStart), RegistrationChange::refreshed);
  EXPECT_EQ(catalog.register_worker(registration(7, 2), kStart), RegistrationChange::restarted);
  EXPECT_EQ(catalog.deregister(7, 1).error(), CatalogError::stale_incarnation);
  EXPECT_TRUE(catalog.deregister(7, 2));
  EXPECT_EQ(catalog.size(), 0U);
}

// The node's own NATS outage: liveness is held while it lasts and each runs one TTL from the
// reconnect (release), so a worker that died meanwhile expires one TTL after it.
TEST(WorkerCatalogTest, HeldLivenessDoesNotExpireAndRunOneTtlFromTheRelease) {
  WorkerCatalog catalog;
  ASSERT_TRUE(catalog.register_worker(registration(7), kStart));
  ASSERT_TRUE(catalog.register_worker(registration(8), kStart));
  catalog.hold_liveness();
  EXPECT_TRUE(catalog.liveness_held());
  std::vector<WorkerId> expired;
  // Thirty TTLs without a heartbeat: the node heard nothing because it was cut off.
  catalog.expire(kStart + milliseconds(30'000), expired);
  EXPECT_TRUE(expired.empty());
  EXPECT_EQ(catalog.size(), 2U);

  const auto reconnect = kStart + milliseconds(30'000);
  const LivenessGrace grace = catalog.resume_liveness(reconnect);
  EXPECT_FALSE(catalog.liveness_held());
  EXPECT_EQ(grace.held_over, 2U);
  EXPECT_EQ(grace.renewed, 2U);
  EXPECT_EQ(catalog.find(7)->liveness_expires_at, reconnect + milliseconds(1000));
  // Worker 8 is alive and heartbeats after the reconnect; worker 7 died during the outage.
  ASSERT_TRUE(catalog.heartbeat(8, 1, reconnect + milliseconds(600)));
  catalog.expire(reconnect + milliseconds(999), expired);
  EXPECT_TRUE(expired.empty());
  catalog.expire(reconnect + milliseconds(1000), expired);
  EXPECT_EQ(expired, std::vector<WorkerId>{7});
  EXPECT_NE(catalog.find(8), nullptr);
  ASSERT_TRUE(catalog.heartbeat(8, 1, reconnect + milliseconds(1500)));
  catalog.expire(reconnect + milliseconds(2400), expired);
  EXPECT_EQ(expired, std::vector<WorkerId>{7});
  EXPECT_NE(catalog.find(8), nullptr);
}

TEST(WorkerCatalogTest, ResumeCountsOnlyTheWorkersItMoved) {
  WorkerCatalog catalog;
  WorkerRegistration long_lived = registration(9);
  long_lived.liveness_ttl = milliseconds(10'000);
  ASSERT_TRUE(catalog.register_worker(registration(7), kStart));
  ASSERT_TRUE(catalog.register_worker(registration(8), kStart));
  ASSERT_TRUE(catalog.register_worker(long_lived, kStart));
  catalog.hold_liveness();
  // A short outage: worker 7's liveness ran out (it would have expired), worker 9's did not, and
  // worker 8 was heard from the moment the connection came back.
  const auto reconnect = kStart + milliseconds(1500);
  ASSERT_TRUE(catalog.heartbeat(8, 1, reconnect));
  const LivenessGrace grace = catalog.resume_liveness(reconnect);
  EXPECT_EQ(grace.held_over, 1U);
  EXPECT_EQ(grace.renewed, 2U);
  EXPECT_EQ(catalog.find(7)->liveness_expires_at, reconnect + milliseconds(1000));
  EXPECT_EQ(catalog.find(8)->liveness_expires_at, reconnect + milliseconds(1000));
  EXPECT_EQ(catalog.find(9)->liveness_expires_at, reconnect + milliseconds(10'000));
  // Without a hold, workers expire as before.
  std::vector<WorkerId> expired;
  catalog.expire(reconnect + milliseconds(1000), expired);
  std::ranges::sort(expired);
  EXPECT_EQ(expired, (std::vector<WorkerId>{7, 8}));
}

TEST(WorkerCatalogTest, ALeaseThatRanOutDuringTheHoldCountsEvenIfAHeartbeatRacedTheRelease) {
  WorkerCatalog catalog;
  ASSERT_TRUE(catalog.register_worker(registration(7), kStart));
  catalog.hold_liveness();
  std::vector<WorkerId> expired;
  catalog.expire(kStart + milliseconds(3000), expired);  // a tick during the outage
  EXPECT_TRUE(expired.empty());
  EXPECT_TRUE(catalog.find(7)->liveness_held_over);
  // The worker's first heartbeat after the return arrives before the node hears of its reconnect.
  ASSERT_TRUE(catalog.heartbeat(7, 1, kStart + milliseconds(5000)));
  const LivenessGrace grace = catalog.resume_liveness(kStart + milliseconds(5001));
  EXPECT_EQ(grace.held_over, 1U);
  EXPECT_EQ(grace.renewed, 1U);
  EXPECT_FALSE(catalog.find(7)->liveness_held_over);
}

class DiscoveryStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(state_.register_worker(registration(), kStart));
    ASSERT_TRUE(state_.index().apply_event({7, 1}, KvStoredEvent{std::nullopt, prompt_, {}}));
    ASSERT_TRUE(
        state_.load().book(BookingRequest{"r", {7, 0}, prompt_, 64, kStart + milliseconds(60000)}));
  }

  std::size_t matches() {
    state_.index().find_matches(prompt_, result_);
    return result_.matches().size();
  }

  std::vector<BlockHash> prompt_{BlockHasher::chain(std::nullopt, 1)};
  PartitionWorkers state_;
  MatchResult result_;
};

TEST_F(DiscoveryStateTest, RegistrationCreatesEveryRank) {
  EXPECT_EQ(state_.index().rank_count(), 2U);
  EXPECT_TRUE(state_.load().rank_load({7, 1}));
  EXPECT_EQ(matches(), 1U);
}

TEST_F(DiscoveryStateTest, ExpiryCascadesToTheIndexAndTheBookings) {
  std::vector<WorkerId> removed;
  state_.expire(kStart + milliseconds(1000), removed);
  EXPECT_EQ(removed, std::vector<WorkerId>{7});
  EXPECT_EQ(matches(), 0U);
  EXPECT_EQ(state_.index().rank_count(), 0U);
  EXPECT_EQ(state_.load().open_bookings(), 0U);
  EXPECT_EQ(state_.load().release("r", BookingEnd::completed).error(), LoadError::unknown_booking);
}

TEST_F(DiscoveryStateTest, RestartResetsTheWorkersState) {
  ASSERT_EQ(state_.register_worker(registration(7, 2), kStart), RegistrationChange::restarted);
  EXPECT_EQ(matches(), 0U);
  EXPECT_EQ(state_.load().open_bookings(), 0U);
  EXPECT_EQ(state_.index().rank_count(), 2U);
  // Events of the old process are refused.
  EXPECT_EQ(state_.index().apply(KvEventBatch{{7, 0}, 1, 1, {}}).error(),
            IndexError::incarnation_mismatch);
  EXPECT_TRUE(state_.index().apply(KvEventBatch{{7, 0}, 2, 1, {}}));
}

TEST_F(DiscoveryStateTest, HeldLivenessKeepsTheIndexWhileBookingsStillExpire) {
  state_.hold_liveness();
  std::vector<WorkerId> removed;
  state_.expire(kStart + milliseconds(61'000), removed);
  EXPECT_TRUE(removed.empty());
  EXPECT_EQ(matches(), 1U);                      // the cached prefix survives the outage
  EXPECT_EQ(state_.load().open_bookings(), 0U);  // the node's own bookings still end
  (void)state_.resume_liveness(kStart + milliseconds(61'000));
  state_.expire(kStart + milliseconds(62'000), removed);
  EXPECT_EQ(removed, std::vector<WorkerId>{7});
  EXPECT_EQ(matches(), 0U);
}

// A rank without a capacity is indexed and tracked like any other; the index bounds what it may
// hold as it bounds a rank of the largest capacity a registration may announce.
TEST(PartitionWorkersTest, AWorkerWithoutCapacityIsIndexedUpToTheLargestCapacity) {
  RegistrationLimits limits;
  limits.max_kv_blocks_per_rank = 8;
  PartitionWorkers state{limits, IndexerConfig{.capacity_margin = 0, .capacity_slack_blocks = 0}};
  auto worker = registration();
  worker.total_kv_blocks.reset();
  ASSERT_TRUE(state.register_worker(worker, kStart));
  EXPECT_EQ(state.index().rank_count(), 2U);
  EXPECT_EQ(state.load().rank_load({7, 1})->total_kv_blocks, std::nullopt);
  std::vector<BlockHash> chain;
  std::optional<BlockHash> parent;
  for (std::uint64_t i = 0; i < 9; ++i) {
    parent = BlockHasher::chain(parent, i);
    chain.push_back(*parent);
  }
  const std::vector<BlockHash> fits(chain.begin(), chain.begin() + 8);
  EXPECT_TRUE(state.index().apply_event({7, 0}, KvStoredEvent{std::nullopt, fits, {}}));
  EXPECT_EQ(state.index().apply_event({7, 1}, KvStoredEvent{std::nullopt, chain, {}}).error(),
            IndexError::chain_too_long);
}

TEST_F(DiscoveryStateTest, DeregistrationCascades) {
  ASSERT_TRUE(state_.deregister(7, 1));
  EXPECT_EQ(matches(), 0U);
  EXPECT_EQ(state_.load().open_bookings(), 0U);
  EXPECT_EQ(state_.catalog().size(), 0U);
}

}  // namespace
}  // namespace kvr::discovery
