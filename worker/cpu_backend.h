// The CPU reference engine: a float32 forward pass of the Llama family over a paged KV cache.
// It is the numerical reference the CUDA backend is tested against and a complete backend in
// its own right (tests, small models, machines without a GPU).
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "shared/checkpoint.h"
#include "worker/backend.h"
#include "worker/cpu_kernels.h"
#include "worker/slot_tags.h"

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
    // The kernels' thread team, the calling thread included (0: defaultThreads()).
    unsigned threads = 0;
    // Fold and check every weight word the kernels read, in every step (worker/backend.h).
    bool check_weight_reads = true;
    // Fault injection: the attention's score scale is multiplied by this, a kernel that computes
    // wrongly while every weight read and product checks out (only the canary's qualification
    // against the reference engine can see it).
    float attention_scale_factor = 1.0f;
  };

  // Copies the weights out of the checkpoint: the engine computes from its own copy, so the
  // mapped file stays a clean reference to repair from.
  static Result<std::unique_ptr<CpuBackend>> create(std::shared_ptr<const Checkpoint> checkpoint,
                                                    const Options& options);

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& config() const override { return checkpoint_->config(); }
  const BackendLimits& limits() const override { return limits_; }
  Status enqueueStep(std::span<const SequenceStep> batch, std::span<const RowOutput> rows) override;
  Status waitStep(WeightReadVerdict& verdict) override;
  Status flipWeightBit(uint64_t byte_offset, uint8_t bit) override;
  Result<std::string> staleSlot(uint64_t selector) override;
  Result<std::string> computeFault(uint64_t selector) override;
  Status residentChecksums(std::span<const WeightRange> ranges, std::span<uint64_t> out) override;
  Status repairResident(const WeightRange& range) override;

  // Replaces the kernels' thread team (tests: the logits must not depend on it).
  void setThreads(unsigned threads);
  // One a core on a small host; on a host of 8 cores or more, five eighths of them (10 of 16).
  // A team on every core shares them with whatever else wakes during a step (the broker's
  // sampling pool, its reply watch, stream writes and gRPC threads), and a member preempted
  // mid-kernel holds up the whole kernel for a scheduler time slice. Measured on a 16-core host
  // (tiny-v152k, serve-bench at concurrency 1, inter-token p99): 7.4 ms with 16 threads, 5.6
  // with 14, 3.0-5.9 with 12 (six runs), 1.5-2.3 with 10 (three runs, and more tokens/s than 12).
  static unsigned defaultThreads();

 private:
  // A norm weight or bias kept in its checkpoint dtype, converted when a step uses it, so every
  // resident byte is a copy of a checkpoint byte and can be scrubbed against it. One row; data
  // null when the model has none.
  using Vector = cpu::WeightMatrix;
  // One weight role's in-step account: what the checkpoint's bytes fold to, read in full once.
  struct ReadAccount {
    std::string tensor;
    uint64_t expected = 0;
    uint64_t words = 0;
    std::vector<uint64_t> row_expected;  // per row, for a weight read row by row (the embedding)
    cpu::ColumnSums columns;             // a linear layer's, for the arithmetic check
    cpu::WeightReads reads;
    // For diagnosis after a failed check only: the binding and the resident slot it started with.
    const cpu::WeightMatrix* binding = nullptr;
    const std::byte* slot = nullptr;
    uint32_t tensor_index = 0;           // which resident slot's tag the binding must carry
    uint32_t generation = 0;             // the slot's generation when the binding was made
    const TensorView* source = nullptr;  // the checkpoint's bytes the expectations come from
    bool by_row = false, linear = false;
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
  // The forward pass of a validated step; the embedding rows it gathered go to `gathered`.
  void forward(std::span<const SequenceStep> batch, std::span<const RowOutput> logits,
               std::vector<uint32_t>& gathered);
  // Binds `w` to its in-step account, which computeAccounts() fills from the checkpoint's bytes
  // of `tensor`. A linear layer also gets its column sums, for the arithmetic check.
  void account(cpu::WeightMatrix& w, const TensorView& tensor, const std::string& role, bool by_row,
               bool linear);
  // What every account's weight must fold to, and the linear layers' column sums: every weight
  // byte read once more, spread over the pool.
  void computeAccounts();
  WeightReadVerdict verifyReads(std::span<const uint32_t> gathered) const;
  // Before a step: every binding's pointer must be a resident slot tagged for its tensor.
  WeightReadVerdict verifySlots() const;
  Status checkRange(const WeightRange& range) const;
  float* kvAt(float* cache, int layer, uint32_t block, int kv_head, uint32_t slot) const;

  std::shared_ptr<const Checkpoint> checkpoint_;
  BackendLimits limits_;
  // Warm from enqueueStep to the end of waitStep only: between steps its cores are the host's.
  std::unique_ptr<WorkPool> pool_;
  cpu::Threads threads_;
  float attention_scale_factor_ = 1.0f;
  std::unique_ptr<std::byte[]> weight_bytes_;
  // checkpoint_->usedTensors(), and the resident copy of each, in that order.
  std::vector<const TensorView*> used_;
  std::vector<std::byte*> resident_;
  cpu::WeightMatrix embed_, lm_head_;
  Vector final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  std::deque<ReadAccount> accounts_;          // stable addresses: kernels hold their WeightReads
  std::vector<cpu::WeightMatrix*> bindings_;  // every weight role, for fault injection
  std::vector<std::string> role_names_;       // beside bindings_
  std::vector<cpu::WeightMatrix*> linear_;    // the matrices products read, for computeFault
  std::vector<std::string> linear_names_;     // beside linear_
  SlotTags slot_tags_;
  std::vector<std::unique_ptr<std::byte[]>> stale_copies_;
  // [layer][block][kv_head][slot][head_dim]
  // Left uninitialised: a slot is always written before it is read.
  std::unique_ptr<float[]> k_cache_, v_cache_;
  PendingStep pending_;
};

}  // namespace bulkhead
