#include "classifiers/builtin/tenant_class.hpp"

#include <memory>
#include <utility>

#include <fmt/format.h>

namespace kvr::classifiers::builtin {

using plugins::request_classifier::AdmissionFuture;
using plugins::request_classifier::ClassifyRequest;
using plugins::request_classifier::ParameterReader;
using plugins::request_classifier::RequestClassifierContext;
using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;

std::expected<TenantClassParameters, RequestClassifierProviderError> TenantClassParameters::read(
    const RequestClassifierParameters& parameters) {
  const auto fail = [](std::string message) {
    return std::unexpected(RequestClassifierProviderError{std::move(message)});
  };
  ParameterReader reader = parameters.reader();
  auto entries = reader.required_mappings("tenants");
  if (!entries) return std::unexpected(entries.error());
  auto default_class = reader.optional<std::string>("default_class", "default");
  if (!default_class) return std::unexpected(default_class.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  TenantClassParameters parsed;
  if (entries->empty()) return fail("parameters.tenants: expected at least one tenant, got []");
  for (std::size_t i = 0; i < entries->size(); ++i) {
    ParameterReader& entry = (*entries)[i];
    auto tenant = entry.required<std::string>("tenant");
    if (!tenant) return std::unexpected(tenant.error());
    auto policy_class = entry.required<std::string>("policy_class");
    if (!policy_class) return std::unexpected(policy_class.error());
    if (auto finished = entry.finish(); !finished) return std::unexpected(finished.error());
    if (tenant->empty()) {
      return fail(fmt::format("parameters.tenants[{}].tenant: must not be empty", i));
    }
    if (policy_class->empty()) {
      return fail(fmt::format("parameters.tenants[{}].policy_class: must not be empty", i));
    }
    if (auto known = parameters.check_policy_class(
            *policy_class, fmt::format("parameters.tenants[{}].policy_class", i));
        !known) {
      return std::unexpected(known.error());
    }
    // A tenant listed twice would leave one of its classes silently unused.
    if (!parsed.tenants.emplace(*tenant, std::move(*policy_class)).second) {
      return fail(
          fmt::format("parameters.tenants[{}].tenant: tenant '{}' is listed twice", i, *tenant));
    }
  }
  if (default_class->empty()) return fail("parameters.default_class: must not be empty");
  if (auto known = parameters.check_policy_class(*default_class, "parameters.default_class");
      !known) {
    return std::unexpected(known.error());
  }
  parsed.default_class = std::move(*default_class);
  return parsed;
}

std::string_view TenantClassParameters::class_for(std::optional<std::string_view> tenant) const {
  if (tenant) {
    if (const auto it = tenants.find(*tenant); it != tenants.end()) return it->second;
  }
  return default_class;
}

AdmissionFuture TenantClassClassifier::classify(ClassifyRequest request) {
  request.set_policy_class(std::string{parameters_.class_for(request.tenant())});
  return AdmissionFuture::ready(std::move(request));
}

std::expected<RequestClassifierFactory, RequestClassifierProviderError> tenant_class_provider(
    const RequestClassifierParameters& parameters) {
  auto parsed = TenantClassParameters::read(parameters);
  if (!parsed) return std::unexpected(parsed.error());
  return RequestClassifierFactory{[checked = std::move(*parsed)](const RequestClassifierContext&) {
    return std::make_unique<TenantClassClassifier>(checked);
  }};
}

}  // namespace kvr::classifiers::builtin
