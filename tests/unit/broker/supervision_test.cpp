// Supervision state changes: readiness, crash loops, backoff, recovery and operator restarts.
#include "broker/supervision.h"

#include <gtest/gtest.h>

namespace bulkhead {
namespace {

using namespace std::chrono_literals;
using Clock = Supervision::Clock;

Supervision make() {
  return Supervision({.max_consecutive_failures = 3, .backoff_initial = 10ms, .backoff_max = 25ms});
}

TEST(Supervision, StartsThenBecomesReady) {
  Supervision s = make();
  EXPECT_EQ(s.state(), WorkerState::kStarting);
  EXPECT_TRUE(s.mayStart(Clock::now()));
  s.onStarting();
  s.onReady();
  EXPECT_EQ(s.state(), WorkerState::kReady);
  EXPECT_EQ(workerStateName(s.state()), "ready");
}

TEST(Supervision, BacksOffExponentiallyAndFailsAfterTheLimit) {
  Supervision s = make();
  const auto t0 = Clock::now();
  s.onStarting();
  EXPECT_FALSE(s.onFailure(t0));  // first failure: restart at once
  EXPECT_EQ(s.nextStartAt(), t0);
  EXPECT_EQ(s.state(), WorkerState::kStarting);
  s.onStarting();
  EXPECT_FALSE(s.onFailure(t0));
  EXPECT_EQ(s.nextStartAt(), t0 + 20ms);
  EXPECT_FALSE(s.mayStart(t0 + 19ms));
  EXPECT_TRUE(s.mayStart(t0 + 20ms));
  s.onStarting();
  EXPECT_TRUE(s.onFailure(t0));  // third in a row: a crash loop, reported once
  EXPECT_EQ(s.state(), WorkerState::kFailed);
  EXPECT_EQ(s.nextStartAt(), t0 + 25ms);  // capped
  s.onStarting();
  EXPECT_EQ(s.state(), WorkerState::kFailed);  // stays failed while starting again
  EXPECT_FALSE(s.onFailure(t0));
  EXPECT_EQ(s.state(), WorkerState::kFailed);
  s.onReady();  // a start succeeded
  EXPECT_EQ(s.state(), WorkerState::kReady);
}

TEST(Supervision, AWorkerThatCompletedAStepStartsANewCount) {
  Supervision s = make();
  const auto t0 = Clock::now();
  s.onStarting();
  s.onFailure(t0);
  s.onStarting();
  s.onFailure(t0);
  s.onStarting();
  s.onReady();
  s.onStepCompleted();
  EXPECT_EQ(s.consecutiveFailures(), 0u);
  EXPECT_FALSE(s.onFailure(t0));
  EXPECT_EQ(s.consecutiveFailures(), 1u);
  EXPECT_EQ(s.nextStartAt(), t0);
}

TEST(Supervision, AnOperatorRestartIsNotAFailure) {
  Supervision s = make();
  const auto t0 = Clock::now();
  s.onStarting();
  s.onFailure(t0);
  s.onStarting();
  s.onFailure(t0);
  s.onOperatorRestart(t0);
  EXPECT_EQ(s.consecutiveFailures(), 0u);
  EXPECT_TRUE(s.mayStart(t0));
  s.onStopped();
  EXPECT_FALSE(s.mayStart(t0 + 1h));
  EXPECT_EQ(s.state(), WorkerState::kStopped);
}

}  // namespace
}  // namespace bulkhead
