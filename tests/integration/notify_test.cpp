// systemd's readiness protocol, as a real worker and a real broker speak it to a datagram socket
// named by NOTIFY_SOCKET: READY=1 only once the worker listens with its model loaded (the broker:
// once a worker passed its canary), WATCHDOG=1 from the worker's serving loop, STOPPING=1 on
// SIGTERM; and the broker's workers never report as the broker's service.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "shared/child_process.h"
#include "support/broker_process.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

// A datagram socket bound at `path`, standing in for systemd's.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~NotifySocket() { ::close(fd_); }
  // The next datagram, or "" when none comes by `deadline`.
  std::string next(std::chrono::steady_clock::time_point deadline) {
    if (!waitReadable(fd_, deadline)) return "";
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, size_t(n)) : "";
  }
  // Datagrams until one contains `want` or `deadline` passes; all of them, in order.
  std::vector<std::string> until(const std::string& want,
                                 std::chrono::steady_clock::time_point deadline) {
    std::vector<std::string> got;
    while (true) {
      std::string m = next(deadline);
      if (m.empty()) return got;
      got.push_back(m);
      if (m.find(want) != std::string::npos) return got;
    }
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Spawns with NOTIFY_SOCKET and WATCHDOG_USEC in the environment (for this child alone).
Result<ChildProcess> spawnNotifying(const std::vector<std::string>& args, const std::string& socket,
                                    const std::string& watchdog_usec) {
  ::setenv("NOTIFY_SOCKET", socket.c_str(), 1);
  ::setenv("WATCHDOG_USEC", watchdog_usec.c_str(), 1);
  auto child = ChildProcess::spawn(args);
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  return child;
}

bool canConnect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

bool contains(const std::vector<std::string>& messages, const std::string& want) {
  for (const auto& m : messages)
    if (m.find(want) != std::string::npos) return true;
  return false;
}

TEST(ServiceNotify, WorkerIsReadyWhenItListensPingsItsWatchdogAndSaysStopping) {
  test::TempDir dir;
  NotifySocket notify(dir.file("notify"));
  const std::string socket = dir.file("worker.sock");
  auto worker = spawnNotifying(
      {test::binDir() + "/bulkhead-worker", "--model", test::fixtureDir("tiny-qwen2"), "--socket",
       socket, "--backend", "cpu", "--log-level", "warn"},
      notify.path(), "200000");
  ASSERT_TRUE(worker.ok()) << worker.status().toString();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const auto before = notify.until("READY=1", deadline);
  ASSERT_TRUE(contains(before, "READY=1")) << "no READY=1";
  EXPECT_FALSE(contains(before, "WATCHDOG=1")) << "a watchdog ping before READY=1";
  EXPECT_TRUE(canConnect(socket)) << "READY=1 before the worker listens";
  // Idle, the serving loop still pings (twice the period: 100 ms).
  for (int i = 0; i < 2; ++i)
    ASSERT_TRUE(contains(notify.until("WATCHDOG=1", deadline), "WATCHDOG=1")) << "ping " << i;
  worker->signal(SIGTERM);
  EXPECT_TRUE(contains(notify.until("STOPPING=1", deadline), "STOPPING=1"));
  ExitInfo exit;
  ASSERT_TRUE(worker->waitExit(deadline, &exit));
  EXPECT_EQ(exit.exit_code, 0) << exit.describe();
}

TEST(ServiceNotify, BrokerIsReadyOnceServingAndItsWorkersDoNotReportAsIt) {
  test::TempDir dir;
  NotifySocket notify(dir.file("notify"));
  auto broker =
      spawnNotifying({test::binDir() + "/bulkhead-broker", "--model",
                      test::fixtureDir("tiny-qwen2"), "--listen", "127.0.0.1:0", "--backend", "cpu",
                      "--ready-fd", "3", "--state-dir", dir.path(), "--log-level", "warn"},
                     notify.path(), "200000");
  ASSERT_TRUE(broker.ok()) << broker.status().toString();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  ASSERT_TRUE(broker->readReadyLine(deadline).ok());  // listening
  auto serving = broker->readReadyLine(deadline);
  ASSERT_TRUE(serving.ok() && *serving == "serving");
  const auto messages = notify.until("READY=1", deadline);
  ASSERT_TRUE(contains(messages, "READY=1"));
  EXPECT_TRUE(contains(messages, "STATUS=serving on 127.0.0.1:"));
  broker->signal(SIGTERM);
  const auto rest = notify.until("STOPPING=1", deadline);
  EXPECT_TRUE(contains(rest, "STOPPING=1"));
  // The worker was started with the broker's environment: had it kept NOTIFY_SOCKET, its READY=1
  // and its watchdog pings (every 100 ms) would be here too.
  for (const auto& m : messages) EXPECT_EQ(m.find("WATCHDOG"), std::string::npos) << m;
  for (const auto& m : rest) EXPECT_EQ(m.find("WATCHDOG"), std::string::npos) << m;
  ExitInfo exit;
  ASSERT_TRUE(broker->waitExit(deadline, &exit));
  EXPECT_EQ(exit.exit_code, 0) << exit.describe();
}

}  // namespace
}  // namespace bulkhead
