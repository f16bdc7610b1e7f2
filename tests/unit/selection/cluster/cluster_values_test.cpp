// The router cluster's records: bucket names, escaped keys and the protobuf values round trip.
#include "selection/cluster/cluster_values.hpp"

#include <gtest/gtest.h>

namespace kvr::cluster {
namespace {

TEST(ClusterValuesTest, BucketNamesCarryTheNamespace) {
  EXPECT_EQ(members_bucket("prod"), "kvr_prod_members");
  EXPECT_EQ(partitions_bucket("prod"), "kvr_prod_partitions");
}

TEST(ClusterValuesTest, KeysEscapeWhatJetStreamRefusesAndParseBack) {
  const std::string partition = "Qwen/Qwen3-0.6B:v1.5 x/default";
  const std::string key = lease_key(partition);
  EXPECT_EQ(key, "lease.Qwen/Qwen3-0=2E6B=3Av1=2E5=20x/default");
  for (const char c : key.substr(6)) {
    EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '/' ||
                c == '=')
        << c;
  }
  const auto parsed = parse_partitions_key(key);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->partition, partition);
  EXPECT_FALSE(parsed->is_ready);

  const auto ready = parse_partitions_key(ready_key(partition));
  ASSERT_TRUE(ready.has_value());
  EXPECT_EQ(ready->partition, partition);
  EXPECT_TRUE(ready->is_ready);

  EXPECT_EQ(parse_member_key(member_key("node a.1")), "node a.1");
}

TEST(ClusterValuesTest, KeysThatKvrDoesNotWriteAreRefused) {
  EXPECT_FALSE(parse_partitions_key("other.m/default").has_value());
  EXPECT_FALSE(parse_partitions_key("lease.").has_value());
  EXPECT_FALSE(parse_partitions_key("lease.m=2").has_value());   // cut escape
  EXPECT_FALSE(parse_partitions_key("lease.m=zz").has_value());  // not hex
  EXPECT_FALSE(parse_partitions_key("lease.m=41").has_value());  // 'A' needs no escape
  EXPECT_FALSE(parse_member_key("").has_value());
}

TEST(ClusterValuesTest, EscapingIsInjective) {
  // The separator of model and group cannot be forged by a model name: '/' stays, '=' escapes.
  EXPECT_NE(escape_key_token("a=2F"), escape_key_token("a/"));
  EXPECT_EQ(unescape_key_token(escape_key_token("a=2F")), "a=2F");
}

TEST(ClusterValuesTest, ValuesRoundTrip) {
  const MemberRecord member{"node-1", 42, "127.0.0.1:4300", 2.5, 1'700'000'000'000};
  EXPECT_EQ(decode_member(encode(member)), member);
  const LeaseValue lease{"node-1", 42, true};
  EXPECT_EQ(decode_lease(encode(lease)), lease);
  EXPECT_EQ(decode_lease(encode(LeaseValue{})), LeaseValue{});
  const ReadyValue ready{"node-2", 7};
  EXPECT_EQ(decode_ready(encode(ready)), ready);
}

TEST(ClusterValuesTest, DecodersRefuseBadRecords) {
  EXPECT_FALSE(decode_member("\xff\xff\xff").has_value());
  EXPECT_FALSE(decode_member(encode(MemberRecord{"", 1, "a:1", 1, 0})).has_value());
  EXPECT_FALSE(decode_member(encode(MemberRecord{"n", 0, "a:1", 1, 0})).has_value());
  EXPECT_FALSE(decode_member(encode(MemberRecord{"n", 1, "a:1", 0, 0})).has_value());
  EXPECT_FALSE(decode_lease(encode(LeaseValue{"", 0, true})).has_value());
  EXPECT_FALSE(decode_ready(encode(ReadyValue{"", 3})).has_value());
}

}  // namespace
}  // namespace kvr::cluster
