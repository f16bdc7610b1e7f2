// tenant-class: the policy class from the request's tenant (a listed tenant, an unlisted one,
// none), admission at once with nothing else changed, and the checks of the `tenants` list.
#include "classifiers/builtin/tenant_class.hpp"

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

TenantClassParameters read(std::string_view yaml) {
  auto parsed = TenantClassParameters::read(testing::parameters(yaml));
  EXPECT_TRUE(parsed.has_value()) << parsed.error().message();
  return parsed.value_or(TenantClassParameters{});
}

class TenantClassTest : public ::testing::Test {
 protected:
  std::string class_of(std::optional<std::string> tenant) {
    auto admission = Admission::start(
        classifier_, make_request({.id = "r", .input_tokens = 300, .tenant = std::move(tenant)}),
        kStart);
    EXPECT_TRUE(admission->is_ready());
    if (!admission->is_ready()) return {};
    EXPECT_EQ(admission->polls(), 1);
    EXPECT_EQ(admission->request().scheduling_cost_tokens(), 300U);  // left alone
    EXPECT_FALSE(admission->request().due_at().has_value());
    return std::string{admission->request().policy_class()};
  }

  TenantClassClassifier classifier_{
      read("{tenants: [{tenant: heavy, policy_class: bulk}, "
           "{tenant: light, policy_class: interactive}], default_class: other}")};
};

TEST_F(TenantClassTest, EachListedTenantGetsItsClass) {
  EXPECT_EQ(class_of("heavy"), "bulk");
  EXPECT_EQ(class_of("light"), "interactive");
}

TEST_F(TenantClassTest, AnUnlistedTenantAndNoTenantGetTheDefaultClass) {
  EXPECT_EQ(class_of("someone-else"), "other");
  EXPECT_EQ(class_of("Heavy"), "other") << "tenant names are case-sensitive";
  EXPECT_EQ(class_of(std::nullopt), "other");
}

TEST(TenantClassParametersTest, TheDefaultClassIsDefault) {
  const TenantClassParameters parameters = read("{tenants: [{tenant: a, policy_class: x}]}");
  ASSERT_EQ(parameters.tenants.size(), 1U);
  EXPECT_EQ(parameters.tenants.at("a"), "x");
  EXPECT_EQ(parameters.class_for("a"), "x");
  EXPECT_EQ(parameters.class_for("b"), "default");
  EXPECT_EQ(parameters.class_for(std::nullopt), "default");
}

TEST(TenantClassParametersTest, BadTenantsFailNamingTheKey) {
  EXPECT_THAT(parameter_error<TenantClassParameters>("{default_class: x}"),
              HasSubstr("parameters.tenants: required parameter is missing"));
  EXPECT_EQ(parameter_error<TenantClassParameters>("{tenants: []}"),
            "parameters.tenants: expected at least one tenant, got []");
  EXPECT_THAT(parameter_error<TenantClassParameters>("{tenants: heavy}"),
              HasSubstr("parameters.tenants: expected a list of mappings"));
  EXPECT_THAT(parameter_error<TenantClassParameters>("{tenants: [heavy]}"),
              HasSubstr("parameters.tenants[0]: expected a mapping"));
  EXPECT_THAT(parameter_error<TenantClassParameters>("{tenants: [{policy_class: x}]}"),
              HasSubstr("parameters.tenants[0].tenant: required parameter is missing"));
  EXPECT_THAT(parameter_error<TenantClassParameters>("{tenants: [{tenant: a}]}"),
              HasSubstr("parameters.tenants[0].policy_class: required parameter is missing"));
  EXPECT_EQ(parameter_error<TenantClassParameters>("{tenants: [{tenant: '', policy_class: x}]}"),
            "parameters.tenants[0].tenant: must not be empty");
  EXPECT_EQ(parameter_error<TenantClassParameters>("{tenants: [{tenant: a, policy_class: ''}]}"),
            "parameters.tenants[0].policy_class: must not be empty");
  EXPECT_EQ(parameter_error<TenantClassParameters>(
                "{tenants: [{tenant: a, policy_class: x}, {tenant: a, policy_class: y}]}"),
            "parameters.tenants[1].tenant: tenant 'a' is listed twice");
  EXPECT_THAT(parameter_error<TenantClassParameters>(
                  "{tenants: [{tenant: a, policy_class: x, quantum: 5}]}"),
              HasSubstr("parameters.tenants[0]: unknown parameter 'quantum'"));
  EXPECT_EQ(parameter_error<TenantClassParameters>(
                "{tenants: [{tenant: a, policy_class: x}], default_class: ''}"),
            "parameters.default_class: must not be empty");
  EXPECT_THAT(parameter_error<TenantClassParameters>(
                  "{tenants: [{tenant: a, policy_class: x}], tenant: b}"),
              HasSubstr("unknown parameter 'tenant'"));
}

TEST(TenantClassParametersTest, AClassThatIsNotConfiguredFailsNamingTheKey) {
  auto source = ParameterSource::from_text(
      "{tenants: [{tenant: a, policy_class: x}, {tenant: b, policy_class: y}]}", "parameters");
  ASSERT_TRUE(source) << source.error();
  const RequestClassifierParameters parameters{*source, std::vector<std::string>{"x"}};
  auto parsed = TenantClassParameters::read(parameters);
  ASSERT_FALSE(parsed);
  EXPECT_THAT(std::string{parsed.error().message()},
              HasSubstr("parameters.tenants[1].policy_class: unknown policy class 'y'"));

  auto bad_default = ParameterSource::from_text(
      "{tenants: [{tenant: a, policy_class: x}], default_class: z}", "parameters");
  ASSERT_TRUE(bad_default) << bad_default.error();
  auto parsed_default = TenantClassParameters::read(
      RequestClassifierParameters{*bad_default, std::vector<std::string>{"x"}});
  ASSERT_FALSE(parsed_default);
  EXPECT_THAT(std::string{parsed_default.error().message()},
              HasSubstr("parameters.default_class: unknown policy class 'z'"));
}

}  // namespace
}  // namespace kvr::classifiers::builtin
