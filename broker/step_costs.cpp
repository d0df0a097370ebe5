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
  if (running == 0) return;
  std::vector<Pace>& paces = paces_[halves];
  // Into the nearest pace still being kept within max(1, running / 8), so that a count that moves
  // by a sequence or two between steps still settles one pace.
  const Pace* kept = nearest(paces, running, [&](const Pace& p) {
    return p.seen > 0 && pace_records_ - p.at < kPaceStale;
  });
  if (kept == nullptr && paces.size() <= running) paces.resize(running + 1);
  Pace& p = kept != nullptr ? paces[size_t(kept - paces.data())] : paces[running];
  if (kept == nullptr) p = Pace{};  // new, or stale: measured again from scratch
  if (p.seen < kPaceSettling)
    p.ms_per_row += (ms_per_row - p.ms_per_row) / double(p.seen + 1);
  else
    p.ms_per_row += kNewest * (std::min(ms_per_row, kClip * p.ms_per_row) - p.ms_per_row);
  ++p.seen;
  p.at = ++pace_records_;
}

const StepCosts::Pace* StepCosts::nearPace(uint32_t running, bool halves) const {
  return nearest(paces_[halves], running, [&](const Pace& p) {
    return p.seen >= kPaceSettling && pace_records_ - p.at < kPaceStale;
  });
}

bool StepCosts::knowsPace(uint32_t running, bool halves) const {
  return nearPace(running, halves) != nullptr;
}

std::optional<bool> StepCosts::fasterPace(uint32_t running, bool halves_now) const {
  const Pace* now = nearPace(running, halves_now);
  const Pace* other = nearPace(running, !halves_now);
  if (now == nullptr || other == nullptr) return std::nullopt;
  return other->ms_per_row < now->ms_per_row * (1.0 - kPaceMargin) ? !halves_now : halves_now;
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
