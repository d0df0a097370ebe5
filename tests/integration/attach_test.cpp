// Attach mode: the broker connects to a worker it did not start (here the test plays systemd:
// it starts each worker on the socket path and starts the next one when the last has gone).
// A worker killed mid-generation is re-attached after its restart and every stream finishes
// identical to a fault-free run; a worker the broker replaces is killed by the broker, so it
// never serves again; with two attached workers, a killed one's streams finish on the other.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <functional>
#include <future>
#include <string>
#include <vector>

#include "shared/child_process.h"
#include "support/broker_process.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

// A worker as systemd would run it: on a fixed socket, listening once its ready byte arrives.
ChildProcess startWorker(const std::string& socket) {
  auto child = ChildProcess::spawn({test::binDir() + "/bulkhead-worker", "--model",
                                    test::fixtureDir("tiny-qwen2"), "--socket", socket, "--backend",
                                    "cpu", "--ready-fd", "3", "--log-level", "warn"});
  EXPECT_TRUE(child.ok()) << child.status().toString();
  if (!child.ok()) return {};
  EXPECT_TRUE(child->waitReady(std::chrono::steady_clock::now() + 60s).ok())
      << "worker did not listen";
  return std::move(*child);
}

v1::GenerateRequest seeded(uint32_t i) {
  v1::GenerateRequest r;
  for (uint32_t t : {11u, 12u, 13u + i}) r.add_prompt_token_ids(t);
  r.set_max_tokens(200);
  r.set_ignore_eos(true);
  r.mutable_sampling()->set_temperature(0.9f);
  r.mutable_sampling()->set_seed(7 + i);
  return r;
}

v1::Stats stats(grpc::Channel& channel) {
  auto admin = v1::Admin::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](auto*) {}));
  grpc::ClientContext ctx;
  v1::Stats s;
  EXPECT_TRUE(admin->GetStats(&ctx, {}, &s).ok());
  return s;
}

// Four seeded generations: a fault-free reference first, then the same four at once. `fault`
// runs once the first stream has a token (every stream is mid-generation), and each stream must
// then finish without an error, identical to its reference.
void expectIdenticalThroughFault(const std::shared_ptr<grpc::Channel>& channel,
                                 const std::function<void()>& fault) {
  std::vector<test::Generation> reference;
  for (uint32_t i = 0; i < 4; ++i) {
    reference.push_back(test::generate(*channel, seeded(i)));
    ASSERT_TRUE(reference.back().status.ok());
  }
  auto stub = v1::Generator::NewStub(channel);
  grpc::ClientContext first_ctx;
  auto first_stream = stub->Generate(&first_ctx, seeded(0));
  std::vector<std::future<test::Generation>> others;
  for (uint32_t i = 1; i < 4; ++i)
    others.push_back(
        std::async(std::launch::async, [&, i] { return test::generate(*channel, seeded(i)); }));
  v1::GenerateResponse response;
  ASSERT_TRUE(first_stream->Read(&response));
  std::vector<uint32_t> tokens(response.token_ids().begin(), response.token_ids().end());
  fault();
  while (first_stream->Read(&response))
    tokens.insert(tokens.end(), response.token_ids().begin(), response.token_ids().end());
  ASSERT_TRUE(first_stream->Finish().ok());
  EXPECT_EQ(tokens, reference[0].tokens);
  for (uint32_t i = 1; i < 4; ++i) {
    const test::Generation g = others[i - 1].get();
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, reference[i].tokens) << "request " << i;
  }
}

TEST(AttachModeTest, AKilledWorkerIsReattachedAfterItsRestartAndStreamsFinishIdentically) {
  test::TempDir dir;
  const std::string socket = dir.file("worker.sock");
  ChildProcess first = startWorker(socket);
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--workers-from", socket});
  ASSERT_TRUE(broker.ok());
  // The worker dies once the first stream has a token: SIGKILL, reaped; systemd would now start
  // the next one.
  ChildProcess second;
  expectIdenticalThroughFault(broker.channel(), [&] {
    first.kill();
    second = startWorker(socket);
  });
  if (HasFatalFailure()) return;
  const v1::Stats s = stats(*broker.channel());
  EXPECT_EQ(s.worker_restarts(), 1u);
  EXPECT_GE(s.replayed_sequences(), 1u) << "nothing was replayed";
  EXPECT_EQ(test::workerInfo(*broker.channel()).pid(), second.pid());
}

TEST(AttachModeTest, AWorkerTheBrokerReplacesIsKilledAndTheNextOneServes) {
  test::TempDir dir;
  const std::string socket = dir.file("worker.sock");
  ChildProcess first = startWorker(socket);
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--workers-from", socket});
  ASSERT_TRUE(broker.ok());
  const uint64_t before = test::workerInfo(*broker.channel()).incarnation();
  auto restart = std::async(std::launch::async, [&] {
    auto admin = v1::Admin::NewStub(broker.channel());
    grpc::ClientContext ctx;
    v1::RestartWorkerResponse r;
    return std::make_pair(admin->RestartWorker(&ctx, {}, &r), r);
  });
  ExitInfo exit;
  ASSERT_TRUE(first.waitExit(std::chrono::steady_clock::now() + 30s, &exit))
      << "the broker left the replaced worker running";
  EXPECT_EQ(exit.signal, SIGKILL) << exit.describe();
  ChildProcess second = startWorker(socket);
  const auto [status, response] = restart.get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.old_incarnation(), before);
  EXPECT_NE(response.new_incarnation(), before);
  EXPECT_TRUE(test::generate(*broker.channel(), seeded(0)).status.ok());
}

// Two attached workers, one socket each: a worker killed mid-generation has its streams finish on
// the other while systemd has not started its successor yet; the successor is attached after.
TEST(AttachModeTest, TwoWorkersOneKilledItsStreamsFinishOnTheOtherBeforeItReturns) {
  test::TempDir dir;
  const std::string sockets[] = {dir.file("worker-0.sock"), dir.file("worker-1.sock")};
  ChildProcess w0 = startWorker(sockets[0]);
  ChildProcess w1 = startWorker(sockets[1]);
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--workers-from", sockets[0], "--workers-from", sockets[1]});
  ASSERT_TRUE(broker.ok());
  // Four streams at once, two on each worker; worker-0 dies once the first stream has a token.
  expectIdenticalThroughFault(broker.channel(), [&] { w0.kill(); });
  if (HasFatalFailure()) return;
  // Every stream ended before worker-0's successor existed: they finished on worker-1.
  const v1::Stats s = stats(*broker.channel());
  EXPECT_GE(s.migrated_sequences(), 1u);
  ChildProcess successor = startWorker(sockets[0]);
  auto admin = v1::Admin::NewStub(broker.channel());
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  v1::ListWorkersResponse workers;
  do {
    grpc::ClientContext ctx;
    workers.Clear();
    ASSERT_TRUE(admin->ListWorkers(&ctx, {}, &workers).ok());
  } while (
      !(workers.workers(0).state() == "ready" && workers.workers(0).pid() == successor.pid()) &&
      std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(workers.workers(0).pid(), successor.pid()) << "the successor was not attached";
  EXPECT_EQ(workers.workers(1).pid(), w1.pid());
}

}  // namespace
}  // namespace bulkhead
