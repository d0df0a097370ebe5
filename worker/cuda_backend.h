// The CUDA backend: every weight resident in its own tagged device slot (or, for products' weights
// beyond a device budget, streamed from pinned host memory through staging slots every step), a
// paged bf16 KV cache, and a forward pass of our own kernels (cuda/), every product on the
// invariant tensor-core kernel (cuda/gemm.cuh), launched on one stream (decode steps as a graph)
// by enqueueStep() and waited for in waitStep(). Logits rows go straight into the host-registered
// arena with their checksum and finite flag computed on the device, and every step checks itself:
// slot tags before it runs, the folded words of every weight its kernels load (the products'
// included), and the arithmetic check of every product (DESIGN.md, "Integrity").
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/gemm.cuh"
#include "cuda/rms_norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/step_checks.cuh"
#include "shared/checkpoint.h"
#include "worker/backend.h"
#include "worker/slot_tags.h"
#include "worker/staging_ring.h"
#include "worker/weight_residency.h"

namespace bulkhead {

struct CudaState;  // the device resources, defined where they are used

class CudaBackend final : public Backend {
 public:
  struct Options {
    int device = 0;
    uint32_t kv_block_size = 16;
    uint32_t kv_blocks = 0;  // 0: kv_memory_share of the memory free after the weights
    double kv_memory_share = 0.5;
    uint32_t max_step_tokens = 8192;
    bool check_weight_reads = true;
    float attention_scale_factor = 1.0f;  // fault injection, as CpuBackend::Options
    bool cuda_graphs = true;  // decode steps as graphs (the numbers are the same without)
    // A step's kernels launched programmatically (cuda/launch.cuh) where the device and the
    // build support it: each may begin, and load its weights, while the one before it finishes.
    // The numbers are the same either way.
    bool programmatic_launch = true;
    // Every product through workspace-0 cuBLAS (cuda/matmul.cuh) instead of our kernel. Its rows
    // keep their bits whatever the row count (tests/gpu/matmul_gpu_test.cpp, 1 to 2,048 rows),
    // but they are not our kernel's bits, so the name (the key of canary records) says which.
    // Faster at the 7B's shapes, most at 33-64 rows and in prefill (cuda/PERFORMANCE.md), but
    // cuBLAS cannot fold the words it loads: the arithmetic check with the canonical column sums,
    // computed in the kernels around each product, is then its weights' only in-step check, and
    // a flipped weight bit inside its tolerance changes released tokens until the scrubber's pass
    // finds it (chaos on the 7B mismatched requests). So it is off unless asked for.
    bool cublas_products = false;
    // The product's schedule per bucket of rows (cuda/gemm.cuh): the same bits in each, so it
    // changes speed only. With the default buckets, steps of 33-64 rows take each product's
    // schedule from its shape (cuda::gemmScheduleAt33To64).
    cuda::GemmScheduleBuckets gemm_schedules = cuda::kDefaultGemmSchedules;
    // Split counts other than cuda::gemmSplits' for some weight shapes (bench-engine
    // --gemm-splits, to measure them in whole steps): other numbers for those shapes.
    std::vector<cuda::GemmSplitsFor> gemm_splits;
    // Schedules other than the bucket's for some weight shapes in steps of 33 to 95 rows
    // (bench-engine --gemm-shape-schedules): the same numbers.
    std::vector<cuda::GemmScheduleFor> gemm_shape_schedules;
    // Measurement (bench-engine --kernel-times): a timed event after every launch of a step, so
    // that takeLaunchTimes() says where the device time goes. Steps then run uncaptured (no
    // graphs) and each launch waits for the event before it: slower, the same numbers.
    bool kernel_times = false;
    // The attention output's and the MLP's products add into the residual stream in their own
    // epilogue, keeping the norm tiles' partials of its sum of squares (cuda/norm_partials.cuh),
    // so a norm only adds a row's partials up: no delta buffer, no reduction of the norm's own.
    // The norms then sum in another order than without (either way the same numbers whatever
    // the batch, graphs or chunking; not the same as each other). Not with cuBLAS products.
    bool residual_in_products = false;
    // With residual_in_products: in steps of 1 to 8 rows, the q/k/v and gate/up products
    // normalise their own tokens as they load them (cuda/gemm.cuh GemmNormedInput) instead of
    // reading a norm kernel's output: two launches a layer fewer, the same numbers.
    bool norm_in_products = false;
    // In steps of 1 to 8 rows, the down product computes silu(gate) * up as its tokens load
    // (cuda/gemm.cuh GemmActivatedInput) instead of reading the activation kernel's output: one
    // launch a layer fewer, the same numbers.
    bool silu_in_products = false;
    // In decode steps (every row its sequence's only one), the attention kernel does the q/k/v
    // kernel's work itself (cuda/attention.cuh AttentionArgs::rope_in): biases, rotation, the
    // new key and value into the cache. One launch a layer fewer, the same numbers. Unset: on
    // for head sizes up to 64 (faster there; at 128 the kernel's registers cost more than the
    // launch saves).
    std::optional<bool> rope_in_attention;
    // In prefill steps, attention in tiles of up to 4 (head size 128) or 8 consecutive rows of
    // one sequence a block, sharing each chunk's key and value loads (cuda/attention.cuh
    // AttentionArgs::tiles), instead of a block a row: the same numbers, prefill 2-2.4 times as
    // fast on long prompts (cuda/PERFORMANCE.md).
    bool attention_tiles = true;
    // In steps of at most this many rows (0: none), the CUDA-core attention takes each row's
    // chunks of positions two at a time (cuda/attention.cuh AttentionArgs::paired_chunks): both
    // chunks' keys and values load together, each chunk's arithmetic as alone, so the same
    // numbers. Head sizes up to cuda::kAttentionPairedHeads; not in prefill tiles.
    uint32_t attention_paired_rows = 0;
    // Attention on the tensor cores (cuda/attention_mma.cuh) in every step, prefill and decode:
    // tiles of a sequence's rows and one KV head's query heads, scores and values multiplied by
    // mma.sync. Other numbers than the CUDA-core kernel's (each the same whatever the batch,
    // chunking or graphs), so one or the other for a model's whole life; not with
    // rope_in_attention. For head sizes 64 and 128 (up to 64 query heads a KV head). Off by
    // default: prefill is faster with it, decode steps at short contexts slower
    // (cuda/PERFORMANCE.md).
    bool attention_mma = false;
    // lm_head stores its logits rows to their destinations (the arena's slots) as it computes
    // them, so they cross PCIe during the product instead of in a copy after it; the rows kernel
    // then only checksums them from the device copy. The same rows either way.
    bool logits_in_product = true;
    // Device bytes for the weights: the resident ones and the staging slots the streamed ones
    // pass through. The products' weights beyond it (units: a layer's q/k/v, o, gate/up or down,
    // an untied lm_head) are copied from pinned host memory every step, on a stream of their
    // own, each into a staging slot while the products before it run (worker/weight_residency.h
    // picks them). The kernels read a staging slot as they read a resident one, so the numbers
    // are the same. 0: every weight resident.
    uint64_t weight_budget = 0;
    std::vector<std::string> streamed_units;  // units streamed whatever the budget (by name)
    uint64_t stream_larger_than = 0;          // units of more bytes streamed whatever the budget
    uint32_t staging_slots = 2;
  };

  static Result<std::unique_ptr<CudaBackend>> create(std::shared_ptr<const Checkpoint> checkpoint,
                                                     const Options& options);
  ~CudaBackend() override;

  // The name keys canary records: "cuda", with "-cublas" for cuBLAS products and "-mma" for
  // attention on the tensor cores, whose numbers differ.
  std::string_view name() const override;
  const ModelConfig& config() const override { return checkpoint_->config(); }
  const BackendLimits& limits() const override { return limits_; }
  Status registerOutputs(std::span<std::byte> memory) override;
  Status enqueueStep(std::span<const SequenceStep> batch, std::span<const RowOutput> rows) override;
  Status waitStep(WeightReadVerdict& verdict) override;
  Status flipWeightBit(uint64_t byte_offset, uint8_t bit) override;
  Result<std::string> staleSlot(uint64_t selector) override;
  Result<std::string> computeFault(uint64_t selector) override;
  Status residentChecksums(std::span<const WeightRange> ranges, std::span<uint64_t> out) override;
  Status repairResident(const WeightRange& range) override;
  std::vector<LaunchTime> takeLaunchTimes() override;

  // Whether the product checks are all zero, as every step leaves them for the next (tests).
  Result<bool> productChecksCleared() const;
  // Steps that ran as a captured graph (tests and stats).
  uint64_t graphLaunches() const { return graph_launches_; }
  // Of those, the ones whose graph runs attention's splits side by side (as its key says: what
  // was captured, not what the step asked for).
  uint64_t parallelGraphLaunches() const { return parallel_graph_launches_; }
  // Decode steps captured so far, one graph for each key (tests).
  size_t capturedGraphs() const;
  // Steps whose attention ran a row's splits side by side (tests and stats).
  uint64_t parallelAttentionSteps() const { return parallel_attention_steps_; }
  // Steps whose attention ran in prefill tiles (Options::attention_tiles).
  uint64_t tiledAttentionSteps() const { return tiled_attention_steps_; }
  // Steps whose attention took its chunks two at a time (Options::attention_paired_rows).
  uint64_t pairedAttentionSteps() const { return paired_attention_steps_; }
  // Steps whose attention ran on the tensor cores (Options::attention_mma).
  uint64_t mmaAttentionSteps() const { return mma_attention_steps_; }
  // Steps whose lm_head stored the logits rows itself (Options::logits_in_product).
  uint64_t productStoredRowSteps() const { return product_stored_row_steps_; }
  // Steps computed a second time because a product's check strayed beyond what rounding does in
  // practice (waitStep), and of those, the ones whose second computation gave the same logits
  // (rounding after all: the step passed).
  uint64_t recomputedSteps() const { return recomputed_steps_; }
  // Steps that copied streamed weights in (Options::weight_budget, streamed_units).
  uint64_t streamedSteps() const { return streamed_steps_; }
  uint64_t straysRepeated() const { return strays_repeated_; }

 private:
  // One weight role as the kernels are handed it.
  struct Weight {
    const TensorView* tensor = nullptr;  // the checkpoint's bytes
    uint32_t tensor_index = 0;           // its resident slot (usedTensors() order)
    const void* ptr = nullptr;           // the device address the launches use
    uint32_t generation = 0;             // of the slot when the binding was made
    std::string role;
    int product = -1;  // a linear layer's product role (arithmetic check)
    int fold = -1;     // a weight our kernels load: its fold account
    uint32_t salt = 0;
  };
  struct Layer {
    Weight q, k, v, o, gate, up, down, input_norm, post_norm, q_bias, k_bias, v_bias;
  };
  // A weight our kernels load, and what its reads must fold to.
  struct FoldRole {
    Weight* weight = nullptr;
    // How often a step reads it: once a token row (norms, biases), once a logits row (the final
    // norm), once a gathered row (the embedding), once (a product's weight), once a chunk of
    // logits rows (lm_head).
    enum Uses { kTokenRows, kLogitsRows, kGathered, kProducts, kLogitsChunks } uses = kTokenRows;
    // Products fold on the tensor cores (cuda/gemm.cuh productFold), modulo 2^32; the other
    // kernels word by word (foldWeightRow).
    bool folded32() const { return uses == kProducts || uses == kLogitsChunks; }
    uint64_t expected = 0;  // one full read of the checkpoint's bytes
    uint64_t words = 0;
    std::vector<uint64_t> row_expected;  // read row by row (the embedding)
  };

  CudaBackend() = default;
  Status load(const Options& options);
  // The parts of load(), in order: the weight slots (returns their bytes); the roles bound to
  // them; the products' column sums; what each folded weight must fold to (with in-step checks);
  // the KV cache (returns its blocks); the RoPE tables.
  Result<uint64_t> uploadWeights(const Options& options);
  // A weight unit (worker/weight_residency.h) and its tensors, laid out one after another.
  struct UnitTensors {
    WeightUnit unit;
    std::vector<const TensorView*> tensors;
  };
  // The products' weights as units a step reads in turn.
  static std::vector<UnitTensors> weightUnits(const ModelTensors& t);
  // Which used tensors stream (unit_of_) and where: their host copies, their staging addresses,
  // the copy stream and the staging events. Nothing when the plan streams nothing.
  Status layOutStreamed(std::span<const UnitTensors> units, const ResidencyPlan& plan);
  void fillHostCopies();
  Status bindRoles();
  Status computeColumnSums();
  void expectFolds();
  Result<uint32_t> allocateKvCache(const Options& options);
  Status uploadRopeTables();
  // The index of a used tensor (checkpoint_->usedTensors()) in used_.
  size_t usedIndex(const TensorView* tensor) const;
  Status bind(Weight& w, const TensorView* tensor, const std::string& role);
  Status allocateStep(const Options& options);
  Status warmCublas(int max_rows);
  // The step's launches on the stream, from clearing the checks to reading them back.
  Status launchForward(int tokens, int logits_rows, bool aligned);
  // launchForward() on the stream (or a graph of it, `graph`), the product checks cleared first
  // where the step before did not end with the kernel that clears them.
  Status enqueueForward(int tokens, int logits_rows, bool aligned, cudaGraphExec_t graph);
  Status launchLayer(size_t layer, int tokens);
  // The norm before layer `layer` (layers_.size(): the final norm).
  cuda::RmsNormArgs normBefore(size_t layer, int tokens) const;
  Status launchOutput(int tokens, int logits_rows, bool aligned);
  // y = x · wᵀ for each weight of `group` (one product when their slots are adjacent), outputs
  // side by side in rows `ldy` floats apart; then the armed compute fault, if one is.
  // With `normed`, the group's input is the norm it describes, not x (one product: the group's
  // slots adjacent, ours, at most cuda::kMaxNormedRows rows). With neither `normed` nor
  // `activated`, our products add their weights' expected sums and bounds themselves, from x
  // (ownChecks), for check rows check_row onwards. With `rows_to` (one of our products), each
  // output row is also stored to rows_to[row] (cuda::GemmResidual::rows_to).
  Status products(std::initializer_list<const Weight*> group, const void* x, int rows, float* y,
                  int ldy, const cuda::GemmNormedInput* normed = nullptr,
                  const cuda::GemmActivatedInput* activated = nullptr, int check_row = 0,
                  float* const* rows_to = nullptr);
  // Whether the group's slots lie one after another, each but the last ending on a 16-row tile
  // (one product for the group).
  static bool adjacentGroup(std::initializer_list<const Weight*> group);
  // The input norm of `norm`'s args, run by the products of `group` themselves when this step
  // may (norm_in_products, few rows, the group one product); else launched as its own kernel.
  // Returns the normed input to pass to products(), or null.
  Result<const cuda::GemmNormedInput*> normFor(const cuda::RmsNormArgs& norm,
                                               std::initializer_list<const Weight*> group,
                                               const char* mark_name);
  // x · wᵀ added into the residual stream (Options::residual_in_products), with the armed
  // compute fault, if one is, applied in the product.
  Status residualProduct(const Weight& w, const void* x, int rows,
                         const cuda::GemmActivatedInput* activated = nullptr);
  Status applyFault(const Weight& w, float* y, int rows, int ldy);
  // The armed fault's output of a product of n outputs over `rows` rows: row * n + column, as
  // CpuBackend picks it.
  long long faultOutput(uint64_t n, int rows) const;
  // The fold of one weight's words loaded by a product of its own (none without checks).
  cuda::GemmFold foldAlone(const Weight& w) const;
  cuda::ConsumerSums consumer(const Weight& w) const;
  // The consumer sums a kernel that writes w's input (a norm, attention, the activation) adds:
  // none where w's product is one of ours, which adds them itself (ownChecks); consumer(w) for
  // cuBLAS products.
  cuda::ConsumerSums consumerInKernel(const Weight& w) const;
  // For a product of bf16 tokens of ours over `group` (up to three weights, one product): its
  // own expected sums and bounds, check rows check_row onwards (cuda/gemm.cuh GemmNormedInput
  // without x). Nothing for cuBLAS products or without checks.
  cuda::GemmNormedInput ownChecks(std::initializer_list<const Weight*> group, int check_row) const;
  WeightReadVerdict verifySlots() const;
  WeightReadVerdict verdictOfStep() const;
  Status checkRange(const WeightRange& range) const;
  // The CUDA device is current per thread: every entry that may run on another thread than the
  // one that loaded the backend (the scrubber's, a fault's) makes this backend's device current.
  Status onDevice() const;
  // The first product role whose check strayed in the step just waited for; -1 none.
  int strayedRole() const;
  // Runs the step just waited for again and judges it by the two (waitStep).
  Status computeAgain(int strayed, WeightReadVerdict& verdict);
  // Kernel times (Options::kernel_times): the launches since the last mark were `what`
  // (nullptr: a start, timed as nothing). collectLaunchTimes() adds a finished step's marks up.
  Status mark(const char* what);
  // Whether this step's lm_head stores its rows itself: logits_in_product, except through cuBLAS
  // or with a compute fault armed (which flips an output after the product).
  bool lmHeadStoresRows() const;
  Status launchAttention(const Layer& L, const cuda::QkvArgs& qa, bool rope_in, int n);
  // Writes the step's tensor-core attention tiles (cuda/attention_mma.cuh MmaAttentionArgs::tiles)
  // to `tiles`: each sequence's rows in runs that fill a tile with their KV group's query heads,
  // a tile for each KV head. Returns how many.
  int mmaTiles(std::span<const SequenceStep> batch, uint32_t* tiles) const;
  Status collectLaunchTimes();
  // Streamed weights within a step's launches, in the order ring_ gives (worker/staging_ring.h):
  // beginStaging() forks the copy stream from the step and starts the first copies; a product of
  // a streamed unit first waits for its copy (awaitStaged), and once launched frees its slot for
  // a later unit's copy (releaseStaged); endStaging() joins the copy stream back. Nothing for
  // resident weights.
  Status beginStaging();
  Status awaitStaged(const Weight& w);
  Status releaseStaged(const Weight& w);
  Status endStaging();
  Status issueStaging(std::span<const StagingRing::Op> ops);

  std::shared_ptr<const Checkpoint> checkpoint_;
  BackendLimits limits_;
  float attention_scale_ = 1.0f;
  bool graphs_ = true;
  bool kernel_times_ = false;
  bool residual_in_products_ = false;
  bool norm_in_products_ = false;
  bool silu_in_products_ = false;
  bool rope_in_attention_ = false;
  bool attention_tiles_ = false;
  uint32_t attention_paired_rows_ = 0;  // Options::attention_paired_rows
  bool attention_mma_ = false;
  bool cublas_products_ = false;  // Options::cublas_products
  bool logits_in_product_ = true;
  cuda::GemmNormedInput normed_input_;  // normFor()'s, for the products launched after it
  cuda::GemmScheduleBuckets gemm_schedules_ = {};
  std::vector<cuda::GemmSplitsFor> gemm_splits_;
  std::vector<cuda::GemmScheduleFor> gemm_shape_schedules_;
  // The schedule a product of this shape runs with in a step of `rows` rows.
  cuda::GemmSchedule scheduleFor(int n, int k, int rows) const;
  // The split count a product of this shape runs with: 0 (cuda::gemmSplits) unless overridden.
  int splitsFor(int n, int k) const;
  int device_ = 0;
  uint64_t graph_launches_ = 0;
  uint64_t parallel_attention_steps_ = 0;
  uint64_t parallel_graph_launches_ = 0;
  uint64_t paired_attention_steps_ = 0;
  uint64_t tiled_attention_steps_ = 0;
  uint64_t mma_attention_steps_ = 0;
  uint64_t product_stored_row_steps_ = 0;
  uint64_t recomputed_steps_ = 0, strays_repeated_ = 0;
  uint64_t streamed_steps_ = 0;
  std::unique_ptr<CudaState> d_;
  std::vector<const TensorView*> used_;
  SlotTags slot_tags_;
  // Streamed units in step order (their host copies), and per used tensor: its unit (-1:
  // resident), its host copy and its address in its unit's staging slot.
  struct StreamedUnit {
    const std::byte* host = nullptr;
    size_t bytes = 0;
  };
  std::vector<StreamedUnit> streamed_;
  std::vector<int> unit_of_;
  std::vector<std::byte*> host_at_, staged_at_;
  uint32_t staging_slots_ = 0;
  size_t slot_bytes_ = 0;
  StagingRing ring_{0, 1};  // the copies and waits of the step being launched
  Weight embed_, lm_head_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<Weight*> weights_;  // every role, for slot checks and fault injection
  std::vector<Weight*> linear_;   // by product role
  std::vector<FoldRole> folds_;
  int product_roles_ = 0;
  // Whether the product checks may hold a step's sums: the kernel that counts them at the end of a
  // step clears them, so they are dirty only after a step that was not enqueued whole.
  bool products_dirty_ = true;
  // Fault injection: the product role and selector of the next step's faulty multiply; -1 none.
  int fault_role_ = -1;
  uint64_t fault_selector_ = 0;
  // The step between enqueueStep() and waitStep().
  struct Pending {
    bool queued = false;
    int tokens = 0;
    bool aligned = true;  // every logits destination 16-byte aligned
    // Few rows, one over a long context: attention runs each row's splits side by side.
    bool parallel_attention = false;
    // Blocks a (row, head) then: the longest row's splits rounded up to a power of two, at most
    // cuda::kAttentionSplitBlocks (1 when not side by side).
    int split_blocks = 1;
    // Every row is its sequence's only row (a decode step): no row attends to another's key.
    bool decode_rows = false;
    // Attention tiles in the inputs (attention_tiles in prefill steps, or attention_mma's in
    // every step), 0: a block a row.
    int attention_tiles = 0;
    // The CUDA-core attention takes each row's chunks two at a time (attention_paired_rows): a
    // function of the rows and the tiles, so a graph's key decides it.
    bool paired_chunks = false;
    std::vector<RowOutput> rows;
    std::vector<bool> copied_out;    // rows outside the registered arena: through the fallback
    std::vector<uint32_t> gathered;  // token ids, for the embedding's expected fold
  } pending_;
};

}  // namespace bulkhead
