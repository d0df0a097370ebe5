// The scheduler against an in-process fake worker: generations, replay after a worker is lost
// mid-generation, rollback after corrupted weights, retries of rows that fail verification, and
// crash loops. Every replay test asserts that the replay happened (a new incarnation recomputed
// the sequence from position 0) and that the client saw the same tokens as a fault-free run.
#include "broker/scheduler.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "support/collect_sink.h"
#include "support/fake_worker.h"
#include "support/test_support.h"

namespace bulkhead {
namespace {

using namespace std::chrono_literals;

using test::CollectSink;
using test::expectedGreedy;

class SchedulerTest : public ::testing::Test {
 protected:
  // `run` false: the scheduling thread waits for scheduler_->start(), so that requests submitted
  // before it are all in the first step (tests whose fault must find them all in flight).
  void start(SchedulerOptions o = {}, bool run = true, SchedulerLinks links = {}) {
    o.restart_backoff_initial = 1ms;
    o.restart_backoff_max = 2ms;
    o.canary_interval = 0ms;
    if (!o.canary_reference) o.canary_reference = test::fakeReference();
    scheduler_ = std::make_unique<Scheduler>(control_->factory(control_),
                                             ModelLimits{control_->vocab, 4096, {}}, o, pool_,
                                             std::move(links));
    if (run) scheduler_->start();
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
  // Runs `n` requests of `tokens` tokens (all submitted before the first step), each checked
  // exactly; returns the share of steps sent while another was in flight.
  double overlappedShareOf(const SchedulerOptions& o, int n, uint32_t tokens) {
    start(o, /*run=*/false);
    auto runs = submit(n, tokens);
    scheduler_->start();
    expectAllExact(runs, tokens);
    const SchedulerStats s = scheduler_->stats();
    scheduler_->stop();
    return double(s.steps_overlapped) / double(s.steps);
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

  // Two requests of 40 tokens with canary_every_steps = 4: a ride every 4th client step.
  void expectCanaryRidesEvery4Steps(bool pipelined);

  // Waits (bounded) until the worker slot reports `state`.
  bool waitForState(const std::string& state) const {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (scheduler_->workerStatus().state != state && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    return scheduler_->workerStatus().state == state;
  }

  // Compute times where a size's first step costs `capture(rows)` (a GPU worker's first step of
  // each size also captures its graph) and every later one `cost(rows)`.
  static std::function<uint64_t(size_t)> capturingFirst(std::function<uint64_t(size_t)> cost,
                                                        std::function<uint64_t(size_t)> capture) {
    auto seen = std::make_shared<std::pair<std::mutex, std::set<size_t>>>();
    return [=](size_t rows) {
      std::lock_guard lock(seen->first);
      return seen->second.insert(rows).second ? capture(rows) : cost(rows);
    };
  }
  std::shared_ptr<test::FakeWorkerControl> control_ = std::make_shared<test::FakeWorkerControl>();
  WorkPool pool_{2};
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
  start({}, /*run=*/false);
  auto runs = submit(4, 16);
  scheduler_->start();
  expectAllExact(runs, 16);
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_EQ(replayedOnNewIncarnation(), 4u) << "every in-flight sequence is re-prefilled";
  EXPECT_GE(scheduler_->stats().replayed_sequences, 4u);
  EXPECT_EQ(scheduler_->stats().worker_restarts, 1u);
}

// A worker that comes back from a fault with a smaller KV cache (16 blocks of 4 positions, from
// 256; 44 positions with the canary's aside): a sequence whose client already has tokens is
// replayed there and goes on, its tokens exact, as far as the new cache holds it, then ends with
// RESOURCE_EXHAUSTED naming the blocks, rather than being refused at the replay for a max_tokens
// the new cache could not reach. A new request too large for the new cache is still refused
// before its first token.
TEST_F(SchedulerTest, AfterARestartWithASmallerCacheABegunSequenceGoesOnAsFarAsItFits) {
  control_->on_start = [this](uint32_t start) {
    if (start == 2) control_->blocks = 16;
  };
  control_->scheduleFault(
      6, {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited});
  start();
  auto runs = submit(1, 60);  // 63 positions: 16 blocks
  ASSERT_TRUE(runs[0].sink->wait()) << "the request never ended";
  EXPECT_EQ(runs[0].sink->status().code(), Code::kResourceExhausted)
      << runs[0].sink->status().toString();
  EXPECT_NE(runs[0].sink->status().message().find("KV blocks"), std::string::npos)
      << runs[0].sink->status().toString();
  const std::vector<uint32_t> tokens = runs[0].sink->tokens();
  EXPECT_GE(tokens.size(), 20u)
      << "the sequence stopped at the replay, not when the cache was full";
  EXPECT_LT(tokens.size(), 60u);
  EXPECT_EQ(tokens, expectedGreedy(runs[0].prompt, uint32_t(tokens.size()), control_->vocab));
  EXPECT_EQ(replayedOnNewIncarnation(), 1u) << "the sequence is re-prefilled on the new worker";
  auto refused = submit(1, 60);
  ASSERT_TRUE(refused[0].sink->wait()) << "the new request never ended";
  EXPECT_EQ(refused[0].sink->status().code(), Code::kResourceExhausted);
  EXPECT_TRUE(refused[0].sink->tokens().empty()) << "refused before its first token";
}

// On SIGTERM a host's service manager stops the workers with the broker: a worker lost once the
// scheduler was asked to stop is not replaced, and the open request ends with an error.
TEST_F(SchedulerTest, AWorkerLostWhileStoppingIsNotReplaced) {
  // Steps 1 and 2 are the new worker's canary (its prompt, then its continuation); step 3, the
  // request's first, loses the worker.
  control_->scheduleFault(
      3, {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited});
  uint32_t steps = 0, offers = 0;
  bool asked = false;
  control_->on_step = [&](std::span<const SequenceStep>) { ++steps; };
  // The stop lands where a SIGTERM may: the worker lost, the loop past its check for a stop. The
  // sequence to replay is offered to other workers as the worker is lost, then again by the loop
  // just before it would start a replacement: the second offer asks the scheduler to stop.
  SchedulerLinks links;
  links.hand_off = [&](std::vector<SequencePtr>&, bool) {
    if (steps >= 3 && ++offers == 2) {
      scheduler_->requestStop();
      asked = true;
    }
    return size_t(0);
  };
  start({}, /*run=*/false, std::move(links));
  auto runs = submit(1, 16);
  scheduler_->start();
  ASSERT_TRUE(runs[0].sink->wait()) << "the request never ended";
  EXPECT_FALSE(runs[0].sink->status().ok());
  scheduler_->stop();
  EXPECT_TRUE(asked) << "the lost worker's sequence was offered " << offers << " times, not twice";
  EXPECT_EQ(control_->starts(), 1u) << "a worker was started while the scheduler stopped";
  EXPECT_EQ(scheduler_->stats().worker_restarts, 1u) << "the loss was not seen";
}

// Two steps in flight (a worker with in-step checks, pipelining forced on): each half of the
// sequences is computed while the other's rows are sampled, with the same tokens as one step at a
// time.
// Beside a CPU worker, rows sampled while it computes the other step in flight are sampled on the
// threads it leaves free; beside another worker every thread samples. Each kind of worker has its
// own count of threads that spin while the pool is warm.
TEST_F(SchedulerTest, BesideACpuWorkerSamplingKeepsToTheThreadsLeftFreeAndFewerSpin) {
  WorkPool pool(4);
  for (const std::string backend : {"cpu", "cuda"}) {
    pool.setParticipants(0);
    auto control = std::make_shared<test::FakeWorkerControl>();
    control->backend = backend;
    control->in_step_checks = true;   // two steps in flight
    std::set<unsigned> sending_with;  // the pool's threads as each step is sent
    control->on_step = [&](std::span<const SequenceStep>) { sending_with.insert(pool.threads()); };
    SchedulerOptions o;
    o.pipeline_sample_share = 0;
    o.cpu_worker_sampling_threads = 2;
    o.cpu_worker_warm_spinners = 1;
    o.warm_spinners = 3;
    o.canary_interval = 0ms;
    o.canary_reference = test::fakeReference();
    Scheduler scheduler(control->factory(control), ModelLimits{control->vocab, 4096, {}}, o, pool);
    // Four requests submitted before the loop starts: two halves of two from the first step.
    std::vector<std::shared_ptr<CollectSink>> sinks;
    std::vector<GenerationRequest> requests(4);
    for (uint32_t i = 0; i < 4; ++i) {
      requests[i].prompt = {3 + i, 5, 7};
      requests[i].max_tokens = 8;
      sinks.push_back(std::make_shared<CollectSink>());
      ASSERT_TRUE(scheduler.submit(requests[i], sinks.back()).ok());
    }
    scheduler.start();
    for (uint32_t i = 0; i < 4; ++i) {
      ASSERT_TRUE(sinks[i]->wait());
      EXPECT_EQ(sinks[i]->tokens(), expectedGreedy(requests[i].prompt, 8, control->vocab));
    }
    scheduler.stop();
    EXPECT_EQ(pool.spinners(), backend == "cpu" ? 1u : 3u) << backend;
    if (backend == "cpu")
      EXPECT_TRUE(sending_with.count(2)) << "never limited while a step was in flight";
    else
      EXPECT_EQ(sending_with, std::set<unsigned>{4}) << backend;
  }
}

// Whether two half steps go in flight follows what the worker's steps cost once both sizes were
// seen: where a half costs about what a whole step does (a GPU), the scheduler goes back to one
// step at a time; where compute grows with the rows, halves stay.
TEST_F(SchedulerTest, TwoHalfStepsGoInFlightOnlyWhereTheyCostLess) {
  auto overlappedShare = [&](std::function<uint64_t(size_t)> cost) {
    control_ = std::make_shared<test::FakeWorkerControl>();
    control_->in_step_checks = true;  // two steps may be in flight
    control_->compute_micros = std::move(cost);
    SchedulerOptions o;
    // Far below any sampling time: the heuristic tries halves at once, so both sizes are seen.
    o.pipeline_sample_share = 1e-9;
    return overlappedShareOf(o, 16, 40);
  };
  // The fake worker reports these compute times without spending them; they are large beside
  // the trips and sampling the broker measures, which a busy host stretches.
  const double flat = overlappedShare([](size_t) { return uint64_t(40'000); });
  const double linear = overlappedShare([](size_t rows) { return uint64_t(1000 * rows); });
  EXPECT_LT(flat, 0.25) << "halves that cost a whole step each kept going";
  EXPECT_GT(linear, 0.75) << "halves that cost half a step each were given up";
  // A GPU worker's first step of each size also captures its graph: one step that costs many
  // times the usual must not decide for good.
  const double flat_captured = overlappedShare(capturingFirst(
      [](size_t) { return uint64_t(40'000); }, [](size_t) { return uint64_t(50 * 40'000); }));
  const double linear_captured =
      overlappedShare(capturingFirst([](size_t rows) { return uint64_t(1000 * rows); },
                                     [](size_t) { return uint64_t(50 * 16'000); }));
  EXPECT_LT(flat_captured, 0.25) << "a capture's cost kept halves going";
  EXPECT_GT(linear_captured, 0.75) << "a capture's cost gave halves up";
}

// As above while sequences end one after another (their lengths differ), so that the batch
// shrinks through many sizes, each first seen with a capture's cost.
TEST_F(SchedulerTest, TwoHalfStepsFollowCostsWhileTheBatchShrinks) {
  auto overlappedShare = [&](std::function<uint64_t(size_t)> cost) {
    control_ = std::make_shared<test::FakeWorkerControl>();
    control_->in_step_checks = true;
    control_->compute_micros =
        capturingFirst(cost, [cost](size_t rows) { return 50 * cost(rows); });
    SchedulerOptions o;
    o.pipeline_sample_share = 1e-9;
    start(o, /*run=*/false);
    std::vector<Run> runs;
    for (int i = 0; i < 32; ++i) {
      runs.emplace_back();
      runs.back().prompt = {uint32_t(i + 1), uint32_t(2 * i + 3), 7};
      GenerationRequest r;
      r.prompt = runs.back().prompt;
      r.max_tokens = 40 + 8 * uint32_t(i);
      EXPECT_TRUE(scheduler_->submit(r, runs.back().sink).ok());
    }
    scheduler_->start();
    for (size_t i = 0; i < runs.size(); ++i) expectAllExact({runs[i]}, 40 + 8 * uint32_t(i));
    const SchedulerStats s = scheduler_->stats();
    scheduler_->stop();
    return double(s.steps_overlapped) / double(s.steps);
  };
  const double flat = overlappedShare([](size_t) { return uint64_t(40'000); });
  const double linear = overlappedShare([](size_t rows) { return uint64_t(2000 * rows); });
  EXPECT_LT(flat, 0.25) << "halves that cost a whole step each kept going";
  EXPECT_GT(linear, 0.75) << "halves that cost half a step each were given up";
}

// Beside a worker whose compute grows with its rows (a CPU, whose cores the sampling shares) the
// realised pace decides: both ways are run, and the faster kept. The fake worker spends the
// compute time here for real, one step after another.
TEST_F(SchedulerTest, BesideACpuWorkerBothWaysAreTriedAndTheFasterKept) {
  auto overlappedShare = [&](std::function<std::chrono::microseconds(size_t)> wall) {
    control_ = std::make_shared<test::FakeWorkerControl>();
    control_->in_step_checks = true;  // two steps may be in flight
    control_->compute_grows_with_rows = true;
    control_->compute_wall = std::move(wall);
    control_->blocks = 1024;  // room for all 16 to the end: none preempted, the count stays
    return overlappedShareOf(SchedulerOptions{}, 16, 120);
  };
  // A step costs the same whatever its rows: two halves take twice as long a round.
  const double flat = overlappedShare([](size_t) { return std::chrono::microseconds(4000); });
  // A step's cost grows faster than its rows: two halves of 8 take half as long as 16 at once.
  const double steep =
      overlappedShare([](size_t rows) { return std::chrono::microseconds(32 * rows * rows); });
  EXPECT_GT(flat, 0.0) << "halves were never tried";
  EXPECT_LT(flat, 0.25) << "halves that take twice as long a round kept going";
  EXPECT_GT(steep, 0.75) << "halves that take half as long a round were given up";
}

TEST_F(SchedulerTest, TwoStepsInFlightGiveTheSameTokens) {
  control_->in_step_checks = true;
  SchedulerOptions o;
  o.pipeline_sample_share = 0;  // from the first step on
  start(o, /*run=*/false);
  auto runs = submit(8, 16);
  scheduler_->start();
  expectAllExact(runs, 16);
  EXPECT_EQ(control_->maxInFlight(), kMaxStepsInFlight);
  EXPECT_EQ(replayedOnNewIncarnation(), 0u);
  // After the first step (all eight prefilled at once, before sampling was ever measured) the
  // halves advanced in alternation: no later step carried more than four sequences.
  std::map<uint64_t, std::set<uint64_t>> per_step;
  for (const auto& st : control_->steps())
    if (st.sequence_id != 0) per_step[st.step_id].insert(st.sequence_id);
  ASSERT_GT(per_step.size(), 2u);
  EXPECT_EQ(per_step.begin()->second.size(), 8u);
  for (auto it = std::next(per_step.begin()); it != per_step.end(); ++it)
    EXPECT_LE(it->second.size(), 4u) << "step " << it->first;
}

// A worker that dies with two steps in flight: both steps' sequences are replayed on the next
// incarnation and every request still gets exactly its tokens.
TEST_F(SchedulerTest, AWorkerLostWithTwoStepsInFlightIsReplayedWithIdenticalTokens) {
  control_->in_step_checks = true;
  control_->scheduleFault(
      9, {.kind = test::FakeFault::Kind::kFailStep, .failure = WorkerFailure::Kind::kExited});
  SchedulerOptions o;
  o.pipeline_sample_share = 0;
  start(o, /*run=*/false);
  auto runs = submit(6, 16);
  scheduler_->start();
  expectAllExact(runs, 16);
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_EQ(control_->maxInFlight(), kMaxStepsInFlight);
  EXPECT_EQ(control_->faultsBesideAStepInFlight(), 1u) << "the worker died with one step in flight";
  EXPECT_EQ(replayedOnNewIncarnation(), 6u) << "both halves are re-prefilled";
  EXPECT_EQ(scheduler_->stats().worker_restarts, 1u);
}

// Rows of one of two steps in flight fail verification: that step is retried while the other
// half goes on, and nothing is lost or repeated.
TEST_F(SchedulerTest, AFailedStepAmongTwoInFlightIsRetried) {
  control_->in_step_checks = true;
  control_->scheduleFault(5, {.kind = test::FakeFault::Kind::kCorruptRow});
  SchedulerOptions o;
  o.pipeline_sample_share = 0;
  start(o, /*run=*/false);
  auto runs = submit(6, 12);
  scheduler_->start();
  expectAllExact(runs, 12);
  EXPECT_EQ(scheduler_->stats().integrity_failures, 1u);
  EXPECT_EQ(control_->faultsBesideAStepInFlight(), 1u) << "the failed step had another beside it";
  EXPECT_EQ(control_->starts(), 1u);
  EXPECT_EQ(control_->maxInFlight(), kMaxStepsInFlight);
}

TEST_F(SchedulerTest, CorruptedWeightsRollBackUnsentTokensAndReplay) {
  control_->scrub_lag = 3;
  control_->scheduleFault(
      8, {.kind = test::FakeFault::Kind::kReportCorruption, .suspect_steps_back = 2});
  start({}, /*run=*/false);
  auto runs = submit(3, 16);
  scheduler_->start();
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

// Every release of a request is in the board's histograms before the request ends, so whoever
// sees it end (its client, then a metrics scrape) finds all its tokens counted.
TEST_F(SchedulerTest, ARequestsReleasesAreCountedBeforeItEnds) {
  start();
  Run run;
  run.prompt = {3, 4};
  uint64_t first_token = 0, inter_token = 0;
  run.sink->on_finish = [&] {
    const StatsHistograms h = scheduler_->board().histograms();
    first_token = h.first_token_ms.count();
    inter_token = h.inter_token_ms.count();
  };
  GenerationRequest r;
  r.prompt = run.prompt;
  r.max_tokens = 12;
  ASSERT_TRUE(scheduler_->submit(r, run.sink).ok());
  expectAllExact({run}, 12);
  EXPECT_EQ(first_token, 1u);
  EXPECT_EQ(inter_token, 11u) << "the last release was counted after the request ended";
}

TEST_F(SchedulerTest, AStoppedSequenceIsVouchedForWithoutWaitingForTheBackgroundPass) {
  control_->scrub_lag = 1'000'000;  // the background pass never vouches in time
  SchedulerOptions o;
  o.finish_vouch_interval = 0ms;
  start(o, /*run=*/false);
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
  scheduler_->start();
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
  ASSERT_TRUE(waitForState("ready"));
  auto after = submit(1, 4);
  expectAllExact(after, 4);
}

// Every start fails; the third failure in a row begins the crash loop. A request arriving while
// that start runs passes submission (the loop has not begun), and must then fail rather than
// wait for a start that never succeeds.
TEST_F(SchedulerTest, ARequestArrivingAsTheCrashLoopBeginsFailsInsteadOfWaiting) {
  control_->failStarts(1000);
  auto late = std::make_shared<CollectSink>();
  std::atomic<bool> accepted{false};
  control_->on_start = [&](uint32_t start) {
    if (start != 3) return;
    GenerationRequest r;
    r.prompt = {1, 2};
    r.max_tokens = 2;
    accepted = scheduler_->submit(r, late).ok();
  };
  SchedulerOptions o;
  o.max_consecutive_failures = 3;
  start(o);
  ASSERT_TRUE(late->wait()) << "the request waited for a start that never succeeds";
  EXPECT_TRUE(accepted.load()) << "the request was refused at submission: nothing was tested";
  EXPECT_EQ(late->status().code(), Code::kUnavailable) << late->status().toString();
  EXPECT_EQ(scheduler_->workerStatus().state, "failed");
}

// An operator's restart whose new worker cannot start says so at once (it does not retry
// without backoff until one starts); supervision then starts one as after any failure.
TEST_F(SchedulerTest, AnOperatorRestartWhoseNewWorkerFailsToStartSaysWhy) {
  start();
  ASSERT_TRUE(waitForState("ready"));
  expectAllExact(submit(1, 4), 4);
  control_->failStarts(1);
  auto restarted = scheduler_->restartWorker(10s);
  ASSERT_FALSE(restarted.ok());
  EXPECT_EQ(restarted.status().code(), Code::kUnavailable);
  EXPECT_NE(restarted.status().message().find("scripted start failure"), std::string::npos)
      << restarted.status().toString();
  ASSERT_TRUE(waitForState("ready"));
  expectAllExact(submit(1, 4), 4);
}

TEST_F(SchedulerTest, TheCanaryRidesAlongWithClientStepsEveryNSteps) {
  expectCanaryRidesEvery4Steps(/*pipelined=*/false);
}

// With two steps in flight, each half a step of its own: the canary still rides every 4 steps
// (one ride in flight at a time), beside even a single client row.
TEST_F(SchedulerTest, TheCanaryRidesAlongWithTwoStepsInFlight) {
  expectCanaryRidesEvery4Steps(/*pipelined=*/true);
  EXPECT_EQ(control_->maxInFlight(), kMaxStepsInFlight);
}

void SchedulerTest::expectCanaryRidesEvery4Steps(bool pipelined) {
  SchedulerOptions o;
  o.canary_every_steps = 4;
  if (pipelined) {
    control_->in_step_checks = true;
    o.pipeline_sample_share = 0;
  }
  start(o);
  auto runs = submit(2, 40);
  expectAllExact(runs, 40);
  struct Seen {
    bool canary = false, client = false;
  };
  std::map<uint64_t, Seen> by_step;
  for (const auto& st : control_->steps()) {
    Seen& seen = by_step[st.step_id];
    if (st.sequence_id == 0 && st.start_position == kCanaryPrefix) seen.canary = true;
    if (st.sequence_id != 0) seen.client = true;
  }
  size_t client_steps = 0, rides = 0;
  for (const auto& [id, seen] : by_step) {
    client_steps += seen.client;
    rides += seen.client && seen.canary;
  }
  ASSERT_GE(client_steps, 40u);
  // Two in flight: a ride waits while the previous one is in flight, and the step sent beside it
  // counts toward the next, so rides come every 4 to 6 steps.
  EXPECT_GE(rides, client_steps / (pipelined ? 6 : 4) - 1)
      << "of " << client_steps << " client steps";
  EXPECT_LE(rides, client_steps / 4 + 1) << "of " << client_steps << " client steps";
  const SchedulerStats s = scheduler_->stats();
  EXPECT_EQ(s.canary_runs, 1 + rides);  // the start's full canary, then each ride
  EXPECT_EQ(s.canary_failures, 0u);
}

TEST_F(SchedulerTest, AWorkerThatStartsMiscomputingIsCaughtByTheCanaryInThatStep) {
  SchedulerOptions o;
  o.canary_every_steps = 1;
  // The 8th step with rows: the start's two canary steps, then the 6th client step, in the
  // middle of the generations. Every row is wrong from then on, each with a matching checksum.
  control_->scheduleFault(8, {.kind = test::FakeFault::Kind::kMiscompute});
  start(o, /*run=*/false);
  auto runs = submit(3, 16);
  scheduler_->start();
  // Exact: no row of a miscomputing step was ever sampled.
  expectAllExact(runs, 16);
  const SchedulerStats s = scheduler_->stats();
  EXPECT_EQ(s.canary_failures, 3u);  // the step and its two retries
  EXPECT_EQ(s.integrity_failures, 3u);
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_EQ(replayedOnNewIncarnation(), 3u);
  EXPECT_NE(scheduler_->workerStatus().last_failure.find("(canary)"), std::string::npos)
      << scheduler_->workerStatus().last_failure;
}

// The same with two steps always in flight. The canary rides one of them; before, the other kept
// being sampled (its miscomputed rows pass their own checks), each such success reset the failure
// count, and the worker served wrong tokens to that half's streams until they ended.
TEST_F(SchedulerTest,
       AMiscomputingWorkerCaughtByTheCanaryWithTwoStepsInFlightReleasesNoWrongToken) {
  control_->in_step_checks = true;  // two steps in flight are allowed
  SchedulerOptions o;
  o.canary_every_steps = 1;
  o.pipeline_sample_share = 0;  // always two
  control_->scheduleFault(8, {.kind = test::FakeFault::Kind::kMiscompute});
  start(o, /*run=*/false);
  auto runs = submit(4, 16);
  scheduler_->start();
  expectAllExact(runs, 16);
  const SchedulerStats s = scheduler_->stats();
  EXPECT_GT(s.steps_overlapped, 0u) << "never two steps in flight";
  EXPECT_GT(s.steps_discarded, 0u) << "no step in flight beside the failed one was set aside";
  EXPECT_EQ(s.canary_failures, 3u);  // the step and its two retries, each alone
  EXPECT_EQ(control_->starts(), 2u);
}

// A fault that fails only the steps carrying one sequence (say a corrupted embedding row only its
// token reads), with two steps in flight: the other half's passing steps reset the failure count
// after every failure, so the worker was never replaced and that sequence (and its half) waited
// as long as the other half had work. Now the retry runs alone, fails its retries, and a fresh
// worker serves everything exactly.
TEST_F(SchedulerTest, AFaultOnlyOneSequenceMeetsStillReplacesTheWorkerWithTwoStepsInFlight) {
  control_->in_step_checks = true;
  control_->blocks = 8192;
  auto* control = control_.get();
  control_->on_step = [control](std::span<const SequenceStep> batch) {
    if (control->starts() != 1) return;  // a fresh worker is healthy
    for (const SequenceStep& s : batch)
      if (s.sequence_id == 1) {
        control->scheduleFault(1, {.kind = test::FakeFault::Kind::kCorruptRow});
        return;
      }
  };
  SchedulerOptions o;
  o.pipeline_sample_share = 0;
  start(o, /*run=*/false);
  auto first = submit(1, 20);  // sequence 1
  std::vector<Run> others;
  for (int i = 0; i < 7; ++i) {
    others.emplace_back();
    others.back().prompt = {uint32_t(i + 2), 5, 9};
    GenerationRequest r;
    r.prompt = others.back().prompt;
    r.max_tokens = 400;
    ASSERT_TRUE(scheduler_->submit(r, others.back().sink).ok());
  }
  scheduler_->start();
  expectAllExact(first, 20);
  const SchedulerStats s = scheduler_->stats();
  EXPECT_EQ(s.integrity_failures, 3u) << "the step and its two retries, then a new worker";
  EXPECT_EQ(control_->starts(), 2u);
  EXPECT_GT(s.steps_overlapped, 0u) << "never two steps in flight";
  expectAllExact(others, 400);
}

TEST_F(SchedulerTest, AWorkerBrokenFromBirthNeverServesAndRecordsNothing) {
  test::TempDir state;
  control_->miscomputeFromBirth(1000);
  SchedulerOptions o;
  o.max_consecutive_failures = 3;
  o.state_dir = state.path();
  start(o);
  ASSERT_TRUE(waitForState("failed"));
  EXPECT_NE(scheduler_->workerStatus().last_failure.find("disagrees with the reference engine"),
            std::string::npos)
      << scheduler_->workerStatus().last_failure;
  GenerationRequest r;
  r.prompt = {1, 2};
  r.max_tokens = 2;
  EXPECT_EQ(scheduler_->submit(r, std::make_shared<CollectSink>()).code(), Code::kUnavailable);
  EXPECT_TRUE(std::filesystem::is_empty(state.path())) << "a broken worker recorded its canary";
  EXPECT_GE(scheduler_->stats().canary_failures, 3u);
  EXPECT_EQ(scheduler_->stats().tokens_generated, 0u);

  // A healthy worker qualifies, is recorded and serves.
  control_->miscomputeFromBirth(0);
  ASSERT_TRUE(waitForState("ready"));
  auto after = submit(1, 4);
  expectAllExact(after, 4);
  EXPECT_FALSE(std::filesystem::is_empty(state.path()));
}

}  // namespace
}  // namespace bulkhead
