// An OpenAI request as a client sends it to the HTTP front door: its routing headers and its
// body, read as the door reads them (read_request_metadata; parse_generation_request for each
// endpoint and both PromptTextUse values, openai_checks.hpp), then what the door makes of an
// accepted request: its route request, and the /tokenize body an engine without render endpoints
// is sent.
// The input: "<name>: <value>" header lines, a blank line, then the body; an input that starts
// with '{' is a body alone. A first line "%nest ..." nests part of it deeply (nesting.hpp).
#include <algorithm>
#include <cctype>
#include <string>
#include <utility>
#include <vector>

#include "tests/fuzz/harness.hpp"
#include "tests/fuzz/nesting.hpp"
#include "tests/fuzz/openai_checks.hpp"

namespace kvr::fuzz {
namespace {

using front_door::Endpoint;

struct ClientRequest {
  std::vector<std::pair<std::string, std::string>> headers;
  std::string_view body;

  // The first value of `name`, as Beast's find gives it to the front door.
  std::string_view header(std::string_view name) const {
    for (const auto& [key, value] : headers) {
      if (key == name) return value;
    }
    return {};
  }
};

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

ClientRequest split_request(std::string_view text) {
  ClientRequest request;
  if (text.starts_with('{')) {
    request.body = text;
    return request;
  }
  const std::size_t blank = text.find("\n\n");
  std::string_view head = text.substr(0, blank);
  request.body = blank == std::string_view::npos ? std::string_view{} : text.substr(blank + 2);
  while (!head.empty()) {
    const std::string_view line = head.substr(0, head.find('\n'));
    head.remove_prefix(std::min(head.size(), line.size() + 1));
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string name{trim(line.substr(0, colon))};
    std::ranges::transform(name, name.begin(),
                           [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    request.headers.emplace_back(std::move(name), std::string{trim(line.substr(colon + 1))});
  }
  return request;
}

void check_endpoint(Endpoint endpoint, const ClientRequest& client,
                    const std::optional<front_door::RequestMetadata>& metadata) {
  const auto request = check_generation_request(endpoint, client.body);
  if (!request) return;
  if (metadata) {
    const front_door::RoutingKey key{.tokens = request->prompt_token_ids,
                                     .text = request->prompt_text};
    const std::vector<WorkerId> eligible{WorkerId{1}, WorkerId{2}};
    const v1::RouteRequest route = front_door::make_route_request(
        "fuzz-1", *request, *metadata, front_door::ModelTarget{.model = request->model}, eligible,
        key);
    KVR_FUZZ_CHECK(route.model() == request->model);
    KVR_FUZZ_CHECK(route.tenant() == (metadata->tenant.empty() ? request->user : metadata->tenant));
    KVR_FUZZ_CHECK(route.priority() == metadata->priority);
    KVR_FUZZ_CHECK(route.allowed_workers_size() == 2);
    KVR_FUZZ_CHECK(route.has_tokens() == !request->prompt_token_ids.empty());
  }
  // An engine without render endpoints is asked /tokenize with a body made of the client's.
  const std::string tokenize_body = front_door::tokenize_request_body(
      endpoint == Endpoint::chat_completions, std::string{client.body});
  KVR_FUZZ_CHECK(!tokenize_body.empty());
}

}  // namespace

void openai_request(Input input) {
  const std::string text = expand_nesting(as_text(input));
  const ClientRequest client = split_request(text);
  const auto metadata =
      check_request_metadata([&](std::string_view name) { return client.header(name); });
  check_endpoint(Endpoint::chat_completions, client, metadata);
  check_endpoint(Endpoint::completions, client, metadata);
}

}  // namespace kvr::fuzz
