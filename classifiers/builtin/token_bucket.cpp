#include "classifiers/builtin/token_bucket.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "classifiers/builtin/provider.hpp"

namespace kvr::classifiers::builtin {

using plugins::request_classifier::AdmissionFuture;
using plugins::request_classifier::ClassifierError;
using plugins::request_classifier::ClassifyRequest;
using plugins::request_classifier::ParameterReader;
using plugins::request_classifier::Poll;
using plugins::request_classifier::PollContext;
using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;
using plugins::request_classifier::TimePoint;
using plugins::request_classifier::Waker;

namespace {

// The tenant, or nullopt: the bucket shared by requests without one.
using BucketKey = std::optional<std::string>;

// Rounding in the refill arithmetic must not leave a request a hair short at its wake time.
constexpr double kTokenTolerance = 1e-6;
// The longest wake-up time a deferred request asks for at once.
constexpr double kMaxWaitSeconds = 86'400.0;
// How often classify() forgets full, idle buckets (they are the same as a new one).
constexpr std::uint64_t kSweepEvery = 4096;

BucketKey key_of(std::optional<std::string_view> tenant) {
  return tenant ? BucketKey{std::string{*tenant}} : std::nullopt;
}

std::string tenant_name(const BucketKey& key) {
  return key ? fmt::format("tenant '{}'", *key) : std::string{"requests without a tenant"};
}

}  // namespace

struct TokenBucketClassifier::Ticket {
  Ticket(std::shared_ptr<State> owner, BucketKey bucket, std::uint64_t tokens)
      : state(std::move(owner)), key(std::move(bucket)), cost(tokens) {}
  ~Ticket();
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;

  std::shared_ptr<State> state;
  BucketKey key;
  std::uint64_t cost;
  Waker waker;  // while it waits behind another request
  bool admitted = false;
};

struct TokenBucketClassifier::State {
  struct Bucket {
    double tokens = 0.0;
    TimePoint refilled_at{};
    std::deque<std::weak_ptr<Ticket>> waiting;  // deferred requests, oldest first
  };

  explicit State(const TokenBucketParameters& parameters)
      : rate(parameters.rate_tokens_per_s),
        burst(static_cast<double>(parameters.burst_tokens)),
        mode(parameters.mode) {}

  double refilled(const Bucket& bucket, TimePoint now) const {
    if (now <= bucket.refilled_at) return bucket.tokens;  // time never runs backwards here
    const double seconds = std::chrono::duration<double>(now - bucket.refilled_at).count();
    return std::min(burst, bucket.tokens + rate * seconds);
  }

  Bucket& bucket_at(const BucketKey& key, TimePoint now) {
    auto [found, inserted] = buckets.try_emplace(key);
    Bucket& bucket = found->second;
    if (inserted) {
      bucket.tokens = burst;
      bucket.refilled_at = now;
    } else if (now > bucket.refilled_at) {
      bucket.tokens = refilled(bucket, now);
      bucket.refilled_at = now;
    }
    return bucket;
  }

  // What must be in the bucket to admit `cost`: a request larger than the bucket needs it full.
  double needed(std::uint64_t cost) const { return std::min(static_cast<double>(cost), burst); }
  bool affords(const Bucket& bucket, std::uint64_t cost) const {
    return bucket.tokens + kTokenTolerance >= needed(cost);
  }
  void charge(Bucket& bucket, std::uint64_t cost) const {
    bucket.tokens -= static_cast<double>(cost);
  }

  // When `bucket` (refilled at now) will hold `cost`'s tokens.
  TimePoint refill_time(const Bucket& bucket, std::uint64_t cost) const {
    const double missing = std::max(0.0, needed(cost) - bucket.tokens);
    // A tiny rate could put the time beyond the clock's range: a poll a day later recomputes it.
    const double seconds = std::min(missing / rate, kMaxWaitSeconds);
    const auto wait =
        std::chrono::ceil<TimePoint::duration>(std::chrono::duration<double>(seconds));
    return bucket.refilled_at + wait;
  }

  // The oldest deferred request still alive, after forgetting dropped ones.
  static std::shared_ptr<Ticket> front(Bucket& bucket) {
    while (!bucket.waiting.empty()) {
      if (auto ticket = bucket.waiting.front().lock()) return ticket;
      bucket.waiting.pop_front();
    }
    return nullptr;
  }

  // The oldest request was admitted and left the queue: the next one now asks for a wake-up time.
  static void wake_front(Bucket& bucket) {
    if (auto next = front(bucket)) next->waker.wake();
  }

  // A deferred request was dropped: if it was the oldest, the next one takes its place.
  void dropped(const BucketKey& key) {
    const auto found = buckets.find(key);
    if (found == buckets.end()) return;
    Bucket& bucket = found->second;
    if (!bucket.waiting.empty() && bucket.waiting.front().expired()) wake_front(bucket);
  }

  void sweep(TimePoint now) {
    for (auto entry = buckets.begin(); entry != buckets.end();) {
      Bucket& bucket = entry->second;
      const bool idle = front(bucket) == nullptr && refilled(bucket, now) >= burst;
      entry = idle ? buckets.erase(entry) : std::next(entry);
    }
  }

  double rate;
  double burst;
  TokenBucketMode mode;
  std::map<BucketKey, Bucket> buckets;
  std::uint64_t classified = 0;
};

TokenBucketClassifier::Ticket::~Ticket() {
  if (!admitted) state->dropped(key);
}

std::expected<TokenBucketParameters, RequestClassifierProviderError> TokenBucketParameters::read(
    const RequestClassifierParameters& parameters) {
  ParameterReader reader = parameters.reader();
  auto rate = reader.required<double>("rate_tokens_per_s");
  if (!rate) return std::unexpected(rate.error());
  auto burst = reader.required<std::uint64_t>("burst_tokens");
  if (!burst) return std::unexpected(burst.error());
  auto mode = reader.optional<std::string>("mode", "reject");
  if (!mode) return std::unexpected(mode.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  if (!std::isfinite(*rate) || *rate <= 0.0) {
    return std::unexpected(RequestClassifierProviderError{
        fmt::format("parameters.rate_tokens_per_s: must be greater than 0, got {}", *rate)});
  }
  if (*burst < 1) {
    return std::unexpected(RequestClassifierProviderError{
        fmt::format("parameters.burst_tokens: must be at least 1, got {}", *burst)});
  }
  TokenBucketParameters parsed{.rate_tokens_per_s = *rate, .burst_tokens = *burst};
  if (*mode == "reject") {
    parsed.mode = TokenBucketMode::Reject;
  } else if (*mode == "defer") {
    parsed.mode = TokenBucketMode::Defer;
  } else {
    return std::unexpected(RequestClassifierProviderError{
        fmt::format("parameters.mode: expected 'reject' or 'defer', got '{}'", *mode)});
  }
  return parsed;
}

TokenBucketClassifier::TokenBucketClassifier(const TokenBucketParameters& parameters)
    : state_(std::make_shared<State>(parameters)) {}

TokenBucketClassifier::~TokenBucketClassifier() = default;

AdmissionFuture TokenBucketClassifier::classify(ClassifyRequest request) {
  const TimePoint now = request.arrived_at();
  if (++state_->classified % kSweepEvery == 0) state_->sweep(now);
  BucketKey key = key_of(request.tenant());
  const std::uint64_t cost = request.input_tokens();
  State::Bucket& bucket = state_->bucket_at(key, now);

  if (State::front(bucket) == nullptr && state_->affords(bucket, cost)) {
    state_->charge(bucket, cost);
    return AdmissionFuture::ready(std::move(request));
  }
  if (state_->mode == TokenBucketMode::Reject) {
    // The refill that would admit the same request.
    const double missing = std::max(0.0, state_->needed(cost) - bucket.tokens);
    const auto retry_after = std::chrono::milliseconds{
        static_cast<std::int64_t>(std::ceil(std::min(missing / state_->rate, 86'400.0) * 1000))};
    return AdmissionFuture::rejected(ClassifierError::rate_limited(
        fmt::format("{} over the rate: the request needs {} tokens, the bucket holds {:.0f} of "
                    "{:.0f}, refilling at {} tokens/s",
                    tenant_name(key), cost, std::max(0.0, bucket.tokens), state_->burst,
                    state_->rate),
        retry_after));
  }
  // Queued at arrival, so that the tenant's deferred requests are admitted in arrival order.
  auto ticket = std::make_shared<Ticket>(state_, std::move(key), cost);
  bucket.waiting.push_back(ticket);
  return AdmissionFuture::deferred(
      [ticket = std::move(ticket), request = std::move(request)](PollContext& context) -> Poll {
        State& owner = *ticket->state;
        State::Bucket& queue = owner.bucket_at(ticket->key, context.now());
        if (State::front(queue) != ticket) {
          ticket->waker = context.waker();  // fired when the one before it leaves the front
          return Poll::pending();
        }
        if (!owner.affords(queue, ticket->cost)) {
          context.wake_at(owner.refill_time(queue, ticket->cost));
          return Poll::pending();
        }
        owner.charge(queue, ticket->cost);
        ticket->admitted = true;
        queue.waiting.pop_front();
        State::wake_front(queue);
        return Poll::ready(request);
      });
}

double TokenBucketClassifier::tokens_at(std::optional<std::string_view> tenant,
                                        TimePoint now) const {
  const auto found = state_->buckets.find(key_of(tenant));
  if (found == state_->buckets.end()) return state_->burst;
  return state_->refilled(found->second, now);
}

std::expected<RequestClassifierFactory, RequestClassifierProviderError> token_bucket_provider(
    const RequestClassifierParameters& parameters) {
  return read_then_make<TokenBucketClassifier, TokenBucketParameters>(parameters);
}

}  // namespace kvr::classifiers::builtin
