// Framing for the broker-worker socket: [magic u32][length u32][payload], little-endian. Reads
// and writes are bounded by a deadline and never block past it, so a peer that stops mid-message
// (hung, killed, or hostile) cannot wedge the other side. Sockets are non-blocking.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <capnp/message.h>

#include "shared/status.h"

namespace bulkhead {

using SteadyTime = std::chrono::steady_clock::time_point;

// A steady-clock time as nanoseconds of the host's monotonic clock, which every process on the
// host shares: how the worker's step timeline crosses the socket.
inline int64_t monotonicNanos(SteadyTime t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

constexpr uint32_t kFrameMagic = 0x314b4842;  // "BHK1"
constexpr uint32_t kMaxFrameBytes = 64u << 20;

// Sends one frame. DEADLINE_EXCEEDED if the peer does not drain in time, UNAVAILABLE if the
// connection is gone.
Status writeFrame(int fd, const void* payload, size_t bytes, SteadyTime deadline);
// Serialises a Cap'n Proto message into one frame.
Status writeMessage(int fd, capnp::MessageBuilder& message, SteadyTime deadline);

// Receives one frame into `words` (8-byte aligned, as Cap'n Proto needs). Errors:
// DEADLINE_EXCEEDED (nothing complete by the deadline), UNAVAILABLE (peer closed; `clean` says
// whether it closed between frames), INVALID_ARGUMENT (bad magic or length: the stream cannot be
// resynchronised and must be dropped). `extra_fd`, when >= 0, is watched too: if it becomes
// readable the read stops with ABORTED (a child's pidfd, say).
struct FrameReadResult {
  Status status;
  bool clean_close = false;
};
FrameReadResult readFrame(int fd, std::vector<capnp::word>& words, SteadyTime deadline,
                          int extra_fd = -1);

// Watches `fd` for input without sleeping, at least once and until `until`: a thread that sleeps
// in poll(2) and is woken on another core costs tens of microseconds, a spinning one costs a core.
// kReadable: a byte waits; kClosed: the peer closed or the socket failed (the read that follows
// says which); kTimedOut: nothing came.
enum class SocketWatch { kReadable, kClosed, kTimedOut };
SocketWatch watchAwake(int fd, SteadyTime until);

// Sets O_NONBLOCK and FD_CLOEXEC.
Status makeNonBlocking(int fd);

}  // namespace bulkhead
