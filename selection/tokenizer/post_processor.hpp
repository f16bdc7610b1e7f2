// The post-processors of a tokenizer.json ("post_processor"): the special tokens an encoding
// gains when special tokens are added (BOS/EOS templates, RoBERTa's and BERT's CLS/SEP).
#pragma once

#include <expected>
#include <memory>

#include <nlohmann/json_fwd.hpp>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// Adds a single sequence's special tokens.
class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void add_special_tokens(TokenIds& ids) const = 0;
};

/// Adds `before` and `after` around the sequence (what tokenizer_config.json's add_bos_token and
/// add_eos_token make of the post-processor).
std::unique_ptr<PostProcessor> make_surrounding_post_processor(TokenIds before, TokenIds after);

/// The post-processor a tokenizer.json describes, or null; an unsupported type is an error.
std::expected<std::unique_ptr<PostProcessor>, TokenizerError> make_post_processor(
    const nlohmann::json& spec);

}  // namespace kvr::tokenizer
