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
// The probe checks that claim at head sizes 64 and 128: every (head, query) item's output alone
// in a tile (at a random row of a random warp, the other rows empty) against the same item as
// prefill takes it (64 queries of one head a tile), as decode would (the q heads of one KV head
// for one query a warp) and among others (items of one KV group shuffled into tiles with gaps),
// bit for bit; then against a double-precision reference (from the same bf16 queries, keys and
// values); then times one layer's prefill attention at both Qwen2.5 shapes (2,048 positions,
// causal) and 32 decode rows at a context of 2,048.
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

#include "probe.cuh"

namespace {

constexpr int kChunk = 64;              // key positions a chunk
constexpr int kWarps = 4;               // a block's warps, 16 query rows each
constexpr int kTileRows = 16 * kWarps;  // query rows a block

// Item i is head i / queries's query i % queries: q and out at i * head size.
struct Args {
  const __nv_bfloat16* q;  // [head][query][head size]
  const __nv_bfloat16* k;  // [kv_head][position][head size]
  const __nv_bfloat16* v;
  const int* tile_items;  // [tile][kTileRows]: the item in each row of the tile, -1: none
  const int* tile_kv;     // [tile]: the KV head every item of the tile reads
  const int* ends;        // [query]: positions 0 .. ends - 1 attended
  float* out;             // [head][query][head size]
  int queries, positions;
  float scale;
};

// Block `tile`: kTileRows items reading one KV head; warp w takes rows 16w .. 16w + 15, lane
// (g, c) holding rows g and g + 8 of them as mma.sync's fragments do.
template <int kHd>
__global__ void __launch_bounds__(32 * kWarps) attentionMma(Args a) {
  constexpr int kStride = kHd + 8;  // a staged key or value row, in bf16 (no bank conflicts)
  constexpr int kPieces = kHd / 8;  // 16-byte pieces a row
  __shared__ __align__(16) __nv_bfloat16 ks[kChunk * kStride];
  __shared__ __align__(16) __nv_bfloat16 vs[kChunk * kStride];
  const int tile = blockIdx.x, kvh = a.tile_kv[tile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int* rows = a.tile_items + size_t(tile) * kTileRows;
  const int item[2] = {rows[16 * warp + g], rows[16 * warp + g + 8]};
  int end[2];
  for (int i = 0; i < 2; ++i) end[i] = item[i] >= 0 ? a.ends[item[i] % a.queries] : 0;
  int block_end = 0;
  for (int r = 0; r < kTileRows; ++r)
    if (rows[r] >= 0) block_end = max(block_end, a.ends[rows[r] % a.queries]);
  // The warp's queries as mma.sync's A fragments, all of the head's k16 steps (zeros for an
  // empty row).
  uint32_t qf[kHd / 16][4];
  for (int s = 0; s < kHd / 16; ++s)
    for (int i = 0; i < 4; ++i) {
      const int row = i % 2, col = 16 * s + 2 * c + 8 * (i / 2);
      qf[s][i] = item[row] >= 0 ? pairOf(a.q + size_t(item[row]) * kHd + col) : 0u;
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
        mmaBf16(sc[j], qf[s][0], qf[s][1], qf[s][2], qf[s][3], pairOf(key), pairOf(key + 8));
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
        mmaBf16(o[d], pf[2 * s][0], pf[2 * s][1], pf[2 * s + 1][0], pf[2 * s + 1][1], b0, b1);
      }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (item[i] < 0) continue;
    float* out = a.out + size_t(item[i]) * kHd;
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
  int hd, queries, positions, heads, kv_heads;
  std::vector<__nv_bfloat16> q, k, v;
  std::vector<int> ends;
  int group() const { return heads / kv_heads; }
};

Problem makeProblem(int hd, int queries, int positions, int heads, int kv_heads, bool causal,
                    std::mt19937& rng) {
  Problem p{hd, queries, positions, heads, kv_heads};
  p.q = randomBf16(size_t(heads) * queries * hd, rng, 1.0f);
  p.k = randomBf16(size_t(kv_heads) * positions * hd, rng, 1.0f);
  p.v = randomBf16(size_t(kv_heads) * positions * hd, rng, 1.0f);
  p.ends.resize(size_t(queries));
  for (int i = 0; i < queries; ++i)
    p.ends[size_t(i)] = causal ? positions - queries + i + 1 : 1 + int(rng() % uint32_t(positions));
  return p;
}

// Tiles of items and the KV head each reads.
struct Tiles {
  std::vector<int> items, kv;
  // Appends a tile of `items` (padded with -1) reading KV head `kvh`.
  void add(const std::vector<int>& tile, int kvh) {
    for (int r = 0; r < kTileRows; ++r)
      items.push_back(r < int(tile.size()) ? tile[size_t(r)] : -1);
    kv.push_back(kvh);
  }
};

// Runs the kernel over `tiles` and returns out (NaN bits where no tile wrote).
template <int kHd>
std::vector<float> run(const Problem& p, const Tiles& tiles, int launches = 1,
                       float* us_a_launch = nullptr) {
  Args a{};
  a.q = upload(p.q);
  a.k = upload(p.k);
  a.v = upload(p.v);
  a.tile_items = upload(tiles.items);
  a.tile_kv = upload(tiles.kv);
  a.ends = upload(p.ends);
  const size_t out_n = size_t(p.heads) * p.queries * kHd;
  CHECK(cudaMalloc(&a.out, out_n * 4));
  CHECK(cudaMemset(a.out, 0xff, out_n * 4));
  a.queries = p.queries;
  a.positions = p.positions;
  a.scale = 1.0f / std::sqrt(float(kHd));
  const dim3 grid(unsigned(tiles.kv.size()));
  attentionMma<kHd><<<grid, 32 * kWarps>>>(a);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  if (launches > 1) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < launches; ++i) attentionMma<kHd><<<grid, 32 * kWarps>>>(a);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    *us_a_launch = 1000.0f * ms / float(launches);
  }
  std::vector<float> out(out_n);
  CHECK(cudaMemcpy(out.data(), a.out, out_n * 4, cudaMemcpyDeviceToHost));
  for (const void* ptr :
       {static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v),
        static_cast<const void*>(a.tile_items), static_cast<const void*>(a.tile_kv),
        static_cast<const void*>(a.ends), static_cast<const void*>(a.out)})
    CHECK(cudaFree(const_cast<void*>(ptr)));
  return out;
}

// Prefill's tiles: 64 consecutive queries of one head.
Tiles prefillTiles(const Problem& p) {
  Tiles t;
  for (int h = 0; h < p.heads; ++h)
    for (int q0 = 0; q0 < p.queries; q0 += kTileRows) {
      std::vector<int> tile;
      for (int q = q0; q < std::min(p.queries, q0 + kTileRows); ++q)
        tile.push_back(h * p.queries + q);
      t.add(tile, h / p.group());
    }
  return t;
}

// Decode's: a query's q heads of one KV head in a warp (the other rows of the tile empty).
Tiles decodeTiles(const Problem& p) {
  Tiles t;
  for (int q = 0; q < p.queries; ++q)
    for (int kvh = 0; kvh < p.kv_heads; ++kvh) {
      std::vector<int> tile;
      for (int j = 0; j < p.group(); ++j) tile.push_back((kvh * p.group() + j) * p.queries + q);
      t.add(tile, kvh);
    }
  return t;
}

// Each item alone, at a random row.
Tiles aloneTiles(const Problem& p, std::mt19937& rng) {
  Tiles t;
  for (int h = 0; h < p.heads; ++h)
    for (int q = 0; q < p.queries; ++q) {
      std::vector<int> tile(kTileRows, -1);
      tile[rng() % kTileRows] = h * p.queries + q;
      t.add(tile, h / p.group());
    }
  return t;
}

// A KV group's items shuffled into tiles, a few rows left empty.
Tiles mixedTiles(const Problem& p, std::mt19937& rng) {
  Tiles t;
  for (int kvh = 0; kvh < p.kv_heads; ++kvh) {
    std::vector<int> items;
    for (int j = 0; j < p.group(); ++j)
      for (int q = 0; q < p.queries; ++q) items.push_back((kvh * p.group() + j) * p.queries + q);
    std::shuffle(items.begin(), items.end(), rng);
    std::vector<int> tile;
    for (int item : items) {
      if (rng() % 7 == 0) tile.push_back(-1);
      tile.push_back(item);
      if (int(tile.size()) >= kTileRows) {
        t.add({tile.begin(), tile.begin() + kTileRows}, kvh);
        tile.erase(tile.begin(), tile.begin() + kTileRows);
      }
    }
    if (!tile.empty()) t.add(tile, kvh);
  }
  return t;
}

// The worst relative error of an item's row against double precision, over every item.
double worstError(const Problem& p, const std::vector<float>& got) {
  double worst = 0;
  for (int h = 0; h < p.heads; ++h) {
    const int kvh = h / p.group();
    for (int qi = 0; qi < p.queries; ++qi) {
      const __nv_bfloat16* q = &p.q[(size_t(h) * p.queries + qi) * p.hd];
      const int end = p.ends[size_t(qi)];
      std::vector<double> w(static_cast<size_t>(end));
      double m = -1e300, z = 0;
      for (int pos = 0; pos < end; ++pos) {
        double dot = 0;
        for (int d = 0; d < p.hd; ++d)
          dot += double(__bfloat162float(q[d])) *
                 double(__bfloat162float(p.k[(size_t(kvh) * p.positions + pos) * p.hd + d]));
        w[size_t(pos)] = dot / std::sqrt(double(p.hd));
        m = std::max(m, w[size_t(pos)]);
      }
      for (double& x : w) z += (x = std::exp(x - m));
      double err = 0, norm = 0;
      for (int d = 0; d < p.hd; ++d) {
        double want = 0;
        for (int pos = 0; pos < end; ++pos)
          want += w[size_t(pos)] *
                  double(__bfloat162float(p.v[(size_t(kvh) * p.positions + pos) * p.hd + d]));
        want /= z;
        const double diff = got[(size_t(h) * p.queries + qi) * p.hd + d] - want;
        err += diff * diff;
        norm += want * want;
      }
      worst = std::max(worst, std::sqrt(err / std::max(norm, 1e-30)));
    }
  }
  return worst;
}

size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

// Invariance and accuracy at head size kHd: 14 heads on 2 KV heads (a group of 7, as both
// Qwen2.5 shapes have), 120 queries of any length against 700 positions.
template <int kHd>
bool checkHeadSize(std::mt19937& rng) {
  const Problem p = makeProblem(kHd, 120, 700, 14, 2, /*causal=*/false, rng);
  const std::vector<float> alone = run<kHd>(p, aloneTiles(p, rng));
  bool ok = true;
  const struct {
    const char* name;
    Tiles tiles;
  } ways[] = {
      {"prefill", prefillTiles(p)}, {"decode", decodeTiles(p)}, {"mixed", mixedTiles(p, rng)}};
  for (const auto& way : ways) {
    const size_t n = differing(alone, run<kHd>(p, way.tiles));
    std::printf("head size %d, %s tiles: %zu of %zu outputs differ from each item alone\n", kHd,
                way.name, n, alone.size());
    ok = ok && n == 0;
  }
  const double worst = worstError(p, alone);
  std::printf("head size %d: worst relative error of a row against double precision %.3g\n", kHd,
              worst);
  return ok && worst < 2e-2;
}

// One layer's attention: a causal prefill of 2,048 tokens, and 32 decode rows at a context of
// 2,048 (each its own sequence here: one query against the same keys, 32 times over).
template <int kHd>
void time(const char* shape, int heads, int kv_heads, std::mt19937& rng) {
  const Problem prefill = makeProblem(kHd, 2048, 2048, heads, kv_heads, true, rng);
  float us = 0;
  run<kHd>(prefill, prefillTiles(prefill), 20, &us);
  const double flops = 4.0 * kHd * heads * (2048.0 * 2049.0 / 2);
  std::printf("%s prefill attention, 2,048 tokens, one layer: %.1f us (%.1f TFLOPS)\n", shape, us,
              flops / (us * 1e-6) / 1e12);
  Problem decode = makeProblem(kHd, 32, 2048, heads, kv_heads, false, rng);
  for (int& e : decode.ends) e = 2048;
  run<kHd>(decode, decodeTiles(decode), 20, &us);
  std::printf("%s decode attention, 32 rows at 2,048 positions, one layer: %.1f us\n", shape, us);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  bool ok = checkHeadSize<64>(rng);
  ok = checkHeadSize<128>(rng) && ok;
  time<128>("7B", 28, 4, rng);
  time<64>("0.5B", 14, 2, rng);
  return ok ? 0 : 1;
}
