// The scheduler against an in-process fake worker: generations, replay after a worker is lost
// mid-generation, rollback after corrupted weights, retries of rows that fail verification, and
// crash loops. Every replay test asserts that the replay happened (a new incarnation recomputed
// the sequence from position 0) and that the client saw the same tokens as a fault-free run.
#include "broker/scheduler.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <functional>
#include <mutex>

#include "support/fake_worker.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

class CollectSink final : public TokenSink {
 public:
  void onTokens(std::span<const TokenChoice> tokens) override {
    std::lock_guard lock(mu_);
    for (const auto& t : tokens) tokens_.push_back(t.token);
  }
  void onFinish(FinishReason reason, const Usage&, const Status& status) override {
    if (on_finish) on_finish();
    std::lock_guard lock(mu_);
    reason_ = reason;
    status_ = status;
    done_ = true;
    cv_.notify_all();
  }
  bool cancelled() const override { return false; }
  std::function<void()> on_finish;  // runs on the scheduler thread as the request ends

  // Waits (bounded) for the request to end.
  bool wait() {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return done_; });
  }
  std::vector<uint32_t> tokens() const {
    std::lock_guard lock(mu_);
    return tokens_;
  }
  Status status() const {
    std::lock_guard lock(mu_);
    return status_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> tokens_;
  FinishReason reason_ = FinishReason::kNone;
  Status status_;
  bool done_ = false;
};

// Greedy continuation straight from the fake's logits function: what any correct schedule gives.
std::vector<uint32_t> expectedGreedy(std::vector<uint32_t> history, uint32_t n, uint32_t vocab) {
  std::vector<uint32_t> out;
  for (uint32_t i = 0; i < n; ++i) {
    const auto row = test::fakeLogits(history, vocab);
    const uint32_t t = uint32_t(std::max_element(row.begin(), row.end()) - row.begin());
    out.push_back(t);
    history.push_back(t);
  }
  return out;
}

class SchedulerTest : public ::testing::Test {
 protected:
  void start(SchedulerOptions o = {}) {
    o.restart_backoff_initial = 1ms;
    o.restart_backoff_max = 2ms;
    o.canary_interval = 0ms;
    scheduler_ = std::make_unique<Scheduler>(control_->factory(control_),
                                             ModelLimits{control_->vocab, 4096, {}}, o, pool_);
    scheduler_->start();
  }

  struct Run {
    std::vector<uint32_t> prompt;
    std::shared_ptr<CollectSink> sink = std::make_shared<CollectSink>();
  };
  // Submits `n` greedy requests of `tokens` tokens each, with distinct prompts.
  std::vector<Run> submit(int n, uint32_t tokens) {
    std::vector<Run> runs;
    for (int i = 0; i < n; ++i) {
      runs.emplace_back();  // each with its own sink
      runs[size_t(i)].prompt = {uint32_t(i + 1), uint32_t(2 * i + 3), 7};
      GenerationRequest r;
      r.prompt = runs[size_t(i)].prompt;
      r.max_tokens = tokens;
      EXPECT_TRUE(scheduler_->submit(r, runs[size_t(i)].sink).ok());
    }
    return runs;
  }
  void expectAllExact(const std::vector<Run>& runs, uint32_t tokens) {
    for (const Run& r : runs) {
      ASSERT_TRUE(r.sink->wait()) << "a request never finished";
      EXPECT_TRUE(r.sink->status().ok()) << r.sink->status().toString();
      EXPECT_EQ(r.sink->tokens(), expectedGreedy(r.prompt, tokens, control_->vocab));
    }
  }
  // Sequences a later incarnation recomputed from position 0 although an earlier one had them.
  size_t replayedOnNewIncarnation() const {
    std::map<uint64_t, uint64_t> first_incarnation;
    std::set<uint64_t> replayed;
    for (const auto& s : control_->steps()) {
      if (s.sequence_id == 0) continue;  // the canary
      auto [it, fresh] = first_incarnation.emplace(s.sequence_id, s.incarnation);
      if (!fresh && s.incarnation != it->second && s.start_position == 0)
        replayed.insert(s.sequence_id);
    }
    return replayed.size();
  }

  std::shared_ptr<test::FakeWorkerControl> control_ = std::make_shared<test::FakeWorkerControl>();
  RowPool pool_{2};
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, GreedyGenerationsMatchTheModel) {
  start();
  auto runs = submit(5, 12);
  expectAllExact(runs, 12);
  EXPECT_EQ(scheduler_->stats().requests_completed, 5u);
  EXPECT_EQ(replayedOnNewIncarnation(), 0u);
}

TEST_F(SchedulerTest, AWorkerLostMidGenerationIsReplayedWithIdenticalTokens) {
  control_->scrub_lag = 2;  // some tokens are unsent when the worker dies
  control_->scheduleFault(
      6, {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited});
  start();
  auto runs = submit(4, 16);
  expectAllExact(runs, 16);
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_EQ(replayedOnNewIncarnation(), 4u) << "every in-flight sequence is re-prefilled";
  EXPECT_GE(scheduler_->stats().replayed_sequences, 4u);
  EXPECT_EQ(scheduler_->stats().worker_restarts, 1u);
}

TEST_F(SchedulerTest, CorruptedWeightsRollBackUnsentTokensAndReplay) {
  control_->scrub_lag = 3;
  control_->scheduleFault(
      8, {.kind = test::FakeFault::Kind::kReportCorruption, .suspect_steps_back = 2});
  start();
  auto runs = submit(3, 16);
  expectAllExact(runs, 16);
  const SchedulerStats s = scheduler_->stats();
  EXPECT_EQ(s.weight_corruptions, 1u);
  EXPECT_GE(s.replayed_sequences, 3u);
  EXPECT_EQ(control_->starts(), 1u);  // the worker repaired itself; it is not replaced
  // The replay recomputed each sequence from position 0 on the same incarnation.
  size_t recomputed = 0;
  std::map<uint64_t, int> prefills;
  for (const auto& st : control_->steps())
    if (st.sequence_id != 0 && st.start_position == 0 && ++prefills[st.sequence_id] == 2)
      ++recomputed;
  EXPECT_EQ(recomputed, 3u);
}

TEST_F(SchedulerTest, RowsFailingVerificationAreRetriedThenTheWorkerIsReplaced) {
  control_->scheduleFault(3, {.kind = test::FakeFault::Kind::kCorruptRow});
  start();
  auto runs = submit(2, 8);
  expectAllExact(runs, 8);
  EXPECT_EQ(scheduler_->stats().integrity_failures, 1u);
  EXPECT_EQ(control_->starts(), 1u);  // one retry sufficed

  // Three in a row exceed the two retries: the worker is replaced and sequences replay.
  for (int i = 0; i < 3; ++i)
    control_->scheduleFault(1, {.kind = test::FakeFault::Kind::kCorruptRow});
  auto more = submit(2, 8);
  expectAllExact(more, 8);
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_GE(replayedOnNewIncarnation(), 1u);
}

TEST_F(SchedulerTest, AStoppedSequenceIsVouchedForWithoutWaitingForTheBackgroundPass) {
  control_->scrub_lag = 1'000'000;  // the background pass never vouches in time
  SchedulerOptions o;
  o.finish_vouch_interval = 0ms;
  start(o);
  Run shortRun, longRun;
  shortRun.prompt = {3, 4};
  longRun.prompt = {5, 6};
  size_t steps_when_short_ended = 0;
  shortRun.sink->on_finish = [&] { steps_when_short_ended = control_->steps().size(); };
  GenerationRequest r;
  r.prompt = longRun.prompt;
  r.max_tokens = 200;
  ASSERT_TRUE(scheduler_->submit(r, longRun.sink).ok());
  r.prompt = shortRun.prompt;
  r.max_tokens = 3;
  ASSERT_TRUE(scheduler_->submit(r, shortRun.sink).ok());
  expectAllExact({shortRun}, 3);
  expectAllExact({longRun}, 200);
  // The short one ended while the long one was still being computed, long before its last step.
  EXPECT_LT(steps_when_short_ended, control_->steps().size() / 2);
}

TEST_F(SchedulerTest, ACrashLoopFailsRequestsUntilAStartSucceeds) {
  control_->failStarts(100);
  SchedulerOptions o;
  o.max_consecutive_failures = 3;
  start(o);
  auto runs = submit(1, 4);
  ASSERT_TRUE(runs[0].sink->wait());
  EXPECT_EQ(runs[0].sink->status().code(), Code::kUnavailable);
  EXPECT_EQ(scheduler_->workerStatus().state, "failed");
  GenerationRequest r;
  r.prompt = {1, 2};
  r.max_tokens = 2;
  EXPECT_EQ(scheduler_->submit(r, std::make_shared<CollectSink>()).code(), Code::kUnavailable);
  control_->failStarts(0);
  // Starts keep being tried with backoff; once one succeeds the slot serves again.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (scheduler_->workerStatus().state != "ready" && std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  ASSERT_EQ(scheduler_->workerStatus().state, "ready");
  auto after = submit(1, 4);
  expectAllExact(after, 4);
}

}  // namespace
}  // namespace bulkhead
