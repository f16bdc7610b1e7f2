// The built-in request classifier `tenant-class`: puts each request in the policy class configured
// for the tenant it names, e.g. each tenant in a class of its own so that deficit round robin
// shares the fleet between tenants, and always admits it. A request whose tenant is not listed,
// or that names none, goes to `default_class`.
//
// Written against the public API (classifiers/request_classifier.hpp) only, as an example.
#pragma once

#include <expected>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The registered type name.
inline constexpr std::string_view kTenantClassType = "tenant-class";

/// `tenant-class` YAML parameters.
struct TenantClassParameters {
  /// Required, at least one entry `{tenant: T, policy_class: C}`, each tenant once: tenant → class.
  std::map<std::string, std::string, std::less<>> tenants;
  /// The class of requests whose tenant is not listed (or that name none); default "default".
  std::string default_class = "default";

  /// Reads and checks the keys above; unknown keys, a missing or bad value, a repeated tenant or
  /// a class that is not configured fail naming the key (e.g. `parameters.tenants[1].tenant`).
  static std::expected<TenantClassParameters,
                       plugins::request_classifier::RequestClassifierProviderError>
  read(const plugins::request_classifier::RequestClassifierParameters& parameters);

  /// The class of a request from `tenant` (empty: none).
  std::string_view class_for(std::optional<std::string_view> tenant) const;
};

/// The `tenant-class` classifier (file comment).
class TenantClassClassifier final : public plugins::request_classifier::RequestClassifier {
 public:
  explicit TenantClassClassifier(TenantClassParameters parameters)
      : parameters_(std::move(parameters)) {}

  plugins::request_classifier::AdmissionFuture classify(
      plugins::request_classifier::ClassifyRequest request) override;

 private:
  TenantClassParameters parameters_;
};

/// The registered provider of `tenant-class`.
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
tenant_class_provider(const plugins::request_classifier::RequestClassifierParameters& parameters);

}  // namespace kvr::classifiers::builtin
