// Claiming a path for a Unix socket a process is about to listen on: a socket a dead process left
// there is removed; anything else is refused, never followed or taken over (a symlink, another
// user's socket, a live socket, a file that is no socket).
#pragma once

#include <sys/un.h>

#include <string>

#include "shared/status.h"

namespace bulkhead {

// The address of a Unix socket at `path`; INVALID_ARGUMENT when the path does not fit.
Result<sockaddr_un> unixSocketAddress(const std::string& path);

// OK when nothing is at `path` (any stale socket of ours removed). FAILED_PRECONDITION for a
// symlink, a non-socket or another user's socket; ALREADY_EXISTS for a socket someone serves.
Status claimSocketPath(const std::string& path);

}  // namespace bulkhead
