#include "actors/selector/selector_state.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace kvr::actors {
namespace {

using plugins::worker_selection::WorkerSelectionPolicyError;
using Kind = WorkerSelectionPolicyError::Kind;

// A reported count adjusted by the bookings' change since the report (predicted_load.hpp): the
// report already counts the requests it had received, so adding every open booking would count
// them twice. Never below zero.
std::uint64_t plus_change(std::uint64_t reported, std::int64_t change) {
  const std::int64_t total = static_cast<std::int64_t>(reported) + change;
  return total < 0 ? 0 : static_cast<std::uint64_t>(total);
}

Error to_error(Kind kind) {
  switch (kind) {
    case Kind::NoEndpoints:
    case Kind::NoEligibleWorkers:
      return Error::no_workers;
    case Kind::AllFiltered:
      return Error::all_filtered;
    case Kind::Failed:
    case Kind::NonFiniteCost:
    case Kind::InvalidPickerRow:
      return Error::policy_failed;
  }
  return Error::policy_failed;
}

}  // namespace

SelectorState::SelectorState(SelectorOptions options, const plugins::RouterPlugins& plugins)
    : options_(std::move(options)),
      plugins_(&plugins),
      discovery_(
          [&] {
            discovery::RegistrationLimits limits = options_.registration;
            limits.required_block_size = options_.router.block_size;
            return limits;
          }(),
          options_.index) {}

std::expected<discovery::RegistrationChange, discovery::RegistrationError>
SelectorState::register_worker(discovery::WorkerRegistration registration, TimePoint now) {
  if (registration.model != options_.partition.model ||
      registration.routing_group != options_.partition.routing_group) {
    return std::unexpected(discovery::RegistrationError{
        registration.model != options_.partition.model ? "model" : "routing_group",
        fmt::format("'{}' group '{}' belongs to another partition than '{}' group '{}'",
                    registration.model, registration.routing_group, options_.partition.model,
                    options_.partition.routing_group)});
  }
  auto change = discovery_.register_worker(std::move(registration), now);
  if (change) rows_dirty_ = true;
  return change;
}

std::expected<void, discovery::CatalogError> SelectorState::heartbeat(WorkerId worker,
                                                                      Incarnation incarnation,
                                                                      TimePoint now) {
  return discovery_.heartbeat(worker, incarnation, now);
}

std::expected<void, discovery::CatalogError> SelectorState::deregister(WorkerId worker,
                                                                       Incarnation incarnation) {
  auto removed = discovery_.deregister(worker, incarnation);
  if (removed) rows_dirty_ = true;
  return removed;
}

std::expected<discovery::ApplyOutcome, discovery::IndexError> SelectorState::apply_kv_events(
    const KvEventBatch& batch) {
  return discovery_.index().apply(batch);
}

std::expected<discovery::ApplyOutcome, discovery::IndexError> SelectorState::load_kv_dump(
    const KvDump& dump) {
  return discovery_.index().load_dump(dump);
}

std::expected<void, discovery::LoadError> SelectorState::update_load(
    WorkerWithDpRank worker, const discovery::ConfirmedLoad& load) {
  return discovery_.load().update_confirmed(worker, load);
}

void SelectorState::expire(TimePoint now, std::vector<WorkerId>& removed_workers) {
  const std::size_t before = removed_workers.size();
  discovery_.expire(now, removed_workers);
  if (removed_workers.size() != before) rows_dirty_ = true;
}

plugins::worker_selection::WorkerSelectionPolicy& SelectorState::policy(WorkerType worker_type) {
  auto& policy = policies_[static_cast<std::size_t>(worker_type)];
  if (!policy) {
    // The factory runs once per partition and role, so policy state stays partition-local.
    policy.emplace(plugins_->selection_for(worker_type)
                       .factory(options_.router, worker_type, options_.partition));
    const auto names = selection::scorer_names(*policy);
    scorer_names_[static_cast<std::size_t>(worker_type)] =
        std::make_shared<const std::vector<std::string>>(names.begin(), names.end());
  }
  return *policy;
}

const std::string& SelectorState::policy_name(WorkerType worker_type) const {
  return plugins_->selection_for(worker_type).instance_name;
}

void SelectorState::rebuild_rows() const {
  for (RoleRows& rows : rows_) {
    rows.descriptors.clear();
    rows.slots.clear();
    rows.total_kv_blocks.clear();
  }
  // Sorted by id so that the host sees a stable order whatever the hash map's iteration order.
  std::vector<const discovery::CatalogEntry*> entries;
  entries.reserve(discovery_.catalog().size());
  for (const auto& [id, entry] : discovery_.catalog().entries()) entries.push_back(&entry);
  std::ranges::sort(entries, {}, [](const discovery::CatalogEntry* entry) {
    return entry->registration.worker_id;
  });
  for (const discovery::CatalogEntry* entry : entries) {
    const discovery::WorkerRegistration& registration = entry->registration;
    RoleRows& rows = rows_[static_cast<std::size_t>(registration.role)];
    for (DpRank rank = 0; rank < registration.data_parallel_size; ++rank) {
      const WorkerWithDpRank worker{registration.worker_id, rank};
      const auto slot = discovery_.index().slot_of(worker);
      if (!slot) continue;  // not indexed: cannot be offered
      rows.descriptors.push_back(
          selection::WorkerDescriptor{.worker = worker, .taints = registration.taints});
      rows.slots.push_back(*slot);
      rows.total_kv_blocks.push_back(registration.total_kv_blocks);
    }
  }
  rows_dirty_ = false;
}

void SelectorState::refresh_busy_signals(RoleRows& rows) const {
  for (std::size_t row = 0; row < rows.descriptors.size(); ++row) {
    selection::WorkerDescriptor& descriptor = rows.descriptors[row];
    const auto view = discovery_.load().rank_load(descriptor.worker);
    if (!view) continue;
    // Until the first report the bookings' change is the whole estimate.
    const discovery::ConfirmedLoad confirmed = view->confirmed.value_or(discovery::ConfirmedLoad{});
    descriptor.active_prefill_tokens =
        plus_change(confirmed.active_prefill_tokens, view->prefill_tokens_since_report);
    if ((view->confirmed || view->open_bookings > 0) && rows.total_kv_blocks[row] > 0) {
      descriptor.kv_usage =
          static_cast<double>(plus_change(confirmed.kv_blocks_used, view->blocks_since_report)) /
          static_cast<double>(rows.total_kv_blocks[row]);
    } else {
      descriptor.kv_usage.reset();
    }
  }
}

std::span<const selection::WorkerDescriptor> SelectorState::workers(WorkerType worker_type) const {
  if (rows_dirty_) rebuild_rows();
  RoleRows& rows = rows_[static_cast<std::size_t>(worker_type)];
  // Busy thresholds need fresh load numbers; without them the descriptors never change.
  if (options_.router.busy_kv_usage_threshold || options_.router.busy_prefill_tokens_threshold) {
    refresh_busy_signals(rows);
  }
  return rows.descriptors;
}

const discovery::MatchResult& SelectorState::matches_for(std::span<const BlockHash> block_hashes) {
  if (!in_route_ || matches_for_route_ != route_counter_) {
    discovery_.index().find_matches(block_hashes, matches_);
    matches_for_route_ = in_route_ ? route_counter_ : 0;
  }
  return matches_;
}

void SelectorState::compute_signals(const selection::SelectionRequest& request,
                                    WorkerType worker_type, std::span<const std::uint32_t> rows,
                                    std::span<selection::WorkerCacheInput> cache_out,
                                    std::span<selection::WorkerLoadInput> load_out) {
  const RoleRows& role_rows = rows_[static_cast<std::size_t>(worker_type)];
  const discovery::MatchResult& matches = matches_for(request.block_hashes);
  const std::uint64_t prompt_blocks = request.block_hashes.size();
  if (!load_out.empty()) discovery_.load().prepare(request.block_hashes, projection_scratch_);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::uint32_t row = rows[i];
    const discovery::WorkerMatch* match = matches.find(role_rows.slots[row]);
    if (!cache_out.empty()) {
      cache_out[i] = match ? selection::WorkerCacheInput{static_cast<double>(match->device_blocks),
                                                         static_cast<double>(match->host_blocks),
                                                         static_cast<double>(match->disk_blocks)}
                           : selection::WorkerCacheInput{};
    }
    if (!load_out.empty()) {
      // The candidate's own prefill is the policy's to weigh (from CACHE), so the projection
      // leaves it out: active_prefill_tokens is what the worker already has to do.
      const auto projection = discovery_.load().project(
          role_rows.descriptors[row].worker,
          discovery::CandidateRequest{.prompt_blocks = prompt_blocks}, projection_scratch_);
      // A rank that has not reported yet but carries bookings is not unknown: its bookings are
      // the whole estimate, and hiding them would herd a burst onto it.
      if (projection && (projection->is_available || projection->active_requests > 0)) {
        load_out[i] = selection::WorkerLoadInput{selection::WorkerLoadInput::Values{
            .active_requests = projection->active_requests,
            .active_prefill_tokens = projection->active_prefill_tokens,
            .decode_cost_blocks = static_cast<double>(projection->decode_cost_blocks),
            .total_kv_blocks = projection->total_kv_blocks,
        }};
      } else {
        load_out[i] = selection::WorkerLoadInput{};
      }
    }
  }
}

std::expected<void, RouteFailure> SelectorState::validate(const RouteInput& input) const {
  if (input.prompt_tokens == 0) {
    return std::unexpected(RouteFailure{Error::invalid_request, "the prompt is empty"});
  }
  const std::size_t block_size = options_.router.block_size;
  if (input.block_hashes.size() > input.prompt_tokens / block_size) {
    return std::unexpected(
        RouteFailure{Error::invalid_request,
                     fmt::format("{} block hashes exceed the {} full blocks of a {}-token prompt",
                                 input.block_hashes.size(), input.prompt_tokens / block_size,
                                 input.prompt_tokens)});
  }
  // Refused before selection, so that a duplicate leaves no trace in stateful policies.
  if (discovery_.load().has_booking(input.request_id)) {
    return std::unexpected(RouteFailure{
        Error::invalid_request,
        fmt::format("request id '{}' is already routed and not yet released", input.request_id)});
  }
  return {};
}

std::expected<RouteOutcome, RouteFailure> SelectorState::route(const RouteInput& input,
                                                               TimePoint now) {
  if (auto valid = validate(input); !valid) return std::unexpected(std::move(valid.error()));
  const selection::SelectionRequest request{
      .request_id = input.request_id,
      .prompt_tokens = input.prompt_tokens,
      .block_hashes = input.block_hashes,
      .expected_output_tokens = input.expected_output_tokens,
      .session = input.session,
      .affinity_target = input.affinity_target,
      .pinned_worker = input.pinned_worker,
      .strict_priority = input.priority,
      .allowed_workers = input.allowed_workers,
      .excluded_workers = input.excluded_workers,
      .required_taints = input.required_taints,
      .preferred_taints = input.preferred_taints,
      .now = now,
  };
  ++route_counter_;
  in_route_ = true;
  auto selected =
      selection::select_worker(policy(input.worker_type), request, options_.partition, *this);
  if (!selected) {
    in_route_ = false;
    return std::unexpected(
        RouteFailure{to_error(selected.error().kind()), std::string{selected.error().message()}});
  }
  RouteOutcome outcome;
  outcome.worker = selected->worker;
  if (selected->cache) {
    outcome.device_overlap_blocks =
        static_cast<std::uint32_t>(selected->cache->device_overlap_blocks());
    outcome.host_overlap_blocks =
        static_cast<std::uint32_t>(selected->cache->host_overlap_blocks());
    outcome.disk_overlap_blocks =
        static_cast<std::uint32_t>(selected->cache->disk_overlap_blocks());
  } else if (const auto slot = discovery_.index().slot_of(outcome.worker)) {
    // The policy asked for no CACHE signals; the booking still needs the chosen worker's overlap.
    if (const discovery::WorkerMatch* match = matches_for(input.block_hashes).find(*slot)) {
      outcome.device_overlap_blocks = match->device_blocks;
      outcome.host_overlap_blocks = match->host_blocks;
      outcome.disk_overlap_blocks = match->disk_blocks;
    }
  }
  in_route_ = false;
  outcome.total_cost = selected->total_cost;
  outcome.scorer_costs = selected->scorer_costs;
  outcome.scorer_names = scorer_names_[static_cast<std::size_t>(input.worker_type)];
  outcome.eligible_workers = selected->eligible_workers;
  return book(input, std::move(outcome), now);
}

std::optional<std::string> SelectorState::unroutable_reason(const RouteInput& input,
                                                            WorkerWithDpRank worker) const {
  const auto rows = workers(input.worker_type);
  const auto row = std::ranges::find(rows, worker, &selection::WorkerDescriptor::worker);
  if (row == rows.end()) {
    const discovery::CatalogEntry* entry = discovery_.catalog().find(worker.worker_id);
    if (entry == nullptr) return std::string{"it is not registered in this partition"};
    const discovery::WorkerRegistration& registration = entry->registration;
    if (registration.role != input.worker_type) {
      return fmt::format("it serves {} requests, not {}", as_str(registration.role),
                         as_str(input.worker_type));
    }
    if (worker.dp_rank >= registration.data_parallel_size) {
      return fmt::format("it has {} data-parallel ranks", registration.data_parallel_size);
    }
    return std::string{"the rank is not indexed"};
  }
  if (!row->available) return std::string{"it is not available"};
  if (input.pinned_worker && !input.pinned_worker->matches(worker)) {
    return fmt::format("the request is pinned to worker {}", input.pinned_worker->worker_id);
  }
  if (!input.allowed_workers.empty() &&
      std::ranges::find(input.allowed_workers, worker.worker_id) == input.allowed_workers.end()) {
    return std::string{"it is not in the request's allow-list"};
  }
  if (std::ranges::find(input.excluded_workers, worker.worker_id) != input.excluded_workers.end()) {
    return std::string{"the request excludes it"};
  }
  for (const std::string& taint : input.required_taints) {
    if (std::ranges::find(row->taints, taint) == row->taints.end()) {
      return fmt::format("it lacks the required taint '{}'", taint);
    }
  }
  return std::nullopt;
}

// GCC 12 (-O2) reports absl::InlinedVector's inline storage as maybe-uninitialized when an
// outcome with no scorer costs is moved; the storage is empty and never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
std::expected<RouteOutcome, RouteFailure> SelectorState::route_to(const RouteInput& input,
                                                                  WorkerWithDpRank worker,
                                                                  TimePoint now) {
  if (auto valid = validate(input); !valid) return std::unexpected(std::move(valid.error()));
  if (auto reason = unroutable_reason(input, worker)) {
    return std::unexpected(
        RouteFailure{Error::no_workers,
                     fmt::format("worker {} rank {} cannot take request '{}': {}", worker.worker_id,
                                 worker.dp_rank, input.request_id, *reason)});
  }
  RouteOutcome outcome;
  outcome.worker = worker;
  outcome.eligible_workers = 1;
  if (const auto slot = discovery_.index().slot_of(worker)) {
    if (const discovery::WorkerMatch* match = matches_for(input.block_hashes).find(*slot)) {
      outcome.device_overlap_blocks = match->device_blocks;
      outcome.host_overlap_blocks = match->host_blocks;
      outcome.disk_overlap_blocks = match->disk_blocks;
    }
  }
  return book(input, std::move(outcome), now);
}
#pragma GCC diagnostic pop

std::expected<RouteOutcome, RouteFailure> SelectorState::book(const RouteInput& input,
                                                              RouteOutcome outcome, TimePoint now) {
  const std::uint64_t cached_blocks = std::uint64_t{outcome.device_overlap_blocks} +
                                      outcome.host_overlap_blocks + outcome.disk_overlap_blocks;
  outcome.uncached_prefill_tokens = discovery::uncached_prefill_tokens(
      input.prompt_tokens, cached_blocks, options_.router.block_size);
  outcome.lease_expires_at = now + options_.lease_ttl;

  auto booked = discovery_.load().book(discovery::BookingRequest{
      .request_id = input.request_id,
      .worker = outcome.worker,
      .prompt_blocks = {input.block_hashes.begin(), input.block_hashes.end()},
      .uncached_prefill_tokens = outcome.uncached_prefill_tokens,
      .expires_at = outcome.lease_expires_at,
  });
  if (!booked) {
    return std::unexpected(RouteFailure{
        booked.error() == discovery::LoadError::duplicate_booking ? Error::invalid_request
                                                                  : Error::unavailable,
        fmt::format("cannot book request '{}': {}", input.request_id,
                    discovery::as_str(booked.error()))});
  }
  // Workers that publish no KV events: the routing decision is the only evidence of what they
  // will cache.
  if (const auto* entry = discovery_.catalog().find(outcome.worker.worker_id);
      entry != nullptr && !entry->registration.publishes_kv_events) {
    (void)discovery_.index().record_routing(outcome.worker, input.block_hashes, now);
  }
  return outcome;
}

std::expected<void, discovery::LoadError> SelectorState::first_token(std::string_view request_id) {
  return discovery_.load().first_token(request_id);
}

std::expected<void, discovery::LoadError> SelectorState::release(std::string_view request_id,
                                                                 discovery::BookingEnd end) {
  return discovery_.load().release(request_id, end);
}

}  // namespace kvr::actors
