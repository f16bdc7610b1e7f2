#include "deploy/mocker/mock_tokenizer.hpp"

#include <fmt/format.h>

namespace kvr::mocker {
namespace {

void append_bytes(std::vector<std::uint32_t>& ids, std::string_view text) {
  for (char byte : text) ids.push_back(kByteBase + static_cast<unsigned char>(byte));
}

}  // namespace

std::vector<std::uint32_t> encode_text(std::string_view text, bool add_bos) {
  std::vector<std::uint32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos) ids.push_back(kBosToken);
  append_bytes(ids, text);
  return ids;
}

std::vector<std::uint32_t> render_chat(std::span<const ChatMessage> messages,
                                       bool add_generation_prompt) {
  std::vector<std::uint32_t> ids{kBosToken};
  for (const ChatMessage& message : messages) {
    ids.push_back(kMessageStartToken);
    append_bytes(ids, message.role);
    append_bytes(ids, "\n");
    append_bytes(ids, message.content);
    ids.push_back(kMessageEndToken);
  }
  if (add_generation_prompt) {
    ids.push_back(kMessageStartToken);
    append_bytes(ids, "assistant\n");
  }
  return ids;
}

std::string token_text(std::uint32_t id) {
  if (id >= kByteBase && id < kFirstWordToken)
    return std::string(1, static_cast<char>(id - kByteBase));
  if (id >= kFirstWordToken) return fmt::format(" t{}", id);
  return {};
}

std::string decode_tokens(std::span<const std::uint32_t> ids) {
  std::string text;
  for (std::uint32_t id : ids) text += token_text(id);
  return text;
}

}  // namespace kvr::mocker
