#include "messages/subjects.hpp"

#include <gtest/gtest.h>

namespace kvr::subjects {
namespace {

TEST(SubjectsTest, NamespacedUnderKvr) {
  EXPECT_EQ(router_route("prod"), "kvr.prod.router.route");
  // A partition's own subject: bytes a NATS token cannot carry (the dot, spaces) are escaped.
  EXPECT_EQ(router_partition_route("prod", "llama-3/default"),
            "kvr.prod.router.llama-3/default.route");
  EXPECT_EQ(router_partition_route("prod", "meta.llama 3/batch_1"),
            "kvr.prod.router.meta=2Ellama=203/batch_1.route");
  // A worker's load and KV events name its partition, so that a node follows only its own.
  EXPECT_EQ(partition_kv_events("prod", "meta.llama/default", 42),
            "kvr.prod.kv.meta=2Ellama/default.42");
  EXPECT_EQ(partition_kv_events_all("prod", "m/g"), "kvr.prod.kv.m/g.*");
  EXPECT_EQ(partition_load("prod", "m/g", 42), "kvr.prod.load.m/g.42");
  EXPECT_EQ(partition_load_all("prod", "m/g"), "kvr.prod.load.m/g.*");
  EXPECT_EQ(router_shard_load("prod"), "kvr.prod.router.shard_load");
  EXPECT_EQ(invalid_worker_subject("kvr.prod.load.m/g.42"),
            "is in the routers' own subject space (kvr.<namespace>.load.)");
  // The previous release's subjects.
  EXPECT_EQ(kv_events("prod", 42), "kvr.prod.kv.42");
  EXPECT_EQ(kv_events_all("prod"), "kvr.prod.kv.*");
  EXPECT_EQ(worker_generate("dev", 7), "kvr.dev.worker.7.generate");
}

TEST(SubjectsTest, NamespaceValidation) {
  EXPECT_TRUE(is_valid_namespace("prod-1_a"));
  EXPECT_FALSE(is_valid_namespace(""));
  EXPECT_FALSE(is_valid_namespace("a.b"));
  EXPECT_FALSE(is_valid_namespace("a*"));
  EXPECT_FALSE(is_valid_namespace("a b"));
}

}  // namespace
}  // namespace kvr::subjects
