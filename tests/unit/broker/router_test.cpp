// The router over three in-process fake workers: placement, and what happens to a worker's
// sequences when it is killed, hangs, reads a stale weight slot or is drained in the middle of
// their generations. Each test asserts that the sequences did move (another worker re-prefilled
// them from position 0 with the tokens generated so far), that every client got exactly the tokens
// of a fault-free run without an error, and that the broker kept serving throughout.
#include "broker/router.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "support/collect_sink.h"
#include "support/fake_worker.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using test::CollectSink;
using test::expectedGreedy;

class RouterTest : public ::testing::Test {
 protected:
  static constexpr size_t kWorkers = 3;

  // Every worker's client steps wait until the test's requests are all submitted, so that placement
  // sees each worker holding what it was given (a fake step takes microseconds: unheld, a request
  // could end before the next one is placed). Then `hooks_[i]` runs as worker i is sent a step.
  RouterTest() {
    gate_ = submitted_.get_future().share();
    for (size_t i = 0; i < kWorkers; ++i) {
      controls_.push_back(std::make_shared<test::FakeWorkerControl>());
      controls_[i]->on_step = [this, i](std::span<const SequenceStep> batch) {
        const bool client = std::any_of(batch.begin(), batch.end(),
                                        [](const SequenceStep& s) { return s.sequence_id != 0; });
        if (!client) return;  // the canary
        EXPECT_EQ(gate_.wait_for(20s), std::future_status::ready);
        if (hooks_[i]) hooks_[i](batch);
      };
    }
  }
  ~RouterTest() override {
    releaseRestarts();
    if (router_) router_->stop();
  }
  // Restarts of the workers given `restart_gate` wait until this is called.
  void releaseRestarts() {
    if (!restarts_released_) restart_release_.set_value();
    restarts_released_ = true;
  }

  // Starts the router and waits (bounded) until every worker is ready.
  void start(SchedulerOptions o = {}) {
    o.restart_backoff_initial = 1ms;
    o.restart_backoff_max = 2ms;
    o.canary_interval = 0ms;
    o.canary_reference = test::fakeReference();
    std::vector<WorkerFactory> factories;
    for (auto& c : controls_) factories.push_back(c->factory(c));
    router_ = std::make_unique<Router>(std::move(factories),
                                       ModelLimits{controls_[0]->vocab, 4096, {}}, o, pool_);
    router_->setServingCallback([this](bool serving) {
      std::lock_guard lock(mu_);
      serving_changes_.push_back(serving);
    });
    router_->start();
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!allReady() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    ASSERT_TRUE(allReady()) << "the workers did not all become ready";
  }
  bool allReady() const {
    for (const WorkerView& w : router_->workers())
      if (w.status.state != "ready") return false;
    return true;
  }

  struct Run {
    std::vector<uint32_t> prompt;
    std::shared_ptr<CollectSink> sink = std::make_shared<CollectSink>();
  };
  std::vector<Run> submit(int n, uint32_t tokens) {
    std::vector<Run> runs(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      runs[size_t(i)].prompt = {uint32_t(i + 1), uint32_t(3 * i + 2), 5};
      GenerationRequest r;
      r.prompt = runs[size_t(i)].prompt;
      r.max_tokens = tokens;
      EXPECT_TRUE(router_->submit(r, runs[size_t(i)].sink).ok());
    }
    if (!released_) submitted_.set_value();
    released_ = true;
    return runs;
  }
  void expectAllExact(const std::vector<Run>& runs, uint32_t tokens) {
    for (const Run& r : runs) {
      ASSERT_TRUE(r.sink->wait()) << "a request never finished";
      EXPECT_TRUE(r.sink->status().ok()) << r.sink->status().toString();
      EXPECT_EQ(r.sink->tokens(), expectedGreedy(r.prompt, tokens, controls_[0]->vocab));
    }
  }
  // Sequences worker `from` computed that another worker then re-prefilled from position 0 with
  // more than their prompt (they had generated tokens: they moved mid-generation).
  std::set<uint64_t> movedMidGeneration(size_t from, size_t prompt_length) const {
    std::set<uint64_t> had;
    for (const auto& s : controls_[from]->steps())
      if (s.sequence_id != 0) had.insert(s.sequence_id);
    std::set<uint64_t> moved;
    for (size_t i = 0; i < controls_.size(); ++i) {
      if (i == from) continue;
      std::set<uint64_t> seen;
      for (const auto& s : controls_[i]->steps()) {
        if (!had.count(s.sequence_id) || !seen.insert(s.sequence_id).second) continue;
        if (s.start_position == 0 && s.tokens.size() > prompt_length) moved.insert(s.sequence_id);
      }
    }
    return moved;
  }
  // Once the broker served, it never reported otherwise.
  void expectServedThroughout() {
    std::lock_guard lock(mu_);
    auto first = std::find(serving_changes_.begin(), serving_changes_.end(), true);
    ASSERT_NE(first, serving_changes_.end());
    EXPECT_EQ(std::find(first, serving_changes_.end(), false), serving_changes_.end())
        << "health went NOT_SERVING while other workers served";
  }
  // A worker's exit, as a fault.
  static test::FakeFault exitFault() {
    return {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited};
  }
  // Worker 0's KV cache holds 64 positions less the canary's, the others' 1,024 less it: too
  // small for the 103-position requests of the capacity cases. Starts the router, then drains
  // worker 2 when asked.
  void startWithASmallWorker0(bool drain_worker_2) {
    controls_[0]->blocks = 16;
    start();
    if (drain_worker_2) {
      ASSERT_TRUE(router_->drainWorker("worker-2", 10s).ok());
    }
  }
  void expectNoClientStepOn(size_t worker) {
    for (const auto& s : controls_[worker]->steps())
      EXPECT_EQ(s.sequence_id, 0u)
          << "worker " << worker << " was given a sequence its cache cannot hold";
  }
  // A fault in worker 1 in the middle of nine 24-token generations (three on each worker); its
  // restart lasts until every generation is done.
  void expectMovedOnFault(std::vector<test::FakeFault> faults) {
    controls_[1]->restart_gate = restart_gate_;
    // Whenever another worker is sent one of worker 1's sequences to re-prefill, worker 1 must
    // not read "ready" (nothing may be placed on it, or wait for its steps, once it is lost).
    for (size_t i : {size_t(0), size_t(2)}) {
      hooks_[i] = [this](std::span<const SequenceStep> batch) {
        // A client sequence re-prefilled from position 0 with more than its 3 prompt tokens.
        if (std::none_of(batch.begin(), batch.end(), [](const SequenceStep& s) {
              return s.sequence_id != 0 && s.start_position == 0 && s.tokens.size() > 3;
            }))
          return;
        moved_ = true;
        if (router_->workers()[1].status.state == "ready") ready_while_moved_ = true;
      };
    }
    start();
    for (size_t k = 0; k < faults.size(); ++k)
      controls_[1]->scheduleFault(k == 0 ? 6 : 1, faults[k]);
    auto runs = submit(9, 24);
    expectAllExact(runs, 24);
    EXPECT_EQ(router_->workers()[1].status.state, "starting")
        << "the generations waited for the failed worker's restart";
    EXPECT_TRUE(moved_.load());
    EXPECT_FALSE(ready_while_moved_.load())
        << "worker 1 still read \"ready\" while another worker computed its sequences";
    const auto moved = movedMidGeneration(1, 3);
    EXPECT_EQ(moved.size(), 3u) << "worker 1's three sequences move to the others";
    const SchedulerStats s = router_->stats();
    EXPECT_EQ(s.migrated_sequences, 3u);
    EXPECT_GT(s.migration_ms_p99, 0.0);
    EXPECT_EQ(s.requests_completed, 9u);
    EXPECT_EQ(s.requests_failed, 0u);
    expectServedThroughout();
    releaseRestarts();
  }

  std::promise<void> restart_release_;
  std::shared_future<void> restart_gate_ = restart_release_.get_future().share();
  bool restarts_released_ = false;
  std::promise<void> submitted_;
  std::shared_future<void> gate_;
  bool released_ = false;
  std::function<void(std::span<const SequenceStep>)> hooks_[kWorkers];
  std::atomic<bool> moved_{false}, ready_while_moved_{false};
  std::vector<std::shared_ptr<test::FakeWorkerControl>> controls_;
  WorkPool pool_{2};
  std::unique_ptr<Router> router_;
  std::mutex mu_;
  std::vector<bool> serving_changes_;
};

TEST_F(RouterTest, RequestsSpreadOverTheWorkersAndStayOnTheirs) {
  start();
  auto runs = submit(9, 16);
  expectAllExact(runs, 16);
  std::map<uint64_t, int> workers_of;  // sequence -> workers that computed it
  for (const auto& c : controls_) {
    std::set<uint64_t> mine;
    for (const auto& s : c->steps())
      if (s.sequence_id != 0) mine.insert(s.sequence_id);
    EXPECT_EQ(mine.size(), 3u) << "nine requests over three idle workers: three each";
    for (uint64_t id : mine) ++workers_of[id];
  }
  EXPECT_EQ(workers_of.size(), 9u) << "sequence ids are unique across the workers";
  for (const auto& [id, n] : workers_of) EXPECT_EQ(n, 1) << "sequence " << id << " moved";
  EXPECT_EQ(router_->stats().migrated_sequences, 0u);
  const auto views = router_->workers();
  ASSERT_EQ(views.size(), kWorkers);
  EXPECT_EQ(views[2].name, "worker-2");
  EXPECT_GT(views[2].stats.tokens_generated, 0u);
}

TEST_F(RouterTest, AKilledWorkersSequencesFinishOnTheOthersWithoutWaitingForItsRestart) {
  expectMovedOnFault(
      {{.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited}});
}

TEST_F(RouterTest, AHungWorkersSequencesFinishOnTheOthers) {
  expectMovedOnFault(
      {{.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kTimedOut}});
}

// A stale weight slot fails the step's integrity check every time the step is retried: after
// the retries the worker is replaced, and its sequences move.
TEST_F(RouterTest, AStaleSlotWorkersSequencesFinishOnTheOthers) {
  const test::FakeFault stale{.kind = test::FakeFault::Kind::kFailStep,
                              .failure = WorkerFailure::Kind::kIntegrityFailure};
  expectMovedOnFault({stale, stale, stale});
  EXPECT_GE(router_->stats().integrity_failures, 3u);
}

TEST_F(RouterTest, DrainingOneWorkerMovesItsSequencesAndLosesNothing) {
  // When worker 1 sends its fourth step (its sequences mid-generation), an operator drains it;
  // the step goes on once the drain is under way.
  std::future<Result<uint32_t>> drained;
  std::atomic<int> steps{0};
  hooks_[1] = [&](std::span<const SequenceStep>) {
    if (++steps != 4) return;
    drained = std::async(std::launch::async, [&] { return router_->drainWorker("worker-1", 10s); });
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!router_->workers()[1].draining && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    EXPECT_TRUE(router_->workers()[1].draining);
  };
  start();
  auto runs = submit(9, 64);
  expectAllExact(runs, 64);
  ASSERT_TRUE(drained.valid());
  const auto moved = drained.get();
  ASSERT_TRUE(moved.ok()) << moved.status().toString();
  EXPECT_EQ(*moved, 3u);
  EXPECT_EQ(movedMidGeneration(1, 3).size(), 3u);
  EXPECT_EQ(router_->workers()[1].status.state, "stopped");
  expectServedThroughout();

  // New requests go to the two that serve; a restart brings the drained one back.
  const size_t steps_before = controls_[1]->steps().size();
  expectAllExact(submit(4, 8), 8);
  EXPECT_EQ(controls_[1]->steps().size(), steps_before);
  auto restarted = router_->restartWorker("worker-1", 10s);
  ASSERT_TRUE(restarted.ok()) << restarted.status().toString();
  EXPECT_EQ(router_->workers()[1].status.state, "ready");
}

// Two operators drain the last two ready workers at the same moment, in the middle of the
// generations: one drain is refused, and every sequence finishes exactly on the worker that stays.
TEST_F(RouterTest, TwoDrainsAtOnceLeaveOneWorkerServingAndLoseNothing) {
  std::future<Result<uint32_t>> drains[2];
  std::atomic<int> steps{0};
  hooks_[1] = [&](std::span<const SequenceStep>) {
    if (++steps != 3) return;
    drains[0] =
        std::async(std::launch::async, [&] { return router_->drainWorker("worker-1", 10s); });
    drains[1] =
        std::async(std::launch::async, [&] { return router_->drainWorker("worker-2", 10s); });
  };
  start();
  ASSERT_TRUE(router_->drainWorker("worker-0", 10s).ok());
  auto runs = submit(6, 48);
  expectAllExact(runs, 48);
  ASSERT_TRUE(drains[0].valid() && drains[1].valid());
  const Result<uint32_t> results[2] = {drains[0].get(), drains[1].get()};
  EXPECT_NE(results[0].ok(), results[1].ok()) << "exactly one of the two drains goes through";
  for (const auto& r : results) {
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().toString();
    }
  }
  EXPECT_EQ(router_->stats().requests_failed, 0u);
  expectServedThroughout();
}

// The whole broker drains while worker 2 dies once the others are idle: its sequences move to
// them, and the drain returns only once those have finished too.
TEST_F(RouterTest, ABrokerDrainWaitsForSequencesMovedDuringIt) {
  controls_[2]->restart_gate = restart_gate_;
  // Client steps wait until the drain is about to begin, so that it begins mid-generation.
  std::atomic<bool> draining{false};
  auto await_drain = [&] {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!draining.load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  };
  hooks_[0] = hooks_[1] = [&](std::span<const SequenceStep>) { await_drain(); };
  std::atomic<int> steps{0};
  hooks_[2] = [&](std::span<const SequenceStep>) {
    await_drain();
    if (++steps != 20) return;  // the step the fault below fails
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    auto idle = [&](size_t i) {
      const SchedulerStats s = router_->workers()[i].stats;
      return s.requests_running == 0 && s.requests_waiting == 0;
    };
    while (!(idle(0) && idle(1)) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  };
  controls_[2]->scheduleFault(
      20, {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited});
  start();
  auto runs = submit(9, 24);
  draining = true;
  const auto drained = router_->drain(20s);
  ASSERT_TRUE(drained.ok()) << drained.status().toString();
  for (const Run& r : runs) EXPECT_TRUE(r.sink->done()) << "the drain returned before it finished";
  expectAllExact(runs, 24);
  EXPECT_EQ(movedMidGeneration(2, 3).size(), 3u) << "worker 2's sequences moved during the drain";
  hooks_[0] = hooks_[1] = hooks_[2] = nullptr;
}

// Every worker dies in the middle of the generations; worker 0 is back in 0.2 s, the others'
// restarts last until the test ends. Whatever was on workers 1 and 2 waits for the first worker
// ready (worker 0), not for its own: every request is done while they still start.
TEST_F(RouterTest, WhenNoOtherWorkerIsReadyTheFirstToReturnTakesTheSequences) {
  controls_[0]->restart_delay = 200ms;
  controls_[1]->restart_gate = restart_gate_;
  controls_[2]->restart_gate = restart_gate_;
  start();
  const test::FakeFault kill{.kind = test::FakeFault::Kind::kFailStep,
                             .failure = WorkerFailure::Kind::kExited};
  for (auto& c : controls_) c->scheduleFault(4, kill);
  auto runs = submit(9, 24);
  expectAllExact(runs, 24);
  const auto views = router_->workers();
  EXPECT_EQ(views[1].status.state, "starting") << "a request waited for worker 1's restart";
  EXPECT_EQ(views[2].status.state, "starting") << "a request waited for worker 2's restart";
  EXPECT_EQ(router_->stats().requests_failed, 0u);
  EXPECT_GT(router_->stats().migration_ms_p99, 0.0);
  expectServedThroughout();
}

// Every worker dies and none can start again: requests fail with UNAVAILABLE once the last
// worker is in a crash loop, rather than wait for ever.
TEST_F(RouterTest, SequencesFailOnceEveryWorkerIsInACrashLoop) {
  start();
  const test::FakeFault kill{.kind = test::FakeFault::Kind::kFailStep,
                             .failure = WorkerFailure::Kind::kExited};
  for (auto& c : controls_) {
    c->failStarts(1000);
    c->scheduleFault(4, kill);
  }
  auto runs = submit(9, 64);
  for (const Run& r : runs) {
    ASSERT_TRUE(r.sink->wait()) << "a request never ended";
    EXPECT_EQ(r.sink->status().code(), Code::kUnavailable) << r.sink->status().toString();
  }
  for (const WorkerView& w : router_->workers()) EXPECT_EQ(w.status.state, "failed");
}

// Requests of 103 positions go only to workers whose cache holds them, although worker 0 (whose
// cache cannot) is idle; worker 1 is killed in the middle of the generations and its sequences move
// to worker 2 alone, none failing part-way on the small cache.
TEST_F(RouterTest, SequencesGoOnlyToWorkersWhoseCacheHoldsThem) {
  controls_[1]->restart_gate = restart_gate_;
  ASSERT_NO_FATAL_FAILURE(startWithASmallWorker0(/*drain_worker_2=*/false));
  controls_[1]->scheduleFault(6, exitFault());
  auto runs = submit(6, 100);
  expectAllExact(runs, 100);
  expectNoClientStepOn(0);
  EXPECT_EQ(movedMidGeneration(1, 3).size(), 3u) << "worker 1's three sequences move to worker 2";
  EXPECT_EQ(router_->stats().requests_failed, 0u);
  expectServedThroughout();
  releaseRestarts();
}

// As above with worker 2 drained: worker 1's sequences fit no ready worker, so they wait in the
// router, where worker 0 (ready, its cache too small) leaves them, until worker 1 is back.
TEST_F(RouterTest, SequencesNoReadyWorkerCanHoldWaitForOneThatCan) {
  controls_[1]->restart_delay = 200ms;
  ASSERT_NO_FATAL_FAILURE(startWithASmallWorker0(/*drain_worker_2=*/true));
  controls_[1]->scheduleFault(6, exitFault());
  auto runs = submit(3, 100);
  expectAllExact(runs, 100);
  expectNoClientStepOn(0);
  // Re-prefilled from position 0 with more than their prompt: replayed by worker 1's restart.
  std::set<uint64_t> replayed;
  for (const auto& s : controls_[1]->steps())
    if (s.sequence_id != 0 && s.start_position == 0 && s.tokens.size() > 3)
      replayed.insert(s.sequence_id);
  EXPECT_EQ(replayed.size(), 3u) << "worker 1's restart replays its three sequences";
  EXPECT_EQ(router_->stats().requests_failed, 0u);
  EXPECT_GE(router_->workers()[1].status.restarts, 1u);
}

// While sequences wait in the router for worker 1's restart, one's client cancels: it ends then,
// CANCELLED, not when worker 1 is back; the others finish exactly once it is.
TEST_F(RouterTest, ASequenceCancelledWhileItWaitsInTheRouterEndsThen) {
  controls_[1]->restart_gate = restart_gate_;
  ASSERT_NO_FATAL_FAILURE(startWithASmallWorker0(/*drain_worker_2=*/true));
  controls_[1]->scheduleFault(6, exitFault());
  auto runs = submit(3, 100);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (router_->parked() != 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  ASSERT_EQ(router_->parked(), 3u) << "worker 1's sequences did not wait in the router";
  EXPECT_GE(router_->stats().requests_waiting, 3u) << "the waiting gauge leaves them out";
  runs[0].sink->cancel = true;
  ASSERT_TRUE(runs[0].sink->wait()) << "the cancelled sequence did not end while it waited";
  EXPECT_EQ(runs[0].sink->status().code(), Code::kCancelled) << runs[0].sink->status().toString();
  EXPECT_EQ(router_->workers()[1].status.state, "starting")
      << "it ended only once worker 1 was back";
  EXPECT_EQ(router_->parked(), 2u);
  releaseRestarts();
  runs.erase(runs.begin());
  expectAllExact(runs, 100);
}

// And when the only worker that could hold them stays down (a crash loop), the ready worker takes
// them rather than leave them waiting for nobody: having begun, they go on there as far as its
// cache holds them (one at a time once they no longer fit side by side), their tokens exact,
// then end with RESOURCE_EXHAUSTED saying why.
TEST_F(RouterTest, SequencesNoLiveWorkerCanHoldGoOnAsFarAsTheyFitThenEndWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(startWithASmallWorker0(/*drain_worker_2=*/true));
  controls_[1]->failStarts(1000);
  controls_[1]->scheduleFault(6, exitFault());
  auto runs = submit(3, 100);
  for (const Run& r : runs) {
    ASSERT_TRUE(r.sink->wait()) << "a request never ended";
    EXPECT_EQ(r.sink->status().code(), Code::kResourceExhausted) << r.sink->status().toString();
    EXPECT_NE(r.sink->status().message().find("KV blocks"), std::string::npos)
        << r.sink->status().toString();
    const std::vector<uint32_t> tokens = r.sink->tokens();
    EXPECT_GE(tokens.size(), 20u) << "it ended at the move, not when worker 0's cache was full";
    EXPECT_EQ(tokens, expectedGreedy(r.prompt, uint32_t(tokens.size()), controls_[0]->vocab));
  }
  EXPECT_EQ(router_->workers()[1].status.state, "failed");
  EXPECT_EQ(router_->workers()[0].status.state, "ready");
}

TEST_F(RouterTest, TheLastReadyWorkerCannotBeDrainedAlone) {
  start();
  ASSERT_TRUE(router_->drainWorker("worker-0", 10s).ok());
  ASSERT_TRUE(router_->drainWorker("worker-1", 10s).ok());
  const auto refused = router_->drainWorker("worker-2", 10s);
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition) << refused.status().toString();
  EXPECT_EQ(router_->drainWorker("worker-7", 1s).status().code(), Code::kNotFound);
  EXPECT_EQ(router_->restartWorker("", 1s).status().code(), Code::kInvalidArgument)
      << "with several workers an operator names one";
  expectAllExact(submit(3, 8), 8);
  expectServedThroughout();
}

}  // namespace
}  // namespace bulkhead
