// Stand-ins the front door's unit tests forward to and route through: an engine on loopback that
// answers non-streamed completions, and a routing gateway that sends every request to it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>

#include "selection/front_door/routing_gateway.hpp"

namespace kvr::front_door::stand_ins {

using namespace std::chrono_literals;
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// An engine on loopback that answers non-streamed completions, counting connections and
// requests. `drop_second_request_of_first_connection`: the first connection's second request is
// read and the connection closed unanswered (an engine closing an idle connection as a request
// arrives). `close_after_answer`: every answer says Connection: close.
class EngineStandIn {
 public:
  struct Behaviour {
    bool drop_second_request_of_first_connection = false;
    bool close_after_answer = false;
  };

  explicit EngineStandIn(Behaviour behaviour) : behaviour_(behaviour) {
    acceptor_.open(tcp::v4());
    acceptor_.bind({net::ip::make_address("127.0.0.1"), 0});
    acceptor_.listen();
    accepting_ = std::thread{[this] { accept_loop(); }};
  }

  ~EngineStandIn() {
    stopping_ = true;
    // Wakes the accept loop: a connection it sees `stopping_` on.
    tcp::socket poke{io_};
    boost::system::error_code ignored;
    poke.connect(acceptor_.local_endpoint(), ignored);
    accepting_.join();
    {
      std::lock_guard lock{mutex_};
      for (auto& socket : sockets_) socket->shutdown(tcp::socket::shutdown_both, ignored);
    }
    for (auto& thread : serving_) thread.join();
  }

  std::string url() const {
    return "http://127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port());
  }
  int connections() const { return connections_.load(); }
  int answered() const { return answered_.load(); }

 private:
  void accept_loop() {
    for (int index = 0;; ++index) {
      auto socket = std::make_shared<tcp::socket>(io_);
      boost::system::error_code error;
      acceptor_.accept(*socket, error);
      if (error || stopping_) return;
      ++connections_;
      std::lock_guard lock{mutex_};
      sockets_.push_back(socket);
      serving_.emplace_back([this, socket, index] { serve(*socket, index); });
    }
  }

  void serve(tcp::socket& socket, int connection) {
    beast::flat_buffer buffer;
    for (int request_index = 0;; ++request_index) {
      http::request<http::string_body> request;
      boost::system::error_code error;
      http::read(socket, buffer, request, error);
      if (error) return;
      if (behaviour_.drop_second_request_of_first_connection && connection == 0 &&
          request_index == 1) {
        socket.shutdown(tcp::socket::shutdown_both, error);
        return;
      }
      http::response<http::string_body> answer{http::status::ok, 11};
      answer.set(http::field::content_type, "application/json");
      answer.body() =
          R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi",)"
          R"("finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":1,)"
          R"("total_tokens":5}})";
      answer.keep_alive(!behaviour_.close_after_answer);
      answer.prepare_payload();
      ++answered_;  // before the write: the client may have the answer before write returns
      http::write(socket, answer, error);
      if (error || behaviour_.close_after_answer) {
        socket.shutdown(tcp::socket::shutdown_both, error);
        return;
      }
    }
  }

  Behaviour behaviour_;
  net::io_context io_;
  tcp::acceptor acceptor_{io_};
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::atomic<int> answered_{0};
  std::thread accepting_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<tcp::socket>> sockets_;
  std::vector<std::thread> serving_;
};

// Routes every request to the one engine (at once, or when the test releases the routes it was
// told to hold) and records the bookings' reports.
class OneEngineGateway final : public RoutingGateway {
 public:
  explicit OneEngineGateway(std::string url) : url_(std::move(url)) {}

  void route(v1::RouteRequest request, std::function<void(v1::RouteDecision)> done) override {
    v1::RouteDecision decision;
    decision.set_request_id(request.request_id());
    auto* success = decision.mutable_success();
    success->set_worker_id(kWorker);
    success->set_booking_id("booking-" + request.request_id());
    success->set_worker_http_url(url_);
    {
      std::lock_guard lock{mutex_};
      if (hold_) {
        held_.emplace_back(std::move(decision), std::move(done));
        held_changed_.notify_all();
        return;
      }
    }
    done(std::move(decision));
  }

  void hold_routes() {
    std::lock_guard lock{mutex_};
    hold_ = true;
  }
  bool wait_held(std::size_t count) {
    std::unique_lock lock{mutex_};
    return held_changed_.wait_for(lock, 10s, [&] { return held_.size() >= count; });
  }
  // Answers the held routes (from the test's thread, as an actor thread would).
  void release_held() {
    std::vector<std::pair<v1::RouteDecision, std::function<void(v1::RouteDecision)>>> held;
    {
      std::lock_guard lock{mutex_};
      held.swap(held_);
    }
    for (auto& [decision, done] : held) done(std::move(decision));
  }

  void report(v1::LifecycleReport report) override {
    std::lock_guard lock{mutex_};
    reports_.push_back(std::move(report));
  }

  std::shared_ptr<GenerateStream> generate(v1::GenerateRequest, GenerateCallbacks) override {
    ADD_FAILURE() << "the engine has an HTTP URL: nothing goes through generate";
    return nullptr;
  }

  int aborted() const {
    std::lock_guard lock{mutex_};
    return static_cast<int>(std::ranges::count_if(reports_, [](const v1::LifecycleReport& r) {
      return r.event() == v1::LIFECYCLE_EVENT_ABORTED;
    }));
  }

  static constexpr WorkerId kWorker = 7;

 private:
  std::string url_;
  mutable std::mutex mutex_;
  std::condition_variable held_changed_;
  bool hold_ = false;
  std::vector<std::pair<v1::RouteDecision, std::function<void(v1::RouteDecision)>>> held_;
  std::vector<v1::LifecycleReport> reports_;
};

}  // namespace kvr::front_door::stand_ins
