// CudaBackend: weight slots, KV cache and step buffers on the device; the forward pass as a
// sequence of launches on one stream; the step's checks read back in waitStep().
#include "worker/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include <spdlog/spdlog.h>

#include "cuda/activation.cuh"
#include "cuda/attention.cuh"
#include "cuda/attention_mma.cuh"
#include "cuda/checksum.cuh"
#include "cuda/column_sums.cuh"
#include "cuda/embedding.cuh"
#include "cuda/gemm.cuh"
#include "cuda/launch.cuh"
#include "cuda/logits.cuh"
#include "cuda/matmul.cuh"
#include "cuda/norm_partials.cuh"
#include "cuda/resources.h"
#include "cuda/rms_norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/step_checks.cuh"
#include "shared/checksum.h"
#include "shared/phase_clock.h"
#include "shared/work_pool.h"
#include "worker/staged_upload.h"
#include "worker/weight_residency.h"

namespace bulkhead {

using cuda::DeviceMemory;
using cuda::PinnedMemory;

namespace {

constexpr int kLinearPerLayer = 7;  // q, k, v, o, gate, up, down
constexpr int kLogitsChunk = 64;    // lm_head rows per product
// Head sizes up to this have the attention kernel do the q/k/v kernel's work in decode steps by
// default (Options::rope_in_attention).
constexpr int kRopeInAttentionHeads = 64;
constexpr int kMaxGraphRows = 64;  // decode steps of up to this many sequences run as graphs

// The arithmetic check's bound per unit of sum_k abssum_k |x_k|: a float32 dot product of
// length k errs by at most about k * 2^-24 of its absolute terms; four times that leaves room
// for how the tensor cores order their additions.
double boundUnit(int k) {
  return double(k + 1) * std::ldexp(1.0, -22);
}

// How far a product's check differs by rounding in practice (cuda::ProductScale), for a weight
// of k columns. Each output's float accumulation takes about k / 16 tensor-core steps (plus the
// adds of the warps' and splits' partials), each rounding by at most 2^-23 of the running sum;
// those errors lean one way within an output (|produced| covers what leans alike over all
// outputs) and fall either way across outputs (sqrt(produced_sq)). kUsualMargin is the room
// left above that estimate; a step beyond it is computed again (CudaBackend::waitStep), so a
// margin too small costs time (a second computation), not a failure: rounding repeats.
constexpr double kUsualMargin = 16;
cuda::ProductScale usualScale(int k) {
  return {kUsualMargin * (double(k) / 16 + 16) * std::ldexp(1.0, -24),
          std::ldexp(1.0, -23) / boundUnit(k)};
}

// Offsets into one buffer of several arrays, each aligned to 256 bytes.
struct Layout {
  size_t bytes = 0;
  size_t add(size_t n) {
    const size_t at = bytes;
    bytes = (bytes + n + 255) & ~size_t(255);
    return at;
  }
};

}  // namespace

// Everything that lives on the device or is pinned for it.
struct CudaState {
  cuda::Stream stream, scrub_stream;
  cuda::Event done;
  DeviceMemory weights;  // every resident slot
  // One per used tensor, in usedTensors() order: its resident slot, or for a streamed tensor the
  // device's address of its pinned host copy (what the scrubber and the column sums read).
  std::vector<std::byte*> slots;
  // Streamed weights (CudaBackend::Options::weight_budget): their pinned host copies, the staging
  // slots they are copied into on copy_stream, and per staging slot the events of a unit's copy
  // landing (staged) and of its products being launched after it (freed); fork and join tie the
  // copy stream into a step's launches (and so into its graph).
  PinnedMemory streamed_host;
  std::byte* streamed_device = nullptr;  // streamed_host's address on the device
  DeviceMemory staging;
  cuda::Stream copy_stream;
  std::vector<cuda::Event> staged, freed;
  cuda::Event fork, join;
  std::vector<DeviceMemory> stale;  // stale copies made by fault injection
  DeviceMemory column_sums;         // per product role: colsum[k], then abssum[k]
  DeviceMemory product_scales;      // per product role (cuda::ProductScale)
  std::vector<const float*> colsum, abssum;
  DeviceMemory k_cache, v_cache;
  size_t kv_layer_elems = 0;
  DeviceMemory rope_cos, rope_sin;
  // Activations, max_step_tokens rows each.
  DeviceMemory x, xn, qkv, attn, delta, gate_up, act, final_rows, logits, fallback;
  int qkv_stride = 0;
  DeviceMemory norm_partials;  // residual_in_products: [token][partials_stride]
  int partials_stride = 0;
  // Step inputs: the same layout on the host (pinned) and the device.
  struct Inputs {
    size_t dst = 0, tokens = 0, positions = 0, row_block = 0, row_table = 0, out_row = 0, tiles = 0,
           tables = 0;
    size_t table_capacity = 0;
    Layout layout;
  } in;
  PinnedMemory inputs_host;
  DeviceMemory inputs;
  // Checks: products [rows][roles]; the rest read back after every step.
  DeviceMemory products;
  // Kernel times: a timed event after each launch, its kind, and the sums so far.
  std::vector<cuda::Event> marks;
  std::vector<const char*> mark_names;
  size_t marks_used = 0;
  std::vector<LaunchTime> launch_times;
  cuda::CheckView view;  // products and the fold accounts in `results`
  struct Results {
    size_t folds = 0, row_sums = 0, failed = 0, strayed = 0, checked = 0, nonfinite = 0;
    // The fold accounts' slots, last: zeroed with the rest before a step, but not read back (the
    // count kernel adds them up into `folds`, FoldTotal a weight).
    size_t fold_slots = 0;
    Layout layout;
  } res;
  DeviceMemory results;
  PinnedMemory results_host;
  cuda::HostRegistration outputs;
  std::unique_ptr<cuda::Matmul> cublas;  // Options::cublas_products
  // Decode steps captured as graphs, by (rows, whether the destinations are 16-byte aligned,
  // attention's blocks a (row, head) for splits side by side (1: one after another), whether
  // every row is its sequence's only one, and the attention's prefill tiles).
  using GraphKey = std::tuple<int, bool, int, bool, int>;
  std::map<GraphKey, cuda::GraphExec> graphs;
  // Attention's splits side by side (cuda/attention.cuh): partials and counts.
  DeviceMemory split_partials, split_counts;
  int max_splits = 0;
  // Scrubbing: ranges and their sums, on the scrub stream.
  // Pinned, so that a granule's copies are plain DMA: a pageable copy stages through the driver
  // and waits on the host for the whole copy.
  DeviceMemory scrub_ranges, scrub_sums;
  PinnedMemory scrub_ranges_host, scrub_sums_host;
  size_t scrub_capacity = 0;

  // Bytes of attention tiles a token row may need: a word (attention_tiles), or two a KV head
  // (attention_mma: a tile of one row a KV head, in decode steps).
  size_t tile_bytes_per_row = 4;

  // Lays out and allocates the inputs for `tokens` rows and `table_words` block ids.
  Status allocateInputs(size_t tokens, size_t table_words) {
    in.table_capacity = table_words;
    in.layout = {};
    in.dst = in.layout.add(tokens * sizeof(float*));
    in.tokens = in.layout.add(tokens * 4);
    in.positions = in.layout.add(tokens * 4);
    in.row_block = in.layout.add(tokens * 4);
    in.row_table = in.layout.add(tokens * 4);
    in.out_row = in.layout.add(tokens * 4);
    in.tiles = in.layout.add(tokens * tile_bytes_per_row);  // attention's tiles
    in.tables = in.layout.add(table_words * 4);
    BULKHEAD_ASSIGN_OR_RETURN(inputs_host, PinnedMemory::allocate(in.layout.bytes));
    BULKHEAD_ASSIGN_OR_RETURN(inputs, DeviceMemory::allocate(in.layout.bytes));
    return okStatus();
  }

  template <typename T>
  T* input(size_t offset) const {
    return reinterpret_cast<T*>(inputs.get<std::byte>() + offset);
  }
  template <typename T>
  T* inputHost(size_t offset) const {
    return reinterpret_cast<T*>(inputs_host.get<std::byte>() + offset);
  }
  template <typename T>
  T* result(size_t offset) const {
    return reinterpret_cast<T*>(results.get<std::byte>() + offset);
  }
  template <typename T>
  T* resultHost(size_t offset) const {
    return reinterpret_cast<T*>(results_host.get<std::byte>() + offset);
  }
};

namespace {

// A host-to-device copy that has landed when it returns: cudaMemcpy from pageable memory may
// return before its copy does, and the non-blocking streams that read the memory next do not
// wait for the legacy stream.
Status copyToDevice(void* to, const void* from, size_t bytes, cudaStream_t stream) {
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return okStatus();
}

}  // namespace

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(
    std::shared_ptr<const Checkpoint> checkpoint, const Options& options) {
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->checkpoint_ = std::move(checkpoint);
  b->attention_scale_ = options.attention_scale_factor;
  b->kernel_times_ = options.kernel_times;
  const ModelConfig& c = b->config();
  b->cublas_products_ = options.cublas_products;
  if (options.residual_in_products && b->cublas_products_)
    return invalidArgument("cuBLAS products cannot add into the residual stream");
  b->residual_in_products_ = options.residual_in_products;
  if (options.norm_in_products && !options.residual_in_products)
    return invalidArgument("norms in the products need the residual in the products");
  b->norm_in_products_ = options.norm_in_products;
  if (options.silu_in_products && b->cublas_products_)
    return invalidArgument("cuBLAS products cannot compute their own activation");
  b->silu_in_products_ = options.silu_in_products;
  const bool mma_fits = cuda::mmaAttentionSupportsHeadDim(c.head_dim) &&
                        c.num_heads / c.num_kv_heads <= cuda::kMmaTileItems;
  b->attention_mma_ = options.attention_mma;
  if (b->attention_mma_ && !mma_fits)
    return invalidArgument("tensor-core attention does not support heads of " +
                           std::to_string(c.head_dim) + " (" + std::to_string(c.num_heads) +
                           " over " + std::to_string(c.num_kv_heads) + " KV heads)");
  b->rope_in_attention_ =
      options.rope_in_attention.value_or(!b->attention_mma_ && c.head_dim <= kRopeInAttentionHeads);
  if (b->rope_in_attention_ && b->attention_mma_)
    return invalidArgument("the tensor-core attention does not do the q/k/v kernel's work");
  b->attention_tiles_ = options.attention_tiles;
  b->attention_paired_rows_ = options.attention_paired_rows;
  if (b->attention_paired_rows_ > 0 &&
      (b->attention_mma_ || c.head_dim > cuda::kAttentionPairedHeads))
    return invalidArgument(
        "attention chunks two at a time need the CUDA-core attention and heads "
        "of at most " +
        std::to_string(cuda::kAttentionPairedHeads) + " (not " + std::to_string(c.head_dim) + ")");
  b->logits_in_product_ = options.logits_in_product;
  b->graphs_ = options.cuda_graphs && !options.kernel_times;  // a graph times as one launch
  b->gemm_schedules_ = options.gemm_schedules;
  b->gemm_splits_ = options.gemm_splits;
  b->gemm_shape_schedules_ = options.gemm_shape_schedules;
  b->d_ = std::make_unique<CudaState>();
  BULKHEAD_RETURN_IF_ERROR(b->load(options));
  return b;
}

std::string_view CudaBackend::name() const {
  if (cublas_products_) return attention_mma_ ? "cuda-cublas-mma" : "cuda-cublas";
  return attention_mma_ ? "cuda-mma" : "cuda";
}

CudaBackend::~CudaBackend() {
  if (d_ == nullptr) return;
  cudaStreamSynchronize(d_->stream.get());
  cuda::setProgrammaticLaunch(d_->stream.get(), false);  // a later stream may reuse the handle
}

size_t CudaBackend::usedIndex(const TensorView* tensor) const {
  return size_t(std::find(used_.begin(), used_.end(), tensor) - used_.begin());
}

Status CudaBackend::bind(Weight& w, const TensorView* tensor, const std::string& role) {
  w.tensor = tensor;
  w.role = role;
  if (tensor == nullptr) return okStatus();
  if (tensor->dtype != DType::kBF16)
    return unimplemented("the CUDA backend computes from bf16 weights; " + tensor->name + " is " +
                         std::string(dtypeName(tensor->dtype)));
  w.tensor_index = uint32_t(usedIndex(tensor));
  const bool streamed = unit_of_[w.tensor_index] >= 0;
  w.ptr = streamed ? staged_at_[w.tensor_index] : d_->slots[w.tensor_index];
  w.generation = streamed ? 0 : slot_tags_.generation(w.ptr);
  w.salt = uint32_t(splitmix64(weights_.size() + 1));
  weights_.push_back(&w);
  return okStatus();
}

// Each unit laid out as its slots are on the device (so a streamed group is one matrix in its
// staging slot, as it is resident).
std::vector<CudaBackend::UnitTensors> CudaBackend::weightUnits(const ModelTensors& t) {
  std::vector<UnitTensors> units;
  auto unit = [&](std::string name, std::vector<const TensorView*> tensors, size_t layer) {
    Layout laid;
    for (const TensorView* m : tensors) laid.add(m->data.size());
    units.push_back({{std::move(name), laid.bytes, uint32_t(layer)}, std::move(tensors)});
  };
  for (size_t l = 0; l < t.layers.size(); ++l) {
    const LayerTensors& L = t.layers[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    unit(p + "qkv", {L.q, L.k, L.v}, l);
    unit(p + "o", {L.o}, l);
    unit(p + "gate_up", {L.gate, L.up}, l);
    unit(p + "down", {L.down}, l);
  }
  if (t.lm_head != t.embed) unit("lm_head", {t.lm_head}, t.layers.size());
  return units;
}

Result<uint64_t> CudaBackend::uploadWeights(const Options& options) {
  const ModelTensors& t = checkpoint_->tensors();
  CudaState& d = *d_;
  used_ = checkpoint_->usedTensors();
  const std::vector<UnitTensors> units = weightUnits(t);
  std::vector<WeightUnit> sizes;
  Layout fixed;  // the weights outside units, laid out as in the resident allocation
  for (const TensorView* m : used_) fixed.add(m->data.size());
  for (const UnitTensors& u : units) {
    sizes.push_back(u.unit);
    fixed.bytes -= u.unit.bytes;
  }
  ResidencyRequest request;
  request.budget = options.weight_budget;
  request.streamed = options.streamed_units;
  request.stream_larger_than = options.stream_larger_than;
  request.staging_slots = options.staging_slots;
  BULKHEAD_ASSIGN_OR_RETURN(const ResidencyPlan plan, planResidency(sizes, fixed.bytes, request));
  BULKHEAD_RETURN_IF_ERROR(layOutStreamed(units, plan));

  // Resident slots in one allocation. Each layer's q, k and v slots come one after another, and
  // its gate and up slots, so each group is one weight matrix to the product that reads it (when
  // their sizes keep the slots adjacent).
  std::vector<const TensorView*> order;
  for (const LayerTensors& l : t.layers)
    for (const TensorView* m : {l.q, l.k, l.v, l.gate, l.up}) order.push_back(m);
  for (const TensorView* m : used_)
    if (std::find(order.begin(), order.end(), m) == order.end()) order.push_back(m);
  Layout arena;
  std::vector<size_t> offsets(used_.size());
  uint64_t resident_bytes = 0;
  for (const TensorView* m : order) {
    const size_t index = usedIndex(m);
    if (unit_of_[index] >= 0) continue;
    offsets[index] = arena.add(m->data.size());
    resident_bytes += m->data.size();
  }
  BULKHEAD_ASSIGN_OR_RETURN(d.weights, DeviceMemory::allocate(arena.bytes));
  std::vector<Upload> uploads;
  for (size_t i = 0; i < used_.size(); ++i) {
    if (unit_of_[i] >= 0) {  // its host copy, as the device addresses it
      d.slots.push_back(d.streamed_device + (host_at_[i] - d.streamed_host.get<std::byte>()));
      continue;
    }
    std::byte* slot = d.weights.get<std::byte>() + offsets[i];
    uploads.push_back({used_[i]->data, slot});
    slot_tags_.tag(slot, uint32_t(i));
    d.slots.push_back(slot);
  }
  BULKHEAD_RETURN_IF_ERROR(uploadStaged(uploads, d.stream.get()));
  fillHostCopies();
  if (!streamed_.empty())
    spdlog::info(
        "weights: {} MiB resident, {} MiB in {} units streamed every step through {} "
        "staging slots of {} MiB",
        resident_bytes >> 20, plan.streamed_bytes >> 20, streamed_.size(), staging_slots_,
        slot_bytes_ >> 20);
  return resident_bytes;
}

Status CudaBackend::layOutStreamed(std::span<const UnitTensors> units, const ResidencyPlan& plan) {
  CudaState& d = *d_;
  // One pinned host copy, unit after unit in step order, each unit laid out as its staging slot.
  Layout host;
  std::vector<size_t> host_offset(used_.size()), unit_base;
  unit_of_.assign(used_.size(), -1);
  for (size_t u = 0; u < units.size(); ++u) {
    if (!plan.streamed[u]) continue;
    const size_t base = host.add(units[u].unit.bytes);
    Layout within;
    for (const TensorView* m : units[u].tensors) {
      const size_t i = usedIndex(m);
      unit_of_[i] = int(streamed_.size());
      host_offset[i] = base + within.add(m->data.size());
    }
    streamed_.push_back({nullptr, units[u].unit.bytes});
    unit_base.push_back(base);
  }
  if (streamed_.empty()) return okStatus();
  staging_slots_ = plan.staging_slots;
  slot_bytes_ = plan.slot_bytes;
  ring_ = StagingRing(streamed_.size(), staging_slots_);
  BULKHEAD_ASSIGN_OR_RETURN(d.streamed_host, PinnedMemory::allocate(host.bytes));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(
      reinterpret_cast<void**>(&d.streamed_device), d.streamed_host.get(), 0));
  BULKHEAD_ASSIGN_OR_RETURN(d.staging, DeviceMemory::allocate(staging_slots_ * slot_bytes_));
  auto* const host_base = d.streamed_host.get<std::byte>();
  for (size_t j = 0; j < streamed_.size(); ++j) streamed_[j].host = host_base + unit_base[j];
  host_at_.assign(used_.size(), nullptr);
  staged_at_.assign(used_.size(), nullptr);
  for (size_t i = 0; i < used_.size(); ++i) {
    const int j = unit_of_[i];
    if (j < 0) continue;
    host_at_[i] = host_base + host_offset[i];
    staged_at_[i] = d.staging.get<std::byte>() + size_t(j) % staging_slots_ * slot_bytes_ +
                    (host_offset[i] - unit_base[size_t(j)]);
  }
  BULKHEAD_ASSIGN_OR_RETURN(d.copy_stream, cuda::Stream::create());
  BULKHEAD_ASSIGN_OR_RETURN(d.fork, cuda::Event::create());
  BULKHEAD_ASSIGN_OR_RETURN(d.join, cuda::Event::create());
  for (uint32_t r = 0; r < staging_slots_; ++r) {
    BULKHEAD_ASSIGN_OR_RETURN(cuda::Event staged, cuda::Event::create());
    BULKHEAD_ASSIGN_OR_RETURN(cuda::Event freed, cuda::Event::create());
    d.staged.push_back(std::move(staged));
    d.freed.push_back(std::move(freed));
  }
  return okStatus();
}

void CudaBackend::fillHostCopies() {
  // The streamed tensors' bytes into their host copies, on every core, in pieces of a few MiB.
  constexpr size_t kPiece = size_t(8) << 20;
  std::vector<std::pair<size_t, size_t>> pieces;  // (tensor, offset)
  for (size_t i = 0; i < used_.size(); ++i)
    if (unit_of_[i] >= 0)
      for (size_t at = 0; at < used_[i]->data.size(); at += kPiece) pieces.push_back({i, at});
  if (pieces.empty()) return;
  WorkPool pool;
  pool.parallelFor(pieces.size(), [&](size_t p) {
    const auto [i, at] = pieces[p];
    const size_t n = std::min(kPiece, used_[i]->data.size() - at);
    std::memcpy(host_at_[i] + at, used_[i]->data.data() + at, n);
  });
}

Status CudaBackend::bindRoles() {
  const ModelTensors& t = checkpoint_->tensors();
  // Roles: the products (layers in order, then lm_head), then the weights our kernels load.
  layers_.resize(t.layers.size());
  const bool tied = t.lm_head == t.embed;
  BULKHEAD_RETURN_IF_ERROR(bind(embed_, t.embed, t.embed->name));
  BULKHEAD_RETURN_IF_ERROR(bind(
      lm_head_, t.lm_head, tied ? "lm_head (tied to " + t.embed->name + ")" : t.lm_head->name));
  BULKHEAD_RETURN_IF_ERROR(bind(final_norm_, t.final_norm, t.final_norm->name));
  for (size_t i = 0; i < t.layers.size(); ++i) {
    const LayerTensors& l = t.layers[i];
    Layer& L = layers_[i];
    const std::pair<Weight*, const TensorView*> roles[] = {{&L.q, l.q},
                                                           {&L.k, l.k},
                                                           {&L.v, l.v},
                                                           {&L.o, l.o},
                                                           {&L.gate, l.gate},
                                                           {&L.up, l.up},
                                                           {&L.down, l.down},
                                                           {&L.input_norm, l.input_norm},
                                                           {&L.post_norm, l.post_norm},
                                                           {&L.q_bias, l.q_bias},
                                                           {&L.k_bias, l.k_bias},
                                                           {&L.v_bias, l.v_bias}};
    for (const auto& [w, tensor] : roles)
      BULKHEAD_RETURN_IF_ERROR(bind(*w, tensor, tensor != nullptr ? tensor->name : ""));
    for (Weight* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) {
      w->product = int(linear_.size());
      linear_.push_back(w);
    }
  }
  lm_head_.product = int(linear_.size());
  linear_.push_back(&lm_head_);
  product_roles_ = int(linear_.size());

  return okStatus();
}

Status CudaBackend::computeColumnSums() {
  CudaState& d = *d_;
  // The column sums of every product's weight, computed on the device from the slot just filled
  // with the checkpoint's bytes, or a streamed weight's host copy (the scrubber verifies those
  // bytes from then on).
  const size_t column_floats = [&] {
    size_t n = 0;
    for (const Weight* w : linear_) n += 2 * size_t(w->tensor->shape[1]);
    return n;
  }();
  BULKHEAD_ASSIGN_OR_RETURN(d.column_sums, DeviceMemory::allocate(column_floats * sizeof(float)));
  float* at = d.column_sums.get<float>();
  for (const Weight* w : linear_) {
    const int rows = int(w->tensor->shape[0]), cols = int(w->tensor->shape[1]);
    d.colsum.push_back(at);
    d.abssum.push_back(at + cols);
    BULKHEAD_RETURN_IF_ERROR(
        cuda::launchColumnSums(reinterpret_cast<const __nv_bfloat16*>(d.slots[w->tensor_index]),
                               rows, cols, boundUnit(cols), at, at + cols, d.stream.get()));
    at += 2 * size_t(cols);
  }
  std::vector<cuda::ProductScale> scales;
  for (const Weight* w : linear_) scales.push_back(usualScale(int(w->tensor->shape[1])));
  BULKHEAD_ASSIGN_OR_RETURN(d.product_scales,
                            DeviceMemory::allocate(scales.size() * sizeof(cuda::ProductScale)));
  BULKHEAD_RETURN_IF_ERROR(copyToDevice(d.product_scales.get(), scales.data(),
                                        scales.size() * sizeof(cuda::ProductScale),
                                        d.stream.get()));

  return okStatus();
}

void CudaBackend::expectFolds() {
  // What every weight our kernels load must fold to, from the checkpoint's own bytes: the
  // norms, biases and embedding in our elementwise kernels, the products' weights in ours (not
  // in cuBLAS's: their arithmetic check is their in-step check).
  auto role = [&](Weight& w, FoldRole::Uses uses) {
    if (w.tensor == nullptr) return;
    if (cublas_products_ && (uses == FoldRole::kProducts || uses == FoldRole::kLogitsChunks))
      return;
    w.fold = int(folds_.size());
    FoldRole& f = folds_.emplace_back();
    f.weight = &w;
    f.uses = uses;
  };
  role(embed_, FoldRole::kGathered);
  role(final_norm_, FoldRole::kLogitsRows);
  role(lm_head_, FoldRole::kLogitsChunks);
  for (Layer& L : layers_) {
    for (Weight* w : {&L.input_norm, &L.post_norm, &L.q_bias, &L.k_bias, &L.v_bias})
      role(*w, FoldRole::kTokenRows);
    for (Weight* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
      role(*w, FoldRole::kProducts);
  }
  // Every weight once (gigabytes for a large model), in jobs of at most kRows rows on every
  // core: the folds of row ranges add up (a product's modulo 2^32, as the device adds them).
  constexpr size_t kRows = 2048;
  struct Job {
    FoldRole* role;
    size_t first_row, rows;
    uint64_t fold = 0;
  };
  std::vector<Job> jobs;
  for (FoldRole& f : folds_) {
    const TensorView& t = *f.weight->tensor;
    const size_t row_bytes = size_t(t.shape.back()) * 2, rows = t.data.size() / row_bytes;
    if (f.uses == FoldRole::kGathered) f.row_expected.assign(rows, 0);
    f.words = rows * weightRowWords(row_bytes);
    for (size_t j = 0; j < rows; j += kRows) jobs.push_back({&f, j, std::min(kRows, rows - j)});
  }
  WorkPool pool;
  pool.parallelFor(jobs.size(), [&](size_t i) {
    Job& job = jobs[i];
    FoldRole& f = *job.role;
    const TensorView& t = *f.weight->tensor;
    const int k = int(t.shape.back());
    const size_t row_bytes = size_t(k) * 2;
    const std::byte* first = t.data.data() + job.first_row * row_bytes;
    if (f.folded32()) {
      job.fold = cuda::productFold(first, job.rows, k, uint32_t(job.first_row), f.weight->salt);
      return;
    }
    for (size_t j = job.first_row; j < job.first_row + job.rows; ++j) {
      const uint64_t v = foldWeightRow(t.data.data() + j * row_bytes, row_bytes,
                                       j * weightRowWords(row_bytes), f.weight->salt);
      if (f.uses == FoldRole::kGathered) f.row_expected[j] = v;
      job.fold += v;
    }
  });
  for (const Job& job : jobs) {
    FoldRole& f = *job.role;
    f.expected = f.folded32() ? uint32_t(f.expected + job.fold) : f.expected + job.fold;
  }
}

Result<uint32_t> CudaBackend::allocateKvCache(const Options& options) {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  // What is left after the step's buffers, in the share the options give.
  if (options.kv_block_size == 0) return invalidArgument("kv block size must be positive");
  const uint64_t block_elems = uint64_t(options.kv_block_size) * c.num_kv_heads * c.head_dim;
  const uint64_t block_bytes = block_elems * 2 * 2 * c.num_layers;  // k and v, bf16
  uint64_t blocks = options.kv_blocks;
  if (blocks == 0) {
    size_t free = 0, total = 0;
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free, &total));
    const uint64_t per_context =
        (uint64_t(c.max_context) + options.kv_block_size - 1) / options.kv_block_size;
    blocks = std::min<uint64_t>(uint64_t(double(free) * options.kv_memory_share) / block_bytes,
                                per_context * 64);
  }
  if (blocks == 0 || blocks > UINT32_MAX)
    return resourceExhausted("KV cache of " + std::to_string(blocks) + " blocks is unusable");
  d.kv_layer_elems = size_t(blocks) * block_elems;
  BULKHEAD_ASSIGN_OR_RETURN(d.k_cache, DeviceMemory::allocate(d.kv_layer_elems * c.num_layers * 2));
  BULKHEAD_ASSIGN_OR_RETURN(d.v_cache, DeviceMemory::allocate(d.kv_layer_elems * c.num_layers * 2));
  return uint32_t(blocks);
}

Status CudaBackend::uploadRopeTables() {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  const cuda::RopeTables rope = cuda::ropeTables(c.ropeInverseFrequencies(), c.max_context);
  BULKHEAD_ASSIGN_OR_RETURN(d.rope_cos, DeviceMemory::allocate(rope.cos.size() * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.rope_sin, DeviceMemory::allocate(rope.sin.size() * 4));
  BULKHEAD_RETURN_IF_ERROR(
      copyToDevice(d.rope_cos.get(), rope.cos.data(), rope.cos.size() * 4, d.stream.get()));
  BULKHEAD_RETURN_IF_ERROR(
      copyToDevice(d.rope_sin.get(), rope.sin.data(), rope.sin.size() * 4, d.stream.get()));

  return okStatus();
}

Status CudaBackend::load(const Options& options) {
  const ModelConfig& c = config();
  const ModelTensors& t = checkpoint_->tensors();
  CudaState& d = *d_;
  if (!cuda::attentionSupportsHeadDim(c.head_dim))
    return unimplemented("the CUDA backend's attention does not support head_dim " +
                         std::to_string(c.head_dim));
  if (c.hidden_size % 2 != 0 || c.intermediate_size % 2 != 0)
    return unimplemented("the CUDA backend needs even hidden and intermediate sizes");
  if (c.hidden_size > cuda::kMaxNormHidden)
    return unimplemented("the CUDA backend's norm takes rows of up to " +
                         std::to_string(cuda::kMaxNormHidden) + " values, not hidden_size " +
                         std::to_string(c.hidden_size));
  if (t.final_norm == nullptr) return unimplemented("the CUDA backend needs a final norm");
  for (const LayerTensors& l : t.layers)
    if (l.o_bias != nullptr)
      return unimplemented("the CUDA backend has no o_proj bias (" + l.o_bias->name + ")");
  device_ = options.device;
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  BULKHEAD_ASSIGN_OR_RETURN(d.stream, cuda::Stream::create(/*urgent=*/true));
  const bool programmatic = options.programmatic_launch && cuda::programmaticLaunchSupported();
  if (options.programmatic_launch && !programmatic)
    spdlog::info(
        "programmatic launch off: it needs a device of compute capability 9.0 or later and "
        "kernels built for it");
  cuda::setProgrammaticLaunch(d.stream.get(), programmatic);
  BULKHEAD_ASSIGN_OR_RETURN(d.scrub_stream, cuda::Stream::create());
  BULKHEAD_ASSIGN_OR_RETURN(d.done, cuda::Event::create());

  PhaseClock clock;
  BULKHEAD_ASSIGN_OR_RETURN(const uint64_t weight_bytes, uploadWeights(options));
  uint64_t streamed_bytes = 0;
  for (size_t i = 0; i < used_.size(); ++i)
    if (unit_of_[i] >= 0) streamed_bytes += used_[i]->data.size();
  clock.phase("weight upload (" + std::to_string(weight_bytes >> 20) + " MiB" +
              (streamed_bytes > 0 ? ", " + std::to_string(streamed_bytes >> 20) + " MiB streamed"
                                  : std::string()) +
              ")");
  BULKHEAD_RETURN_IF_ERROR(bindRoles());
  BULKHEAD_RETURN_IF_ERROR(computeColumnSums());
  if (cublas_products_) {
    BULKHEAD_ASSIGN_OR_RETURN(d.cublas, cuda::Matmul::create(d.stream.get()));
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d.stream.get()));
  clock.phase("column sums");
  if (options.check_weight_reads) expectFolds();
  clock.phase("expected folds");
  BULKHEAD_RETURN_IF_ERROR(allocateStep(options));
  BULKHEAD_ASSIGN_OR_RETURN(const uint32_t blocks, allocateKvCache(options));
  BULKHEAD_RETURN_IF_ERROR(uploadRopeTables());
  clock.phase("step buffers and KV cache");
  spdlog::info("CUDA device {} loaded in {}", device_, clock.summary());

  std::vector<uint32_t> buckets;
  for (uint32_t b = 1; options.cuda_graphs && b <= kMaxGraphRows; ++b) buckets.push_back(b);
  limits_ = {.vocab_size = uint32_t(c.vocab_size),
             .max_context = uint32_t(c.max_context),
             .kv_block_size = options.kv_block_size,
             .kv_block_count = blocks,
             .max_step_tokens = options.max_step_tokens,
             .graph_batch_buckets = std::move(buckets),
             .resident_weight_bytes = weight_bytes,
             .streamed_weight_bytes = streamed_bytes,
             .kv_cache_bytes = d.kv_layer_elems * c.num_layers * 2 * 2,
             .checks_weight_reads = options.check_weight_reads,
             .compute_grows_with_rows = false};
  if (d.cublas != nullptr) {
    BULKHEAD_RETURN_IF_ERROR(warmCublas(int(options.max_step_tokens)));
    clock.phase("cuBLAS warm-up");
    spdlog::info("CUDA device {} ready in {}", device_, clock.summary());
  }
  return okStatus();
}

// cuBLAS loads each of its kernels on first use and picks one by the row count, so a step of a
// new size (a long prompt's first chunk above all) would wait for the loading. Each product of
// the first layer and lm_head runs once at every power of two of rows up to a step's most (on
// the step buffers, whatever they hold), so the kernels any step picks are loaded before it.
Status CudaBackend::warmCublas(int max_rows) {
  CudaState& d = *d_;
  const ModelConfig& c = config();
  const Layer& L = layers_.front();
  auto* xn = d.xn.get<__nv_bfloat16>();
  for (int m = 1;; m = std::min(2 * m, max_rows)) {
    BULKHEAD_RETURN_IF_ERROR(products({&L.q, &L.k, &L.v}, xn, m, d.qkv.get<float>(), d.qkv_stride));
    BULKHEAD_RETURN_IF_ERROR(
        products({&L.o}, d.attn.get<__nv_bfloat16>(), m, d.delta.get<float>(), c.hidden_size));
    BULKHEAD_RETURN_IF_ERROR(
        products({&L.gate, &L.up}, xn, m, d.gate_up.get<float>(), 2 * c.intermediate_size));
    BULKHEAD_RETURN_IF_ERROR(
        products({&L.down}, d.act.get<__nv_bfloat16>(), m, d.delta.get<float>(), c.hidden_size));
    if (m <= kLogitsChunk)
      BULKHEAD_RETURN_IF_ERROR(products({&lm_head_}, d.final_rows.get<__nv_bfloat16>(), m,
                                        d.logits.get<float>(), c.vocab_size));
    if (m == max_rows) break;
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d.stream.get()));
  return okStatus();
}

Status CudaBackend::allocateStep(const Options& options) {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  const size_t T = options.max_step_tokens;
  // The per-row kernels (q/k/v, activation, attention) put a step's rows on the grid's y.
  constexpr size_t kMaxGridRows = 65535;
  if (T == 0 || T > kMaxGridRows)
    return invalidArgument("max_step_tokens must be 1 to " + std::to_string(kMaxGridRows) +
                           ", not " + std::to_string(T));
  d.qkv_stride = c.qDim() + 2 * c.kvDim();
  const size_t hidden = size_t(c.hidden_size), inter = size_t(c.intermediate_size);
  const size_t vocab = size_t(c.vocab_size);
  BULKHEAD_ASSIGN_OR_RETURN(d.x, DeviceMemory::allocate(T * hidden * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.xn, DeviceMemory::allocate(T * hidden * 2));
  BULKHEAD_ASSIGN_OR_RETURN(d.qkv, DeviceMemory::allocate(T * size_t(d.qkv_stride) * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.attn, DeviceMemory::allocate(T * size_t(c.qDim()) * 2));
  BULKHEAD_ASSIGN_OR_RETURN(d.delta, DeviceMemory::allocate(T * hidden * 4));
  d.partials_stride = cuda::normTiles(c.hidden_size);
  BULKHEAD_ASSIGN_OR_RETURN(d.norm_partials,
                            DeviceMemory::allocate(T * size_t(d.partials_stride) * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.gate_up, DeviceMemory::allocate(T * 2 * inter * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.act, DeviceMemory::allocate(T * inter * 2));
  BULKHEAD_ASSIGN_OR_RETURN(d.final_rows, DeviceMemory::allocate(T * hidden * 2));
  BULKHEAD_ASSIGN_OR_RETURN(d.logits, DeviceMemory::allocate(kLogitsChunk * vocab * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.fallback, DeviceMemory::allocate(kLogitsChunk * vocab * 4));
  // Attention's parallel splits: room for the longest context the model has.
  d.max_splits = std::max(1, (c.max_context + cuda::kAttentionSplit - 1) / cuda::kAttentionSplit);
  const size_t split_rows = size_t(cuda::kAttentionParallelRows) * size_t(c.num_heads);
  BULKHEAD_ASSIGN_OR_RETURN(
      d.split_partials,
      DeviceMemory::allocate(split_rows * size_t(d.max_splits) * size_t(c.head_dim + 2) * 4));
  BULKHEAD_ASSIGN_OR_RETURN(d.split_counts, DeviceMemory::allocate(split_rows * 4));
  // Zero before any step, on the step stream (which does not wait for the legacy one).
  BULKHEAD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(d.split_counts.get(), 0, split_rows * 4, d.stream.get()));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d.stream.get()));

  // Inputs, with room for 4 block ids a token row at first (grown when a step needs more).
  if (attention_mma_) d.tile_bytes_per_row = 8 * size_t(c.num_kv_heads);
  BULKHEAD_RETURN_IF_ERROR(d.allocateInputs(T, T * 4));

  BULKHEAD_ASSIGN_OR_RETURN(
      d.products, DeviceMemory::allocate(T * size_t(product_roles_) * sizeof(cuda::ProductCheck)));
  d.res.layout = {};
  const size_t fold_count = std::max<size_t>(1, folds_.size());
  d.res.folds = d.res.layout.add(fold_count * sizeof(cuda::FoldTotal));
  d.res.row_sums = d.res.layout.add(T * 8);
  d.res.failed = d.res.layout.add(size_t(product_roles_) * 4);
  d.res.strayed = d.res.layout.add(size_t(product_roles_) * 4);
  d.res.checked = d.res.layout.add(size_t(product_roles_) * 4);
  d.res.nonfinite = d.res.layout.add(T * 4);
  d.res.fold_slots = d.res.layout.add(fold_count * sizeof(cuda::FoldAccount));
  BULKHEAD_ASSIGN_OR_RETURN(d.results, DeviceMemory::allocate(d.res.layout.bytes));
  BULKHEAD_ASSIGN_OR_RETURN(d.results_host, PinnedMemory::allocate(d.res.fold_slots));
  d.view = {d.products.get<cuda::ProductCheck>(), product_roles_,
            d.result<cuda::FoldAccount>(d.res.fold_slots)};
  return okStatus();
}

Status CudaBackend::registerOutputs(std::span<std::byte> memory) {
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  d_->outputs = {};  // the previous registration, if any, ends first
  if (memory.empty()) return okStatus();
  BULKHEAD_ASSIGN_OR_RETURN(d_->outputs,
                            cuda::HostRegistration::create(memory.data(), memory.size()));
  return okStatus();
}

int CudaBackend::mmaTiles(std::span<const SequenceStep> batch, uint32_t* tiles) const {
  const ModelConfig& c = config();
  const uint32_t per_tile = uint32_t(cuda::kMmaTileItems / (c.num_heads / c.num_kv_heads));
  int count = 0;
  uint32_t first = 0;
  for (const SequenceStep& s : batch) {
    const auto rows = uint32_t(s.tokens.size());
    for (uint32_t i = 0; i < rows; i += per_tile)
      for (uint32_t kvh = 0; kvh < uint32_t(c.num_kv_heads); ++kvh) {
        tiles[2 * count] = (first + i) | std::min(per_tile, rows - i) << 24;
        tiles[2 * count + 1] = kvh;
        ++count;
      }
    first += rows;
  }
  return count;
}

Status CudaBackend::enqueueStep(std::span<const SequenceStep> batch,
                                std::span<const RowOutput> rows) {
  if (pending_.queued)
    return failedPrecondition("enqueueStep while a step is pending (waitStep not called)");
  BULKHEAD_RETURN_IF_ERROR(validateStep(batch, rows, limits_));
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  CudaState& d = *d_;
  // Flatten the batch into the pinned inputs: one entry per token row.
  size_t table_words = 0;
  for (const SequenceStep& s : batch) table_words += s.kv_blocks.size();
  if (table_words > d.in.table_capacity) {
    // Grow the tables' room (no step is in flight: the last waitStep synchronised).
    BULKHEAD_RETURN_IF_ERROR(
        d.allocateInputs(limits_.max_step_tokens, std::max(table_words, 2 * d.in.table_capacity)));
    d.graphs.clear();  // they read the old inputs
  }
  auto* tokens = d.inputHost<uint32_t>(d.in.tokens);
  auto* positions = d.inputHost<uint32_t>(d.in.positions);
  auto* row_block = d.inputHost<uint32_t>(d.in.row_block);
  auto* row_table = d.inputHost<uint32_t>(d.in.row_table);
  auto* out_row = d.inputHost<int32_t>(d.in.out_row);
  auto* tables = d.inputHost<uint32_t>(d.in.tables);
  auto* dst = d.inputHost<float*>(d.in.dst);
  const uint32_t bs = limits_.kv_block_size;
  size_t n = 0, table_at = 0;
  int m = 0;
  uint32_t longest = 0;  // positions attended by the step's longest row
  pending_.gathered.clear();
  for (const SequenceStep& s : batch) {
    std::copy(s.kv_blocks.begin(), s.kv_blocks.end(), tables + table_at);
    const size_t first = n;
    for (size_t i = 0; i < s.tokens.size(); ++i, ++n) {
      const uint32_t p = s.start_position + uint32_t(i);
      tokens[n] = s.tokens[i];
      positions[n] = p;
      longest = std::max(longest, p + 1);
      row_block[n] = s.kv_blocks[p / bs];
      row_table[n] = uint32_t(table_at);
      out_row[n] = -1;
      pending_.gathered.push_back(s.tokens[i]);
    }
    for (uint32_t i : s.logits_rows) out_row[first + i] = m++;
    table_at += s.kv_blocks.size();
  }
  // Each logits row goes straight to its arena slot when the arena is registered; otherwise
  // (tests, a fault's diverted row) through a device buffer, copied out chunk by chunk.
  bool mapped = true, aligned = true;
  pending_.copied_out.assign(size_t(m), false);
  for (int r = 0; r < m; ++r) {
    void* in_arena = d.outputs.deviceAddress(rows[size_t(r)].payload);
    pending_.copied_out[size_t(r)] = in_arena == nullptr;
    mapped = mapped && in_arena != nullptr;
    dst[r] = in_arena != nullptr
                 ? static_cast<float*>(in_arena)
                 : d.fallback.get<float>() + size_t(r % kLogitsChunk) * config().vocab_size;
    aligned = aligned && uintptr_t(dst[r]) % 16 == 0;
  }
  pending_.aligned = aligned;
  const uint32_t splits = (longest + cuda::kAttentionSplit - 1) / cuda::kAttentionSplit;
  pending_.parallel_attention =
      n <= size_t(cuda::kAttentionParallelRows) && splits > 1 && splits <= uint32_t(d.max_splits);
  parallel_attention_steps_ += pending_.parallel_attention;
  pending_.split_blocks = 1;
  while (pending_.parallel_attention && pending_.split_blocks < cuda::kAttentionSplitBlocks &&
         uint32_t(pending_.split_blocks) < splits)
    pending_.split_blocks *= 2;
  product_stored_row_steps_ += lmHeadStoresRows();
  pending_.decode_rows = n == batch.size();
  pending_.attention_tiles = 0;
  if (attention_mma_) {
    pending_.attention_tiles = mmaTiles(batch, d.inputHost<uint32_t>(d.in.tiles));
    ++mma_attention_steps_;
  } else if (attention_tiles_ && !pending_.decode_rows && !pending_.parallel_attention &&
             n < (1u << 24)) {
    // Prefill steps: attention in tiles of each sequence's consecutive rows (attention_tiles).
    auto* tiles = d.inputHost<uint32_t>(d.in.tiles);
    const uint32_t per_tile = uint32_t(cuda::attentionTileRows(config().head_dim));
    uint32_t first = 0;
    for (const SequenceStep& s : batch) {
      const auto count = uint32_t(s.tokens.size());
      for (uint32_t i = 0; i < count; i += per_tile)
        tiles[pending_.attention_tiles++] = (first + i) | std::min(per_tile, count - i) << 24;
      first += count;
    }
    ++tiled_attention_steps_;
  }
  pending_.paired_chunks =
      !attention_mma_ && n <= attention_paired_rows_ && pending_.attention_tiles == 0;
  paired_attention_steps_ += pending_.paired_chunks;
  pending_.rows.assign(rows.begin(), rows.end());
  if (limits_.checks_weight_reads && !verifySlots().failed_tensor.empty()) {
    // Computes nothing and queues nothing (so no copy still reads the inputs when the next step
    // writes them); waitStep reports the binding.
    pending_.queued = true;
    pending_.tokens = -1;
    fault_role_ = -1;  // a compute fault lasts one step
    return okStatus();
  }
  BULKHEAD_RETURN_IF_ERROR(mark(nullptr));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.inputs.get(), d.inputs_host.get(),
                                                d.in.tables + table_at * 4, cudaMemcpyHostToDevice,
                                                d.stream.get()));
  BULKHEAD_RETURN_IF_ERROR(mark("step inputs copy"));
  pending_.tokens = int(n);
  // A decode step (a token and its logits row per sequence) runs as a graph, captured the
  // first time its size is seen; the same launches either way, so the same numbers.
  if (graphs_ && fault_role_ < 0 && mapped && size_t(m) == n && n <= kMaxGraphRows) {
    const CudaState::GraphKey key{m, aligned, pending_.split_blocks, pending_.decode_rows,
                                  pending_.attention_tiles};
    auto graph = d.graphs.find(key);
    if (graph == d.graphs.end()) {
      const auto capture_start = std::chrono::steady_clock::now();
      BULKHEAD_CUDA_RETURN_IF_ERROR(
          cudaStreamBeginCapture(d.stream.get(), cudaStreamCaptureModeThreadLocal));
      const Status launched = launchForward(int(n), m, aligned);
      cudaGraph_t captured = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(d.stream.get(), &captured);
      if (!launched.ok()) {
        if (captured != nullptr) cudaGraphDestroy(captured);
        return launched;
      }
      BULKHEAD_CUDA_RETURN_IF_ERROR(ended);
      BULKHEAD_ASSIGN_OR_RETURN(cuda::GraphExec exec, cuda::GraphExec::instantiate(captured));
      graph = d.graphs.emplace(key, std::move(exec)).first;
      spdlog::debug("captured the decode step of {} rows as graph {} in {:.2f} ms", m,
                    d.graphs.size(),
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                              capture_start)
                        .count());
    }
    BULKHEAD_RETURN_IF_ERROR(enqueueForward(int(n), m, aligned, graph->second.get()));
    ++graph_launches_;
    parallel_graph_launches_ += std::get<2>(graph->first) > 1;
  } else {
    BULKHEAD_RETURN_IF_ERROR(enqueueForward(int(n), m, aligned, nullptr));
  }
  fault_role_ = -1;  // a compute fault lasts one step
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.done.get(), d.stream.get()));
  pending_.queued = true;
  return okStatus();
}

size_t CudaBackend::capturedGraphs() const {
  return d_->graphs.size();
}

long long CudaBackend::faultOutput(uint64_t n, int rows) const {
  // Output (s % n) of token (s / n % rows).
  const uint64_t s = (fault_selector_ / uint64_t(product_roles_)) & 0x7fffffffffffull;
  return (long long)(s / n % uint64_t(rows) * n + s % n);
}

cuda::GemmFold CudaBackend::foldAlone(const Weight& w) const {
  cuda::GemmFold f;
  if (w.fold >= 0 && limits_.checks_weight_reads)
    f = {1, {d_->view.folds + w.fold}, {w.salt}, {int(w.tensor->shape[0])}};
  return f;
}

Status CudaBackend::applyFault(const Weight& w, float* y, int rows, int ldy) {
  if (w.product != fault_role_) return okStatus();
  const uint64_t n = uint64_t(w.tensor->shape[0]);
  const auto output = uint64_t(faultOutput(n, rows));
  const size_t index = size_t(output / n) * size_t(ldy) + size_t(output % n);
  return cuda::launchFlipExponentBit(y, index, d_->stream.get());
}

bool CudaBackend::adjacentGroup(std::initializer_list<const Weight*> group) {
  const Weight& first = **group.begin();
  const std::byte* next = static_cast<const std::byte*>(first.ptr);
  int n = 0;
  for (const Weight* w : group) {
    if (w->ptr != next || w->tensor->shape[1] != first.tensor->shape[1] || n % 16 != 0)
      return false;
    next = static_cast<const std::byte*>(w->ptr) + w->tensor->data.size();
    n += int(w->tensor->shape[0]);
  }
  return true;
}

Result<const cuda::GemmNormedInput*> CudaBackend::normFor(
    const cuda::RmsNormArgs& norm, std::initializer_list<const Weight*> group,
    const char* mark_name) {
  if (!norm_in_products_ || norm.rows > cuda::kMaxNormedRows || norm.partials == nullptr ||
      norm.out_row != nullptr || d_->cublas != nullptr || !adjacentGroup(group) ||
      (*group.begin())->tensor->shape[1] != int64_t(norm.hidden) || norm.hidden % 4 != 0) {
    BULKHEAD_RETURN_IF_ERROR(cuda::launchRmsNorm(norm, d_->stream.get()));
    BULKHEAD_RETURN_IF_ERROR(mark(mark_name));
    return static_cast<const cuda::GemmNormedInput*>(nullptr);
  }
  cuda::GemmNormedInput& in = normed_input_;
  in = {};
  in.x = norm.x;
  in.ldx = norm.hidden;
  in.partials = norm.partials;
  in.ldp = norm.partials_stride;
  in.weight = norm.weight;
  in.eps = norm.eps;
  in.weight_salt = norm.weight_salt;
  in.weight_fold = norm.weight_fold >= 0 ? norm.checks.folds + norm.weight_fold : nullptr;
  int c = 0;  // the products' own consumers: the norm's args carry none for ours
  for (const Weight* w : group) in.consumers[c++] = consumer(*w);
  in.checks = norm.checks;
  return static_cast<const cuda::GemmNormedInput*>(&in);
}

Status CudaBackend::products(std::initializer_list<const Weight*> group, const void* x, int rows,
                             float* y, int ldy, const cuda::GemmNormedInput* normed,
                             const cuda::GemmActivatedInput* activated, int check_row,
                             float* const* rows_to) {
  // One product over the group when its slots lie one after another (one weight matrix), else
  // one each; either way output j of group member i lands at column (sum of earlier n) + j.
  const Weight& first = **group.begin();
  const int k = int(first.tensor->shape[1]);
  const bool adjacent = adjacentGroup(group);
  int n = 0;
  cuda::GemmFold fused;
  for (const Weight* w : group) {
    n += int(w->tensor->shape[0]);
    if (fused.weights < 3 && w->fold >= 0 && limits_.checks_weight_reads) {
      fused.account[fused.weights] = d_->view.folds + w->fold;
      fused.salt[fused.weights] = w->salt;
      fused.row_end[fused.weights++] = n;
    }
  }
  if (fused.weights != int(group.size())) fused = {};
  const auto* input = static_cast<const __nv_bfloat16*>(x);
  cudaStream_t stream = d_->stream.get();
  if ((normed != nullptr || activated != nullptr || rows_to != nullptr) &&
      (!adjacent || d_->cublas != nullptr))
    return internalError("a computed input or rows stored elsewhere for products not one of ours");
  if (d_->cublas != nullptr) {
    if (!adjacent || ldy != n)
      return unimplemented("cuBLAS products need a group's weights adjacent and its output packed");
    BULKHEAD_RETURN_IF_ERROR(
        d_->cublas->run(input, rows, static_cast<const __nv_bfloat16*>(first.ptr), n, k, y, false));
  } else if (adjacent) {
    const cuda::GemmNormedInput own = normed == nullptr && activated == nullptr
                                          ? ownChecks(group, check_row)
                                          : cuda::GemmNormedInput{};
    cuda::GemmResidual epilogue;
    epilogue.rows_to = rows_to;
    BULKHEAD_RETURN_IF_ERROR(cuda::launchGemm(
        input, rows, static_cast<const __nv_bfloat16*>(first.ptr), n, k, y, ldy, stream, fused,
        scheduleFor(n, k, rows), splitsFor(n, k), epilogue, normed != nullptr ? *normed : own,
        activated != nullptr ? *activated : cuda::GemmActivatedInput{}));
  }

  int column = 0;
  for (const Weight* w : group) {
    const int wn = int(w->tensor->shape[0]);
    if (!adjacent && d_->cublas == nullptr)
      BULKHEAD_RETURN_IF_ERROR(
          cuda::launchGemm(input, rows, static_cast<const __nv_bfloat16*>(w->ptr), wn, k,
                           y + column, ldy, stream, foldAlone(*w), scheduleFor(wn, k, rows),
                           splitsFor(wn, k), {}, ownChecks({w}, check_row)));
    BULKHEAD_RETURN_IF_ERROR(applyFault(*w, y + column, rows, ldy));
    column += wn;
  }
  return okStatus();
}

Status CudaBackend::residualProduct(const Weight& w, const void* x, int rows,
                                    const cuda::GemmActivatedInput* activated) {
  CudaState& d = *d_;
  const int n = int(w.tensor->shape[0]), k = int(w.tensor->shape[1]);
  const bool checks = limits_.checks_weight_reads;
  cuda::GemmResidual residual;
  residual.x = d.x.get<float>();
  residual.ldx = config().hidden_size;
  residual.partials = d.norm_partials.get<float>();
  residual.ldp = d.partials_stride;
  if (checks) {
    residual.checks = d.view.products;
    residual.roles = d.view.roles;
    residual.role = w.product;
  }
  if (w.product == fault_role_) residual.fault = faultOutput(uint64_t(n), rows);
  return cuda::launchGemm(
      static_cast<const __nv_bfloat16*>(x), rows, static_cast<const __nv_bfloat16*>(w.ptr), n, k,
      nullptr, 0, d.stream.get(), foldAlone(w), scheduleFor(n, k, rows), splitsFor(n, k), residual,
      activated != nullptr ? cuda::GemmNormedInput{} : ownChecks({&w}, 0),
      activated != nullptr ? *activated : cuda::GemmActivatedInput{});
}

cuda::GemmSchedule CudaBackend::scheduleFor(int n, int k, int rows) const {
  if (rows > 32 && rows < cuda::kTiledFromRows)
    for (const cuda::GemmScheduleFor& s : gemm_shape_schedules_)
      if (s.n == n && s.k == k) return s.schedule;
  if (rows > 32 && rows <= 64 && gemm_schedules_ == cuda::kDefaultGemmSchedules)
    return cuda::gemmScheduleAt33To64(n, k);
  return gemm_schedules_[size_t(cuda::gemmBucket(rows))];
}

int CudaBackend::splitsFor(int n, int k) const {
  for (const cuda::GemmSplitsFor& s : gemm_splits_)
    if (s.n == n && s.k == k) return s.splits;
  return 0;
}

cuda::ConsumerSums CudaBackend::consumer(const Weight& w) const {
  if (!limits_.checks_weight_reads) return {};
  return {w.product, d_->colsum[size_t(w.product)], d_->abssum[size_t(w.product)]};
}

cuda::ConsumerSums CudaBackend::consumerInKernel(const Weight& w) const {
  return d_->cublas != nullptr ? consumer(w) : cuda::ConsumerSums{};
}

cuda::GemmNormedInput CudaBackend::ownChecks(std::initializer_list<const Weight*> group,
                                             int check_row) const {
  cuda::GemmNormedInput in;
  if (d_->cublas != nullptr || !limits_.checks_weight_reads || group.size() > 3) return in;
  int i = 0;
  for (const Weight* w : group) in.consumers[i++] = consumer(*w);
  in.checks = d_->view;
  in.checks.products += size_t(check_row) * size_t(d_->view.roles);
  return in;
}

// The norm before layer l (l = layers: the final norm, before lm_head): the residual add of the
// down product before it (none before the first layer, or with the products adding into the
// residual), then the norm into xn for q/k/v, or into final_rows for the rows whose logits were
// asked.
cuda::RmsNormArgs CudaBackend::normBefore(size_t l, int n) const {
  const CudaState& d = *d_;
  const bool checks = limits_.checks_weight_reads, residual = residual_in_products_;
  const bool last = l == layers_.size();
  const Weight& weight = last ? final_norm_ : layers_[l].input_norm;
  cuda::RmsNormArgs norm;
  norm.x = d.x.get<float>();
  norm.delta = l > 0 && !residual ? d.delta.get<float>() : nullptr;
  norm.delta_role = l > 0 && !residual && checks ? layers_[l - 1].down.product : -1;
  if (residual) {
    norm.partials = d.norm_partials.get<float>();
    norm.partials_stride = d.partials_stride;
  }
  norm.rows = n;
  norm.hidden = config().hidden_size;
  norm.weight = static_cast<const __nv_bfloat16*>(weight.ptr);
  norm.weight_salt = weight.salt;
  norm.weight_fold = checks ? weight.fold : -1;
  norm.eps = config().rms_norm_eps;
  if (last) {
    norm.out = d.final_rows.get<__nv_bfloat16>();
    norm.out_row = d.input<int32_t>(d.in.out_row);
    norm.consumers[0] = consumerInKernel(lm_head_);
  } else {
    const Layer& L = layers_[l];
    norm.out = d.xn.get<__nv_bfloat16>();
    norm.consumers[0] = consumerInKernel(L.q);
    norm.consumers[1] = consumerInKernel(L.k);
    norm.consumers[2] = consumerInKernel(L.v);
  }
  norm.checks = d.view;
  return norm;
}

Status CudaBackend::launchLayer(size_t l, int n) {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  cudaStream_t stream = d.stream.get();
  const Layer& L = layers_[l];
  const bool checks = limits_.checks_weight_reads;
  auto role = [&](const Weight& w) { return checks ? w.product : -1; };
  auto foldOf = [&](const Weight& w) { return checks ? w.fold : -1; };
  const int inter = c.intermediate_size;
  float* qkv = d.qkv.get<float>();
  float* delta = d.delta.get<float>();
  float* gate_up = d.gate_up.get<float>();
  auto* xn = d.xn.get<__nv_bfloat16>();
  const bool residual = residual_in_products_;

  cuda::RmsNormArgs norm = normBefore(l, n);
  BULKHEAD_ASSIGN_OR_RETURN(const cuda::GemmNormedInput* normed,
                            normFor(norm, {&L.q, &L.k, &L.v}, "norm (input)"));
  BULKHEAD_RETURN_IF_ERROR(awaitStaged(L.q));
  BULKHEAD_RETURN_IF_ERROR(products({&L.q, &L.k, &L.v}, xn, n, qkv, d.qkv_stride, normed));
  BULKHEAD_RETURN_IF_ERROR(releaseStaged(L.q));
  BULKHEAD_RETURN_IF_ERROR(mark("product q/k/v"));

  cuda::QkvArgs qa;
  qa.qkv = qkv;
  qa.rows = n;
  qa.stride = d.qkv_stride;
  qa.heads = c.num_heads;
  qa.kv_heads = c.num_kv_heads;
  qa.head_dim = c.head_dim;
  const Weight* biases[3] = {&L.q_bias, &L.k_bias, &L.v_bias};
  const Weight* projections[3] = {&L.q, &L.k, &L.v};
  for (int i = 0; i < 3; ++i) {
    qa.bias[i] = static_cast<const __nv_bfloat16*>(biases[i]->ptr);
    qa.bias_salt[i] = biases[i]->salt;
    qa.bias_fold[i] = foldOf(*biases[i]);
    qa.product_role[i] = role(*projections[i]);
  }
  qa.positions = d.input<uint32_t>(d.in.positions);
  qa.cos_table = d.rope_cos.get<float>();
  qa.sin_table = d.rope_sin.get<float>();
  qa.k_cache = d.k_cache.get<__nv_bfloat16>() + l * d.kv_layer_elems;
  qa.v_cache = d.v_cache.get<__nv_bfloat16>() + l * d.kv_layer_elems;
  qa.row_block = d.input<uint32_t>(d.in.row_block);
  qa.block_size = int(limits_.kv_block_size);
  qa.checks = d.view;
  // In decode steps the attention kernel can do this kernel's work (rope_in_attention).
  const bool rope_in = rope_in_attention_ && pending_.decode_rows;
  if (!rope_in) {
    BULKHEAD_RETURN_IF_ERROR(cuda::launchQkv(qa, stream));
    BULKHEAD_RETURN_IF_ERROR(mark("q/k/v bias, rope, cache"));
  }

  BULKHEAD_RETURN_IF_ERROR(launchAttention(L, qa, rope_in, n));
  const auto* attn = d.attn.get<__nv_bfloat16>();
  BULKHEAD_RETURN_IF_ERROR(awaitStaged(L.o));
  BULKHEAD_RETURN_IF_ERROR(residual ? residualProduct(L.o, attn, n)
                                    : products({&L.o}, attn, n, delta, c.hidden_size));
  BULKHEAD_RETURN_IF_ERROR(releaseStaged(L.o));
  BULKHEAD_RETURN_IF_ERROR(mark("product o"));

  norm.delta = residual ? nullptr : delta;
  norm.delta_role = residual ? -1 : role(L.o);
  norm.weight = static_cast<const __nv_bfloat16*>(L.post_norm.ptr);
  norm.weight_salt = L.post_norm.salt;
  norm.weight_fold = foldOf(L.post_norm);
  norm.consumers[0] = consumerInKernel(L.gate);
  norm.consumers[1] = consumerInKernel(L.up);
  norm.consumers[2] = {};
  BULKHEAD_ASSIGN_OR_RETURN(normed, normFor(norm, {&L.gate, &L.up}, "norm (post-attention)"));
  BULKHEAD_RETURN_IF_ERROR(awaitStaged(L.gate));
  BULKHEAD_RETURN_IF_ERROR(products({&L.gate, &L.up}, xn, n, gate_up, 2 * inter, normed));
  BULKHEAD_RETURN_IF_ERROR(releaseStaged(L.gate));
  BULKHEAD_RETURN_IF_ERROR(mark("product gate/up"));

  cuda::SiluMulArgs sa;
  sa.gate_up = gate_up;
  sa.rows = n;
  sa.inter = inter;
  sa.out = d.act.get<__nv_bfloat16>();
  sa.gate_role = role(L.gate);
  sa.up_role = role(L.up);
  sa.down = consumerInKernel(L.down);
  sa.checks = d.view;
  // In few rows (silu_in_products), the down product computes the activation as it loads it,
  // and its check tile adds the down product's expected sums as well.
  cuda::GemmActivatedInput activated;
  const cuda::GemmActivatedInput* computed = nullptr;
  if (silu_in_products_ && n <= cuda::kMaxNormedRows && d.cublas == nullptr && inter % 4 == 0) {
    activated = {gate_up, 2 * inter, sa.gate_role, sa.up_role, consumer(L.down), d.view};
    computed = &activated;
  } else {
    BULKHEAD_RETURN_IF_ERROR(cuda::launchSiluMul(sa, stream));
    BULKHEAD_RETURN_IF_ERROR(mark("silu"));
  }
  BULKHEAD_RETURN_IF_ERROR(awaitStaged(L.down));
  BULKHEAD_RETURN_IF_ERROR(
      residual ? residualProduct(L.down, sa.out, n, computed)
               : products({&L.down}, sa.out, n, delta, c.hidden_size, nullptr, computed));
  BULKHEAD_RETURN_IF_ERROR(releaseStaged(L.down));
  return mark("product down");
}

// The layer's attention, after the q/k/v kernel (or doing its work: rope_in): on the tensor
// cores (attention_mma) or the CUDA cores.
Status CudaBackend::launchAttention(const Layer& L, const cuda::QkvArgs& qa, bool rope_in, int n) {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  cudaStream_t stream = d.stream.get();
  cuda::AttentionInputs in;
  in.q = d.qkv.get<float>();
  in.q_stride = d.qkv_stride;
  in.rows = n;
  in.heads = c.num_heads;
  in.kv_heads = c.num_kv_heads;
  in.head_dim = c.head_dim;
  in.positions = qa.positions;
  in.row_table = d.input<uint32_t>(d.in.row_table);
  in.block_tables = d.input<uint32_t>(d.in.tables);
  in.k_cache = qa.k_cache;
  in.v_cache = qa.v_cache;
  in.block_size = qa.block_size;
  in.scale = float(1.0 / std::sqrt(double(c.head_dim))) * attention_scale_;
  in.out = d.attn.get<__nv_bfloat16>();
  in.consumer = consumerInKernel(L.o);
  in.checks = d.view;
  in.split_partials = d.split_partials.get<float>();
  in.split_counts = d.split_counts.get<unsigned>();
  in.max_splits = d.max_splits;
  if (attention_mma_) {
    cuda::MmaAttentionArgs ma{in};
    ma.tiles = d.input<uint32_t>(d.in.tiles);
    ma.tile_count = pending_.attention_tiles;
    ma.split_blocks = pending_.split_blocks;
    BULKHEAD_RETURN_IF_ERROR(cuda::launchMmaAttention(ma, stream));
    return mark("attention");
  }
  cuda::AttentionArgs aa{in};
  aa.parallel_splits = pending_.parallel_attention;
  aa.split_blocks = pending_.split_blocks;
  aa.paired_chunks = pending_.paired_chunks;
  aa.rope_in = rope_in;
  aa.rope = qa;
  if (pending_.attention_tiles > 0) {
    aa.tiles = d.input<uint32_t>(d.in.tiles);
    aa.tile_count = pending_.attention_tiles;
  }
  BULKHEAD_RETURN_IF_ERROR(cuda::launchAttention(aa, stream));
  return mark("attention");
}

bool CudaBackend::lmHeadStoresRows() const {
  return logits_in_product_ && d_->cublas == nullptr && fault_role_ != lm_head_.product;
}

Status CudaBackend::launchOutput(int n, int m, bool aligned) {
  const ModelConfig& c = config();
  CudaState& d = *d_;
  cudaStream_t stream = d.stream.get();
  const bool checks = limits_.checks_weight_reads;
  // The last residual add for every row; the final norm for the rows whose logits were asked.
  BULKHEAD_RETURN_IF_ERROR(cuda::launchRmsNorm(normBefore(layers_.size(), n), stream));
  BULKHEAD_RETURN_IF_ERROR(mark("norm (final)"));

  const int vocab = c.vocab_size;
  auto* const* dst = d.input<float*>(d.in.dst);
  auto* const* dst_host = d.inputHost<float*>(d.in.dst);
  BULKHEAD_RETURN_IF_ERROR(awaitStaged(lm_head_));
  for (int first = 0; first < m; first += kLogitsChunk) {
    const int rows = std::min(kLogitsChunk, m - first);
    const bool in_product = lmHeadStoresRows();
    BULKHEAD_RETURN_IF_ERROR(products(
        {&lm_head_}, d.final_rows.get<__nv_bfloat16>() + size_t(first) * c.hidden_size, rows,
        d.logits.get<float>(), vocab, nullptr, nullptr, first, in_product ? dst + first : nullptr));
    BULKHEAD_RETURN_IF_ERROR(mark("product lm_head"));
    cuda::LogitsArgs la;
    la.logits = d.logits.get<float>();
    la.rows = rows;
    la.vocab = vocab;
    la.dst = dst + first;
    la.aligned = aligned;
    la.row_sums = d.result<unsigned long long>(d.res.row_sums) + first;
    la.row_nonfinite = d.result<unsigned int>(d.res.nonfinite) + first;
    la.role = checks ? lm_head_.product : -1;
    la.check_row = first;
    la.checks = d.view;
    la.rows_written = in_product;
    BULKHEAD_RETURN_IF_ERROR(cuda::launchLogits(la, stream));
    BULKHEAD_RETURN_IF_ERROR(mark("logits rows out"));
    // Rows not in the registered arena went to the fallback buffer: copy them out in order.
    for (int r = first; r < first + rows; ++r) {
      if (!pending_.copied_out[size_t(r)]) continue;
      BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pending_.rows[size_t(r)].payload, dst_host[r],
                                                    size_t(vocab) * 4, cudaMemcpyDeviceToHost,
                                                    stream));
      BULKHEAD_RETURN_IF_ERROR(mark("logits copy-out"));
    }
  }
  BULKHEAD_RETURN_IF_ERROR(releaseStaged(lm_head_));
  if (checks)
    BULKHEAD_RETURN_IF_ERROR(cuda::launchCountFailedProducts(
        d.view.products, n, product_roles_, d.product_scales.get<cuda::ProductScale>(),
        {d.result<unsigned int>(d.res.failed), d.result<unsigned int>(d.res.strayed),
         d.result<unsigned int>(d.res.checked)},
        d.view.folds, int(folds_.size()), d.result<cuda::FoldTotal>(d.res.folds), stream));
  BULKHEAD_RETURN_IF_ERROR(mark("count product checks"));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.results_host.get(), d.results.get(),
                                                d.res.fold_slots, cudaMemcpyDeviceToHost, stream));
  return mark("results read-back");
}

Status CudaBackend::enqueueForward(int n, int m, bool aligned, cudaGraphExec_t graph) {
  CudaState& d = *d_;
  if (products_dirty_)
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(d.products.get(), 0, d.products.bytes(), d.stream.get()));
  products_dirty_ = true;  // until the whole step is on the stream
  streamed_steps_ += streamed_.empty() ? 0 : 1;
  if (graph != nullptr)
    BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graph, d.stream.get()));
  else
    BULKHEAD_RETURN_IF_ERROR(launchForward(n, m, aligned));
  products_dirty_ = false;
  return okStatus();
}

Result<bool> CudaBackend::productChecksCleared() const {
  const CudaState& d = *d_;
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d.stream.get()));
  std::vector<std::byte> host(d.products.bytes());
  BULKHEAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host.data(), d.products.get(), host.size(), cudaMemcpyDeviceToHost));
  return std::all_of(host.begin(), host.end(), [](std::byte b) { return b == std::byte{0}; });
}

Status CudaBackend::launchForward(int n, int m, bool aligned) {
  CudaState& d = *d_;
  cudaStream_t stream = d.stream.get();
  // The product checks are zero already (enqueueForward); the step's other results are not.
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d.results.get(), 0, d.res.layout.bytes, stream));
  BULKHEAD_RETURN_IF_ERROR(mark("clear checks"));
  BULKHEAD_RETURN_IF_ERROR(beginStaging());
  BULKHEAD_RETURN_IF_ERROR(cuda::launchEmbedding(
      static_cast<const __nv_bfloat16*>(embed_.ptr), config().hidden_size,
      d.input<uint32_t>(d.in.tokens), n, d.x.get<float>(), stream,
      limits_.checks_weight_reads && embed_.fold >= 0 ? d.view.folds + embed_.fold : nullptr,
      embed_.salt, residual_in_products_ ? d.norm_partials.get<float>() : nullptr,
      d.partials_stride));
  BULKHEAD_RETURN_IF_ERROR(mark("embedding"));
  for (size_t l = 0; l < layers_.size(); ++l) BULKHEAD_RETURN_IF_ERROR(launchLayer(l, n));
  BULKHEAD_RETURN_IF_ERROR(launchOutput(n, m, aligned));
  return endStaging();
}

Status CudaBackend::beginStaging() {
  if (streamed_.empty()) return okStatus();
  CudaState& d = *d_;
  // The copies start once the step does (and, captured, belong to its graph); the staging slots
  // are free then, since the step before has finished.
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.fork.get(), d.stream.get()));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d.copy_stream.get(), d.fork.get(), 0));
  return issueStaging(ring_.begin());
}

Status CudaBackend::awaitStaged(const Weight& w) {
  const int j = unit_of_[w.tensor_index];
  if (j < 0) return okStatus();
  BULKHEAD_ASSIGN_OR_RETURN(const std::vector<StagingRing::Op> ops, ring_.before(size_t(j)));
  return issueStaging(ops);
}

Status CudaBackend::releaseStaged(const Weight& w) {
  const int j = unit_of_[w.tensor_index];
  if (j < 0) return okStatus();
  BULKHEAD_ASSIGN_OR_RETURN(const std::vector<StagingRing::Op> ops, ring_.after(size_t(j)));
  return issueStaging(ops);
}

Status CudaBackend::endStaging() {
  if (streamed_.empty()) return okStatus();
  CudaState& d = *d_;
  BULKHEAD_RETURN_IF_ERROR(ring_.end());
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.join.get(), d.copy_stream.get()));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(d.stream.get(), d.join.get(), 0));
  return okStatus();
}

Status CudaBackend::issueStaging(std::span<const StagingRing::Op> ops) {
  CudaState& d = *d_;
  cudaStream_t copy = d.copy_stream.get(), compute = d.stream.get();
  for (const StagingRing::Op& op : ops) {
    cudaEvent_t staged = d.staged[op.slot].get(), freed = d.freed[op.slot].get();
    switch (op.kind) {
      case StagingRing::Op::kCopyWaitsFreed:
        BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy, freed, 0));
        break;
      case StagingRing::Op::kCopy:
        BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            d.staging.get<std::byte>() + op.slot * slot_bytes_, streamed_[op.unit].host,
            streamed_[op.unit].bytes, cudaMemcpyHostToDevice, copy));
        break;
      case StagingRing::Op::kRecordStaged:
        BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(staged, copy));
        break;
      case StagingRing::Op::kComputeWaits:
        BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, staged, 0));
        break;
      case StagingRing::Op::kRecordFreed:
        BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(freed, compute));
        break;
    }
  }
  return okStatus();
}

WeightReadVerdict CudaBackend::verifySlots() const {
  WeightReadVerdict verdict;
  verdict.checked = true;
  for (const Weight* w : weights_) {
    const size_t i = w->tensor_index;
    const std::string_view why =
        unit_of_[i] < 0           ? slot_tags_.mismatch(w->ptr, uint32_t(i), w->generation)
        : w->ptr == staged_at_[i] ? std::string_view()
                                  : std::string_view("bound to other memory than its staging slot");
    if (why.empty()) continue;
    verdict.failed_tensor = w->role;
    verdict.failed_check = WeightCheck::kSlotTag;
    verdict.why = why;
    break;
  }
  return verdict;
}

WeightReadVerdict CudaBackend::verdictOfStep() const {
  const CudaState& d = *d_;
  WeightReadVerdict verdict;
  verdict.checked = limits_.checks_weight_reads;
  if (!verdict.checked) return verdict;
  const auto* folds = d.resultHost<cuda::FoldTotal>(d.res.folds);
  const uint64_t rows = uint64_t(pending_.tokens), logits_rows = pending_.rows.size();
  for (size_t i = 0; i < folds_.size(); ++i) {
    const FoldRole& f = folds_[i];
    uint64_t want_sum = 0, want_words = 0;
    switch (f.uses) {
      case FoldRole::kTokenRows:
        want_sum = rows * f.expected;
        want_words = rows * f.words;
        break;
      case FoldRole::kLogitsRows:
        want_sum = logits_rows * f.expected;
        want_words = logits_rows * f.words;
        break;
      case FoldRole::kProducts:
        want_sum = f.expected;
        want_words = f.words;
        break;
      case FoldRole::kLogitsChunks: {
        const uint64_t launches = (logits_rows + kLogitsChunk - 1) / kLogitsChunk;
        want_sum = launches * f.expected;
        want_words = launches * f.words;
        break;
      }
      case FoldRole::kGathered:
        for (uint32_t token : pending_.gathered) want_sum += f.row_expected[token];
        want_words = pending_.gathered.size() * (f.words / f.row_expected.size());
        break;
    }
    const uint64_t sum = folds[i].sum, words = folds[i].words;
    verdict.words_read += words;
    const uint64_t mask = f.folded32() ? 0xffffffffu : ~uint64_t(0);
    if (verdict.failed_tensor.empty() &&
        ((sum & mask) != (want_sum & mask) || words != want_words)) {
      verdict.failed_tensor = f.weight->role;
      verdict.why = words != want_words ? "not read in full"
                    : f.weight->ptr != d.slots[f.weight->tensor_index]
                        ? "read from another slot than its own"
                        : "its bytes differ from the checkpoint";
    }
  }
  if (!verdict.failed_tensor.empty()) return verdict;
  // The first product in the forward order whose check failed: a wrong value spoils every
  // product after it.
  const auto* failed = d.resultHost<unsigned int>(d.res.failed);
  const auto* checked = d.resultHost<unsigned int>(d.res.checked);
  for (int r = 0; r < product_roles_; ++r) {
    if (failed[r] == 0) continue;
    verdict.failed_tensor = linear_[size_t(r)]->role;
    verdict.failed_check = WeightCheck::kArithmetic;
    verdict.why = "its products fail the arithmetic check (" + std::to_string(failed[r]) + " of " +
                  std::to_string(checked[r]) + " output rows)";
    break;
  }
  return verdict;
}

Status CudaBackend::waitStep(WeightReadVerdict& verdict) {
  if (!pending_.queued) return failedPrecondition("waitStep without an enqueued step");
  pending_.queued = false;
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  if (pending_.tokens < 0) {  // a binding failed its slot tag: nothing was computed
    verdict = verifySlots();
    return okStatus();
  }
  CudaState& d = *d_;
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(d.done.get()));
  verdict = verdictOfStep();
  const int strayed = strayedRole();
  if (verdict.failed_tensor.empty() && strayed >= 0)
    BULKHEAD_RETURN_IF_ERROR(computeAgain(strayed, verdict));
  BULKHEAD_RETURN_IF_ERROR(collectLaunchTimes());
  const auto* sums = d.resultHost<unsigned long long>(d.res.row_sums);
  const auto* nonfinite = d.resultHost<unsigned int>(d.res.nonfinite);
  for (size_t r = 0; r < pending_.rows.size(); ++r)
    *pending_.rows[r].check = RowCheck{sums[r], nonfinite[r] == 0};
  return okStatus();
}

Status CudaBackend::mark(const char* what) {
  if (!kernel_times_) return okStatus();
  CudaState& d = *d_;
  if (d.marks_used == d.marks.size()) {
    BULKHEAD_ASSIGN_OR_RETURN(cuda::Event e, cuda::Event::create(/*timed=*/true));
    d.marks.push_back(std::move(e));
    d.mark_names.push_back(nullptr);
  }
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.marks[d.marks_used].get(), d.stream.get()));
  d.mark_names[d.marks_used++] = what;
  return okStatus();
}

Status CudaBackend::collectLaunchTimes() {
  CudaState& d = *d_;
  for (size_t i = 1; i < d.marks_used; ++i) {
    if (d.mark_names[i] == nullptr) continue;
    float ms = 0;
    BULKHEAD_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, d.marks[i - 1].get(), d.marks[i].get()));
    auto kind = std::find_if(d.launch_times.begin(), d.launch_times.end(),
                             [&](const LaunchTime& t) { return t.what == d.mark_names[i]; });
    if (kind == d.launch_times.end())
      kind = d.launch_times.insert(d.launch_times.end(), LaunchTime{d.mark_names[i], 0, 0});
    ++kind->launches;
    kind->total_us += 1e3 * double(ms);
  }
  d.marks_used = 0;
  return okStatus();
}

std::vector<LaunchTime> CudaBackend::takeLaunchTimes() {
  return std::exchange(d_->launch_times, {});
}

int CudaBackend::strayedRole() const {
  if (!limits_.checks_weight_reads) return -1;
  const auto* strayed = d_->resultHost<unsigned int>(d_->res.strayed);
  for (int r = 0; r < product_roles_; ++r)
    if (strayed[r] != 0) return r;
  return -1;
}

Status CudaBackend::computeAgain(int strayed, WeightReadVerdict& verdict) {
  // A product's check strayed beyond what rounding does in practice, though within its
  // worst-case bound: a wrong output of ordinary size in a wide product, or rare rounding. The
  // same launches round the same way to the bit, and a transient fault does not repeat, so the
  // step runs again (rewriting its KV entries and rows) and the two runs decide: rounding gives
  // the same logits and strays in the same products again.
  CudaState& d = *d_;
  const auto* sums = d.resultHost<unsigned long long>(d.res.row_sums);
  const std::vector<unsigned long long> first(sums, sums + pending_.rows.size());
  const auto* counts = d.resultHost<unsigned int>(d.res.strayed);
  const std::vector<unsigned int> first_strays(counts, counts + product_roles_);
  const unsigned int strays = counts[strayed];
  ++recomputed_steps_;
  spdlog::debug("computing a step again: product {} strayed in {} output rows",
                linear_[size_t(strayed)]->role, strays);
  BULKHEAD_RETURN_IF_ERROR(mark(nullptr));
  BULKHEAD_RETURN_IF_ERROR(
      enqueueForward(pending_.tokens, int(pending_.rows.size()), pending_.aligned, nullptr));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(d.done.get(), d.stream.get()));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(d.done.get()));
  verdict = verdictOfStep();
  if (!verdict.failed_tensor.empty()) return okStatus();
  const bool same_logits = std::equal(first.begin(), first.end(), sums);
  if (!same_logits || !std::equal(first_strays.begin(), first_strays.end(), counts)) {
    // A fault, even one that left this step's logits alone (an output no requested row
    // depends on): the device computed something wrong.
    verdict.failed_tensor = linear_[size_t(strayed)]->role;
    verdict.failed_check = WeightCheck::kArithmetic;
    verdict.why = "its products strayed beyond rounding (" + std::to_string(strays) +
                  " output rows) and the step computed again " +
                  (same_logits ? "did not" : "gave other logits");
    return okStatus();
  }
  if (strays_repeated_++ % 1000 == 0)
    spdlog::warn(
        "{} strayed beyond the usual rounding in {} output rows, and the step computed again "
        "gave the same logits: rounding, passed ({} such steps so far)",
        linear_[size_t(strayed)]->role, strays, strays_repeated_);
  return okStatus();
}

Result<std::string> CudaBackend::computeFault(uint64_t selector) {
  fault_role_ = int(selector % uint64_t(product_roles_));
  fault_selector_ = selector;
  return linear_[size_t(fault_role_)]->role;
}

Result<std::string> CudaBackend::staleSlot(uint64_t selector) {
  Weight& w = *weights_[selector % weights_.size()];
  const size_t bytes = w.tensor->data.size();
  // Another resident slot of the same size whose bytes differ, if there is one.
  for (const Weight* other : weights_) {
    if (other->ptr == w.ptr || other->tensor->data.size() != bytes ||
        std::memcmp(other->tensor->data.data(), w.tensor->data.data(), bytes) == 0)
      continue;
    w.ptr = other->ptr;
    d_->graphs.clear();  // captured with the old binding
    return w.role;
  }
  // Otherwise a stale copy: an older version that differs in every row's first byte.
  std::vector<std::byte> copy(w.tensor->data.begin(), w.tensor->data.end());
  const size_t row_bytes = size_t(w.tensor->shape.back()) * 2;
  for (size_t at = 0; at < bytes; at += row_bytes) copy[at] ^= std::byte(0x10);
  BULKHEAD_ASSIGN_OR_RETURN(DeviceMemory stale, DeviceMemory::allocate(bytes));
  BULKHEAD_RETURN_IF_ERROR(copyToDevice(stale.get(), copy.data(), bytes, d_->stream.get()));
  w.ptr = stale.get();
  d_->stale.push_back(std::move(stale));
  d_->graphs.clear();
  return w.role;
}

Status CudaBackend::checkRange(const WeightRange& r) const {
  if (r.tensor >= used_.size() || r.offset > used_[r.tensor]->data.size() ||
      r.bytes > used_[r.tensor]->data.size() - r.offset)
    return invalidArgument("resident range " + std::to_string(r.offset) + "+" +
                           std::to_string(r.bytes) + " outside tensor " + std::to_string(r.tensor));
  return okStatus();
}

Status CudaBackend::onDevice() const {
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return okStatus();
}

Status CudaBackend::residentChecksums(std::span<const WeightRange> ranges,
                                      std::span<uint64_t> out) {
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  if (out.size() != ranges.size())
    return invalidArgument(std::to_string(ranges.size()) + " ranges but " +
                           std::to_string(out.size()) + " checksum destinations");
  for (const WeightRange& r : ranges) BULKHEAD_RETURN_IF_ERROR(checkRange(r));
  if (ranges.empty()) return okStatus();
  CudaState& d = *d_;
  if (ranges.size() > d.scrub_capacity) {
    const size_t range_bytes = ranges.size() * sizeof(cuda::DeviceRange);
    BULKHEAD_ASSIGN_OR_RETURN(d.scrub_ranges, DeviceMemory::allocate(range_bytes));
    BULKHEAD_ASSIGN_OR_RETURN(d.scrub_sums, DeviceMemory::allocate(ranges.size() * 8));
    BULKHEAD_ASSIGN_OR_RETURN(d.scrub_ranges_host, PinnedMemory::allocate(range_bytes));
    BULKHEAD_ASSIGN_OR_RETURN(d.scrub_sums_host, PinnedMemory::allocate(ranges.size() * 8));
    d.scrub_capacity = ranges.size();
  }
  auto* refs = d.scrub_ranges_host.get<cuda::DeviceRange>();
  for (size_t i = 0; i < ranges.size(); ++i)
    refs[i] = {d.slots[ranges[i].tensor] + ranges[i].offset, ranges[i].bytes};
  cudaStream_t s = d.scrub_stream.get();
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.scrub_ranges.get(), refs,
                                                ranges.size() * sizeof(cuda::DeviceRange),
                                                cudaMemcpyHostToDevice, s));
  BULKHEAD_RETURN_IF_ERROR(cuda::launchRangeChecksums(d.scrub_ranges.get<cuda::DeviceRange>(),
                                                      int(ranges.size()),
                                                      d.scrub_sums.get<uint64_t>(), s));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d.scrub_sums_host.get(), d.scrub_sums.get(),
                                                out.size() * 8, cudaMemcpyDeviceToHost, s));
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  std::copy_n(d.scrub_sums_host.get<uint64_t>(), out.size(), out.begin());
  return okStatus();
}

Status CudaBackend::repairResident(const WeightRange& r) {
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  BULKHEAD_RETURN_IF_ERROR(checkRange(r));
  const std::byte* from = used_[r.tensor]->data.data() + r.offset;
  if (unit_of_[r.tensor] >= 0) {  // a streamed tensor's host copy
    std::memcpy(host_at_[r.tensor] + r.offset, from, r.bytes);
    return okStatus();
  }
  return copyToDevice(d_->slots[r.tensor] + r.offset, from, r.bytes, d_->scrub_stream.get());
}

Status CudaBackend::flipWeightBit(uint64_t byte_offset, uint8_t bit) {
  if (bit > 7) return invalidArgument("bit " + std::to_string(bit) + " is not 0..7");
  BULKHEAD_RETURN_IF_ERROR(onDevice());
  uint64_t offset = byte_offset;
  for (size_t t = 0; t < used_.size(); ++t) {
    if (offset < used_[t]->data.size() && unit_of_[t] >= 0) {  // a streamed tensor's host copy
      host_at_[t][offset] ^= std::byte(1u << bit);
      return okStatus();
    }
    if (offset < used_[t]->data.size()) {
      std::byte* at = d_->slots[t] + offset;
      std::byte value;
      cudaStream_t s = d_->scrub_stream.get();
      BULKHEAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&value, at, 1, cudaMemcpyDeviceToHost, s));
      BULKHEAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
      value ^= std::byte(1u << bit);
      return copyToDevice(at, &value, 1, s);
    }
    offset -= used_[t]->data.size();
  }
  return invalidArgument(
      "weight byte " + std::to_string(byte_offset) + " outside " +
      std::to_string(limits_.resident_weight_bytes + limits_.streamed_weight_bytes) + " bytes");
}

}  // namespace bulkhead
