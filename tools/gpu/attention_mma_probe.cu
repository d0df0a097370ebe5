// Whether an attention built on the tensor cores (mma.sync) can keep the CUDA backend's
// invariance, how close it is to a double-precision reference, and how fast it is at the 7B
// shape's prefill. The design under test (cuda/PERFORMANCE.md): a warp takes 16 query rows of
// one head against each chunk of 64 key positions, which the block's four warps share from
// shared memory. Scores come from mma.sync over the head's dimensions in fixed k16 steps (bf16
// queries and keys, fp32 sums); each row's maximum is exact in any order; its probabilities are
// rounded to bf16 once and summed in a fixed order (a thread's 16 in position order, then the
// quad's four by xor 1 and xor 2); P times V by mma.sync over the chunk's positions; an online
// softmax across chunks with the backend's formulas. A chunk past a row's end changes nothing
// of that row (its maximum stays, its scale is exp(0) = 1, its probabilities are 0), so a row
// gives the same bits whatever rows share its warp and however far they reach.
//
// The probe checks that claim: every query's output alone in a tile (at a random row of a
// random warp, the other rows empty) against the same query among others (random tiles mixing
// queries of any length), bit for bit; then against a double-precision reference (from the
// same bf16 queries, keys and values); then times the 7B prefill's attention for one layer
// (28 heads on 4 KV heads, 2,048 positions, causal).
//
// Build: nvcc -std=c++17 -gencode arch=compute_90,code=sm_90 -O3 -o attention_mma_probe \
//          tools/gpu/attention_mma_probe.cu
// Run on an sm_90 GPU: ./attention_mma_probe (exit 0: bit-identical and close; 1: not).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

namespace {

constexpr int kHd = 128;                // head size
constexpr int kChunk = 64;              // key positions a chunk
constexpr int kWarps = 4;               // a block's warps, 16 query rows each
constexpr int kTileRows = 16 * kWarps;  // query rows a block
constexpr int kStride = kHd + 8;        // a staged key or value row, in bf16 (272 bytes)
constexpr int kPieces = kHd / 8;        // 16-byte pieces a row

struct Args {
  const __nv_bfloat16* q;  // [head][query][kHd]
  const __nv_bfloat16* k;  // [kv_head][position][kHd]
  const __nv_bfloat16* v;
  const int* tile_rows;  // [tile][kTileRows]: the query in each row of the tile, -1: none
  const int* ends;       // [query]: positions 0 .. ends - 1 attended
  float* out;            // [head][query][kHd]
  int queries, positions, heads, kv_heads;
  float scale;
};

__device__ __forceinline__ uint32_t pair(const __nv_bfloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

__device__ __forceinline__ uint32_t packRounded(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  uint32_t v;
  std::memcpy(&v, &p, 4);
  return v;
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two 8 x 8 bf16 matrices, transposed: rows from lanes 0-7 and 8-15.
__device__ __forceinline__ void loadTransposed(uint32_t& r0, uint32_t& r1, const void* row) {
  const unsigned at = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(at));
}

// Block (tile, head): kTileRows query rows of one head; warp w takes rows 16w .. 16w + 15, lane
// (g, c) holding rows g and g + 8 of them as mma.sync's fragments do.
__global__ void __launch_bounds__(32 * kWarps) attentionMma(Args a) {
  __shared__ __align__(16) __nv_bfloat16 ks[kChunk * kStride];
  __shared__ __align__(16) __nv_bfloat16 vs[kChunk * kStride];
  const int tile = blockIdx.x, h = blockIdx.y, kvh = h / (a.heads / a.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int* rows = a.tile_rows + size_t(tile) * kTileRows;
  const int query[2] = {rows[16 * warp + g], rows[16 * warp + g + 8]};
  int end[2];
  for (int i = 0; i < 2; ++i) end[i] = query[i] >= 0 ? a.ends[query[i]] : 0;
  int block_end = 0;
  for (int r = 0; r < kTileRows; ++r)
    if (rows[r] >= 0) block_end = max(block_end, a.ends[rows[r]]);
  // The warp's queries as mma.sync's A fragments, all of the head's k16 steps (zeros for an
  // empty row).
  uint32_t qf[kHd / 16][4];
  for (int s = 0; s < kHd / 16; ++s)
    for (int i = 0; i < 4; ++i) {
      const int row = i % 2, col = 16 * s + 2 * c + 8 * (i / 2);
      qf[s][i] = query[row] >= 0
                     ? pair(a.q + (size_t(h) * a.queries + size_t(query[row])) * kHd + col)
                     : 0u;
    }
  const __nv_bfloat16* kh = a.k + size_t(kvh) * a.positions * kHd;
  const __nv_bfloat16* vh = a.v + size_t(kvh) * a.positions * kHd;
  float running_max[2] = {-INFINITY, -INFINITY}, running_sum[2] = {0.0f, 0.0f};
  float o[kHd / 8][4] = {};
  for (int chunk = 0; chunk < block_end; chunk += kChunk) {
    __syncthreads();  // every warp is done with the chunk before
    // Stage the chunk's keys and values; positions past the block's last end are zeros (the
    // cache there may hold anything, and 0 times NaN is NaN).
    for (int e = threadIdx.x; e < kChunk * kPieces; e += 32 * kWarps) {
      const int p = e / kPieces, piece = e % kPieces, position = chunk + p;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
      if (position < block_end) {
        kv = reinterpret_cast<const uint4*>(kh + size_t(position) * kHd)[piece];
        vv = reinterpret_cast<const uint4*>(vh + size_t(position) * kHd)[piece];
      }
      *reinterpret_cast<uint4*>(ks + p * kStride + 8 * piece) = kv;
      *reinterpret_cast<uint4*>(vs + p * kStride + 8 * piece) = vv;
    }
    __syncthreads();
    // Scores: 8 tiles of 8 positions, each over the head's dimensions in k16 steps.
    float sc[kChunk / 8][4] = {};
#pragma unroll
    for (int s = 0; s < kHd / 16; ++s)
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j) {
        const __nv_bfloat16* key = ks + (8 * j + g) * kStride + 16 * s + 2 * c;
        mma(sc[j], qf[s][0], qf[s][1], qf[s][2], qf[s][3], pair(key), pair(key + 8));
      }
    // Row i (g, then g + 8): scaled, masked past its end, its chunk maximum over the quad.
    float chunk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2, position = chunk + 8 * j + 2 * c + e % 2;
        const float s = position < end[i] ? __fmul_rn(sc[j][e], a.scale) : -INFINITY;
        sc[j][e] = s;
        chunk_max[i] = fmaxf(chunk_max[i], s);
      }
    float alpha[2], chunk_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 1));
      chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 2));
      const float new_max = fmaxf(running_max[i], chunk_max[i]);
      // exp(0) = 1 for a row this chunk does not reach (its maximum stays); 0 on a row's first.
      alpha[i] = running_max[i] == new_max ? 1.0f : expf(running_max[i] - new_max);
      running_max[i] = new_max;
    }
    // Probabilities, rounded to bf16 once: what P times V multiplies and what the sums add.
    uint32_t pf[kChunk / 8][2];
#pragma unroll
    for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float p[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float s = sc[j][2 * i + e];
          p[e] = s == -INFINITY ? 0.0f
                                : __bfloat162float(__float2bfloat16_rn(expf(s - running_max[i])));
          chunk_sum[i] += p[e];
        }
        pf[j][i] = packRounded(p[0], p[1]);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      chunk_sum[i] += __shfl_xor_sync(0xffffffffu, chunk_sum[i], 1);
      chunk_sum[i] += __shfl_xor_sync(0xffffffffu, chunk_sum[i], 2);
      running_sum[i] = fmaf(running_sum[i], alpha[i], chunk_sum[i]);
    }
#pragma unroll
    for (int d = 0; d < kHd / 8; ++d) {
      o[d][0] *= alpha[0];
      o[d][1] *= alpha[0];
      o[d][2] *= alpha[1];
      o[d][3] *= alpha[1];
    }
    // P times V: k16 steps over the chunk's positions, the probabilities' C fragments of two
    // position tiles being the A fragment of one step.
#pragma unroll
    for (int s = 0; s < kChunk / 16; ++s)
#pragma unroll
      for (int d = 0; d < kHd / 8; ++d) {
        uint32_t b0, b1;
        loadTransposed(b0, b1, vs + (16 * s + lane % 16) * kStride + 8 * d);
        mma(o[d], pf[2 * s][0], pf[2 * s][1], pf[2 * s + 1][0], pf[2 * s + 1][1], b0, b1);
      }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (query[i] < 0) continue;
    float* out = a.out + (size_t(h) * a.queries + size_t(query[i])) * kHd;
#pragma unroll
    for (int d = 0; d < kHd / 8; ++d) {
      out[8 * d + 2 * c] = o[d][2 * i] / running_sum[i];
      out[8 * d + 2 * c + 1] = o[d][2 * i + 1] / running_sum[i];
    }
  }
}

template <typename T>
T* upload(const std::vector<T>& host) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

std::vector<__nv_bfloat16> randomBf16(size_t n, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<__nv_bfloat16> v(n);
  for (auto& x : v) x = __float2bfloat16(dist(rng));
  return v;
}

struct Problem {
  int queries, positions, heads, kv_heads;
  std::vector<__nv_bfloat16> q, k, v;
  std::vector<int> ends;
};

// Runs the kernel over `tiles` (each kTileRows queries or -1) and returns out.
std::vector<float> run(const Problem& p, const std::vector<int>& tiles, int launches = 1,
                       float* us_a_launch = nullptr) {
  Args a{};
  a.q = upload(p.q);
  a.k = upload(p.k);
  a.v = upload(p.v);
  a.tile_rows = upload(tiles);
  a.ends = upload(p.ends);
  const size_t out_n = size_t(p.heads) * p.queries * kHd;
  CHECK(cudaMalloc(&a.out, out_n * 4));
  CHECK(cudaMemset(a.out, 0xff, out_n * 4));
  a.queries = p.queries;
  a.positions = p.positions;
  a.heads = p.heads;
  a.kv_heads = p.kv_heads;
  a.scale = 1.0f / std::sqrt(float(kHd));
  const dim3 grid(unsigned(tiles.size() / kTileRows), unsigned(p.heads));
  attentionMma<<<grid, 32 * kWarps>>>(a);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  if (launches > 1) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < launches; ++i) attentionMma<<<grid, 32 * kWarps>>>(a);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    *us_a_launch = 1000.0f * ms / float(launches);
  }
  std::vector<float> out(out_n);
  CHECK(cudaMemcpy(out.data(), a.out, out_n * 4, cudaMemcpyDeviceToHost));
  for (const void* ptr : {static_cast<const void*>(a.q), static_cast<const void*>(a.k),
                          static_cast<const void*>(a.v), static_cast<const void*>(a.tile_rows),
                          static_cast<const void*>(a.ends), static_cast<const void*>(a.out)})
    CHECK(cudaFree(const_cast<void*>(ptr)));
  return out;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  bool ok = true;

  // Invariance and accuracy: 300 queries of one head against 700 positions, ends anywhere.
  Problem p{300, 700, 2, 1};
  p.q = randomBf16(size_t(p.heads) * p.queries * kHd, rng, 1.0f);
  p.k = randomBf16(size_t(p.kv_heads) * p.positions * kHd, rng, 1.0f);
  p.v = randomBf16(size_t(p.kv_heads) * p.positions * kHd, rng, 1.0f);
  p.ends.resize(p.queries);
  for (int& e : p.ends) e = 1 + int(rng() % uint32_t(p.positions));
  // Mixed: the queries shuffled into tiles, a few rows left empty.
  std::vector<int> order(p.queries);
  for (int i = 0; i < p.queries; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int> mixed;
  for (int i = 0; i < p.queries; ++i) {
    if (rng() % 7 == 0) mixed.push_back(-1);
    mixed.push_back(order[i]);
  }
  while (mixed.size() % kTileRows != 0) mixed.push_back(-1);
  // Alone: each query in a tile of its own, at a random row.
  std::vector<int> alone(size_t(p.queries) * kTileRows, -1);
  for (int i = 0; i < p.queries; ++i) alone[size_t(i) * kTileRows + rng() % kTileRows] = i;
  const std::vector<float> got_mixed = run(p, mixed), got_alone = run(p, alone);
  size_t differ = 0;
  for (size_t i = 0; i < got_mixed.size(); ++i)
    differ += std::memcmp(&got_mixed[i], &got_alone[i], 4) != 0;
  std::printf("invariance: %zu of %zu outputs differ between a query alone and among others\n",
              differ, got_mixed.size());
  ok = ok && differ == 0;

  double worst = 0;
  for (int h = 0; h < p.heads; ++h) {
    const int kvh = h / (p.heads / p.kv_heads);
    for (int qi = 0; qi < p.queries; ++qi) {
      const __nv_bfloat16* q = &p.q[(size_t(h) * p.queries + qi) * kHd];
      std::vector<double> w(p.ends[qi]);
      double m = -1e300, z = 0;
      for (int pos = 0; pos < p.ends[qi]; ++pos) {
        double dot = 0;
        for (int d = 0; d < kHd; ++d)
          dot += double(__bfloat162float(q[d])) *
                 double(__bfloat162float(p.k[(size_t(kvh) * p.positions + pos) * kHd + d]));
        w[pos] = dot / std::sqrt(double(kHd));
        m = std::max(m, w[pos]);
      }
      for (double& x : w) z += (x = std::exp(x - m));
      double err = 0, norm = 0;
      for (int d = 0; d < kHd; ++d) {
        double want = 0;
        for (int pos = 0; pos < p.ends[qi]; ++pos)
          want +=
              w[pos] * double(__bfloat162float(p.v[(size_t(kvh) * p.positions + pos) * kHd + d]));
        want /= z;
        const double diff = got_mixed[(size_t(h) * p.queries + qi) * kHd + d] - want;
        err += diff * diff;
        norm += want * want;
      }
      worst = std::max(worst, std::sqrt(err / std::max(norm, 1e-30)));
    }
  }
  std::printf("accuracy: worst relative error of a row against double precision %.3g\n", worst);
  ok = ok && worst < 2e-2;

  // Speed: one 7B layer's attention in a prefill of 2,048 tokens (causal), consecutive tiles.
  Problem s{2048, 2048, 28, 4};
  s.q = randomBf16(size_t(s.heads) * s.queries * kHd, rng, 1.0f);
  s.k = randomBf16(size_t(s.kv_heads) * s.positions * kHd, rng, 1.0f);
  s.v = randomBf16(size_t(s.kv_heads) * s.positions * kHd, rng, 1.0f);
  s.ends.resize(s.queries);
  for (int i = 0; i < s.queries; ++i) s.ends[i] = i + 1;
  std::vector<int> consecutive(s.queries);
  for (int i = 0; i < s.queries; ++i) consecutive[i] = i;
  float us = 0;
  run(s, consecutive, 20, &us);
  const double flops = 4.0 * kHd * s.heads * (double(s.queries) * (s.queries + 1) / 2);
  std::printf("speed: 7B prefill attention, 2,048 tokens, one layer: %.1f us (%.1f TFLOPS)\n", us,
              flops / (us * 1e-6) / 1e12);
  return ok ? 0 : 1;
}
