#include "classifiers/builtin/length_class.hpp"

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

std::expected<LengthClassParameters, RequestClassifierProviderError> LengthClassParameters::read(
    const RequestClassifierParameters& parameters) {
  const auto fail = [](std::string message) {
    return std::unexpected(RequestClassifierProviderError{std::move(message)});
  };
  ParameterReader reader = parameters.reader();
  auto entries = reader.required_mappings("buckets");
  if (!entries) return std::unexpected(entries.error());
  auto default_class = reader.optional<std::string>("default_class", "default");
  if (!default_class) return std::unexpected(default_class.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  LengthClassParameters parsed;
  if (entries->empty()) return fail("parameters.buckets: expected at least one bucket, got []");
  for (std::size_t i = 0; i < entries->size(); ++i) {
    ParameterReader& entry = (*entries)[i];
    auto max_input_tokens = entry.required<std::uint64_t>("max_input_tokens");
    if (!max_input_tokens) return std::unexpected(max_input_tokens.error());
    auto policy_class = entry.required<std::string>("policy_class");
    if (!policy_class) return std::unexpected(policy_class.error());
    if (auto finished = entry.finish(); !finished) return std::unexpected(finished.error());
    if (policy_class->empty()) {
      return fail(fmt::format("parameters.buckets[{}].policy_class: must not be empty", i));
    }
    if (auto known = parameters.check_policy_class(
            *policy_class, fmt::format("parameters.buckets[{}].policy_class", i));
        !known) {
      return std::unexpected(known.error());
    }
    if (!parsed.buckets.empty() && *max_input_tokens <= parsed.buckets.back().max_input_tokens) {
      return fail(fmt::format(
          "parameters.buckets[{}].max_input_tokens: buckets must be strictly ascending, got {} "
          "after {}",
          i, *max_input_tokens, parsed.buckets.back().max_input_tokens));
    }
    parsed.buckets.push_back(
        Bucket{.max_input_tokens = *max_input_tokens, .policy_class = std::move(*policy_class)});
  }
  if (default_class->empty()) return fail("parameters.default_class: must not be empty");
  if (auto known = parameters.check_policy_class(*default_class, "parameters.default_class");
      !known) {
    return std::unexpected(known.error());
  }
  parsed.default_class = std::move(*default_class);
  return parsed;
}

std::string_view LengthClassParameters::class_for(std::size_t input_tokens) const {
  for (const Bucket& bucket : buckets) {
    if (input_tokens <= bucket.max_input_tokens) return bucket.policy_class;
  }
  return default_class;
}

AdmissionFuture LengthClassClassifier::classify(ClassifyRequest request) {
  request.set_policy_class(std::string{parameters_.class_for(request.input_tokens())});
  return AdmissionFuture::ready(std::move(request));
}

std::expected<RequestClassifierFactory, RequestClassifierProviderError> length_class_provider(
    const RequestClassifierParameters& parameters) {
  auto parsed = LengthClassParameters::read(parameters);
  if (!parsed) return std::unexpected(parsed.error());
  return RequestClassifierFactory{[checked = std::move(*parsed)](const RequestClassifierContext&) {
    return std::make_unique<LengthClassClassifier>(checked);
  }};
}

}  // namespace kvr::classifiers::builtin
