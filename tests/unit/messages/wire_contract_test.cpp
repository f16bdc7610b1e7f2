// The wire contract round-trips through protobuf encoding, and a truncated payload is detected.
#include <gtest/gtest.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"

namespace kvr {
namespace {

TEST(WireContractTest, KvEventBatchRoundTrips) {
  v1::KvEventBatch batch;
  batch.set_worker_id(9);
  batch.set_dp_rank(1);
  batch.set_event_id(17);
  auto* stored = batch.add_events()->mutable_stored();
  stored->set_has_parent(true);
  stored->set_parent_hash(0xDEADBEEFULL);
  stored->add_block_hashes(1);
  stored->add_block_hashes(2);
  stored->set_tier(v1::STORAGE_TIER_HOST);
  batch.add_events()->mutable_cleared();

  v1::KvEventBatch decoded;
  ASSERT_TRUE(decoded.ParseFromString(batch.SerializeAsString()));
  ASSERT_EQ(decoded.events_size(), 2);
  EXPECT_EQ(decoded.event_id(), 17U);
  EXPECT_EQ(decoded.events(0).stored().parent_hash(), 0xDEADBEEFULL);
  EXPECT_EQ(decoded.events(0).stored().tier(), v1::STORAGE_TIER_HOST);
  EXPECT_TRUE(decoded.events(1).has_cleared());
}

TEST(WireContractTest, RouteRequestKeepsOptionalPresence) {
  v1::RouteRequest request;
  request.set_request_id("r1");
  request.mutable_tokens()->add_ids(5);
  request.mutable_session()->set_session_id("s");
  request.mutable_session()->set_session_final(false);
  (*request.mutable_preferred_taints())["gpu=h100"] = 0.5;

  v1::RouteRequest decoded;
  ASSERT_TRUE(decoded.ParseFromString(request.SerializeAsString()));
  EXPECT_EQ(decoded.prompt_case(), v1::RouteRequest::kTokens);
  EXPECT_TRUE(decoded.session().has_session_final());
  EXPECT_FALSE(decoded.session().has_parent_session_id());
  EXPECT_FALSE(decoded.has_expected_output_tokens());
  EXPECT_DOUBLE_EQ(decoded.preferred_taints().at("gpu=h100"), 0.5);
}

TEST(WireContractTest, TruncatedPayloadFailsToParse) {
  v1::WorkerRegistration registration;
  registration.set_worker_id(1);
  registration.set_model("m");
  registration.set_generate_subject("kvr.ns.worker.1.generate");
  std::string bytes = registration.SerializeAsString();
  bytes.resize(bytes.size() - 3);
  v1::WorkerRegistration decoded;
  EXPECT_FALSE(decoded.ParseFromString(bytes));
}

}  // namespace
}  // namespace kvr
