#include "selection/classifiers_registration.hpp"

#include <array>
#include <string>

#include "classifiers/builtin/kv_capacity_pause.hpp"
#include "classifiers/builtin/length_class.hpp"
#include "classifiers/builtin/max_in_flight.hpp"
#include "classifiers/builtin/tenant_class.hpp"
#include "classifiers/builtin/token_bucket.hpp"

namespace kvr::selection {
namespace {

using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;

struct BuiltinClassifier {
  std::string_view type;
  std::expected<RequestClassifierFactory, RequestClassifierProviderError> (*provider)(
      const RequestClassifierParameters&);
};

constexpr std::array<BuiltinClassifier, 5> kBuiltinClassifiers{{
    {classifiers::builtin::kKvCapacityPauseType, &classifiers::builtin::kv_capacity_pause_provider},
    {classifiers::builtin::kLengthClassType, &classifiers::builtin::length_class_provider},
    {classifiers::builtin::kMaxInFlightType, &classifiers::builtin::max_in_flight_provider},
    {classifiers::builtin::kTenantClassType, &classifiers::builtin::tenant_class_provider},
    {classifiers::builtin::kTokenBucketType, &classifiers::builtin::token_bucket_provider},
}};

constexpr std::array<std::string_view, kBuiltinClassifiers.size()> kBuiltinClassifierTypes = [] {
  std::array<std::string_view, kBuiltinClassifiers.size()> types{};
  for (std::size_t i = 0; i < kBuiltinClassifiers.size(); ++i) {
    types[i] = kBuiltinClassifiers[i].type;
  }
  return types;
}();

}  // namespace

std::span<const std::string_view> builtin_classifier_types() { return kBuiltinClassifierTypes; }

std::expected<void, plugins::RegistryError> register_builtin_classifiers(
    plugins::RouterPluginRegistry& registry) {
  for (const BuiltinClassifier& classifier : kBuiltinClassifiers) {
    auto registered =
        registry.register_request_classifier(std::string{classifier.type}, classifier.provider);
    if (!registered) return registered;
  }
  return {};
}

}  // namespace kvr::selection
