// A plugin whose policy misbehaves on purpose, chosen by the prompt's length in tokens (mod 6):
//   0 serves normally (the least active requests), 1 its scorer throws, 2 its scorer returns NaN,
//   3 its picker returns a row past the last, 4 its scorer reads the CACHE group it did not
//   declare, 5 its filter throws something that is no std::exception.
// The node must fail only those selections and serve every other request.
#include <limits>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include <kvr/plugin.hpp>

namespace {

using namespace kvr::plugins::worker_selection;

enum class Fault {
  none,
  scorer_throws,
  scorer_nan,
  picker_out_of_range,
  undeclared_group,
  filter_throws
};

Fault fault_of(const WorkerSelectionContext& context) {
  return static_cast<Fault>(context.prompt_tokens() % 6);
}

class MisbehavingFilter final : public WorkerFilter {
 public:
  PolicyResult<bool> keep(const WorkerSelectionContext& context, const WorkerCandidate&) override {
    if (fault_of(context) == Fault::filter_throws) throw 42;
    return true;
  }
};

class MisbehavingScorer final : public WorkerScorer {
 public:
  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<double> score(const WorkerSelectionContext& context,
                             const WorkerCandidate& candidate) override {
    switch (fault_of(context)) {
      case Fault::scorer_throws:
        throw std::runtime_error("the scorer's model file is gone");
      case Fault::scorer_nan:
        return std::numeric_limits<double>::quiet_NaN();
      case Fault::undeclared_group:
        return candidate.cache()->device_overlap_blocks();
      default:
        return static_cast<double>(candidate.load()->active_requests());
    }
  }
};

class MisbehavingPicker final : public WorkerPicker {
 public:
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override {
    const auto rows = view.candidates();
    if (fault_of(context) == Fault::picker_out_of_range) return rows.size();
    std::size_t best = 0;
    for (std::size_t row = 1; row < rows.size(); ++row) {
      if (rows[row].cost() < rows[best].cost()) best = row;
    }
    return best;
  }
};

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> misbehaving(
    const WorkerSelectionPolicyParameters& parameters) {
  if (auto finished = parameters.reader().finish(); !finished) {
    return std::unexpected(finished.error());
  }
  return [](const RouterConfig& config, WorkerType worker_type, const RoutingPartition&) {
    std::vector<std::unique_ptr<WorkerFilter>> filters;
    filters.push_back(std::make_unique<MisbehavingFilter>());
    std::vector<std::unique_ptr<WorkerScorer>> scorers;
    scorers.push_back(std::make_unique<MisbehavingScorer>());
    return WorkerSelectionPolicy(config, worker_type, std::move(filters), std::move(scorers),
                                 std::make_unique<MisbehavingPicker>());
  };
}

std::expected<void, kvr::plugins::RegistryError> register_misbehaving(
    kvr::plugins::RouterPluginRegistry& registry) {
  return registry.register_worker_selection("misbehaving", misbehaving);
}

}  // namespace

KVR_PLUGIN_CATALOG(register_misbehaving)
