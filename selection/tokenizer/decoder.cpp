#include "selection/tokenizer/decoder.hpp"

#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "selection/tokenizer/replacement.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
// Named after the kind, as tokenizer.json groups them: the kinds share component names
// (Sequence, Strip, ...), and a unity build compiles their files together.
namespace decoders {
namespace {

// Byte-level spellings are raw bytes already (respelt at load): joining them and repairing
// what is not UTF-8 is all that is left.
class ByteLevel final : public Decoder {
 public:
  bool byte_level() const override { return true; }
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined.append(token);
    tokens.assign(1, utf8_lossy(joined));
  }
};

class Replace final : public Decoder {
 public:
  explicit Replace(Replacement replacement) : replacement_(std::move(replacement)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) replacement_.apply(token);
  }

 private:
  Replacement replacement_;
};

// <0xNN> tokens become their bytes; a run of them that is not UTF-8 becomes one U+FFFD per byte.
class ByteFallback final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> decoded;
    decoded.reserve(tokens.size());
    std::string pending;
    std::size_t pending_tokens = 0;
    const auto flush = [&] {
      if (pending_tokens == 0) return;
      if (first_invalid_utf8(pending) == pending.size()) {
        decoded.push_back(pending);
      } else {
        for (std::size_t i = 0; i < pending_tokens; ++i) decoded.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_tokens = 0;
    };
    for (std::string& token : tokens) {
      if (const auto byte = byte_of(token)) {
        pending.push_back(static_cast<char>(*byte));
        ++pending_tokens;
      } else {
        flush();
        decoded.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(decoded);
  }

 private:
  static std::optional<unsigned> byte_of(const std::string& token) {
    if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return std::nullopt;
    unsigned value = 0;
    for (std::size_t at = 3; at < 5; ++at) {
      const char c = token[at];
      value <<= 4;
      if (c >= '0' && c <= '9') {
        value |= static_cast<unsigned>(c - '0');
      } else if (c >= 'A' && c <= 'F') {
        value |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        return std::nullopt;
      }
    }
    return value;
  }
};

class Fuse final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined.append(token);
    tokens.assign(1, std::move(joined));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class Strip final : public Decoder {
 public:
  Strip(std::string content, std::size_t start, std::size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    if (content_.empty()) return;
    for (std::string& token : tokens) {
      std::size_t begin = 0;
      for (std::size_t i = 0; i < start_ && token.compare(begin, content_.size(), content_) == 0;
           ++i) {
        begin += content_.size();
      }
      std::size_t end = token.size();
      for (std::size_t i = 0; i < stop_ && end >= begin + content_.size() &&
                              token.compare(end - content_.size(), content_.size(), content_) == 0;
           ++i) {
        end -= content_.size();
      }
      token = token.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  std::size_t start_;
  std::size_t stop_;
};

class Metaspace final : public Decoder {
 public:
  Metaspace(std::string replacement, bool strip_first_space)
      : replacement_(std::move(replacement)), strip_first_space_(strip_first_space) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::size_t index = 0; index < tokens.size(); ++index) {
      std::string& token = tokens[index];
      std::string replaced;
      for (std::size_t at = 0; at < token.size();) {
        if (token.compare(at, replacement_.size(), replacement_) == 0) {
          replaced.push_back(' ');
          at += replacement_.size();
        } else {
          replaced.push_back(token[at++]);
        }
      }
      if (index == 0 && strip_first_space_ && replaced.starts_with(' ')) replaced.erase(0, 1);
      token = std::move(replaced);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_space_;
};

class Sequence final : public Decoder {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }
  bool byte_level() const override {
    for (const auto& step : steps_) {
      if (step->byte_level()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

TokenizerError error(const std::string& what) { return TokenizerError{"decoder " + what}; }

}  // namespace
}  // namespace decoders

std::expected<std::unique_ptr<Decoder>, TokenizerError> make_decoder(const nlohmann::json& spec) {
  if (spec.is_null()) return nullptr;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    return std::unexpected(decoders::error(": an object with a \"type\" is expected"));
  }
  const std::string type = spec["type"].get<std::string>();
  if (type == "ByteLevel") return std::make_unique<decoders::ByteLevel>();
  if (type == "ByteFallback") return std::make_unique<decoders::ByteFallback>();
  if (type == "Fuse") return std::make_unique<decoders::Fuse>();
  if (type == "Strip") {
    return std::make_unique<decoders::Strip>(spec.value("content", std::string{" "}),
                                             spec.value("start", std::size_t{0}),
                                             spec.value("stop", std::size_t{0}));
  }
  if (type == "Replace") {
    auto replacement = Replacement::from_json(spec);
    if (!replacement) return std::unexpected(decoders::error(replacement.error().message));
    return std::make_unique<decoders::Replace>(std::move(*replacement));
  }
  if (type == "Metaspace") {
    const std::string scheme = spec.value("prepend_scheme", std::string{"always"});
    const bool strip =
        spec.contains("prepend_scheme") ? scheme != "never" : spec.value("add_prefix_space", true);
    return std::make_unique<decoders::Metaspace>(spec.value("replacement", std::string{"\u2581"}),
                                                 strip);
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const auto& step_spec : spec.value("decoders", nlohmann::json::array())) {
      auto step = make_decoder(step_spec);
      if (!step) return std::unexpected(step.error());
      if (*step) steps.push_back(std::move(*step));
    }
    return std::make_unique<decoders::Sequence>(std::move(steps));
  }
  return std::unexpected(decoders::error(
      fmt::format("type \"{}\" is not supported (supported: decoders::ByteLevel, "
                  "decoders::ByteFallback, decoders::Fuse, decoders::Strip, decoders::Replace, "
                  "Metaspace, Sequence)",
                  type)));
}

}  // namespace kvr::tokenizer
