#include "selection/tokenizer/post_processor.hpp"

#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvr::tokenizer {
// Named after the kind, as tokenizer.json groups them: the kinds share component names
// (Sequence, Strip, ...), and a unity build compiles their files together.
namespace processors {
namespace {

// The ids around the sequence: what TemplateProcessing's `single` and the CLS/SEP processors
// reduce to.
class Surround final : public PostProcessor {
 public:
  Surround(TokenIds before, TokenIds after)
      : before_(std::move(before)), after_(std::move(after)) {}
  void add_special_tokens(TokenIds& ids) const override {
    ids.insert(ids.begin(), before_.begin(), before_.end());
    ids.insert(ids.end(), after_.begin(), after_.end());
  }

 private:
  TokenIds before_;
  TokenIds after_;
};

// ByteLevel's post-processing only trims offsets: it adds no ids.
class NoTokens final : public PostProcessor {
 public:
  void add_special_tokens(TokenIds&) const override {}
};

class Sequence final : public PostProcessor {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  void add_special_tokens(TokenIds& ids) const override {
    for (const auto& step : steps_) step->add_special_tokens(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

TokenizerError error(const std::string& what) { return TokenizerError{"post_processor " + what}; }

std::expected<std::unique_ptr<PostProcessor>, TokenizerError> template_processing(
    const nlohmann::json& spec) {
  if (!spec.contains("single") || !spec["single"].is_array()) {
    return std::unexpected(error("TemplateProcessing: \"single\" must be an array"));
  }
  const auto special_tokens = spec.value("special_tokens", nlohmann::json::object());
  TokenIds before;
  TokenIds after;
  bool seen_sequence = false;
  for (const auto& item : spec["single"]) {
    if (item.contains("Sequence")) {
      if (seen_sequence) {
        return std::unexpected(error("TemplateProcessing: \"single\" names the sequence twice"));
      }
      seen_sequence = true;
      continue;
    }
    if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id")) {
      return std::unexpected(
          error("TemplateProcessing: each item is a SpecialToken or the Sequence"));
    }
    const std::string name = item["SpecialToken"]["id"].get<std::string>();
    if (!special_tokens.contains(name) || !special_tokens[name].contains("ids")) {
      return std::unexpected(error(
          fmt::format("TemplateProcessing: special token \"{}\" is not in special_tokens", name)));
    }
    for (const auto& id : special_tokens[name]["ids"]) {
      (seen_sequence ? after : before).push_back(id.get<TokenId>());
    }
  }
  return std::make_unique<Surround>(std::move(before), std::move(after));
}

}  // namespace
}  // namespace processors

std::unique_ptr<PostProcessor> make_surrounding_post_processor(TokenIds before, TokenIds after) {
  return std::make_unique<processors::Surround>(std::move(before), std::move(after));
}

std::expected<std::unique_ptr<PostProcessor>, TokenizerError> make_post_processor(
    const nlohmann::json& spec) {
  if (spec.is_null()) return nullptr;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    return std::unexpected(processors::error(": an object with a \"type\" is expected"));
  }
  const std::string type = spec["type"].get<std::string>();
  try {
    if (type == "TemplateProcessing") return processors::template_processing(spec);
    if (type == "ByteLevel") return std::make_unique<processors::NoTokens>();
    if (type == "RobertaProcessing" || type == "BertProcessing") {
      // [cls] A [sep]: each is a [content, id] pair.
      return std::make_unique<processors::Surround>(TokenIds{spec.at("cls").at(1).get<TokenId>()},
                                                    TokenIds{spec.at("sep").at(1).get<TokenId>()});
    }
    if (type == "Sequence") {
      std::vector<std::unique_ptr<PostProcessor>> steps;
      for (const auto& step_spec : spec.value("processors", nlohmann::json::array())) {
        auto step = make_post_processor(step_spec);
        if (!step) return std::unexpected(step.error());
        if (*step) steps.push_back(std::move(*step));
      }
      return std::make_unique<processors::Sequence>(std::move(steps));
    }
  } catch (const nlohmann::json::exception& failure) {
    return std::unexpected(processors::error(fmt::format("{}: {}", type, failure.what())));
  }
  return std::unexpected(processors::error(fmt::format(
      "type \"{}\" is not supported (supported: TemplateProcessing, ByteLevel, RobertaProcessing, "
      "BertProcessing, Sequence)",
      type)));
}

}  // namespace kvr::tokenizer
