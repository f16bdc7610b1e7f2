// The provider every built-in classifier has: its parameters are read and checked once, when the
// configuration is loaded (a bad one fails there, naming the field), and each classifier the
// factory makes gets its own copy of them. Written against the public API only.
#pragma once

#include <expected>
#include <memory>
#include <utility>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The factory of `Classifier`s built from `Parameters::read(parameters)`, or that read's error.
template <class Classifier, class Parameters>
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
read_then_make(const plugins::request_classifier::RequestClassifierParameters& parameters) {
  auto parsed = Parameters::read(parameters);
  if (!parsed) return std::unexpected(parsed.error());
  return plugins::request_classifier::RequestClassifierFactory{
      [checked = std::move(*parsed)](const plugins::request_classifier::RequestClassifierContext&) {
        return std::make_unique<Classifier>(checked);
      }};
}

}  // namespace kvr::classifiers::builtin
