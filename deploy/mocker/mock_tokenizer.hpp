// The deterministic tokenizer of `kvr mocker --speak vllm` (deploy/mocker/vllm_engine_server.hpp):
// byte-level, with a fixed chat template, so that a front door that renders or tokenizes through
// the engine and the engine itself agree on every prompt's token ids, without a model's files.
//
// Token ids:
//  - [0, kByteBase): special tokens (kBosToken, kMessageStartToken, kMessageEndToken; the rest
//    unused); they decode to nothing.
//  - [kByteBase, kByteBase + 256): one byte of UTF-8 text each, id = kByteBase + byte.
//  - kFirstWordToken and above: words, each decoding to the readable " t<id>"; the simulated engine
//    generates ids in [kFirstWordToken, kVocabSize). Prompts of ids may use any 32-bit id.
// Chat template: [BOS], then per message [START] role "\n" content [END], then, with a generation
// prompt, [START] "assistant\n".
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::mocker {

/// Begins a text prompt (unless the request says add_special_tokens: false) and every chat.
inline constexpr std::uint32_t kBosToken = 1;
/// Opens a chat message.
inline constexpr std::uint32_t kMessageStartToken = 2;
/// Closes a chat message.
inline constexpr std::uint32_t kMessageEndToken = 3;
/// The id of byte 0; byte b is kByteBase + b.
inline constexpr std::uint32_t kByteBase = 16;
/// The first id the simulated engine generates (the ids above the bytes).
inline constexpr std::uint32_t kFirstWordToken = kByteBase + 256;
/// One past the largest id the simulated engine generates.
inline constexpr std::uint32_t kVocabSize = 32'000;

/// One chat message, its content already flattened to text.
struct ChatMessage {
  std::string role;
  std::string content;
};

/// The ids of `text`: one per byte, after kBosToken when `add_bos`.
std::vector<std::uint32_t> encode_text(std::string_view text, bool add_bos);

/// The chat template's ids for `messages` (see the file comment); with `add_generation_prompt`
/// the prompt ends by opening the assistant's message.
std::vector<std::uint32_t> render_chat(std::span<const ChatMessage> messages,
                                       bool add_generation_prompt);

/// The text of one token: its byte, " t<id>" for a generated word, "" for a special or unused id.
std::string token_text(std::uint32_t id);

/// The text of `ids`: every token's text, concatenated.
std::string decode_tokens(std::span<const std::uint32_t> ids);

}  // namespace kvr::mocker
