// The Backend interface: what a worker runs a step on. The CPU reference engine and the CUDA
// engine both implement it, and both must give a sequence the same logits however it is batched
// or chunked (see DESIGN.md, "Determinism").
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "shared/model_config.h"
#include "shared/status.h"
#include "shared/step_types.h"

namespace bulkhead {

struct BackendLimits {
  uint32_t vocab_size = 0;
  uint32_t max_context = 0;
  uint32_t kv_block_size = 0;
  uint32_t kv_block_count = 0;
  uint32_t max_step_tokens = 0;  // tokens across all sequences of one step
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual BackendLimits limits() const = 0;

  // Appends each sequence's tokens to its KV cache and writes the requested logits rows:
  // `logits[r]` receives vocab_size floats for the r-th requested row, counting sequence by
  // sequence in batch order. Invalid input is rejected with INVALID_ARGUMENT before any state
  // changes.
  virtual Status step(std::span<const SequenceStep> batch, std::span<float* const> logits) = 0;

  // Fault injection: flips one bit of the weights the backend computes from (its own copy, not
  // the checkpoint), so integrity checks can be proven against a real corruption.
  virtual Status flipWeightBit(uint64_t byte_offset, uint8_t bit) = 0;
  virtual uint64_t residentWeightBytes() const = 0;

  // Scrubbing. Tensors are numbered as Checkpoint::usedTensors(); ranges are byte ranges of one
  // tensor. The checksum is shared/checksum.h's checksumBytes of the resident copy.
  virtual Result<uint64_t> residentChecksum(size_t tensor, uint64_t offset, uint64_t bytes) = 0;
  // Rewrites the resident range from the checkpoint's (host) bytes.
  virtual Status repairResident(size_t tensor, uint64_t offset, uint64_t bytes) = 0;
};

// Checks a step against the backend's limits: token ids, positions, block tables, logits rows.
Status validateStep(std::span<const SequenceStep> batch, std::span<float* const> logits,
                    const BackendLimits& limits);

}  // namespace bulkhead
