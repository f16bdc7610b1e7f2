// The `native` tokenizer mode's tokenizers, by model name: what the node loads from --tokenizer
// and the router-policy YAML's `tokenizers`, shared by both front doors.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace kvr::tokenizer {
class PromptTokenizer;
}  // namespace kvr::tokenizer

namespace kvr::front_door {

/// Each model's tokenizer and chat templates.
using NativeTokenizers =
    std::map<std::string, std::shared_ptr<const tokenizer::PromptTokenizer>, std::less<>>;

}  // namespace kvr::front_door
