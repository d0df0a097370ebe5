// The Backend interface: what a worker runs a step on. The CPU reference engine and the CUDA
// engine both implement it, and both must give a sequence the same logits however it is batched
// or chunked (see DESIGN.md, "Determinism"). The contract below is what the worker relies on.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shared/checksum.h"
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
  // Batch sizes (sequences per decode step: one token and its logits row each) that run as a
  // CUDA graph, each captured the first time it is seen; ascending. Other steps run uncaptured.
  // Empty on CPU.
  std::vector<uint32_t> graph_batch_buckets;
  // Memory figures. Resident weights live in the backend's own memory for its whole life;
  // streamed ones are copied in every step (DESIGN.md, "Residency"). On CPU every weight is
  // resident and nothing is streamed.
  uint64_t resident_weight_bytes = 0;
  uint64_t streamed_weight_bytes = 0;
  uint64_t kv_cache_bytes = 0;
  // Every step checks the weight words its kernels read (WeightReadVerdict).
  bool checks_weight_reads = false;
  // A step's compute time grows about linearly with its rows (the CPU), rather than staying
  // near flat while the weights' read dominates (a GPU).
  bool compute_grows_with_rows = false;
};

// Where one requested logits row goes: vocab_size floats at `payload` (an arena slot, so the
// row reaches the reader with no host copy) and the producer's check of exactly those bytes.
struct RowOutput {
  float* payload = nullptr;
  RowCheck* check = nullptr;
};

// What a step's kernels read of the weights, checked within the step: every weight word a kernel
// loads is folded (shared/checksum.h foldWeightRow, keyed by the weight's role and the word's
// offset) through the pointer the kernel was handed, and compared at the end of the step with the
// same fold over the checkpoint's bytes, words counted. A step whose verdict names a tensor must
// not be trusted: its rows are never sampled.
// Which in-step check failed.
enum class WeightCheck : uint8_t {
  kReads,       // the words read, folded and counted, differ from the checkpoint's
  kSlotTag,     // a binding is not its tensor's tagged slot (checked before computing)
  kArithmetic,  // a product's output sums differ from the column sums dotted with its input
};

struct WeightReadVerdict {
  bool checked = false;            // the backend checks its weight reads in the step
  std::string failed_tensor = {};  // the first weight whose reads did not match; empty: all did
  std::string why = {};            // what the backend can tell: another slot than its own, or bytes
  WeightCheck failed_check = WeightCheck::kReads;  // meaningful when failed_tensor is set
  uint64_t words_read = 0;
};

// A byte range of one weight tensor. Tensors are numbered as Checkpoint::usedTensors().
struct WeightRange {
  uint32_t tensor = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Contract (CPU now, CUDA next):
//
// Steps. enqueueStep() validates the step (validateStep) and copies whatever it needs from
// `batch`: the caller may free the batch as soon as it returns. On OK exactly one waitStep() must
// follow before the next enqueueStep(); waitStep() returns once every requested row is in place.
// Row r (counting requested rows sequence by sequence in batch order) is written to
// rows[r].payload, and rows[r].check gets checkRow() of those bytes (shared/checksum.h: the
// order-independent sum of each 32-bit word's term keyed by its index in the row, and whether
// every value is finite), computed by the producer AS IT WRITES the row, never by a second pass.
// Payloads and checks belong to the backend from enqueueStep() until waitStep() returns.
//   CPU: enqueueStep() validates and copies; the forward pass runs in waitStep().
//   CUDA: enqueueStep() launches the step (graph or stream) into mapped arena memory;
//   waitStep() synchronises on its event.
//
// Errors. INVALID_ARGUMENT means the input was bad and nothing changed: no KV state, no row, no
// pending step; the worker answers Error and keeps serving. Any other error, from any method, is
// fatal: the worker logs it and exits non-zero (crash-only), since the backend's state is then
// unknown.
//
// Threads. A step, repairResident() and flipWeightBit() run on one thread at a time and never
// overlap one another (the worker orders them with a shared_mutex: steps shared, repairs and
// flips exclusive). residentChecksums() only reads and may run on another thread while a step is
// in flight; it must not slow the step down more than its memory traffic does.
// The device time of one kind of launch (a kernel, a copy) summed over steps: see
// Backend::takeLaunchTimes.
struct LaunchTime {
  std::string what;
  uint64_t launches = 0;
  double total_us = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  virtual const ModelConfig& config() const = 0;
  virtual const BackendLimits& limits() const = 0;

  // The memory logits rows will be written to (the whole arena mapping), before the first step:
  // a device backend registers it so its kernels write rows there directly. Rows elsewhere still
  // work, through a copy. The memory outlives the backend's use of it; an empty span ends it.
  virtual Status registerOutputs(std::span<std::byte> memory) { return okStatus(); }

  virtual Status enqueueStep(std::span<const SequenceStep> batch,
                             std::span<const RowOutput> rows) = 0;
  // Fills `verdict` with the in-step check of what the step read.
  virtual Status waitStep(WeightReadVerdict& verdict) = 0;

  // Fault injection: flips one bit of the weights the backend computes from (its own copy, not
  // the checkpoint), so integrity checks can be proven against a real corruption. Offsets count
  // resident_weight_bytes, tensor after tensor in usedTensors() order, with no padding.
  virtual Status flipWeightBit(uint64_t byte_offset, uint8_t bit) = 0;
  // Fault injection: the weight in role `selector % roles` is served from another resident slot
  // of the same size, or from a stale copy, while every resident byte stays intact (the failure
  // a residency table cannot see). Returns the role's tensor name.
  virtual Result<std::string> staleSlot(uint64_t selector) = 0;
  // Fault injection: in the next step, one multiply-add result of the linear layer in role
  // `selector % roles` has its highest exponent bit flipped (a faulty multiplier: the weights
  // are intact), in a row and output that the rest of `selector` picks. Returns the role's name.
  virtual Result<std::string> computeFault(uint64_t selector) = 0;

  // Scrubbing. out[i] = checksumBytes() of ranges[i] as the compute path reads it (the resident
  // copy). All ranges in one call, so a device runs them as one kernel on a side stream and the
  // host runs them in parallel; returns when `out` is filled.
  virtual Status residentChecksums(std::span<const WeightRange> ranges,
                                   std::span<uint64_t> out) = 0;
  // Rewrites one resident range from the checkpoint's (host) bytes.
  virtual Status repairResident(const WeightRange& range) = 0;

  // Measurement: the device time of each kind of launch in the steps since the last call, in
  // the order of a step's launches. Empty unless the backend was made to time its launches
  // (the CUDA backend's kernel_times), which slows its steps.
  virtual std::vector<LaunchTime> takeLaunchTimes() { return {}; }
};

// Checks a step against the backend's limits: token ids, positions, block tables, logits rows.
Status validateStep(std::span<const SequenceStep> batch, std::span<const RowOutput> rows,
                    const BackendLimits& limits);

// enqueueStep() then waitStep(), for callers that want the logits and nothing to overlap (tools,
// tests). The rows' checks are computed and dropped; a failed in-step weight check is DATA_LOSS.
Status runStep(Backend& backend, std::span<const SequenceStep> batch,
               std::span<float* const> payloads);

}  // namespace bulkhead
