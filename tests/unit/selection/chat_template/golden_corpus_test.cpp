// Every chat of the repository's corpus (tests/data/tokenizers/corpus/chats.jsonl) rendered with
// each family's template (from KVR_TOKENIZERS_DIR) and compared with the family's golden
// (goldens/<family>.chats.jsonl): the same text, or a failure where the golden is an error.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/tokenizer_data.hpp"
#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;

const std::filesystem::path kDataDir =
    std::filesystem::path(KVR_SOURCE_DIR) / "tests" / "data" / "tokenizers";

std::vector<ordered_json> read_lines(const std::filesystem::path& path) {
  std::vector<ordered_json> lines;
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (!line.empty()) {
      lines.push_back(ordered_json::parse(line));
    }
  }
  return lines;
}

class ChatTemplateGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateGoldenTest, RendersEveryCorpusChatAsItsGolden) {
  const char* tokenizers_dir = kvr::testing::bundled_tokenizers_dir();
  if (tokenizers_dir == nullptr || *tokenizers_dir == '\0') {
    GTEST_SKIP() << "the bundled tokenizers folder is empty";
  }
  const std::string& family = GetParam();
  std::ifstream config_file(std::filesystem::path(tokenizers_dir) / family /
                            "tokenizer_config.json");
  ASSERT_TRUE(config_file) << "no tokenizer_config.json for " << family;
  const auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(config_file));
  ASSERT_TRUE(config.has_value()) << testing::describe("config", config.error());

  const std::vector<ordered_json> chats = read_lines(kDataDir / "corpus" / "chats.jsonl");
  const std::vector<ordered_json> goldens =
      read_lines(kDataDir / "goldens" / (family + ".chats.jsonl"));
  ASSERT_FALSE(chats.empty());
  ASSERT_EQ(chats.size(), goldens.size());
  for (std::size_t i = 0; i < chats.size(); ++i) {
    const ordered_json& chat = chats[i];
    const ordered_json& golden = goldens[i];
    SCOPED_TRACE(chat.at("name").get<std::string>());
    ASSERT_EQ(chat.at("name"), golden.at("name"));
    ChatRequest request;
    request.messages = chat.at("messages");
    request.tools = chat.value("tools", ordered_json());
    request.add_generation_prompt = chat.value("add_generation_prompt", false);
    request.extra_kwargs = chat.value("chat_template_kwargs", ordered_json::object());
    const auto rendered = config->render_chat(request, testing::fixed_clock());
    if (golden.contains("error")) {
      EXPECT_FALSE(rendered.has_value())
          << "renders, but the golden is an error: " << golden.at("error");
    } else {
      ASSERT_TRUE(rendered.has_value()) << testing::describe("render", rendered.error());
      EXPECT_EQ(*rendered, golden.at("rendered").get<std::string>());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ChatTemplateGoldenTest,
                         ::testing::Values("qwen3", "deepseek-v3", "mistral-nemo"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           std::string name = param_info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace kvr::chat_template
