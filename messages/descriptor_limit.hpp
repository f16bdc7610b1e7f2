// The process's file descriptor budget (RLIMIT_NOFILE) and what a listener may take of it: the
// node raises its soft limit at startup and caps each door's connections below what is left once
// NATS, engines, peers and files have their reserve, so that a flood of clients meets a refusal
// instead of an accept loop out of descriptors. Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvr {

/// RLIMIT_NOFILE as it stands.
struct DescriptorLimit {
  std::uint64_t soft = 0;
  std::uint64_t hard = 0;
};

/// The limit in force now.
DescriptorLimit descriptor_limit();

/// Raises the soft limit to the hard limit where the process may (an unprivileged process may
/// always go up to its hard limit); returns the limit in force afterwards.
DescriptorLimit raise_descriptor_limit();

/// Descriptors left to everything but client connections: NATS, engine connections kept alive,
/// peers, the other doors, files. An eighth of the limit, at least 128.
std::uint64_t descriptor_reserve(std::uint64_t soft_limit);

/// The client connections a door may hold under `soft_limit` when each may need
/// `descriptors_per_connection` at once (a forwarded request holds its engine connection too):
/// `requested`, or less when the limit leaves less (at least 1).
std::size_t connections_within_limit(std::size_t requested, std::uint64_t soft_limit,
                                     std::size_t descriptors_per_connection);

}  // namespace kvr
