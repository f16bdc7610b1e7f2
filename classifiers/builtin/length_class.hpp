// The built-in request classifier `length-class`: puts each request in a policy class by its
// length, e.g. short prompts in a class with a larger quantum, and always admits it. `buckets` are
// ascending by `max_input_tokens`; a request goes to the first bucket whose max_input_tokens is at
// least its input tokens (bounds inclusive), else to `default_class`.
//
// The length used is ClassifyRequest::input_tokens(): admission runs before worker selection, so
// the tokens a worker has cached are not known yet, and the input length is the uncached length
// when nothing is cached (an upper bound otherwise).
//
// Written against the public API (classifiers/request_classifier.hpp) only, as an example.
#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The registered type name.
inline constexpr std::string_view kLengthClassType = "length-class";

/// `length-class` YAML parameters.
struct LengthClassParameters {
  /// One `buckets` entry.
  struct Bucket {
    /// The longest request of the bucket, in input tokens.
    std::uint64_t max_input_tokens = 0;
    /// The policy class of its requests; not empty.
    std::string policy_class;
  };
  /// Required, at least one, strictly ascending by max_input_tokens; each entry takes exactly
  /// the keys `max_input_tokens` and `policy_class`.
  std::vector<Bucket> buckets;
  /// The class of requests longer than every bucket; not empty; default "default".
  std::string default_class = "default";

  /// Reads and checks the keys above; unknown keys, a missing or bad value fail naming the key
  /// (e.g. `parameters.buckets[1].max_input_tokens`).
  static std::expected<LengthClassParameters,
                       plugins::request_classifier::RequestClassifierProviderError>
  read(const plugins::request_classifier::RequestClassifierParameters& parameters);

  /// The class of a request of `input_tokens`.
  std::string_view class_for(std::size_t input_tokens) const;
};

/// The `length-class` classifier (file comment).
class LengthClassClassifier final : public plugins::request_classifier::RequestClassifier {
 public:
  explicit LengthClassClassifier(LengthClassParameters parameters)
      : parameters_(std::move(parameters)) {}

  plugins::request_classifier::AdmissionFuture classify(
      plugins::request_classifier::ClassifyRequest request) override;

 private:
  LengthClassParameters parameters_;
};

/// The registered provider of `length-class`.
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
length_class_provider(const plugins::request_classifier::RequestClassifierParameters& parameters);

}  // namespace kvr::classifiers::builtin
