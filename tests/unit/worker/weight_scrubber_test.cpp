// The weight scrubber: its thread finds and repairs a flipped bit and names the first step that
// may have used it, clean_through never vouches for such a step, a full pass is complete when it
// returns, no granule starts while a step computes, stop() joins the thread without waiting out
// its idle time, and a new step numbering (a broker reattached) starts with nothing vouched for.
#include "worker/weight_scrubber.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "shared/checkpoint.h"
#include "support/backend_driver.h"
#include "support/test_support.h"
#include "worker/cpu_backend.h"

namespace bulkhead {
namespace {

// Bounded waits: generous, so a slow machine never fails a correct scrubber; a broken one fails
// with the message instead of hanging the suite.
constexpr auto kPatience = std::chrono::seconds(60);

class WeightScrubberTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = Checkpoint::open(test::fixtureDir("tiny-qwen2"));
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().toString();
    checkpoint_ = std::make_shared<const Checkpoint>(std::move(*ckpt));
    CpuBackend::Options options;
    options.kv_blocks = 64;
    auto backend = CpuBackend::create(checkpoint_, options);
    ASSERT_TRUE(backend.ok()) << backend.status().toString();
    backend_ = std::move(*backend);
  }

  std::unique_ptr<WeightScrubber> scrubber(double share, uint64_t granule_bytes = 4096) {
    return std::make_unique<WeightScrubber>(
        *backend_, *checkpoint_, weights_mutex_,
        WeightScrubber::Options{.share = share, .granule_bytes = granule_bytes});
  }

  // One step of a fresh sequence, as the server runs it: stepStarted, the compute under the
  // shared lock, then stepCompleted. A step
  // that computes with a corrupted weight also fails its own in-step check; that is counted.
  test::Rows step(WeightScrubber& s, uint64_t step_id) {
    test::Rows rows;
    s.stepStarted();
    {
      std::shared_lock lock(weights_mutex_);
      test::BackendDriver driver(*backend_, /*tolerate_failed_reads=*/true);
      rows = driver.runAlone(step_id, {3, 1, 4, 1, 5}, 5);
      failed_reads_ += driver.failedReads();
    }
    s.stepCompleted(step_id);
    return rows;
  }
  int failed_reads_ = 0;

  void flip(uint64_t byte, uint8_t bit) {
    std::unique_lock lock(weights_mutex_);
    ASSERT_TRUE(backend_->flipWeightBit(byte, bit).ok());
  }

  // Whether every resident byte matches the checkpoint again.
  bool residentMatchesCheckpoint() {
    const auto used = checkpoint_->usedTensors();
    for (uint32_t t = 0; t < used.size(); ++t) {
      const WeightRange r{t, 0, used[t]->data.size()};
      uint64_t sum = 0;
      if (!backend_->residentChecksums({&r, 1}, {&sum, 1}).ok()) return false;
      if (sum != checksumBytes(used[t]->data)) return false;
    }
    return true;
  }

  std::shared_ptr<const Checkpoint> checkpoint_;
  std::unique_ptr<CpuBackend> backend_;
  std::shared_mutex weights_mutex_;
};

TEST_F(WeightScrubberTest, ThreadFindsAndRepairsAFlippedBitAndNamesTheFirstSuspectStep) {
  auto s = scrubber(1.0);
  const test::Rows clean = step(*s, 1);
  step(*s, 2);
  step(*s, 3);
  s->start();
  // A pass that started after step 3 completed: every granule was last found clean after it.
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (s->cleanThrough() < 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "no clean pass after step 3; clean_through " << s->cleanThrough();
    std::this_thread::yield();
  }
  flip(checkpoint_->weightBytes() / 2, 6);
  step(*s, 4);  // both compute with the corrupted byte
  step(*s, 5);
  EXPECT_EQ(failed_reads_, 2) << "each step that read the corrupted byte fails its own check";

  std::vector<ScrubReport> reports;
  std::vector<WeightCorruption> found;
  while (found.empty()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "the scrub thread never found the flip";
    // Until the corruption is reported, nothing may vouch for steps 4 and 5.
    ASSERT_LT(s->cleanThrough(), 4u);
    ScrubReport r = s->takeReport();
    found = r.corruptions;
    if (found.empty()) {
      EXPECT_LT(r.clean_through, 4u) << "a report vouched for a corrupted step";
    }
    std::this_thread::yield();
  }
  s->stop();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].suspect_from_step, 4u) << found[0].tensor << " at " << found[0].offset;
  EXPECT_GT(found[0].bytes, 0u);
  EXPECT_TRUE(residentMatchesCheckpoint()) << "the granule was not repaired";
  EXPECT_TRUE(test::bitIdentical(step(*s, 6)[4], clean[4])) << "logits differ after the repair";
}

TEST_F(WeightScrubberTest, FullPassIsCompleteWhenItReturns) {
  auto s = scrubber(0.0);  // no thread: only the full pass looks
  step(*s, 1);
  s->stepCompleted(7);
  const uint64_t total = checkpoint_->weightBytes();
  flip(10, 0);
  flip(total - 10, 3);
  const uint64_t passes = s->passes();
  ScrubReport first = s->fullPass();
  EXPECT_EQ(s->passes(), passes + 1);
  ASSERT_EQ(first.corruptions.size(), 2u);
  for (const WeightCorruption& c : first.corruptions) EXPECT_EQ(c.suspect_from_step, 1u);
  EXPECT_EQ(first.clean_through, 0u) << "a pass that repaired something vouches for nothing";
  EXPECT_TRUE(residentMatchesCheckpoint());

  ScrubReport second = s->fullPass();
  EXPECT_TRUE(second.corruptions.empty());
  EXPECT_EQ(second.clean_through, 7u);
  EXPECT_EQ(s->cleanThrough(), 7u);
}

// A broker that reattaches to a running worker numbers its steps from 1 again: what the
// scrubber vouched for under the old numbering (clean through 1,000) must not vouch for the new
// broker's step 1, and a corruption that step read is suspect from step 1, not 1,001.
TEST_F(WeightScrubberTest, ANewStepNumberingStartsWithNothingVouchedFor) {
  auto s = scrubber(0.0);
  step(*s, 999);
  s->stepCompleted(1000);
  ASSERT_EQ(s->fullPass().clean_through, 1000u);
  flip(200, 2);  // found by no pass before the restart: the next broker's step 1 reads it
  s->restartStepNumbering();
  EXPECT_EQ(s->cleanThrough(), 0u);
  step(*s, 1);
  EXPECT_EQ(s->cleanThrough(), 0u) << "step 1 vouched for by a pass of the old numbering";
  ScrubReport found = s->fullPass();
  ASSERT_EQ(found.corruptions.size(), 1u);
  EXPECT_EQ(found.corruptions[0].suspect_from_step, 1u);
  EXPECT_EQ(found.clean_through, 0u);
  EXPECT_EQ(s->fullPass().clean_through, 1u);
}

TEST_F(WeightScrubberTest, FullPassWhileTheThreadRunsReportsWhatEitherFound) {
  auto s = scrubber(1.0);
  s->start();
  step(*s, 1);
  flip(100, 1);
  step(*s, 2);
  ScrubReport report = s->fullPass();
  // The thread may have found the flip first; either way it is in this report or the pass's.
  EXPECT_EQ(report.corruptions.size(), 1u);
  EXPECT_TRUE(residentMatchesCheckpoint());
  EXPECT_EQ(s->fullPass().clean_through, 2u);
  s->stop();
}

TEST_F(WeightScrubberTest, NoGranuleStartsWhileAStepComputes) {
  auto s = scrubber(1.0);  // never idle: only the step holds it back
  s->stepStarted();
  s->start();
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (!s->waitingForStepToEnd()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the scrub thread never waited";
    std::this_thread::yield();
  }
  EXPECT_EQ(s->granulesScrubbed(), 0u) << "a granule was scrubbed while the step computed";
  s->stepCompleted(1);
  while (s->passes() == 0) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no pass after the step ended";
    std::this_thread::yield();
  }
  EXPECT_GT(s->granulesScrubbed(), 0u);
  s->stop();
}

TEST_F(WeightScrubberTest, StopDoesNotWaitOutTheIdleTime) {
  // A share so small that the idle time after the first granule is hours long. That granule
  // holds a flipped bit, so its report shows that the thread did it and is now idle.
  auto s = scrubber(1e-9, checkpoint_->weightBytes());
  flip(10, 0);
  s->start();
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (s->takeReport().corruptions.empty()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the scrub thread never ran";
    std::this_thread::yield();
  }
  auto stopped = std::async(std::launch::async, [&] { s->stop(); });
  ASSERT_EQ(stopped.wait_for(kPatience), std::future_status::ready)
      << "stop() waited for the scrub thread's idle time";
}

}  // namespace
}  // namespace bulkhead
