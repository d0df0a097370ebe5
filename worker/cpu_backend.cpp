// CpuBackend: weight copy, paged KV cache and the forward pass. enqueueStep() validates and copies
// the step; the forward pass runs in waitStep().
#include "worker/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "shared/checksum.h"
#include "shared/mix.h"
#include "shared/work_pool.h"

namespace bulkhead {

Result<std::unique_ptr<CpuBackend>> CpuBackend::create(std::shared_ptr<const Checkpoint> checkpoint,
                                                       const Options& options) {
  std::unique_ptr<CpuBackend> b(new CpuBackend());
  b->checkpoint_ = checkpoint;
  b->threads_.min_macs = options.parallel_macs;
  b->setThreads(options.threads);
  b->attention_scale_factor_ = options.attention_scale_factor;
  const ModelConfig& c = checkpoint->config();
  const ModelTensors& t = checkpoint->tensors();

  if (options.kv_block_size == 0) return invalidArgument("kv block size must be positive");
  // Keys and values in floats; computed in double first, where no product can wrap.
  if (double(options.kv_block_size) * c.num_layers * c.kvDim() * 2 * 4 > 0x1p62)
    return resourceExhausted("a KV block of this model is over 2^62 bytes");
  const uint64_t block_bytes = uint64_t(options.kv_block_size) * c.num_layers * c.kvDim() * 2 * 4;
  uint64_t blocks = options.kv_blocks;
  if (blocks == 0) {
    // The budget, but never more than 64 full-context sequences' worth.
    const uint64_t per_context =
        (uint64_t(c.max_context) + options.kv_block_size - 1) / options.kv_block_size;
    blocks = std::min(options.kv_budget_bytes / block_bytes, per_context * 64);
  }
  if (blocks == 0 || blocks > UINT32_MAX)
    return resourceExhausted("KV cache of " + std::to_string(blocks) + " blocks is unusable");
  // More than the host's memory can never be served (and asking for it would end the worker in
  // std::bad_alloc, or in the OOM killer once touched).
  const double kv_bytes = double(blocks) * double(block_bytes);
  const double host_bytes = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGE_SIZE));
  if (kv_bytes > host_bytes)
    return resourceExhausted("KV cache of " + std::to_string(blocks) + " blocks (" +
                             std::to_string(uint64_t(kv_bytes) >> 20) +
                             " MiB) is larger than this host's memory (" +
                             std::to_string(uint64_t(host_bytes) >> 20) + " MiB): see --kv-blocks");
  const size_t kv_floats = size_t(blocks) * options.kv_block_size * c.num_layers * c.kvDim();
  b->limits_ = {.vocab_size = uint32_t(c.vocab_size),
                .max_context = uint32_t(c.max_context),
                .kv_block_size = options.kv_block_size,
                .kv_block_count = uint32_t(blocks),
                .max_step_tokens = options.max_step_tokens,
                .graph_batch_buckets = {},
                .resident_weight_bytes = checkpoint->weightBytes(),
                .streamed_weight_bytes = 0,
                .kv_cache_bytes = uint64_t(kv_floats) * 2 * sizeof(float),
                .checks_weight_reads = options.check_weight_reads,
                .compute_grows_with_rows = true};
  b->k_cache_ = std::make_unique_for_overwrite<float[]>(kv_floats);
  b->v_cache_ = std::make_unique_for_overwrite<float[]>(kv_floats);

  // One owned copy of every tensor the model uses, each 64-byte aligned.
  b->used_ = checkpoint->usedTensors();
  const std::vector<const TensorView*>& used = b->used_;
  auto aligned = [](size_t n) { return (n + 63) & ~size_t(63); };
  size_t total = 0;
  for (const TensorView* m : used) total += aligned(m->data.size());
  b->weight_bytes_ = std::make_unique_for_overwrite<std::byte[]>(total + 64);
  std::byte* base = reinterpret_cast<std::byte*>(
      (reinterpret_cast<uintptr_t>(b->weight_bytes_.get()) + 63) & ~uintptr_t(63));
  std::map<const TensorView*, std::byte*> where;
  size_t offset = 0;
  std::vector<ByteCopy> copies;
  for (const TensorView* m : used) {
    copies.push_back({m->data, base + offset});
    b->slot_tags_.tag(base + offset, uint32_t(b->resident_.size()));
    b->resident_.push_back(base + offset);
    where[m] = base + offset;
    offset += aligned(m->data.size());
  }
  copyInPieces(*b->pool_, copies, size_t(16) << 20);
  auto matrix = [&](const TensorView* m) {
    return cpu::WeightMatrix{m->dtype, where.at(m), int(m->shape[0]), int(m->shape[1])};
  };
  auto vector = [&](const TensorView* m) {
    return m == nullptr ? Vector{} : Vector{m->dtype, where.at(m), 1, int(m->numel())};
  };
  b->embed_ = matrix(t.embed);
  b->lm_head_ = matrix(t.lm_head);
  b->final_norm_ = vector(t.final_norm);
  for (const LayerTensors& l : t.layers) {
    b->layers_.push_back({.q = matrix(l.q),
                          .k = matrix(l.k),
                          .v = matrix(l.v),
                          .o = matrix(l.o),
                          .gate = matrix(l.gate),
                          .up = matrix(l.up),
                          .down = matrix(l.down),
                          .input_norm = vector(l.input_norm),
                          .post_norm = vector(l.post_norm),
                          .q_bias = vector(l.q_bias),
                          .k_bias = vector(l.k_bias),
                          .v_bias = vector(l.v_bias),
                          .o_bias = vector(l.o_bias)});
  }
  b->inv_freq_ = c.ropeInverseFrequencies();

  // In-step accounts, one per weight role (a tied lm_head is its own role beside the embedding).
  b->account(b->embed_, *t.embed, t.embed->name, /*by_row=*/true, /*linear=*/false);
  b->account(b->lm_head_, *t.lm_head,
             t.lm_head == t.embed ? "lm_head (tied to " + t.embed->name + ")" : t.lm_head->name,
             false, true);
  if (t.final_norm != nullptr)
    b->account(b->final_norm_, *t.final_norm, t.final_norm->name, false, false);
  for (size_t i = 0; i < t.layers.size(); ++i) {
    const LayerTensors& l = t.layers[i];
    Layer& L = b->layers_[i];
    const std::pair<cpu::WeightMatrix*, const TensorView*> roles[] = {{&L.q, l.q},
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
                                                                      {&L.v_bias, l.v_bias},
                                                                      {&L.o_bias, l.o_bias}};
    constexpr size_t kLinearRoles = 7;  // q .. down: the products; then norms and biases
    for (size_t r = 0; r < std::size(roles); ++r)
      if (roles[r].second != nullptr)
        b->account(*roles[r].first, *roles[r].second, roles[r].second->name, false,
                   r < kLinearRoles);
  }
  b->computeAccounts();
  return b;
}

void CpuBackend::account(cpu::WeightMatrix& w, const TensorView& tensor, const std::string& role,
                         bool by_row, bool linear) {
  bindings_.push_back(&w);
  role_names_.push_back(role);
  if (linear) {
    linear_.push_back(&w);
    linear_names_.push_back(role);
  }
  if (!limits_.checks_weight_reads) return;
  ReadAccount& a = accounts_.emplace_back();
  a.tensor = role;
  a.binding = &w;
  a.slot = w.data;
  a.tensor_index = uint32_t(std::find(used_.begin(), used_.end(), &tensor) - used_.begin());
  a.generation = slot_tags_.generation(resident_[a.tensor_index]);
  w.salt = uint32_t(splitmix64(accounts_.size()));
  w.reads = &a.reads;
  a.source = &tensor;
  a.by_row = by_row;
  a.linear = linear;
  a.words = uint64_t(w.rows) * weightRowWords(w.rowBytes());
  if (linear) w.columns = &a.columns;
}

void CpuBackend::computeAccounts() {
  // Jobs of at most kRows rows of folds (they add up in any order) and of at most kColumns
  // columns of a linear layer's column sums (each column's rows added in one fixed order), from
  // the checkpoint's own bytes (the mapped file), never from the resident copy.
  constexpr int kRows = 4096, kColumns = 1024;
  struct Job {
    ReadAccount* account;
    int first_row = 0, rows = 0;  // rows == 0: column sums of columns [first_row, first_row + n)
    int columns = 0;
    uint64_t fold = 0;
  };
  std::vector<Job> jobs;
  for (ReadAccount& a : accounts_) {
    const int rows = a.binding->rows, cols = a.binding->cols;
    if (a.by_row) a.row_expected.assign(size_t(rows), 0);
    for (int j = 0; j < rows; j += kRows) jobs.push_back({&a, j, std::min(kRows, rows - j)});
    if (!a.linear) continue;
    a.columns = {std::vector<double>(size_t(cols), 0.0), std::vector<double>(size_t(cols), 0.0)};
    for (int c = 0; c < cols; c += kColumns)
      jobs.push_back({&a, c, 0, std::min(kColumns, cols - c)});
  }
  pool_->parallelFor(jobs.size(), [&](size_t i) {
    Job& job = jobs[i];
    ReadAccount& a = *job.account;
    cpu::WeightMatrix checkpoint_bytes = *a.binding;
    checkpoint_bytes.data = a.source->data.data();
    if (job.rows == 0) {
      cpu::columnSumsRange(checkpoint_bytes, job.first_row, job.first_row + job.columns, a.columns);
      return;
    }
    const size_t row_bytes = checkpoint_bytes.rowBytes();
    const uint64_t row_words = weightRowWords(row_bytes);
    for (int j = job.first_row; j < job.first_row + job.rows; ++j) {
      const uint64_t fold = foldWeightRow(checkpoint_bytes.data + size_t(j) * row_bytes, row_bytes,
                                          uint64_t(j) * row_words, checkpoint_bytes.salt);
      if (a.by_row) a.row_expected[size_t(j)] = fold;
      job.fold += fold;
    }
  });
  for (const Job& job : jobs) job.account->expected += job.fold;
}

WeightReadVerdict CpuBackend::verifyReads(std::span<const uint32_t> gathered) const {
  WeightReadVerdict verdict{.checked = limits_.checks_weight_reads};
  for (const ReadAccount& a : accounts_) {
    const uint64_t sum = a.reads.sum.load(std::memory_order_relaxed);
    const uint64_t words = a.reads.words.load(std::memory_order_relaxed);
    const uint64_t uses = a.reads.uses.load(std::memory_order_relaxed);
    uint64_t want_sum = uses * a.expected, want_words = uses * a.words;
    bool counted = true;
    if (!a.row_expected.empty()) {  // read row by row: the rows this step gathered
      want_sum = 0;
      for (uint32_t row : gathered) want_sum += a.row_expected[row];
      want_words = gathered.size() * (a.words / a.row_expected.size());
      counted = uses == gathered.size();  // one lookup per gathered row
    }
    verdict.words_read += words;
    const bool full = counted && words == want_words;
    if ((!full || sum != want_sum) && verdict.failed_tensor.empty()) {
      verdict.failed_tensor = a.tensor;
      // The check itself looked at what the kernels read; this only says which way it is wrong.
      verdict.why = !full                       ? "not read in full"
                    : a.binding->data != a.slot ? "read from another slot than its own"
                                                : "its bytes differ from the checkpoint";
    }
  }
  // The arithmetic: only once every weight read was right can a failed column-sum check be a
  // faulty multiply-add rather than a wrong weight. A wrong value spoils every product after it,
  // so the first product in the forward pass (the layers in order, then lm_head) is the culprit.
  std::vector<const ReadAccount*> forward_order;
  for (const ReadAccount& a : accounts_)
    if (a.binding != &lm_head_) forward_order.push_back(&a);
  for (const ReadAccount& a : accounts_)
    if (a.binding == &lm_head_) forward_order.push_back(&a);
  for (const ReadAccount* account : forward_order) {
    const ReadAccount& a = *account;
    if (!verdict.failed_tensor.empty()) break;
    const uint64_t failed = a.reads.rows_failed.load(std::memory_order_relaxed);
    if (failed == 0) continue;
    verdict.failed_tensor = a.tensor;
    verdict.failed_check = WeightCheck::kArithmetic;
    verdict.why = "its products fail the arithmetic check (" + std::to_string(failed) + " of " +
                  std::to_string(a.reads.rows_checked.load(std::memory_order_relaxed)) +
                  " output rows)";
  }
  return verdict;
}

Result<std::string> CpuBackend::computeFault(uint64_t selector) {
  if (linear_.empty()) return failedPrecondition("no linear layers to fault");
  const size_t role = selector % linear_.size();
  // Which output of which token: a value in every row, not only the canary's or the last.
  linear_[role]->fault = int64_t((selector / linear_.size()) & 0x7fffffffffffull);
  return linear_names_[role];
}

Result<std::string> CpuBackend::staleSlot(uint64_t selector) {
  if (bindings_.empty()) return failedPrecondition("no weights to rebind");
  cpu::WeightMatrix& w = *bindings_[selector % bindings_.size()];
  const std::string& name = role_names_[selector % bindings_.size()];
  const size_t bytes = w.rowBytes() * size_t(w.rows);
  // Another resident slot of the same size and dtype whose bytes differ, if there is one.
  for (const cpu::WeightMatrix* other : bindings_) {
    if (other->data == w.data || other->dtype != w.dtype ||
        other->rowBytes() * size_t(other->rows) != bytes ||
        std::memcmp(other->data, w.data, bytes) == 0)
      continue;
    w.data = other->data;
    return name;
  }
  // Otherwise a stale copy: an older version of the weight, which differs in every row (here in
  // one bit of each row's first byte).
  auto copy = std::make_unique_for_overwrite<std::byte[]>(bytes);
  std::memcpy(copy.get(), w.data, bytes);
  for (int j = 0; j < w.rows; ++j) copy[size_t(j) * w.rowBytes()] ^= std::byte(0x10);
  w.data = copy.get();
  stale_copies_.push_back(std::move(copy));
  return name;
}

Status CpuBackend::checkRange(const WeightRange& r) const {
  if (r.tensor >= used_.size() || r.offset > used_[r.tensor]->data.size() ||
      r.bytes > used_[r.tensor]->data.size() - r.offset)
    return invalidArgument("resident range " + std::to_string(r.offset) + "+" +
                           std::to_string(r.bytes) + " outside tensor " + std::to_string(r.tensor));
  return okStatus();
}

Status CpuBackend::residentChecksums(std::span<const WeightRange> ranges, std::span<uint64_t> out) {
  if (out.size() != ranges.size())
    return invalidArgument(std::to_string(ranges.size()) + " ranges but " +
                           std::to_string(out.size()) + " checksum destinations");
  for (const WeightRange& r : ranges) BULKHEAD_RETURN_IF_ERROR(checkRange(r));
  // One range per task: a batch (a full pass) spreads over every core, a single range stays on
  // the calling thread.
  pool_->parallelFor(ranges.size(), [&](size_t i) {
    const WeightRange& r = ranges[i];
    out[i] = checksumBytes(std::span(resident_[r.tensor] + r.offset, r.bytes));
  });
  return okStatus();
}

Status CpuBackend::repairResident(const WeightRange& r) {
  BULKHEAD_RETURN_IF_ERROR(checkRange(r));
  std::memcpy(resident_[r.tensor] + r.offset, used_[r.tensor]->data.data() + r.offset, r.bytes);
  return okStatus();
}

Status CpuBackend::flipWeightBit(uint64_t byte_offset, uint8_t bit) {
  // Offsets count tensor bytes only (no alignment padding), so every flip lands in a weight.
  const auto& used = used_;
  if (bit > 7) return invalidArgument("bit " + std::to_string(bit) + " is not 0..7");
  uint64_t offset = byte_offset;
  for (size_t t = 0; t < used.size(); ++t) {
    if (offset < used[t]->data.size()) {
      resident_[t][offset] ^= std::byte(1u << bit);
      return okStatus();
    }
    offset -= used[t]->data.size();
  }
  return invalidArgument("weight byte " + std::to_string(byte_offset) + " outside " +
                         std::to_string(limits_.resident_weight_bytes) + " bytes");
}

float* CpuBackend::kvAt(float* cache, int layer, uint32_t block, int kv_head, uint32_t slot) const {
  const ModelConfig& c = config();
  const size_t bs = limits_.kv_block_size;
  size_t index = ((size_t(layer) * limits_.kv_block_count + block) * c.num_kv_heads + kv_head);
  index = (index * bs + slot) * c.head_dim;
  return cache + index;
}

unsigned CpuBackend::defaultThreads() {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return cores - WorkPool::coresBesideCpuWorker(cores);
}

void CpuBackend::setThreads(unsigned threads) {
  pool_ = std::make_unique<WorkPool>(threads != 0 ? threads : defaultThreads());
  threads_.pool = pool_.get();
}

Status CpuBackend::enqueueStep(std::span<const SequenceStep> batch,
                               std::span<const RowOutput> rows) {
  if (pending_.queued)
    return failedPrecondition("enqueueStep while a step is pending (waitStep not called)");
  BULKHEAD_RETURN_IF_ERROR(validateStep(batch, rows, limits_));
  // One buffer for every list, filled before any span into it is taken.
  std::vector<uint32_t>& lists = pending_.lists;
  lists.clear();
  for (const SequenceStep& s : batch) {
    lists.insert(lists.end(), s.tokens.begin(), s.tokens.end());
    lists.insert(lists.end(), s.kv_blocks.begin(), s.kv_blocks.end());
    lists.insert(lists.end(), s.logits_rows.begin(), s.logits_rows.end());
  }
  pending_.batch.clear();
  std::span<const uint32_t> rest = lists;
  auto take = [&rest](size_t n) {
    auto part = rest.first(n);
    rest = rest.subspan(n);
    return part;
  };
  for (const SequenceStep& s : batch) {
    const auto tokens = take(s.tokens.size());
    const auto blocks = take(s.kv_blocks.size());
    pending_.batch.push_back({.sequence_id = s.sequence_id,
                              .start_position = s.start_position,
                              .tokens = tokens,
                              .kv_blocks = blocks,
                              .logits_rows = take(s.logits_rows.size())});
  }
  pending_.rows.assign(rows.begin(), rows.end());
  pending_.queued = true;
  pool_->keepWarm(true);  // the helpers wake while the caller gets to waitStep
  return okStatus();
}

WeightReadVerdict CpuBackend::verifySlots() const {
  WeightReadVerdict verdict{.checked = true};
  for (const ReadAccount& a : accounts_) {
    const std::string_view why = slot_tags_.mismatch(a.binding->data, a.tensor_index, a.generation);
    if (why.empty()) continue;
    verdict.failed_tensor = a.tensor;
    verdict.failed_check = WeightCheck::kSlotTag;
    verdict.why = why;
    break;
  }
  return verdict;
}

Status CpuBackend::waitStep(WeightReadVerdict& verdict) {
  if (!pending_.queued) return failedPrecondition("waitStep without an enqueued step");
  pending_.queued = false;
  struct Cool {
    WorkPool& pool;
    ~Cool() { pool.keepWarm(false); }
  } cool{*pool_};
  if (limits_.checks_weight_reads) {
    // A binding that is not its tensor's slot fails the step before anything is computed.
    verdict = verifySlots();
    if (!verdict.failed_tensor.empty()) return okStatus();
  }
  for (ReadAccount& a : accounts_) a.reads.reset();
  std::vector<uint32_t> gathered;
  forward(pending_.batch, pending_.rows, gathered);
  for (cpu::WeightMatrix* w : linear_) w->fault = -1;  // a compute fault lasts one step
  verdict = verifyReads(gathered);
  return okStatus();
}

void CpuBackend::forward(std::span<const SequenceStep> batch, std::span<const RowOutput> logits,
                         std::vector<uint32_t>& gathered) {
  const ModelConfig& c = config();
  const int hidden = c.hidden_size, head_dim = c.head_dim, heads = c.num_heads;
  const int kv_heads = c.num_kv_heads, q_dim = c.qDim(), kv_dim = c.kvDim();
  const int group = heads / kv_heads;
  const uint32_t bs = limits_.kv_block_size;

  // Flatten the batch: one row per token, remembering its sequence and position.
  struct Row {
    const SequenceStep* seq;
    uint32_t position;
  };
  std::vector<Row> rows;
  std::vector<uint32_t> token_ids;
  for (const SequenceStep& s : batch) {
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      rows.push_back({&s, uint32_t(s.start_position + i)});
      token_ids.push_back(s.tokens[i]);
    }
  }
  const int n = int(rows.size());

  std::vector<float> x(size_t(n) * hidden), xn(size_t(n) * hidden);
  std::vector<float> q(size_t(n) * q_dim), k(size_t(n) * kv_dim), v(size_t(n) * kv_dim);
  std::vector<float> attn(size_t(n) * q_dim);
  std::vector<float> gate(size_t(n) * c.intermediate_size), up(size_t(n) * c.intermediate_size);

  for (int r = 0; r < n; ++r)
    cpu::readRow(embed_, int(token_ids[size_t(r)]), x.data() + size_t(r) * hidden);
  gathered = token_ids;

  // RoPE angles per row, shared by all heads (rotate-half layout).
  const int pairs = head_dim / 2;
  std::vector<float> cos_table(size_t(n) * pairs), sin_table(size_t(n) * pairs);
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < pairs; ++i) {
      const float angle = float(rows[size_t(r)].position) * inv_freq_[size_t(i)];
      cos_table[size_t(r) * pairs + i] = std::cos(angle);
      sin_table[size_t(r) * pairs + i] = std::sin(angle);
    }
  }
  auto rope = [&](float* vec, int r) {
    const float* cs = cos_table.data() + size_t(r) * pairs;
    const float* sn = sin_table.data() + size_t(r) * pairs;
    for (int i = 0; i < pairs; ++i) {
      const float a = vec[i], b = vec[i + pairs];
      vec[i] = a * cs[i] - b * sn[i];
      vec[i + pairs] = b * cs[i] + a * sn[i];
    }
  };
  const float scale = float(1.0 / std::sqrt(double(head_dim))) * attention_scale_factor_;
  // Norm weights and biases of the current layer, converted to float32.
  auto floats = [&](const Vector& v, std::vector<float>& out) -> const float* {
    if (v.data == nullptr) return nullptr;
    out.resize(size_t(v.cols));
    cpu::readRow(v, 0, out.data());
    return out.data();
  };
  std::vector<float> input_norm, post_norm, q_bias, k_bias, v_bias, o_bias, final_norm;

  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    floats(L.input_norm, input_norm);
    floats(L.post_norm, post_norm);
    const float* qb = floats(L.q_bias, q_bias);
    const float* kb = floats(L.k_bias, k_bias);
    const float* vb = floats(L.v_bias, v_bias);
    const float* ob = floats(L.o_bias, o_bias);
    for (int r = 0; r < n; ++r) {
      cpu::rmsNorm(x.data() + size_t(r) * hidden, input_norm.data(), c.rms_norm_eps, hidden,
                   xn.data() + size_t(r) * hidden);
    }
    cpu::matmul(xn.data(), n, L.q, qb, q.data(), false, threads_);
    cpu::matmul(xn.data(), n, L.k, kb, k.data(), false, threads_);
    cpu::matmul(xn.data(), n, L.v, vb, v.data(), false, threads_);
    for (int r = 0; r < n; ++r) {
      for (int h = 0; h < heads; ++h) rope(q.data() + size_t(r) * q_dim + h * head_dim, r);
      for (int h = 0; h < kv_heads; ++h) {
        float* kr = k.data() + size_t(r) * kv_dim + h * head_dim;
        rope(kr, r);
        const Row& row = rows[size_t(r)];
        const uint32_t block = row.seq->kv_blocks[row.position / bs];
        std::memcpy(kvAt(k_cache_.get(), int(l), block, h, row.position % bs), kr,
                    sizeof(float) * head_dim);
        std::memcpy(kvAt(v_cache_.get(), int(l), block, h, row.position % bs),
                    v.data() + size_t(r) * kv_dim + h * head_dim, sizeof(float) * head_dim);
      }
    }
    // Causal attention of every (row, head) over positions 0..position of its own sequence, read
    // back from the cache in position order: the same arithmetic for prefill and decode.
    int64_t attention_work = 0;
    for (const Row& row : rows) attention_work += int64_t(row.position + 1) * heads * head_dim;
    std::atomic<int> next_task{0};
    auto member = [&](size_t) {
      thread_local std::vector<float> scores;
      scores.resize(std::max<size_t>(scores.size(), limits_.max_context));
      for (int task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < n * heads;) {
        const int r = task / heads, h = task % heads, kvh = h / group;
        const Row& row = rows[size_t(r)];
        const float* qv = q.data() + size_t(r) * q_dim + h * head_dim;
        const uint32_t len = row.position + 1;
        float max_score = -INFINITY;
        for (uint32_t p = 0; p < len; ++p) {
          const float* kv = kvAt(k_cache_.get(), int(l), row.seq->kv_blocks[p / bs], kvh, p % bs);
          scores[p] = cpu::dot(qv, kv, head_dim) * scale;
          max_score = std::max(max_score, scores[p]);
        }
        float sum = 0.0f;
        for (uint32_t p = 0; p < len; ++p) {
          scores[p] = std::exp(scores[p] - max_score);
          sum += scores[p];
        }
        float* out = attn.data() + size_t(r) * q_dim + h * head_dim;
        std::fill(out, out + head_dim, 0.0f);
        for (uint32_t p = 0; p < len; ++p) {
          const float weight = scores[p] / sum;
          const float* vv = kvAt(v_cache_.get(), int(l), row.seq->kv_blocks[p / bs], kvh, p % bs);
          for (int d = 0; d < head_dim; ++d) out[d] += weight * vv[d];
        }
      }
    };
    if (threads_.worthIt(attention_work)) {
      pool_->parallelFor(pool_->threads(), member);
    } else {
      member(0);
    }
    cpu::matmul(attn.data(), n, L.o, ob, x.data(), true, threads_);

    for (int r = 0; r < n; ++r) {
      cpu::rmsNorm(x.data() + size_t(r) * hidden, post_norm.data(), c.rms_norm_eps, hidden,
                   xn.data() + size_t(r) * hidden);
    }
    cpu::matmul(xn.data(), n, L.gate, nullptr, gate.data(), false, threads_);
    cpu::matmul(xn.data(), n, L.up, nullptr, up.data(), false, threads_);
    for (size_t i = 0; i < gate.size(); ++i) {
      const float g = gate[i];
      gate[i] = (g / (1.0f + std::exp(-g))) * up[i];
    }
    cpu::matmul(gate.data(), n, L.down, nullptr, x.data(), true, threads_);
  }

  // Final norm and lm_head only for the rows whose logits were asked for.
  floats(final_norm_, final_norm);
  std::vector<float> selected;
  int row_base = 0;
  for (const SequenceStep& s : batch) {
    for (uint32_t i : s.logits_rows) {
      const size_t r = size_t(row_base) + i;
      selected.resize(selected.size() + hidden);
      cpu::rmsNorm(x.data() + r * hidden, final_norm.data(), c.rms_norm_eps, hidden,
                   selected.data() + selected.size() - hidden);
    }
    row_base += int(s.tokens.size());
  }
  // lm_head writes straight into the destinations and checks each row as it writes it.
  if (!logits.empty()) {
    std::vector<float*> payloads(logits.size());
    std::vector<RowCheck> checks(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) payloads[i] = logits[i].payload;
    cpu::matmulCheckedRows(selected.data(), int(logits.size()), lm_head_, payloads.data(),
                           checks.data(), threads_);
    for (size_t i = 0; i < logits.size(); ++i) *logits[i].check = checks[i];
  }
}

}  // namespace bulkhead
