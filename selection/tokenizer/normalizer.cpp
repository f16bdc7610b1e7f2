#include "selection/tokenizer/normalizer.hpp"

#include <cstdlib>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "selection/tokenizer/replacement.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
// Named after the kind, as tokenizer.json groups them: the kinds share component names
// (Sequence, Strip, ...), and a unity build compiles their files together.
namespace normalizers {
namespace {

bool is_ascii(const std::string& text) {
  for (const char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

// NFC, NFD, NFKC or NFKD through utf8proc. ASCII is stable under all four, the common case.
class UnicodeNormalForm final : public Normalizer {
 public:
  explicit UnicodeNormalForm(int options) : options_(options) {}
  void normalize(std::string& text) const override {
    if (is_ascii(text)) return;
    utf8proc_uint8_t* mapped = nullptr;
    const utf8proc_ssize_t length =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                     static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                     static_cast<utf8proc_option_t>(options_));
    if (length >= 0) text.assign(reinterpret_cast<const char*>(mapped), length);
    std::free(mapped);
  }

 private:
  int options_;
};

class Lowercase final : public Normalizer {
 public:
  void normalize(std::string& text) const override {
    std::string lowered;
    lowered.reserve(text.size());
    for (std::size_t at = 0; at < text.size();) {
      append_utf8(lowered, static_cast<std::uint32_t>(utf8proc_tolower(
                               static_cast<utf8proc_int32_t>(next_code_point(text, at)))));
    }
    text = std::move(lowered);
  }
};

class Replace final : public Normalizer {
 public:
  explicit Replace(Replacement replacement) : replacement_(std::move(replacement)) {}
  void normalize(std::string& text) const override { replacement_.apply(text); }

 private:
  Replacement replacement_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& text) const override {
    std::size_t begin = 0;
    std::size_t end = text.size();
    if (left_) {
      for (std::size_t at = 0; at < text.size();) {
        if (!is_unicode_whitespace(next_code_point(text, at))) break;
        begin = at;
      }
    }
    if (right_) {
      while (end > begin) {
        std::size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        std::size_t at = start;
        if (!is_unicode_whitespace(next_code_point(text, at))) break;
        end = start;
      }
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool left_;
  bool right_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(std::string& text) const override {
    for (const auto& part : parts_) part->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

std::string string_field(const nlohmann::json& spec, const char* key) {
  const auto found = spec.find(key);
  return found != spec.end() && found->is_string() ? found->get<std::string>() : std::string{};
}

}  // namespace
}  // namespace normalizers

std::expected<std::unique_ptr<Normalizer>, TokenizerError> make_normalizer(
    const nlohmann::json& spec) {
  if (spec.is_null()) return nullptr;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    return std::unexpected(TokenizerError{"normalizer: an object with a \"type\" is expected"});
  }
  const std::string type = spec["type"].get<std::string>();
  constexpr int kStable = UTF8PROC_STABLE;
  if (type == "NFC")
    return std::make_unique<normalizers::UnicodeNormalForm>(kStable | UTF8PROC_COMPOSE);
  if (type == "NFD")
    return std::make_unique<normalizers::UnicodeNormalForm>(kStable | UTF8PROC_DECOMPOSE);
  if (type == "NFKC") {
    return std::make_unique<normalizers::UnicodeNormalForm>(kStable | UTF8PROC_COMPOSE |
                                                            UTF8PROC_COMPAT);
  }
  if (type == "NFKD") {
    return std::make_unique<normalizers::UnicodeNormalForm>(kStable | UTF8PROC_DECOMPOSE |
                                                            UTF8PROC_COMPAT);
  }
  if (type == "Lowercase") return std::make_unique<normalizers::Lowercase>();
  if (type == "Prepend")
    return std::make_unique<normalizers::Prepend>(normalizers::string_field(spec, "prepend"));
  if (type == "Strip") {
    return std::make_unique<normalizers::Strip>(spec.value("strip_left", true),
                                                spec.value("strip_right", true));
  }
  if (type == "Replace") {
    auto replacement = Replacement::from_json(spec);
    if (!replacement) {
      return std::unexpected(TokenizerError{"normalizer " + replacement.error().message});
    }
    return std::make_unique<normalizers::Replace>(std::move(*replacement));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (const auto& part_spec : spec.value("normalizers", nlohmann::json::array())) {
      auto part = make_normalizer(part_spec);
      if (!part) return std::unexpected(part.error());
      if (*part) parts.push_back(std::move(*part));
    }
    return std::make_unique<normalizers::Sequence>(std::move(parts));
  }
  return std::unexpected(
      TokenizerError{fmt::format("normalizer type \"{}\" is not supported (supported: NFC, NFD, "
                                 "NFKC, NFKD, normalizers::Lowercase, "
                                 "Replace, normalizers::Prepend, normalizers::Strip, Sequence)",
                                 type)});
}

}  // namespace kvr::tokenizer
