// bulkhead-worker against a hostile or broken peer on its socket: garbage, truncated and
// oversized messages get an Error reply (or, when the framing itself is broken, an Error and a
// dropped connection) and the worker keeps serving. Also: exclusive sockets, stale socket and
// arena collection.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <filesystem>
#include <random>

#include <boost/interprocess/shared_memory_object.hpp>

#include "proto/worker.capnp.h"
#include "shared/child_process.h"
#include "shared/ipc_frame.h"
#include "shared/logits_arena.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

SteadyTime soon() {
  return std::chrono::steady_clock::now() + 10s;
}

class WorkerProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override { socket_ = dir_.file("w.sock"); }

  Result<ChildProcess> startWorker(const std::string& socket,
                                   const std::vector<std::string>& more = {}) {
    std::vector<std::string> args = {test::binDir() + "/bulkhead-worker",
                                     "--model",
                                     test::fixtureDir("tiny-qwen2"),
                                     "--socket",
                                     socket,
                                     "--backend",
                                     "cpu",
                                     "--kv-blocks",
                                     "64",
                                     "--ready-fd",
                                     "3",
                                     "--log-level",
                                     "error"};
    args.insert(args.end(), more.begin(), more.end());
    return ChildProcess::spawn(args);
  }

  void start() {
    auto child = startWorker(socket_);
    ASSERT_TRUE(child.ok()) << child.status().toString();
    worker_ = std::move(*child);
    ASSERT_TRUE(worker_.waitReady(soon()).ok());
  }

  // Connects and consumes the Hello.
  int connectAndGreet() {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_TRUE(makeNonBlocking(fd).ok());
    auto reply = readReply(fd);
    EXPECT_EQ(reply, "hello");
    return fd;
  }

  // Reads one reply and names its kind ("error: ..." includes the message).
  std::string readReply(int fd) {
    std::vector<capnp::word> words;
    FrameReadResult r = readFrame(fd, words, soon());
    if (!r.status.ok()) return "no reply: " + r.status.toString();
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(words.data(), words.size()));
    auto m = reader.getRoot<wire::FromWorker>();
    switch (m.which()) {
      case wire::FromWorker::HELLO:
        return "hello";
      case wire::FromWorker::PONG:
        return "pong";
      case wire::FromWorker::ERROR:
        return std::string("error: ") + m.getError().getMessage().cStr();
      default:
        return "other";
    }
  }

  void sendPing(int fd) {
    capnp::MallocMessageBuilder message;
    auto req = message.initRoot<wire::ToWorker>();
    req.setRequestId(77);
    req.setPing();
    ASSERT_TRUE(writeMessage(fd, message, soon()).ok());
  }

  void expectAlive(int fd) {
    sendPing(fd);
    EXPECT_EQ(readReply(fd), "pong");
  }

  bool closedByPeer(int fd) {
    std::vector<capnp::word> words;
    FrameReadResult r = readFrame(fd, words, soon());
    return r.status.code() == Code::kUnavailable;
  }

  test::TempDir dir_;
  std::string socket_;
  ChildProcess worker_;
};

// A peer that stops in the middle of a frame is dropped once the frame's wait is over, and the
// worker serves the next connection.
TEST_F(WorkerProtocolTest, APeerStoppingMidFrameIsDroppedAndTheNextServed) {
  auto child = startWorker(socket_, {"--frame-wait-ms", "200"});
  ASSERT_TRUE(child.ok()) << child.status().toString();
  worker_ = std::move(*child);
  ASSERT_TRUE(worker_.waitReady(soon()).ok());
  int fd = connectAndGreet();
  const uint32_t first_word = kFrameMagic;  // a frame header's first half, and nothing more
  ASSERT_EQ(::send(fd, &first_word, sizeof(first_word), MSG_NOSIGNAL), ssize_t(sizeof(first_word)));
  EXPECT_TRUE(closedByPeer(fd)) << "the worker still waits for the rest of the frame";
  ::close(fd);
  int next = connectAndGreet();
  expectAlive(next);
  ::close(next);
}

TEST_F(WorkerProtocolTest, GarbagePayloadsGetErrorsAndTheConnectionSurvives) {
  start();
  int fd = connectAndGreet();
  std::mt19937 rng(9);
  for (int i = 0; i < 200; ++i) {
    std::vector<uint64_t> junk(1 + rng() % 64);
    for (auto& w : junk) w = (uint64_t(rng()) << 32) | rng();
    ASSERT_TRUE(writeFrame(fd, junk.data(), junk.size() * 8, soon()).ok());
    const std::string reply = readReply(fd);
    // Random bytes are occasionally a valid (if meaningless) message; never a crash.
    ASSERT_TRUE(reply.rfind("error: ", 0) == 0 || reply == "pong" || reply == "other")
        << "iteration " << i << ": " << reply;
  }
  expectAlive(fd);
  ::close(fd);
}

TEST_F(WorkerProtocolTest, TruncatedMessageGetsAnError) {
  start();
  int fd = connectAndGreet();
  capnp::MallocMessageBuilder message;
  auto req = message.initRoot<wire::ToWorker>();
  req.setRequestId(5);
  auto step = req.initStep();
  step.setStepId(1);
  auto seq = step.initSequences(1)[0];
  auto tokens = seq.initTokens(64);
  for (unsigned i = 0; i < 64; ++i) tokens.set(i, i);
  seq.initKvBlocks(4);
  kj::Array<capnp::word> flat = capnp::messageToFlatArray(message);
  ASSERT_TRUE(writeFrame(fd, flat.begin(), (flat.size() / 2) * 8, soon()).ok());
  const std::string reply = readReply(fd);
  EXPECT_EQ(reply.rfind("error: malformed message", 0), 0u) << reply;
  expectAlive(fd);
  ::close(fd);
}

TEST_F(WorkerProtocolTest, BrokenFramingDropsTheConnectionButNotTheWorker) {
  start();
  struct Bad {
    const char* what;
    std::vector<uint32_t> words;
  };
  const std::vector<Bad> cases = {
      {"bad magic", {0xdeadbeef, 8, 0, 0}},
      {"oversized", {kFrameMagic, kMaxFrameBytes + 8}},
      {"unaligned length", {kFrameMagic, 13, 0, 0, 0, 0}},
  };
  for (const Bad& bad : cases) {
    int fd = connectAndGreet();
    ASSERT_EQ(::send(fd, bad.words.data(), bad.words.size() * 4, MSG_NOSIGNAL),
              ssize_t(bad.words.size() * 4));
    const std::string reply = readReply(fd);
    EXPECT_EQ(reply.rfind("error: bad frame", 0), 0u) << bad.what << ": " << reply;
    EXPECT_TRUE(closedByPeer(fd)) << bad.what;
    ::close(fd);
  }
  // A peer that vanishes mid-frame.
  int fd = connectAndGreet();
  const uint32_t half[3] = {kFrameMagic, 64, 0};
  ASSERT_EQ(::send(fd, half, sizeof(half), MSG_NOSIGNAL), ssize_t(sizeof(half)));
  ::close(fd);
  fd = connectAndGreet();
  expectAlive(fd);
  ::close(fd);
}

TEST_F(WorkerProtocolTest, SocketIsOwnerOnlyAndExclusive) {
  start();
  struct stat st {};
  ASSERT_EQ(::stat(socket_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0077, 0u) << "socket is accessible to others";
  auto second = startWorker(socket_);
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->waitReady(soon()).ok());
  ExitInfo info;
  ASSERT_TRUE(second->waitExit(soon(), &info));
  EXPECT_EQ(info.exit_code, 1);
  int fd = connectAndGreet();  // the first worker is untouched
  expectAlive(fd);
  ::close(fd);
}

TEST_F(WorkerProtocolTest, StaleSocketAndArenaAreCollectedAtStart) {
  // A socket file nobody listens on.
  {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_.c_str(), sizeof(addr.sun_path) - 1);
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::close(fd);
  }
  // An arena left by a process that no longer exists.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(dead, nullptr, 0), dead);
  const std::string stale = LogitsArena::arenaName(dead, 42);
  {
    auto arena = LogitsArena::create(stale, 42, 1, 16);
    ASSERT_TRUE(arena.ok());
    (*arena)->unlink();  // so the destructor does not remove it...
  }
  {
    // ...and recreate it, ownerless, as a crashed worker would leave it.
    boost::interprocess::shared_memory_object shm(boost::interprocess::create_only, stale.c_str(),
                                                  boost::interprocess::read_write);
    shm.truncate(4096);
  }
  ASSERT_TRUE(std::filesystem::exists("/dev/shm/" + stale));
  start();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + stale));
  int fd = connectAndGreet();
  expectAlive(fd);
  ::close(fd);
}

// systemd's watchdog is pinged from the serving loop. Under steady load the next request is
// already waiting when a reply goes out, and the worker watching its socket awake after a reply
// (--spin-us) used to return to it without ever pinging: a busy, healthy worker was killed by its
// service manager after WatchdogSec.
TEST_F(WorkerProtocolTest, AWorkerKeptBusyStillPingsItsWatchdog) {
  const std::string notify_path = dir_.file("notify");
  const int notify = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  notify_path.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(notify, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // A ping every 100 ms is due; after each reply the worker watches 50 ms awake for the next.
  ::setenv("NOTIFY_SOCKET", notify_path.c_str(), 1);
  ::setenv("WATCHDOG_USEC", "200000", 1);
  auto child = startWorker(socket_, {"--spin-us", "50000"});
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  ASSERT_TRUE(child.ok()) << child.status().toString();
  worker_ = std::move(*child);
  ASSERT_TRUE(worker_.waitReady(soon()).ok());
  const int fd = connectAndGreet();
  auto pings = [&] {  // the WATCHDOG=1 datagrams received since the last call
    int count = 0;
    char buf[512];
    for (ssize_t n; (n = ::recv(notify, buf, sizeof(buf), 0)) > 0;)
      count += std::string(buf, size_t(n)).find("WATCHDOG=1") != std::string::npos;
    return count;
  };
  pings();
  // One request after another for 1.5 s: each arrives while the worker still watches awake. (The
  // datagrams are taken as they come: a full queue would block the worker's next ping.)
  int requests = 0, busy_pings = 0;
  const auto end = std::chrono::steady_clock::now() + 1500ms;
  while (std::chrono::steady_clock::now() < end) {
    expectAlive(fd);
    ++requests;
    busy_pings += pings();
  }
  EXPECT_GE(busy_pings, 5) << "over 1.5 s of back-to-back requests (" << requests
                           << "), with a ping due every 100 ms";
  ::close(fd);
  ::close(notify);
}

TEST_F(WorkerProtocolTest, SigtermIsACleanShutdown) {
  start();
  const std::string arena_glob = "bulkhead-arena-" + std::to_string(worker_.pid()) + "-";
  auto arenaExists = [&] {
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(arena_glob, 0) == 0) return true;
    return false;
  };
  ASSERT_TRUE(arenaExists());
  worker_.signal(SIGTERM);
  ExitInfo info;
  ASSERT_TRUE(worker_.waitExit(soon(), &info));
  EXPECT_EQ(info.exit_code, 0) << info.describe();
  EXPECT_FALSE(std::filesystem::exists(socket_));
  EXPECT_FALSE(arenaExists());
}

}  // namespace
}  // namespace bulkhead
