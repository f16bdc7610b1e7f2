#include "classifiers/builtin/tenant_class.hpp"

#include <utility>

#include <fmt/format.h>

#include "classifiers/builtin/class_table.hpp"
#include "classifiers/builtin/provider.hpp"

namespace kvr::classifiers::builtin {

using plugins::request_classifier::AdmissionFuture;
using plugins::request_classifier::ClassifyRequest;
using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;

std::expected<TenantClassParameters, RequestClassifierProviderError> TenantClassParameters::read(
    const RequestClassifierParameters& parameters) {
  const auto fail = [](std::string message) {
    return std::unexpected(RequestClassifierProviderError{std::move(message)});
  };
  auto table = read_class_table<std::string>(parameters, "tenants", "tenant", "tenant");
  if (!table) return std::unexpected(table.error());
  TenantClassParameters parsed;
  for (std::size_t i = 0; i < table->rows.size(); ++i) {
    auto& row = table->rows[i];
    if (row.key.empty()) {
      return fail(fmt::format("parameters.tenants[{}].tenant: must not be empty", i));
    }
    // A tenant listed twice would leave one of its classes silently unused.
    if (!parsed.tenants.emplace(row.key, std::move(row.policy_class)).second) {
      return fail(
          fmt::format("parameters.tenants[{}].tenant: tenant '{}' is listed twice", i, row.key));
    }
  }
  parsed.default_class = std::move(table->default_class);
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
  return read_then_make<TenantClassClassifier, TenantClassParameters>(parameters);
}

}  // namespace kvr::classifiers::builtin
