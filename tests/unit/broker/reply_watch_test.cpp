// The window in which the broker watches awake for a step's reply (replyWatch).
#include "broker/worker_client.h"

#include <gtest/gtest.h>

#include <vector>

namespace bulkhead {
namespace {

using std::chrono::microseconds;

TEST(ReplyWatch, WithNoWaitsYetItIsTheSpinEitherSideOfTheStart) {
  const SteadyTime start = SteadyTime::clock::now();
  const ReplyWatch w = replyWatch(start, {}, microseconds(50));
  EXPECT_EQ(w.wake, start - microseconds(50));
  EXPECT_EQ(w.until, start + microseconds(50));
}

TEST(ReplyWatch, SpansTheShortestToTheLongestOfTheLastWaits) {
  const SteadyTime start = SteadyTime::clock::now();
  // The last wait (510 us) is not the shortest: a window around it alone would start too late
  // for a step as short as the 480 us one.
  const std::vector<SteadyTime::duration> waits = {microseconds(500), microseconds(480),
                                                   microseconds(560), microseconds(510)};
  const ReplyWatch w = replyWatch(start, waits, microseconds(50));
  EXPECT_EQ(w.wake, start + microseconds(430));
  EXPECT_EQ(w.until, start + microseconds(610));
}

TEST(ReplyWatch, AnOutlierWaitDoesNotStretchTheWatchPastAQuarterOfTheShortest) {
  const SteadyTime start = SteadyTime::clock::now();
  const std::vector<SteadyTime::duration> waits = {microseconds(800), microseconds(4000)};
  const ReplyWatch w = replyWatch(start, waits, microseconds(50));
  EXPECT_EQ(w.wake, start + microseconds(750));
  EXPECT_EQ(w.until, start + microseconds(1050));
}

}  // namespace
}  // namespace bulkhead
