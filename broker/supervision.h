// Worker supervision as an explicit state machine: what state the worker slot is in, how many
// workers in a row failed before completing a step, and when the next start may be tried
// (exponential backoff). Plain state and time in, decisions out: the scheduler acts on them.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

namespace bulkhead {

enum class WorkerState {
  kStarting,  // no worker serves yet; one is being started (or will be, after the backoff)
  kReady,     // a worker passed its canary and takes traffic
  kFailed,    // a crash loop: requests get UNAVAILABLE until a start succeeds
  kStopped,   // the broker is shutting down
};
std::string_view workerStateName(WorkerState state);

struct SupervisionOptions {
  // Failures in a row (failed starts, or workers that fail before completing a step) that mark
  // the slot failed.
  uint32_t max_consecutive_failures = 5;
  std::chrono::milliseconds backoff_initial{50};
  std::chrono::milliseconds backoff_max{5'000};
};

class Supervision {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Supervision(SupervisionOptions options) : options_(options) {}

  WorkerState state() const { return state_; }
  uint32_t consecutiveFailures() const { return consecutive_failures_; }
  Clock::time_point nextStartAt() const { return next_start_at_; }
  bool mayStart(Clock::time_point now) const {
    return state_ != WorkerState::kStopped && now >= next_start_at_;
  }

  // A start is under way (a failed slot stays failed until one succeeds).
  void onStarting();
  // The new worker passed its canary.
  void onReady();
  // The current worker completed a step: it has proven itself, the failure count resets.
  void onStepCompleted();
  // The current worker failed, or a start failed. Returns true when this failure is the one that
  // marks the slot failed (a crash loop).
  bool onFailure(Clock::time_point now);
  // An operator asked for a restart: not a failure; the next start may happen at once.
  void onOperatorRestart(Clock::time_point now);
  void onStopped() { state_ = WorkerState::kStopped; }
  // A stopped slot (an operator drained its worker) is put back into service: it starts at once.
  void onResumed(Clock::time_point now) {
    state_ = WorkerState::kStarting;
    consecutive_failures_ = 0;
    proven_ = false;
    next_start_at_ = now;
  }

 private:
  SupervisionOptions options_;
  WorkerState state_ = WorkerState::kStarting;
  uint32_t consecutive_failures_ = 0;
  bool proven_ = false;  // the current worker completed a step
  Clock::time_point next_start_at_{};
};

}  // namespace bulkhead
