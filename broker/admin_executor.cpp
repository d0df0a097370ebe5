// AdminExecutor: one thread per in-flight admin task, joined when the next task arrives or on
// stop(). A fixed pool would let a ten-minute Drain hold up a RestartWorker or InjectFault queued
// behind it; admin RPCs are rare and capped in number, so a thread each is cheap and never starves.
#include "broker/admin_executor.h"

#include <exception>
#include <system_error>

#include <spdlog/spdlog.h>

namespace bulkhead {

Status AdminExecutor::submit(std::function<void()> task) {
  std::lock_guard lock(mu_);
  if (stopping_) return unavailable("shutting down");
  reapFinished();
  if (tasks_.size() >= max_in_flight_)
    return resourceExhausted("too many admin operations in flight (" +
                             std::to_string(max_in_flight_) + ")");
  Task& entry = tasks_.emplace_back();
  try {
    entry.thread = std::thread([this, &entry, task = std::move(task)] {
      // Exceptions do not cross a thread: one escaping a task would terminate the broker anyway,
      // so say which.
      try {
        task();
      } catch (const std::exception& e) {
        spdlog::critical("admin task threw: {}", e.what());
        std::terminate();
      }
      std::lock_guard done_lock(mu_);
      entry.done = true;
    });
  } catch (const std::system_error& e) {
    tasks_.pop_back();
    return resourceExhausted(std::string("cannot start a thread for an admin operation: ") +
                             e.what());
  }
  return okStatus();
}

void AdminExecutor::reapFinished() {
  for (auto it = tasks_.begin(); it != tasks_.end();) {
    if (it->done) {
      // Done is set as the task's last step: the join waits at most for its return.
      it->thread.join();
      it = tasks_.erase(it);
    } else {
      ++it;
    }
  }
}

void AdminExecutor::stop() noexcept {
  std::list<Task> running;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    // Entries move between lists without being copied, so the tasks' references stay valid.
    running.splice(running.end(), tasks_);
  }
  for (Task& t : running)
    if (t.thread.joinable()) t.thread.join();
}

size_t AdminExecutor::inFlight() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const Task& t : tasks_) n += t.done ? 0 : 1;
  return n;
}

}  // namespace bulkhead
