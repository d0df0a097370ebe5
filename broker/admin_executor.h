// AdminExecutor: runs the Admin RPCs that wait on the scheduler (drain, restart, fault injection)
// off gRPC's callback threads, on threads it owns and joins, so none of them can outlive the
// service and the scheduler they reference.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

#include "shared/status.h"

namespace bulkhead {

class AdminExecutor {
 public:
  // More tasks than this in flight at once are refused with RESOURCE_EXHAUSTED.
  static constexpr size_t kDefaultMaxInFlight = 16;

  explicit AdminExecutor(size_t max_in_flight = kDefaultMaxInFlight)
      : max_in_flight_(max_in_flight) {}
  ~AdminExecutor() { stop(); }
  AdminExecutor(const AdminExecutor&) = delete;
  AdminExecutor& operator=(const AdminExecutor&) = delete;

  // Starts `task` on a thread of its own. UNAVAILABLE "shutting down" once stop() has begun, and
  // RESOURCE_EXHAUSTED when too many are in flight; the task is not run then.
  Status submit(std::function<void()> task);

  // Refuses new tasks and joins every running one. The caller must first unblock what the tasks
  // wait on (Scheduler::stop()). Idempotent.
  void stop() noexcept;

  size_t inFlight() const;

 private:
  struct Task {
    std::thread thread;
    bool done = false;
  };
  // Joins the threads of finished tasks; with mu_ held.
  void reapFinished();

  const size_t max_in_flight_;
  mutable std::mutex mu_;
  bool stopping_ = false;
  // A list, so a task's entry stays put while its thread runs and can mark itself done.
  std::list<Task> tasks_;
};

}  // namespace bulkhead
