// systemd's readiness protocol, as a real worker and a real broker speak it to a datagram socket
// named by NOTIFY_SOCKET: READY=1 only once the worker listens with its model loaded (the broker:
// once a worker passed its canary), WATCHDOG=1 from the worker's serving loop, STOPPING=1 on
// SIGTERM; and the broker's workers never report as the broker's service.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
    const int on = 1;  // each datagram's sender, as systemd learns it
    EXPECT_EQ(::setsockopt(fd_, SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)), 0);
  }
  ~NotifySocket() { ::close(fd_); }
  // The next datagram, or "" when none comes by `deadline`; `sender` gets the sending process.
  std::string next(std::chrono::steady_clock::time_point deadline, pid_t* sender = nullptr) {
    if (!waitReadable(fd_, deadline)) return "";
    char buf[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
    iovec iov{buf, sizeof(buf)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(fd_, &msg, 0);
    if (n <= 0) return "";
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr && sender != nullptr;
         c = CMSG_NXTHDR(&msg, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS)
        *sender = reinterpret_cast<const ucred*>(CMSG_DATA(c))->pid;
    return std::string(buf, size_t(n));
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

// With a canary record (from `bulkhead qualify`), a worker runs the canary after loading: READY=1
// when its digest matches; an exit with no READY=1 at all when it does not.
TEST(ServiceNotify, WorkerWithACanaryRecordIsReadyOnlyWhenItsCanaryPasses) {
  test::TempDir dir;
  const std::string record = dir.file("canary.json");
  auto qualified = test::runBinary(
      dir, "bulkhead",
      {"qualify", "--model", test::fixtureDir("tiny-qwen2"), "--backend", "cpu", "--out", record});
  ASSERT_EQ(qualified.exit_code, 0) << qualified.err;
  std::string text = test::readFile(record);
  const size_t at = text.find("\"logits_digest\": \"") + 18;
  ASSERT_GT(at, 18u) << text;
  std::string wrong = text;
  wrong[at] = wrong[at] == '0' ? '1' : '0';
  test::writeFile(dir.file("wrong.json"), wrong);
  for (const bool matches : {true, false}) {
    SCOPED_TRACE(matches ? "the record's digest" : "another digest");
    NotifySocket notify(dir.file(matches ? "notify-good" : "notify-bad"));
    const std::string socket = dir.file(matches ? "good.sock" : "bad.sock");
    auto worker = spawnNotifying(
        {test::binDir() + "/bulkhead-worker", "--model", test::fixtureDir("tiny-qwen2"), "--socket",
         socket, "--backend", "cpu", "--log-level", "warn", "--canary-record",
         matches ? record : dir.file("wrong.json")},
        notify.path(), "0");
    ASSERT_TRUE(worker.ok()) << worker.status().toString();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    if (matches) {
      ASSERT_TRUE(contains(notify.until("READY=1", deadline), "READY=1"));
      worker->signal(SIGTERM);
    }
    ExitInfo exit;
    ASSERT_TRUE(worker->waitExit(deadline, &exit));
    EXPECT_EQ(exit.exit_code, matches ? 0 : 1) << exit.describe();
    if (!matches) {
      EXPECT_FALSE(contains(notify.until("READY=1", std::chrono::steady_clock::now()), "READY=1"))
          << "READY=1 from a worker whose canary failed";
    }
  }
}

// The broker pings its watchdog from its scheduling loop, also while a slow worker loads (here a
// script that waits 2 s before it runs the worker), and only the broker does: every WATCHDOG=1
// comes from the broker's own process.
TEST(ServiceNotify, BrokerPingsItsWatchdogWhileAWorkerLoadsAndWhileIdle) {
  test::TempDir dir;
  NotifySocket notify(dir.file("notify"));
  test::writeFile(dir.file("slow-worker"),
                  "#!/bin/sh\nsleep 2\nexec '" + test::binDir() + "/bulkhead-worker\' \"$@\"\n");
  ASSERT_EQ(::chmod(dir.file("slow-worker").c_str(), 0755), 0);
  auto broker = spawnNotifying(
      {test::binDir() + "/bulkhead-broker", "--model", test::fixtureDir("tiny-qwen2"), "--listen",
       "127.0.0.1:0", "--backend", "cpu", "--worker", dir.file("slow-worker"), "--state-dir",
       dir.path(), "--log-level", "warn"},
      notify.path(), "400000");  // pings due every 200 ms
  ASSERT_TRUE(broker.ok()) << broker.status().toString();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int before_ready = 0, after_ready = 0;
  bool ready = false;
  while (after_ready < 3) {
    pid_t sender = 0;
    const std::string m = notify.next(deadline, &sender);
    ASSERT_FALSE(m.empty()) << "the broker went quiet (" << before_ready << " pings before READY, "
                            << after_ready << " after)";
    if (m.find("READY=1") != std::string::npos) ready = true;
    if (m.find("WATCHDOG=1") == std::string::npos) continue;
    EXPECT_EQ(sender, broker->pid()) << "a WATCHDOG=1 from another process";
    ++(ready ? after_ready : before_ready);
  }
  // The 2 s the worker took to start were covered by pings every 200 ms (not every one is due
  // to the millisecond: at least 5).
  EXPECT_GE(before_ready, 5);
  broker->signal(SIGTERM);
  ExitInfo exit;
  ASSERT_TRUE(broker->waitExit(deadline, &exit));
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
  // would be here twice. (Every WATCHDOG=1 is the broker's own: the test above.)
  int readies = 0;
  for (const auto& m : messages) readies += m.find("READY=1") != std::string::npos;
  for (const auto& m : rest) readies += m.find("READY=1") != std::string::npos;
  EXPECT_EQ(readies, 1);
  ExitInfo exit;
  ASSERT_TRUE(broker->waitExit(deadline, &exit));
  EXPECT_EQ(exit.exit_code, 0) << exit.describe();
}

}  // namespace
}  // namespace bulkhead
