#include "classifiers/builtin/max_in_flight.hpp"

#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "classifiers/builtin/provider.hpp"

namespace kvr::classifiers::builtin {

using plugins::request_classifier::Aborted;
using plugins::request_classifier::AdmissionFuture;
using plugins::request_classifier::ClassifierError;
using plugins::request_classifier::ClassifyEvent;
using plugins::request_classifier::ClassifyRequest;
using plugins::request_classifier::Completed;
using plugins::request_classifier::ParameterReader;
using plugins::request_classifier::Poll;
using plugins::request_classifier::PollContext;
using plugins::request_classifier::RequestClassifierFactory;
using plugins::request_classifier::RequestClassifierParameters;
using plugins::request_classifier::RequestClassifierProviderError;
using plugins::request_classifier::Waker;

namespace {

// Which budget a request counts against: its tenant with per_tenant, else the shared one (nullopt,
// also the budget of requests without a tenant).
using BudgetKey = std::optional<std::string>;

}  // namespace

// One deferred request. Owned by its future's poll function, so it dies with the future; the
// budget's queue only observes it.
struct MaxInFlightClassifier::Ticket {
  Ticket(std::shared_ptr<State> owner, BudgetKey budget, std::string id)
      : state(std::move(owner)), key(std::move(budget)), request_id(std::move(id)) {}
  ~Ticket();
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;

  std::shared_ptr<State> state;
  BudgetKey key;
  std::string request_id;
  Waker waker;           // from the latest pending poll
  bool granted = false;  // a freed slot was handed to it
  bool admitted = false;
};

struct MaxInFlightClassifier::State {
  struct Budget {
    std::size_t used = 0;  // admitted and not ended, plus granted tickets not yet polled
    std::deque<std::weak_ptr<Ticket>> waiting;
  };

  State(std::size_t max, bool by_tenant) : limit(max), per_tenant(by_tenant) {}

  BudgetKey key_of(const ClassifyRequest& request) const {
    if (!per_tenant) return std::nullopt;
    const auto tenant = request.tenant();
    return tenant ? BudgetKey{std::string{*tenant}} : std::nullopt;
  }

  // Frees one slot of `key`: the oldest live waiter takes it over, else it is given back.
  void release(const BudgetKey& key) {
    const auto found = budgets.find(key);
    if (found == budgets.end()) return;
    Budget& budget = found->second;
    --budget.used;
    grant_waiting(budget);
    if (budget.used == 0 && budget.waiting.empty()) budgets.erase(found);
  }

  void grant_waiting(Budget& budget) {
    while (budget.used < limit && !budget.waiting.empty()) {
      const std::shared_ptr<Ticket> ticket = budget.waiting.front().lock();
      budget.waiting.pop_front();
      if (!ticket) continue;  // its future was dropped
      ticket->granted = true;
      ++budget.used;
      ticket->waker.wake();  // empty before the first poll, which will see the grant anyway
    }
  }

  void count_in_flight(std::string request_id, BudgetKey key) {
    in_flight.emplace(std::move(request_id), std::move(key));
  }

  std::size_t limit;
  bool per_tenant;
  std::map<BudgetKey, Budget> budgets;
  std::unordered_multimap<std::string, BudgetKey> in_flight;  // by request id
};

MaxInFlightClassifier::Ticket::~Ticket() {
  // A slot handed to a request that was then dropped goes to the next one in line.
  if (granted && !admitted) state->release(key);
}

namespace {

std::expected<void, RequestClassifierProviderError> at_least_one(std::string_view key,
                                                                 std::uint32_t value) {
  if (value >= 1) return {};
  return std::unexpected(RequestClassifierProviderError{
      fmt::format("parameters.{}: must be at least 1, got {}", key, value)});
}

}  // namespace

std::expected<MaxInFlightParameters, RequestClassifierProviderError> MaxInFlightParameters::read(
    const RequestClassifierParameters& parameters) {
  ParameterReader reader = parameters.reader();
  auto limit = reader.required<std::uint32_t>("max_in_flight");
  if (!limit) return std::unexpected(limit.error());
  auto per_tenant = reader.optional<bool>("per_tenant", false);
  if (!per_tenant) return std::unexpected(per_tenant.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());
  if (auto valid = at_least_one("max_in_flight", *limit); !valid) {
    return std::unexpected(valid.error());
  }
  return MaxInFlightParameters{.max_in_flight = *limit, .per_tenant = *per_tenant};
}

MaxInFlightClassifier::MaxInFlightClassifier(const MaxInFlightParameters& parameters)
    : state_(std::make_shared<State>(parameters.max_in_flight, parameters.per_tenant)) {}

MaxInFlightClassifier::~MaxInFlightClassifier() = default;

AdmissionFuture MaxInFlightClassifier::classify(ClassifyRequest request) {
  const auto id = request.request_id();
  if (!id) {
    return AdmissionFuture::rejected(
        ClassifierError::failed("max-in-flight needs a request id to count the request"));
  }
  BudgetKey key = state_->key_of(request);
  State::Budget& budget = state_->budgets[key];
  if (budget.used < state_->limit && budget.waiting.empty()) {
    ++budget.used;
    state_->count_in_flight(std::string{*id}, std::move(key));
    return AdmissionFuture::ready(std::move(request));
  }
  // Queued now, at arrival, so that the order among the deferred is the order of arrival.
  auto ticket = std::make_shared<Ticket>(state_, std::move(key), std::string{*id});
  budget.waiting.push_back(ticket);
  return AdmissionFuture::deferred(
      [ticket = std::move(ticket), request = std::move(request)](PollContext& context) -> Poll {
        if (!ticket->granted) {
          ticket->waker = context.waker();
          return Poll::pending();
        }
        ticket->admitted = true;
        ticket->state->count_in_flight(ticket->request_id, ticket->key);
        return Poll::ready(request);
      });
}

void MaxInFlightClassifier::on_event(const ClassifyEvent& event) {
  const std::string* id = nullptr;
  if (const auto* completed = std::get_if<Completed>(&event)) id = &completed->request_id;
  if (const auto* aborted = std::get_if<Aborted>(&event)) id = &aborted->request_id;
  if (id == nullptr) return;  // Sent (also a retry's) and Responding do not change the count
  const auto counted = state_->in_flight.find(*id);
  if (counted == state_->in_flight.end()) return;
  BudgetKey key = std::move(counted->second);
  state_->in_flight.erase(counted);
  state_->release(key);
}

std::size_t MaxInFlightClassifier::in_flight(std::optional<std::string_view> tenant) const {
  const BudgetKey key =
      state_->per_tenant && tenant ? BudgetKey{std::string{*tenant}} : std::nullopt;
  const auto found = state_->budgets.find(key);
  return found == state_->budgets.end() ? 0 : found->second.used;
}

std::size_t MaxInFlightClassifier::waiting(std::optional<std::string_view> tenant) const {
  const BudgetKey key =
      state_->per_tenant && tenant ? BudgetKey{std::string{*tenant}} : std::nullopt;
  const auto found = state_->budgets.find(key);
  if (found == state_->budgets.end()) return 0;
  std::size_t live = 0;
  for (const auto& ticket : found->second.waiting) live += ticket.expired() ? 0 : 1;
  return live;
}

std::expected<RequestClassifierFactory, RequestClassifierProviderError> max_in_flight_provider(
    const RequestClassifierParameters& parameters) {
  return read_then_make<MaxInFlightClassifier, MaxInFlightParameters>(parameters);
}

}  // namespace kvr::classifiers::builtin
