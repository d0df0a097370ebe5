// ChildProcess: the child's readiness pipe is its fd 3 whatever descriptors the parent has open.
#include "shared/child_process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

namespace bulkhead {
namespace {

SteadyTime soon() {
  return std::chrono::steady_clock::now() + std::chrono::seconds(30);
}

// With the parent's stdin closed, the pipe's write end is itself descriptor 3, where the child
// wants it; it must still survive the exec (it was left close-on-exec, so the child's fd 3 was
// gone and its readiness never came).
// Closes stdin for its lifetime (the parent's end of the pipe may then be descriptor 0).
class StdinClosed {
 public:
  StdinClosed() : saved_(::fcntl(0, F_DUPFD_CLOEXEC, 10)) { ::close(0); }
  ~StdinClosed() {
    ::dup2(saved_, 0);
    ::close(saved_);
  }
  StdinClosed(const StdinClosed&) = delete;
  StdinClosed& operator=(const StdinClosed&) = delete;

 private:
  int saved_;
};

void expectReady(ChildProcess& child) {
  auto ready = child.waitReady(soon());
  ASSERT_TRUE(ready.ok()) << ready.status().toString();
  EXPECT_EQ(*ready, "ready");
  ExitInfo exit;
  ASSERT_TRUE(child.waitExit(soon(), &exit));
  EXPECT_EQ(exit.exit_code, 0) << exit.describe();
}

// With the parent's stdin closed, the pipe's write end is itself descriptor 3, where the child
// wants it; it must still survive the exec (it was left close-on-exec, so the child's fd 3 was
// gone and its readiness never came).
TEST(ChildProcess, ReadinessReachesTheParentWhenItsStdinIsClosed) {
  const std::vector<std::string> args = {"/bin/sh", "-c", "printf ready >&3"};
  {
    SCOPED_TRACE("stdin open");
    auto child = ChildProcess::spawn(args);
    ASSERT_TRUE(child.ok()) << child.status().toString();
    expectReady(*child);
  }
  SCOPED_TRACE("stdin closed");
  StdinClosed closed;
  auto child = ChildProcess::spawn(args);
  ASSERT_TRUE(child.ok()) << child.status().toString();
  expectReady(*child);
}

}  // namespace
}  // namespace bulkhead
