// validateStep: every field of a step checked before a backend touches its KV cache; runStep for
// callers that do not overlap steps with anything.
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "worker/backend.h"

namespace bulkhead {

Status validateStep(std::span<const SequenceStep> batch, std::span<const RowOutput> rows,
                    const BackendLimits& limits) {
  if (batch.empty()) return invalidArgument("step has no sequences");
  uint64_t total_tokens = 0;
  uint64_t total_rows = 0;
  std::unordered_set<uint64_t> sequence_ids;
  std::unordered_map<uint32_t, uint64_t> block_owner;
  for (const SequenceStep& s : batch) {
    const std::string where = "sequence " + std::to_string(s.sequence_id);
    if (!sequence_ids.insert(s.sequence_id).second)
      return invalidArgument(where + " appears twice in one step");
    if (s.tokens.empty()) return invalidArgument(where + ": no tokens");
    for (uint32_t t : s.tokens) {
      if (t >= limits.vocab_size)
        return invalidArgument(where + ": token id " + std::to_string(t) + " >= vocab size " +
                               std::to_string(limits.vocab_size));
    }
    const uint64_t end = uint64_t(s.start_position) + s.tokens.size();
    if (end > limits.max_context)
      return invalidArgument(where + ": positions up to " + std::to_string(end) +
                             " exceed the context limit " + std::to_string(limits.max_context));
    const uint64_t blocks_needed = (end + limits.kv_block_size - 1) / limits.kv_block_size;
    if (s.kv_blocks.size() < blocks_needed)
      return invalidArgument(where + ": block table has " + std::to_string(s.kv_blocks.size()) +
                             " blocks, positions up to " + std::to_string(end) + " need " +
                             std::to_string(blocks_needed));
    for (size_t i = 0; i < blocks_needed; ++i) {
      const uint32_t b = s.kv_blocks[i];
      if (b >= limits.kv_block_count)
        return invalidArgument(where + ": KV block " + std::to_string(b) + " out of range (" +
                               std::to_string(limits.kv_block_count) + " blocks)");
      auto [it, inserted] = block_owner.emplace(b, s.sequence_id);
      if (!inserted)
        return invalidArgument(where + ": KV block " + std::to_string(b) +
                               " is also used by sequence " + std::to_string(it->second) +
                               (it->second == s.sequence_id ? " (twice)" : ""));
    }
    int64_t previous = -1;
    for (uint32_t r : s.logits_rows) {
      if (r >= s.tokens.size())
        return invalidArgument(where + ": logits row " + std::to_string(r) + " outside its " +
                               std::to_string(s.tokens.size()) + " tokens");
      if (int64_t(r) <= previous)
        return invalidArgument(where + ": logits rows must be strictly ascending");
      previous = r;
    }
    total_tokens += s.tokens.size();
    total_rows += s.logits_rows.size();
  }
  if (total_tokens > limits.max_step_tokens)
    return invalidArgument("step carries " + std::to_string(total_tokens) +
                           " tokens, the limit is " + std::to_string(limits.max_step_tokens));
  if (total_rows != rows.size())
    return invalidArgument("step asks for " + std::to_string(total_rows) + " logits rows but " +
                           std::to_string(rows.size()) + " destinations were given");
  for (const RowOutput& row : rows) {
    if (row.payload == nullptr) return invalidArgument("null logits destination");
    if (row.check == nullptr) return invalidArgument("null row check destination");
  }
  return okStatus();
}

Status runStep(Backend& backend, std::span<const SequenceStep> batch,
               std::span<float* const> payloads) {
  std::vector<RowCheck> checks(payloads.size());
  std::vector<RowOutput> rows(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) rows[i] = {payloads[i], &checks[i]};
  BULKHEAD_RETURN_IF_ERROR(backend.enqueueStep(batch, rows));
  WeightReadVerdict verdict;
  BULKHEAD_RETURN_IF_ERROR(backend.waitStep(verdict));
  if (!verdict.failed_tensor.empty())
    return dataLoss("the step read " + verdict.failed_tensor +
                    " wrongly: its in-step checksum does not match the checkpoint");
  return okStatus();
}

}  // namespace bulkhead
