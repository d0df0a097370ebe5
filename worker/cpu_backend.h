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
    // Work below which a kernel runs on one thread (multiply-adds; tests lower it to 0).
    int64_t parallel_macs = int64_t(1) << 18;
  };

  // Copies the weights out of the checkpoint: the engine computes from its own copy, so the
  // mapped file stays a clean reference to repair from.
  static Result<std::unique_ptr<CpuBackend>> create(std::shared_ptr<const Checkpoint> checkpoint,
                                                    const Options& options);

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& config() const override { return checkpoint_->config(); }
  const BackendLimits& limits() const override { return limits_; }
  Status enqueueStep(std::span<const SequenceStep> batch, std::span<const RowOutput> rows) override;
  Status waitStep() override;
  Status flipWeightBit(uint64_t byte_offset, uint8_t bit) override;
  Status residentChecksums(std::span<const WeightRange> ranges, std::span<uint64_t> out) override;
  Status repairResident(const WeightRange& range) override;

 private:
  // A norm weight or bias kept in its checkpoint dtype, converted when a step uses it, so every
  // resident byte is a copy of a checkpoint byte and can be scrubbed against it.
  struct Vector {
    DType dtype = DType::kF32;
    const std::byte* data = nullptr;  // null: absent
    int n = 0;
  };
  struct Layer {
    cpu::WeightMatrix q, k, v, o, gate, up, down;
    Vector input_norm, post_norm, q_bias, k_bias, v_bias, o_bias;
  };

  // The step between enqueueStep() and waitStep(), with its own copy of every list.
  struct PendingStep {
    bool queued = false;
    std::vector<uint32_t> lists;
    std::vector<SequenceStep> batch;  // spans into `lists`
    std::vector<RowOutput> rows;
  };

  CpuBackend() = default;
  // The forward pass of a validated step.
  void forward(std::span<const SequenceStep> batch, std::span<const RowOutput> logits);
  Status checkRange(const WeightRange& range) const;
  float* kvAt(float* cache, int layer, uint32_t block, int kv_head, uint32_t slot) const;

  std::shared_ptr<const Checkpoint> checkpoint_;
  BackendLimits limits_;
  int64_t parallel_macs_ = 0;
  std::unique_ptr<std::byte[]> weight_bytes_;
  // checkpoint_->usedTensors(), and the resident copy of each, in that order.
  std::vector<const TensorView*> used_;
  std::vector<std::byte*> resident_;
  cpu::WeightMatrix embed_, lm_head_;
  Vector final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  // [layer][block][kv_head][slot][head_dim]
  // Left uninitialised: a slot is always written before it is read.
  std::unique_ptr<float[]> k_cache_, v_cache_;
  PendingStep pending_;
};

}  // namespace bulkhead
