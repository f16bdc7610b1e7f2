#include "messages/error.hpp"

#include <gtest/gtest.h>

#include "actors/caf_error.hpp"

namespace kvr {
namespace {

TEST(ErrorTest, MapsToWireCodes) {
  EXPECT_EQ(to_route_error_code(Error::no_workers), v1::ROUTE_ERROR_NO_WORKERS);
  EXPECT_EQ(to_route_error_code(Error::all_filtered), v1::ROUTE_ERROR_ALL_FILTERED);
  EXPECT_EQ(to_route_error_code(Error::rejected), v1::ROUTE_ERROR_REJECTED);
  EXPECT_EQ(to_route_error_code(Error::bad_message), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_EQ(to_route_error_code(Error::overloaded), v1::ROUTE_ERROR_OVERLOADED);
  EXPECT_EQ(to_route_error_code(Error::rate_limited), v1::ROUTE_ERROR_RATE_LIMITED);
  EXPECT_EQ(to_route_error_code(Error::due_time_expired), v1::ROUTE_ERROR_DUE_TIME_EXPIRED);
  EXPECT_EQ(to_route_error_code(Error::owner_lost), v1::ROUTE_ERROR_OWNER_LOST);
}

// The admission codes were appended: the numbers clients already know keep their meaning.
TEST(ErrorTest, AdmissionCodesAreAppendedToBothEnums) {
  EXPECT_EQ(static_cast<int>(Error::unknown_booking), 11);
  EXPECT_EQ(static_cast<int>(Error::overloaded), 12);
  EXPECT_EQ(static_cast<int>(Error::rate_limited), 13);
  EXPECT_EQ(static_cast<int>(Error::due_time_expired), 14);
  EXPECT_EQ(v1::ROUTE_ERROR_UNAVAILABLE, 8);
  EXPECT_EQ(v1::ROUTE_ERROR_OVERLOADED, 9);
  EXPECT_EQ(v1::ROUTE_ERROR_RATE_LIMITED, 10);
  EXPECT_EQ(v1::ROUTE_ERROR_DUE_TIME_EXPIRED, 11);
  EXPECT_EQ(as_str(Error::due_time_expired), "due_time_expired");
  EXPECT_EQ(static_cast<int>(Error::owner_lost), 15);
  EXPECT_EQ(v1::ROUTE_ERROR_OWNER_LOST, 12);
  EXPECT_FALSE(is_admission_rejection(v1::ROUTE_ERROR_OWNER_LOST));
}

TEST(ErrorTest, EveryCodeHasAName) {
  for (int code = static_cast<int>(Error::invalid_request);
       code <= static_cast<int>(Error::owner_lost); ++code) {
    EXPECT_NE(as_str(static_cast<Error>(code)), "unknown_error") << code;
  }
}

TEST(ErrorTest, AdmissionRejectionsAreTheClassifiersCodesOnly) {
  for (const Error error :
       {Error::overloaded, Error::rate_limited, Error::due_time_expired, Error::rejected}) {
    EXPECT_TRUE(is_admission_rejection(to_route_error_code(error))) << as_str(error);
  }
  for (const Error error :
       {Error::invalid_request, Error::no_workers, Error::all_filtered, Error::policy_failed,
        Error::timeout, Error::worker_failed, Error::unavailable}) {
    EXPECT_FALSE(is_admission_rejection(to_route_error_code(error))) << as_str(error);
  }
}

TEST(ErrorTest, CarriedByCafErrorWithKvrCategory) {
  caf::error error = caf::make_error(Error::all_filtered, "every worker filtered");
  EXPECT_EQ(error.category(), caf::atom("kvr"));
  EXPECT_EQ(error.code(), static_cast<std::uint8_t>(Error::all_filtered));
  EXPECT_TRUE(error == Error::all_filtered);
}

}  // namespace
}  // namespace kvr
