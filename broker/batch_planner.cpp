// The batch planner's two decisions (see broker/batch_planner.h).
#include "broker/batch_planner.h"

#include <algorithm>

namespace bulkhead {

std::vector<Admit> planAdmission(std::span<const WaitingSequence> waiting, uint32_t free_blocks,
                                 uint32_t total_blocks, uint32_t block_size, size_t running,
                                 size_t max_running) {
  std::vector<Admit> out;
  for (const WaitingSequence& s : waiting) {
    if (running >= max_running) break;
    if (admissionBlocks(s, block_size) > total_blocks) {
      out.push_back(Admit::kRejectTooLarge);
      continue;
    }
    const uint32_t need = blocksFor(uint64_t(s.history) + 1, block_size);
    if (need > free_blocks) break;
    free_blocks -= need;
    ++running;
    out.push_back(Admit::kStart);
  }
  return out;
}

StepPlan planStep(std::span<const RunningSequence> running, const StepLimits& limits) {
  StepPlan plan;
  uint32_t budget = limits.token_budget, rows = 0, free = limits.free_blocks;
  size_t end = running.size();  // sequences at [end, size) are preempted
  const bool may_preempt = std::none_of(running.begin(), running.end(),
                                        [](const RunningSequence& s) { return s.in_flight; });
  for (size_t i = 0; i < end && budget > 0 && rows < limits.max_rows; ++i) {
    const RunningSequence& s = running[i];
    if (s.in_flight) continue;
    const uint32_t chunk = std::min(s.history - s.computed, budget);
    if (chunk == 0) continue;
    const uint32_t needed = blocksFor(uint64_t(s.computed) + chunk, limits.block_size);
    const uint32_t extra = needed > s.blocks_held ? needed - s.blocks_held : 0;
    if (!may_preempt && free < extra) break;
    while (free < extra && end - 1 > i) {
      --end;
      free += running[end].blocks_held;
    }
    if (free < extra) {
      end = i;  // the newest sequence still does not fit: it waits too
      break;
    }
    free -= extra;
    const bool wants_row = s.computed + chunk == s.history;
    rows += wants_row ? 1 : 0;
    budget -= chunk;
    plan.chunks.push_back({i, chunk, wants_row, std::max(needed, s.blocks_held)});
  }
  plan.preempt = running.size() - end;
  return plan;
}

}  // namespace bulkhead
