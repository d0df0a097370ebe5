// Float32 kernels of the CPU reference engine. Each output element is produced by one fixed
// sequence of operations that depends only on the vector length, never on how many rows are
// computed together or on which thread runs them: batch- and chunk-invariance rests on this.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shared/checksum.h"
#include "shared/dtype.h"
#include "shared/work_pool.h"

namespace bulkhead::cpu {

// Where a kernel's parallel part runs: on `pool` when the kernel has at least `min_macs`
// multiply-adds (waking threads costs more than small products pay back), else on the caller.
struct Threads {
  WorkPool* pool = nullptr;  // null: always on the caller
  int64_t min_macs = 0;
  bool worthIt(int64_t macs) const {
    return pool != nullptr && pool->threads() > 1 && macs >= min_macs;
  }
};

// What one step's kernels read of one weight, folded as they read it: the sum of
// foldWeightRow() over every row they loaded through the pointer they were handed, the words
// counted, and how many kernels used the weight. The backend compares it with the checkpoint's
// bytes at the end of the step (in-step integrity).
struct WeightReads {
  std::atomic<uint64_t> sum{0};
  std::atomic<uint64_t> words{0};
  std::atomic<uint32_t> uses{0};
  // The arithmetic check (ColumnSums): output rows checked, and how many of them failed.
  std::atomic<uint64_t> rows_checked{0};
  std::atomic<uint64_t> rows_failed{0};
  void reset() {
    sum.store(0, std::memory_order_relaxed);
    words.store(0, std::memory_order_relaxed);
    uses.store(0, std::memory_order_relaxed);
    rows_checked.store(0, std::memory_order_relaxed);
    rows_failed.store(0, std::memory_order_relaxed);
  }
};

// The arithmetic check of a linear layer (algorithm-based fault tolerance): for every output row
// y = W x, sum_j y_j must equal sum_k colsum_k x_k, where colsum_k = sum_j W_jk is computed from
// the checkpoint's bytes at load. A float32 dot product of length n errs by at most about
// n * 2^-24 * sum_k |W_jk| |x_k|, so the sums may differ by at most n * 2^-24 * sum_k abssum_k
// |x_k| (abssum_k = sum_j |W_jk|); a faulty multiply-add, or a weight that is not the
// checkpoint's, shows as a larger difference.
struct ColumnSums {
  std::vector<double> sum;
  std::vector<double> abs_sum;
};

// A row-major [rows][cols] weight matrix in its checkpoint dtype (a vector has one row).
struct WeightMatrix {
  DType dtype = DType::kF32;
  const std::byte* data = nullptr;
  int rows = 0;
  int cols = 0;
  uint32_t salt = 0;                    // names the weight's role in the folded terms
  WeightReads* reads = nullptr;         // null: reads are not folded
  const ColumnSums* columns = nullptr;  // null (or reads null): no arithmetic check
  // Fault injection: >= 0 flips the highest exponent bit of one accumulator in the next product,
  // output (fault % rows) of token (fault / rows % tokens), after the dot product and before its
  // value is stored or checked.
  int64_t fault = -1;

  size_t rowBytes() const { return size_t(cols) * dtypeSize(dtype); }
};

// y[t * w.rows + j] = dot(x[t * w.cols ...], row j of w) (+ bias[j]) (+ y when accumulate), for
// t < tokens. Parallel over j when `threads` say the product is worth it; each dot product has a
// fixed reduction order.
void matmul(const float* x, int tokens, const WeightMatrix& w, const float* bias, float* y,
            bool accumulate, const Threads& threads);

// The same products as matmul (no bias), token t's outputs written to rows[t][0..w.rows) and
// checks[t] = checkRow() of what was written, folded in as each value is stored (no second pass
// over the rows).
void matmulCheckedRows(const float* x, int tokens, const WeightMatrix& w, float* const* rows,
                       RowCheck* checks, const Threads& threads);

// The column sums of `w` (from these bytes: the checkpoint's), for its arithmetic check.
ColumnSums columnSums(const WeightMatrix& w);
// Columns [begin, end) of them into `out` (sized for every column): each column's rows are added
// in the same order as columnSums, so ranges computed apart give the same sums.
void columnSumsRange(const WeightMatrix& w, int begin, int end, ColumnSums& out);

// Same reduction order as the rows of matmul, for two float32 vectors.
float dot(const float* a, const float* b, int n);

// out = weight * (x / sqrt(mean(x^2) + eps)), element order as the reference implementation.
void rmsNorm(const float* x, const float* weight, float eps, int n, float* out);

// Converts n elements of a checkpoint tensor to float32.
void toFloat(DType dtype, const std::byte* src, size_t n, float* dst);

// Row `row` of `w` converted to float32 (an embedding lookup, or a vector with row 0), folded into
// w.reads as it is read.
void readRow(const WeightMatrix& w, int row, float* dst);

}  // namespace bulkhead::cpu
