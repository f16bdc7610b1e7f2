// What the two front doors (the OpenAI HTTP API and Envoy's endpoint picker) share about a
// generation request beyond its body: the routing headers, the route request made of it, and the
// lifecycle reports of its booking.
#pragma once

#include <cstdint>
#include <expected>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvr/v1/routing.pb.h"
#include "selection/front_door/fleet_directory.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/routing_gateway.hpp"

namespace kvr::front_door {

/// The routing fields a request's headers carry.
struct RequestMetadata {
  std::string session_id;
  std::string tenant;
  std::string routing_group;
  std::uint32_t priority = 0;
};

/// What a request is routed on: its prompt's token ids, else (the `estimate` tokenizer mode) its
/// text.
struct RoutingKey {
  std::vector<std::uint32_t> tokens;
  std::string text;
};

/// Header values longer than this are refused (400): they would be refused as ids by the router.
inline constexpr std::size_t kMaxMetadataHeaderBytes = 256;

/// Reads `session_header`, x-kvr-tenant, x-kvr-routing-group and x-kvr-priority through
/// `header(name)` (empty: absent); the error names the header.
std::expected<RequestMetadata, HttpError> read_request_metadata(
    const std::function<std::string_view(std::string_view)>& header,
    std::string_view session_header);

/// The route request of `request`, routed on `key` in `target`'s model (a LoRA adapter as the
/// cache namespace), among `eligible` workers only: the tenant is x-kvr-tenant, else the body's
/// `user`.
v1::RouteRequest make_route_request(std::string request_id, const GenerationRequest& request,
                                    const RequestMetadata& metadata, const ModelTarget& target,
                                    std::span<const WorkerId> eligible, const RoutingKey& key);

/// Reports `event` on `booking_id` (nothing for an empty id); `cause` and `error` for aborts.
void report_booking(RoutingGateway& gateway, const std::string& booking_id,
                    v1::LifecycleEvent event, v1::AbortCause cause = v1::ABORT_CAUSE_UNSPECIFIED,
                    std::string error = {});

/// A random prefix for a front door's request ids (unique per process run).
std::string random_request_prefix();

}  // namespace kvr::front_door
