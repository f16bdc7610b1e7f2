#include "tests/bench/node/node_bench_workload.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>
#include <sstream>
#include <unordered_set>

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include "messages/subjects.hpp"

namespace kvr::bench {
namespace {

constexpr std::size_t kDocuments = 512;
constexpr std::size_t kDocumentBlocks = 64;
constexpr std::size_t kDocumentsPerWorker = 16;
constexpr std::size_t kRequests = 4096;
constexpr std::size_t kOwnBlocks = 4;

// Document d is cached on workers d mod 64 and (d + 32) mod 64.
std::vector<std::size_t> documents_of(std::size_t worker) {
  std::vector<std::size_t> documents;
  for (std::size_t d = 0; d < kDocuments; ++d) {
    if (d % kWorkers == worker || (d + kWorkers / 2) % kWorkers == worker) documents.push_back(d);
  }
  return documents;
}

}  // namespace

Workload::Workload() {
  std::mt19937_64 random{20261129};
  documents_.resize(kDocuments);
  for (auto& document : documents_) {
    document.resize(kDocumentBlocks);
    for (auto& hash : document) hash = random();
  }
  std::uniform_int_distribution<std::size_t> pick_document{0, kDocuments - 1};
  std::uniform_int_distribution<std::size_t> pick_length{kDocumentBlocks / 2, kDocumentBlocks};
  prompts_.resize(kRequests);
  for (auto& prompt : prompts_) {
    const auto& document = documents_[pick_document(random)];
    prompt.assign(document.begin(),
                  document.begin() + static_cast<std::ptrdiff_t>(pick_length(random)));
    for (std::size_t i = 0; i < kOwnBlocks; ++i) prompt.push_back(random());
  }
}

discovery::WorkerRegistration Workload::registration(std::size_t index) const {
  discovery::WorkerRegistration registration;
  registration.worker_id = kFirstWorker + index;
  registration.incarnation = 1;
  registration.model = std::string{kModel};
  registration.block_size = kBlockSize;
  registration.total_kv_blocks = 16'384;
  registration.max_num_batched_tokens = 8192;
  registration.max_num_seqs = 256;
  registration.liveness_ttl = std::chrono::minutes(10);
  registration.generate_subject = subjects::worker_generate("bench", registration.worker_id);
  registration.dump_subject = subjects::worker_dump("bench", registration.worker_id);
  return registration;
}

KvEventBatch Workload::kv_events(std::size_t index) const {
  KvEventBatch batch{.worker = {kFirstWorker + index, 0}, .incarnation = 1, .event_id = 1};
  for (std::size_t d : documents_of(index)) {
    batch.events.emplace_back(KvStoredEvent{
        .parent_hash = std::nullopt, .block_hashes = documents_[d], .tier = StorageTier::Device});
  }
  return batch;
}

std::size_t Workload::prompt_blocks(std::size_t index) const {
  return prompts_[index % prompts_.size()].size();
}

v1::RouteRequest Workload::route_request(std::size_t index, std::string_view request_id) const {
  const auto& prompt = prompts_[index % prompts_.size()];
  v1::RouteRequest request;
  request.set_request_id(std::string{request_id});
  request.set_model(std::string{kModel});
  request.set_expected_output_tokens(128);
  auto* hashes = request.mutable_block_hashes();
  hashes->set_prompt_tokens(static_cast<std::uint32_t>(prompt.size() * kBlockSize));
  for (BlockHash hash : prompt) hashes->add_hashes(hash);
  return request;
}

std::size_t Workload::distinct_blocks() const {
  std::unordered_set<BlockHash> blocks;
  for (const auto& document : documents_) blocks.insert(document.begin(), document.end());
  return blocks.size();
}

v1::WorkerRegistration to_wire(const discovery::WorkerRegistration& registration) {
  v1::WorkerRegistration wire;
  wire.set_worker_id(registration.worker_id);
  wire.set_incarnation(registration.incarnation);
  wire.set_model(registration.model);
  wire.set_role(v1::WORKER_ROLE_AGGREGATED);
  wire.set_routing_group(registration.routing_group);
  wire.set_block_size(registration.block_size);
  wire.set_total_kv_blocks(registration.total_kv_blocks.value_or(0));
  wire.set_data_parallel_size(1);
  wire.set_max_num_batched_tokens(registration.max_num_batched_tokens);
  wire.set_max_num_seqs(registration.max_num_seqs);
  wire.set_publishes_kv_events(true);
  wire.set_liveness_ttl_ms(static_cast<std::uint32_t>(registration.liveness_ttl.count()));
  wire.set_generate_subject(registration.generate_subject);
  wire.set_dump_subject(registration.dump_subject);
  return wire;
}

v1::LoadMetrics idle_load_wire(const discovery::WorkerRegistration& registration) {
  v1::LoadMetrics load;
  load.set_worker_id(registration.worker_id);
  load.set_incarnation(registration.incarnation);
  load.add_ranks()->set_dp_rank(0);
  return load;
}

RequestTemplates::RequestTemplates(const Workload& workload) {
  const std::string placeholder(kIdWidth, '0');
  templates_.reserve(workload.pool_size());
  for (std::size_t i = 0; i < workload.pool_size(); ++i) {
    templates_.push_back(workload.route_request(i, placeholder).SerializeAsString());
  }
}

void RequestTemplates::render(std::uint64_t sequence, std::string& out) const {
  out = templates_[sequence % templates_.size()];
  // Field 1 (request_id) comes first: tag byte, length byte, then the id's bytes.
  const std::string id = fmt::format("{:016x}", sequence);
  out.replace(2, kIdWidth, id);
}

LatencyPercentiles percentiles(std::vector<double> microseconds) {
  LatencyPercentiles result;
  if (microseconds.empty()) return result;
  std::ranges::sort(microseconds);
  const auto at = [&](double fraction) {
    const auto rank =
        static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(microseconds.size())));
    return microseconds[std::clamp<std::size_t>(rank, 1, microseconds.size()) - 1];
  };
  result.mean_us = std::accumulate(microseconds.begin(), microseconds.end(), 0.0) /
                   static_cast<double>(microseconds.size());
  result.p50_us = at(0.50);
  result.p90_us = at(0.90);
  result.p99_us = at(0.99);
  result.max_us = microseconds.back();
  return result;
}

HistogramSnapshot read_histogram(std::string_view text, std::string_view name) {
  HistogramSnapshot snapshot;
  std::istringstream lines{std::string{text}};
  std::string line;
  const std::string bucket_prefix = std::string{name} + "_bucket{le=\"";
  const std::string sum_prefix = std::string{name} + "_sum ";
  const std::string count_prefix = std::string{name} + "_count ";
  while (std::getline(lines, line)) {
    if (line.rfind(bucket_prefix, 0) == 0) {
      const std::size_t close = line.find('"', bucket_prefix.size());
      const std::string bound = line.substr(bucket_prefix.size(), close - bucket_prefix.size());
      const double le = bound == "+Inf" ? INFINITY : std::stod(bound);
      const double cumulative = std::stod(line.substr(line.rfind(' ') + 1));
      // Several nodes' pages joined: the same bucket of each adds up.
      auto same = std::ranges::find(snapshot.buckets, le, &std::pair<double, double>::first);
      if (same != snapshot.buckets.end()) {
        same->second += cumulative;
      } else {
        snapshot.buckets.emplace_back(le, cumulative);
      }
    } else if (line.rfind(sum_prefix, 0) == 0) {
      snapshot.sum += std::stod(line.substr(sum_prefix.size()));
    } else if (line.rfind(count_prefix, 0) == 0) {
      snapshot.count += std::stod(line.substr(count_prefix.size()));
    }
  }
  return snapshot;
}

LatencyPercentiles histogram_delta(const HistogramSnapshot& before,
                                   const HistogramSnapshot& after) {
  LatencyPercentiles result;
  const double count = after.count - before.count;
  if (count <= 0 || after.buckets.empty()) return result;
  result.mean_us = (after.sum - before.sum) / count * 1e6;
  std::vector<double> cumulative(after.buckets.size());
  for (std::size_t i = 0; i < after.buckets.size(); ++i) {
    const double earlier = i < before.buckets.size() ? before.buckets[i].second : 0;
    cumulative[i] = after.buckets[i].second - earlier;
  }
  const auto quantile = [&](double fraction) {
    const double target = fraction * count;
    double lower_bound = 0;
    double lower_count = 0;
    for (std::size_t i = 0; i < cumulative.size(); ++i) {
      const double upper = after.buckets[i].first;
      if (cumulative[i] >= target) {
        // Past the last finite bound there is nothing to interpolate: report that bound.
        if (std::isinf(upper)) return lower_bound * 1e6;
        const double in_bucket = cumulative[i] - lower_count;
        const double share = in_bucket > 0 ? (target - lower_count) / in_bucket : 1.0;
        return (lower_bound + share * (upper - lower_bound)) * 1e6;
      }
      lower_bound = upper;
      lower_count = cumulative[i];
    }
    return lower_bound * 1e6;
  };
  result.p50_us = quantile(0.50);
  result.p90_us = quantile(0.90);
  result.p99_us = quantile(0.99);
  return result;
}

double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& time) {
    return static_cast<double>(time.tv_sec) + static_cast<double>(time.tv_usec) / 1e6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double process_cpu_seconds(int pid) {
  std::ifstream input{"/proc/" + std::to_string(pid) + "/stat"};
  std::string text{std::istreambuf_iterator<char>{input}, std::istreambuf_iterator<char>{}};
  // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields{text.substr(close + 2)};
  std::string field;
  double ticks = 0;
  for (int index = 3; index <= 15 && fields >> field; ++index) {
    if (index >= 14) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

void ClosedLoop::begin(std::size_t total, std::size_t slots,
                       std::chrono::milliseconds max_duration) {
  issued_.store(0);
  deadline_ = std::chrono::steady_clock::now() + max_duration;
  open_slots_.store(slots);
  total_.store(total);
}

std::optional<std::uint64_t> ClosedLoop::next_request() {
  const std::uint64_t n = issued_.fetch_add(1);
  if (n < total_.load() && std::chrono::steady_clock::now() < deadline_) return n;
  finish_slot();
  return std::nullopt;
}

void ClosedLoop::finish_slot() {
  if (open_slots_.fetch_sub(1) == 1) {
    std::lock_guard lock{mutex_};
    done_.notify_all();
  }
}

std::size_t ClosedLoop::wait(std::chrono::milliseconds grace) {
  {
    std::unique_lock lock{mutex_};
    done_.wait_until(lock, deadline_ + grace, [this] { return open_slots_.load() == 0; });
  }
  total_.store(0);
  return open_slots_.load();
}

}  // namespace kvr::bench
