// One sequence's part of a step, as the broker asks for it and a backend executes it.
#pragma once

#include <cstdint>
#include <span>

namespace bulkhead {

struct SequenceStep {
  uint64_t sequence_id = 0;
  // Tokens already in this sequence's KV cache; `tokens` occupy the positions after it.
  uint32_t start_position = 0;
  // A prefill chunk of any length, or a single decode token.
  std::span<const uint32_t> tokens;
  // Block table: block i holds positions [i * kv_block_size, (i + 1) * kv_block_size).
  std::span<const uint32_t> kv_blocks;
  // Indices into `tokens` whose logits are wanted, strictly ascending.
  std::span<const uint32_t> logits_rows;
};

}  // namespace bulkhead
