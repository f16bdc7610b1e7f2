#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "selection/config/parameter_source.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::selection {
namespace {

using plugins::worker_selection::ParameterReader;
using plugins::worker_selection::WorkerSelectionPolicyParameters;
using ::testing::AllOf;
using ::testing::HasSubstr;

ParameterReader reader_for(std::string_view yaml) {
  auto source = ParameterSource::from_text(yaml, "parameters");
  EXPECT_TRUE(source.has_value()) << source.error();
  return WorkerSelectionPolicyParameters{*source}.reader();
}

std::string error_of(const auto& result) {
  EXPECT_FALSE(result.has_value());
  return result.has_value() ? std::string{} : std::string{result.error().message()};
}

TEST(ParameterReaderTest, ReadsEveryScalarType) {
  auto reader = reader_for(
      "{flag: true, small: -7, big: -5000000000, count: 7, huge: 18446744073709551615, "
      "ratio: 0.25, name: least-busy}");
  EXPECT_EQ(reader.required<bool>("flag").value(), true);
  EXPECT_EQ(reader.required<std::int32_t>("small").value(), -7);
  EXPECT_EQ(reader.required<std::int64_t>("big").value(), -5000000000);
  EXPECT_EQ(reader.required<std::uint32_t>("count").value(), 7U);
  EXPECT_EQ(reader.required<std::uint64_t>("huge").value(), 18446744073709551615ULL);
  EXPECT_DOUBLE_EQ(reader.required<double>("ratio").value(), 0.25);
  EXPECT_EQ(reader.required<std::string>("name").value(), "least-busy");
  EXPECT_TRUE(reader.finish().has_value());
}

TEST(ParameterReaderTest, ReadsListsOfEveryKind) {
  auto reader = reader_for(
      "{ints: [1, -2, 3], names: [a, b], ratios: [0.5, 2], none: [], flags: [true, off]}");
  EXPECT_EQ(reader.required<std::vector<std::int32_t>>("ints").value(),
            (std::vector<std::int32_t>{1, -2, 3}));
  EXPECT_EQ(reader.required<std::vector<std::string>>("names").value(),
            (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(reader.required<std::vector<double>>("ratios").value(),
            (std::vector<double>{0.5, 2.0}));
  EXPECT_TRUE(reader.required<std::vector<std::uint64_t>>("none").value().empty());
  EXPECT_EQ(reader.required<std::vector<bool>>("flags").value(), (std::vector<bool>{true, false}));
  EXPECT_TRUE(reader.finish().has_value());
}

TEST(ParameterReaderTest, AcceptsYamlBooleanSpellings) {
  auto reader = reader_for("{a: yes, b: On, c: FALSE}");
  EXPECT_TRUE(reader.required<bool>("a").value());
  EXPECT_TRUE(reader.required<bool>("b").value());
  EXPECT_FALSE(reader.required<bool>("c").value());
}

TEST(ParameterReaderTest, ReadsIntegersInBaseTenAndAcceptsAPlusSign) {
  auto reader = reader_for("{leading_zero: 010, plus: +5, as_double: 3}");
  EXPECT_EQ(reader.required<std::int32_t>("leading_zero").value(), 10);
  EXPECT_EQ(reader.required<std::uint32_t>("plus").value(), 5U);
  EXPECT_DOUBLE_EQ(reader.required<double>("as_double").value(), 3.0);
}

TEST(ParameterReaderTest, ReadsNumbersAsTextForStrings) {
  auto reader = reader_for("{model: 123}");
  EXPECT_EQ(reader.required<std::string>("model").value(), "123");
}

TEST(ParameterReaderTest, OptionalReturnsTheFallbackOnlyWhenAbsent) {
  auto reader = reader_for("{present: 3}");
  EXPECT_EQ(reader.optional<std::int64_t>("present", 9).value(), 3);
  EXPECT_EQ(reader.optional<std::int64_t>("absent", 9).value(), 9);
  EXPECT_EQ(reader.optional<std::string>("label", "x").value(), "x");
}

TEST(ParameterReaderTest, OptionalWithoutFallbackTellsAbsentFromPresent) {
  auto reader = reader_for("{present: 0}");
  EXPECT_EQ(reader.optional<std::uint64_t>("present").value(), std::optional<std::uint64_t>{0});
  EXPECT_EQ(reader.optional<std::uint64_t>("absent").value(), std::nullopt);
}

TEST(ParameterReaderTest, AbsentParametersReadAsEmpty) {
  WorkerSelectionPolicyParameters parameters{nullptr};
  auto reader = parameters.reader();
  EXPECT_EQ(reader.optional<double>("ratio", 1.5).value(), 1.5);
  EXPECT_TRUE(reader.finish().has_value());
}

TEST(ParameterReaderTest, RequiredMissingKeyIsNamedWithTheGivenKeys) {
  auto reader = reader_for("{min_device_overlap: 1}");
  EXPECT_EQ(error_of(reader.required<std::uint32_t>("min_device_overlap_blocks")),
            "parameters.min_device_overlap_blocks: required parameter is missing (given: "
            "'min_device_overlap')");
}

TEST(ParameterReaderTest, RequiredMissingKeyWithoutAnyParameters) {
  auto reader = reader_for("");
  EXPECT_THAT(error_of(reader.required<std::string>("mode")),
              HasSubstr("parameters.mode: required parameter is missing (no parameters given)"));
}

TEST(ParameterReaderTest, RejectsTextForAnInteger) {
  auto reader = reader_for("{limit: abc}");
  EXPECT_EQ(error_of(reader.required<std::int32_t>("limit")),
            "parameters.limit: expected a 32-bit integer, got 'abc'");
}

TEST(ParameterReaderTest, RejectsAFractionForAnInteger) {
  auto reader = reader_for("{limit: 1.5}");
  EXPECT_EQ(error_of(reader.required<std::int64_t>("limit")),
            "parameters.limit: expected a 64-bit integer, got '1.5'");
}

TEST(ParameterReaderTest, RejectsANegativeValueForAnUnsignedType) {
  auto reader = reader_for("{limit: -1}");
  EXPECT_EQ(error_of(reader.required<std::uint32_t>("limit")),
            "parameters.limit: expected a non-negative 32-bit integer, got '-1'");
  EXPECT_THAT(error_of(reader.required<std::uint64_t>("limit")),
              HasSubstr("expected a non-negative 64-bit integer"));
}

TEST(ParameterReaderTest, RejectsAValueOutOfRange) {
  auto reader = reader_for("{limit: 5000000000, tiny: 1e999}");
  EXPECT_EQ(error_of(reader.required<std::int32_t>("limit")),
            "parameters.limit: expected a 32-bit integer, got '5000000000' (out of range)");
  EXPECT_THAT(error_of(reader.required<double>("tiny")), HasSubstr("(out of range)"));
}

TEST(ParameterReaderTest, RejectsAMappingOrListWhereAScalarIsExpected) {
  auto reader = reader_for("{nested: {a: 1}, listed: [1]}");
  EXPECT_EQ(error_of(reader.required<std::string>("nested")),
            "parameters.nested: expected a string, got a mapping");
  EXPECT_EQ(error_of(reader.required<double>("listed")),
            "parameters.listed: expected a finite number, got a list");
}

TEST(ParameterReaderTest, RejectsAQuotedNumber) {
  auto reader = reader_for("{limit: \"5\", flag: 'true'}");
  EXPECT_EQ(error_of(reader.required<std::uint32_t>("limit")),
            "parameters.limit: expected a non-negative 32-bit integer, got \"5\" (quoted, so a "
            "string)");
  EXPECT_THAT(error_of(reader.required<bool>("flag")), HasSubstr("expected a boolean"));
}

TEST(ParameterReaderTest, RejectsNonBooleanTextForABoolean) {
  auto reader = reader_for("{flag: 1}");
  EXPECT_EQ(error_of(reader.required<bool>("flag")),
            "parameters.flag: expected a boolean (true or false), got '1'");
}

TEST(ParameterReaderTest, RejectsNonFiniteNumbers) {
  auto reader = reader_for("{ratio: inf, other: nan}");
  EXPECT_THAT(error_of(reader.required<double>("ratio")), HasSubstr("expected a finite number"));
  EXPECT_THAT(error_of(reader.required<double>("other")), HasSubstr("expected a finite number"));
}

TEST(ParameterReaderTest, RejectsAnExplicitNull) {
  auto reader = reader_for("{limit: ~}");
  EXPECT_EQ(error_of(reader.optional<std::int32_t>("limit", 4)),
            "parameters.limit: expected a 32-bit integer, got null");
}

TEST(ParameterReaderTest, RejectsAScalarWhereAListIsExpected) {
  auto reader = reader_for("{ints: 3}");
  EXPECT_EQ(error_of(reader.required<std::vector<std::int32_t>>("ints")),
            "parameters.ints: expected a list of 32-bit integers, got '3'");
}

TEST(ParameterReaderTest, RejectsAWrongListItemNamingItsIndex) {
  auto reader = reader_for("{ints: [1, 2, x]}");
  EXPECT_EQ(error_of(reader.required<std::vector<std::int32_t>>("ints")),
            "parameters.ints[2]: expected a 32-bit integer, got 'x'");
}

TEST(ParameterReaderTest, FinishNamesEveryUnreadKeyAndWhatWasAccepted) {
  auto reader = reader_for("{min_device_overlap_blocks: 1, min_overlap: 2, extra: 3}");
  ASSERT_TRUE(reader.optional<std::uint32_t>("min_device_overlap_blocks", 0).has_value());
  ASSERT_TRUE(reader.optional<double>("ratio", 0).has_value());
  EXPECT_EQ(error_of(reader.finish()),
            "parameters: unknown parameters 'min_overlap', 'extra'; accepted: "
            "'min_device_overlap_blocks', 'ratio'");
}

TEST(ParameterReaderTest, FinishSaysWhenThePluginTakesNoParameters) {
  auto reader = reader_for("{seed: 1}");
  EXPECT_EQ(error_of(reader.finish()),
            "parameters: unknown parameter 'seed'; this plugin takes no parameters");
}

TEST(ParameterReaderTest, AKeyReadWithTheWrongTypeIsNotAlsoReportedAsUnknown) {
  auto reader = reader_for("{limit: abc}");
  ASSERT_FALSE(reader.required<std::int32_t>("limit").has_value());
  EXPECT_TRUE(reader.finish().has_value());
}

TEST(ParameterSourceTest, KeepsKeysInDocumentOrder) {
  auto source = ParameterSource::from_text("{b: 1, a: 2}", "ctx").value();
  EXPECT_EQ(source->keys(), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(source->context(), "ctx");
  EXPECT_NE(source->find("a"), nullptr);
  EXPECT_EQ(source->find("c"), nullptr);
}

TEST(ParameterSourceTest, RejectsBadYamlWithItsLine) {
  auto source = ParameterSource::from_text("a: 1\nb: [1,\n", "ctx");
  ASSERT_FALSE(source.has_value());
  EXPECT_THAT(source.error(), AllOf(HasSubstr("ctx: line 3"), HasSubstr("invalid YAML")));
}

TEST(ParameterSourceTest, RejectsANonMapping) {
  auto source = ParameterSource::from_text("[1, 2]", "ctx");
  ASSERT_FALSE(source.has_value());
  EXPECT_EQ(source.error(), "ctx: expected a mapping, got a list");
}

TEST(ParameterSourceTest, RejectsADuplicateKey) {
  auto source = ParameterSource::from_text("{a: 1, a: 2}", "ctx");
  ASSERT_FALSE(source.has_value());
  EXPECT_EQ(source.error(), "ctx.a: duplicate key");
}

TEST(ParameterSourceTest, EmptyTextMeansNoParameters) {
  auto source = ParameterSource::from_text("", "ctx").value();
  EXPECT_TRUE(source->keys().empty());
  EXPECT_EQ(source->find("a"), nullptr);
}

}  // namespace
}  // namespace kvr::selection
