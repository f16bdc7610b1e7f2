#include "selection/front_door/request_routing.hpp"

#include <charconv>
#include <random>

#include <fmt/format.h>

namespace kvr::front_door {

std::expected<RequestMetadata, HttpError> read_request_metadata(
    const std::function<std::string_view(std::string_view)>& header,
    std::string_view session_header) {
  RequestMetadata metadata;
  const auto read = [&](std::string_view name,
                        std::string& into) -> std::expected<void, HttpError> {
    const std::string_view text = header(name);
    if (text.size() > kMaxMetadataHeaderBytes) {
      return std::unexpected(
          bad_request(fmt::format("header {}: longer than {} bytes", name, kMaxMetadataHeaderBytes),
                      std::string{name}));
    }
    into.assign(text);
    return {};
  };
  std::string priority;
  for (auto [name, into] :
       {std::pair<std::string_view, std::string*>{session_header, &metadata.session_id},
        {"x-kvr-tenant", &metadata.tenant},
        {"x-kvr-routing-group", &metadata.routing_group},
        {"x-kvr-priority", &priority}}) {
    if (auto ok = read(name, *into); !ok) return std::unexpected(ok.error());
  }
  if (!priority.empty()) {
    const auto [end, error] =
        std::from_chars(priority.data(), priority.data() + priority.size(), metadata.priority);
    if (error != std::errc{} || end != priority.data() + priority.size()) {
      return std::unexpected(bad_request(
          "header x-kvr-priority: an integer in [0, 4294967295] is required", "x-kvr-priority"));
    }
  }
  return metadata;
}

v1::RouteRequest make_route_request(std::string request_id, const GenerationRequest& request,
                                    const RequestMetadata& metadata, const ModelTarget& target,
                                    std::span<const WorkerId> eligible, const RoutingKey& key) {
  v1::RouteRequest route;
  route.set_request_id(std::move(request_id));
  route.set_model(target.model);
  route.set_cache_namespace(target.adapter);
  // Always a list, even of every worker: an empty one would mean "any worker of the partition".
  route.mutable_allowed_workers()->Add(eligible.begin(), eligible.end());
  route.set_routing_group(metadata.routing_group);
  if (!key.tokens.empty()) {
    route.mutable_tokens()->mutable_ids()->Add(key.tokens.begin(), key.tokens.end());
  } else {
    route.mutable_text()->set_utf8(key.text);
  }
  if (request.max_tokens) route.set_expected_output_tokens(*request.max_tokens);
  if (!metadata.session_id.empty()) route.mutable_session()->set_session_id(metadata.session_id);
  route.set_priority(metadata.priority);
  route.set_tenant(!metadata.tenant.empty() ? metadata.tenant : request.user);
  return route;
}

void report_booking(RoutingGateway& gateway, const std::string& booking_id,
                    v1::LifecycleEvent event, v1::AbortCause cause, std::string error) {
  if (booking_id.empty()) return;
  v1::LifecycleReport report;
  report.set_booking_id(booking_id);
  report.set_event(event);
  if (event == v1::LIFECYCLE_EVENT_ABORTED) {
    report.set_abort_cause(cause);
    report.set_error(std::move(error));
  }
  gateway.report(std::move(report));
}

std::string random_request_prefix() {
  std::random_device device;
  return fmt::format("{:08x}", device());
}

}  // namespace kvr::front_door
