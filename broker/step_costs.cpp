// StepCosts: a moving average per row count.
#include "broker/step_costs.h"

#include <algorithm>

namespace bulkhead {
namespace {
// Weight of the newest step in each average: recent enough to follow a host whose load changes,
// smooth enough that one slow step does not flip the choice.
constexpr double kNewest = 0.2;

// The entry nearest `rows` for which `usable` holds, within max(1, rows / 8) of it.
template <typename Entry, typename Usable>
const Entry* nearest(const std::vector<Entry>& by_rows, uint32_t rows, Usable usable) {
  auto at = [&](uint32_t r) { return r < by_rows.size() && usable(by_rows[r]); };
  const uint32_t tolerance = std::max(1u, rows / 8);
  for (uint32_t d = 0; d <= tolerance; ++d) {
    if (at(rows + d)) return &by_rows[rows + d];
    if (d <= rows && rows - d > 0 && at(rows - d)) return &by_rows[rows - d];
  }
  return nullptr;
}
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
  return nearest(by_rows_, rows,
                 [&](const Cost& c) { return c.seen > 0 && records_ - c.at < kStale; });
}

void StepCosts::recordPace(uint32_t running, bool halves, double ms_per_row) {
  std::vector<Pace>& paces = paces_[halves];
  // Stale as nearPace has it, before this record counts.
  const Pace* kept = nearest(paces, running, [&](const Pace& p) {
    return p.seen > 0 && pace_records_ - p.at < kPaceStale;
  });
  ++pace_records_;
  if (running == 0) return;
  if (kept == nullptr && paces.size() <= running) paces.resize(running + 1);
  Pace& p = kept != nullptr ? paces[size_t(kept - paces.data())] : paces[running];
  if (kept == nullptr) p = Pace{};    // new, or stale: measured again from scratch
  if (p.seen == kPaceWindow) return;  // complete: it stands until it is stale
  p.window[p.seen++] = ms_per_row;
  p.at = pace_records_;
  if (p.seen < kPaceWindow) return;
  double sorted[kPaceWindow];
  std::copy(std::begin(p.window), std::end(p.window), sorted);
  std::sort(std::begin(sorted), std::end(sorted));
  p.ms_per_row = (sorted[kPaceWindow / 2 - 1] + sorted[kPaceWindow / 2]) / 2;
}

const StepCosts::Pace* StepCosts::nearPace(uint32_t running, bool halves) const {
  return nearest(paces_[halves], running, [&](const Pace& p) {
    return p.seen == kPaceWindow && pace_records_ - p.at < kPaceStale;
  });
}

bool StepCosts::knowsPace(uint32_t running, bool halves) const {
  return nearPace(running, halves) != nullptr;
}

std::optional<bool> StepCosts::fasterPace(uint32_t running) const {
  const Pace* whole = nearPace(running, false);
  const Pace* halves = nearPace(running, true);
  if (whole == nullptr || halves == nullptr) return std::nullopt;
  return halves->ms_per_row < whole->ms_per_row;
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
