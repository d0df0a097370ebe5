// The CPU reference engine: a float32 forward pass of the Llama family over a paged KV cache.
// It is the numerical reference the CUDA backend is tested against and a complete backend in
// its own right (tests, small models, machines without a GPU).
#pragma once

#include <memory>
#include <vector>

#include "shared/checkpoint.h"
#include "worker/backend.h"
#include "worker/cpu_kernels.h"

namespace bulkhead {

class CpuBackend final : public Backend {
 public:
  struct Options {
    uint32_t kv_block_size = 16;
    uint32_t kv_blocks = 0;  // 0: sized from kv_budget_bytes
    uint64_t kv_budget_bytes = 1ull << 30;
    uint32_t max_step_tokens = 8192;
  };

  // Copies the weights out of the checkpoint: the engine computes from its own copy, so the
  // mapped file stays a clean reference to repair from.
  static Result<std::unique_ptr<CpuBackend>> create(std::shared_ptr<const Checkpoint> checkpoint,
                                                    const Options& options);

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& config() const override { return checkpoint_->config(); }
  BackendLimits limits() const override { return limits_; }
  Status step(std::span<const SequenceStep> batch, std::span<float* const> logits) override;
  Status flipWeightBit(uint64_t byte_offset, uint8_t bit) override;
  uint64_t residentWeightBytes() const override { return weight_size_; }

 private:
  struct Layer {
    cpu::WeightMatrix q, k, v, o, gate, up, down;
    std::vector<float> input_norm, post_norm, q_bias, k_bias, v_bias, o_bias;
  };

  CpuBackend() = default;
  float* kvAt(float* cache, int layer, uint32_t block, int kv_head, uint32_t slot) const;

  std::shared_ptr<const Checkpoint> checkpoint_;
  BackendLimits limits_;
  std::unique_ptr<std::byte[]> weight_bytes_;
  std::byte* weights_ = nullptr;  // 64-byte aligned start inside weight_bytes_
  uint64_t weight_size_ = 0;
  cpu::WeightMatrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  // [layer][block][kv_head][slot][head_dim]
  // Left uninitialised: a slot is always written before it is read.
  std::unique_ptr<float[]> k_cache_, v_cache_;
};

}  // namespace bulkhead
