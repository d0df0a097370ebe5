// decodeStep: sizes first, then one copy of every list.
#include "worker/step_decode.h"

#include <string>

namespace bulkhead {

Status decodeStep(wire::Step::Reader step, const BackendLimits& limits, uint32_t arena_slots,
                  std::vector<uint32_t>& lists, std::vector<SequenceStep>& batch,
                  uint32_t& total_rows) {
  auto seqs = step.getSequences();
  if (seqs.size() > kMaxSequencesPerStep)
    return invalidArgument("step has " + std::to_string(seqs.size()) + " sequences, the limit is " +
                           std::to_string(kMaxSequencesPerStep));
  // Sizes first, so nothing oversized is copied; then one buffer holds every list.
  size_t words = 0;
  uint64_t rows = 0;
  for (auto s : seqs) {
    const size_t tokens = s.getTokens().size(), blocks = s.getKvBlocks().size();
    const size_t logits_rows = s.getLogitsRows().size();
    if (tokens > limits.max_step_tokens || blocks > limits.kv_block_count || logits_rows > tokens)
      return invalidArgument("sequence " + std::to_string(s.getSequenceId()) +
                             ": list lengths exceed the worker's limits");
    words += tokens + blocks + logits_rows;
    rows += logits_rows;
  }
  if (rows + step.getFirstSlot() > arena_slots)
    return resourceExhausted("step asks for " + std::to_string(rows) + " logits rows from slot " +
                             std::to_string(step.getFirstSlot()) + ", the arena holds " +
                             std::to_string(arena_slots));
  lists.resize(words);
  batch.clear();
  size_t at = 0;
  auto copy = [&](auto list) {
    const size_t begin = at;
    for (uint32_t v : list) lists[at++] = v;
    return std::span<const uint32_t>(lists.data() + begin, list.size());
  };
  for (auto s : seqs) {
    const auto tokens = copy(s.getTokens());
    const auto blocks = copy(s.getKvBlocks());
    batch.push_back({.sequence_id = s.getSequenceId(),
                     .start_position = s.getStartPosition(),
                     .tokens = tokens,
                     .kv_blocks = blocks,
                     .logits_rows = copy(s.getLogitsRows())});
  }
  total_rows = uint32_t(rows);
  return okStatus();
}

}  // namespace bulkhead
