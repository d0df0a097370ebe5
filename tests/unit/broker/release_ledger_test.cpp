// ReleaseLedger: which step produced each token, what is released, and rollback; and the latency
// window that release times are reported through.
#include "broker/release_ledger.h"

#include "broker/latency_window.h"

#include <gtest/gtest.h>

namespace bulkhead {
namespace {

TokenChoice choice(uint32_t token) {
  return TokenChoice{.token = token, .logprob = -1.0f, .top = {}};
}

std::vector<uint32_t> ids(const std::vector<TokenChoice>& choices) {
  std::vector<uint32_t> out;
  for (const auto& c : choices) out.push_back(c.token);
  return out;
}

TEST(ReleaseLedger, ReleasesOnlyTokensOfVouchedSteps) {
  ReleaseLedger l({1, 2, 3});
  l.append(10, choice(100));
  l.append(11, choice(101));
  l.append(13, choice(102));
  EXPECT_TRUE(l.takeReleasable(9).empty());
  EXPECT_EQ(ids(l.takeReleasable(11)), (std::vector<uint32_t>{100, 101}));
  EXPECT_EQ(l.released(), 2u);
  EXPECT_EQ(l.unreleasedCount(), 1u);
  EXPECT_TRUE(l.takeReleasable(12).empty());
  EXPECT_EQ(ids(l.takeReleasable(13)), (std::vector<uint32_t>{102}));
  EXPECT_EQ(l.tokens().size(), 6u);
  EXPECT_EQ(l.generatedCount(), 3u);
}

TEST(ReleaseLedger, RollbackDropsExactlyTheUnreleasedTokensFromTheSuspectStep) {
  ReleaseLedger l({7, 8});
  for (uint64_t step = 1; step <= 6; ++step) l.append(step, choice(uint32_t(200 + step)));
  ASSERT_EQ(l.takeReleasable(2).size(), 2u);  // steps 1 and 2 sent
  // Weights found corrupted from step 4: tokens of steps 4, 5 and 6 go; 3 stays unsent.
  EXPECT_EQ(l.rollBack(4), 3u);
  EXPECT_EQ(l.generated().size(), 3u);
  EXPECT_EQ(l.tokens().back(), 203u);
  EXPECT_EQ(l.released(), 2u);
  EXPECT_EQ(l.unreleasedCount(), 1u);
  // A suspect step before the released ones cannot take back what was sent.
  EXPECT_EQ(l.rollBack(1), 1u);
  EXPECT_EQ(l.generated().size(), 2u);
  EXPECT_EQ(l.released(), 2u);
}

TEST(ReleaseLedger, ForgettingKeepsTheSentHistory) {
  ReleaseLedger l({5});
  l.append(1, choice(50));
  l.append(2, choice(51));
  ASSERT_EQ(l.takeReleasable(1).size(), 1u);
  EXPECT_EQ(l.forgetUnreleased(), 1u);
  EXPECT_EQ(l.tokens().size(), 2u);
  EXPECT_EQ(l.prompt().size(), 1u);
  EXPECT_EQ(l.generated()[0], 50u);
  // Replayed tokens are appended again with the new worker's step ids.
  l.append(9, choice(51));
  EXPECT_EQ(ids(l.takeReleasable(9)), (std::vector<uint32_t>{51}));
}

}  // namespace
}  // namespace bulkhead

namespace bulkhead {
namespace {

TEST(ReleaseLedger, ReportsWhenEachReleasedTokensStepCompleted) {
  ReleaseLedger l({1});
  const auto t0 = ReleaseLedger::Clock::now();
  l.append(1, choice(10), t0);
  l.append(2, choice(11), t0 + std::chrono::milliseconds(5));
  std::vector<ReleaseLedger::Clock::time_point> at;
  ASSERT_EQ(l.takeReleasable(2, &at).size(), 2u);
  ASSERT_EQ(at.size(), 2u);
  EXPECT_EQ(at[0], t0);
  EXPECT_EQ(at[1], t0 + std::chrono::milliseconds(5));
}

TEST(LatencyWindow, PercentilesOfTheLastSamplesOnly) {
  LatencyWindow w(4);
  EXPECT_EQ(w.percentile(99), 0.0);
  for (double v : {100.0, 1.0, 2.0, 3.0, 4.0}) w.add(v);  // 100 falls out of the window
  EXPECT_EQ(w.percentile(0), 1.0);
  EXPECT_EQ(w.percentile(50), 3.0);
  EXPECT_EQ(w.percentile(99), 4.0);
}

}  // namespace
}  // namespace bulkhead
