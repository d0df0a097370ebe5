// FaultInjector: arming, detection and recovery timing of injected faults.
#include "broker/fault_injection.h"

#include <algorithm>

namespace bulkhead {
namespace {

double msBetween(FaultInjector::Clock::time_point a, FaultInjector::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

FaultSpec faultSpecFor(Fault fault, uint64_t r, const WorkerHello& hello,
                       std::chrono::milliseconds step_timeout) {
  FaultSpec spec{.fault = fault};
  switch (fault) {
    case Fault::kWeightBitflip:
      spec.byte_offset = r % std::max<uint64_t>(1, hello.weight_bytes);
      spec.bit = uint8_t((r >> 56) % 8);
      break;
    case Fault::kStaleSlot:
      spec.byte_offset = r;  // which weight role
      break;
    case Fault::kComputeFault:
      spec.byte_offset = r;  // which linear layer, row and output
      break;
    case Fault::kSlowStep:
      spec.delay_ms = uint32_t(step_timeout.count() * 3);
      break;
    case Fault::kWorkerKill:
    case Fault::kWorkerHang:
      spec.between_steps = (r & 1) != 0;  // half in the middle of a step, half after one
      break;
    default:
      spec.row = uint32_t(r % 64);
      break;
  }
  return spec;
}

std::vector<std::string_view> expectedDetections(Fault fault) {
  switch (fault) {
    case Fault::kWorkerKill:
      return {"worker exited"};
    case Fault::kWorkerHang:
    case Fault::kSlowStep:
      return {"timed out"};
    case Fault::kWeightBitflip:
      // In the step that reads it, or by the scrubber when no step reads that word.
      return {"(in-step weight reads)", "weight corruption"};
    case Fault::kLogitsCorrupt:
    case Fault::kTornWrite:
      return {"(payload checksum)"};
    case Fault::kLogitsNan:
      return {"(non-finite value)"};
    case Fault::kStaleIncarnation:
      return {"(incarnation id)"};
    case Fault::kStaleStep:
      return {"(step id)"};
    case Fault::kGarbageReply:
    case Fault::kTruncatedReply:
      return {"protocol violation"};
    case Fault::kStaleSlot:
      return {"(slot tag)"};
    case Fault::kComputeFault:
      return {"(arithmetic check)"};
  }
  return {};
}

bool detectedByItsOwnMechanism(Fault fault, std::string_view detected_as) {
  for (std::string_view m : expectedDetections(fault))
    if (detected_as.find(m) != std::string_view::npos) return true;
  return false;
}

Result<InjectionOutcome> FaultInjector::inject(Fault fault, uint64_t random,
                                               std::chrono::milliseconds timeout,
                                               const std::function<void()>& wake_scheduler) {
  auto injection = std::make_shared<Injection>();
  injection->fault = fault;
  injection->random = random;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return unavailable("the broker is shutting down");
    if (current_) return failedPrecondition("another injection is in progress");
    current_ = injection;
  }
  wake_scheduler();
  std::unique_lock lock(mu_);
  changed_.wait_for(lock, timeout, [&] {
    return stopping_ || injection->recovered_at != Clock::time_point{} ||
           !injection->refused.empty();
  });
  current_.reset();
  if (!injection->refused.empty()) return failedPrecondition(injection->refused);
  InjectionOutcome out;
  out.detected = injection->detected_at != Clock::time_point{};
  out.recovered = injection->recovered_at != Clock::time_point{};
  out.migrated = injection->migrated;
  out.detected_as = injection->detected_as;
  if (out.detected) out.detection_ms = msBetween(injection->at, injection->detected_at);
  if (out.recovered) out.recovery_ms = msBetween(injection->detected_at, injection->recovered_at);
  return out;
}

void FaultInjector::stop() {
  std::lock_guard lock(mu_);
  stopping_ = true;
  changed_.notify_all();
}

std::optional<std::pair<Fault, uint64_t>> FaultInjector::pending() {
  std::lock_guard lock(mu_);
  if (!current_ || current_->applied) return std::nullopt;
  return std::make_pair(current_->fault, current_->random);
}

void FaultInjector::arm(WorkerConnection& worker, std::chrono::milliseconds step_timeout) {
  std::shared_ptr<Injection> injection;
  {
    std::lock_guard lock(mu_);
    if (!current_ || current_->applied) return;
    injection = current_;
  }
  const FaultSpec spec =
      faultSpecFor(injection->fault, injection->random, worker.hello(), step_timeout);
  const WorkerFailure armed = worker.injectFault(spec, std::chrono::seconds(5));
  std::lock_guard lock(mu_);
  injection->applied = true;
  if (!armed.ok()) {
    injection->refused = "injection refused: " + armed.toString();
    changed_.notify_all();
    return;
  }
  injection->at = Clock::now();
}

void FaultInjector::failureSeen(const std::string& what) {
  std::lock_guard lock(mu_);
  if (current_ && current_->applied && current_->refused.empty() &&
      current_->detected_at == Clock::time_point{}) {
    current_->detected_at = Clock::now();
    current_->detected_as = what;
  }
}

void FaultInjector::stepCompleted() {
  std::lock_guard lock(mu_);
  if (current_ && current_->detected_at != Clock::time_point{} &&
      current_->recovered_at == Clock::time_point{}) {
    current_->recovered_at = Clock::now();
    changed_.notify_all();
  }
}

std::function<void()> FaultInjector::migrationCallback() {
  std::lock_guard lock(mu_);
  if (!current_ || current_->detected_at == Clock::time_point{} ||
      current_->recovered_at != Clock::time_point{})
    return {};
  return [this, injection = std::weak_ptr<Injection>(current_)] {
    std::lock_guard lock(mu_);
    auto live = injection.lock();
    if (!live || live != current_ || live->recovered_at != Clock::time_point{}) return;
    live->recovered_at = Clock::now();
    live->migrated = true;
    changed_.notify_all();
  };
}

}  // namespace bulkhead
