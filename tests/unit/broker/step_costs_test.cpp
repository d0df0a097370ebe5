// StepCosts: the choice between one step at a time and two halves, from observed costs.
#include "broker/step_costs.h"

#include <gtest/gtest.h>

namespace bulkhead {
namespace {

TEST(StepCostsTest, NoChoiceUntilBothSizesWereSeen) {
  StepCosts costs;
  EXPECT_FALSE(costs.halvesPay(64).has_value());
  costs.record(64, 8.0, 0.1, 1.0);
  EXPECT_FALSE(costs.halvesPay(64).has_value()) << "the half size was never seen";
  costs.record(32, 4.0, 0.1, 0.5);
  EXPECT_TRUE(costs.halvesPay(64).has_value());
  EXPECT_FALSE(costs.halvesPay(1).has_value()) << "one row cannot be halved";
  EXPECT_FALSE(costs.halvesPay(0).has_value());
}

TEST(StepCostsTest, HalvesPayWhenTheyCostNoMoreComputeThanTheSamplingTheyHide) {
  StepCosts costs;
  // A GPU: a step costs about the same at 32 and 64 rows; sampling is cheap.
  costs.record(64, 4.2, 0.1, 0.6);
  costs.record(32, 3.8, 0.1, 0.3);
  EXPECT_FALSE(*costs.halvesPay(64)) << "7.6 ms of halves against 4.9 ms at once";
  // Compute that grows with the rows: halves lose nothing, the overlap wins.
  StepCosts linear;
  linear.record(64, 8.0, 0.1, 2.0);
  linear.record(32, 4.0, 0.1, 1.0);
  EXPECT_TRUE(*linear.halvesPay(64)) << "8 ms of halves against 10.1 ms at once";
  // A CPU host where halves cost 25% more compute: cheap sampling does not pay for it, costly
  // sampling does.
  StepCosts greedy, top_p;
  greedy.record(64, 8.2, 0.1, 0.8);
  greedy.record(32, 5.1, 0.1, 0.4);
  EXPECT_FALSE(*greedy.halvesPay(64));
  top_p.record(64, 8.2, 0.1, 3.5);
  top_p.record(32, 5.1, 0.1, 1.8);
  EXPECT_TRUE(*top_p.halvesPay(64));
  // Sampling slower than the other half's compute sets the pace of the halves.
  StepCosts slow_sampling;
  slow_sampling.record(64, 2.0, 0.1, 6.0);
  slow_sampling.record(32, 1.0, 0.1, 3.1);
  EXPECT_TRUE(*slow_sampling.halvesPay(64)) << "6.2 ms of halves against 8.1 ms";
  slow_sampling.record(32, 1.0, 0.1, 3.1);
  EXPECT_TRUE(*slow_sampling.halvesPay(64));
}

// Sequences come and go between steps: a size stands for its neighbours within an eighth of it,
// the nearest first.
TEST(StepCostsTest, ASizeStandsForItsNearNeighbours) {
  StepCosts costs;
  costs.record(64, 8.0, 0.0, 0.0);
  costs.record(27, 1.0, 0.0, 0.0);
  EXPECT_FALSE(costs.halvesPay(64).has_value()) << "27 is too far from 32";
  EXPECT_FALSE(costs.knows(32));
  costs.record(29, 5.0, 0.0, 0.0);
  ASSERT_TRUE(costs.halvesPay(64).has_value()) << "29 is within 4 of 32";
  EXPECT_FALSE(*costs.halvesPay(64)) << "2 x 5 ms against 8 ms";
  EXPECT_TRUE(costs.halvesPay(66).has_value()) << "64 stands for 66, 29 for 33";
  costs.record(32, 3.0, 0.0, 0.0);
  EXPECT_TRUE(*costs.halvesPay(64)) << "the exact size comes first: 2 x 3 ms against 8 ms";
  // An odd count's halves: each at its own size's cost once both were seen, the larger's for
  // both until then.
  StepCosts odd;
  odd.record(33, 10.0, 0.0, 0.0);
  odd.record(17, 6.0, 0.0, 0.0);
  EXPECT_FALSE(*odd.halvesPay(33)) << "2 x 6 ms of halves against 10 ms";
  odd.record(15, 3.0, 0.0, 0.0);
  EXPECT_FALSE(*odd.halvesPay(33)) << "17 rows stand for 16 before 15 does";
  odd.record(16, 3.0, 0.0, 0.0);
  EXPECT_TRUE(*odd.halvesPay(33)) << "6 + 3 ms of halves against 10 ms";
}

TEST(StepCostsTest, RecentStepsOutweighOldOnes) {
  StepCosts costs;
  costs.record(64, 8.0, 0.0, 0.0);
  costs.record(32, 3.0, 0.0, 0.0);
  EXPECT_TRUE(*costs.halvesPay(64));
  // The host got busier: half steps now cost 6 ms. One slow step does not flip the choice ...
  costs.record(32, 6.0, 0.0, 0.0);
  EXPECT_TRUE(*costs.halvesPay(64));
  // ... a run of them does.
  for (int i = 0; i < 10; ++i) costs.record(32, 6.0, 0.0, 0.0);
  EXPECT_FALSE(*costs.halvesPay(64));
}

// A GPU worker's first step of a size also captures its graph: the least of a size's first steps
// is its cost, and later one slow step counts for at most twice the average.
TEST(StepCostsTest, AFirstStepThatCapturedAGraphDoesNotSetTheCost) {
  StepCosts costs;
  costs.record(64, 400.0, 0.1, 0.5);  // the capture
  costs.record(32, 300.0, 0.1, 0.3);  // the capture
  EXPECT_FALSE(*costs.halvesPay(64)) << "on the captures alone: 600 ms of halves against 400";
  costs.record(32, 3.8, 0.1, 0.3);
  EXPECT_TRUE(*costs.halvesPay(64)) << "7.6 ms of halves against the 400 ms step";
  costs.record(64, 4.2, 0.1, 0.5);
  EXPECT_FALSE(*costs.halvesPay(64)) << "7.6 ms of halves against 4.8 ms at once";
  // Settled: a slow step moves the average by at most a fifth of the average.
  for (int i = 0; i < 3; ++i) costs.record(64, 4.2, 0.1, 0.5);
  costs.record(64, 1000.0, 0.1, 0.5);
  EXPECT_FALSE(*costs.halvesPay(64)) << "4.2 + 0.2 x 4.2 ms at once: still less";
}

// A cost last seen long ago is measured again before it decides: a choice made on what one size
// cost once is not kept for good.
TEST(StepCostsTest, ACostSeenLongAgoNoLongerDecides) {
  StepCosts costs;
  costs.record(64, 4.2, 0.1, 0.5);
  costs.record(32, 3.8, 0.1, 0.3);
  ASSERT_TRUE(costs.halvesPay(64).has_value());
  for (uint64_t i = 0; i + 1 < StepCosts::kStale; ++i) costs.record(64, 4.2, 0.1, 0.5);
  EXPECT_TRUE(costs.halvesPay(64).has_value()) << "32 rows seen kStale - 1 records ago";
  costs.record(64, 4.2, 0.1, 0.5);
  EXPECT_FALSE(costs.halvesPay(64).has_value()) << "32 rows last seen kStale records ago";
  EXPECT_FALSE(costs.knows(32));
  EXPECT_TRUE(costs.knows(64));
  costs.record(32, 3.8, 0.1, 0.3);
  EXPECT_TRUE(costs.halvesPay(64).has_value());
}

// Paces (wall ms a row between used replies) of the two modes: no choice until each has a
// complete window of them at about the running count, then the faster.
TEST(StepCostsTest, ThePaceChoiceWaitsForBothModesThenTakesTheFaster) {
  StepCosts costs;
  for (uint32_t i = 0; i + 1 < StepCosts::kPaceWindow; ++i) costs.recordPace(64, false, 0.2);
  EXPECT_FALSE(costs.knowsPace(64, false)) << "one pace short of a window";
  costs.recordPace(64, false, 0.2);
  EXPECT_TRUE(costs.knowsPace(64, false));
  EXPECT_FALSE(costs.knowsPace(64, true));
  EXPECT_FALSE(costs.fasterPace(64).has_value()) << "halves never ran";
  for (uint32_t i = 0; i < StepCosts::kPaceWindow; ++i) costs.recordPace(64, true, 0.15);
  ASSERT_TRUE(costs.fasterPace(64).has_value());
  EXPECT_TRUE(*costs.fasterPace(64)) << "0.15 ms a row in halves against 0.2 at once";
  EXPECT_FALSE(costs.fasterPace(16).has_value()) << "no pace near 16 sequences";
  // A complete pace stands as it is: later paces of that mode change nothing until it is stale.
  for (uint32_t i = 0; i < 100; ++i) costs.recordPace(64, true, 0.5);
  EXPECT_TRUE(*costs.fasterPace(64));
}

// A pace is the median of its window, so a few stalled steps do not decide; paces at counts
// within an eighth of the window's first go into the same window (sequences come and go).
TEST(StepCostsTest, APaceIsItsWindowsMedianOverNearbyCounts) {
  StepCosts costs;
  const uint32_t counts[] = {64, 62, 63, 66, 60, 64, 61, 65};
  for (uint32_t i = 0; i < StepCosts::kPaceWindow; ++i) {
    // One at a time: 0.20 a row, but three steps stalled at 2 ms a row.
    costs.recordPace(counts[i % 8], false, i % 5 == 0 ? 2.0 : 0.20);
    costs.recordPace(counts[(i + 3) % 8], true, 0.22);
  }
  ASSERT_TRUE(costs.fasterPace(64).has_value());
  EXPECT_FALSE(*costs.fasterPace(64)) << "0.20 a row at once (its median) against 0.22 in halves";
  EXPECT_FALSE(costs.knowsPace(56, false)) << "64 is further than an eighth of 56 away";
}

// A complete pace decides for kPaceStale pace records after its last; then that mode is measured
// again from scratch (and then the other, whose pace went stale meanwhile), so a host that
// changed is followed.
TEST(StepCostsTest, APaceSeenLongAgoIsMeasuredAgainFromScratch) {
  StepCosts costs;
  const uint32_t w = StepCosts::kPaceWindow;
  for (uint32_t i = 0; i < w; ++i) costs.recordPace(64, false, 0.30);
  for (uint32_t i = 0; i < w; ++i) costs.recordPace(64, true, 0.20);
  ASSERT_TRUE(costs.fasterPace(64).has_value());
  EXPECT_TRUE(*costs.fasterPace(64));
  // Halves kept: their later paces change nothing, but count.
  for (uint64_t i = 0; i + w + 1 < StepCosts::kPaceStale; ++i) costs.recordPace(64, true, 0.20);
  EXPECT_TRUE(costs.knowsPace(64, false)) << "one at a time last seen kPaceStale - 1 ago";
  costs.recordPace(64, true, 0.20);
  EXPECT_FALSE(costs.knowsPace(64, false)) << "one at a time last seen kPaceStale ago";
  EXPECT_FALSE(costs.fasterPace(64).has_value());
  EXPECT_TRUE(costs.knowsPace(64, true));
  // The host changed meanwhile: one at a time now takes 0.1 ms a row, halves 0.15.
  for (uint32_t i = 0; i < w; ++i) costs.recordPace(64, false, 0.10);
  EXPECT_TRUE(costs.knowsPace(64, false)) << "nothing of the old 0.30 in it";
  EXPECT_FALSE(costs.knowsPace(64, true)) << "halves went stale as one at a time was measured";
  for (uint32_t i = 0; i < w; ++i) costs.recordPace(64, true, 0.15);
  ASSERT_TRUE(costs.fasterPace(64).has_value());
  EXPECT_FALSE(*costs.fasterPace(64)) << "0.10 a row at once against 0.15 in halves";
}

}  // namespace
}  // namespace bulkhead
