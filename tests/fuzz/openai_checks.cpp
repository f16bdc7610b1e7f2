#include "tests/fuzz/openai_checks.hpp"

#include <charconv>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

using front_door::GenerationRequest;
using front_door::PromptTextUse;

void check_refusal(const front_door::HttpError& error) {
  KVR_FUZZ_CHECK(error.status == 400);
  KVR_FUZZ_CHECK(error.type == "invalid_request_error");
  KVR_FUZZ_CHECK(!error.message.empty());
  check_error_body(error);
}

// What both text uses read alike.
void check_same_request(const GenerationRequest& kept, const GenerationRequest& skipped) {
  KVR_FUZZ_CHECK(kept.endpoint == skipped.endpoint);
  KVR_FUZZ_CHECK(kept.model == skipped.model);
  KVR_FUZZ_CHECK(kept.stream == skipped.stream);
  KVR_FUZZ_CHECK(kept.max_tokens == skipped.max_tokens);
  KVR_FUZZ_CHECK(kept.user == skipped.user);
  KVR_FUZZ_CHECK(kept.prompt_token_ids == skipped.prompt_token_ids);
  KVR_FUZZ_CHECK(kept.include_usage == skipped.include_usage);
  KVR_FUZZ_CHECK(kept.sampling.SerializeAsString() == skipped.sampling.SerializeAsString());
}

}  // namespace

void check_error_body(const front_door::HttpError& error) {
  KVR_FUZZ_CHECK(nlohmann::json::accept(error.body()));
}

std::optional<GenerationRequest> check_generation_request(front_door::Endpoint endpoint,
                                                          std::string_view body) {
  auto skipped = front_door::parse_generation_request(endpoint, body, PromptTextUse::skip);
  auto kept = front_door::parse_generation_request(endpoint, body, PromptTextUse::keep);
  if (!skipped) {
    check_refusal(skipped.error());
    KVR_FUZZ_CHECK(!kept);
  }
  if (!kept) {
    check_refusal(kept.error());
    return std::nullopt;
  }
  check_same_request(*kept, *skipped);
  KVR_FUZZ_CHECK(skipped->prompt_text.empty());
  KVR_FUZZ_CHECK(!kept->model.empty());
  KVR_FUZZ_CHECK(!kept->max_tokens || *kept->max_tokens > 0);
  if (endpoint == front_door::Endpoint::chat_completions) {
    KVR_FUZZ_CHECK(kept->prompt_token_ids.empty());
  }
  return std::move(*kept);
}

std::optional<front_door::RequestMetadata> check_request_metadata(const HeaderLookup& header) {
  auto metadata = front_door::read_request_metadata(header, kSessionHeader);
  if (!metadata) {
    check_refusal(metadata.error());
    const std::string& named = metadata.error().param;
    KVR_FUZZ_CHECK(named == kSessionHeader || named == "x-kvr-tenant" ||
                   named == "x-kvr-routing-group" || named == "x-kvr-priority");
    KVR_FUZZ_CHECK(named == "x-kvr-priority" ||
                   header(named).size() > front_door::kMaxMetadataHeaderBytes);
    return std::nullopt;
  }
  KVR_FUZZ_CHECK(metadata->session_id == header(kSessionHeader));
  KVR_FUZZ_CHECK(metadata->tenant == header("x-kvr-tenant"));
  KVR_FUZZ_CHECK(metadata->routing_group == header("x-kvr-routing-group"));
  for (const std::string* value :
       {&metadata->session_id, &metadata->tenant, &metadata->routing_group}) {
    KVR_FUZZ_CHECK(value->size() <= front_door::kMaxMetadataHeaderBytes);
  }
  const std::string_view priority = header("x-kvr-priority");
  std::uint32_t read = 0;
  if (!priority.empty()) {
    KVR_FUZZ_CHECK(std::from_chars(priority.data(), priority.data() + priority.size(), read).ec ==
                   std::errc{});
  }
  KVR_FUZZ_CHECK(metadata->priority == read);
  return std::move(*metadata);
}

}  // namespace kvr::fuzz
