// A real broker with three CPU workers: a kill, a hang and a stale weight slot injected into one
// worker while it holds generations in the middle of their tokens, and an operator draining one
// worker. Every client gets exactly its fault-free tokens without an error, the failed worker's
// sequences finish on the other two (the fault injection reports recovery by their first token
// there, as the metrics also show), and health never leaves SERVING.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include "support/broker_process.h"
#include "support/metrics_scrape.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using test::Generation;

// Records every status the broker's health service reports until it is destroyed.
class HealthWatch {
 public:
  explicit HealthWatch(std::shared_ptr<grpc::Channel> channel)
      : stub_(grpc::health::v1::Health::NewStub(channel)) {
    thread_ = std::thread([this] {
      grpc::health::v1::HealthCheckRequest req;
      auto reader = stub_->Watch(&ctx_, req);
      grpc::health::v1::HealthCheckResponse resp;
      while (reader->Read(&resp)) {
        std::lock_guard lock(mu_);
        seen_.push_back(resp.status());
      }
      (void)reader->Finish();
    });
  }
  ~HealthWatch() {
    ctx_.TryCancel();
    thread_.join();
  }
  // Every status reported was SERVING (and there was one).
  void expectServingThroughout() {
    std::lock_guard lock(mu_);
    ASSERT_FALSE(seen_.empty()) << "the health watch saw no status";
    for (auto s : seen_) EXPECT_EQ(s, grpc::health::v1::HealthCheckResponse::SERVING);
  }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  grpc::ClientContext ctx_;
  std::thread thread_;
  std::mutex mu_;
  std::vector<grpc::health::v1::HealthCheckResponse::ServingStatus> seen_;
};

class ThreeWorkersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    broker_ = std::make_unique<test::BrokerProcess>(
        test::fixtureDir("tiny-qwen2"),
        std::vector<std::string>{"--workers", "3", "--enable-fault-injection", "--step-timeout-ms",
                                 "300", "--step-timeout-per-token-us", "500", "--metrics-listen",
                                 "127.0.0.1:0"});
    ASSERT_TRUE(broker_->ok());
    admin_ = v1::Admin::NewStub(broker_->channel());
    // The broker serves once one worker is ready; these tests move sequences to the others.
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    std::string states;
    for (bool all_ready = false; !all_ready;) {
      states.clear();
      all_ready = true;
      for (const auto& w : workers()) {
        states += " " + w.name() + " " + w.state();
        all_ready &= w.state() == "ready";
      }
      ASSERT_TRUE(all_ready || std::chrono::steady_clock::now() < deadline)
          << "the three workers were not all ready within 60 s:" << states;
      if (!all_ready) std::this_thread::yield();
    }
    // Six long generations (the fixture's context allows 256 positions), greedy and seeded,
    // and their fault-free tokens.
    for (uint32_t i = 0; i < 6; ++i) {
      auto r = test::request({21, 22, 23 + i}, 250);
      r.set_ignore_eos(true);
      if (i % 2 == 1) {
        r.mutable_sampling()->set_temperature(0.8f);
        r.mutable_sampling()->set_seed(7 + i);
      }
      requests_.push_back(r);
      reference_.push_back(test::generate(*broker_->channel(), r));
      ASSERT_TRUE(reference_.back().status.ok());
    }
  }

  std::vector<v1::WorkerInfo> workers() {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse r;
    EXPECT_TRUE(admin_->ListWorkers(&ctx, {}, &r).ok());
    return {r.workers().begin(), r.workers().end()};
  }

  // A worker holding a generation, worker-1 if it does (placement spreads six concurrent
  // requests, but two arriving together may land on the same worker).
  size_t busyWorker() {
    const auto now = workers();
    if (now.size() > 1 && now[1].requests_running() > 0) return 1;
    for (size_t i = 0; i < now.size(); ++i)
      if (now[i].requests_running() > 0) return i;
    ADD_FAILURE() << "no worker holds a generation";
    return 1;
  }
  static std::string name(size_t i) { return "worker-" + std::to_string(i); }

  // Starts the six generations and returns once each has received tokens (all are mid-way).
  struct Streams {
    std::vector<std::future<Generation>> results;
  };
  Streams startMidGeneration() {
    Streams s;
    std::vector<std::promise<void>> started(requests_.size());
    std::vector<std::future<void>> first;
    for (auto& p : started) first.push_back(p.get_future());
    for (size_t i = 0; i < requests_.size(); ++i) {
      s.results.push_back(
          std::async(std::launch::async, [this, i, started = std::move(started[i])]() mutable {
            auto stub = v1::Generator::NewStub(broker_->channel());
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + 60s);
            auto reader = stub->Generate(&ctx, requests_[i]);
            Generation g;
            v1::GenerateResponse r;
            bool told = false;
            while (reader->Read(&r)) {
              g.tokens.insert(g.tokens.end(), r.token_ids().begin(), r.token_ids().end());
              if (!told) started.set_value();
              told = true;
            }
            if (!told) started.set_value();
            g.status = reader->Finish();
            return g;
          }));
    }
    for (auto& f : first) EXPECT_EQ(f.wait_for(60s), std::future_status::ready);
    return s;
  }
  void expectExact(Streams& s) {
    for (size_t i = 0; i < s.results.size(); ++i) {
      const Generation g = s.results[i].get();
      EXPECT_TRUE(g.status.ok()) << "request " << i << ": " << g.status.error_message();
      EXPECT_EQ(g.tokens, reference_[i].tokens) << "request " << i;
    }
  }

  void expectMovedOnFault(const std::string& fault, uint64_t random) {
    HealthWatch health(broker_->channel());
    Streams streams = startMidGeneration();
    const size_t w = busyWorker();
    const auto before = workers();
    ASSERT_EQ(before.size(), 3u);
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault(fault);
    req.set_random(random);
    req.set_worker(name(w));
    v1::InjectFaultResponse resp;
    ASSERT_TRUE(admin_->InjectFault(&ctx, req, &resp).ok());
    EXPECT_TRUE(resp.detected()) << fault;
    EXPECT_TRUE(resp.recovered()) << fault;
    EXPECT_EQ(resp.worker(), name(w));
    EXPECT_TRUE(resp.migrated()) << fault << ": recovery came from the restart, not from a move";
    EXPECT_GT(resp.recovery_ms(), 0.0);
    expectExact(streams);
    const auto after = workers();
    EXPECT_GT(after[w].migrated_sequences(), before[w].migrated_sequences());
    EXPECT_EQ(after[w].restarts(), before[w].restarts() + 1) << name(w) << " was not replaced";
    grpc::ClientContext stats_ctx;
    v1::Stats stats;
    ASSERT_TRUE(admin_->GetStats(&stats_ctx, {}, &stats).ok());
    EXPECT_GT(stats.migration_ms_p99(), 0.0) << "the move's time is reported";
    // The metrics say the same, and carry one sample per worker.
    const auto m = test::scrapeMetrics(broker_->metricsAddress());
    for (const char* w : {"worker-0", "worker-1", "worker-2"})
      EXPECT_EQ(m.count(std::string("bulkhead_kv_blocks{worker=\"") + w + "\"}"), 1u) << w;
    EXPECT_EQ(m.at("bulkhead_migrated_sequences_total"), double(stats.migrated_sequences()));
    EXPECT_GE(m.at("bulkhead_migration_seconds_count"), 1.0);
    health.expectServingThroughout();
  }

  std::unique_ptr<test::BrokerProcess> broker_;
  std::unique_ptr<v1::Admin::Stub> admin_;
  std::vector<v1::GenerateRequest> requests_;
  std::vector<Generation> reference_;
};

// Even `random`: the kill and the hang land in the middle of a step.
TEST_F(ThreeWorkersTest, AKilledWorkersGenerationsFinishOnTheOthers) {
  expectMovedOnFault("worker_kill", 2);
}

TEST_F(ThreeWorkersTest, AHungWorkersGenerationsFinishOnTheOthers) {
  expectMovedOnFault("worker_hang", 4);
}

TEST_F(ThreeWorkersTest, AStaleSlotWorkersGenerationsFinishOnTheOthers) {
  expectMovedOnFault("stale_slot", 5);
}

TEST_F(ThreeWorkersTest, DrainingOneWorkerLosesNothing) {
  HealthWatch health(broker_->channel());
  Streams streams = startMidGeneration();
  const size_t w = busyWorker();
  grpc::ClientContext ctx;
  v1::DrainRequest req;
  req.set_worker(name(w));
  v1::DrainResponse resp;
  const grpc::Status drained = admin_->Drain(&ctx, req, &resp);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  EXPECT_GT(resp.moved(), 0u);
  expectExact(streams);
  EXPECT_EQ(workers()[w].state(), "stopped");
  health.expectServingThroughout();

  grpc::ClientContext restart_ctx;
  v1::RestartWorkerRequest restart;
  restart.set_name(name(w));
  v1::RestartWorkerResponse restarted;
  ASSERT_TRUE(admin_->RestartWorker(&restart_ctx, restart, &restarted).ok());
  EXPECT_EQ(workers()[w].state(), "ready");
}

// The operator's tool: `bulkhead admin` lists the three workers, drains one while generations run
// (they finish on the others), shows it stopped, and restarts it.
TEST_F(ThreeWorkersTest, TheAdminToolDrainsAndRestartsOneWorker) {
  test::TempDir dir;
  auto admin = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"admin", "--server", broker_->address()});
    return test::runBinary(dir, "bulkhead", args);
  };
  auto listed = admin({"workers"});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  for (const char* name : {"worker-0", "worker-1", "worker-2"})
    EXPECT_NE(listed.out.find(name), std::string::npos) << listed.out;
  Streams streams = startMidGeneration();
  auto drained = admin({"drain", "--worker", "worker-1"});
  ASSERT_EQ(drained.exit_code, 0) << drained.err;
  EXPECT_NE(drained.out.find("worker-1 drained"), std::string::npos) << drained.out;
  expectExact(streams);
  EXPECT_EQ(workers()[1].state(), "stopped");
  auto stats = admin({"stats"});
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  EXPECT_NE(stats.out.find("\"migrated_sequences\""), std::string::npos) << stats.out;
  auto restarted = admin({"restart", "--worker", "worker-1"});
  ASSERT_EQ(restarted.exit_code, 0) << restarted.err;
  EXPECT_EQ(workers()[1].state(), "ready");
  auto unnamed = admin({"restart"});
  EXPECT_NE(unnamed.exit_code, 0) << "with several workers an operator names one";
  EXPECT_NE(unnamed.err.find("name one"), std::string::npos) << unnamed.err;
}

}  // namespace
}  // namespace bulkhead
