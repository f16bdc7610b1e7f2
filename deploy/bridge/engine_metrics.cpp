#include "deploy/bridge/engine_metrics.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kvr::bridge {
namespace {

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) {
    text.remove_suffix(1);
  }
  return text;
}

// Parses `{a="x",b="y"}` at the start of `text`; returns the rest after '}', or nullopt.
std::optional<std::string_view> parse_labels(std::string_view text, PrometheusSample& sample) {
  text.remove_prefix(1);  // '{'
  while (true) {
    text = trim(text);
    if (text.empty()) return std::nullopt;
    if (text.front() == '}') return text.substr(1);
    const auto equals = text.find('=');
    if (equals == std::string_view::npos || equals + 1 >= text.size() || text[equals + 1] != '"') {
      return std::nullopt;
    }
    std::string key{trim(text.substr(0, equals))};
    std::string value;
    std::size_t at = equals + 2;
    for (; at < text.size() && text[at] != '"'; ++at) {
      if (text[at] == '\\' && at + 1 < text.size()) {
        ++at;
        value.push_back(text[at] == 'n' ? '\n' : text[at]);
      } else {
        value.push_back(text[at]);
      }
    }
    if (at >= text.size()) return std::nullopt;
    sample.labels.emplace_back(std::move(key), std::move(value));
    text = trim(text.substr(at + 1));
    if (!text.empty() && text.front() == ',') text.remove_prefix(1);
  }
}

std::optional<double> parse_value(std::string_view text) {
  text = trim(text);
  const auto space = text.find_first_of(" \t");  // an optional timestamp follows
  std::string value{text.substr(0, space)};
  if (value.empty()) return std::nullopt;
  if (value == "NaN") return std::nan("");
  if (value == "+Inf") return HUGE_VAL;
  if (value == "-Inf") return -HUGE_VAL;
  char* end = nullptr;
  const double parsed = std::strtod(value.c_str(), &end);
  if (end != value.c_str() + value.size()) return std::nullopt;
  return parsed;
}

template <typename T>
std::optional<T> parse_integer(std::string_view text) {
  T value{};
  // Python formats some integer labels as floats ("16.0"): take the integral part.
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end == text.data()) return std::nullopt;
  if (end != text.data() + text.size() && *end != '.') return std::nullopt;
  return value;
}

std::optional<std::uint32_t> rank_of(const PrometheusSample& sample, EngineKind kind) {
  const auto label = sample.label(kind == EngineKind::vllm ? "engine" : "dp_rank");
  if (!label) return 0;
  return parse_integer<std::uint32_t>(*label);
}

std::uint32_t count_of(double value) {
  if (!std::isfinite(value) || value <= 0) return 0;
  if (value >= 4e9) return 4'000'000'000U;
  return static_cast<std::uint32_t>(std::llround(value));
}

}  // namespace

std::string_view as_str(EngineKind kind) { return kind == EngineKind::vllm ? "vllm" : "sglang"; }

std::optional<EngineKind> parse_engine_kind(std::string_view name) {
  if (name == "vllm") return EngineKind::vllm;
  if (name == "sglang") return EngineKind::sglang;
  return std::nullopt;
}

std::optional<std::string_view> PrometheusSample::label(std::string_view key) const {
  for (const auto& [label_name, label_value] : labels) {
    if (label_name == key) return std::string_view{label_value};
  }
  return std::nullopt;
}

std::vector<PrometheusSample> parse_prometheus_text(std::string_view text) {
  std::vector<PrometheusSample> samples;
  while (!text.empty()) {
    const auto newline = text.find('\n');
    std::string_view line = trim(text.substr(0, newline));
    text = newline == std::string_view::npos ? std::string_view{} : text.substr(newline + 1);
    if (line.empty() || line.front() == '#') continue;
    PrometheusSample sample;
    const auto name_end = line.find_first_of("{ \t");
    if (name_end == std::string_view::npos || name_end == 0) continue;
    sample.name = std::string{line.substr(0, name_end)};
    std::string_view rest = line.substr(name_end);
    if (rest.front() == '{') {
      auto after = parse_labels(rest, sample);
      if (!after) continue;
      rest = *after;
    }
    auto value = parse_value(rest);
    if (!value) continue;
    sample.value = *value;
    samples.push_back(std::move(sample));
  }
  return samples;
}

std::vector<EngineRankLoad> engine_load(const std::vector<PrometheusSample>& samples,
                                        EngineKind kind, std::uint32_t data_parallel_size) {
  std::vector<EngineRankLoad> ranks(data_parallel_size);
  // vLLM renamed its usage gauge; the newer name wins where both appear.
  std::vector<std::optional<double>> older_usage(data_parallel_size);
  const bool vllm = kind == EngineKind::vllm;
  for (const PrometheusSample& sample : samples) {
    const auto rank = rank_of(sample, kind);
    if (!rank || *rank >= data_parallel_size) continue;
    EngineRankLoad& load = ranks[*rank];
    if (sample.name == (vllm ? "vllm:num_requests_running" : "sglang:num_running_reqs")) {
      load.running += count_of(sample.value);
    } else if (sample.name == (vllm ? "vllm:num_requests_waiting" : "sglang:num_queue_reqs")) {
      load.waiting += count_of(sample.value);
    } else if (sample.name == (vllm ? "vllm:kv_cache_usage_perc" : "sglang:token_usage")) {
      if (std::isfinite(sample.value)) load.kv_usage = std::clamp(sample.value, 0.0, 1.0);
    } else if (vllm && sample.name == "vllm:gpu_cache_usage_perc") {
      if (std::isfinite(sample.value)) older_usage[*rank] = std::clamp(sample.value, 0.0, 1.0);
    }
  }
  for (std::uint32_t rank = 0; rank < data_parallel_size; ++rank) {
    if (!ranks[rank].kv_usage) ranks[rank].kv_usage = older_usage[rank];
  }
  return ranks;
}

EngineCacheConfig engine_cache_config(const std::vector<PrometheusSample>& samples) {
  EngineCacheConfig config;
  for (const PrometheusSample& sample : samples) {
    if (sample.name != "vllm:cache_config_info") continue;
    if (auto block_size = sample.label("block_size")) {
      config.block_size = parse_integer<std::uint32_t>(*block_size);
    }
    if (auto blocks = sample.label("num_gpu_blocks")) {
      config.num_gpu_blocks = parse_integer<std::uint64_t>(*blocks);
    }
  }
  return config;
}

std::optional<double> engine_start_time(const std::vector<PrometheusSample>& samples) {
  for (const PrometheusSample& sample : samples) {
    if (sample.name == "process_start_time_seconds" && std::isfinite(sample.value) &&
        sample.value > 0) {
      return sample.value;
    }
  }
  return std::nullopt;
}

}  // namespace kvr::bridge
