// The checks both front doors' harnesses run on what a client sent (openai_request for the HTTP
// API, epp_request for Envoy's endpoint picker): the body parsed for its endpoint with both
// PromptTextUse values, and the routing headers.
#pragma once

#include <functional>
#include <optional>
#include <string_view>

#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/request_routing.hpp"

namespace kvr::fuzz {

/// The header naming the session, as both doors are configured by default.
inline constexpr std::string_view kSessionHeader = "x-session-id";

/// A header's value by its lower-case name; empty when absent.
using HeaderLookup = std::function<std::string_view(std::string_view)>;

/// Checks that `error`'s object (what the client gets) is JSON, whatever bytes its message quotes.
void check_error_body(const front_door::HttpError& error);

/// Parses `body` for `endpoint` keeping and skipping the prompt's text. Checks: a refusal is a 400
/// with a message and a JSON error object; keeping the text refuses no more and reads the same
/// fields. The request read with its text, when accepted.
std::optional<front_door::GenerationRequest> check_generation_request(front_door::Endpoint endpoint,
                                                                      std::string_view body);

/// Reads the routing headers through `header`. Checks: a refusal names one of them, one too long
/// unless it is the priority; what is read is the headers' values, within bounds.
std::optional<front_door::RequestMetadata> check_request_metadata(const HeaderLookup& header);

}  // namespace kvr::fuzz
