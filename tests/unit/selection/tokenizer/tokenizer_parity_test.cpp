// Token parity with HuggingFace: every prompt and chat of the corpus (tests/data/tokenizers)
// encoded by kvr's tokenizer for each bundled family, compared id by id with the goldens the
// reference implementation produced (tests/clients/tokenizers/make_goldens.mjs).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "selection/tokenizer/tokenizer.hpp"
#include "tests/testing/tokenizer_data.hpp"

namespace kvr::tokenizer {
namespace {

std::filesystem::path tokenizers_dir() {
  const char* dir = kvr::testing::bundled_tokenizers_dir();
  return dir != nullptr ? std::filesystem::path{dir} : std::filesystem::path{};
}

std::filesystem::path goldens_dir() {
  return std::filesystem::path{KVR_SOURCE_DIR} / "tests/data/tokenizers/goldens";
}

std::vector<nlohmann::json> read_lines(const std::filesystem::path& file) {
  std::vector<nlohmann::json> lines;
  std::ifstream in{file};
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

// Where two id sequences first differ, for a failure message a person can act on.
std::string first_difference(const Tokenizer& tokenizer, const TokenIds& actual,
                             const TokenIds& expected) {
  std::size_t at = 0;
  while (at < actual.size() && at < expected.size() && actual[at] == expected[at]) ++at;
  const auto around = [&](const TokenIds& ids) {
    const std::size_t end = std::min(ids.size(), at + 3);
    return at < end ? tokenizer.decode(std::span{ids}.subspan(at, end - at), false) : "";
  };
  return "first difference at position " + std::to_string(at) + " of " +
         std::to_string(expected.size()) + ": kvr \"" + around(actual) + "\" vs reference \"" +
         around(expected) + "\"";
}

void expect_prompt_parity(const std::string& family, const Tokenizer& tokenizer) {
  const auto goldens = read_lines(goldens_dir() / (family + ".prompts.jsonl"));
  const auto corpus = read_lines(goldens_dir() / "../corpus/prompts.jsonl");
  ASSERT_GE(corpus.size(), 200u);
  ASSERT_EQ(goldens.size(), corpus.size());
  for (std::size_t index = 0; index < corpus.size(); ++index) {
    const std::string name = corpus[index]["name"].get<std::string>();
    ASSERT_EQ(goldens[index]["name"], name);
    const std::string prompt = corpus[index]["prompt"].get<std::string>();
    const auto with_special = tokenizer.encode(prompt, true);
    const auto without_special = tokenizer.encode(prompt, false);
    ASSERT_TRUE(with_special && without_special) << name;
    const auto expected = goldens[index]["ids"].get<TokenIds>();
    const auto expected_plain = goldens[index]["ids_no_special"].get<TokenIds>();
    EXPECT_EQ(*with_special, expected)
        << name << ": " << first_difference(tokenizer, *with_special, expected);
    EXPECT_EQ(*without_special, expected_plain)
        << name << ": " << first_difference(tokenizer, *without_special, expected_plain);
    EXPECT_EQ(tokenizer.decode(expected_plain, false), goldens[index]["decoded"])
        << name << ": decoding differs";
  }
}

void expect_chat_parity(const std::string& family, const Tokenizer& tokenizer) {
  const auto file = goldens_dir() / (family + ".chats.jsonl");
  if (!std::filesystem::exists(file)) return;  // a family without a chat template
  const auto goldens = read_lines(file);
  ASSERT_GE(goldens.size(), 30u);
  for (const auto& golden : goldens) {
    if (!golden.contains("rendered")) continue;  // the template rejects this chat
    const auto ids = tokenizer.encode(golden["rendered"].get<std::string>(), false);
    ASSERT_TRUE(ids.has_value()) << golden["name"];
    const auto expected = golden["ids"].get<TokenIds>();
    EXPECT_EQ(*ids, expected) << golden["name"] << ": "
                              << first_difference(tokenizer, *ids, expected);
  }
}

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (tokenizers_dir().empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
    auto loaded = Tokenizer::load(tokenizers_dir() / GetParam());
    ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
    tokenizer_.emplace(std::move(*loaded));
  }
  std::optional<Tokenizer> tokenizer_;
};

// One test per family: the tokenizer is loaded once per process.
TEST_P(TokenizerParityTest, PromptAndChatIdsEqualTheReference) {
  expect_prompt_parity(GetParam(), *tokenizer_);
  expect_chat_parity(GetParam(), *tokenizer_);
}

INSTANTIATE_TEST_SUITE_P(BundledFamilies, TokenizerParityTest,
                         ::testing::Values("qwen3", "gpt-oss", "mistral-nemo", "deepseek-v3", "yi"),
                         [](const auto& family) {
                           std::string name = family.param;
                           std::erase(name, '-');
                           return name;
                         });

}  // namespace
}  // namespace kvr::tokenizer
