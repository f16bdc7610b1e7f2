#include "messages/subjects.hpp"

#include <gtest/gtest.h>

namespace kvr::subjects {
namespace {

TEST(SubjectsTest, NamespacedUnderKvr) {
  EXPECT_EQ(router_route("prod"), "kvr.prod.router.route");
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
