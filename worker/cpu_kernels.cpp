// CPU kernels: AVX2/FMA dot products over bf16/f16/f32 weights, with a portable fallback.
#include "worker/cpu_kernels.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "shared/mix.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BULKHEAD_CPU_AVX2 1
#endif

namespace bulkhead::cpu {
namespace {

#ifdef BULKHEAD_CPU_AVX2

template <DType D>
inline __m256 load8(const std::byte* w, int i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + i);
  } else if constexpr (D == DType::kBF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + size_t(i) * 2));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + size_t(i) * 2));
    return _mm256_cvtph_ps(h);
  }
}

inline float hsum(__m256 a, __m256 b) {
  __m256 s = _mm256_add_ps(a, b);
  __m128 lo = _mm256_castps256_ps128(s);
  __m128 hi = _mm256_extractf128_ps(s, 1);
  __m128 q = _mm_add_ps(lo, hi);                  // 4 lanes
  __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));  // 2 lanes
  __m128 r = _mm_add_ss(d, _mm_movehdup_ps(d));   // 1 lane
  return _mm_cvtss_f32(r);
}

#endif

template <DType D>
inline float weightAt(const std::byte* w, size_t i) {
  if constexpr (D == DType::kF32) {
    float f;
    std::memcpy(&f, w + size_t(i) * 4, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, w + size_t(i) * 2, 2);
    return D == DType::kBF16 ? bf16ToFloat(h) : f16ToFloat(h);
  }
}

// N dot products of x[0..N) with one weight row. The per-row arithmetic is identical for every
// N, so grouping rows changes speed, never results.
template <DType D, int N>
inline void dotRows(const float* const* x, const std::byte* w, int n, float* out) {
  int i = 0;
#ifdef BULKHEAD_CPU_AVX2
  __m256 acc0[N], acc1[N];
  for (int r = 0; r < N; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 w0 = load8<D>(w, i);
    __m256 w1 = load8<D>(w, i + 8);
    for (int r = 0; r < N; ++r) {
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i + 8), w1, acc1[r]);
    }
  }
  if (i + 8 <= n) {
    __m256 w0 = load8<D>(w, i);
    for (int r = 0; r < N; ++r) acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), w0, acc0[r]);
    i += 8;
  }
  for (int r = 0; r < N; ++r) out[r] = hsum(acc0[r], acc1[r]);
#else
  float acc[N][16] = {};
  for (; i + 16 <= n; i += 16) {
    for (int r = 0; r < N; ++r) {
      for (int l = 0; l < 16; ++l) acc[r][l] += x[r][i + l] * weightAt<D>(w, i + l);
    }
  }
  for (int r = 0; r < N; ++r) {
    float s = 0.0f;
    for (int l = 0; l < 16; ++l) s += acc[r][l];
    out[r] = s;
  }
#endif
  for (; i < n; ++i) {
    const float wi = weightAt<D>(w, i);
    for (int r = 0; r < N; ++r) out[r] += x[r][i] * wi;
  }
}

// Rows of W processed per parallel task: a block small enough to stay in L1/L2 while every token
// row streams past it.
constexpr int kRowBlock = 16;
// Blocks a thread claims at a time: large enough that claiming costs nothing next to the work.
constexpr int kBlocksPerClaim = 8;

// Where matmulTyped's outputs go. A sink makes one Local per thread; the Local receives every
// (token, column, value) that thread produces, and finish() runs once per thread at the end
// (concurrently with other threads' finish()).
struct AddToMatrix {
  struct Local {
    const AddToMatrix& sink;
    void emit(int tok, int j, float v) {
      if (sink.bias != nullptr) v += sink.bias[j];
      float& dst = sink.y[size_t(tok) * sink.rows + j];
      dst = sink.accumulate ? dst + v : v;
    }
    void finish() {}
  };
  float* y;
  const float* bias;
  int rows;
  bool accumulate;
  Local local() const { return {*this}; }
};

// Writes token t's outputs into rows[t] and folds each value into that row's checksum as it is
// written. Each thread sums the terms of the columns it produced; the partial sums are added at
// the end, which gives exactly checkRow() because the checksum is an order-independent sum.
struct WriteCheckedRows {
  struct Local {
    const WriteCheckedRows& sink;
    std::vector<uint64_t> sums;
    std::vector<uint32_t> non_finite;
    void emit(int tok, int j, float v) {
      sink.rows[tok][j] = v;
      const uint32_t word = std::bit_cast<uint32_t>(v);
      sums[size_t(tok)] += checksumTerm(word, uint32_t(j));
      non_finite[size_t(tok)] |= uint32_t((word & 0x7f800000u) == 0x7f800000u);
    }
    void finish() {
      for (size_t t = 0; t < sums.size(); ++t) {
        std::atomic_ref(sink.checks[t].checksum).fetch_add(sums[t], std::memory_order_relaxed);
        if (non_finite[t] != 0)
          std::atomic_ref(sink.non_finite[t]).store(1u, std::memory_order_relaxed);
      }
    }
  };
  float* const* rows;
  RowCheck* checks;
  uint32_t* non_finite;
  int tokens;
  Local local() const {
    return {*this, std::vector<uint64_t>(size_t(tokens)), std::vector<uint32_t>(size_t(tokens))};
  }
};

// The arithmetic check of one product: each token's sum of outputs against the column sums
// dotted with its input, within the accumulation bound (ColumnSums). The comparison is written
// so that a NaN or an infinity fails it.
void checkColumnSums(const float* x, int tokens, const WeightMatrix& w,
                     std::span<const double> out_sums) {
  const ColumnSums& c = *w.columns;
  const int cols = w.cols;
  // n * 2^-24 per dot product, with margin for the final reductions' own rounding.
  const double gamma = (double(cols) + 16.0) * 0x1p-24 * 1.25;
  uint64_t failed = 0;
  for (int t = 0; t < tokens; ++t) {
    const float* xt = x + size_t(t) * cols;
    double expect = 0, scale = 0;
    for (int k = 0; k < cols; ++k) {
      expect += c.sum[size_t(k)] * xt[k];
      scale += c.abs_sum[size_t(k)] * std::fabs(xt[k]);
    }
    const double bound = gamma * scale + 1e-30;
    if (!(std::fabs(out_sums[size_t(t)] - expect) <= bound)) ++failed;
  }
  w.reads->rows_checked.fetch_add(uint64_t(tokens), std::memory_order_relaxed);
  if (failed != 0) w.reads->rows_failed.fetch_add(failed, std::memory_order_relaxed);
}

template <DType D, class Sink>
void matmulTyped(const float* x, int tokens, const WeightMatrix& w, const Sink& sink,
                 const Threads& threads) {
  const int rows = w.rows, cols = w.cols;
  const size_t row_bytes = size_t(cols) * dtypeSize(D);
  const int blocks = (rows + kRowBlock - 1) / kRowBlock;
  // Threads only where the work pays for them: small products run on the caller.
  const bool parallel = threads.worthIt(int64_t(rows) * cols * tokens);
  const uint64_t row_words = weightRowWords(row_bytes);
  if (w.reads != nullptr) w.reads->uses.fetch_add(1, std::memory_order_relaxed);
  // Each token's sum of outputs, for the arithmetic check (threads add their partial sums).
  const bool abft = w.reads != nullptr && w.columns != nullptr;
  std::vector<double> out_sums(abft ? size_t(tokens) : 0, 0.0);
  const bool armed = w.fault >= 0 && tokens > 0 && rows > 0;
  const int fault_token = armed ? int(w.fault / rows % tokens) : -1;
  const int fault_row = armed ? int(w.fault % rows) : -1;
  auto faulty = [&](int t, int j, float& v) {
    if (t == fault_token && j == fault_row)
      v = std::bit_cast<float>(std::bit_cast<uint32_t>(v) ^ (1u << 30));
  };
  // Blocks are handed out dynamically: a thread the OS preempts (the broker samples on the same
  // cores) leaves its share to the others instead of holding up the whole product. Which thread
  // computes a block never changes its values, and the checksum partial sums are order-free.
  std::atomic<int> next_block{0};
  // One member of the team: claims blocks until none is left.
  auto member = [&](size_t) {
    auto out = sink.local();
    uint64_t read_sum = 0, read_words = 0;
    std::vector<double> sums(out_sums.size(), 0.0);
    for (int claim;
         (claim = next_block.fetch_add(kBlocksPerClaim, std::memory_order_relaxed)) < blocks;)
      for (int b = claim; b < claim + kBlocksPerClaim && b < blocks; ++b) {
        const int j0 = b * kRowBlock;
        const int j1 = j0 + kRowBlock < rows ? j0 + kRowBlock : rows;
        if (w.reads != nullptr) {
          // The block's rows, through the pointer the products below read them from. Rows of
          // whole words are contiguous words, so the block folds in one call.
          if (row_bytes % 4 == 0) {
            read_sum += foldWeightRow(w.data + size_t(j0) * row_bytes, size_t(j1 - j0) * row_bytes,
                                      uint64_t(j0) * row_words, w.salt);
          } else {
            for (int j = j0; j < j1; ++j)
              read_sum += foldWeightRow(w.data + size_t(j) * row_bytes, row_bytes,
                                        uint64_t(j) * row_words, w.salt);
          }
          read_words += uint64_t(j1 - j0) * row_words;
        }
        int t = 0;
        for (; t + 4 <= tokens; t += 4) {
          const float* xs[4] = {x + size_t(t) * cols, x + size_t(t + 1) * cols,
                                x + size_t(t + 2) * cols, x + size_t(t + 3) * cols};
          for (int j = j0; j < j1; ++j) {
            float dots[4];
            dotRows<D, 4>(xs, w.data + size_t(j) * row_bytes, cols, dots);
            for (int r = 0; r < 4; ++r) {
              faulty(t + r, j, dots[r]);
              if (abft) sums[size_t(t + r)] += dots[r];
              out.emit(t + r, j, dots[r]);
            }
          }
        }
        for (; t < tokens; ++t) {
          const float* xs[1] = {x + size_t(t) * cols};
          for (int j = j0; j < j1; ++j) {
            float dots[1];
            dotRows<D, 1>(xs, w.data + size_t(j) * row_bytes, cols, dots);
            faulty(t, j, dots[0]);
            if (abft) sums[size_t(t)] += dots[0];
            out.emit(t, j, dots[0]);
          }
        }
      }
    out.finish();
    for (size_t t = 0; t < sums.size(); ++t)
      std::atomic_ref(out_sums[t]).fetch_add(sums[t], std::memory_order_relaxed);
    if (w.reads != nullptr) {
      w.reads->sum.fetch_add(read_sum, std::memory_order_relaxed);
      w.reads->words.fetch_add(read_words, std::memory_order_relaxed);
    }
  };
  if (parallel) {
    threads.pool->parallelFor(threads.pool->threads(), member);
  } else {
    member(0);
  }
  if (abft) checkColumnSums(x, tokens, w, out_sums);
}

template <class Sink>
void matmulTo(const float* x, int tokens, const WeightMatrix& w, const Sink& sink,
              const Threads& threads) {
  switch (w.dtype) {
    case DType::kF32:
      return matmulTyped<DType::kF32>(x, tokens, w, sink, threads);
    case DType::kF16:
      return matmulTyped<DType::kF16>(x, tokens, w, sink, threads);
    case DType::kBF16:
      return matmulTyped<DType::kBF16>(x, tokens, w, sink, threads);
  }
}

}  // namespace

void matmul(const float* x, int tokens, const WeightMatrix& w, const float* bias, float* y,
            bool accumulate, const Threads& threads) {
  matmulTo(x, tokens, w, AddToMatrix{y, bias, w.rows, accumulate}, threads);
}

void matmulCheckedRows(const float* x, int tokens, const WeightMatrix& w, float* const* rows,
                       RowCheck* checks, const Threads& threads) {
  std::vector<uint32_t> non_finite(size_t(tokens), 0);
  for (int t = 0; t < tokens; ++t) checks[t] = {0, true};
  matmulTo(x, tokens, w, WriteCheckedRows{rows, checks, non_finite.data(), tokens}, threads);
  for (int t = 0; t < tokens; ++t) checks[t].finite = non_finite[size_t(t)] == 0;
}

ColumnSums columnSums(const WeightMatrix& w) {
  ColumnSums c{std::vector<double>(size_t(w.cols), 0.0), std::vector<double>(size_t(w.cols), 0.0)};
  columnSumsRange(w, 0, w.cols, c);
  return c;
}

void columnSumsRange(const WeightMatrix& w, int begin, int end, ColumnSums& out) {
  const size_t n = size_t(end - begin), offset = size_t(begin) * dtypeSize(w.dtype);
  std::vector<float> row(n);
  double* sum = out.sum.data() + begin;
  double* abs_sum = out.abs_sum.data() + begin;
  for (int j = 0; j < w.rows; ++j) {
    toFloat(w.dtype, w.data + size_t(j) * w.rowBytes() + offset, n, row.data());
    for (size_t k = 0; k < n; ++k) {
      sum[k] += row[k];
      abs_sum[k] += std::fabs(row[k]);
    }
  }
}

float dot(const float* a, const float* b, int n) {
  const float* xs[1] = {a};
  float out[1];
  dotRows<DType::kF32, 1>(xs, reinterpret_cast<const std::byte*>(b), n, out);
  return out[0];
}

void rmsNorm(const float* x, const float* weight, float eps, int n, float* out) {
  const float mean_square = dot(x, x, n) / float(n);
  const float inv = 1.0f / std::sqrt(mean_square + eps);
  for (int i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

void toFloat(DType dtype, const std::byte* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::kF32:
        dst[i] = weightAt<DType::kF32>(src, i);
        break;
      case DType::kF16:
        dst[i] = weightAt<DType::kF16>(src, i);
        break;
      case DType::kBF16:
        dst[i] = weightAt<DType::kBF16>(src, i);
        break;
    }
  }
}

void readRow(const WeightMatrix& w, int row, float* dst) {
  const size_t row_bytes = w.rowBytes();
  const std::byte* src = w.data + size_t(row) * row_bytes;
  if (w.reads != nullptr) {
    const uint64_t row_words = weightRowWords(row_bytes);
    w.reads->sum.fetch_add(foldWeightRow(src, row_bytes, uint64_t(row) * row_words, w.salt),
                           std::memory_order_relaxed);
    w.reads->words.fetch_add(row_words, std::memory_order_relaxed);
    w.reads->uses.fetch_add(1, std::memory_order_relaxed);
  }
  toFloat(w.dtype, src, size_t(w.cols), dst);
}

}  // namespace bulkhead::cpu
