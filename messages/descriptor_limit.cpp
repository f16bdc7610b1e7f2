#include "messages/descriptor_limit.hpp"

#include <algorithm>

#include <sys/resource.h>

namespace kvr {

DescriptorLimit descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return {};
  return {.soft = limit.rlim_cur, .hard = limit.rlim_max};
}

DescriptorLimit raise_descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return {};
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    // A hard limit of "unlimited" is refused for the soft one on Linux (nr_open bounds it): the
    // limit stays as it was then.
    ::setrlimit(RLIMIT_NOFILE, &raised);
  }
  return descriptor_limit();
}

std::uint64_t descriptor_reserve(std::uint64_t soft_limit) {
  return std::max<std::uint64_t>(128, soft_limit / 8);
}

std::size_t connections_within_limit(std::size_t requested, std::uint64_t soft_limit,
                                     std::size_t descriptors_per_connection) {
  if (soft_limit == 0 || soft_limit == RLIM_INFINITY) return requested;
  const std::uint64_t reserve = descriptor_reserve(soft_limit);
  const std::uint64_t usable = soft_limit > reserve ? soft_limit - reserve : 0;
  const std::uint64_t fits = usable / std::max<std::size_t>(descriptors_per_connection, 1);
  return static_cast<std::size_t>(
      std::clamp<std::uint64_t>(fits, 1, static_cast<std::uint64_t>(requested)));
}

}  // namespace kvr
