// Every router-policy YAML the documentation shows loads as written: each ```yaml block of
// README.md and docs/*.md, and each deploy/examples/*.yaml file, goes through the real loader,
// the selection precedence and the plugin registry (built-in policies plus the example catalog).
// And the actor client docs/actor-client.md shows in full is the one the test suite builds.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "deploy/examples/policies/example_catalog.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/policies/builtin_policies.hpp"

namespace kvr::selection {
namespace {

namespace fs = std::filesystem;

/// One YAML document and where it came from ("README.md:120" or a file path).
struct YamlSample {
  std::string source;
  std::string text;
};

std::string read_file(const fs::path& path) {
  std::ifstream in{path};
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The ```yaml fenced blocks of a Markdown file, each named by the line of its opening fence.
/// Other YAML, such as Envoy's configuration in docs/gateway.md, names itself after the language
/// ("```yaml envoy") and is not a router policy.
std::vector<YamlSample> yaml_blocks(const fs::path& markdown, const std::string& name) {
  std::vector<YamlSample> blocks;
  std::istringstream lines{read_file(markdown)};
  std::string line;
  std::optional<YamlSample> open;
  for (int number = 1; std::getline(lines, line); ++number) {
    const std::string_view trimmed =
        std::string_view{line}.substr(std::min(line.find_first_not_of(' '), line.size()));
    if (!open && trimmed == "```yaml") {
      open = YamlSample{name + ":" + std::to_string(number), {}};
    } else if (open && trimmed.starts_with("```")) {
      blocks.push_back(std::move(*open));
      open.reset();
    } else if (open) {
      open->text.append(line).append("\n");
    }
  }
  EXPECT_FALSE(open.has_value()) << name << ": unterminated ```yaml block at " << open->source;
  return blocks;
}

std::vector<YamlSample> documented_yaml() {
  const fs::path root{KVR_SOURCE_DIR};
  std::vector<YamlSample> samples = yaml_blocks(root / "README.md", "README.md");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator{root / "docs"}) {
    if (entry.path().extension() == ".md") files.push_back(entry.path());
  }
  for (const auto& entry : fs::directory_iterator{root / "deploy/examples"}) {
    if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  }
  std::ranges::sort(files);
  for (const fs::path& file : files) {
    const std::string name = fs::relative(file, root).string();
    if (file.extension() == ".md") {
      std::ranges::move(yaml_blocks(file, name), std::back_inserter(samples));
    } else {
      samples.push_back(YamlSample{name, read_file(file)});
    }
  }
  return samples;
}

std::size_t count_from(const std::vector<YamlSample>& samples, std::string_view prefix) {
  return static_cast<std::size_t>(std::ranges::count_if(
      samples, [&](const YamlSample& sample) { return sample.source.starts_with(prefix); }));
}

TEST(DocsYamlTest, EveryDocumentedRouterPolicyYamlLoads) {
  plugins::RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  ASSERT_TRUE(examples::register_example_catalog(registry));
  // What `kvr node` registers: the README's examples are given to it as they are.
  plugins::RouterPluginRegistry builtins_only;
  ASSERT_TRUE(register_builtin_policies(builtins_only));

  const std::vector<YamlSample> samples = documented_yaml();
  // The README's configuration example, docs/policies.md's instance, and the example catalog's
  // file at least: the test cannot pass by finding nothing.
  EXPECT_GE(count_from(samples, "README.md"), 1U);
  EXPECT_GE(count_from(samples, "docs/policies.md"), 1U);
  EXPECT_GE(count_from(samples, "deploy/examples/router_policy.yaml"), 1U);
  EXPECT_GE(samples.size(), 3U);

  for (const YamlSample& sample : samples) {
    SCOPED_TRACE(sample.source);
    auto config = parse_router_policy_config(sample.text, sample.source);
    ASSERT_TRUE(config.has_value()) << config.error();
    auto merged = apply_selection_precedence(
        *config, {}, [](std::string_view) { return std::optional<std::string>{}; });
    ASSERT_TRUE(merged.has_value()) << merged.error();
    auto plugins = registry.resolve_plugins(*config);
    EXPECT_TRUE(plugins.has_value()) << plugins.error().message();
    if (sample.source.starts_with("README.md")) {
      auto builtin = builtins_only.resolve_plugins(*config);
      EXPECT_TRUE(builtin.has_value())
          << "with the built-in policies only: " << builtin.error().message();
    }
  }
}

TEST(DocsCodeTest, TheActorClientOfTheDocsIsTheOneTheSuiteBuilds) {
  const std::string doc = read_file(fs::path{KVR_SOURCE_DIR} / "docs/actor-client.md");
  const std::string source =
      read_file(fs::path{KVR_SOURCE_DIR} / "deploy/examples/actor_client/actor_client.cpp");
  ASSERT_FALSE(source.empty());
  EXPECT_NE(doc.find("```cpp\n" + source + "```\n"), std::string::npos)
      << "docs/actor-client.md no longer shows deploy/examples/actor_client/actor_client.cpp";
}

}  // namespace
}  // namespace kvr::selection
