#include "selection/wire/worker_messages.hpp"

#include <gtest/gtest.h>

#include "kvr/v1/kv_events.pb.h"
#include "kvr/v1/worker.pb.h"

namespace kvr {
namespace {

WorkerMessageLimits limits() {
  WorkerMessageLimits result;
  result.registration.required_block_size = 16;
  return result;
}

TEST(WorkerMessagesTest, GarbageBytesAreRefusedByEveryDecoder) {
  const std::string garbage = "\xff\xff\xff garbage";
  EXPECT_FALSE(decode_worker_registration(garbage, limits()));
  EXPECT_FALSE(decode_worker_heartbeat(garbage));
  EXPECT_FALSE(decode_worker_deregistration(garbage));
  EXPECT_FALSE(decode_worker_load(garbage, limits()));
  EXPECT_FALSE(decode_kv_events(garbage, limits()));
  EXPECT_FALSE(decode_kv_dump_reply(garbage, limits()));
}

TEST(WorkerMessagesTest, RegistrationWithAnotherBlockSizeIsRefusedNamingTheField) {
  v1::WorkerRegistration wire;
  wire.set_worker_id(5);
  wire.set_incarnation(1);
  wire.set_model("m");
  wire.set_role(v1::WORKER_ROLE_AGGREGATED);
  wire.set_block_size(32);
  wire.set_total_kv_blocks(100);
  auto refused = decode_worker_registration(wire.SerializeAsString(), limits());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().find("block_size"), std::string::npos) << refused.error();
  wire.set_block_size(16);
  EXPECT_TRUE(decode_worker_registration(wire.SerializeAsString(), limits()));
}

TEST(WorkerMessagesTest, HeartbeatNeedsAWorkerId) {
  v1::WorkerHeartbeat wire;
  EXPECT_FALSE(decode_worker_heartbeat(wire.SerializeAsString()));
  wire.set_worker_id(9);
  wire.set_incarnation(3);
  auto heartbeat = decode_worker_heartbeat(wire.SerializeAsString());
  ASSERT_TRUE(heartbeat);
  EXPECT_EQ(heartbeat->worker_id, 9U);
  EXPECT_EQ(heartbeat->incarnation, 3U);
}

TEST(WorkerMessagesTest, LoadRefusesAbsurdValues) {
  v1::LoadMetrics wire;
  wire.set_worker_id(9);
  auto* rank = wire.add_ranks();
  rank->set_active_requests(1);
  rank->set_waiting_requests(5);  // more waiting than active
  EXPECT_FALSE(decode_worker_load(wire.SerializeAsString(), limits()));
  rank->set_waiting_requests(0);
  rank->set_kv_blocks_used(std::uint64_t{1} << 40);
  EXPECT_FALSE(decode_worker_load(wire.SerializeAsString(), limits()));
  rank->set_kv_blocks_used(10);
  wire.add_ranks()->set_dp_rank(0);  // rank 0 twice
  EXPECT_FALSE(decode_worker_load(wire.SerializeAsString(), limits()));
  wire.mutable_ranks()->RemoveLast();
  auto load = decode_worker_load(wire.SerializeAsString(), limits());
  ASSERT_TRUE(load) << load.error();
  ASSERT_EQ(load->ranks.size(), 1U);
  EXPECT_EQ(load->ranks.front().second.kv_blocks_used, 10U);
}

TEST(WorkerMessagesTest, KvBatchWithoutEventIdIsRefused) {
  v1::KvEventBatch wire;
  wire.set_worker_id(9);
  wire.add_events()->mutable_cleared();
  EXPECT_FALSE(decode_kv_events(wire.SerializeAsString(), limits()));
  wire.set_event_id(1);
  EXPECT_TRUE(decode_kv_events(wire.SerializeAsString(), limits()));
}

}  // namespace
}  // namespace kvr
