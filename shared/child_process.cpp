// ChildProcess: fork/exec with a readiness pipe and a pidfd.
#include "shared/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace bulkhead {

bool waitReadable(int fd, SteadyTime deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    const int n =
        ::poll(&p, 1, left.count() > 0 ? int(std::min<int64_t>(left.count(), 1 << 30)) + 1 : 0);
    if (n > 0) return true;
    if (n == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) return false;
  }
}

std::string ExitInfo::describe() const {
  if (signal != 0) return "signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "exit status " + std::to_string(exit_code);
}

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& args) {
  if (args.empty()) return invalidArgument("no program to spawn");
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0)
    return internalError(std::string("pipe: ") + std::strerror(errno));
  // Everything the child needs is prepared before fork: after it only exec-safe calls.
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(ready[0]);
    ::close(ready[1]);
    return internalError(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    // The copy does not inherit close-on-exec; the pipe may already be 3 (a parent whose
    // stdin, stdout or stderr is closed), and dup2 onto itself would keep the flag.
    if (ready[1] == 3)
      ::fcntl(3, F_SETFD, 0);
    else
      ::dup2(ready[1], 3);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(ready[1]);
  ChildProcess child;
  child.pid_ = pid;
  child.ready_fd_ = ready[0];
  child.pidfd_ = int(::syscall(SYS_pidfd_open, pid, 0));
  if (child.pidfd_ < 0) return internalError(std::string("pidfd_open: ") + std::strerror(errno));
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : pid_(std::exchange(o.pid_, -1)),
      pidfd_(std::exchange(o.pidfd_, -1)),
      ready_fd_(std::exchange(o.ready_fd_, -1)),
      reaped_(std::exchange(o.reaped_, false)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    reset();
    pid_ = std::exchange(o.pid_, -1);
    pidfd_ = std::exchange(o.pidfd_, -1);
    ready_fd_ = std::exchange(o.ready_fd_, -1);
    reaped_ = std::exchange(o.reaped_, false);
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  reset();
}

void ChildProcess::reset() {
  kill();
  if (pidfd_ >= 0) ::close(pidfd_);
  if (ready_fd_ >= 0) ::close(ready_fd_);
  pidfd_ = ready_fd_ = -1;
  pid_ = -1;
}

Result<std::string> ChildProcess::readReadyLine(SteadyTime deadline) {
  while (true) {
    if (const size_t nl = ready_buffer_.find('\n'); nl != std::string::npos) {
      std::string line = ready_buffer_.substr(0, nl);
      ready_buffer_.erase(0, nl + 1);
      return line;
    }
    if (ready_fd_ < 0) return unavailable("readiness pipe closed");
    if (!waitReadable(ready_fd_, deadline)) return Status(Code::kDeadlineExceeded, "not ready");
    char buf[256];
    const ssize_t n = ::read(ready_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(ready_fd_);
      ready_fd_ = -1;
      if (ready_buffer_.empty()) return unavailable("exited before it was ready");
      ready_buffer_ += '\n';
      continue;
    }
    ready_buffer_.append(buf, size_t(n));
  }
}

Result<std::string> ChildProcess::waitReady(SteadyTime deadline) {
  if (ready_fd_ < 0) return failedPrecondition("readiness already consumed");
  std::string message = std::move(ready_buffer_);
  while (true) {
    if (!waitReadable(ready_fd_, deadline)) {
      ready_buffer_ = std::move(message);  // kept for the next wait
      return Status(Code::kDeadlineExceeded, "not ready");
    }
    char buf[256];
    const ssize_t n = ::read(ready_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    message.append(buf, size_t(n));
  }
  ::close(ready_fd_);
  ready_fd_ = -1;
  if (message.empty()) return unavailable("exited before it was ready");
  return message;
}

bool ChildProcess::waitExit(SteadyTime deadline, ExitInfo* info) {
  if (!running()) return reaped_;
  if (!waitReadable(pidfd_, deadline)) return false;
  int status = 0;
  if (::waitpid(pid_, &status, 0) != pid_) return false;
  reaped_ = true;
  if (info != nullptr) {
    *info = ExitInfo{};
    if (WIFEXITED(status)) info->exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) info->signal = WTERMSIG(status);
  }
  return true;
}

void ChildProcess::signal(int sig) {
  if (running()) ::kill(pid_, sig);
}

void ChildProcess::kill() {
  if (!running()) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  reaped_ = true;
}

}  // namespace bulkhead
