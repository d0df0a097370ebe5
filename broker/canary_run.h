// Running the canary on a worker: its steps (the prefix, then the continuation that rides along
// with client steps), the verified rows they return, and their qualification against the
// reference engine. Used by the worker slot and by `bulkhead qualify`.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "broker/canary.h"
#include "broker/row_sampling.h"
#include "broker/worker_connection.h"
#include "shared/step_types.h"

namespace bulkhead {

// The canary's tokens and KV blocks for one worker: blocks 0 .. n-1, which the broker never hands
// to a sequence. The steps hold spans into the plan, so they live as long as it does.
class CanaryPlan {
 public:
  // nullopt when the worker is too small for the canary (it must leave sequences a block).
  static std::optional<CanaryPlan> forWorker(const WorkerHello& hello);
  CanaryPlan(const CanaryPlan&) = delete;
  CanaryPlan& operator=(const CanaryPlan&) = delete;
  CanaryPlan(CanaryPlan&&) = default;
  CanaryPlan& operator=(CanaryPlan&&) = default;

  // The 16-token prefix, asking for its last row.
  SequenceStep prefix() const;
  // The one-token continuation at position 16 over the prefix's blocks, asking for its row.
  SequenceStep ride() const;
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  uint32_t blocks() const { return uint32_t(blocks_.size()); }

 private:
  CanaryPlan() = default;
  std::vector<uint32_t> tokens_, blocks_;
  std::vector<uint32_t> rows_;  // {prefix's last, 0}
};

// What the full canary computed: its two rows (copied out of the arena) and their checksums.
struct CanaryRun {
  std::vector<std::vector<float>> rows;
  std::vector<uint64_t> checksums;
  uint64_t digest = 0;  // canaryDigest(checksums)
};

// One canary step, its row verified like any row: the row (its payload stays valid until the next
// call on `worker`). An error names what failed.
Result<PendingRow> runCanaryStep(WorkerConnection& worker, RowSampler& sampler,
                                 const SequenceStep& step, uint64_t step_id,
                                 std::chrono::milliseconds timeout);

// Runs the prefix, then the continuation, each verified like any row. An error names what failed.
Result<CanaryRun> runCanary(WorkerConnection& worker, RowSampler& sampler, const CanaryPlan& plan,
                            const std::function<uint64_t()>& next_step_id,
                            std::chrono::milliseconds timeout);

// The run's rows against the reference engine's, within canaryTolerance(backend).
Status qualifyCanary(const WorkerHello& hello, const CanaryPlan& plan, const CanaryRun& run,
                     const CanaryReference& reference);

}  // namespace bulkhead
