// bulkhead-broker end to end through real gRPC on the golden fixture: greedy output equals the
// golden tokens; 32 concurrent streams each identical to the same request alone; 64 concurrent
// streams each get all their tokens in order and their finish reason; seeded sampling
// identical across runs and batch mixes; cancel, deadline, validation, queue full, health, Admin;
// SIGTERM answers an admin call still waiting.
#include <gtest/gtest.h>

#include <httplib.h>
#include <signal.h>

#include <future>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

#include "support/broker_process.h"
#include "support/metrics_scrape.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using test::generate;
using test::request;

class BrokerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    broker_ = new test::BrokerProcess(test::fixtureDir("tiny-qwen2"));
  }
  static void TearDownTestSuite() {
    delete broker_;
    broker_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(broker_ && broker_->ok()); }

  v1::Stats stats() {
    auto admin = v1::Admin::NewStub(broker_->channel());
    grpc::ClientContext ctx;
    v1::Stats s;
    EXPECT_TRUE(admin->GetStats(&ctx, {}, &s).ok());
    return s;
  }
  v1::WorkerInfo worker() { return test::workerInfo(*broker_->channel()); }
  // Every KV block is free again once nothing runs (the scheduler updates between steps).
  void expectAllBlocksFree() {
    const v1::WorkerInfo w = test::waitForWorker(
        *broker_->channel(),
        [](const v1::WorkerInfo& w) { return w.kv_blocks_free() == w.kv_blocks_total(); }, 10s);
    EXPECT_EQ(w.kv_blocks_free(), w.kv_blocks_total());
  }

  static inline test::BrokerProcess* broker_ = nullptr;
};

TEST_F(BrokerTest, GreedyOutputEqualsGoldenTokens) {
  const test::Golden golden = test::loadGolden(test::fixtureDir("tiny-qwen2"));
  for (const auto& c : golden.cases) {
    auto r = request(c.prompt, uint32_t(c.greedy.size()));
    r.set_ignore_eos(true);
    r.set_request_id("golden");
    test::Generation g = generate(*broker_->channel(), r);
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, c.greedy);
    EXPECT_EQ(g.finish, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(g.usage.prompt_tokens(), c.prompt.size());
    EXPECT_EQ(g.usage.completion_tokens(), c.greedy.size());
    ASSERT_EQ(g.logprobs.size(), g.tokens.size());
    for (float lp : g.logprobs) EXPECT_LE(lp, 0.0f);
    // Without logprobs asked for: the same tokens, and no logprobs.
    r.set_logprobs(false);
    test::Generation plain = generate(*broker_->channel(), r);
    ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
    EXPECT_EQ(plain.tokens, c.greedy);
    EXPECT_TRUE(plain.logprobs.empty());
  }
}

v1::GenerateRequest mixedRequest(int i) {
  std::mt19937 rng(uint32_t(1000 + i));
  std::vector<uint32_t> prompt(1 + rng() % 40);
  for (auto& t : prompt) t = 3 + rng() % 500;
  auto r = request(prompt, 5 + rng() % 60);
  r.set_ignore_eos(true);
  if (i % 2 == 1) {  // half greedy, half seeded sampling with assorted filters
    auto* s = r.mutable_sampling();
    s->set_temperature(0.7f + 0.1f * float(i % 5));
    s->set_seed(uint64_t(i) * 31 + 7);
    if (i % 3 == 0) s->set_top_k(20);
    if (i % 5 == 1) s->set_top_p(0.9f);
    if (i % 7 == 3) s->set_min_p(0.05f);
    if (i % 4 == 1) s->set_repetition_penalty(1.2f);
    if (i % 6 == 5) s->set_frequency_penalty(0.5f);
  }
  return r;
}

TEST_F(BrokerTest, ConcurrentStreamsMatchTheSameRequestAlone) {
  constexpr int kStreams = 32;
  std::vector<test::Generation> alone(kStreams), together(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    alone[i] = generate(*broker_->channel(), mixedRequest(i));
    ASSERT_TRUE(alone[i].status.ok()) << alone[i].status.error_message();
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] { together[i] = generate(*broker_->channel(), mixedRequest(i)); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "stream " << i;
    EXPECT_EQ(together[i].logprobs, alone[i].logprobs) << "stream " << i;
    EXPECT_EQ(together[i].tokens.size(), mixedRequest(i).max_tokens());
  }
  expectAllBlocksFree();
}

TEST_F(BrokerTest, ManyConcurrentStreamsEachGetAllTheirTokensInOrder) {
  // Tokens reach clients through the stream writers, batched while a write is in flight: with
  // 64 streams at once every stream must still get exactly its own tokens, in order, then its
  // finish reason. Greedy golden cases give the expected tokens; every third stream stops early
  // on a stop token.
  const test::Golden golden = test::loadGolden(test::fixtureDir("tiny-qwen2"));
  ASSERT_FALSE(golden.cases.empty());
  constexpr int kStreams = 64;
  struct Expected {
    v1::GenerateRequest request;
    std::vector<uint32_t> tokens;
    v1::FinishReason finish;
  };
  std::vector<Expected> expected;
  for (int i = 0; i < kStreams; ++i) {
    const test::GoldenCase& c = golden.cases[size_t(i) % golden.cases.size()];
    Expected e{request(c.prompt, uint32_t(c.greedy.size())), c.greedy, v1::FINISH_REASON_LENGTH};
    e.request.set_ignore_eos(true);
    e.request.set_request_id("stream-" + std::to_string(i));
    if (i % 3 == 2 && c.greedy.size() > 2) {
      const uint32_t stop = c.greedy[c.greedy.size() / 2];
      e.request.add_stop_token_ids(stop);
      e.tokens.erase(std::find(e.tokens.begin(), e.tokens.end(), stop) + 1, e.tokens.end());
      e.finish = v1::FINISH_REASON_STOP;
    }
    expected.push_back(std::move(e));
  }
  std::vector<test::Generation> got(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i)
    threads.emplace_back([&, i] { got[i] = generate(*broker_->channel(), expected[i].request); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE("stream " + std::to_string(i));
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, expected[i].tokens);
    EXPECT_EQ(got[i].finish, expected[i].finish);
    EXPECT_EQ(got[i].usage.completion_tokens(), expected[i].tokens.size());
    EXPECT_EQ(got[i].logprobs.size(), got[i].tokens.size());
    EXPECT_GE(got[i].messages, 1u);
    EXPECT_LE(got[i].messages, got[i].tokens.size() + 1);
  }
  expectAllBlocksFree();
}

TEST_F(BrokerTest, SeededSamplingIsReproducibleAndUnseededRecordsItsSeed) {
  auto r = request({5, 6, 7}, 40);
  r.set_ignore_eos(true);
  r.mutable_sampling()->set_temperature(1.0f);
  r.mutable_sampling()->set_seed(1234);
  test::Generation a = generate(*broker_->channel(), r);
  test::Generation b = generate(*broker_->channel(), r);
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.usage.seed(), 1234u);
  r.mutable_sampling()->set_seed(1235);
  EXPECT_NE(generate(*broker_->channel(), r).tokens, a.tokens);

  auto unseeded = request({5, 6, 7}, 40);
  unseeded.set_ignore_eos(true);
  unseeded.mutable_sampling()->set_temperature(1.0f);
  test::Generation u = generate(*broker_->channel(), unseeded);
  ASSERT_TRUE(u.status.ok());
  unseeded.mutable_sampling()->set_seed(u.usage.seed());
  EXPECT_EQ(generate(*broker_->channel(), unseeded).tokens, u.tokens)
      << "replaying with the recorded seed must reproduce the output";
}

TEST_F(BrokerTest, StopTokensAndEos) {
  // Greedy case 2 of the golden file continues 144,123,123,...: stop at 123.
  auto r = request({369, 137, 41, 124, 111, 365, 251}, 20);
  r.add_stop_token_ids(123);
  test::Generation g = generate(*broker_->channel(), r);
  ASSERT_TRUE(g.status.ok());
  EXPECT_EQ(g.tokens, (std::vector<uint32_t>{144, 123}));
  EXPECT_EQ(g.finish, v1::FINISH_REASON_STOP);
  // EOS (token 2, from generation_config.json) ends a generation unless ignore_eos. Near-uniform
  // seeded sampling reaches it within a few seeds; the seeds make the search deterministic.
  bool found = false;
  for (uint64_t seed = 0; seed < 40 && !found; ++seed) {
    auto eos = request({1}, 250);
    eos.mutable_sampling()->set_temperature(50.0f);
    eos.mutable_sampling()->set_seed(seed);
    test::Generation e = generate(*broker_->channel(), eos);
    ASSERT_TRUE(e.status.ok());
    if (e.finish != v1::FINISH_REASON_STOP) continue;
    found = true;
    EXPECT_EQ(e.tokens.back(), 2u);
    eos.set_ignore_eos(true);
    test::Generation past = generate(*broker_->channel(), eos);
    ASSERT_TRUE(past.status.ok());
    EXPECT_EQ(past.finish, v1::FINISH_REASON_LENGTH);
    ASSERT_EQ(past.tokens.size(), 250u);
    EXPECT_TRUE(std::equal(e.tokens.begin(), e.tokens.end(), past.tokens.begin()));
  }
  EXPECT_TRUE(found) << "no seed reached EOS";
}

TEST_F(BrokerTest, ValidationErrorsNameTheField) {
  struct Case {
    std::function<void(v1::GenerateRequest&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.clear_prompt_token_ids(); }, "prompt_token_ids: empty"},
      {[](auto& r) { r.add_prompt_token_ids(512); }, "prompt_token_ids[3]: 512 >= vocab size"},
      {[](auto& r) { r.set_max_tokens(0); }, "max_tokens: must be at least 1"},
      {[](auto& r) { r.set_max_tokens(254); }, "exceeds the context of 256"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(-1); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(NAN); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_top_p(1.5f); }, "sampling.top_p"},
      {[](auto& r) { r.mutable_sampling()->set_top_p(-0.1f); }, "sampling.top_p"},
      {[](auto& r) { r.mutable_sampling()->set_min_p(2); }, "sampling.min_p"},
      {[](auto& r) { r.mutable_sampling()->set_repetition_penalty(-1); },
       "sampling.repetition_penalty"},
      {[](auto& r) { r.mutable_sampling()->set_presence_penalty(3); }, "sampling.presence_penalty"},
      {[](auto& r) { r.mutable_sampling()->set_frequency_penalty(-3); },
       "sampling.frequency_penalty"},
      {[](auto& r) { r.add_stop_token_ids(600); }, "stop_token_ids[0]"},
      {[](auto& r) {
         for (int i = 0; i < 257; ++i) r.add_stop_token_ids(1);
       },
       "stop_token_ids: 257 ids, at most 256"},
      {[](auto& r) { r.set_top_logprobs(21); }, "top_logprobs"},
      {[](auto& r) { r.set_request_id(std::string(300, 'x')); }, "request_id"},
  };
  for (const Case& c : cases) {
    auto r = request({1, 2, 3}, 4);
    c.edit(r);
    test::Generation g = generate(*broker_->channel(), r);
    EXPECT_EQ(g.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(g.status.error_message().find(c.field), std::string::npos)
        << g.status.error_message();
    EXPECT_TRUE(g.tokens.empty());
  }
}

TEST_F(BrokerTest, CancelFreesBlocksWithinAStep) {
  auto stub = v1::Generator::NewStub(broker_->channel());
  auto r = request({1, 2, 3}, 250);
  r.set_ignore_eos(true);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, r);
  v1::GenerateResponse resp;
  ASSERT_TRUE(reader->Read(&resp));
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  expectAllBlocksFree();
}

TEST_F(BrokerTest, DeadlineEndsTheRequestAndFreesBlocks) {
  // Enough work that it cannot finish in 5 ms on any machine: 32 long streams at once.
  std::vector<std::thread> threads;
  std::vector<grpc::StatusCode> codes(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto r = request({uint32_t(1 + i), 2, 3}, 250);
      r.set_ignore_eos(true);
      codes[i] = generate(*broker_->channel(), r, 5ms).status.error_code();
    });
  }
  for (auto& t : threads) t.join();
  for (auto c : codes) EXPECT_EQ(c, grpc::StatusCode::DEADLINE_EXCEEDED);
  expectAllBlocksFree();
}

// Server reflection, spoken with a generic stub so the test needs no reflection stubs:
// ServerReflectionRequest{list_services: "*"} is field 7, a length-delimited "*".
std::string listServicesViaReflection(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  auto call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  auto next = [&] { return cq.Next(&tag, &ok) && ok; };
  call->StartCall(reinterpret_cast<void*>(1));
  if (!next()) return "start failed";
  const char request[] = {0x3a, 0x01, '*'};
  grpc::Slice slice(request, sizeof(request));
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  if (!next()) return "write failed";
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  if (!next()) return "read failed";
  std::vector<grpc::Slice> slices;
  (void)in.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  call->WritesDone(reinterpret_cast<void*>(4));
  next();
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  next();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return bytes;
}

TEST_F(BrokerTest, HealthAndReflectionAreServed) {
  const std::string services = listServicesViaReflection(broker_->channel());
  EXPECT_NE(services.find("bulkhead.v1.Generator"), std::string::npos) << services;
  EXPECT_NE(services.find("bulkhead.v1.Admin"), std::string::npos) << services;
  EXPECT_NE(services.find("grpc.health.v1.Health"), std::string::npos) << services;

  auto health = grpc::health::v1::Health::NewStub(broker_->channel());
  for (const std::string service : {"", "bulkhead.v1.Generator"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  const v1::WorkerInfo w = worker();
  EXPECT_EQ(w.state(), "ready");
  EXPECT_GT(w.incarnation(), 0u);
  EXPECT_EQ(w.backend(), "cpu");
  EXPECT_GT(w.resident_weight_bytes(), 0u);
  EXPECT_EQ(w.streamed_weight_bytes(), 0u);  // the CPU backend keeps every weight
}

TEST(BrokerQueueTest, FullQueueIsResourceExhausted) {
  // One sequence at a time and one queued: of twelve concurrent requests, some find the queue
  // full (how many depends on how fast the first ones are admitted).
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                             {"--max-running", "1", "--max-waiting", "1"});
  ASSERT_TRUE(broker.ok());
  std::vector<std::future<test::Generation>> calls;
  for (int i = 0; i < 12; ++i) {
    calls.push_back(std::async(std::launch::async, [&, i] {
      auto r = request({uint32_t(3 + i), 4, 5}, 250);
      r.set_ignore_eos(true);
      return generate(*broker.channel(), r);
    }));
  }
  int exhausted = 0, ok = 0;
  for (auto& c : calls) {
    test::Generation g = c.get();
    if (g.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      EXPECT_NE(g.status.error_message().find("queue is full"), std::string::npos);
    } else {
      EXPECT_TRUE(g.status.ok()) << g.status.error_message();
      ++ok;
    }
  }
  EXPECT_GT(exhausted, 0);
  EXPECT_GE(ok, 1);
}

// A config file's empty lists, as --print-config writes them (and as it wrote them before, "[]"),
// pass nothing to the workers: the broker's worker starts and serves.
TEST(BrokerConfigTest, EmptyListsInAConfigFilePassNoWorkerFlags) {
  for (const char* empty : {"\"\"", "\"[]\""}) {
    test::TempDir dir;
    test::writeFile(dir.file("broker.toml"),
                    std::string("worker-arg = ") + empty + "\nworkers-from = " + empty + "\n");
    test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"),
                               {"--config", dir.file("broker.toml")});
    ASSERT_TRUE(broker.ok()) << empty;
    auto r = request({1, 2, 3}, 4);
    r.set_ignore_eos(true);
    const test::Generation g = generate(*broker.channel(), r);
    EXPECT_TRUE(g.status.ok()) << empty << ": " << g.status.error_message();
    EXPECT_EQ(g.tokens.size(), 4u) << empty;
  }
}

TEST(BrokerDrainTest, DrainFinishesRunningRequestsThenReportsNotServing) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(broker.ok());
  // A request that is streaming when the drain starts runs to its end.
  auto stub = v1::Generator::NewStub(broker.channel());
  auto r = request({7, 8, 9}, 200);
  r.set_ignore_eos(true);
  grpc::ClientContext stream_ctx;
  auto reader = stub->Generate(&stream_ctx, r);
  v1::GenerateResponse resp;
  ASSERT_TRUE(reader->Read(&resp));
  size_t tokens = size_t(resp.token_ids_size());
  auto admin = v1::Admin::NewStub(broker.channel());
  auto drain = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    v1::DrainResponse drained;
    return std::make_pair(admin->Drain(&ctx, {}, &drained), drained.drained());
  });
  while (reader->Read(&resp)) tokens += size_t(resp.token_ids_size());
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 200u);
  auto [drain_status, drained] = drain.get();
  ASSERT_TRUE(drain_status.ok()) << drain_status.error_message();
  test::Generation after = generate(*broker.channel(), request({1}, 2));
  EXPECT_EQ(after.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  auto health = grpc::health::v1::Health::NewStub(broker.channel());
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckResponse health_resp;
  ASSERT_TRUE(health->Check(&hctx, {}, &health_resp).ok());
  EXPECT_EQ(health_resp.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
}

TEST(BrokerRestartTest, AdminRestartReplaysInFlightSequencesLosslessly) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"));
  ASSERT_TRUE(broker.ok());
  // Sixteen long seeded generations, so the restart lands while they are all mid-generation.
  std::vector<v1::GenerateRequest> requests;
  std::vector<test::Generation> reference;
  for (uint32_t i = 0; i < 16; ++i) {
    auto r = request({11, 12, 13 + i}, 240);
    r.set_ignore_eos(true);
    r.mutable_sampling()->set_temperature(0.9f);
    r.mutable_sampling()->set_seed(99 + i);
    requests.push_back(r);
    reference.push_back(generate(*broker.channel(), r));
    ASSERT_TRUE(reference.back().status.ok());
  }
  auto stub = v1::Generator::NewStub(broker.channel());
  grpc::ClientContext first_ctx;
  auto first = stub->Generate(&first_ctx, requests[0]);
  std::vector<std::future<test::Generation>> others;
  for (size_t i = 1; i < requests.size(); ++i)
    others.push_back(std::async(std::launch::async,
                                [&, i] { return generate(*broker.channel(), requests[i]); }));
  // The first stream has tokens: generation is under way when the restart is asked for.
  v1::GenerateResponse resp;
  ASSERT_TRUE(first->Read(&resp));
  std::vector<uint32_t> first_tokens(resp.token_ids().begin(), resp.token_ids().end());
  auto admin = v1::Admin::NewStub(broker.channel());
  grpc::ClientContext ctx;
  v1::RestartWorkerResponse restarted;
  ASSERT_TRUE(admin->RestartWorker(&ctx, {}, &restarted).ok());
  EXPECT_NE(restarted.old_incarnation(), restarted.new_incarnation());
  while (first->Read(&resp))
    first_tokens.insert(first_tokens.end(), resp.token_ids().begin(), resp.token_ids().end());
  ASSERT_TRUE(first->Finish().ok());
  EXPECT_EQ(first_tokens, reference[0].tokens);
  for (size_t i = 1; i < requests.size(); ++i) {
    const test::Generation g = others[i - 1].get();
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens, reference[i].tokens) << "request " << i;
  }
  grpc::ClientContext stats_ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&stats_ctx, {}, &stats).ok());
  EXPECT_GE(stats.replayed_sequences(), 1u) << "the restart replayed no sequence";
  EXPECT_EQ(stats.worker_restarts(), 1u);
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

TEST(BrokerAdmissionTest, ARequestTheCacheCouldNeverHoldIsRefusedBeforeItsFirstToken) {
  // 8 blocks of 16 positions, some of them the canary's: a 3-token prompt fits, but with
  // max_tokens 250 it would need 16 blocks and fail part-way; it is refused whole instead, and a
  // request that fits is served.
  test::BrokerProcess tight(test::fixtureDir("tiny-qwen2"), {"--kv-blocks", "8"});
  ASSERT_TRUE(tight.ok());
  auto r = request({5, 6, 7}, 250);
  r.set_ignore_eos(true);
  const test::Generation refused = generate(*tight.channel(), r);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("max_tokens (250)"), std::string::npos)
      << refused.status.error_message();
  EXPECT_TRUE(refused.tokens.empty());
  auto fits = request({5, 6, 7}, 40);
  fits.set_ignore_eos(true);
  const test::Generation served = generate(*tight.channel(), fits);
  ASSERT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(served.tokens.size(), 40u);
}

TEST(BrokerPreemptionTest, RecomputeAfterPreemptionGivesTheSameTokens) {
  // 24 blocks of 16 positions: eight 200-token generations cannot all hold their caches, so
  // the newest are preempted and recomputed.
  test::BrokerProcess tight(test::fixtureDir("tiny-qwen2"), {"--kv-blocks", "24"});
  ASSERT_TRUE(tight.ok());
  auto make = [](int i) {
    auto r = request({uint32_t(20 + i), 21, 22, 23, 24, 25, 26, 27}, 200);
    r.set_ignore_eos(true);
    if (i % 2) {
      r.mutable_sampling()->set_temperature(1.0f);
      r.mutable_sampling()->set_seed(uint64_t(i));
    }
    return r;
  };
  std::vector<test::Generation> alone(8), together(8);
  for (int i = 0; i < 8; ++i) alone[i] = generate(*tight.channel(), make(i));
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] { together[i] = generate(*tight.channel(), make(i)); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(alone[i].status.ok()) << alone[i].status.error_message();
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "stream " << i;
  }
  auto admin = v1::Admin::NewStub(tight.channel());
  grpc::ClientContext ctx;
  v1::Stats stats;
  ASSERT_TRUE(admin->GetStats(&ctx, {}, &stats).ok());
  EXPECT_GT(stats.preemptions(), 0u) << "the test did not exercise preemption";
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

TEST(BrokerShutdownTest, SigtermAnswersAnAdminCallThatIsStillWaiting) {
  // No worker can start, so a RestartWorker waits (up to two minutes) for one. SIGTERM must end
  // that wait, answer the call and let the broker exit cleanly: the admin threads are joined
  // before the scheduler they wait on is gone.
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--worker", "/bin/false"},
                             /*wait_serving=*/false);
  auto channel = grpc::CreateChannel(broker.address(), grpc::InsecureChannelCredentials());
  auto admin = v1::Admin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  v1::RestartWorkerResponse restarted;
  auto call =
      std::async(std::launch::async, [&] { return admin->RestartWorker(&ctx, {}, &restarted); });
  // ListWorkers is answered inline, whatever the admin threads are doing.
  EXPECT_NE(test::workerInfo(*channel).state(), "ready");
  broker.process().signal(SIGTERM);
  ASSERT_EQ(call.wait_for(30s), std::future_status::ready);
  const grpc::Status status = call.get();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  ExitInfo info;
  ASSERT_TRUE(broker.process().waitExit(std::chrono::steady_clock::now() + 30s, &info));
  EXPECT_EQ(info.exit_code, 0) << info.describe();
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

TEST(BrokerMetricsTest, ScrapedAfterTrafficAndAWorkerKill) {
  test::BrokerProcess broker(test::fixtureDir("tiny-qwen2"), {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(broker.ok());
  ASSERT_FALSE(broker.metricsAddress().empty());
  constexpr uint32_t kRequests = 4, kTokens = 12;
  for (uint32_t i = 0; i < kRequests; ++i) {
    auto r = request({5, 6, 7 + i}, kTokens);
    r.set_ignore_eos(true);
    ASSERT_TRUE(generate(*broker.channel(), r).status.ok());
  }
  // A real restart: the worker process is killed, the broker notices and starts another.
  const v1::WorkerInfo before = test::workerInfo(*broker.channel());
  ASSERT_GT(before.pid(), 0);
  ASSERT_EQ(::kill(before.pid(), SIGKILL), 0);
  const v1::WorkerInfo after = test::waitForWorker(
      *broker.channel(),
      [&](const v1::WorkerInfo& w) {
        return w.incarnation() != before.incarnation() && w.state() == "ready";
      },
      std::chrono::seconds(60));
  ASSERT_NE(after.incarnation(), before.incarnation()) << "no new worker";
  auto r = request({9, 9, 9}, kTokens);
  r.set_ignore_eos(true);
  ASSERT_TRUE(generate(*broker.channel(), r).status.ok());

  const auto m = test::scrapeMetrics(broker.metricsAddress());
  const double requests = kRequests + 1, tokens = requests * kTokens;
  EXPECT_EQ(m.at("bulkhead_requests_total{outcome=\"completed\"}"), requests);
  EXPECT_EQ(m.at("bulkhead_prompt_tokens_total"), requests * 3);
  EXPECT_GE(m.at("bulkhead_generated_tokens_total"), tokens);
  EXPECT_EQ(m.at("bulkhead_worker_restarts_total{cause=\"worker exited\"}"), 1);
  EXPECT_EQ(m.at("bulkhead_worker_ready{worker=\"worker-0\"}"), 1);
  // Every released token is either a sequence's first or follows another.
  EXPECT_EQ(m.at("bulkhead_time_to_first_token_seconds_count"), requests);
  EXPECT_EQ(m.at("bulkhead_inter_token_seconds_count"), tokens - requests);
  EXPECT_EQ(m.at("bulkhead_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), requests);
  EXPECT_GT(m.at("bulkhead_step_duration_seconds_count"), 0);
  EXPECT_EQ(m.at("bulkhead_step_batch_size_count"), m.at("bulkhead_step_duration_seconds_count"));
  EXPECT_GT(m.at("bulkhead_weight_resident_bytes{worker=\"worker-0\"}"), 0);
  EXPECT_EQ(m.at("bulkhead_weight_streamed_bytes{worker=\"worker-0\"}"), 0);  // a CPU worker
  EXPECT_GT(m.at("bulkhead_last_step_id{worker=\"worker-0\"}"), 0);
  EXPECT_LE(m.at("bulkhead_scrub_clean_through_step_id{worker=\"worker-0\"}"),
            m.at("bulkhead_last_step_id{worker=\"worker-0\"}"));
}

}  // namespace
}  // namespace bulkhead
