// The built-in request classifier `max-in-flight`: at most `max_in_flight` requests between
// admission and their end (Completed or Aborted), in one budget or, with `per_tenant: true`, one
// budget per tenant (requests that name no tenant share one). A request over its budget is
// deferred, parked with a Waker: when a request of the same budget ends, its slot goes straight to
// the oldest deferred request of that budget (FIFO, and no newcomer can take it first), whose
// Waker is fired. Sent and Responding change nothing, so a retry's second Sent is not counted
// again; a terminal event for a request that is not counted (never admitted, or already ended) is
// ignored. A deferred future that the host drops (a cancelled request) gives back a slot it was
// handed and leaves the queue.
//
// Counting follows the request id, so a request without one is rejected (Kind::Failed): the
// host always sets it; ids are unique among live requests.
//
// Written against the public API (classifiers/request_classifier.hpp) only, as an example.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The registered type name.
inline constexpr std::string_view kMaxInFlightType = "max-in-flight";

/// `max-in-flight` YAML parameters.
struct MaxInFlightParameters {
  /// Requests admitted and not yet ended, per budget; required, >= 1.
  std::uint32_t max_in_flight = 1;
  /// One budget per tenant (true) or one for all requests (false, the default).
  bool per_tenant = false;

  /// Reads and checks the keys above; unknown keys, a missing or bad value fail naming the key.
  static std::expected<MaxInFlightParameters,
                       plugins::request_classifier::RequestClassifierProviderError>
  read(const plugins::request_classifier::RequestClassifierParameters& parameters);
};

/// The `max-in-flight` classifier (file comment).
class MaxInFlightClassifier final : public plugins::request_classifier::RequestClassifier {
 public:
  explicit MaxInFlightClassifier(const MaxInFlightParameters& parameters);
  ~MaxInFlightClassifier() override;

  plugins::request_classifier::AdmissionFuture classify(
      plugins::request_classifier::ClassifyRequest request) override;
  void on_event(const plugins::request_classifier::ClassifyEvent& event) override;

  /// Requests counted against the budget of `tenant` (ignored without per_tenant), including
  /// deferred ones already handed a freed slot.
  std::size_t in_flight(std::optional<std::string_view> tenant = std::nullopt) const;
  /// Deferred requests of that budget still waiting for a slot.
  std::size_t waiting(std::optional<std::string_view> tenant = std::nullopt) const;

 private:
  struct State;
  struct Ticket;
  std::shared_ptr<State> state_;  // shared with the deferred futures, which may outlive this
};

/// The registered provider of `max-in-flight`.
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
max_in_flight_provider(const plugins::request_classifier::RequestClassifierParameters& parameters);

}  // namespace kvr::classifiers::builtin
