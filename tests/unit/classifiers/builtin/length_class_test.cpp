// length-class: the policy class from the request's length at each bucket boundary, admission at
// once with nothing else changed, and the checks of the `buckets` list.
#include "classifiers/builtin/length_class.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/classifiers/builtin/classifier_host.hpp"

namespace kvr::classifiers::builtin {
namespace {

using namespace plugins::request_classifier;
using testing::Admission;
using ::testing::HasSubstr;
using testing::make_request;
using testing::parameter_error;

const TimePoint kStart{};

LengthClassParameters read(std::string_view yaml) {
  auto parsed = LengthClassParameters::read(testing::parameters(yaml));
  EXPECT_TRUE(parsed.has_value()) << parsed.error().message();
  return parsed.value_or(LengthClassParameters{});
}

class LengthClassTest : public ::testing::Test {
 protected:
  std::string class_of(std::size_t input_tokens) {
    auto admission = Admission::start(
        classifier_, make_request({.id = "r", .input_tokens = input_tokens}), kStart);
    EXPECT_TRUE(admission->is_ready());
    if (!admission->is_ready()) return {};
    EXPECT_EQ(admission->polls(), 1);
    EXPECT_EQ(admission->request().scheduling_cost_tokens(), input_tokens);  // left alone
    return std::string{admission->request().policy_class()};
  }

  LengthClassClassifier classifier_{
      read("{buckets: [{max_input_tokens: 512, policy_class: short}, "
           "{max_input_tokens: 4096, policy_class: medium}], default_class: long}")};
};

TEST_F(LengthClassTest, EachBucketIncludesItsBound) {
  EXPECT_EQ(class_of(0), "short");
  EXPECT_EQ(class_of(512), "short");
  EXPECT_EQ(class_of(513), "medium");
  EXPECT_EQ(class_of(4096), "medium");
  EXPECT_EQ(class_of(4097), "long");
  EXPECT_EQ(class_of(1'000'000), "long");
}

TEST(LengthClassParametersTest, TheDefaultClassIsDefault) {
  const LengthClassParameters parameters =
      read("{buckets: [{max_input_tokens: 100, policy_class: tiny}]}");
  ASSERT_EQ(parameters.buckets.size(), 1U);
  EXPECT_EQ(parameters.buckets[0].max_input_tokens, 100U);
  EXPECT_EQ(parameters.buckets[0].policy_class, "tiny");
  EXPECT_EQ(parameters.class_for(100), "tiny");
  EXPECT_EQ(parameters.class_for(101), "default");
}

TEST(LengthClassParametersTest, BadBucketsFailNamingTheKey) {
  EXPECT_THAT(parameter_error<LengthClassParameters>("{default_class: long}"),
              HasSubstr("parameters.buckets: required parameter is missing"));
  EXPECT_EQ(parameter_error<LengthClassParameters>("{buckets: []}"),
            "parameters.buckets: expected at least one bucket, got []");
  EXPECT_THAT(parameter_error<LengthClassParameters>("{buckets: 512}"),
              HasSubstr("parameters.buckets: expected a list of mappings"));
  EXPECT_THAT(parameter_error<LengthClassParameters>("{buckets: [512]}"),
              HasSubstr("parameters.buckets[0]: expected a mapping"));
  EXPECT_EQ(parameter_error<LengthClassParameters>(
                "{buckets: [{max_input_tokens: 4096, policy_class: a}, "
                "{max_input_tokens: 512, policy_class: b}]}"),
            "parameters.buckets[1].max_input_tokens: buckets must be strictly ascending, got 512 "
            "after 4096");
  EXPECT_THAT(
      parameter_error<LengthClassParameters>("{buckets: [{max_input_tokens: 512, policy_class: a}, "
                                             "{max_input_tokens: 512, policy_class: b}]}"),
      HasSubstr("parameters.buckets[1].max_input_tokens: buckets must be strictly"));
  EXPECT_THAT(parameter_error<LengthClassParameters>("{buckets: [{max_input_tokens: 512}]}"),
              HasSubstr("parameters.buckets[0].policy_class: required parameter is missing"));
  EXPECT_THAT(parameter_error<LengthClassParameters>(
                  "{buckets: [{max_input_tokens: -1, policy_class: a}]}"),
              HasSubstr("parameters.buckets[0].max_input_tokens: expected a non-negative"));
  EXPECT_EQ(parameter_error<LengthClassParameters>(
                "{buckets: [{max_input_tokens: 1, policy_class: ''}]}"),
            "parameters.buckets[0].policy_class: must not be empty");
  EXPECT_THAT(parameter_error<LengthClassParameters>(
                  "{buckets: [{max_input_tokens: 1, policy_class: a, quantum: 5}]}"),
              HasSubstr("parameters.buckets[0]: unknown parameter 'quantum'"));
  EXPECT_EQ(parameter_error<LengthClassParameters>(
                "{buckets: [{max_input_tokens: 1, policy_class: a}], default_class: ''}"),
            "parameters.default_class: must not be empty");
  EXPECT_THAT(parameter_error<LengthClassParameters>(
                  "{buckets: [{max_input_tokens: 1, policy_class: a}], default: b}"),
              HasSubstr("unknown parameter 'default'"));
}

}  // namespace
}  // namespace kvr::classifiers::builtin
