// Supervision end to end through gRPC: every fault class injected for real while a generation
// runs, detected, recovered from, and invisible in the output; a crash loop that reaches
// UNAVAILABLE and recovers; a canary mismatch caught before any client traffic reaches the worker.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <future>

#include "broker/generator_service.h"
#include "support/broker_process.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using test::generate;
using test::request;

v1::GenerateRequest longRequest(bool seeded) {
  auto r = request({17, 33, 65, 129, 257, 3, 4}, 200);
  r.set_ignore_eos(true);
  if (seeded) {
    r.mutable_sampling()->set_temperature(0.9f);
    r.mutable_sampling()->set_seed(2024);
    r.mutable_sampling()->set_top_p(0.95f);
  }
  return r;
}

class FaultClassTest : public ::testing::TestWithParam<Fault> {
 protected:
  static void SetUpTestSuite() {
    broker_ = new test::BrokerProcess(test::fixtureDir("tiny-qwen2"),
                                      {"--enable-fault-injection", "--step-timeout-ms", "300",
                                       "--step-timeout-per-token-us", "500"});
  }
  static void TearDownTestSuite() {
    delete broker_;
    broker_ = nullptr;
  }
  static inline test::BrokerProcess* broker_ = nullptr;
};

TEST_P(FaultClassTest, IsDetectedRecoveredAndInvisibleToClients) {
  ASSERT_TRUE(broker_ && broker_->ok());
  const Fault fault = GetParam();
  std::vector<test::Generation> reference;
  for (bool seeded : {false, true}) {
    reference.push_back(generate(*broker_->channel(), longRequest(seeded)));
    ASSERT_TRUE(reference.back().status.ok());
  }
  // Inject while generations keep the worker stepping; the injection returns once the fault was
  // detected and service recovered.
  auto admin = v1::Admin::NewStub(broker_->channel());
  auto injected = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault(std::string(faultName(fault)));
    req.set_random(0x9e3779b97f4a7c15ull * (uint64_t(fault) + 1));
    req.set_timeout_ms(20'000);
    v1::InjectFaultResponse resp;
    grpc::Status s = admin->InjectFault(&ctx, req, &resp);
    return std::make_pair(s, resp);
  });
  int rounds = 0;
  while (injected.wait_for(0s) != std::future_status::ready && rounds < 200) {
    std::vector<std::future<test::Generation>> running;
    for (bool seeded : {false, true}) {
      running.push_back(std::async(std::launch::async, [seeded] {
        return generate(*broker_->channel(), longRequest(seeded));
      }));
    }
    for (size_t i = 0; i < running.size(); ++i) {
      test::Generation g = running[i].get();
      ASSERT_TRUE(g.status.ok()) << faultName(fault) << ": " << g.status.error_message();
      EXPECT_EQ(g.tokens, reference[i].tokens) << faultName(fault) << " changed an output";
    }
    ++rounds;
  }
  auto [status, outcome] = injected.get();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(outcome.detected()) << faultName(fault) << " was not detected";
  EXPECT_TRUE(outcome.recovered()) << faultName(fault) << " was not recovered from";
  // Each class is caught by its own mechanism (the weight faults each by their own in-step
  // check), never by another one by luck.
  const std::string as = outcome.detected_as();
  EXPECT_TRUE(detectedByItsOwnMechanism(fault, as))
      << faultName(fault) << " was detected as \"" << as
      << "\", expected one of: " << expectedDetections(fault)[0];
  RecordProperty("detected_as", as);
  RecordProperty("detection_ms", std::to_string(outcome.detection_ms()));
}

// An injection that times out undetected leaves nothing armed behind: the next fault is caught as
// itself, not as the one still waiting in the worker.
TEST(FaultInjection, AFaultStillArmedAfterItsTimeoutIsNotCreditedToTheNext) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--enable-fault-injection"});
  ASSERT_TRUE(broker.ok());
  auto admin = v1::Admin::NewStub(broker.channel());
  auto inject = [&](Fault fault, uint32_t timeout_ms, bool keep_armed = false) {
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault(std::string(faultName(fault)));
    req.set_random(3);
    req.set_timeout_ms(timeout_ms);
    req.set_keep_armed(keep_armed);
    v1::InjectFaultResponse resp;
    grpc::Status s = admin->InjectFault(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  };
  // No traffic: a faulty multiply waits in the backend for the next step that computes, and none
  // comes in time. Left armed, it would fire in the next injection's first step, be caught by the
  // arithmetic check and be credited to that injection.
  const v1::InjectFaultResponse idle = inject(Fault::kComputeFault, 300);
  EXPECT_FALSE(idle.detected());
  EXPECT_TRUE(idle.disarmed());
  // Now with traffic: a stale step id, caught as itself.
  auto injected = std::async(std::launch::async, [&] { return inject(Fault::kStaleStep, 20'000); });
  int rounds = 0;
  while (injected.wait_for(0s) != std::future_status::ready && rounds++ < 200)
    ASSERT_TRUE(generate(*broker.channel(), longRequest(false)).status.ok());
  const v1::InjectFaultResponse next = injected.get();
  EXPECT_TRUE(next.detected());
  EXPECT_NE(next.detected_as().find("(step id)"), std::string::npos) << next.detected_as();
}

INSTANTIATE_TEST_SUITE_P(Classes, FaultClassTest,
                         ::testing::ValuesIn(allFaults().begin(), allFaults().end()),
                         [](const ::testing::TestParamInfo<Fault>& info) {
                           return std::string(faultName(info.param));
                         });

// The failure this project exists for: a second generation in the same worker, after lm_head
// began to be served from a stale slot while every resident byte stayed intact. The first step
// that reads it fails its own weight check, no row of it is sampled, the worker is replaced, and
// the generation is the same as without the fault.
TEST(OriginFailure, StaleLmHeadBetweenTwoGenerationsIsCaughtInTheStepThatReadsIt) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--enable-fault-injection"});
  ASSERT_TRUE(broker.ok());
  const test::Golden golden = test::loadGolden(test::fixtureDir("tiny-qwen2"));
  const test::GoldenCase& c = golden.cases[0];
  const auto r = request(c.prompt, uint32_t(c.greedy.size()));
  const test::Generation first = generate(*broker.channel(), r);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_EQ(first.tokens, c.greedy);

  // Role 1 is lm_head. With no traffic the fault is armed and waits for the next step; the call
  // returns when its short timeout passes, undetected so far, and the fault stays armed.
  auto admin = v1::Admin::NewStub(broker.channel());
  {
    grpc::ClientContext ctx;
    v1::InjectFaultRequest req;
    req.set_fault("stale_slot");
    req.set_random(1);
    req.set_timeout_ms(500);
    req.set_keep_armed(true);
    v1::InjectFaultResponse resp;
    ASSERT_TRUE(admin->InjectFault(&ctx, req, &resp).ok());
    EXPECT_FALSE(resp.detected()) << "detected before any step read the stale slot";
  }
  const test::Generation second = generate(*broker.channel(), r);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.tokens, c.greedy) << "the stale lm_head reached a client";

  grpc::ClientContext stats_ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&stats_ctx, {}, &stats).ok());
  EXPECT_GE(stats.integrity_failures(), 1u);
  EXPECT_EQ(stats.worker_restarts(), 1u) << "the stale slot persists: the worker is replaced";
  const v1::WorkerInfo info = test::workerInfo(*broker.channel());
  EXPECT_NE(info.last_failure().find("(slot tag)"), std::string::npos) << info.last_failure();
  EXPECT_NE(info.last_failure().find("lm_head"), std::string::npos) << info.last_failure();
  EXPECT_NE(info.last_failure().find("bound to memory that is no resident slot"), std::string::npos)
      << info.last_failure();
}

TEST(FaultInjection, RefusedUnlessEnabled) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(broker.ok());
  auto admin = v1::Admin::NewStub(broker.channel());
  grpc::ClientContext ctx;
  v1::InjectFaultRequest req;
  req.set_fault("worker_kill");
  v1::InjectFaultResponse resp;
  grpc::Status s = admin->InjectFault(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("--enable-fault-injection"), std::string::npos);
}

std::string writeScript(const test::TempDir& dir, const std::string& name,
                        const std::string& body) {
  const std::string path = dir.file(name);
  test::writeFile(path, "#!/bin/sh\n" + body + "\n");
  ::chmod(path.c_str(), 0700);
  return path;
}

grpc::health::v1::HealthCheckResponse::ServingStatus health(grpc::Channel& channel) {
  auto stub =
      grpc::health::v1::Health::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](auto*) {}));
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, {}, &resp).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return resp.status();
}

// Follows the health service's Watch stream until `want` (bounded).
bool watchUntil(grpc::Channel& channel, grpc::health::v1::HealthCheckResponse::ServingStatus want,
                std::chrono::seconds limit) {
  auto stub =
      grpc::health::v1::Health::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](auto*) {}));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + limit);
  auto reader = stub->Watch(&ctx, {});
  grpc::health::v1::HealthCheckResponse resp;
  while (reader->Read(&resp)) {
    if (resp.status() == want) {
      ctx.TryCancel();
      return true;
    }
  }
  return false;
}

TEST(CrashLoop, ReachesUnavailableAndRecoversWhenAStartSucceeds) {
  test::TempDir dir;
  const std::string marker = dir.file("broken");
  test::writeFile(marker, "");
  // A worker that dies at once while the marker exists, then behaves.
  const std::string worker = writeScript(
      dir, "worker.sh",
      "[ -e '" + marker + "' ] && exit 3\nexec '" + test::binDir() + "/bulkhead-worker' \"$@\"");
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--worker", worker},
                             /*wait_serving=*/false);
  ASSERT_TRUE(broker.ok());
  // Five failed starts in a row mark the worker failed (backoff 50, 100, 200, 400 ms).
  auto admin = v1::Admin::NewStub(broker.channel());
  const v1::WorkerInfo info = test::waitForWorker(
      *broker.channel(), [](const v1::WorkerInfo& w) { return w.state() == "failed"; }, 30s);
  ASSERT_EQ(info.state(), "failed");
  EXPECT_NE(info.last_failure().find("status 3"), std::string::npos) << info.last_failure();
  EXPECT_EQ(health(*broker.channel()), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  test::Generation refused = generate(*broker.channel(), request({1, 2, 3}, 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("no healthy worker"), std::string::npos);

  std::filesystem::remove(marker);
  ASSERT_TRUE(watchUntil(*broker.channel(), grpc::health::v1::HealthCheckResponse::SERVING, 30s));
  test::Generation served = generate(*broker.channel(), request({1, 2, 3}, 4));
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
}

TEST(Heartbeat, AWorkerThatHangsWhileIdleIsReplacedWithoutTraffic) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--heartbeat-ms", "100", "--step-timeout-ms", "300"});
  ASSERT_TRUE(broker.ok());
  const v1::WorkerInfo before = test::workerInfo(*broker.channel());
  ASSERT_GT(before.pid(), 0);
  ASSERT_EQ(::kill(before.pid(), SIGSTOP), 0);  // the fault itself: no request is running
  const v1::WorkerInfo after = test::waitForWorker(
      *broker.channel(),
      [&](const v1::WorkerInfo& w) { return w.restarts() >= 1 && w.state() == "ready"; }, 20s);
  EXPECT_EQ(after.restarts(), 1u);
  EXPECT_NE(after.pid(), before.pid());
  EXPECT_NE(after.last_failure().find("heartbeat"), std::string::npos) << after.last_failure();
  test::Generation g = generate(*broker.channel(), request({1, 2, 3}, 8));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
}

TEST(Canary, MismatchIsCaughtBeforeAnyClientTraffic) {
  test::TempDir state;
  {
    // A healthy worker records the canary for this model and backend.
    test::BrokerProcess healthy(test::fixtureDir("tiny-qwen2"), {"--state-dir", state.path()});
    ASSERT_TRUE(healthy.ok());
  }
  bool recorded = false;
  for (const auto& e : std::filesystem::directory_iterator(state.path()))
    recorded |= e.path().filename().string().rfind("canary-", 0) == 0;
  ASSERT_TRUE(recorded);

  // Workers that compute with one perturbed weight from birth (the host copy is untouched, so
  // the model's identity and weight digest are the same). Scrubbing is off; the canary's step is
  // the first step such a worker runs, and its own in-step weight check fails it.
  test::TempDir dir;
  const std::string worker =
      writeScript(dir, "worker.sh",
                  "exec '" + test::binDir() + "/bulkhead-worker' \"$@\" --perturb-weight 70001:6");
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--worker", worker, "--enable-fault-injection", "--state-dir",
                              state.path(), "--scrub-share", "0"},
                             /*wait_serving=*/false);
  ASSERT_TRUE(broker.ok());
  auto admin = v1::Admin::NewStub(broker.channel());
  const v1::WorkerInfo info = test::waitForWorker(
      *broker.channel(), [](const v1::WorkerInfo& w) { return w.state() == "failed"; }, 30s);
  ASSERT_EQ(info.state(), "failed") << "a perturbed worker was allowed to serve";
  EXPECT_NE(
      info.last_failure().find("canary step failed: integrity failure (in-step weight reads)"),
      std::string::npos)
      << info.last_failure();
  EXPECT_EQ(health(*broker.channel()), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  grpc::ClientContext ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&ctx, {}, &stats).ok());
  EXPECT_GE(stats.canary_failures(), 5u);
  EXPECT_EQ(stats.tokens_generated(), 0u) << "client traffic reached a quarantined worker";
  test::Generation refused = generate(*broker.channel(), request({1, 2, 3}, 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// The canary records in a state directory.
std::vector<std::filesystem::path> canaryRecords(const test::TempDir& state) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(state.path()))
    if (e.path().filename().string().rfind("canary-", 0) == 0) out.push_back(e.path());
  return out;
}

// A worker that computes its attention slightly wrongly from birth: every weight read and every
// product checks out in the step, so only qualification against the reference engine can tell.
std::string miscomputingWorker(const test::TempDir& dir) {
  return writeScript(dir, "worker.sh",
                     "exec '" + test::binDir() +
                         "/bulkhead-worker' \"$@\" --enable-fault-injection --perturb-attention "
                         "1.01");
}

// Waits until the worker is marked failed, and checks that it never served.
void expectNeverServed(test::BrokerProcess& broker, const std::string& why) {
  const v1::WorkerInfo info = test::waitForWorker(
      *broker.channel(), [](const v1::WorkerInfo& w) { return w.state() == "failed"; }, 60s);
  ASSERT_EQ(info.state(), "failed") << "a miscomputing worker was allowed to serve";
  EXPECT_NE(info.last_failure().find(why), std::string::npos) << info.last_failure();
  EXPECT_EQ(health(*broker.channel()), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  auto admin = v1::Admin::NewStub(broker.channel());
  grpc::ClientContext ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&ctx, {}, &stats).ok());
  EXPECT_EQ(stats.tokens_generated(), 0u) << "client traffic reached a quarantined worker";
}

TEST(Canary, AWorkerBrokenFromBirthNeverServesAndRecordsNothing) {
  test::TempDir state, dir;
  {
    test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                               {"--worker", miscomputingWorker(dir), "--state-dir", state.path()},
                               /*wait_serving=*/false);
    ASSERT_TRUE(broker.ok());
    expectNeverServed(broker, "disagrees with the reference engine");
  }
  EXPECT_TRUE(canaryRecords(state).empty()) << "a worker broken from birth recorded its canary";
  // A healthy worker then qualifies, is recorded, and serves.
  test::BrokerProcess healthy(test::fixtureDir("tiny-qwen2"), {"--state-dir", state.path()});
  ASSERT_TRUE(healthy.ok());
  EXPECT_EQ(canaryRecords(state).size(), 1u);
  EXPECT_TRUE(generate(*healthy.channel(), request({1, 2, 3}, 4)).status.ok());
}

TEST(Canary, ACorruptRecordFallsBackToQualification) {
  test::TempDir state, dir;
  {
    test::BrokerProcess healthy(test::fixtureDir("tiny-qwen2"), {"--state-dir", state.path()});
    ASSERT_TRUE(healthy.ok());
  }
  const auto records = canaryRecords(state);
  ASSERT_EQ(records.size(), 1u);
  const std::string record = records[0].string();
  test::writeFile(record, "{\"model_identity\": \"not hex\"}");
  // Had the corrupt record been dropped and the first canary trusted, this worker would serve.
  {
    test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                               {"--worker", miscomputingWorker(dir), "--state-dir", state.path()},
                               /*wait_serving=*/false);
    ASSERT_TRUE(broker.ok());
    expectNeverServed(broker, "disagrees with the reference engine");
  }
  EXPECT_FALSE(std::filesystem::exists(record)) << "the corrupt record was not moved aside";
  test::BrokerProcess healthy(test::fixtureDir("tiny-qwen2"), {"--state-dir", state.path()});
  ASSERT_TRUE(healthy.ok());
  EXPECT_TRUE(std::filesystem::exists(record));
}

TEST(Canary, APinnedRecordFromQualifyIsTheReference) {
  test::TempDir state, dir;
  const std::string pinned = dir.file("pinned.json");
  const test::CommandResult q = test::runBulkhead(
      dir,
      {"qualify", "--model", test::fixtureDir("tiny-qwen2"), "--backend", "cpu", "--out", pinned});
  ASSERT_EQ(q.exit_code, 0) << q.err;
  EXPECT_NE(q.out.find("qualified"), std::string::npos) << q.out;
  {
    test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                               {"--canary-record", pinned, "--state-dir", state.path()});
    ASSERT_TRUE(broker.ok());
    EXPECT_TRUE(generate(*broker.channel(), request({1, 2, 3}, 4)).status.ok());
  }
  {
    test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                               {"--worker", miscomputingWorker(dir), "--canary-record", pinned,
                                "--state-dir", state.path()},
                               /*wait_serving=*/false);
    ASSERT_TRUE(broker.ok());
    expectNeverServed(broker, "canary mismatch");
  }
  EXPECT_TRUE(canaryRecords(state).empty()) << "a pinned record must be the only one";
  // qualify refuses a miscomputing worker and writes nothing.
  const std::string refused = dir.file("refused.json");
  const test::CommandResult bad =
      test::runBulkhead(dir, {"qualify", "--model", test::fixtureDir("tiny-qwen2"), "--backend",
                              "cpu", "--out", refused, "--worker", miscomputingWorker(dir)});
  EXPECT_NE(bad.exit_code, 0) << bad.out;
  EXPECT_NE(bad.err.find("disagrees with the reference engine"), std::string::npos) << bad.err;
  EXPECT_FALSE(std::filesystem::exists(refused));
}

TEST(Canary, RidesAlongUnderLoad) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--canary-every-steps", "4"});
  ASSERT_TRUE(broker.ok());
  v1::GenerateRequest r = request({1, 2, 3}, 64);
  r.set_ignore_eos(true);
  test::Generation g = generate(*broker.channel(), r);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  ASSERT_EQ(g.tokens.size(), 64u);
  auto admin = v1::Admin::NewStub(broker.channel());
  grpc::ClientContext ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&ctx, {}, &stats).ok());
  // The start's canary, then one ride every 4 of the generation's 64 steps or more.
  EXPECT_GE(stats.canary_runs(), 1u + 64 / 4 - 1);
  EXPECT_EQ(stats.canary_failures(), 0u);
}

}  // namespace
}  // namespace bulkhead
