// The deployment files of deploy/cluster/ say only what kvr and nats-server accept: every
// Kubernetes manifest (every document) parses and has its kind and name, every container that
// runs `kvr` or `nats-server` names only flags and KVR_* variables their --help lists, the node
// StatefulSet joins the cluster with stable ids, pod addresses, /healthz probes and a policy
// ConfigMap that loads; every systemd unit has its sections and an ExecStart whose flags exist.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

const fs::path kClusterDir = fs::path{KVR_SOURCE_DIR} / "deploy/cluster";

/// The flags and environment variables a command's --help lists.
struct HelpText {
  std::set<std::string> flags;
  std::set<std::string> env;
};

HelpText help_of(const std::vector<std::string>& argv) {
  static int runs = 0;
  testing::TemporaryDirectory directory;
  const testing::ProcessRun run =
      testing::run_process(argv, directory.path() / fmt::format("help-{}.log", runs++), 20s);
  EXPECT_TRUE(run.exit_code == 0) << fmt::format("{}", argv.front()) << "\n" << run.output;
  HelpText help;
  // "--flag", "-js", "-sd," as they open a help line or follow a comma or space.
  static const std::regex flag{R"((?:^|[\s,])(--?[A-Za-z][A-Za-z0-9_-]*))"};
  for (std::sregex_iterator it{run.output.begin(), run.output.end(), flag}, end; it != end; ++it) {
    help.flags.insert((*it)[1]);
  }
  static const std::regex env{R"(Env:(KVR_[A-Z0-9_]+))"};
  for (std::sregex_iterator it{run.output.begin(), run.output.end(), env}, end; it != end; ++it) {
    help.env.insert((*it)[1]);
  }
  return help;
}

const HelpText& kvr_help(const std::string& subcommand) {
  static std::map<std::string, HelpText> cache;
  if (!cache.contains(subcommand))
    cache[subcommand] = help_of({kvr::testing::kvr_binary(), subcommand, "--help"});
  return cache[subcommand];
}

const HelpText& nats_server_help() {
  static const HelpText help = help_of({"nats-server", "--help"});
  return help;
}

std::vector<fs::path> files_in(const fs::path& dir, std::string_view extension) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator{dir}) {
    if (entry.path().extension() == extension) files.push_back(entry.path());
  }
  std::ranges::sort(files);
  return files;
}

std::string read_text(const fs::path& path) {
  std::ifstream in{path};
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Checks a command line's flags against the help of the program it runs (kvr <subcommand> or
// nats-server); returns the program ("kvr node", "kvr mocker", "nats-server", or another).
std::string check_command(const std::vector<std::string>& argv, const std::string& where) {
  if (argv.empty()) {
    ADD_FAILURE() << where << ": an empty command";
    return {};
  }
  const std::string program = fs::path{argv.front()}.filename().string();
  const HelpText* help = nullptr;
  std::string name = program;
  std::size_t first_flag = 1;
  if (program == "kvr") {
    if (argv.size() < 2) {
      ADD_FAILURE() << where << ": kvr without a subcommand";
      return {};
    }
    help = &kvr_help(argv[1]);
    name = "kvr " + argv[1];
    first_flag = 2;
  } else if (program == "nats-server") {
    help = &nats_server_help();
  } else {
    return program;
  }
  EXPECT_FALSE(help->flags.empty()) << where << ": " << name << " --help listed no flags";
  for (std::size_t i = first_flag; i < argv.size(); ++i) {
    if (!argv[i].starts_with("-")) continue;
    const std::string flag = argv[i].substr(0, argv[i].find('='));
    EXPECT_TRUE(help->flags.contains(flag))
        << where << ": " << name << " has no flag " << flag << " (see " << name << " --help)";
  }
  return name;
}

// The value following `flag` on a command line.
std::optional<std::string> flag_value(const std::vector<std::string>& argv, std::string_view flag) {
  for (std::size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == flag) return argv[i + 1];
  }
  return std::nullopt;
}

bool contains(const std::vector<std::string>& argv, std::string_view word) {
  return std::ranges::find(argv, word) != argv.end();
}

// ---- Kubernetes ------------------------------------------------------------------------------

struct Manifest {
  std::string source;  ///< "kvr-node.yaml #2"
  YAML::Node document;
};

std::vector<Manifest> manifests() {
  std::vector<Manifest> all;
  for (const fs::path& file : files_in(kClusterDir / "kubernetes", ".yaml")) {
    std::vector<YAML::Node> documents;
    try {
      documents = YAML::LoadAllFromFile(file.string());
    } catch (const YAML::Exception& error) {
      ADD_FAILURE() << file << ": " << error.what();
      continue;
    }
    int index = 0;
    for (const YAML::Node& document : documents) {
      all.push_back({fmt::format("{} #{}", file.filename().string(), ++index), document});
    }
  }
  return all;
}

std::vector<std::string> strings(const YAML::Node& node) {
  std::vector<std::string> values;
  if (!node || !node.IsSequence()) return values;
  for (const auto& item : node) values.push_back(item.as<std::string>());
  return values;
}

// A container's command line: command, then args.
std::vector<std::string> command_line(const YAML::Node& container) {
  std::vector<std::string> argv = strings(container["command"]);
  std::ranges::move(strings(container["args"]), std::back_inserter(argv));
  return argv;
}

bool is_workload(const YAML::Node& document) {
  const std::string kind = document["kind"].as<std::string>("");
  return kind == "StatefulSet" || kind == "Deployment" || kind == "DaemonSet";
}

// An env entry of a container by name; a null node when absent.
YAML::Node env_entry(const YAML::Node& container, std::string_view name) {
  for (const auto& entry : container["env"]) {
    if (entry["name"].as<std::string>("") == name) return entry;
  }
  return YAML::Node{YAML::NodeType::Undefined};
}

TEST(ClusterDeployTest, EveryManifestHasKindNameAndOnlyFlagsAndVariablesTheCommandsKnow) {
  const std::vector<Manifest> all = manifests();
  std::set<std::string> programs;
  for (const Manifest& manifest : all) {
    SCOPED_TRACE(manifest.source);
    const YAML::Node& document = manifest.document;
    ASSERT_TRUE(document.IsMap());
    EXPECT_FALSE(document["apiVersion"].as<std::string>("").empty());
    EXPECT_FALSE(document["kind"].as<std::string>("").empty());
    EXPECT_FALSE(document["metadata"]["name"].as<std::string>("").empty());
    if (!is_workload(document)) continue;
    const YAML::Node spec = document["spec"];
    // The selector picks the template's own pods.
    const YAML::Node labels = spec["template"]["metadata"]["labels"];
    ASSERT_TRUE(spec["selector"]["matchLabels"].IsMap());
    for (const auto& label : spec["selector"]["matchLabels"]) {
      EXPECT_EQ(labels[label.first.as<std::string>()].as<std::string>(""),
                label.second.as<std::string>())
          << "selector label " << label.first.as<std::string>();
    }
    ASSERT_TRUE(spec["template"]["spec"]["containers"].IsSequence());
    for (const auto& container : spec["template"]["spec"]["containers"]) {
      const std::string where =
          manifest.source + " container " + container["name"].as<std::string>("");
      EXPECT_FALSE(container["name"].as<std::string>("").empty()) << where;
      EXPECT_FALSE(container["image"].as<std::string>("").empty()) << where;
      const std::vector<std::string> argv = command_line(container);
      const std::string program = check_command(argv, where);
      programs.insert(program);
      if (!program.starts_with("kvr ")) continue;
      for (const auto& entry : container["env"]) {
        const std::string name = entry["name"].as<std::string>();
        if (!name.starts_with("KVR_")) continue;
        EXPECT_TRUE(kvr_help(argv[1]).env.contains(name))
            << where << ": " << program << " reads no variable " << name;
      }
    }
  }
  // The files hold what they are for: the test cannot pass by finding nothing.
  EXPECT_TRUE(programs.contains("kvr node"));
  EXPECT_TRUE(programs.contains("kvr mocker"));
  EXPECT_TRUE(programs.contains("nats-server"));
}

TEST(ClusterDeployTest, TheNodeStatefulSetJoinsWithStableIdsPodAddressesProbesAndItsPolicy) {
  const std::vector<Manifest> all = manifests();
  std::map<std::string, YAML::Node> config_maps;
  std::map<std::string, YAML::Node> services;
  for (const Manifest& manifest : all) {
    const std::string kind = manifest.document["kind"].as<std::string>("");
    const std::string name = manifest.document["metadata"]["name"].as<std::string>("");
    if (kind == "ConfigMap") config_maps[name] = manifest.document;
    if (kind == "Service") services[name] = manifest.document;
  }
  int nodes = 0;
  int nats_servers = 0;
  for (const Manifest& manifest : all) {
    const YAML::Node& document = manifest.document;
    if (document["kind"].as<std::string>("") != "StatefulSet") continue;
    const YAML::Node pod = document["spec"]["template"]["spec"];
    for (const auto& container : pod["containers"]) {
      SCOPED_TRACE(manifest.source);
      const std::vector<std::string> argv = command_line(container);
      if (argv.size() >= 2 && argv[0] == "kvr" && argv[1] == "node") {
        ++nodes;
        EXPECT_TRUE(contains(argv, "--cluster") ||
                    env_entry(container, "KVR_CLUSTER")["value"].as<std::string>("") == "1");
        EXPECT_EQ(env_entry(container, "KVR_NODE_ID")["valueFrom"]["fieldRef"]["fieldPath"]
                      .as<std::string>(""),
                  "metadata.name");
        EXPECT_EQ(env_entry(container, "KVR_CLUSTER_ADDRESS")["valueFrom"]["fieldRef"]["fieldPath"]
                      .as<std::string>(""),
                  "status.podIP");
        // The NATS URL names the NATS Service and its client port.
        const std::string url = env_entry(container, "KVR_NATS_URL")["value"].as<std::string>("");
        const std::smatch parts = [&] {
          std::smatch match;
          std::regex_match(url, match, std::regex{R"(nats://([^:/]+):(\d+))"});
          return match;
        }();
        ASSERT_EQ(parts.size(), 3U) << url;
        ASSERT_TRUE(services.contains(parts[1])) << "no Service " << parts[1];
        bool port_found = false;
        for (const auto& port : services[parts[1]]["spec"]["ports"]) {
          port_found |= port["port"].as<std::string>("") == parts[2];
        }
        EXPECT_TRUE(port_found) << url;

        // Probes on /healthz at the node's metrics port.
        const std::optional<std::string> metrics_port = flag_value(argv, "--metrics-port");
        ASSERT_TRUE(metrics_port) << "the probes need --metrics-port";
        for (const char* probe : {"startupProbe", "readinessProbe", "livenessProbe"}) {
          SCOPED_TRACE(probe);
          const YAML::Node spec = container[probe];
          ASSERT_TRUE(spec.IsMap());
          std::string target;
          if (spec["httpGet"]) {
            target = fmt::format("{}:{}", spec["httpGet"]["port"].as<std::string>(),
                                 spec["httpGet"]["path"].as<std::string>());
          } else {
            for (const std::string& word : strings(spec["exec"]["command"])) target += word + " ";
          }
          EXPECT_NE(target.find(*metrics_port), std::string::npos) << target;
          EXPECT_NE(target.find("/healthz"), std::string::npos) << target;
        }

        // --router-policy-config is a key of a mounted ConfigMap, and that YAML loads.
        const std::optional<std::string> policy_path = flag_value(argv, "--router-policy-config");
        ASSERT_TRUE(policy_path);
        std::optional<std::string> policy_text;
        for (const auto& mount : container["volumeMounts"]) {
          const std::string dir = mount["mountPath"].as<std::string>();
          if (!policy_path->starts_with(dir + "/")) continue;
          const std::string key = policy_path->substr(dir.size() + 1);
          for (const auto& volume : pod["volumes"]) {
            if (volume["name"].as<std::string>() != mount["name"].as<std::string>()) continue;
            const std::string map_name = volume["configMap"]["name"].as<std::string>("");
            ASSERT_TRUE(config_maps.contains(map_name)) << "no ConfigMap " << map_name;
            policy_text = config_maps[map_name]["data"][key].as<std::string>("");
          }
        }
        ASSERT_TRUE(policy_text && !policy_text->empty())
            << *policy_path << " is no key of a mounted ConfigMap";
        auto config = selection::parse_router_policy_config(*policy_text, *policy_path);
        ASSERT_TRUE(config) << config.error();
        plugins::RouterPluginRegistry registry;
        ASSERT_TRUE(selection::register_builtin_policies(registry));
        auto resolved = registry.resolve_plugins(*config);
        EXPECT_TRUE(resolved) << resolved.error().message();
      } else if (!argv.empty() && argv[0] == "nats-server") {
        ++nats_servers;
        EXPECT_TRUE(contains(argv, "-js") || contains(argv, "--jetstream"));
        // The JetStream store is on a mounted volume, so the leases survive a restart.
        const std::optional<std::string> store = flag_value(argv, "-sd");
        ASSERT_TRUE(store);
        bool mounted = false;
        for (const auto& mount : container["volumeMounts"]) {
          mounted |= store->starts_with(mount["mountPath"].as<std::string>());
        }
        EXPECT_TRUE(mounted) << *store;
      }
    }
  }
  EXPECT_EQ(nodes, 1) << "one StatefulSet of kvr nodes";
  EXPECT_EQ(nats_servers, 1) << "one StatefulSet of NATS";
}

// ---- systemd ---------------------------------------------------------------------------------

// A unit file: section → key → values (a key may repeat).
using UnitFile = std::map<std::string, std::map<std::string, std::vector<std::string>>>;

UnitFile parse_unit(const fs::path& path) {
  UnitFile unit;
  std::istringstream lines{read_text(path)};
  std::string line;
  std::string section;
  std::string pending;  // a line continued with a trailing backslash
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!pending.empty()) line = pending + " " + line;
    pending.clear();
    if (line.ends_with("\\")) {
      pending = line.substr(0, line.size() - 1);
      continue;
    }
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#' || line[start] == ';') continue;
    if (line[start] == '[') {
      EXPECT_TRUE(line.ends_with("]")) << path.filename() << ":" << number << ": " << line;
      section = line.substr(start + 1, line.size() - start - 2);
      unit[section];
      continue;
    }
    const auto equals = line.find('=');
    EXPECT_NE(equals, std::string::npos) << path.filename() << ":" << number << ": " << line;
    EXPECT_FALSE(section.empty()) << path.filename() << ":" << number << ": a key before [Unit]";
    if (equals == std::string::npos) continue;
    unit[section][line.substr(start, equals - start)].push_back(line.substr(equals + 1));
  }
  EXPECT_TRUE(pending.empty()) << path.filename() << ": ends in a continued line";
  return unit;
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in{text};
  std::vector<std::string> result;
  for (std::string word; in >> word;) result.push_back(word);
  return result;
}

// KEY=VALUE lines of an environment file (comments and blank lines skipped).
std::map<std::string, std::string> parse_env_file(const fs::path& path) {
  std::map<std::string, std::string> values;
  std::istringstream lines{read_text(path)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (line.empty() || line.starts_with("#")) continue;
    const auto equals = line.find('=');
    EXPECT_NE(equals, std::string::npos) << path.filename() << ":" << number << ": " << line;
    if (equals != std::string::npos) values[line.substr(0, equals)] = line.substr(equals + 1);
  }
  return values;
}

TEST(ClusterDeployTest, EverySystemdUnitHasItsSectionsAndAnExecStartWithKnownFlags) {
  std::set<std::string> programs;
  const std::vector<fs::path> units = files_in(kClusterDir / "systemd", ".service");
  for (const fs::path& path : units) {
    const std::string where = path.filename().string();
    SCOPED_TRACE(where);
    const UnitFile unit = parse_unit(path);
    for (const char* section : {"Unit", "Service", "Install"}) {
      EXPECT_TRUE(unit.contains(section)) << "no [" << section << "]";
    }
    if (!unit.contains("Unit") || !unit.contains("Service") || !unit.contains("Install")) continue;
    EXPECT_TRUE(unit.at("Unit").contains("Description"));
    EXPECT_TRUE(unit.at("Install").contains("WantedBy"));
    const auto& service = unit.at("Service");
    ASSERT_TRUE(service.contains("ExecStart"));
    ASSERT_EQ(service.at("ExecStart").size(), 1U);
    const std::vector<std::string> argv = words(service.at("ExecStart").front());
    ASSERT_FALSE(argv.empty());
    EXPECT_TRUE(argv.front().starts_with("/"))
        << "systemd wants an absolute path: " << argv.front();
    const std::string program = check_command(argv, where);
    programs.insert(program);
    if (program == "nats-server") {
      EXPECT_TRUE(contains(argv, "-js") || contains(argv, "--jetstream"));
      EXPECT_TRUE(flag_value(argv, "-sd").has_value());
    }
    if (program == "kvr node") {
      EXPECT_TRUE(contains(argv, "--cluster"));
    }
    if (!program.starts_with("kvr ")) continue;
    // The EnvironmentFile's example sits beside the unit, and sets only variables the command
    // reads or ExecStart uses.
    ASSERT_TRUE(service.contains("EnvironmentFile"));
    const fs::path installed{service.at("EnvironmentFile").front()};
    const fs::path example = kClusterDir / "systemd" / installed.filename();
    ASSERT_TRUE(fs::exists(example)) << example;
    const auto env = parse_env_file(example);
    EXPECT_FALSE(env.empty());
    for (const auto& [name, value] : env) {
      const bool read = kvr_help(argv[1]).env.contains(name);
      const bool used =
          service.at("ExecStart").front().find("${" + name + "}") != std::string::npos;
      EXPECT_TRUE(read || used) << example.filename() << ": " << program << " neither reads "
                                << name << " nor does ExecStart use it";
    }
    // Every ${VAR} of ExecStart is set by the file.
    static const std::regex reference{R"(\$\{([A-Z0-9_]+)\})"};
    const std::string& exec = service.at("ExecStart").front();
    for (std::sregex_iterator it{exec.begin(), exec.end(), reference}, end; it != end; ++it) {
      EXPECT_TRUE(env.contains((*it)[1])) << "ExecStart uses ${" << (*it)[1] << "}, unset";
    }
  }
  EXPECT_TRUE(programs.contains("kvr node"));
  EXPECT_TRUE(programs.contains("kvr mocker"));
  EXPECT_TRUE(programs.contains("nats-server"));
}

}  // namespace
}  // namespace kvr
