// KV event codec: plain batches and dumps round-trip through the wire form, and absurd or
// malformed wire messages are rejected with a specific error.
#include "selection/wire/kv_event_codec.hpp"

#include <gtest/gtest.h>

namespace kvr {
namespace {

KvEventBatch sample_batch() {
  return KvEventBatch{{9, 2},
                      4,
                      17,
                      {KvStoredEvent{0xABCULL, {1, 2, 3}, StorageTier::Host},
                       KvStoredEvent{std::nullopt, {7}, StorageTier::Device},
                       KvRemovedEvent{{2, 3}, StorageTier::Disk}, KvClearedEvent{}}};
}

TEST(KvEventCodecTest, BatchRoundTrips) {
  const KvEventBatch batch = sample_batch();
  v1::KvEventBatch wire;
  ASSERT_TRUE(wire.ParseFromString(encode_kv_event_batch(batch).SerializeAsString()));
  const auto decoded = decode_kv_event_batch(wire);
  ASSERT_TRUE(decoded) << decoded.error().message();
  EXPECT_EQ(*decoded, batch);
}

TEST(KvEventCodecTest, DumpRoundTrips) {
  const KvDump dump{{9, 1},
                    4,
                    30,
                    {KvStoredEvent{std::nullopt, {1, 2}, StorageTier::Device},
                     KvStoredEvent{2, {5}, StorageTier::Host}}};
  const auto decoded = decode_kv_dump(encode_kv_dump(dump));
  ASSERT_TRUE(decoded);
  EXPECT_EQ(*decoded, dump);
}

TEST(KvEventCodecTest, RejectsMissingIds) {
  auto wire = encode_kv_event_batch(sample_batch());
  wire.set_worker_id(0);
  EXPECT_EQ(decode_kv_event_batch(wire).error().code, KvCodecErrorCode::missing_worker_id);
  wire = encode_kv_event_batch(sample_batch());
  wire.set_event_id(0);
  EXPECT_EQ(decode_kv_event_batch(wire).error().code, KvCodecErrorCode::missing_event_id);
}

TEST(KvEventCodecTest, RejectsAbsurdSizes) {
  KvCodecLimits limits;
  limits.max_blocks_per_event = 2;
  const auto error = decode_kv_event_batch(encode_kv_event_batch(sample_batch()), limits).error();
  EXPECT_EQ(error, (KvCodecError{KvCodecErrorCode::too_many_blocks, 0}));
  EXPECT_EQ(error.message(), "too_many_blocks at event 0");
  limits = {};
  limits.max_events_per_batch = 3;
  EXPECT_EQ(decode_kv_event_batch(encode_kv_event_batch(sample_batch()), limits).error().code,
            KvCodecErrorCode::too_many_events);
  limits = {};
  limits.max_blocks_per_dump = 2;
  const KvDump dump{{9, 1},
                    4,
                    30,
                    {KvStoredEvent{std::nullopt, {1, 2}, StorageTier::Device},
                     KvStoredEvent{2, {5}, StorageTier::Host}}};
  EXPECT_EQ(decode_kv_dump(encode_kv_dump(dump), limits).error(),
            (KvCodecError{KvCodecErrorCode::too_many_blocks, 1}));
}

TEST(KvEventCodecTest, RejectsUnknownTierAndEmptyEvent) {
  auto wire = encode_kv_event_batch(sample_batch());
  wire.mutable_events(2)->mutable_removed()->set_tier(static_cast<v1::StorageTier>(9));
  EXPECT_EQ(decode_kv_event_batch(wire).error(), (KvCodecError{KvCodecErrorCode::unknown_tier, 2}));
  wire = encode_kv_event_batch(sample_batch());
  wire.add_events();
  EXPECT_EQ(decode_kv_event_batch(wire).error(),
            (KvCodecError{KvCodecErrorCode::missing_event_kind, 4}));
}

}  // namespace
}  // namespace kvr
