#include "selection/partition/selector_state.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "discovery/block_hash.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/config/plugin_factories.hpp"

namespace kvr {
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

// A rank's prefill tokens: the report's, plus the bookings' change since (until the first
// report, the bookings' change is the whole estimate).
std::uint64_t queued_prefill_of(const discovery::RankLoadView& view) {
  const discovery::ConfirmedLoad confirmed = view.confirmed.value_or(discovery::ConfirmedLoad{});
  return plus_change(confirmed.active_prefill_tokens, view.prefill_tokens_since_report);
}

// A rank's KV usage: the report's blocks plus the bookings' change since, over its capacity.
// None until it reports or carries a booking, and none without a capacity: a worker whose engine
// did not say is never busy by KV.
std::optional<double> kv_usage_of(const discovery::RankLoadView& view) {
  if (!view.total_kv_blocks || *view.total_kv_blocks == 0) return std::nullopt;
  if (!view.confirmed && view.open_bookings == 0) return std::nullopt;
  const std::uint64_t reported = view.confirmed ? view.confirmed->kv_blocks_used : 0;
  return static_cast<double>(plus_change(reported, view.blocks_since_report)) /
         static_cast<double>(*view.total_kv_blocks);
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
      // The block size is checked here (register_worker), where a refusal can be remembered.
      workers_(
          [&] {
            discovery::RegistrationLimits limits = options_.registration;
            limits.required_block_size = 0;
            return limits;
          }(),
          options_.index),
      node_share_(options_.node_totals),
      client_share_(std::make_unique<ClientBookingShare>(options_.client_totals)),
      block_size_(options_.router.block_size),
      health_(options_.health) {
  if (options_.client_totals) {
    workers_.load().on_booking_end(
        [share = client_share_.get()](std::string_view client, std::uint64_t blocks) {
          share->remove(client, blocks);
        });
  }
  if (block_size_ != 0) build_policies();
}

std::expected<discovery::RegistrationChange, discovery::RegistrationError>
SelectorState::register_worker(discovery::WorkerRegistration registration, TimePoint now) {
  // A shard's workers register with the model's plain routing group.
  if (registration.model != options_.partition.model ||
      registration.routing_group !=
          cluster::split_shard_group(options_.partition.routing_group).routing_group) {
    return std::unexpected(discovery::RegistrationError{
        registration.model != options_.partition.model ? "model" : "routing_group",
        fmt::format("'{}' group '{}' belongs to another partition than '{}' group '{}'",
                    registration.model, registration.routing_group, options_.partition.model,
                    options_.partition.routing_group)});
  }
  const WorkerId worker_id = registration.worker_id;
  if (block_size_ != 0 && registration.block_size != block_size_) {
    // Bounded: a flood of refused ids keeps only the first ones, which still explain a failure.
    constexpr std::size_t kMaxRemembered = 1024;
    if (refused_.size() < kMaxRemembered || refused_.contains(worker_id)) {
      const auto ttl = registration.liveness_ttl.count() > 0
                           ? registration.liveness_ttl
                           : options_.registration.default_liveness_ttl;
      refused_[worker_id] = RefusedWorker{registration.block_size, now + ttl};
    }
    return std::unexpected(discovery::RegistrationError{
        "block_size", fmt::format("worker {} announces block size {}, partition '{}' group '{}' "
                                  "routes at block size {}",
                                  worker_id, registration.block_size, options_.partition.model,
                                  options_.partition.routing_group, block_size_)});
  }
  const std::uint32_t announced = registration.block_size;
  auto change = workers_.register_worker(std::move(registration), now);
  if (change) {
    sync_node_share();  // a restarted worker's bookings are gone
    rows_dirty_ = true;
    refused_.erase(worker_id);
    if (block_size_ == 0) {
      block_size_ = announced;
      if (policies_block_size_ != block_size_) build_policies();
    }
    if (*change != discovery::RegistrationChange::refreshed) {
      // A new process: its history is dropped, and it may get slow start.
      (void)health_.joined(worker_id, now);
    }
  }
  return change;
}

void SelectorState::forget_block_size_when_empty() {
  if (options_.router.block_size != 0 || block_size_ == 0 || workers_.catalog().size() != 0) return;
  // The next fleet may use another block size: the policies are rebuilt only if it does.
  block_size_ = 0;
}

RouteFailure SelectorState::explain(RouteFailure failure) const {
  if (failure.code != Error::no_workers || refused_.empty()) return failure;
  std::map<std::uint32_t, std::size_t> by_block_size;
  for (const auto& [id, refused] : refused_) ++by_block_size[refused.block_size];
  std::string sizes;
  for (const auto& [size, count] : by_block_size) {
    if (!sizes.empty()) sizes += ", ";
    sizes += fmt::format("{} at block size {}", count, size);
  }
  failure.message +=
      fmt::format("; {} worker{} of model '{}' refused ({}): the partition routes at block size {}",
                  refused_.size(), refused_.size() == 1 ? "" : "s", options_.partition.model, sizes,
                  block_size_);
  return failure;
}

std::expected<void, discovery::CatalogError> SelectorState::heartbeat(WorkerId worker,
                                                                      Incarnation incarnation,
                                                                      TimePoint now) {
  return workers_.heartbeat(worker, incarnation, now);
}

std::expected<void, discovery::CatalogError> SelectorState::deregister(WorkerId worker,
                                                                       Incarnation incarnation) {
  auto removed = workers_.deregister(worker, incarnation);
  if (removed) {
    sync_node_share();
    rows_dirty_ = true;
    health_.left(worker);
    forget_block_size_when_empty();
  }
  return removed;
}

std::expected<discovery::ApplyOutcome, discovery::IndexError> SelectorState::apply_kv_events(
    const KvEventBatch& batch) {
  return workers_.index().apply(batch);
}

std::expected<discovery::ApplyOutcome, discovery::IndexError> SelectorState::load_kv_dump(
    const KvDump& dump) {
  return workers_.index().load_dump(dump);
}

std::expected<void, discovery::LoadError> SelectorState::update_load(
    WorkerWithDpRank worker, const discovery::ConfirmedLoad& load) {
  return workers_.load().update_confirmed(worker, load);
}

void SelectorState::expire(TimePoint now, std::vector<WorkerId>& removed_workers) {
  const std::size_t before = removed_workers.size();
  workers_.expire(now, removed_workers);
  sync_node_share();
  absl::erase_if(refused_, [&](const auto& entry) { return entry.second.forget_at <= now; });
  return_ejected(now);
  if (removed_workers.size() != before) {
    for (std::size_t i = before; i < removed_workers.size(); ++i) health_.left(removed_workers[i]);
    rows_dirty_ = true;
    forget_block_size_when_empty();
  }
}

void SelectorState::build_policies() {
  policies_block_size_ = block_size_;
  plugins::worker_selection::RouterConfig router = options_.router;
  router.block_size = block_size_;
  for (const WorkerType worker_type :
       {WorkerType::Aggregated, WorkerType::Prefill, WorkerType::Decode, WorkerType::Encode}) {
    const auto role = static_cast<std::size_t>(worker_type);
    policies_[role].reset();
    scorer_names_[role].reset();
    policy_failures_[role].clear();
    auto built = selection::build_policy(selection::selection_or_builtin(*plugins_, worker_type),
                                         router, worker_type, options_.partition);
    if (!built) {
      policy_failures_[role] = std::move(built.error());
      if (options_.on_policy_build_failure) {
        options_.on_policy_build_failure(options_.partition, worker_type, policy_failures_[role]);
      }
      continue;
    }
    policies_[role].emplace(std::move(*built));
    const auto names = selection::scorer_names(*policies_[role]);
    scorer_names_[role] =
        std::make_shared<const std::vector<std::string>>(names.begin(), names.end());
  }
}

const std::string& SelectorState::policy_name(WorkerType worker_type) const {
  return selection::selection_or_builtin(*plugins_, worker_type).instance_name;
}

void SelectorState::rebuild_rows() const {
  for (RoleRows& rows : rows_) {
    rows.descriptors.clear();
    rows.slots.clear();
    rows.text_slots.clear();
    rows.max_batched_tokens.clear();
  }
  // Sorted by id so that the host sees a stable order whatever the hash map's iteration order.
  std::vector<const discovery::CatalogEntry*> entries;
  entries.reserve(workers_.catalog().size());
  for (const auto& [id, entry] : workers_.catalog().entries()) entries.push_back(&entry);
  std::ranges::sort(entries, {}, [](const discovery::CatalogEntry* entry) {
    return entry->registration.worker_id;
  });
  for (const discovery::CatalogEntry* entry : entries) {
    const discovery::WorkerRegistration& registration = entry->registration;
    RoleRows& rows = rows_[static_cast<std::size_t>(registration.role)];
    for (DpRank rank = 0; rank < registration.data_parallel_size; ++rank) {
      const WorkerWithDpRank worker{registration.worker_id, rank};
      const auto slot = workers_.index().slot_of(worker);
      const auto text_slot = workers_.text_index().slot_of(worker);
      if (!slot || !text_slot) continue;  // not indexed: cannot be offered
      rows.descriptors.push_back(
          selection::WorkerDescriptor{.worker = worker,
                                      .taints = registration.taints,
                                      .available = !health_.is_ejected(registration.worker_id)});
      rows.slots.push_back(*slot);
      rows.text_slots.push_back(*text_slot);
      rows.max_batched_tokens.push_back(registration.max_num_batched_tokens);
    }
  }
  rows_dirty_ = false;
}

void SelectorState::refresh_busy_signals(RoleRows& rows) const {
  for (std::size_t row = 0; row < rows.descriptors.size(); ++row) {
    selection::WorkerDescriptor& descriptor = rows.descriptors[row];
    const auto view = workers_.load().rank_load(descriptor.worker);
    if (!view) continue;
    descriptor.active_prefill_tokens = queued_prefill_of(*view);
    descriptor.kv_usage = kv_usage_of(*view);
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

const discovery::KvIndexer& SelectorState::index_for(selection::PromptKeys keys) const {
  return keys == selection::PromptKeys::text_blocks ? workers_.text_index() : workers_.index();
}

const std::vector<discovery::SlotId>& SelectorState::RoleRows::slots_for(
    selection::PromptKeys keys) const {
  return keys == selection::PromptKeys::text_blocks ? text_slots : slots;
}

const discovery::MatchResult& SelectorState::matches_for(
    const selection::SelectionRequest& request) {
  if (!in_route_ || matches_for_route_ != route_counter_) {
    index_for(request.prompt_keys).find_matches(request.block_hashes, matches_);
    matches_for_route_ = in_route_ ? route_counter_ : 0;
  }
  return matches_;
}

void SelectorState::set_overlap(RouteOutcome& outcome, const selection::SelectionRequest& request) {
  const auto slot = index_for(request.prompt_keys).slot_of(outcome.worker);
  if (!slot) return;
  if (const discovery::WorkerMatch* match = matches_for(request).find(*slot)) {
    outcome.device_overlap_blocks = match->device_blocks;
    outcome.host_overlap_blocks = match->host_blocks;
    outcome.disk_overlap_blocks = match->disk_blocks;
  }
}

void SelectorState::compute_signals(const selection::SelectionRequest& request,
                                    WorkerType worker_type, std::span<const std::uint32_t> rows,
                                    std::span<selection::WorkerCacheInput> cache_out,
                                    std::span<selection::WorkerLoadInput> load_out) {
  const RoleRows& role_rows = rows_[static_cast<std::size_t>(worker_type)];
  const discovery::MatchResult& matches = matches_for(request);
  const std::vector<discovery::SlotId>& slots = role_rows.slots_for(request.prompt_keys);
  const std::uint64_t prompt_blocks = request.block_hashes.size();
  if (!load_out.empty()) workers_.load().prepare(request.block_hashes, projection_scratch_);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::uint32_t row = rows[i];
    const discovery::WorkerMatch* match = matches.find(slots[row]);
    if (!cache_out.empty()) {
      cache_out[i] = match ? selection::WorkerCacheInput{static_cast<double>(match->device_blocks),
                                                         static_cast<double>(match->host_blocks),
                                                         static_cast<double>(match->disk_blocks)}
                           : selection::WorkerCacheInput{};
    }
    if (!load_out.empty()) {
      // The candidate's own prefill is the policy's to weigh (from CACHE), so the projection
      // leaves it out: active_prefill_tokens is what the worker already has to do.
      const auto projection = workers_.load().project(
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

std::expected<void, RouteFailure> SelectorState::prepare(RouteRequest& request, TimePoint now) {
  selection::SelectionRequest& selection = request.selection;
  selection.now = now;
  if (selection.prompt_tokens == 0) {
    return std::unexpected(RouteFailure{Error::invalid_request, "the prompt is empty"});
  }
  if (block_size_ == 0) {
    return std::unexpected(explain(
        RouteFailure{Error::no_workers,
                     fmt::format("no worker serves model '{}' group '{}' yet",
                                 options_.partition.model, options_.partition.routing_group)}));
  }
  if (!request.prompt_token_ids.empty()) {
    const discovery::BlockHasher hasher{block_size_, request.cache_namespace};
    selection.block_hashes.clear();
    hasher.append_sequence_hashes(request.prompt_token_ids, selection.block_hashes);
    selection.prompt_keys = selection::PromptKeys::kv_blocks;
    request.prompt_token_ids.clear();
  } else if (!request.prompt_text.empty()) {
    const discovery::TextBlockHasher hasher{block_size_, request.cache_namespace};
    selection.block_hashes.clear();
    hasher.append_sequence_hashes(request.prompt_text, selection.block_hashes);
    selection.prompt_keys = selection::PromptKeys::text_blocks;
    request.prompt_text = std::string{};
  }
  if (selection.block_hashes.size() > selection.prompt_tokens / block_size_) {
    return std::unexpected(
        RouteFailure{Error::invalid_request,
                     fmt::format("{} block hashes exceed the {} full blocks of a {}-token prompt",
                                 selection.block_hashes.size(),
                                 selection.prompt_tokens / block_size_, selection.prompt_tokens)});
  }
  // Refused before selection, so that a duplicate leaves no trace in stateful policies.
  if (workers_.load().has_booking(selection.request_id)) {
    return std::unexpected(
        RouteFailure{Error::invalid_request,
                     fmt::format("request id '{}' is already routed and not yet released",
                                 selection.request_id)});
  }
  if (auto refused = over_cap(selection.block_hashes.size(), capped_client(request))) {
    return std::unexpected(std::move(*refused));
  }
  return {};
}

std::optional<RouteFailure> SelectorState::over_cap(std::uint64_t blocks,
                                                    std::string_view client) const {
  const discovery::PredictedLoad& load = workers_.load();
  const BookingCaps& partition = options_.partition_caps;
  std::optional<BookingCapKind> kind;
  std::uint64_t held = 0;
  std::uint64_t cap = 0;
  const auto check = [&](BookingCapKind which, std::uint64_t now_held, std::uint64_t adding,
                         std::uint64_t limit) {
    if (kind || limit == 0 || now_held + adding <= limit) return;
    kind = which;
    held = now_held;
    cap = limit;
  };
  check(BookingCapKind::partition_bookings, load.open_bookings(), 1, partition.max_bookings);
  check(BookingCapKind::partition_blocks, load.booked_prompt_blocks(), blocks,
        partition.max_blocks);
  if (const NodeBookingTotals* node = node_share_.totals()) {
    check(BookingCapKind::node_bookings, node->bookings.load(std::memory_order_relaxed), 1,
          node->caps.max_bookings);
    check(BookingCapKind::node_blocks, node->blocks.load(std::memory_order_relaxed), blocks,
          node->caps.max_blocks);
  }
  // Checked last, after the locks-free caps: a client's totals take a short lock.
  if (const ClientBookingTotals* clients = client_share_->totals();
      clients != nullptr && !client.empty() && !kind &&
      (clients->caps.max_bookings != 0 || clients->caps.max_blocks != 0)) {
    const ClientHeld mine = clients->held(client);
    check(BookingCapKind::client_bookings, mine.bookings, 1, clients->caps.max_bookings);
    check(BookingCapKind::client_blocks, mine.blocks, blocks, clients->caps.max_blocks);
  }
  if (!kind) return std::nullopt;
  if (options_.on_cap_refusal) options_.on_cap_refusal(*kind);
  const std::string_view scope = cap_scope(*kind);
  const std::string where = scope == "node" ? std::string{"the node"}
                            : scope == "client"
                                ? std::string{"this client, over the node"}
                                : fmt::format("partition '{}' group '{}'", options_.partition.model,
                                              options_.partition.routing_group);
  if (cap_resource(*kind) == "bookings") {
    return RouteFailure{
        Error::overloaded,
        fmt::format("{} open-booking cap reached: {} bookings open, at most {} ({}); retry after "
                    "reporting or releasing bookings",
                    scope, held, cap, where)};
  }
  return RouteFailure{
      Error::overloaded,
      fmt::format("{} booked-blocks cap reached: {} blocks booked, a request of {} would pass "
                  "the cap of {} ({}); retry after reporting or releasing bookings",
                  scope, held, blocks, cap, where)};
}

std::expected<RouteOutcome, RouteFailure> SelectorState::route(RouteRequest& request,
                                                               TimePoint now) {
  if (auto valid = prepare(request, now); !valid) return std::unexpected(std::move(valid.error()));
  return_ejected(now);
  if (const auto& pin = request.selection.pinned_worker) {
    if (pin->dp_rank) return route_to(request, {pin->worker_id, *pin->dp_rank}, now);
    return route_to(request, pinned_rank(request, pin->worker_id), now);
  }
  const auto role = static_cast<std::size_t>(request.worker_type);
  if (!policies_[role])
    return std::unexpected(RouteFailure{Error::policy_failed, policy_failures_[role]});
  ++route_counter_;
  in_route_ = true;
  // Usually false: only while a worker that joined a warm partition is in its slow start.
  const bool ramping = !request.query_only && health_.ramping(now);
  if (ramping) hide_ramping(request.worker_type, now);
  auto selected =
      selection::select_worker(*policies_[role], request.selection, options_.partition, *this);
  if (ramping && !hidden_rows_.empty()) {
    unhide_ramping(request.worker_type);
    const bool none_left = !selected && (selected.error().kind() == Kind::NoEligibleWorkers ||
                                         selected.error().kind() == Kind::AllFiltered);
    if (none_left) {
      // The ramp limits a worker's share; it never turns away a request only it can take.
      for (const std::uint32_t row : hidden_rows_) {
        health_.refund(
            rows_[static_cast<std::size_t>(request.worker_type)].descriptors[row].worker.worker_id);
      }
      selected =
          selection::select_worker(*policies_[role], request.selection, options_.partition, *this);
    }
    hidden_rows_.clear();
  }
  if (!selected) {
    in_route_ = false;
    return std::unexpected(explain(
        RouteFailure{to_error(selected.error().kind()), std::string{selected.error().message()}}));
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
  } else {
    // The policy asked for no CACHE signals; the booking still needs the chosen worker's overlap.
    set_overlap(outcome, request.selection);
  }
  in_route_ = false;
  outcome.total_cost = selected->total_cost;
  outcome.scorer_costs = selected->scorer_costs;
  outcome.scorer_names = scorer_names_[static_cast<std::size_t>(request.worker_type)];
  outcome.eligible_workers = selected->eligible_workers;
  return book(request, std::move(outcome), now, &*selected);
}

WorkerWithDpRank SelectorState::pinned_rank(const RouteRequest& request, WorkerId worker) {
  const auto descriptors = workers(request.worker_type);
  const discovery::MatchResult& matches = matches_for(request.selection);
  const std::vector<discovery::SlotId>& slots =
      rows_[static_cast<std::size_t>(request.worker_type)].slots_for(request.selection.prompt_keys);
  // Rank 0 when none can take it: route_to then says why.
  WorkerWithDpRank best{worker, 0};
  std::optional<std::uint64_t> best_cached;
  for (std::size_t row = 0; row < descriptors.size(); ++row) {
    const selection::WorkerDescriptor& descriptor = descriptors[row];
    if (descriptor.worker.worker_id != worker ||
        selection::violated_restriction(request.selection, descriptor.worker, descriptor.available,
                                        descriptor.taints)) {
      continue;
    }
    std::uint64_t cached = 0;
    if (const discovery::WorkerMatch* match = matches.find(slots[row])) {
      cached = std::uint64_t{match->device_blocks} + match->host_blocks + match->disk_blocks;
    }
    if (!best_cached || cached > *best_cached) {
      best = descriptor.worker;
      best_cached = cached;
    }
  }
  return best;
}

void SelectorState::eligible_prefill_loads(const RouteRequest& request,
                                           std::vector<classifiers::WorkerPrefillLoad>& out) const {
  out.clear();
  const auto descriptors = workers(request.worker_type);
  const RoleRows& rows = rows_[static_cast<std::size_t>(request.worker_type)];
  for (std::size_t row = 0; row < descriptors.size(); ++row) {
    const selection::WorkerDescriptor& descriptor = descriptors[row];
    if (selection::violated_restriction(request.selection, descriptor.worker, descriptor.available,
                                        descriptor.taints)) {
      continue;
    }
    classifiers::WorkerPrefillLoad load{.max_batched_tokens = rows.max_batched_tokens[row]};
    if (const auto view = workers_.load().rank_load(descriptor.worker)) {
      load.active_prefill_tokens = queued_prefill_of(*view);
      // As the busy signals count it (none without a capacity: never busy by KV).
      load.kv_usage = kv_usage_of(*view);
    }
    out.push_back(load);
  }
}

template <class Cost>
std::optional<std::uint64_t> SelectorState::least_over_eligible_ranks(const RouteRequest& request,
                                                                      Cost cost) {
  const auto descriptors = workers(request.worker_type);
  const RoleRows& rows = rows_[static_cast<std::size_t>(request.worker_type)];
  const discovery::MatchResult& matches = matches_for(request.selection);
  const std::vector<discovery::SlotId>& slots = rows.slots_for(request.selection.prompt_keys);
  std::optional<std::uint64_t> least;
  for (std::size_t row = 0; row < descriptors.size(); ++row) {
    const selection::WorkerDescriptor& descriptor = descriptors[row];
    if (selection::violated_restriction(request.selection, descriptor.worker, descriptor.available,
                                        descriptor.taints)) {
      continue;
    }
    std::uint64_t cached_blocks = 0;
    if (const discovery::WorkerMatch* match = matches.find(slots[row])) {
      cached_blocks = std::uint64_t{match->device_blocks} + match->host_blocks + match->disk_blocks;
    }
    const std::uint64_t value =
        cost(descriptor.worker, discovery::uncached_prefill_tokens(request.selection.prompt_tokens,
                                                                   cached_blocks, block_size_));
    least = std::min(least.value_or(value), value);
  }
  return least;
}

std::uint64_t SelectorState::fewest_uncached_tokens(const RouteRequest& request) {
  return least_over_eligible_ranks(
             request, [](WorkerWithDpRank, std::uint64_t uncached) { return uncached; })
      .value_or(request.selection.prompt_tokens);
}

std::optional<std::uint64_t> SelectorState::least_prefill_work(const RouteRequest& request) {
  return least_over_eligible_ranks(request, [&](WorkerWithDpRank worker, std::uint64_t uncached) {
    return queued_prefill_tokens(worker) + uncached;
  });
}

std::uint64_t SelectorState::queued_prefill_tokens(WorkerWithDpRank worker) const {
  const auto view = workers_.load().rank_load(worker);
  return view ? queued_prefill_of(*view) : 0;
}

std::uint64_t SelectorState::active_kv_blocks(WorkerWithDpRank worker) const {
  const auto view = workers_.load().rank_load(worker);
  if (!view) return 0;
  const std::uint64_t reported = view->confirmed ? view->confirmed->kv_blocks_used : 0;
  return plus_change(reported, view->blocks_since_report);
}

std::vector<std::uint64_t> SelectorState::work_ahead_tokens() const {
  std::vector<std::uint64_t> tokens;
  for (const WorkerType role : {WorkerType::Prefill, WorkerType::Aggregated, WorkerType::Decode}) {
    const auto rows = workers(role);
    if (rows.empty()) continue;
    tokens.reserve(rows.size());
    for (const selection::WorkerDescriptor& row : rows) {
      tokens.push_back(queued_prefill_tokens(row.worker) +
                       active_kv_blocks(row.worker) * block_size_);
    }
    break;
  }
  return tokens;
}

std::optional<std::string> SelectorState::unroutable_reason(const RouteRequest& request,
                                                            WorkerWithDpRank worker) const {
  const auto rows = workers(request.worker_type);
  const auto row = std::ranges::find(rows, worker, &selection::WorkerDescriptor::worker);
  if (row == rows.end()) {
    const discovery::CatalogEntry* entry = workers_.catalog().find(worker.worker_id);
    if (entry == nullptr) return std::string{"it is not registered in this partition"};
    const discovery::WorkerRegistration& registration = entry->registration;
    if (registration.role != request.worker_type) {
      return fmt::format("it serves {} requests, not {}", as_str(registration.role),
                         as_str(request.worker_type));
    }
    if (worker.dp_rank >= registration.data_parallel_size) {
      return fmt::format("it has {} data-parallel ranks", registration.data_parallel_size);
    }
    return std::string{"the rank is not indexed"};
  }
  if (const auto violation =
          selection::violated_restriction(request.selection, worker, row->available, row->taints)) {
    return selection::describe(*violation, request.selection);
  }
  return std::nullopt;
}

// GCC 12 (-O2) reports absl::InlinedVector's inline storage as maybe-uninitialized when an
// outcome with no scorer costs is moved; the storage is empty and never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
std::expected<RouteOutcome, RouteFailure> SelectorState::route_to(RouteRequest& request,
                                                                  WorkerWithDpRank worker,
                                                                  TimePoint now) {
  if (auto valid = prepare(request, now); !valid) return std::unexpected(std::move(valid.error()));
  if (auto reason = unroutable_reason(request, worker)) {
    return std::unexpected(RouteFailure{
        Error::no_workers, fmt::format("worker {} rank {} cannot take request '{}': {}",
                                       worker.worker_id, worker.dp_rank, request.id(), *reason)});
  }
  RouteOutcome outcome;
  outcome.worker = worker;
  outcome.eligible_workers = 1;
  set_overlap(outcome, request.selection);
  return book(request, std::move(outcome), now);
}
#pragma GCC diagnostic pop

std::expected<RouteOutcome, RouteFailure> SelectorState::book(
    const RouteRequest& request, RouteOutcome outcome, TimePoint now,
    const selection::SelectionResult* selected) {
  const selection::SelectionRequest& input = request.selection;
  const std::uint64_t cached_blocks = std::uint64_t{outcome.device_overlap_blocks} +
                                      outcome.host_overlap_blocks + outcome.disk_overlap_blocks;
  outcome.uncached_prefill_tokens =
      discovery::uncached_prefill_tokens(input.prompt_tokens, cached_blocks, block_size_);
  if (request.query_only) return outcome;
  outcome.booking_expires_at = now + options_.booking_ttl;

  // Empty: no per-client cap applies (none configured, or one of the node's own actors).
  const std::string_view client =
      client_share_->totals() != nullptr ? capped_client(request) : std::string_view{};
  auto booked = workers_.load().book(discovery::BookingRequest{
      .request_id = input.request_id,
      .worker = outcome.worker,
      .prompt_blocks = {input.block_hashes.begin(), input.block_hashes.end()},
      // After the prefill hop the prompt's KV arrives by transfer: nothing to prefill here.
      .uncached_prefill_tokens =
          request.hop == RouteHop::decode_after_transfer ? 0 : outcome.uncached_prefill_tokens,
      .expires_at = outcome.booking_expires_at,
      .client = std::string{client},
  });
  sync_node_share();
  if (booked && !client.empty()) client_share_->add(client, input.block_hashes.size());
  if (!booked) {
    return std::unexpected(RouteFailure{
        booked.error() == discovery::LoadError::duplicate_booking ? Error::invalid_request
                                                                  : Error::unavailable,
        fmt::format("cannot book request '{}': {}", input.request_id,
                    discovery::as_str(booked.error()))});
  }
  // Text blocks, and workers that publish no KV events: the routing decision is the only evidence
  // of what they will cache.
  if (input.prompt_keys == selection::PromptKeys::text_blocks) {
    (void)workers_.text_index().record_routing(outcome.worker, input.block_hashes, now);
  } else if (const auto* entry = workers_.catalog().find(outcome.worker.worker_id);
             entry != nullptr && !entry->registration.publishes_kv_events) {
    (void)workers_.index().record_routing(outcome.worker, input.block_hashes, now);
  }
  if (auto& policy = policies_[static_cast<std::size_t>(request.worker_type)]) {
    selection::SelectionHost& host = selection::SelectionHost::of(*policy);
    if (host.has_observers()) {
      plugins::worker_selection::RoutedRequest routed{
          .request_id = input.request_id,
          .worker = outcome.worker,
          .prompt_tokens = input.prompt_tokens,
          .block_size = block_size_,
          .routed_at = now,
      };
      if (selected != nullptr) {
        routed.cache = selected->cache;
        routed.load = selected->load;
      }
      host.notify_routed(routed);
    }
  }
  return outcome;
}

std::optional<FailureVerdict> SelectorState::report_health(const WorkerHealthReport& report,
                                                           TimePoint now) {
  if (workers_.catalog().find(report.worker) == nullptr) return std::nullopt;
  if (!report.failure) {
    health_.success(report.worker);
    return FailureVerdict{};
  }
  const FailureVerdict verdict = health_.failure(report.worker, now, workers_.catalog().size());
  if (verdict.ejected) mark_ejections();
  return verdict;
}

void SelectorState::return_ejected(TimePoint now) {
  const std::size_t before = returned_.size();
  health_.return_due(now, returned_);
  if (returned_.size() != before) mark_ejections();
}

void SelectorState::mark_ejections() {
  if (rows_dirty_) return;  // the rebuild marks them
  for (RoleRows& rows : rows_) {
    for (selection::WorkerDescriptor& descriptor : rows.descriptors) {
      descriptor.available = !health_.is_ejected(descriptor.worker.worker_id);
    }
  }
}

void SelectorState::hide_ramping(WorkerType worker_type, TimePoint now) {
  hidden_rows_.clear();
  if (rows_dirty_) rebuild_rows();
  RoleRows& rows = rows_[static_cast<std::size_t>(worker_type)];
  for (std::size_t row = 0; row < rows.descriptors.size(); ++row) {
    selection::WorkerDescriptor& descriptor = rows.descriptors[row];
    if (!descriptor.available) continue;
    // Ranks of one worker share its credit: the worker is offered or hidden as a whole.
    if (row > 0 && rows.descriptors[row - 1].worker.worker_id == descriptor.worker.worker_id) {
      if (!hidden_rows_.empty() && hidden_rows_.back() == row - 1) {
        descriptor.available = false;
        hidden_rows_.push_back(static_cast<std::uint32_t>(row));
      }
      continue;
    }
    if (!health_.offer(descriptor.worker.worker_id, now)) {
      descriptor.available = false;
      hidden_rows_.push_back(static_cast<std::uint32_t>(row));
    }
  }
}

void SelectorState::unhide_ramping(WorkerType worker_type) {
  RoleRows& rows = rows_[static_cast<std::size_t>(worker_type)];
  for (const std::uint32_t row : hidden_rows_) rows.descriptors[row].available = true;
}

std::expected<void, discovery::LoadError> SelectorState::first_token(
    std::string_view request_id, TimePoint now,
    std::optional<plugins::worker_selection::TtftCalibration>* calibration) {
  auto reported = workers_.load().first_token(request_id);
  if (!reported) return reported;
  for_each_observed_policy(policies_, [&](selection::SelectionHost& host) {
    auto told = host.notify_first_token(request_id, now);
    if (calibration != nullptr && told) *calibration = told;
  });
  return reported;
}

std::expected<void, discovery::LoadError> SelectorState::release(std::string_view request_id,
                                                                 discovery::BookingEnd end,
                                                                 TimePoint now) {
  auto released = workers_.load().release(request_id, end);
  if (!released) return released;
  sync_node_share();
  using plugins::worker_selection::RoutedRequestEnd;
  const RoutedRequestEnd ended =
      end == discovery::BookingEnd::completed   ? RoutedRequestEnd::Completed
      : end == discovery::BookingEnd::cancelled ? RoutedRequestEnd::Cancelled
                                                : RoutedRequestEnd::Failed;
  for_each_observed_policy(policies_, [&](selection::SelectionHost& host) {
    host.notify_ended(request_id, ended, now);
  });
  return released;
}

std::vector<std::pair<WorkerType, plugins::worker_selection::LearntValue>>
SelectorState::learnt_values() const {
  std::vector<std::pair<WorkerType, plugins::worker_selection::LearntValue>> values;
  for_each_observed_policy(policies_, [&](const selection::SelectionHost& host) {
    for (auto& value : host.learnt_values()) {
      values.emplace_back(host.worker_type(), std::move(value));
    }
  });
  return values;
}

}  // namespace kvr
