// The batch planner's pure decisions: admission and step packing with preemption.
#include "broker/batch_planner.h"

#include <gtest/gtest.h>

namespace bulkhead {
namespace {

TEST(PlanAdmission, FirstComeFirstServedWithoutOvertaking) {
  // Block size 4: histories of 3, 10 and 1 need 1, 3 and 1 blocks (history + 1 token).
  const std::vector<WaitingSequence> waiting = {{3, 4}, {10, 11}, {1, 2}};
  auto d = planAdmission(waiting, /*free=*/3, /*total=*/8, 4, /*running=*/0, /*max_running=*/8);
  ASSERT_EQ(d.size(), 1u);  // the second needs 3 with 2 left: it waits, and so does the third
  EXPECT_EQ(d[0], Admit::kStart);
  d = planAdmission(waiting, 4, 8, 4, 0, 8);
  EXPECT_EQ(d, (std::vector<Admit>{Admit::kStart, Admit::kStart}));
}

TEST(PlanAdmission, RejectsWhatCouldNeverFitAndGoesOn) {
  const std::vector<WaitingSequence> waiting = {{100, 101}, {2, 3}};
  auto d = planAdmission(waiting, 8, 8, 4, 0, 8);
  EXPECT_EQ(d, (std::vector<Admit>{Admit::kRejectTooLarge, Admit::kStart}));
}

TEST(PlanAdmission, RejectsARequestWhoseMaxTokensCouldNeverFitBeforeItStarts) {
  // Three blocks of 4: a 3-token prompt fits now, but with max_tokens 60 (63 tokens) it needs 16
  // blocks, so it would fail part-way; one of 3 + 9 fits whole (3 blocks). Both fit now.
  const std::vector<WaitingSequence> waiting = {{3, 63}, {3, 12}};
  EXPECT_EQ(planAdmission(waiting, 3, 3, 4, 0, 8),
            (std::vector<Admit>{Admit::kRejectTooLarge, Admit::kStart}));
  EXPECT_EQ(mostBlocks({3, 63}, 4), 16u);
  EXPECT_EQ(mostBlocks({20, 12}, 4), 6u);  // never below what its history needs now
}

TEST(PlanAdmission, ASequenceThatHasBegunNeedsRoomOnlyForItsNextToken) {
  // Three blocks of 4, as above: begun (its client has tokens; a replay on a worker that came
  // back with a smaller cache), a 3 + 60 request starts with 9 tokens of history (3 blocks for
  // history + 1) and goes on as far as the cache holds it; with 12 it could not take one more.
  const std::vector<WaitingSequence> waiting = {{9, 63, true}, {12, 63, true}, {3, 63, false}};
  EXPECT_EQ(planAdmission(waiting, 3, 3, 4, 0, 8),
            (std::vector<Admit>{Admit::kStart, Admit::kRejectTooLarge, Admit::kRejectTooLarge}));
  EXPECT_EQ(admissionBlocks({9, 63, true}, 4), 3u);
  EXPECT_EQ(admissionBlocks({9, 63, false}, 4), 16u);
}

TEST(PlanAdmission, StopsAtTheRunningLimit) {
  const std::vector<WaitingSequence> waiting = {{1, 2}, {1, 2}, {1, 2}};
  EXPECT_EQ(planAdmission(waiting, 8, 8, 4, 6, 8).size(), 2u);
}

TEST(PlanStep, SharesTheTokenBudgetOldestFirst) {
  // A decode (history 9, 8 computed) and two prefills of 20 tokens; budget 16.
  const std::vector<RunningSequence> running = {{9, 8, 3}, {20, 0, 6}, {20, 0, 6}};
  const StepPlan p =
      planStep(running, {.token_budget = 16, .max_rows = 64, .block_size = 4, .free_blocks = 10});
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].chunk, 1u);
  EXPECT_TRUE(p.chunks[0].wants_row);
  EXPECT_EQ(p.chunks[1].index, 1u);
  EXPECT_EQ(p.chunks[1].chunk, 15u);
  EXPECT_FALSE(p.chunks[1].wants_row);  // the chunk does not end its history
  EXPECT_EQ(p.preempt, 0u);
}

TEST(PlanStep, CapsRowsPerStep) {
  const std::vector<RunningSequence> running = {{5, 4, 2}, {5, 4, 2}, {5, 4, 2}};
  const StepPlan p =
      planStep(running, {.token_budget = 64, .max_rows = 2, .block_size = 4, .free_blocks = 0});
  EXPECT_EQ(p.chunks.size(), 2u);
}

TEST(PlanStep, PreemptsTheNewestToMakeBlocks) {
  // The first sequence crosses into a new block with none free: the newest gives its 2 back.
  const std::vector<RunningSequence> running = {{9, 8, 2}, {5, 4, 2}, {5, 4, 2}};
  const StepPlan p =
      planStep(running, {.token_budget = 64, .max_rows = 64, .block_size = 4, .free_blocks = 0});
  EXPECT_EQ(p.preempt, 1u);
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].blocks_needed, 3u);
  EXPECT_EQ(p.chunks[1].index, 1u);
}

TEST(PlanStep, TheNewestThatCannotFitWaitsItself) {
  const std::vector<RunningSequence> running = {{5, 4, 2}, {9, 8, 2}};
  const StepPlan p =
      planStep(running, {.token_budget = 64, .max_rows = 64, .block_size = 4, .free_blocks = 0});
  EXPECT_EQ(p.preempt, 1u);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].index, 0u);
}

// A sequence in a step in flight is not planned again, and while one is in flight nothing is
// preempted: the first sequence that does not fit ends the plan.
TEST(PlanStep, LeavesSequencesInFlightAloneAndPreemptsNothingMeanwhile) {
  const std::vector<RunningSequence> running = {
      {5, 4, 2, /*in_flight=*/true}, {5, 4, 2}, {9, 8, 2}, {5, 4, 2}};
  const StepPlan p =
      planStep(running, {.token_budget = 64, .max_rows = 64, .block_size = 4, .free_blocks = 0});
  EXPECT_EQ(p.preempt, 0u);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].index, 1u);  // the third needs a block none can give: planning stops
  const std::vector<RunningSequence> none_in_flight = {{5, 4, 2}, {5, 4, 2}, {9, 8, 2}, {5, 4, 2}};
  EXPECT_EQ(planStep(none_in_flight,
                     {.token_budget = 64, .max_rows = 64, .block_size = 4, .free_blocks = 0})
                .preempt,
            1u);
}

TEST(PlanStep, NothingToComputeGivesAnEmptyPlan) {
  const std::vector<RunningSequence> running = {{5, 5, 2}};
  const StepPlan p =
      planStep(running, {.token_budget = 64, .max_rows = 64, .block_size = 4, .free_blocks = 0});
  EXPECT_TRUE(p.chunks.empty());
  EXPECT_EQ(p.preempt, 0u);
}

}  // namespace
}  // namespace bulkhead
