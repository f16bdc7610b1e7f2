#include "selection/config/router_policy_config.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>
#include <yaml-cpp/yaml.h>

#include "classifiers/plugin_parameters.hpp"
#include "classifiers/yaml_description.hpp"
#include "selection/plugin_registry.hpp"

namespace kvr::selection {
namespace {

// Counts a stream's documents without building them, noting where each starts.
class DocumentCounter : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override {
    ++documents;
    stalled = documents > 1 && mark.pos == last_start.pos;
    last_start = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

  std::size_t documents = 0;
  /// The last document began where the one before it did: the parser consumed nothing.
  bool stalled = false;
  YAML::Mark last_start = YAML::Mark::null_mark();
};

using classifiers::describe_yaml;
using classifiers::PolicyClassConfig;

constexpr std::string_view kTopLevelKeys[] = {
    "worker_selection", "request_classifier", "policy_classes", "worker_health",
    "models",           "tokenizers",         "plugins"};
constexpr std::string_view kModelKeys[] = {"tokenizer_mode", "disaggregation",
                                           "content_special_tokens"};
constexpr std::string_view kDisaggregationKeys[] = {"min_uncached_tokens", "prefill_queue_check",
                                                    "transfer_valid_ms"};
constexpr std::string_view kWorkerSelectionKeys[] = {"aggregated", "prefill", "decode", "encode",
                                                     "instances"};
constexpr std::string_view kInstanceKeys[] = {"name", "type", "parameters"};
constexpr std::string_view kRequestClassifierKeys[] = {"type", "parameters"};
constexpr std::string_view kPolicyClassKeys[] = {"name",
                                                 "quantum",
                                                 "order",
                                                 "prefill_busy_threshold",
                                                 "prefill_busy_threshold_frac",
                                                 "kv_busy_threshold",
                                                 "request_queue_limit_per_worker",
                                                 "uncached_token_queue_limit_per_worker"};
constexpr std::string_view kWorkerHealthKeys[] = {"consecutive_failures", "base_ejection_time_ms",
                                                  "max_ejection_time_ms", "max_ejection_percent",
                                                  "slow_start_window_ms", "slow_start_min_weight"};

std::string join(std::span<const std::string_view> names) {
  std::string joined;
  for (std::string_view name : names) {
    if (!joined.empty()) joined += ", ";
    joined += name;
  }
  return joined;
}

std::string child_path(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string{key} : fmt::format("{}.{}", parent, key);
}

struct MappingEntry {
  std::string key;
  YAML::Node key_node;
  YAML::Node value;
};

// Walks one router-policy document; every message names the source, the line and the key path.
class Parser {
 public:
  explicit Parser(RouterPolicyConfig& config) : config_(config) {}

  std::expected<void, std::string> parse_document(const YAML::Node& root) {
    if (root.IsNull()) return {};
    if (!root.IsMap()) {
      return fail(root, "",
                  fmt::format("expected a mapping with the keys {}, got {}", join(kTopLevelKeys),
                              describe_yaml(root)));
    }
    auto entries = mapping_entries(root, "", kTopLevelKeys);
    if (!entries) return std::unexpected(std::move(entries.error()));
    for (const MappingEntry& entry : *entries) {
      auto parsed = entry.key == "worker_selection"     ? parse_worker_selection(entry.value)
                    : entry.key == "request_classifier" ? parse_request_classifier(entry.value)
                    : entry.key == "worker_health"      ? parse_worker_health(entry.value)
                    : entry.key == "models"             ? parse_models(entry.value)
                    : entry.key == "tokenizers"         ? parse_tokenizers(entry.value)
                    : entry.key == "plugins"            ? parse_plugins(entry.value)
                                                        : parse_policy_classes(entry.value);
      if (!parsed) return parsed;
    }
    return {};
  }

 private:
  std::unexpected<std::string> fail(const YAML::Node& where, std::string_view path,
                                    std::string_view problem) const {
    const YAML::Mark mark = where.Mark();
    const std::string location = mark.is_null()
                                     ? config_.source_name
                                     : fmt::format("{}:{}", config_.source_name, mark.line + 1);
    if (path.empty()) return std::unexpected(fmt::format("{}: {}", location, problem));
    return std::unexpected(fmt::format("{}: {}: {}", location, path, problem));
  }

  // The entries of a mapping, refusing non-string keys, duplicates and keys not in `allowed`.
  std::expected<std::vector<MappingEntry>, std::string> mapping_entries(
      const YAML::Node& node, std::string_view path,
      std::span<const std::string_view> allowed) const {
    std::vector<MappingEntry> entries;
    for (auto entry = node.begin(); entry != node.end(); ++entry) {
      if (!entry->first.IsScalar()) {
        return fail(entry->first, path,
                    fmt::format("keys must be strings, got {}", describe_yaml(entry->first)));
      }
      std::string key = entry->first.Scalar();
      const std::string key_path = child_path(path, key);
      if (std::ranges::find(allowed, key) == allowed.end()) {
        return fail(entry->first, key_path, fmt::format("unknown key; allowed: {}", join(allowed)));
      }
      if (std::ranges::find(entries, key, &MappingEntry::key) != entries.end()) {
        return fail(entry->first, key_path, "duplicate key");
      }
      entries.push_back({std::move(key), entry->first, entry->second});
    }
    return entries;
  }

  // A non-empty string scalar.
  std::expected<std::string, std::string> name_value(const YAML::Node& node, std::string_view path,
                                                     std::string_view what) const {
    if (!node.IsScalar()) {
      return fail(node, path, fmt::format("expected {}, got {}", what, describe_yaml(node)));
    }
    if (node.Scalar().empty()) return fail(node, path, fmt::format("{} must not be empty", what));
    return node.Scalar();
  }

  std::expected<std::shared_ptr<const ParameterSource>, std::string> parameters_value(
      const YAML::Node& node, std::string_view path) const {
    if (!node.IsNull() && !node.IsMap()) {
      return fail(node, path, fmt::format("expected a mapping, got {}", describe_yaml(node)));
    }
    // The context stays short: resolution prefixes it with the instance's place in this file.
    auto source = ParameterSource::from_yaml(node, "parameters");
    if (!source) return fail(node, path, source.error());
    return source;
  }

  std::expected<void, std::string> parse_worker_selection(const YAML::Node& node) {
    constexpr std::string_view path = "worker_selection";
    if (node.IsNull()) return {};
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping with the keys {}, got {}",
                              join(kWorkerSelectionKeys), describe_yaml(node)));
    }
    auto entries = mapping_entries(node, path, kWorkerSelectionKeys);
    if (!entries) return std::unexpected(std::move(entries.error()));
    for (const MappingEntry& entry : *entries) {
      if (entry.key == "instances") {
        if (auto parsed = parse_instances(entry.value); !parsed) return parsed;
        continue;
      }
      const WorkerType role = *parse_worker_type(entry.key);  // mapping_entries allowed only roles
      auto value = name_value(entry.value, child_path(path, entry.key),
                              "a policy: an instance name, a policy type or 'default'");
      if (!value) return std::unexpected(std::move(value.error()));
      config_.worker_selection[static_cast<std::size_t>(role)] = std::move(*value);
      config_.worker_selection_sources[static_cast<std::size_t>(role)] = SelectionSource::Yaml;
    }
    return {};
  }

  std::expected<void, std::string> parse_instances(const YAML::Node& node) {
    constexpr std::string_view path = "worker_selection.instances";
    if (node.IsNull()) return {};
    if (!node.IsSequence()) {
      return fail(node, path,
                  fmt::format("expected a list of instances, got {}", describe_yaml(node)));
    }
    for (std::size_t i = 0; i < node.size(); ++i) {
      const YAML::Node item = node[i];
      const std::string item_path = fmt::format("{}[{}]", path, i);
      if (!item.IsMap()) {
        return fail(item, item_path,
                    fmt::format("expected a mapping with the keys {}, got {}", join(kInstanceKeys),
                                describe_yaml(item)));
      }
      auto entries = mapping_entries(item, item_path, kInstanceKeys);
      if (!entries) return std::unexpected(std::move(entries.error()));

      WorkerSelectionInstanceConfig instance;
      bool has_name = false;
      bool has_type = false;
      for (const MappingEntry& entry : *entries) {
        const std::string entry_path = child_path(item_path, entry.key);
        if (entry.key == "parameters") {
          auto parameters = parameters_value(entry.value, entry_path);
          if (!parameters) return std::unexpected(std::move(parameters.error()));
          instance.parameters = std::move(*parameters);
          continue;
        }
        auto value = name_value(entry.value, entry_path,
                                entry.key == "name" ? "an instance name" : "a policy type");
        if (!value) return std::unexpected(std::move(value.error()));
        if (*value == plugins::kDefaultPolicyName) {
          return fail(entry.value, entry_path,
                      entry.key == "name"
                          ? std::string{"'default' is reserved (it selects the built-in policy); "
                                        "choose another instance name"}
                          : fmt::format("'default' is reserved and is not a type; use type: {} "
                                        "to configure the built-in policy",
                                        plugins::kBuiltinDefaultPolicyType));
        }
        if (entry.key == "name") {
          instance.name = std::move(*value);
          has_name = true;
        } else {
          instance.type = std::move(*value);
          has_type = true;
        }
      }
      if (!has_name) return fail(item, item_path, "missing key 'name'");
      if (!has_type) return fail(item, item_path, "missing key 'type'");

      const auto previous =
          std::ranges::find(config_.instances, instance.name, &WorkerSelectionInstanceConfig::name);
      if (previous != config_.instances.end()) {
        return fail(item, child_path(item_path, "name"),
                    fmt::format("duplicate instance name '{}' (also {}[{}])", instance.name, path,
                                previous - config_.instances.begin()));
      }
      if (!instance.parameters) instance.parameters = ParameterSource::empty("parameters");
      config_.instances.push_back(std::move(instance));
    }
    return {};
  }

  std::expected<void, std::string> parse_request_classifier(const YAML::Node& node) {
    constexpr std::string_view path = "request_classifier";
    if (node.IsNull()) return {};
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping with the keys {}, got {}",
                              join(kRequestClassifierKeys), describe_yaml(node)));
    }
    auto entries = mapping_entries(node, path, kRequestClassifierKeys);
    if (!entries) return std::unexpected(std::move(entries.error()));

    RequestClassifierConfig classifier;
    bool has_type = false;
    for (const MappingEntry& entry : *entries) {
      const std::string entry_path = child_path(path, entry.key);
      if (entry.key == "parameters") {
        auto parameters = parameters_value(entry.value, entry_path);
        if (!parameters) return std::unexpected(std::move(parameters.error()));
        classifier.parameters = std::move(*parameters);
        continue;
      }
      auto type = name_value(entry.value, entry_path, "a request-classifier type");
      if (!type) return std::unexpected(std::move(type.error()));
      classifier.type = std::move(*type);
      has_type = true;
    }
    if (!has_type) return fail(node, path, "missing key 'type'");
    if (!classifier.parameters) classifier.parameters = ParameterSource::empty("parameters");
    config_.request_classifier = std::move(classifier);
    return {};
  }

  // A number read with the plugin parameters' strict conversions (no quoted numbers, no octal,
  // no fraction for an integer); the message already names the key path.
  template <class T>
  std::expected<T, std::string> number_value(const classifiers::ParameterSource& item,
                                             const MappingEntry& entry) const {
    auto value = classifiers::read_parameter<T>(item, entry.key);
    if (!value) return fail(entry.value, "", value.error());
    return **value;  // present: mapping_entries found the key
  }

  std::expected<void, std::string> parse_policy_classes(const YAML::Node& node) {
    constexpr std::string_view path = "policy_classes";
    if (node.IsNull()) return {};
    if (!node.IsSequence()) {
      return fail(node, path,
                  fmt::format("expected a list of policy classes, got {}", describe_yaml(node)));
    }
    for (std::size_t i = 0; i < node.size(); ++i) {
      const YAML::Node item = node[i];
      const std::string item_path = fmt::format("{}[{}]", path, i);
      if (!item.IsMap()) {
        return fail(item, item_path,
                    fmt::format("expected a mapping with the keys {}, got {}",
                                join(kPolicyClassKeys), describe_yaml(item)));
      }
      auto entries = mapping_entries(item, item_path, kPolicyClassKeys);
      if (!entries) return std::unexpected(std::move(entries.error()));
      auto source = ParameterSource::from_yaml(item, item_path);
      if (!source) return fail(item, item_path, source.error());

      PolicyClassConfig policy_class;
      bool has_name = false;
      for (const MappingEntry& entry : *entries) {
        const std::string entry_path = child_path(item_path, entry.key);
        if (entry.key == "name") {
          auto name = name_value(entry.value, entry_path, "a policy class name");
          if (!name) return std::unexpected(std::move(name.error()));
          policy_class.name = std::move(*name);
          has_name = true;
        } else if (entry.key == "order") {
          auto order = name_value(entry.value, entry_path, "a queue order: fcfs or wspt");
          if (!order) return std::unexpected(std::move(order.error()));
          const auto parsed = classifiers::parse_queue_order(*order);
          if (!parsed) {
            return fail(entry.value, entry_path,
                        fmt::format("expected fcfs or wspt, got {}", describe_yaml(entry.value)));
          }
          policy_class.order = *parsed;
        } else if (entry.key == "prefill_busy_threshold_frac" || entry.key == "kv_busy_threshold") {
          auto frac = number_value<double>(**source, entry);
          if (!frac) return std::unexpected(std::move(frac.error()));
          (entry.key == "kv_busy_threshold" ? policy_class.kv_busy_threshold
                                            : policy_class.prefill_busy_threshold_frac) = *frac;
        } else {
          auto tokens = number_value<std::uint64_t>(**source, entry);
          if (!tokens) return std::unexpected(std::move(tokens.error()));
          if (entry.key == "quantum") {
            policy_class.quantum = *tokens;
          } else if (entry.key == "prefill_busy_threshold") {
            policy_class.prefill_busy_threshold = *tokens;
          } else if (entry.key == "request_queue_limit_per_worker") {
            policy_class.request_queue_limit_per_worker = *tokens;
          } else {
            policy_class.uncached_token_queue_limit_per_worker = *tokens;
          }
        }
      }
      if (!has_name) return fail(item, item_path, "missing key 'name'");
      if (auto valid = classifiers::validate_policy_class(policy_class); !valid) {
        const auto entry = std::ranges::find(*entries, valid.error().key, &MappingEntry::key);
        const YAML::Node& where = entry == entries->end() ? item : entry->value;
        return fail(where, child_path(item_path, valid.error().key), valid.error().message);
      }
      const auto previous =
          std::ranges::find(config_.policy_classes, policy_class.name, &PolicyClassConfig::name);
      if (previous != config_.policy_classes.end()) {
        return fail(item, child_path(item_path, "name"),
                    fmt::format("duplicate policy class name '{}' (also {}[{}])", policy_class.name,
                                path, previous - config_.policy_classes.begin()));
      }
      config_.policy_classes.push_back(std::move(policy_class));
    }
    return {};
  }

  std::expected<void, std::string> parse_worker_health(const YAML::Node& node) {
    constexpr std::string_view path = "worker_health";
    if (node.IsNull()) return {};
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping with the keys {}, got {}",
                              join(kWorkerHealthKeys), describe_yaml(node)));
    }
    auto entries = mapping_entries(node, path, kWorkerHealthKeys);
    if (!entries) return std::unexpected(std::move(entries.error()));
    auto source = ParameterSource::from_yaml(node, std::string{path});
    if (!source) return fail(node, path, source.error());
    WorkerHealthConfig health;
    for (const MappingEntry& entry : *entries) {
      if (entry.key == "max_ejection_percent" || entry.key == "slow_start_min_weight") {
        auto value = number_value<double>(**source, entry);
        if (!value) return std::unexpected(std::move(value.error()));
        (entry.key == "max_ejection_percent" ? health.max_ejection_percent
                                             : health.slow_start_min_weight) = *value;
        continue;
      }
      auto value = number_value<std::uint64_t>(**source, entry);
      if (!value) return std::unexpected(std::move(value.error()));
      if (entry.key == "consecutive_failures") {
        // Clamped into range here; validate() then names the key of a value that is too large.
        health.consecutive_failures =
            static_cast<std::uint32_t>(std::min<std::uint64_t>(*value, UINT32_MAX));
        continue;
      }
      const std::chrono::milliseconds ms{
          static_cast<std::int64_t>(std::min<std::uint64_t>(*value, std::uint64_t{1} << 40))};
      if (entry.key == "base_ejection_time_ms") {
        health.base_ejection_time = ms;
      } else if (entry.key == "max_ejection_time_ms") {
        health.max_ejection_time = ms;
      } else {
        health.slow_start_window = ms;
      }
    }
    if (auto valid = health.validate(); !valid) {
      const auto entry = std::ranges::find(*entries, valid.error().key, &MappingEntry::key);
      const YAML::Node& where = entry == entries->end() ? node : entry->value;
      return fail(where, child_path(path, valid.error().key), valid.error().message);
    }
    config_.worker_health = health;
    return {};
  }

  // `tokenizers`: a mapping from model names to tokenizer paths.
  std::expected<void, std::string> parse_tokenizers(const YAML::Node& node) {
    constexpr std::string_view path = "tokenizers";
    if (node.IsNull()) return {};
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping from model names to tokenizer paths, got {}",
                              describe_yaml(node)));
    }
    for (auto entry = node.begin(); entry != node.end(); ++entry) {
      const YAML::Node key = entry->first;
      const YAML::Node value = entry->second;
      if (!key.IsScalar() || key.Scalar().empty()) {
        return fail(
            key, path,
            fmt::format("model names must be non-empty strings, got {}", describe_yaml(key)));
      }
      const std::string model_path = child_path(path, key.Scalar());
      if (config_.tokenizers.contains(key.Scalar()))
        return fail(key, model_path, "duplicate model");
      if (!value.IsScalar() || value.Scalar().empty()) {
        return fail(value, model_path,
                    fmt::format("expected the path of a tokenizer (a folder with tokenizer.json, "
                                "or the file), got {}",
                                describe_yaml(value)));
      }
      std::filesystem::path tokenizer = value.Scalar();
      if (tokenizer.is_relative() && !config_.source_name.empty()) {
        tokenizer = std::filesystem::path{config_.source_name}.parent_path() / tokenizer;
      }
      config_.tokenizers.emplace(key.Scalar(), tokenizer.string());
    }
    return {};
  }

  // `plugins`: a list of plugin library paths, loaded in order before the types are resolved.
  std::expected<void, std::string> parse_plugins(const YAML::Node& node) {
    constexpr std::string_view path = "plugins";
    if (node.IsNull()) return {};
    if (!node.IsSequence()) {
      return fail(
          node, path,
          fmt::format("expected a list of plugin library paths, got {}", describe_yaml(node)));
    }
    for (std::size_t i = 0; i < node.size(); ++i) {
      const YAML::Node value = node[i];
      if (!value.IsScalar() || value.Scalar().empty()) {
        return fail(
            value, fmt::format("{}[{}]", path, i),
            fmt::format("expected the path of a plugin library, got {}", describe_yaml(value)));
      }
      std::filesystem::path library = value.Scalar();
      if (library.is_relative() && !config_.source_name.empty()) {
        library = std::filesystem::path{config_.source_name}.parent_path() / library;
      }
      config_.plugins.push_back(library.string());
    }
    return {};
  }

  // `models`: a mapping from model names (any string the workers register) to their settings.
  std::expected<void, std::string> parse_models(const YAML::Node& node) {
    constexpr std::string_view path = "models";
    if (node.IsNull()) return {};
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping from model names to their settings, got {}",
                              describe_yaml(node)));
    }
    for (auto entry = node.begin(); entry != node.end(); ++entry) {
      if (!entry->first.IsScalar() || entry->first.Scalar().empty()) {
        return fail(entry->first, path,
                    fmt::format("model names must be non-empty strings, got {}",
                                describe_yaml(entry->first)));
      }
      const YAML::Node key = entry->first;
      const std::string model = key.Scalar();
      const std::string model_path = child_path(path, model);
      if (config_.models.contains(model)) return fail(key, model_path, "duplicate model");
      ModelConfig settings;
      const YAML::Node value = entry->second;
      if (!value.IsNull() && !value.IsMap()) {
        return fail(value, model_path,
                    fmt::format("expected a mapping with the keys {}, got {}", join(kModelKeys),
                                describe_yaml(value)));
      }
      auto fields = value.IsNull() ? std::expected<std::vector<MappingEntry>, std::string>{}
                                   : mapping_entries(value, model_path, kModelKeys);
      if (!fields) return std::unexpected(std::move(fields.error()));
      for (const MappingEntry& field : *fields) {
        const std::string field_path = child_path(model_path, field.key);
        if (field.key == "disaggregation") {
          auto disaggregation = parse_disaggregation(field.value, field_path);
          if (!disaggregation) return std::unexpected(std::move(disaggregation.error()));
          settings.disaggregation = *disaggregation;
          continue;
        }
        if (field.key == "content_special_tokens") {
          auto name = name_value(field.value, field_path, "special or text");
          if (!name) return std::unexpected(std::move(name.error()));
          if (*name != "special" && *name != "text") {
            return fail(field.value, field_path,
                        fmt::format("'{}' is not one of: special, text", *name));
          }
          settings.content_special_tokens_as_text = *name == "text";
          continue;
        }
        auto name = name_value(field.value, field_path, "a tokenizer mode");
        if (!name) return std::unexpected(std::move(name.error()));
        settings.tokenizer_mode = tokenizer_mode_from(*name);
        if (!settings.tokenizer_mode) {
          return fail(field.value, field_path,
                      fmt::format("'{}' is not a tokenizer mode; one of: {}", *name,
                                  tokenizer_mode_names()));
        }
      }
      config_.models.emplace(model, settings);
    }
    return {};
  }

  // `models.<model>.disaggregation`: when the model's requests take the prefill hop.
  std::expected<DisaggregationConfig, std::string> parse_disaggregation(const YAML::Node& node,
                                                                        const std::string& path) {
    DisaggregationConfig disaggregation;
    if (node.IsNull()) return disaggregation;
    if (!node.IsMap()) {
      return fail(node, path,
                  fmt::format("expected a mapping with the keys {}, got {}",
                              join(kDisaggregationKeys), describe_yaml(node)));
    }
    auto entries = mapping_entries(node, path, kDisaggregationKeys);
    if (!entries) return std::unexpected(std::move(entries.error()));
    auto source = ParameterSource::from_yaml(node, path);
    if (!source) return fail(node, path, source.error());
    for (const MappingEntry& entry : *entries) {
      if (entry.key == "prefill_queue_check") {
        auto value = number_value<bool>(**source, entry);
        if (!value) return std::unexpected(std::move(value.error()));
        disaggregation.prefill_queue_check = *value;
        continue;
      }
      auto value = number_value<std::uint64_t>(**source, entry);
      if (!value) return std::unexpected(std::move(value.error()));
      // Clamped so that validate() names the key of a value too large for its field.
      const std::uint64_t clamped = std::min<std::uint64_t>(*value, std::uint64_t{1} << 40);
      if (entry.key == "min_uncached_tokens") {
        disaggregation.min_uncached_tokens = clamped;
      } else {
        disaggregation.transfer_valid =
            std::chrono::milliseconds{static_cast<std::int64_t>(clamped)};
      }
    }
    if (auto valid = disaggregation.validate(); !valid) {
      const auto entry = std::ranges::find(*entries, valid.error().key, &MappingEntry::key);
      const YAML::Node& where = entry == entries->end() ? node : entry->value;
      return fail(where, child_path(path, valid.error().key), valid.error().message);
    }
    return disaggregation;
  }

  RouterPolicyConfig& config_;
};

}  // namespace

bool RouterPolicyConfig::has_policy_class(std::string_view name) const {
  return name == classifiers::kDefaultPolicyClass ||
         std::ranges::find(policy_classes, name, &PolicyClassConfig::name) != policy_classes.end();
}

std::expected<void, std::string> RouterPolicyConfig::check_policy_class(
    std::string_view name, std::string_view where) const {
  if (has_policy_class(name)) return {};
  std::string known;
  for (const PolicyClassConfig& policy_class : policy_classes) {
    if (policy_class.name == classifiers::kDefaultPolicyClass) continue;
    known += fmt::format("{}, ", policy_class.name);
  }
  known += classifiers::kDefaultPolicyClass;
  const std::string problem =
      policy_classes.empty() ? fmt::format(
                                   "unknown policy class '{}'; no policy_classes are "
                                   "configured, so the only class is {}",
                                   name, known)
                             : fmt::format("unknown policy class '{}'; known: {}", name, known);
  if (where.empty()) return std::unexpected(fmt::format("{}: {}", source_name, problem));
  return std::unexpected(fmt::format("{}: {}: {}", source_name, where, problem));
}

std::expected<RouterPolicyConfig, std::string> parse_router_policy_config(
    std::string_view yaml_text, std::string source_name) {
  RouterPolicyConfig config;
  config.source_name = std::move(source_name);
  // Not YAML::LoadAll: on some malformed input (",a:\n  b:c\n    - d}\n") yaml-cpp 0.7's parser
  // stops consuming it and yields empty documents forever, which LoadAll collects until memory
  // runs out. The documents are counted first, and a document that consumed nothing ends it.
  const std::string text{yaml_text};
  YAML::Node document;
  try {
    std::istringstream stream{text};
    YAML::Parser stream_parser{stream};
    DocumentCounter counter;
    while (counter.documents <= 1 && stream_parser.HandleNextDocument(counter)) {
      if (counter.stalled) {
        return std::unexpected(fmt::format("{}:{}:{}: invalid YAML: cannot read past this point",
                                           config.source_name, counter.last_start.line + 1,
                                           counter.last_start.column + 1));
      }
    }
    if (counter.documents == 0) return config;
    if (counter.documents > 1) {
      // Every further document consumes input, so counting the rest ends.
      while (stream_parser.HandleNextDocument(counter) && !counter.stalled) {
      }
      return std::unexpected(fmt::format("{}: expected one YAML document, found {}",
                                         config.source_name, counter.documents));
    }
    document = YAML::Load(text);
  } catch (const YAML::Exception& error) {
    return std::unexpected(fmt::format("{}:{}:{}: invalid YAML: {}", config.source_name,
                                       error.mark.line + 1, error.mark.column + 1, error.msg));
  }
  try {
    Parser parser{config};
    if (auto parsed = parser.parse_document(document); !parsed) {
      return std::unexpected(std::move(parsed.error()));
    }
  } catch (const YAML::Exception& error) {
    // Not expected from a parsed document; kept so that no yaml-cpp exception escapes.
    return std::unexpected(fmt::format("{}: {}", config.source_name, error.what()));
  }
  return config;
}

std::expected<RouterPolicyConfig, std::string> load_router_policy_config(
    const std::filesystem::path& path) {
  std::ifstream file{path, std::ios::binary};
  if (!file) {
    return std::unexpected(fmt::format("{}: cannot open the router-policy config: {}",
                                       path.string(), std::strerror(errno)));
  }
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad()) {
    return std::unexpected(fmt::format("{}: cannot read the router-policy config", path.string()));
  }
  return parse_router_policy_config(text.str(), path.string());
}

}  // namespace kvr::selection
