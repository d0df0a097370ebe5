// Fault-injection bookkeeping for operators and `bulkhead chaos`: an RPC thread asks for a fault
// and waits; the scheduler thread arms it on the current worker, then reports the first failure
// it sees (detection) and the first completed step after it (recovery). Kept apart from the
// scheduling code, which only calls the narrow hooks below.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "broker/worker_connection.h"
#include "shared/fault.h"
#include "shared/status.h"

namespace bulkhead {

struct InjectionOutcome {
  bool detected = false, recovered = false;
  double detection_ms = 0, recovery_ms = 0;
  std::string detected_as;
  bool disarmed = false;  // not detected in time, so the worker was replaced to disarm it
  // Service recovered by moving the failed worker's sequences to the others (recovery_ms then
  // runs to their first token there), not by the worker's replacement.
  bool migrated = false;
  std::string worker;  // the worker it was injected into
};

// The concrete fault for a class: `random` picks the row, the weight byte and bit. A slow step is
// made slower than the step deadline so that supervision must notice it.
FaultSpec faultSpecFor(Fault fault, uint64_t random, const WorkerHello& hello,
                       std::chrono::milliseconds step_timeout);

// The mechanism that must catch each class, as the detection reads ("(slot tag)", "timed out",
// ...): a fault caught by another mechanism was found by luck, or credited to the wrong fault.
std::vector<std::string_view> expectedDetections(Fault fault);
bool detectedByItsOwnMechanism(Fault fault, std::string_view detected_as);

class FaultInjector {
 public:
  using Clock = std::chrono::steady_clock;

  // RPC side: waits until the fault was detected and service recovered, or `timeout`.
  // FAILED_PRECONDITION when another injection is in progress or the worker refused it.
  Result<InjectionOutcome> inject(Fault fault, uint64_t random, std::chrono::milliseconds timeout,
                                  const std::function<void()>& wake_scheduler);
  // Ends every wait (the broker is stopping).
  void stop();

  // Scheduler side. The fault to arm on the current worker, if one waits.
  std::optional<std::pair<Fault, uint64_t>> pending();
  // Arms the pending fault on `worker`.
  void arm(WorkerConnection& worker, std::chrono::milliseconds step_timeout);
  void failureSeen(const std::string& what);
  void stepCompleted();
  // For the sequences of a worker the detected fault lost, as they move to other workers: called
  // when the first of them has its first token released there, it marks the injection recovered
  // (the injection's, not a later one's). Null when no detected injection awaits recovery.
  std::function<void()> migrationCallback();

 private:
  struct Injection {
    Fault fault;
    uint64_t random;
    bool applied = false;
    std::string refused;  // why the worker refused it
    Clock::time_point at, detected_at, recovered_at;
    bool migrated = false;  // recovered_at is a moved sequence's first token
    std::string detected_as;
  };
  std::mutex mu_;
  std::condition_variable changed_;
  std::shared_ptr<Injection> current_;
  bool stopping_ = false;
};

}  // namespace bulkhead
