// CanaryPlan, runCanary and qualifyCanary.
#include "broker/canary_run.h"

#include <spdlog/spdlog.h>

#include "broker/batch_planner.h"
#include "broker/step_rows.h"

namespace bulkhead {

std::optional<CanaryPlan> CanaryPlan::forWorker(const WorkerHello& hello) {
  CanaryPlan plan;
  plan.tokens_ = canaryTokens(hello.vocab_size);
  const uint32_t blocks = blocksFor(plan.tokens_.size(), hello.kv_block_size);
  if (blocks >= hello.kv_block_count || hello.max_step_tokens < kCanaryPrefix ||
      hello.arena_slots == 0)
    return std::nullopt;
  for (uint32_t b = 0; b < blocks; ++b) plan.blocks_.push_back(b);
  plan.rows_ = {kCanaryPrefix - 1, 0};
  return plan;
}

SequenceStep CanaryPlan::prefix() const {
  // The last row depends on every token and layer, and on no broker setting.
  return {.sequence_id = 0,
          .start_position = 0,
          .tokens = std::span(tokens_).first(kCanaryPrefix),
          .kv_blocks = blocks_,
          .logits_rows = std::span(rows_).first(1)};
}

SequenceStep CanaryPlan::ride() const {
  return {.sequence_id = 0,
          .start_position = kCanaryPrefix,
          .tokens = std::span(tokens_).subspan(kCanaryPrefix, 1),
          .kv_blocks = blocks_,
          .logits_rows = std::span(rows_).subspan(1, 1)};
}

Result<PendingRow> runCanaryStep(WorkerConnection& worker, RowSampler& sampler,
                                 const SequenceStep& step, uint64_t step_id,
                                 std::chrono::milliseconds timeout) {
  auto result = worker.step(step_id, {&step, 1}, timeout);
  if (!result.ok()) return failedPrecondition("canary step failed: " + result.error().toString());
  if (!result->scrub.corruptions.empty())
    return failedPrecondition("canary: worker found corrupted weights in " +
                              result->scrub.corruptions[0].tensor);
  if (WorkerFailure bad = verifyRows(sampler, result->rows); !bad.ok())
    return failedPrecondition("canary row: " + bad.toString());
  return result->rows[0];
}

Result<CanaryRun> runCanary(WorkerConnection& worker, RowSampler& sampler, const CanaryPlan& plan,
                            const std::function<uint64_t()>& next_step_id,
                            std::chrono::milliseconds timeout) {
  CanaryRun run;
  for (const SequenceStep& step : {plan.prefix(), plan.ride()}) {
    BULKHEAD_ASSIGN_OR_RETURN(const PendingRow row,
                              runCanaryStep(worker, sampler, step, next_step_id(), timeout));
    run.rows.emplace_back(row.payload.begin(), row.payload.end());
    run.checksums.push_back(row.checksum);
  }
  run.digest = canaryDigest(run.checksums);
  return run;
}

Status qualifyCanary(const WorkerHello& hello, const CanaryPlan& plan, const CanaryRun& run,
                     const CanaryReference& reference) {
  if (!reference)
    return failedPrecondition(
        "canary: no record vouches for it and there is no reference engine to qualify it with");
  const uint32_t wanted[] = {kCanaryPrefix - 1, kCanaryPrefix};
  spdlog::info("qualifying the canary of {} on {} against the reference engine", hello.model_dir,
               hello.backend);
  auto expected = reference(hello, plan.tokens(), wanted);
  if (!expected.ok())
    return failedPrecondition("canary qualification: the reference engine failed: " +
                              expected.status().toString());
  std::vector<std::span<const float>> rows(run.rows.begin(), run.rows.end());
  return qualifyRows(rows, *expected, canaryTolerance(hello.backend));
}

}  // namespace bulkhead
