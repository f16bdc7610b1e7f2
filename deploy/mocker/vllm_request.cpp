#include "deploy/mocker/vllm_request.hpp"

#include <algorithm>
#include <optional>

#include <fmt/format.h>
#include <httplib.h>

#include "deploy/mocker/mock_tokenizer.hpp"
#include "deploy/mocker/vllm_engine_server.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::mocker {

HttpError bad_request(std::string message) { return {400, std::move(message), "BadRequestError"}; }

void send_error(httplib::Response& response, const HttpError& error) {
  response.status = error.status;
  response.set_content(nlohmann::json{{"error",
                                       {{"message", error.message},
                                        {"type", error.type},
                                        {"param", nullptr},
                                        {"code", error.status}}}}
                           .dump(),
                       "application/json");
}

std::expected<bool, HttpError> read_bool(const nlohmann::json& object, const char* field,
                                         bool fallback) {
  const auto found = object.find(field);
  if (found == object.end() || found->is_null()) return fallback;
  if (!found->is_boolean())
    return std::unexpected(bad_request(fmt::format("{} must be a boolean", field)));
  return found->get<bool>();
}

// The sampling parameters of a completions or chat body, checked for their types as vLLM checks
// them; seed, stop_token_ids and min_tokens are honoured, the others (temperature, top_p, top_k,
// min_p, stop, the penalties, ignore_eos: the simulated engine has no EOS token, so it always
// generates to max_tokens or a stop token) accepted and ignored.
std::expected<Sampling, std::string> read_sampling(const nlohmann::json& body) {
  Sampling sampling;
  const auto null_or = [&](const char* field, auto&& valid) {
    const auto found = body.find(field);
    return found == body.end() || found->is_null() || valid(*found);
  };
  const auto number = [](const nlohmann::json& v) { return v.is_number(); };
  const auto boolean = [](const nlohmann::json& v) { return v.is_boolean(); };
  const auto integer = [](const nlohmann::json& v) { return v.is_number_integer(); };
  const auto strings = [](const nlohmann::json& v) {
    if (v.is_string()) return true;
    if (!v.is_array()) return false;
    for (const auto& entry : v) {
      if (!entry.is_string()) return false;
    }
    return true;
  };
  for (const char* field : {"temperature", "top_p", "min_p", "presence_penalty",
                            "frequency_penalty", "repetition_penalty"}) {
    if (!null_or(field, number)) return std::unexpected(fmt::format("{} must be a number", field));
  }
  for (const char* field : {"ignore_eos", "include_stop_str_in_output", "skip_special_tokens"}) {
    if (!null_or(field, boolean))
      return std::unexpected(fmt::format("{} must be a boolean", field));
  }
  if (!null_or("top_k", integer)) return std::unexpected("top_k must be an integer");
  if (!null_or("stop", strings)) return std::unexpected("stop must be a string or strings");
  if (const auto seed = body.find("seed"); seed != body.end() && !seed->is_null()) {
    if (!seed->is_number_integer()) return std::unexpected("seed must be an integer");
    sampling.seed = seed->get<std::int64_t>();
  }
  if (const auto ids = body.find("stop_token_ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) return std::unexpected("stop_token_ids must be a list of token ids");
    for (const auto& id : *ids) {
      if (!id.is_number_unsigned() || id.get<std::uint64_t>() > UINT32_MAX) {
        return std::unexpected("stop_token_ids must be a list of token ids");
      }
      sampling.stop_token_ids.insert(id.get<std::uint32_t>());
    }
  }
  if (const auto min = body.find("min_tokens"); min != body.end() && !min->is_null()) {
    if (!min->is_number_unsigned() || min->get<std::uint64_t>() > simulation::kMaxOutputTokens) {
      return std::unexpected("min_tokens must be in [0, 1048576]");
    }
    sampling.min_tokens = min->get<std::uint32_t>();
  }
  return sampling;
}

std::expected<RequestBody, HttpError> read_body(const VllmEngineOptions& options,
                                                const httplib::Request& http_request) {
  // Before nlohmann reads it: its ordered objects copy a member nested before another, and the
  // chat template walks what it is given, both recursively.
  if (const auto fault =
          tokenizer::check_request_json(http_request.body, tokenizer::kDefaultMaxJsonDepth)) {
    return std::unexpected(
        bad_request(tokenizer::request_json_message(*fault, tokenizer::kDefaultMaxJsonDepth)));
  }
  RequestBody body{.json = nlohmann::json::parse(http_request.body, nullptr, false)};
  if (body.json.is_discarded() || !body.json.is_object()) {
    return std::unexpected(bad_request("the body is not a JSON object"));
  }
  if (options.tokenizer) body.ordered = nlohmann::ordered_json::parse(http_request.body);
  const auto model = body.json.find("model");
  if (model == body.json.end() || model->is_null()) return body;
  if (!model->is_string()) return std::unexpected(bad_request("model must be a string"));
  const auto& name = model->get_ref<const std::string&>();
  if (name == options.model) return body;
  const auto adapter = std::ranges::find(options.lora_adapters, name);
  if (adapter == options.lora_adapters.end()) {
    return std::unexpected(
        HttpError{404, fmt::format("The model `{}` does not exist.", name), "NotFoundError"});
  }
  body.lora = static_cast<std::uint32_t>(adapter - options.lora_adapters.begin()) + 1;
  return body;
}

std::expected<std::vector<std::uint32_t>, HttpError> encode_prompt_text(
    const VllmEngineOptions& options, const std::string& text, bool add_bos) {
  if (!options.tokenizer) return encode_text(text, add_bos);
  auto ids = options.tokenizer->tokenizer().encode(text, add_bos);
  if (!ids) return std::unexpected(bad_request(ids.error().message));
  return std::move(*ids);
}

std::expected<std::vector<std::vector<std::uint32_t>>, HttpError> read_prompts(
    const VllmEngineOptions& options, const nlohmann::json& body) {
  const auto add_bos = read_bool(body, "add_special_tokens", true);
  if (!add_bos) return std::unexpected(add_bos.error());
  const auto prompt = body.find("prompt");
  if (prompt == body.end() || prompt->is_null()) {
    return std::unexpected(bad_request("prompt is required"));
  }
  auto one = [&](const nlohmann::json& entry) -> std::optional<std::vector<std::uint32_t>> {
    if (entry.is_string()) {
      auto ids = encode_prompt_text(options, entry.get_ref<const std::string&>(), *add_bos);
      return ids ? std::optional{std::move(*ids)} : std::nullopt;
    }
    if (!entry.is_array()) return std::nullopt;
    std::vector<std::uint32_t> ids;
    ids.reserve(entry.size());
    for (const auto& token : entry) {
      if (!token.is_number_unsigned() || token.get<std::uint64_t>() > UINT32_MAX) {
        return std::nullopt;
      }
      ids.push_back(token.get<std::uint32_t>());
    }
    return ids;
  };
  std::vector<std::vector<std::uint32_t>> prompts;
  // A list of texts or of id lists is a batch; a list of integers is one prompt.
  const bool batch = prompt->is_array() && !prompt->empty() &&
                     ((*prompt)[0].is_string() || (*prompt)[0].is_array());
  if (batch) {
    for (const auto& entry : *prompt) {
      auto ids = one(entry);
      if (!ids) break;
      prompts.push_back(std::move(*ids));
    }
    if (prompts.size() != prompt->size()) prompts.clear();
  } else if (auto ids = one(*prompt)) {
    prompts.push_back(std::move(*ids));
  }
  if (prompts.empty()) {
    return std::unexpected(bad_request(
        "prompt must be a text, a list of unsigned 32-bit token ids, or a list of either"));
  }
  for (const auto& ids : prompts) {
    if (ids.empty() || ids.size() > simulation::kMaxPromptTokens) {
      return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
    }
  }
  return prompts;
}

std::expected<std::vector<std::uint32_t>, HttpError> read_chat_prompt(
    const VllmEngineOptions& options, const RequestBody& request) {
  const nlohmann::json& body = request.json;
  if (options.tokenizer) {
    auto chat = tokenizer::PromptTokenizer::chat_from_openai(request.ordered);
    if (!chat) return std::unexpected(bad_request(chat.error().message));
    auto rendered = options.tokenizer->encode_chat(*chat);
    if (!rendered) return std::unexpected(bad_request(rendered.error().message));
    if (rendered->ids.empty() || rendered->ids.size() > simulation::kMaxPromptTokens) {
      return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
    }
    return std::move(rendered->ids);
  }
  const auto generation_prompt = read_bool(body, "add_generation_prompt", true);
  if (!generation_prompt) return std::unexpected(generation_prompt.error());
  const auto add_bos = read_bool(body, "add_special_tokens", false);
  if (!add_bos) return std::unexpected(add_bos.error());
  const auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array() || messages->empty()) {
    return std::unexpected(bad_request("messages must be a non-empty list of messages"));
  }
  std::vector<ChatMessage> chat;
  chat.reserve(messages->size());
  for (const auto& message : *messages) {
    if (!message.is_object()) return std::unexpected(bad_request("a message is not an object"));
    const auto role = message.find("role");
    if (role == message.end() || !role->is_string()) {
      return std::unexpected(bad_request("a message's role must be a string"));
    }
    ChatMessage& entry = chat.emplace_back();
    entry.role = role->get<std::string>();
    const auto content = message.find("content");
    if (content == message.end() || content->is_null()) continue;
    if (content->is_string()) {
      entry.content = content->get<std::string>();
      continue;
    }
    if (!content->is_array()) {
      return std::unexpected(bad_request("a message's content must be a text or a list of parts"));
    }
    for (const auto& part : *content) {
      const auto type = part.is_object() ? part.find("type") : part.end();
      if (!part.is_object() || type == part.end() || !type->is_string()) {
        return std::unexpected(bad_request("a content part must be an object with a type"));
      }
      if (*type != "text") {
        return std::unexpected(bad_request(fmt::format(
            "kvr mocker serves text content only, not a part of type `{}`", type->dump())));
      }
      const auto text = part.find("text");
      if (text == part.end() || !text->is_string()) {
        return std::unexpected(bad_request("a text part's text must be a string"));
      }
      entry.content += text->get<std::string>();
    }
  }
  std::vector<std::uint32_t> ids = render_chat(chat, *generation_prompt);
  if (*add_bos) ids.insert(ids.begin(), kBosToken);
  if (ids.size() > simulation::kMaxPromptTokens) {
    return std::unexpected(bad_request("a prompt must have 1 to 4194304 tokens"));
  }
  return ids;
}

// What a completions or chat body asks of the engine besides the prompt. Chat reads
// max_completion_tokens before max_tokens. Both default to 16, vLLM's completions default (its
// chat would generate to the end of the context, which no test of a mock wants).
std::expected<Generation, HttpError> read_generation(const nlohmann::json& body, bool chat) {
  Generation generation;
  const auto given = [&](const char* field) -> const nlohmann::json* {
    const auto found = body.find(field);
    return found == body.end() || found->is_null() ? nullptr : &*found;
  };
  const nlohmann::json* max_tokens_field = chat ? given("max_completion_tokens") : nullptr;
  if (max_tokens_field == nullptr) max_tokens_field = given("max_tokens");
  const nlohmann::json max_tokens =
      max_tokens_field ? *max_tokens_field : nlohmann::json(std::uint64_t{16});
  if (!max_tokens.is_number_unsigned() || max_tokens.get<std::uint64_t>() == 0 ||
      max_tokens.get<std::uint64_t>() > simulation::kMaxOutputTokens) {
    return std::unexpected(bad_request("max_tokens must be in [1, 1048576]"));
  }
  generation.max_tokens = max_tokens.get<std::uint32_t>();
  auto sampling = read_sampling(body);
  if (!sampling) return std::unexpected(bad_request(sampling.error()));
  generation.sampling = std::move(*sampling);
  const auto stream = read_bool(body, "stream", false);
  if (!stream) return std::unexpected(stream.error());
  generation.stream = *stream;
  const auto return_token_ids = read_bool(body, "return_token_ids", false);
  if (!return_token_ids) return std::unexpected(return_token_ids.error());
  generation.return_token_ids = *return_token_ids;
  if (const auto found = body.find("stream_options"); found != body.end() && !found->is_null()) {
    if (!found->is_object()) {
      return std::unexpected(bad_request("stream_options must be an object"));
    }
    const auto include_usage = read_bool(*found, "include_usage", false);
    if (!include_usage) return std::unexpected(include_usage.error());
    const auto continuous = read_bool(*found, "continuous_usage_stats", false);
    if (!continuous) return std::unexpected(continuous.error());
    generation.include_usage = *include_usage;
    generation.continuous_usage = *include_usage && *continuous;
  }
  if (const auto found = body.find("kv_transfer_params"); found != body.end()) {
    auto kv_transfer = read_kv_transfer_params(*found);
    if (!kv_transfer) return std::unexpected(bad_request(kv_transfer.error()));
    generation.kv_transfer = *kv_transfer;
  }
  return generation;
}

}  // namespace kvr::mocker
