// A child process we spawn and supervise (RAII): exec with a readiness pipe on fd 3, a pidfd to
// observe its exit without SIGCHLD games, and SIGKILL + reap on destruction. The child gets
// PR_SET_PDEATHSIG so it never outlives its parent.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "shared/ipc_frame.h"
#include "shared/status.h"

namespace bulkhead {

struct ExitInfo {
  int exit_code = -1;            // when it exited normally
  int signal = 0;                // when a signal ended it
  std::string describe() const;  // "exit status 1" / "signal 9 (Killed)"
};

class ChildProcess {
 public:
  // Starts argv[0] with `args`; the child's fd 3 is the write end of a readiness pipe.
  static Result<ChildProcess> spawn(const std::vector<std::string>& args);

  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Readable once the process has exited (for poll sets).
  int exitFd() const { return pidfd_; }
  bool running() const { return pid_ > 0 && !reaped_; }

  // What the child wrote on fd 3 before closing it (its readiness message). UNAVAILABLE if it
  // closed the pipe empty or died first; DEADLINE_EXCEEDED if neither happened in time.
  Result<std::string> waitReady(SteadyTime deadline);
  // One line of the readiness pipe (without the newline), for children that report in stages.
  Result<std::string> readReadyLine(SteadyTime deadline);
  // Reaps the child if it exits by `deadline`; true then, with `info` filled.
  bool waitExit(SteadyTime deadline, ExitInfo* info);
  void signal(int sig);
  // SIGKILL and reap.
  void kill();

 private:
  void reset();

  pid_t pid_ = -1;
  int pidfd_ = -1;
  int ready_fd_ = -1;
  bool reaped_ = false;
  std::string ready_buffer_;  // read from the pipe but not yet returned
};

// Waits for `fd` to become readable until `deadline`; true if it did.
bool waitReadable(int fd, SteadyTime deadline);

}  // namespace bulkhead
