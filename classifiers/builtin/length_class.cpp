#include "classifiers/builtin/length_class.hpp"

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

std::expected<LengthClassParameters, RequestClassifierProviderError> LengthClassParameters::read(
    const RequestClassifierParameters& parameters) {
  auto table = read_class_table<std::uint64_t>(parameters, "buckets", "bucket", "max_input_tokens");
  if (!table) return std::unexpected(table.error());
  LengthClassParameters parsed;
  for (std::size_t i = 0; i < table->rows.size(); ++i) {
    auto& row = table->rows[i];
    if (!parsed.buckets.empty() && row.key <= parsed.buckets.back().max_input_tokens) {
      return std::unexpected(RequestClassifierProviderError{fmt::format(
          "parameters.buckets[{}].max_input_tokens: buckets must be strictly ascending, got {} "
          "after {}",
          i, row.key, parsed.buckets.back().max_input_tokens)});
    }
    parsed.buckets.push_back(
        Bucket{.max_input_tokens = row.key, .policy_class = std::move(row.policy_class)});
  }
  parsed.default_class = std::move(table->default_class);
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
  return read_then_make<LengthClassClassifier, LengthClassParameters>(parameters);
}

}  // namespace kvr::classifiers::builtin
