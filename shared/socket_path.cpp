// claimSocketPath: lstat (never following a link), then a connect probe on our own socket.
#include "shared/socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

namespace bulkhead {

Result<sockaddr_un> unixSocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path))
    return invalidArgument("socket path " + path + " is longer than " +
                           std::to_string(sizeof(addr.sun_path) - 1) + " bytes");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

Status claimSocketPath(const std::string& path) {
  BULKHEAD_ASSIGN_OR_RETURN(sockaddr_un addr, unixSocketAddress(path));
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return okStatus();
  if (!S_ISSOCK(st.st_mode)) return failedPrecondition(path + " exists and is not a socket");
  // Another user's socket is never probed, removed or taken over.
  if (st.st_uid != ::geteuid())
    return failedPrecondition(path + " exists and belongs to user " + std::to_string(st.st_uid));
  const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool alive =
      probe >= 0 && ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (probe >= 0) ::close(probe);
  if (alive) return Status(Code::kAlreadyExists, path + " is served by a running process");
  if (::unlink(path.c_str()) != 0)
    return failedPrecondition(path + ": cannot remove a stale socket: " + std::strerror(errno));
  return okStatus();
}

}  // namespace bulkhead
