// StepCosts: a moving average per row count.
#include "broker/step_costs.h"

#include <algorithm>

namespace bulkhead {
namespace {
// Weight of the newest step in each average: recent enough to follow a host whose load changes,
// smooth enough that one slow step does not flip the choice.
constexpr double kNewest = 0.2;
}  // namespace

void StepCosts::record(uint32_t rows, double compute_ms, double trip_ms, double sample_ms) {
  if (rows == 0) return;
  if (by_rows_.size() <= rows) by_rows_.resize(rows + 1);
  Cost& c = by_rows_[rows];
  auto add = [&](double& average, double value) {
    if (c.seen == 0)
      average = value;
    else if (c.seen < kSettling)
      average = std::min(average, value);
    else
      average += kNewest * (std::min(value, kClip * average) - average);
  };
  add(c.compute_ms, compute_ms);
  add(c.trip_ms, trip_ms);
  add(c.sample_ms, sample_ms);
  ++c.seen;
  c.at = ++records_;
}

const StepCosts::Cost* StepCosts::near(uint32_t rows) const {
  auto seen = [&](uint32_t r) {
    return r < by_rows_.size() && by_rows_[r].seen > 0 && records_ - by_rows_[r].at < kStale;
  };
  const uint32_t tolerance = std::max(1u, rows / 8);
  for (uint32_t d = 0; d <= tolerance; ++d) {
    if (seen(rows + d)) return &by_rows_[rows + d];
    if (d <= rows && rows - d > 0 && seen(rows - d)) return &by_rows_[rows - d];
  }
  return nullptr;
}

std::optional<bool> StepCosts::halvesPay(uint32_t rows) const {
  if (rows < 2) return std::nullopt;
  const Cost* whole = near(rows);
  const Cost* large = near((rows + 1) / 2);
  if (whole == nullptr || large == nullptr) return std::nullopt;
  const Cost* small = rows % 2 == 0 ? large : near(rows / 2);
  if (small == nullptr) small = large;  // the larger half's cost for both, until it is seen
  // One at a time, the worker waits out each step's trip and sampling; in halves each half's
  // sampling runs while the worker computes the other, so the slower of the two sets the pace.
  const double one_at_a_time = whole->compute_ms + whole->trip_ms + whole->sample_ms;
  const double halves =
      std::max(large->compute_ms, small->sample_ms) + std::max(small->compute_ms, large->sample_ms);
  return halves < one_at_a_time;
}

}  // namespace bulkhead
