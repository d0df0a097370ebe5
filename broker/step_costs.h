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

  // The pace a mode kept at about `running` sequences: the wall time from one step's reply to the
  // next's (both steps sent in that mode), per row of the later step. Unlike the costs above it
  // counts what the modes do to each other: beside a CPU worker, the worker's compute and the
  // broker's sampling share the host's cores, so a half step's cost measured while the other half
  // is sampled is not the cost the model above assumes. A mode's pace at a count is the median of
  // kPaceWindow paces in a row, recorded at counts within an eighth of the first (sequences come
  // and go between steps); once complete it stands as it is, and kPaceStale pace records after its
  // last it is stale, and measured again from scratch.
  void recordPace(uint32_t running, bool halves, double ms_per_row);
  // Whether `halves` (or one at a time) has a complete pace at about `running` that is not stale.
  bool knowsPace(uint32_t running, bool halves) const;
  // Once both modes' paces are known at about `running`: true for halves, false for one at a time,
  // whichever is faster.
  std::optional<bool> fasterPace(uint32_t running) const;
  static constexpr uint32_t kPaceWindow = 16;
  static constexpr uint64_t kPaceStale = 512;

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

  struct Pace {
    double window[kPaceWindow] = {};
    uint32_t seen = 0;      // paces in the window
    double ms_per_row = 0;  // the window's median, once it is complete
    uint64_t at = 0;        // pace_records_ when the last was recorded
  };
  // The complete pace (see knowsPace) nearest `running`, within max(1, running / 8); nullptr if
  // none.
  const Pace* nearPace(uint32_t running, bool halves) const;
  std::vector<Pace> paces_[2];  // [halves] by running count
  uint64_t pace_records_ = 0;
};

}  // namespace bulkhead
