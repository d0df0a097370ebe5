// ServiceNotifier: the environment, and one datagram per state.
#include "shared/service_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace bulkhead {

ServiceNotifier ServiceNotifier::fromEnvironment() {
  ServiceNotifier n;
  if (const char* path = std::getenv("NOTIFY_SOCKET"); path != nullptr && *path) n.socket_ = path;
  const char* usec = std::getenv("WATCHDOG_USEC");
  const char* pid = std::getenv("WATCHDOG_PID");
  if (usec != nullptr && (pid == nullptr || std::atol(pid) == long(::getpid()))) {
    const long long us = std::atoll(usec);
    if (us > 0) n.watchdog_period_ = std::chrono::milliseconds(std::max(1LL, us / 2000));
  }
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  ::unsetenv("WATCHDOG_PID");
  return n;
}

void ServiceNotifier::notify(std::string_view state) const {
  if (socket_.empty()) return;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_.size() >= sizeof(addr.sun_path)) return;
  std::memcpy(addr.sun_path, socket_.data(), socket_.size());
  // '@' names a socket in the abstract namespace, whose address starts with a NUL byte.
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + socket_.size());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  [[maybe_unused]] ssize_t sent = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                                           reinterpret_cast<sockaddr*>(&addr), len);
  ::close(fd);
}

}  // namespace bulkhead
