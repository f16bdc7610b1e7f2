// The built-in request classifier `token-bucket`: a token bucket per tenant (requests that name no
// tenant share one), `burst_tokens` deep, refilled at `rate_tokens_per_s`; a request costs its
// input tokens. A new bucket starts full. A request is admitted when its bucket holds its cost
// (at most burst_tokens: a request larger than the bucket waits for a full bucket and leaves it in
// debt, so it is not refused for ever and the long-run rate still holds), and the cost is taken.
// Over the rate:
//   - `mode: reject` (the default) rejects at once with ClassifierError::rate_limited;
//   - `mode: defer` defers the request behind the tenant's earlier deferred ones (FIFO): the
//     oldest asks to be polled (wake_at) when the bucket will have refilled enough (at most a
//     day ahead: then it asks again), the others wait for a Waker fired when the one before
//     them is admitted or dropped.
// classify() decides at ClassifyRequest::arrived_at(), a deferred poll at PollContext::now().
//
// Written against the public API (classifiers/request_classifier.hpp) only, as an example.
#pragma once

#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <string_view>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// The registered type name.
inline constexpr std::string_view kTokenBucketType = "token-bucket";

/// What `token-bucket` does with a request over its tenant's rate.
enum class TokenBucketMode { Reject, Defer };

/// `token-bucket` YAML parameters.
struct TokenBucketParameters {
  /// Refill rate of each tenant's bucket; required, finite and > 0.
  double rate_tokens_per_s = 1.0;
  /// Capacity of each tenant's bucket; required, >= 1.
  std::uint64_t burst_tokens = 1;
  /// `reject` (default) or `defer`.
  TokenBucketMode mode = TokenBucketMode::Reject;

  /// Reads and checks the keys above; unknown keys, a missing or bad value fail naming the key.
  static std::expected<TokenBucketParameters,
                       plugins::request_classifier::RequestClassifierProviderError>
  read(const plugins::request_classifier::RequestClassifierParameters& parameters);
};

/// The `token-bucket` classifier (file comment).
class TokenBucketClassifier final : public plugins::request_classifier::RequestClassifier {
 public:
  explicit TokenBucketClassifier(const TokenBucketParameters& parameters);
  ~TokenBucketClassifier() override;

  plugins::request_classifier::AdmissionFuture classify(
      plugins::request_classifier::ClassifyRequest request) override;

  /// The tokens in `tenant`'s bucket at `now` (negative while in debt), without changing it.
  double tokens_at(std::optional<std::string_view> tenant,
                   plugins::request_classifier::TimePoint now) const;

 private:
  struct State;
  struct Ticket;
  std::shared_ptr<State> state_;  // shared with the deferred futures, which may outlive this
};

/// The registered provider of `token-bucket`.
std::expected<plugins::request_classifier::RequestClassifierFactory,
              plugins::request_classifier::RequestClassifierProviderError>
token_bucket_provider(const plugins::request_classifier::RequestClassifierParameters& parameters);

}  // namespace kvr::classifiers::builtin
