// What decode steps have cost, by their row count, as the broker observed them, and the choice it
// supports between one step at a time and two half steps in flight (the scheduler's pipelining).
// Whether halving a batch pays depends on the worker: a GPU reads its weights once a step whatever
// its rows, and a CPU backend's step at 64 rows on 16 cores took 8.2 ms against 5.1 ms at 32, so
// two halves cost 25% more compute; the overlap wins only when sampling hides more than that.
// Measured costs decide, not an assumption about the backend.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace bulkhead {

class StepCosts {
 public:
  // A decode step of `rows` rows (one token each): the worker's compute, the broker's round trip
  // beyond it, and the verification and sampling of its rows, in milliseconds.
  void record(uint32_t rows, double compute_ms, double trip_ms, double sample_ms);

  // For `rows` sequences due: whether two steps of half of them each (the larger half first), each
  // sampled while the worker computes the other, are expected to take less time than one step of
  // all of them followed by its sampling (an odd count's halves each at its own size's cost, once
  // both sizes were seen). nullopt until steps of both sizes have been seen, and
  // again once either was last seen kStale records ago (so that a choice is measured again, not
  // kept for good on what one size cost once). A size stands for its neighbours within an eighth
  // of it (sequences come and go between steps).
  std::optional<bool> halvesPay(uint32_t rows) const;
  // Whether steps of about `rows` rows have been seen within the last kStale records.
  bool knows(uint32_t rows) const { return near(rows) != nullptr; }

  // A size's cost is the least of its first kSettling steps (a GPU worker's first step of a size
  // also captures its graph, many times a usual step), then a moving average in which one step
  // counts for at most kClip times the average.
  static constexpr uint32_t kSettling = 3;
  static constexpr double kClip = 2.0;
  static constexpr uint64_t kStale = 64;

 private:
  struct Cost {
    double compute_ms = 0, trip_ms = 0, sample_ms = 0;
    uint32_t seen = 0;
    uint64_t at = 0;  // records_ when last recorded
  };
  // The size nearest `rows` seen within the last kStale records, within max(1, rows / 8); nullptr
  // if none.
  const Cost* near(uint32_t rows) const;
  std::vector<Cost> by_rows_;
  uint64_t records_ = 0;
};

}  // namespace bulkhead
