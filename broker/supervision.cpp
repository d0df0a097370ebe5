// Supervision state changes (see broker/supervision.h).
#include "broker/supervision.h"

#include <algorithm>

namespace bulkhead {

std::string_view workerStateName(WorkerState state) {
  switch (state) {
    case WorkerState::kStarting:
      return "starting";
    case WorkerState::kReady:
      return "ready";
    case WorkerState::kFailed:
      return "failed";
    case WorkerState::kStopped:
      return "stopped";
  }
  return "?";
}

void Supervision::onStarting() {
  proven_ = false;
  if (state_ != WorkerState::kFailed && state_ != WorkerState::kStopped)
    state_ = WorkerState::kStarting;
}

void Supervision::onReady() {
  if (state_ != WorkerState::kStopped) state_ = WorkerState::kReady;
}

void Supervision::onStepCompleted() {
  proven_ = true;
  consecutive_failures_ = 0;
}

bool Supervision::onFailure(Clock::time_point now) {
  if (state_ == WorkerState::kStopped) return false;
  // A worker that had completed a step starts a new count; failures of workers that never did
  // accumulate.
  consecutive_failures_ = proven_ ? 1 : consecutive_failures_ + 1;
  proven_ = false;
  const uint32_t doublings = std::min<uint32_t>(consecutive_failures_ - 1, 16);
  const auto backoff = std::min(options_.backoff_max, options_.backoff_initial * (1u << doublings));
  next_start_at_ = consecutive_failures_ > 1 ? now + backoff : now;
  if (consecutive_failures_ >= options_.max_consecutive_failures) {
    const bool newly = state_ != WorkerState::kFailed;
    state_ = WorkerState::kFailed;
    return newly;
  }
  if (state_ != WorkerState::kFailed) state_ = WorkerState::kStarting;
  return false;
}

void Supervision::onOperatorRestart(Clock::time_point now) {
  if (state_ == WorkerState::kStopped) return;
  consecutive_failures_ = 0;
  proven_ = false;
  next_start_at_ = now;
  if (state_ != WorkerState::kFailed) state_ = WorkerState::kStarting;
}

}  // namespace bulkhead
