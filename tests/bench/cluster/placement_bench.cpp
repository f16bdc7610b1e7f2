// Placement at cluster scale: the time to assign 10,000 partitions over 100 members (every node
// does this on each membership change), one rendezvous lookup, and the figures the placement
// promises, as counters: max/mean partitions per member and the fraction moved when one member
// joins or leaves (expected about 1/N).
#include <benchmark/benchmark.h>

#include "selection/cluster/placement.hpp"

namespace {

using kvr::cluster::PlacementMember;

std::vector<PlacementMember> members_of(int count) {
  std::vector<PlacementMember> members;
  for (int i = 0; i < count; ++i) members.push_back({"node-" + std::to_string(i), 1.0});
  return members;
}

std::vector<std::string> partitions_of(int count) {
  std::vector<std::string> partitions;
  for (int i = 0; i < count; ++i) {
    partitions.push_back(kvr::cluster::partition_key("model-" + std::to_string(i), "default"));
  }
  return partitions;
}

void BM_AssignBoundedLoad(benchmark::State& state) {
  const int nodes = static_cast<int>(state.range(0));
  const int partitions_count = static_cast<int>(state.range(1));
  const auto members = members_of(nodes);
  const auto partitions = partitions_of(partitions_count);
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvr::cluster::assign(partitions, members));
  }
  const auto owners = kvr::cluster::assign(partitions, members);
  const auto spread = kvr::cluster::spread_of(owners, members);
  state.counters["max_over_mean"] = static_cast<double>(spread.max_owned) / spread.mean_owned;
  state.counters["min_over_mean"] = static_cast<double>(spread.min_owned) / spread.mean_owned;

  auto joined = members;
  joined.push_back({"node-joined", 1.0});
  const auto after_join = kvr::cluster::assign(partitions, joined);
  const double moved_join =
      static_cast<double>(kvr::cluster::moved_partitions(owners, after_join)) / partitions_count;
  state.counters["moved_on_join"] = moved_join;
  state.counters["moved_on_join_x_n"] = moved_join * (nodes + 1);

  auto left = members;
  left.erase(left.begin());
  const auto after_leave = kvr::cluster::assign(partitions, left);
  const double moved_leave =
      static_cast<double>(kvr::cluster::moved_partitions(owners, after_leave)) / partitions_count;
  state.counters["moved_on_leave"] = moved_leave;
  state.counters["moved_on_leave_x_n"] = moved_leave * nodes;
}
BENCHMARK(BM_AssignBoundedLoad)
    ->Args({3, 12})
    ->Args({10, 1000})
    ->Args({100, 10'000})
    ->Unit(benchmark::kMillisecond);

void BM_DesiredOwner(benchmark::State& state) {
  const auto members = members_of(static_cast<int>(state.range(0)));
  const auto partitions = partitions_of(1024);
  std::size_t next = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvr::cluster::desired_owner(partitions[next++ & 1023], members));
  }
  std::map<std::string, std::string> owners;
  for (const auto& partition : partitions_of(10'000)) {
    owners[partition] = *kvr::cluster::desired_owner(partition, members);
  }
  const auto spread = kvr::cluster::spread_of(owners, members);
  state.counters["max_over_mean_10k"] = static_cast<double>(spread.max_owned) / spread.mean_owned;
}
BENCHMARK(BM_DesiredOwner)->Arg(3)->Arg(100);

}  // namespace

BENCHMARK_MAIN();
