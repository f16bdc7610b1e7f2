#include "messages/clock.hpp"

namespace kvr {
namespace {

class SteadyClock final : public Clock {
 public:
  time_point now() const override { return std::chrono::steady_clock::now(); }
};

}  // namespace

std::shared_ptr<const Clock> Clock::steady() {
  static const auto instance = std::make_shared<const SteadyClock>();
  return instance;
}

}  // namespace kvr
