#include "selection/wire/route_messages.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "discovery/block_hash.hpp"
#include "messages/worker_role.hpp"

namespace kvr {
namespace {

std::unexpected<RouteFailure> invalid(std::string message) {
  return std::unexpected(RouteFailure{Error::invalid_request, std::move(message)});
}

std::optional<InputTrigger> trigger_from(v1::InputTrigger trigger) {
  switch (trigger) {
    case v1::INPUT_TRIGGER_USER_MESSAGE:
      return InputTrigger::UserMessage;
    case v1::INPUT_TRIGGER_TOOL_RESULT:
      return InputTrigger::ToolResult;
    case v1::INPUT_TRIGGER_OTHER:
      return InputTrigger::Other;
    default:
      return std::nullopt;
  }
}

v1::InputTrigger trigger_to(InputTrigger trigger) {
  switch (trigger) {
    case InputTrigger::UserMessage:
      return v1::INPUT_TRIGGER_USER_MESSAGE;
    case InputTrigger::ToolResult:
      return v1::INPUT_TRIGGER_TOOL_RESULT;
    case InputTrigger::Other:
      return v1::INPUT_TRIGGER_OTHER;
  }
  return v1::INPUT_TRIGGER_OTHER;
}

}  // namespace

v1::RouteRequest encode_route_request(const RouteRequest& data) {
  const selection::SelectionRequest& request = data.selection;
  v1::RouteRequest wire;
  wire.set_request_id(std::string{data.client_id()});
  wire.set_model(data.partition.model);
  wire.set_routing_group(data.partition.routing_group);
  wire.set_worker_role(to_wire(data.worker_type));
  wire.set_tenant(data.tenant);
  wire.set_query_only(data.query_only);
  if (!data.prompt_token_ids.empty()) {
    wire.mutable_tokens()->mutable_ids()->Add(data.prompt_token_ids.begin(),
                                              data.prompt_token_ids.end());
    wire.set_cache_namespace(data.cache_namespace);
  } else if (!data.prompt_text.empty()) {
    wire.mutable_text()->set_utf8(data.prompt_text);
    wire.set_cache_namespace(data.cache_namespace);
  } else {
    auto* hashes = wire.mutable_block_hashes();
    hashes->set_prompt_tokens(request.prompt_tokens);
    hashes->mutable_hashes()->Add(request.block_hashes.begin(), request.block_hashes.end());
  }
  if (request.expected_output_tokens) {
    wire.set_expected_output_tokens(*request.expected_output_tokens);
  }
  if (const auto& session = request.session) {
    auto* metadata = wire.mutable_session();
    metadata->set_session_id(std::string{session->session_id()});
    if (const auto parent = session->parent_session_id()) {
      metadata->set_parent_session_id(std::string{*parent});
    }
    if (const auto final_turn = session->session_final()) metadata->set_session_final(*final_turn);
    if (const auto trigger = session->input_trigger()) {
      metadata->set_input_trigger(trigger_to(*trigger));
    }
  }
  wire.set_priority(request.strict_priority);
  if (const auto& pinned = request.pinned_worker) {
    auto* ref = wire.mutable_pinned_worker();
    ref->set_worker_id(pinned->worker_id);
    if (pinned->dp_rank) ref->set_dp_rank(*pinned->dp_rank);
  }
  wire.mutable_allowed_workers()->Add(request.allowed_workers.begin(),
                                      request.allowed_workers.end());
  wire.mutable_excluded_workers()->Add(request.excluded_workers.begin(),
                                       request.excluded_workers.end());
  for (const std::string& taint : request.required_taints) wire.add_required_taints(taint);
  for (const auto& taint : request.preferred_taints) {
    (*wire.mutable_preferred_taints())[taint.taint] = taint.weight;
  }
  return wire;
}

std::expected<RouteRequest, RouteFailure> decode_route_request(const v1::RouteRequest& wire,
                                                               const RouteDecodeLimits& limits) {
  const auto too_long = [&](const std::string& value) {
    return value.size() > limits.max_id_length;
  };
  if (wire.request_id().empty()) return invalid("request_id: empty");
  if (too_long(wire.request_id())) {
    return invalid(fmt::format("request_id: longer than {} bytes", limits.max_id_length));
  }
  if (wire.model().empty()) return invalid("model: empty");
  if (too_long(wire.model()) || too_long(wire.routing_group()) ||
      too_long(wire.cache_namespace())) {
    return invalid(fmt::format("model, routing_group or cache_namespace: longer than {} bytes",
                               limits.max_id_length));
  }
  if (too_long(wire.tenant())) {
    return invalid(fmt::format("tenant: longer than {} bytes", limits.max_id_length));
  }
  RouteRequest data;
  selection::SelectionRequest& request = data.selection;
  request.request_id = wire.request_id();
  data.partition.model = wire.model();
  data.tenant = wire.tenant();
  data.partition.routing_group = wire.routing_group().empty() ? "default" : wire.routing_group();
  // A request that names no role is for aggregated workers.
  const auto worker_type = wire.worker_role() == v1::WORKER_ROLE_UNSPECIFIED
                               ? std::optional{WorkerType::Aggregated}
                               : worker_type_from_wire(wire.worker_role());
  if (!worker_type) {
    return invalid(
        fmt::format("worker_role: unknown value {}", static_cast<int>(wire.worker_role())));
  }
  data.worker_type = *worker_type;

  switch (wire.prompt_case()) {
    case v1::RouteRequest::kTokens: {
      const auto& ids = wire.tokens().ids();
      if (ids.empty()) return invalid("tokens: empty prompt");
      if (static_cast<std::size_t>(ids.size()) > limits.max_prompt_tokens) {
        return invalid(fmt::format("tokens: {} tokens exceed the limit of {}", ids.size(),
                                   limits.max_prompt_tokens));
      }
      request.prompt_tokens = static_cast<std::size_t>(ids.size());
      data.prompt_token_ids.assign(ids.begin(), ids.end());
      data.cache_namespace = wire.cache_namespace();
      break;
    }
    case v1::RouteRequest::kBlockHashes: {
      const auto& hashes = wire.block_hashes();
      request.prompt_tokens = hashes.prompt_tokens();
      if (request.prompt_tokens == 0) return invalid("block_hashes.prompt_tokens: zero");
      if (request.prompt_tokens > limits.max_prompt_tokens) {
        return invalid(fmt::format("block_hashes.prompt_tokens: {} exceeds the limit of {}",
                                   request.prompt_tokens, limits.max_prompt_tokens));
      }
      // Their count is checked against the partition's block size by its selector.
      if (static_cast<std::size_t>(hashes.hashes_size()) > request.prompt_tokens) {
        return invalid(fmt::format("block_hashes: {} hashes for a {}-token prompt",
                                   hashes.hashes_size(), request.prompt_tokens));
      }
      request.block_hashes.assign(hashes.hashes().begin(), hashes.hashes().end());
      break;
    }
    case v1::RouteRequest::kText: {
      const std::string& text = wire.text().utf8();
      if (text.empty()) return invalid("text: empty prompt");
      request.prompt_tokens = discovery::estimated_prompt_tokens(text.size());
      if (request.prompt_tokens > limits.max_prompt_tokens) {
        return invalid(fmt::format("text: {} bytes exceed the limit of {} (4 per token)",
                                   text.size(),
                                   limits.max_prompt_tokens * discovery::kTextBytesPerToken));
      }
      data.prompt_text = text;
      data.cache_namespace = wire.cache_namespace();
      break;
    }
    case v1::RouteRequest::PROMPT_NOT_SET:
      return invalid("prompt: none of tokens, block_hashes or text given");
  }

  if (wire.has_expected_output_tokens()) {
    request.expected_output_tokens = wire.expected_output_tokens();
  }
  if (wire.has_session()) {
    const auto& session = wire.session();
    if (session.session_id().empty()) return invalid("session.session_id: empty");
    if (too_long(session.session_id()) || too_long(session.parent_session_id())) {
      return invalid(fmt::format("session ids: longer than {} bytes", limits.max_id_length));
    }
    request.session.emplace(
        session.session_id(),
        session.has_parent_session_id() ? std::optional<std::string>{session.parent_session_id()}
                                        : std::nullopt,
        session.has_session_final() ? std::optional<bool>{session.session_final()} : std::nullopt,
        trigger_from(session.input_trigger()));
  }
  request.strict_priority = wire.priority();
  if (wire.has_pinned_worker()) {
    const auto& pinned = wire.pinned_worker();
    if (pinned.worker_id() == 0) return invalid("pinned_worker.worker_id: zero");
    request.pinned_worker = plugins::worker_selection::WorkerAffinityTarget{
        .worker_id = pinned.worker_id(),
        .dp_rank = pinned.has_dp_rank() ? std::optional<DpRank>{pinned.dp_rank()} : std::nullopt};
  }
  if (static_cast<std::size_t>(wire.allowed_workers_size()) > limits.max_allowed_workers) {
    return invalid(fmt::format("allowed_workers: more than {}", limits.max_allowed_workers));
  }
  request.allowed_workers.assign(wire.allowed_workers().begin(), wire.allowed_workers().end());
  if (static_cast<std::size_t>(wire.excluded_workers_size()) > limits.max_allowed_workers) {
    return invalid(fmt::format("excluded_workers: more than {}", limits.max_allowed_workers));
  }
  request.excluded_workers.assign(wire.excluded_workers().begin(), wire.excluded_workers().end());
  if (static_cast<std::size_t>(wire.required_taints_size()) > limits.max_taints ||
      wire.preferred_taints_size() > static_cast<int>(limits.max_taints)) {
    return invalid(
        fmt::format("required_taints or preferred_taints: more than {}", limits.max_taints));
  }
  for (const std::string& taint : wire.required_taints()) {
    if (taint.empty() || too_long(taint)) return invalid("required_taints: empty or too long");
    request.required_taints.push_back(taint);
  }
  for (const auto& [taint, weight] : wire.preferred_taints()) {
    if (taint.empty() || too_long(taint)) return invalid("preferred_taints: empty or too long");
    if (!std::isfinite(weight)) {
      return invalid(fmt::format("preferred_taints.{}: weight is not finite", taint));
    }
    request.preferred_taints.push_back(selection::PreferredTaint{taint, weight});
  }
  // Map order is unspecified on the wire; sorted, the same request always selects the same way.
  std::ranges::sort(request.preferred_taints, {}, &selection::PreferredTaint::taint);
  data.query_only = wire.query_only();
  return data;
}

v1::RouteDecision encode_route_error(std::string_view request_id, Error error,
                                     std::string_view message,
                                     std::optional<std::chrono::milliseconds> retry_after) {
  v1::RouteDecision decision;
  decision.set_request_id(std::string{request_id});
  auto* failure = decision.mutable_error();
  failure->set_code(to_route_error_code(error));
  failure->set_message(std::string{message});
  if (retry_after) {
    failure->set_retry_after_ms(static_cast<std::uint32_t>(
        std::clamp<std::int64_t>(retry_after->count(), 0, std::int64_t{UINT32_MAX})));
  }
  return decision;
}

v1::RouteDecision encode_route_success(std::string_view request_id, const RouteOutcome& outcome,
                                       const RouteSuccessInfo& info) {
  v1::RouteDecision decision;
  decision.set_request_id(std::string{request_id});
  auto* success = decision.mutable_success();
  success->set_worker_id(outcome.worker.worker_id);
  success->set_dp_rank(outcome.worker.dp_rank);
  success->set_device_overlap_blocks(outcome.device_overlap_blocks);
  success->set_host_overlap_blocks(outcome.host_overlap_blocks);
  success->set_disk_overlap_blocks(outcome.disk_overlap_blocks);
  success->set_booking_id(info.booking_id);
  success->set_booking_ttl_ms(static_cast<std::uint32_t>(info.booking_ttl.count()));
  success->set_policy(info.policy);
  success->set_total_cost(outcome.total_cost);
  for (std::size_t i = 0; i < outcome.scorer_costs.size(); ++i) {
    auto* cost = success->add_costs();
    const bool named = outcome.scorer_names && i < outcome.scorer_names->size();
    cost->set_scorer(named ? (*outcome.scorer_names)[i] : fmt::format("scorer_{}", i));
    cost->set_cost(outcome.scorer_costs[i]);
  }
  success->set_generate_subject(info.generate_subject);
  success->set_worker_http_url(info.http_url);
  return decision;
}

std::expected<LifecycleReportData, std::string> decode_lifecycle_report(
    const v1::LifecycleReport& wire, const RouteDecodeLimits& limits) {
  if (wire.booking_id().empty()) return std::unexpected("booking_id: empty");
  if (wire.booking_id().size() > limits.max_id_length) {
    return std::unexpected(fmt::format("booking_id: longer than {} bytes", limits.max_id_length));
  }
  LifecycleReportData data;
  data.booking_id = wire.booking_id();
  switch (wire.event()) {
    case v1::LIFECYCLE_EVENT_FIRST_TOKEN:
      data.event = LifecycleEventKind::FirstToken;
      break;
    case v1::LIFECYCLE_EVENT_COMPLETED:
      data.event = LifecycleEventKind::Completed;
      break;
    case v1::LIFECYCLE_EVENT_ABORTED:
      data.event = LifecycleEventKind::Aborted;
      break;
    default:
      return std::unexpected(
          fmt::format("event: unknown or unspecified value {}", static_cast<int>(wire.event())));
  }
  data.error = wire.error().substr(0, limits.max_id_length * 4);
  if (wire.has_context_tokens()) data.context_tokens = wire.context_tokens();
  switch (wire.abort_cause()) {
    case v1::ABORT_CAUSE_CLIENT_CANCELLED:
      data.abort_cause = AbortCause::client_cancelled;
      break;
    case v1::ABORT_CAUSE_WORKER_FAILED:
      data.abort_cause = AbortCause::worker_failed;
      break;
    case v1::ABORT_CAUSE_FIRST_TOKEN_TIMEOUT:
      data.abort_cause = AbortCause::first_token_timeout;
      break;
    case v1::ABORT_CAUSE_STREAM_TIMEOUT:
      data.abort_cause = AbortCause::stream_timeout;
      break;
    default:
      // Unspecified, or a cause newer than this node: it blames nobody.
      data.abort_cause = AbortCause::unspecified;
      break;
  }
  return data;
}

v1::AbortCause to_wire(AbortCause cause) {
  switch (cause) {
    case AbortCause::unspecified:
      return v1::ABORT_CAUSE_UNSPECIFIED;
    case AbortCause::client_cancelled:
      return v1::ABORT_CAUSE_CLIENT_CANCELLED;
    case AbortCause::worker_failed:
      return v1::ABORT_CAUSE_WORKER_FAILED;
    case AbortCause::first_token_timeout:
      return v1::ABORT_CAUSE_FIRST_TOKEN_TIMEOUT;
    case AbortCause::stream_timeout:
      return v1::ABORT_CAUSE_STREAM_TIMEOUT;
  }
  return v1::ABORT_CAUSE_UNSPECIFIED;
}

v1::LifecycleAck encode_lifecycle_ack(bool accepted, std::string_view message) {
  v1::LifecycleAck ack;
  ack.set_accepted(accepted);
  ack.set_message(std::string{message});
  return ack;
}

std::string_view as_str(LifecycleEventKind kind) {
  switch (kind) {
    case LifecycleEventKind::FirstToken:
      return "first_token";
    case LifecycleEventKind::Completed:
      return "completed";
    case LifecycleEventKind::Aborted:
      return "aborted";
  }
  return "unknown";
}

}  // namespace kvr
