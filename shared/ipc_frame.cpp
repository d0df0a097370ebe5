// Deadline-bounded frame I/O over poll(2).
#include "shared/ipc_frame.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <immintrin.h>

#include <cerrno>
#include <cstring>

#include <capnp/serialize.h>

namespace bulkhead {
namespace {

int millisUntil(SteadyTime deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > 1'000'000 ? 1'000'000 : int(left.count()) + 1;
}

// Waits until `fd` is ready for `events`. Returns OK, DEADLINE_EXCEEDED, or ABORTED when
// extra_fd fired.
Status waitFor(int fd, short events, SteadyTime deadline, int extra_fd) {
  while (true) {
    pollfd fds[2] = {{fd, events, 0}, {extra_fd, POLLIN, 0}};
    const int n = ::poll(fds, extra_fd >= 0 ? 2 : 1, millisUntil(deadline));
    if (n < 0) {
      if (errno == EINTR) continue;
      return internalError(std::string("poll: ") + std::strerror(errno));
    }
    // Data the peer sent before it went away is still read: the socket wins over extra_fd.
    if (fds[0].revents != 0) return okStatus();
    if (extra_fd >= 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      return Status(Code::kAborted, "watched descriptor became ready");
    }
    if (n == 0 && std::chrono::steady_clock::now() >= deadline) {
      return Status(Code::kDeadlineExceeded, "timed out");
    }
  }
}

}  // namespace

SocketWatch watchAwake(int fd, SteadyTime until) {
  do {
    char byte;
    const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return SocketWatch::kReadable;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return SocketWatch::kClosed;
    for (int i = 0; i < 16; ++i) _mm_pause();
  } while (std::chrono::steady_clock::now() < until);
  return SocketWatch::kTimedOut;
}

Status makeNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0 ||
      ::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
    return internalError(std::string("fcntl: ") + std::strerror(errno));
  }
  return okStatus();
}

Status writeFrame(int fd, const void* payload, size_t bytes, SteadyTime deadline) {
  if (bytes > kMaxFrameBytes) {
    return invalidArgument("frame of " + std::to_string(bytes) + " bytes exceeds the limit of " +
                           std::to_string(kMaxFrameBytes));
  }
  uint32_t header[2] = {kFrameMagic, uint32_t(bytes)};
  iovec parts[2] = {{header, sizeof(header)}, {const_cast<void*>(payload), bytes}};
  size_t done = 0;
  const size_t total = sizeof(header) + bytes;
  while (done < total) {
    // Skip what is already sent across the two parts.
    iovec iov[2];
    int count = 0;
    size_t skip = done;
    for (const iovec& p : parts) {
      if (skip >= p.iov_len) {
        skip -= p.iov_len;
        continue;
      }
      iov[count++] = {static_cast<char*>(p.iov_base) + skip, p.iov_len - skip};
      skip = 0;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = size_t(count);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n > 0) {
      done += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      BULKHEAD_RETURN_IF_ERROR(waitFor(fd, POLLOUT, deadline, -1));
      continue;
    }
    return unavailable(std::string("connection lost while sending: ") + std::strerror(errno));
  }
  return okStatus();
}

Status writeMessage(int fd, capnp::MessageBuilder& message, SteadyTime deadline) {
  kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
  const auto bytes = flat.asBytes();
  return writeFrame(fd, bytes.begin(), bytes.size(), deadline);
}

FrameReadResult readFrame(int fd, std::vector<capnp::word>& words, SteadyTime deadline,
                          int extra_fd) {
  uint32_t header[2];
  auto readExactly = [&](void* dst, size_t len, bool at_boundary) -> FrameReadResult {
    size_t done = 0;
    while (done < len) {
      const ssize_t n = ::recv(fd, static_cast<char*>(dst) + done, len - done, 0);
      if (n > 0) {
        done += size_t(n);
        continue;
      }
      if (n == 0) {
        return {unavailable(done == 0 && at_boundary ? "connection closed"
                                                     : "connection closed mid-frame"),
                done == 0 && at_boundary};
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Status s = waitFor(fd, POLLIN, deadline, extra_fd);
        if (!s.ok()) return {s, false};
        continue;
      }
      return {unavailable(std::string("connection lost while receiving: ") + std::strerror(errno)),
              false};
    }
    return {okStatus(), false};
  };
  FrameReadResult r = readExactly(header, sizeof(header), true);
  if (!r.status.ok()) return r;
  if (header[0] != kFrameMagic) {
    return {invalidArgument("bad frame magic 0x" +
                            [&] {
                              char hex[16];
                              std::snprintf(hex, sizeof(hex), "%08x", header[0]);
                              return std::string(hex);
                            }()),
            false};
  }
  if (header[1] > kMaxFrameBytes || header[1] % sizeof(capnp::word) != 0 || header[1] == 0) {
    return {invalidArgument("bad frame length " + std::to_string(header[1])), false};
  }
  words.resize(header[1] / sizeof(capnp::word));
  return readExactly(words.data(), header[1], false);
}

}  // namespace bulkhead
