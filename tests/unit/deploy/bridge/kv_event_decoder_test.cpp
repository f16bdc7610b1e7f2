#include "deploy/bridge/kv_event_decoder.hpp"

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

namespace kvr::bridge {
namespace {

#include "tests/unit/deploy/bridge/golden_payloads.inc"

template <std::size_t N>
std::string_view bytes_of(const unsigned char (&payload)[N]) {
  return {reinterpret_cast<const char*>(payload), N};
}

std::vector<std::uint32_t> tokens(std::uint32_t first, std::uint32_t count) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 0; i < count; ++i) out.push_back(first + i);
  return out;
}

EngineBlockStored stored_of(const EngineKvEventBatch& batch, std::size_t index) {
  return std::get<EngineBlockStored>(batch.events.at(index));
}

TEST(KvEventDecoderTest, DecodesTheArrayEncodingOfEveryEventType) {
  auto batch = decode_kv_event_batch(bytes_of(k_array_batch));
  ASSERT_TRUE(batch) << batch.error().message();
  EXPECT_DOUBLE_EQ(batch->ts, 1.5);
  EXPECT_EQ(batch->data_parallel_rank, 0U);
  ASSERT_EQ(batch->events.size(), 3U);
  EXPECT_EQ(stored_of(*batch, 0), (EngineBlockStored{.block_hashes = {11, 12},
                                                     .parent_block_hash = std::nullopt,
                                                     .token_ids = tokens(100, 8),
                                                     .block_size = 4,
                                                     .medium = "GPU"}));
  EXPECT_EQ(std::get<EngineBlockRemoved>(batch->events[1]),
            (EngineBlockRemoved{.block_hashes = {12}, .medium = "GPU"}));
  EXPECT_TRUE(std::holds_alternative<EngineAllBlocksCleared>(batch->events[2]));
}

TEST(KvEventDecoderTest, DecodesTheMapEncodingOfEveryEventType) {
  auto batch = decode_kv_event_batch(bytes_of(k_map_batch));
  ASSERT_TRUE(batch) << batch.error().message();
  EXPECT_DOUBLE_EQ(batch->ts, 2.25);
  EXPECT_EQ(batch->data_parallel_rank, 1U);
  ASSERT_EQ(batch->events.size(), 3U);
  EXPECT_EQ(stored_of(*batch, 0), (EngineBlockStored{.block_hashes = {21, 22},
                                                     .parent_block_hash = 20,
                                                     .token_ids = tokens(100, 8),
                                                     .block_size = 4,
                                                     .lora_id = 3,
                                                     .lora_name = "adapter-a",
                                                     .medium = "CPU"}));
  EXPECT_EQ(std::get<EngineBlockRemoved>(batch->events[1]),
            (EngineBlockRemoved{.block_hashes = {22}, .medium = "CPU"}));
  EXPECT_TRUE(std::holds_alternative<EngineAllBlocksCleared>(batch->events[2]));
}

TEST(KvEventDecoderTest, DecodesMapEventsInsideAnArrayBatch) {
  auto batch = decode_kv_event_batch(bytes_of(k_mixed_batch));
  ASSERT_TRUE(batch) << batch.error().message();
  EXPECT_EQ(batch->data_parallel_rank, 2U);
  ASSERT_EQ(batch->events.size(), 1U);
  EXPECT_EQ(stored_of(*batch, 0).block_hashes, std::vector<EngineBlockHash>{31});
  EXPECT_FALSE(stored_of(*batch, 0).parent_block_hash.has_value());
  EXPECT_FALSE(stored_of(*batch, 0).lora_name.has_value());
}

TEST(KvEventDecoderTest, ReadsSignedAndUnsignedHashesAsTheSame64Bits) {
  auto batch = decode_kv_event_batch(bytes_of(k_signed_unsigned_hashes));
  ASSERT_TRUE(batch) << batch.error().message();
  const EngineBlockStored stored = stored_of(*batch, 0);
  EXPECT_EQ(stored.block_hashes,
            (std::vector<EngineBlockHash>{0xFFFFFFFFFFFFFFFFULL, 0x8000000000000000ULL,
                                          0xFFFFFFFFFFFFFFFFULL}));
  EXPECT_EQ(stored.parent_block_hash, 0xFFFFFFFFFFFFFFFEULL);
  EXPECT_FALSE(batch->data_parallel_rank.has_value());
}

TEST(KvEventDecoderTest, IgnoresFieldsANewerEngineAppends) {
  auto batch = decode_kv_event_batch(bytes_of(k_trailing_fields));
  ASSERT_TRUE(batch) << batch.error().message();
  ASSERT_EQ(batch->events.size(), 2U);
  EXPECT_EQ(stored_of(*batch, 0).medium, "DISK");
  EXPECT_EQ(stored_of(*batch, 0).lora_name, "lora-b");
  EXPECT_EQ(std::get<EngineBlockRemoved>(batch->events[1]).block_hashes,
            std::vector<EngineBlockHash>{41});
}

TEST(KvEventDecoderTest, ReadsMissingOptionalFieldsOfAnOlderEngineAsAbsent) {
  auto batch = decode_kv_event_batch(bytes_of(k_short_fields));
  ASSERT_TRUE(batch) << batch.error().message();
  ASSERT_EQ(batch->events.size(), 2U);
  EXPECT_EQ(stored_of(*batch, 0).medium, "");
  EXPECT_EQ(std::get<EngineBlockRemoved>(batch->events[1]).medium, "");
  EXPECT_FALSE(batch->data_parallel_rank.has_value());
}

TEST(KvEventDecoderTest, FoldsBytesHashesToTheirLastEightBytesBigEndian) {
  auto batch = decode_kv_event_batch(bytes_of(k_bytes_hashes));
  ASSERT_TRUE(batch) << batch.error().message();
  const EngineBlockStored stored = stored_of(*batch, 0);
  EXPECT_EQ(stored.block_hashes, std::vector<EngineBlockHash>{0x0102});
  EXPECT_EQ(stored.parent_block_hash, 0x18191A1B1C1D1E1FULL);
}

TEST(KvEventDecoderTest, KeepsOnlyTheMainAttentionGroupAndCountsTheRest) {
  auto batch = decode_kv_event_batch(bytes_of(k_groups_and_unknown));
  ASSERT_TRUE(batch) << batch.error().message();
  EXPECT_EQ(batch->other_group_events, 2U);
  EXPECT_EQ(batch->unknown_events, 1U);
  ASSERT_EQ(batch->events.size(), 2U);
  EXPECT_EQ(stored_of(*batch, 0).block_hashes, std::vector<EngineBlockHash>{64});
  EXPECT_EQ(stored_of(*batch, 1).block_hashes, std::vector<EngineBlockHash>{65});
  EXPECT_EQ(stored_of(*batch, 1).parent_block_hash, 64U);
}

TEST(KvEventDecoderTest, RejectsEveryTruncationOfAGoldenPayload) {
  for (std::string_view golden : {bytes_of(k_array_batch), bytes_of(k_map_batch)}) {
    for (std::size_t length = 0; length < golden.size(); ++length) {
      auto batch = decode_kv_event_batch(golden.substr(0, length));
      ASSERT_FALSE(batch) << "length " << length;
      // A cut inside a container may leave fewer bytes than the container declares elements.
      EXPECT_TRUE(batch.error().code == DecodeErrorCode::malformed ||
                  batch.error().code == DecodeErrorCode::bad_length)
          << batch.error().message();
    }
  }
}

TEST(KvEventDecoderTest, RejectsBytesAfterTheValue) {
  std::string payload{bytes_of(k_array_batch)};
  payload.push_back('\xc0');
  auto batch = decode_kv_event_batch(payload);
  ASSERT_FALSE(batch);
  EXPECT_EQ(batch.error().code, DecodeErrorCode::malformed);
}

TEST(KvEventDecoderTest, RejectsAHugeArrayHeaderWithoutAllocatingForIt) {
  // array32 of 10^7 elements followed by three nils: a header that lies about its length.
  const std::string payload{"\xdd\x00\x98\x96\x80\xc0\xc0\xc0", 8};
  auto batch = decode_kv_event_batch(payload);
  ASSERT_FALSE(batch);
  EXPECT_EQ(batch.error().code, DecodeErrorCode::bad_length);

  // The same lie one level down, inside a well-formed batch.
  const std::string nested{"\x93\x00\xdd\x00\x98\x96\x80\x91\xc0\xc0", 10};
  auto inner = decode_kv_event_batch(nested);
  ASSERT_FALSE(inner);
  EXPECT_EQ(inner.error().code, DecodeErrorCode::bad_length);

  // A map32 of 2^32 - 1 pairs.
  auto map = decode_kv_event_batch(std::string{"\xdf\xff\xff\xff\xff\xc0\xc0", 7});
  ASSERT_FALSE(map);
  EXPECT_EQ(map.error().code, DecodeErrorCode::bad_length);
}

TEST(KvEventDecoderTest, RejectsANestingDepthBomb) {
  // 100,000 nested one-element arrays (fixarray 1), then a nil.
  std::string bomb(100'000, '\x91');
  bomb.push_back('\xc0');
  auto batch = decode_kv_event_batch(bomb);
  ASSERT_FALSE(batch);
  EXPECT_EQ(batch.error().code, DecodeErrorCode::too_deep);

  // The same with maps (fixmap 1, key nil).
  std::string maps;
  for (int i = 0; i < 50'000; ++i) maps += "\x81\xc0";
  maps.push_back('\xc0');
  auto map_batch = decode_kv_event_batch(maps);
  ASSERT_FALSE(map_batch);
  EXPECT_EQ(map_batch.error().code, DecodeErrorCode::too_deep);
}

TEST(KvEventDecoderTest, RejectsAPayloadAboveTheSizeLimit) {
  auto batch =
      decode_kv_event_batch(bytes_of(k_array_batch), DecoderLimits{.max_payload_bytes = 8});
  ASSERT_FALSE(batch);
  EXPECT_EQ(batch.error().code, DecodeErrorCode::too_large);
}

TEST(KvEventDecoderTest, RejectsEmptyAndInvalidBytes) {
  EXPECT_EQ(decode_kv_event_batch(std::string_view{}).error().code, DecodeErrorCode::malformed);
  // 0xc1 is the one byte msgpack never uses.
  EXPECT_EQ(decode_kv_event_batch(std::string{"\xc1"}).error().code, DecodeErrorCode::malformed);
  EXPECT_EQ(decode_kv_event_batch(std::string{"\x93\x00\xc1\xc0", 4}).error().code,
            DecodeErrorCode::malformed);
}

// Hand-packed payloads: msgpack bytes written out so each test names the one defect it has.
struct Packer {
  std::string out;
  Packer& array(std::uint8_t n) {
    out.push_back(static_cast<char>(0x90 | n));
    return *this;
  }
  Packer& map(std::uint8_t n) {
    out.push_back(static_cast<char>(0x80 | n));
    return *this;
  }
  Packer& str(std::string_view s) {
    out.push_back(static_cast<char>(0xa0 | s.size()));
    out.append(s);
    return *this;
  }
  Packer& uint(std::uint8_t v) {
    out.push_back(static_cast<char>(v & 0x7f));
    return *this;
  }
  Packer& neg1() {
    out.push_back('\xff');
    return *this;
  }
  Packer& nil() {
    out.push_back('\xc0');
    return *this;
  }
  Packer& f64_zero() {
    out.push_back('\xcb');
    out.append(8, '\0');
    return *this;
  }
  Packer& boolean() {
    out.push_back('\xc3');
    return *this;
  }
};

DecodeErrorCode error_of(const std::string& payload) {
  auto batch = decode_kv_event_batch(payload);
  EXPECT_FALSE(batch);
  return batch ? DecodeErrorCode::malformed : batch.error().code;
}

TEST(KvEventDecoderTest, RejectsATopLevelThatIsNoBatch) {
  EXPECT_EQ(error_of(Packer{}.uint(5).out), DecodeErrorCode::not_a_batch);
  EXPECT_EQ(error_of(Packer{}.str("x").out), DecodeErrorCode::not_a_batch);
}

TEST(KvEventDecoderTest, RejectsABatchWithoutTsOrEvents) {
  EXPECT_EQ(error_of(Packer{}.array(0).out), DecodeErrorCode::missing_field);
  EXPECT_EQ(error_of(Packer{}.array(1).f64_zero().out), DecodeErrorCode::missing_field);
  EXPECT_EQ(error_of(Packer{}.map(1).str("ts").f64_zero().out), DecodeErrorCode::missing_field);
}

TEST(KvEventDecoderTest, RejectsBatchFieldsOfTheWrongType) {
  EXPECT_EQ(error_of(Packer{}.array(2).str("now").array(0).out), DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().uint(3).out), DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(Packer{}.array(3).f64_zero().array(0).neg1().out), DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(Packer{}.array(3).f64_zero().array(0).str("0").out),
            DecodeErrorCode::bad_field);
}

TEST(KvEventDecoderTest, RejectsEventsWithoutAStringTag) {
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).uint(1).out),
            DecodeErrorCode::bad_event);
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).array(0).out),
            DecodeErrorCode::bad_event);
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).array(1).uint(1).out),
            DecodeErrorCode::bad_event);
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).map(1).str("type").uint(1).out),
            DecodeErrorCode::bad_event);
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).map(0).out), DecodeErrorCode::bad_event);
}

Packer stored_prefix(std::uint8_t fields) {
  Packer p;
  p.array(2).f64_zero().array(1).array(static_cast<std::uint8_t>(fields + 1)).str("BlockStored");
  return p;
}

TEST(KvEventDecoderTest, RejectsABlockStoredWithoutItsRequiredFields) {
  EXPECT_EQ(error_of(stored_prefix(0).out), DecodeErrorCode::missing_field);
  EXPECT_EQ(error_of(stored_prefix(2).array(1).uint(1).nil().out), DecodeErrorCode::missing_field);
  EXPECT_EQ(error_of(stored_prefix(3).array(1).uint(1).nil().array(0).out),
            DecodeErrorCode::missing_field);
}

TEST(KvEventDecoderTest, RejectsABlockStoredWithBadFieldValues) {
  // Hashes that are not a list, a hash that is a string, a parent that is a bool.
  EXPECT_EQ(error_of(stored_prefix(4).uint(1).nil().array(0).uint(4).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(4).array(1).str("h").nil().array(0).uint(4).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(4).array(1).uint(1).boolean().array(0).uint(4).out),
            DecodeErrorCode::bad_field);
  // A negative token, a token list that is a map, a block size of 0, a string block size.
  EXPECT_EQ(error_of(stored_prefix(4).array(1).uint(1).nil().array(1).neg1().uint(4).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(4).array(1).uint(1).nil().map(0).uint(4).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(4).array(1).uint(1).nil().array(0).uint(0).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(4).array(1).uint(1).nil().array(0).str("4").out),
            DecodeErrorCode::bad_field);
  // A lora_id that is a string, a medium that is a number, a group that is a string.
  EXPECT_EQ(error_of(stored_prefix(5).array(1).uint(1).nil().array(0).uint(4).str("x").out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(6).array(1).uint(1).nil().array(0).uint(4).nil().uint(1).out),
            DecodeErrorCode::bad_field);
  EXPECT_EQ(error_of(stored_prefix(9)
                         .array(1)
                         .uint(1)
                         .nil()
                         .array(0)
                         .uint(4)
                         .nil()
                         .nil()
                         .nil()
                         .nil()
                         .str("0")
                         .out),
            DecodeErrorCode::bad_field);
}

TEST(KvEventDecoderTest, RejectsABlockRemovedWithoutHashes) {
  EXPECT_EQ(error_of(Packer{}.array(2).f64_zero().array(1).array(1).str("BlockRemoved").out),
            DecodeErrorCode::missing_field);
  EXPECT_EQ(error_of(Packer{}
                         .array(2)
                         .f64_zero()
                         .array(1)
                         .map(2)
                         .str("type")
                         .str("BlockRemoved")
                         .str("block_hashes")
                         .nil()
                         .out),
            DecodeErrorCode::bad_field);
}

TEST(KvEventDecoderTest, RejectsMoreEventsOrBlocksThanTheLimits) {
  auto events = decode_kv_event_batch(bytes_of(k_array_batch), DecoderLimits{.max_events = 2});
  ASSERT_FALSE(events);
  EXPECT_EQ(events.error().code, DecodeErrorCode::too_many);
  auto blocks =
      decode_kv_event_batch(bytes_of(k_array_batch), DecoderLimits{.max_blocks_per_event = 1});
  ASSERT_FALSE(blocks);
  EXPECT_EQ(blocks.error().code, DecodeErrorCode::too_many);
  auto tokens_limit =
      decode_kv_event_batch(bytes_of(k_array_batch), DecoderLimits{.max_tokens_per_event = 7});
  ASSERT_FALSE(tokens_limit);
  EXPECT_EQ(tokens_limit.error().code, DecodeErrorCode::too_many);
}

TEST(KvEventDecoderTest, ErrorMessagesNameTheCodeAndThePlace) {
  auto batch = decode_kv_event_batch(stored_prefix(0).out);
  ASSERT_FALSE(batch);
  EXPECT_EQ(batch.error().message(), "missing_field: events[0].block_hashes");
}

TEST(KvEventDecoderTest, SurvivesHundredThousandMutatedPayloads) {
  // Deterministic mutations of every golden payload: flipped bits, overwritten, inserted and
  // removed bytes. Each must decode or fail cleanly; the sanitizers catch anything else.
  const std::vector<std::string_view> goldens = {
      bytes_of(k_array_batch),     bytes_of(k_map_batch),
      bytes_of(k_mixed_batch),     bytes_of(k_signed_unsigned_hashes),
      bytes_of(k_trailing_fields), bytes_of(k_short_fields),
      bytes_of(k_bytes_hashes),    bytes_of(k_groups_and_unknown)};
  std::mt19937_64 random{20240614};
  std::size_t decoded = 0;
  constexpr int kMutations = 100'000;
  for (int i = 0; i < kMutations; ++i) {
    std::string payload{goldens[random() % goldens.size()]};
    const int edits = 1 + static_cast<int>(random() % 4);
    for (int e = 0; e < edits && !payload.empty(); ++e) {
      const std::size_t at = random() % payload.size();
      switch (random() % 4) {
        case 0:
          payload[at] = static_cast<char>(payload[at] ^ (1 << (random() % 8)));
          break;
        case 1:
          payload[at] = static_cast<char>(random());
          break;
        case 2:
          payload.insert(at, 1, static_cast<char>(random()));
          break;
        default:
          payload.erase(at, 1);
          break;
      }
    }
    auto batch = decode_kv_event_batch(payload);
    if (batch) {
      ++decoded;
      EXPECT_LE(batch->events.size(), payload.size());
    } else {
      EXPECT_FALSE(batch.error().message().empty());
    }
  }
  // Some mutations keep the payload valid (a changed hash or token); most do not.
  EXPECT_GT(decoded, 0U);
  EXPECT_LT(decoded, static_cast<std::size_t>(kMutations));
}

}  // namespace
}  // namespace kvr::bridge
