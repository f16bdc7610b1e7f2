#include "tests/testing/kvr_cluster_test.hpp"

#include <chrono>
#include <utility>

namespace kvr::testing {

nats::NatsOptions reconnecting_client() {
  nats::NatsOptions options;
  options.max_reconnects = -1;
  options.reconnect_wait = std::chrono::milliseconds(50);
  return options;
}

KvrClusterTest::KvrClusterTest(std::string binary, std::string ns, nats::NatsOptions client_options,
                               std::vector<std::string> server_args)
    : binary_(std::move(binary)),
      namespace_(std::move(ns)),
      client_options_(std::move(client_options)),
      server_args_(std::move(server_args)) {}

void KvrClusterTest::SetUp() {
  std::string error;
  server_ = NatsServer::start(&error, std::nullopt, server_args_);
  ASSERT_TRUE(server_) << error;
  client_options_.url = server_->url();
  auto client = nats::NatsClient::connect(client_options_);
  ASSERT_TRUE(client) << client.error();
  client_ = std::move(*client);
  kvr_.emplace(binary_, server_->url(), namespace_, directory_.path());
}

}  // namespace kvr::testing
