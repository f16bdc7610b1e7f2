#include "tests/testing/nats_server.hpp"

#include <csignal>
#include <fstream>
#include <regex>
#include <sstream>

namespace kvr::testing {

std::unique_ptr<NatsServer> NatsServer::start(std::string* error, std::optional<std::uint16_t> port,
                                              std::vector<std::string> extra_args) {
  std::unique_ptr<NatsServer> server{new NatsServer()};
  server->directory_ = std::make_unique<TemporaryDirectory>();
  server->extra_args_ = std::move(extra_args);
  if (!server->launch(port, error)) return nullptr;
  return server;
}

NatsServer::~NatsServer() { stop(); }

std::string NatsServer::url() const { return "nats://127.0.0.1:" + std::to_string(port_); }

void NatsServer::stop() {
  if (process_) {
    process_->stop();
    process_.reset();
  }
}

void NatsServer::kill() {
  if (process_) {
    process_->signal(SIGKILL);
    (void)process_->wait(std::chrono::seconds(5));
    process_.reset();
  }
}

bool NatsServer::restart(std::string* error) {
  stop();
  return launch(port_, error);
}

bool NatsServer::launch(std::optional<std::uint16_t> port, std::string* error) {
  const auto& dir = directory_->path();
  const auto ports_dir = dir / ("ports-" + std::to_string(++launches_));
  std::filesystem::create_directories(ports_dir);
  // -p -1 asks for a random free port; the ports file is the reliable way to learn it. A private
  // store dir keeps parallel servers apart.
  std::vector<std::string> argv{"nats-server",
                                "-a",
                                "127.0.0.1",
                                "-p",
                                port ? std::to_string(*port) : "-1",
                                "--ports_file_dir",
                                ports_dir.string(),
                                "-sd",
                                (dir / "store").string()};
  argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
  process_ = ChildProcess::start(argv, dir / "nats-server.log");
  if (!process_) {
    if (error != nullptr) *error = "cannot start nats-server (is it installed?)";
    return false;
  }
  const auto ports_file = ports_dir / ("nats-server_" + std::to_string(process_->pid()) + ".ports");
  std::string contents;
  const bool ready = wait_until(
      [&] {
        std::ifstream input{ports_file};
        if (!input) return false;
        std::stringstream text;
        text << input.rdbuf();
        contents = text.str();
        return contents.find("://127.0.0.1:") != std::string::npos;
      },
      std::chrono::milliseconds(10'000));
  std::smatch match;
  // A TLS server lists its address as tls://.
  static const std::regex kPort{R"((?:nats|tls)://127\.0\.0\.1:(\d+))"};
  if (!ready || !std::regex_search(contents, match, kPort)) {
    if (error != nullptr) *error = "nats-server did not come up: " + process_->log();
    stop();
    return false;
  }
  port_ = static_cast<std::uint16_t>(std::stoi(match[1].str()));
  return true;
}

bool make_self_signed_certificate(const std::filesystem::path& dir, std::string* error) {
  auto openssl = ChildProcess::start(
      {"openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
       "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout",
       (dir / "key.pem").string(), "-out", (dir / "cert.pem").string()},
      dir / "openssl.log");
  if (openssl && openssl->wait(std::chrono::seconds(30)) == 0) return true;
  if (error != nullptr) {
    *error = openssl ? "openssl could not make a certificate: " + openssl->log()
                     : "cannot start openssl (is it installed?)";
  }
  return false;
}

}  // namespace kvr::testing
