#include "deploy/cli/tokenize_command.hpp"

#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "deploy/cli/cli_options.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::cli {
namespace {

using Json = nlohmann::ordered_json;
using tokenizer::PromptTokenizer;
using tokenizer::TokenIds;

struct TokenizeOptions {
  std::string tokenizer_path;
  std::string input = "-";
  std::string check_engine;
  std::string model;
};

// The ids kvr makes of one input line, with the rendered text for a chat.
struct Encoded {
  TokenIds ids;
  std::optional<std::string> rendered;
};

std::expected<Encoded, std::string> encode_line(const PromptTokenizer& tokenizer,
                                                const Json& line) {
  if (line.contains("prompt")) {
    if (!line["prompt"].is_string()) return std::unexpected("\"prompt\" must be a string");
    auto ids = tokenizer.encode_prompt(line["prompt"].get<std::string>());
    if (!ids) return std::unexpected(ids.error().message);
    return Encoded{.ids = std::move(*ids), .rendered = std::nullopt};
  }
  if (!line.contains("messages")) {
    return std::unexpected("each line needs \"prompt\" or \"messages\"");
  }
  if (!tokenizer.has_chat_template()) {
    return std::unexpected(
        "the tokenizer has no chat template (no tokenizer_config.json with "
        "chat_template beside tokenizer.json)");
  }
  auto chat = PromptTokenizer::chat_from_openai(line);
  if (!chat) return std::unexpected(chat.error().message);
  auto rendered = tokenizer.encode_chat(*chat);
  if (!rendered) return std::unexpected(rendered.error().message);
  return Encoded{.ids = std::move(rendered->ids), .rendered = std::move(rendered->text)};
}

// An engine's rendering of the same input: vLLM's render endpoints, else /tokenize.
class EngineRenderer {
 public:
  EngineRenderer(const std::string& url, std::string model)
      : client_(url), model_(std::move(model)) {
    client_.set_connection_timeout(5);
    client_.set_read_timeout(30);
  }

  std::expected<std::string, std::string> resolve_model() {
    if (!model_.empty()) return model_;
    const auto answer = client_.Get("/v1/models");
    if (!answer || answer->status != 200) return std::unexpected("GET /v1/models failed");
    const Json models = Json::parse(answer->body, nullptr, false);
    if (!models.is_object() || !models.contains("data") || !models["data"].is_array() ||
        models["data"].empty() || !models["data"][0].contains("id")) {
      return std::unexpected("GET /v1/models lists no model");
    }
    model_ = models["data"][0]["id"].get<std::string>();
    return model_;
  }

  std::expected<TokenIds, std::string> render(const Json& line) {
    const bool chat = !line.contains("prompt");
    Json body{{"model", model_}};
    if (chat) {
      for (const char* field :
           {"messages", "tools", "add_generation_prompt", "chat_template_kwargs", "documents"}) {
        if (line.contains(field)) body[field] = line[field];
      }
    } else {
      body["prompt"] = line["prompt"];
    }
    if (!without_render_) {
      const auto answer =
          client_.Post(chat ? "/v1/chat/completions/render" : "/v1/completions/render", body.dump(),
                       "application/json");
      if (!answer) return std::unexpected("the engine did not answer");
      if (answer->status == 200) {
        if (auto ids = front_door::rendered_token_ids(answer->body, false)) return *ids;
        return std::unexpected("the render answer has no token_ids");
      }
      if (answer->status != 404) {
        return std::unexpected(
            fmt::format("render answered {}: {}", answer->status, answer->body.substr(0, 300)));
      }
      without_render_ = true;
    }
    const auto answer = client_.Post(
        "/tokenize", front_door::tokenize_request_body(chat, body.dump()), "application/json");
    if (!answer || answer->status != 200) return std::unexpected("/tokenize failed");
    if (auto ids = front_door::rendered_token_ids(answer->body, true)) return *ids;
    return std::unexpected("the tokenize answer has no tokens");
  }

 private:
  httplib::Client client_;
  std::string model_;
  bool without_render_ = false;
};

std::size_t first_difference(const TokenIds& left, const TokenIds& right) {
  std::size_t at = 0;
  while (at < left.size() && at < right.size() && left[at] == right[at]) ++at;
  return at;
}

int run(const TokenizeOptions& options) {
  auto loaded = PromptTokenizer::load(options.tokenizer_path);
  if (!loaded) {
    std::cerr << "kvr tokenize: --tokenizer: " << loaded.error().message << "\n";
    return kUsageError;
  }
  const PromptTokenizer& tokenizer = **loaded;
  std::ifstream file;
  if (options.input != "-") {
    file.open(options.input);
    if (!file) {
      std::cerr << "kvr tokenize: --input: cannot read " << options.input << "\n";
      return kUsageError;
    }
  }
  std::istream& in = options.input == "-" ? std::cin : file;
  std::optional<EngineRenderer> engine;
  if (!options.check_engine.empty()) {
    engine.emplace(options.check_engine, options.model);
    if (auto model = engine->resolve_model(); !model) {
      std::cerr << "kvr tokenize: --check-engine " << options.check_engine << ": " << model.error()
                << "\n";
      return 1;
    }
  }
  std::size_t inputs = 0;
  std::size_t failures = 0;
  std::size_t mismatches = 0;
  for (std::string text; std::getline(in, text);) {
    if (text.empty()) continue;
    ++inputs;
    Json out = Json::object();
    Json line;
    std::expected<Encoded, std::string> encoded;
    // Checked before nlohmann reads it: its ordered objects copy a member nested before another,
    // recursively.
    if (const auto fault = tokenizer::check_request_json(text, tokenizer::kDefaultMaxJsonDepth)) {
      encoded =
          std::unexpected(tokenizer::request_json_message(*fault, tokenizer::kDefaultMaxJsonDepth));
    } else {
      line = Json::parse(text, nullptr, false);
      encoded = line.is_object() ? encode_line(tokenizer, line)
                                 : std::unexpected(std::string{"not a JSON object"});
    }
    if (!encoded) {
      out["error"] = fmt::format("line {}: {}", inputs, encoded.error());
      ++failures;
      std::cout << out.dump() << "\n";
      continue;
    }
    out["ids"] = encoded->ids;
    if (encoded->rendered) out["rendered"] = *encoded->rendered;
    if (engine) {
      auto engine_ids = engine->render(line);
      if (!engine_ids) {
        out["engine_error"] = engine_ids.error();
        ++failures;
      } else {
        const std::size_t at = first_difference(encoded->ids, *engine_ids);
        const bool match = *engine_ids == encoded->ids;
        out["match"] = match;
        if (!match) {
          out["engine_ids"] = *engine_ids;
          out["first_difference"] = at;
          if (mismatches++ == 0) {
            const auto window = [&](const TokenIds& ids) {
              const std::size_t end = std::min(ids.size(), at + 4);
              return at < end
                         ? tokenizer.tokenizer().decode(std::span{ids}.subspan(at, end - at), false)
                         : std::string{"(end)"};
            };
            std::cerr << fmt::format(
                "kvr tokenize: input {} differs from the engine at position {}: kvr {} \"{}\", "
                "engine {} \"{}\"\n",
                inputs, at, at < encoded->ids.size() ? std::to_string(encoded->ids[at]) : "-",
                window(encoded->ids),
                at < engine_ids->size() ? std::to_string((*engine_ids)[at]) : "-",
                window(*engine_ids));
          }
        }
      }
    }
    std::cout << out.dump() << "\n";
  }
  if (engine) {
    std::cerr << fmt::format("kvr tokenize: {} of {} inputs match the engine\n",
                             inputs - mismatches - failures, inputs);
  }
  return failures > 0 || mismatches > 0 ? 1 : 0;
}

}  // namespace

void add_tokenize_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand(
      "tokenize", "token ids of prompts and chats with kvr's native tokenizer and chat templates");
  command->footer(
      "Input: JSON lines, each {\"prompt\": \"...\"} (encoded with the special tokens the\n"
      "post-processor adds, as an engine's completions path) or {\"messages\": [...],\n"
      "\"add_generation_prompt\": true, \"tools\": [...]} (rendered by the chat template, then\n"
      "encoded without added special tokens, as vLLM does). Output: one JSON line per input,\n"
      "{\"ids\": [...]} plus \"rendered\" for chats, or {\"error\": ...}.\n"
      "Exit codes: 0 all encoded (and equal to the engine's), 1 an input failed or differs,\n"
      "2 usage or configuration error.");
  auto options = std::make_shared<TokenizeOptions>();
  command
      ->add_option("--tokenizer", options->tokenizer_path,
                   "a tokenizer.json, or a folder with tokenizer.json and tokenizer_config.json")
      ->required()
      ->check(CLI::ExistingPath);
  command->add_option("--input", options->input, "JSON-lines file; - reads standard input")
      ->capture_default_str();
  command->add_option("--check-engine", options->check_engine,
                      "an engine's base URL (http://host:port): compare kvr's ids with its "
                      "render endpoints (or /tokenize) and print the first difference");
  command->add_option("--model", options->model,
                      "model name sent to the engine (default: the first of its /v1/models)");
  command->callback([options, &exit_code] { exit_code = run(*options); });
}

}  // namespace kvr::cli
