// The invariant tensor-core product. A weight's rows are cut into tiles of 16, and its k blocks of
// 32 into `lanes` = splits x kWarps lanes: lane v takes the k blocks v, v + lanes, ... in
// increasing order. A tile is one cluster of `splits` blocks of kWarps warps; warp w of block
// rank r runs lane r * kWarps + w. Within a k block, lane (g, c) of a warp loads 16 bytes of weight
// rows g and g + 8 and of token g at k offsets 8c .. 8c + 7, and feeds them to two mma
// instructions: the k positions are permuted the same way for both operands, so each instruction
// computes a fixed part of the dot product, in a fixed order. A block adds its warps' sums in warp
// order; the cluster adds its blocks' sums in rank order, through distributed shared memory. The
// splits depend on the weight's shape alone (gemmSplits), so every output element is the same
// sequence of operations whatever the number of tokens. The blocks of the first token group also
// fold every weight word they load (the in-step check, gemm.cuh productFold) on the tensor cores.
#include "cuda/gemm.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cuda/activation.cuh"
#include "cuda/cp_async.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"
#include "cuda/norm_partials.cuh"
#include "cuda/warp_mma.cuh"

namespace bulkhead::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 8;  // the portable cluster size

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p, bool valid) {
  return valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
}

// Eight inputs of a normed token (GemmNormedInput) as load16 would give them from the norm
// kernel's output: bf16(w * (x * inv)), the norm kernel's expression.
__device__ __forceinline__ uint4 normedLoad(const float* x, const __nv_bfloat16* w, float inv,
                                            bool valid) {
  if (!valid) return make_uint4(0, 0, 0, 0);
  const float4 lo = reinterpret_cast<const float4*>(x)[0],
               hi = reinterpret_cast<const float4*>(x)[1];
  const uint4 wv = *reinterpret_cast<const uint4*>(w);
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 pair;
    memcpy(&pair, &words[i], 4);
    const __nv_bfloat162 o = __floats2bfloat162_rn(__bfloat162float(pair.x) * (v[2 * i] * inv),
                                                   __bfloat162float(pair.y) * (v[2 * i + 1] * inv));
    memcpy(&out[i], &o, 4);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// The eight bf16 inputs a uint4 of tokens holds, widened, in k order.
__device__ __forceinline__ void unpackTokens(const uint4& packed, float (&out)[8]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 pair;
    memcpy(&pair, &words[i], 4);
    out[2 * i] = __bfloat162float(pair.x);
    out[2 * i + 1] = __bfloat162float(pair.y);
  }
}

// A check tile's per-token sums added over the 4 lanes (c) that hold a token's inputs: every
// lane of the warp must reach it.
template <int kGroups>
__device__ __forceinline__ void sumOverTokenLanes(double (&sums)[kGroups][6]) {
#pragma unroll
  for (int t = 0; t < kGroups; ++t)
#pragma unroll
    for (int i = 0; i < 6; ++i)
      for (int offset = 1; offset < 4; offset *= 2)
        sums[t][i] += __shfl_xor_sync(0xffffffffu, sums[t][i], offset);
}

// Whether a normed product has the norm's side of any check to add (a check tile).
__host__ __device__ inline bool normedHasChecks(const GemmNormedInput& nin) {
  return nin.weight_fold != nullptr || nin.consumers[0].role >= 0 || nin.consumers[1].role >= 0 ||
         nin.consumers[2].role >= 0;
}

// How many consumers a product of bf16 tokens checks itself (tokenChecks): they fill from the
// first.
__host__ __device__ inline int tokenConsumers(const GemmNormedInput& nin) {
  return nin.x != nullptr ? 0
                          : (nin.consumers[0].role >= 0) + (nin.consumers[1].role >= 0) +
                                (nin.consumers[2].role >= 0);
}

// Whether a product of bf16 tokens adds its consumers' expected sums and bounds itself (a check
// tile): a GemmNormedInput without x that names consumers.
__host__ __device__ inline bool tokenHasChecks(const GemmNormedInput& nin) {
  return tokenConsumers(nin) > 0;
}

// The check tile of a product of bf16 tokens x (m x k): each consumer's (weight's) expected sum
// and bound from the very inputs the product multiplies. Check lane v takes consumer v / k_blocks
// and k block v % k_blocks (enough check blocks that every pair has a lane); its lane (g, c)
// inputs 8c .. 8c + 7 of that k block for token g of each of the block's token groups. The column
// sums, which no kernel writes, load before the wait for the kernel before; the tokens after it.
template <int kGroups>
__device__ void tokenChecks(const __nv_bfloat16* x, const GemmNormedInput& nin, int m0, int m,
                            int k, int v) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, k_blocks = (k + 31) / 32;
  const int s = v / k_blocks, k0 = 32 * (v % k_blocks) + 8 * c;
  const bool in = s < tokenConsumers(nin) && k0 < k;
  // Selects, not an index into the parameters.
  const ConsumerSums& consumer = s == 0   ? nin.consumers[0]
                                 : s == 1 ? nin.consumers[1]
                                          : nin.consumers[2];
  float4 cs[2], as[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    cs[half] = in ? reinterpret_cast<const float4*>(consumer.colsum + k0)[half] : float4{};
    as[half] = in ? reinterpret_cast<const float4*>(consumer.abssum + k0)[half] : float4{};
  }
  awaitKernelBefore();
  const float cv[8] = {cs[0].x, cs[0].y, cs[0].z, cs[0].w, cs[1].x, cs[1].y, cs[1].z, cs[1].w};
  const float av[8] = {as[0].x, as[0].y, as[0].z, as[0].w, as[1].x, as[1].y, as[1].z, as[1].w};
#pragma unroll 1
  for (int t = 0; t < kGroups && m0 + 8 * t < m; ++t) {
    const int token = m0 + 8 * t + g;
    double sums[2] = {};  // expected, bound
    if (in && token < m) {
      float xv[8];
      unpackTokens(load16(x + size_t(token) * k + k0, true), xv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sums[0] += double(cv[j]) * xv[j];
        sums[1] += double(av[j]) * fabsf(xv[j]);
      }
    }
    // Over the 4 lanes that hold a token's inputs, then one atomic add a value from lane c = 0.
#pragma unroll
    for (int i = 0; i < 2; ++i)
      for (int offset = 1; offset < 4; offset *= 2)
        sums[i] += __shfl_xor_sync(0xffffffffu, sums[i], offset);
    if (c != 0 || !in || token >= m) continue;
    ProductCheck& p = nin.checks.products[size_t(token) * nin.checks.roles + consumer.role];
    atomicAdd(&p.expected, sums[0]);
    atomicAdd(&p.bound, sums[1]);
  }
}

// The check tile of a normed product: the norm's side of its consumers' checks and the norm
// weight's fold, for the k blocks of this warp's lane and the tokens of this block's group. The
// lanes (g, c) of a warp hold token g's inputs 8c .. 8c + 7 of a k block, as the product's lanes.
template <int kGroups>
__device__ void normedChecks(const GemmNormedInput& nin, const float (&inv)[kGroups], int m0, int m,
                             int k, int first_kb, int stride) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, k_blocks = (k + 31) / 32;
  double sums[kGroups][6] = {};  // per consumer: expected, then bound (3 on)
  unsigned long long fold = 0, words = 0;
  for (int kb = first_kb; kb < k_blocks; kb += stride) {
    const int k0 = 32 * kb + 8 * c;
    if (k0 >= k) continue;
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      const int token = m0 + 8 * t + g;
      if (token >= m) continue;
      float xn[8];
      unpackTokens(normedLoad(nin.x + size_t(token) * nin.ldx + k0, nin.weight + k0, inv[t], true),
                   xn);
#pragma unroll
      for (int s = 0; s < 3; ++s) {
        if (nin.consumers[s].role < 0) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sums[t][s] += double(nin.consumers[s].colsum[k0 + j]) * xn[j];
          sums[t][3 + s] += double(nin.consumers[s].abssum[k0 + j]) * fabsf(xn[j]);
        }
      }
      if (nin.weight_fold != nullptr) {
        // Once a token row, as the norm kernel folds the weight once a row.
        const uint32_t* w_words = reinterpret_cast<const uint32_t*>(nin.weight + k0);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          fold += foldTerm(w_words[i], nin.weight_salt, uint32_t(k0 / 2 + i));
        words += 4;
      }
    }
  }
  sumOverTokenLanes(sums);  // then one atomic add a role from lane c = 0
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    const int token = m0 + 8 * t + g;
    if (c != 0 || token >= m) continue;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      if (nin.consumers[s].role < 0) continue;
      ProductCheck& p =
          nin.checks.products[size_t(token) * nin.checks.roles + nin.consumers[s].role];
      atomicAdd(&p.expected, sums[t][s]);
      atomicAdd(&p.bound, sums[t][3 + s]);
    }
  }
  if (nin.weight_fold != nullptr) {
    for (int offset = 16; offset > 0; offset /= 2) {
      fold += __shfl_xor_sync(0xffffffffu, fold, offset);
      words += __shfl_xor_sync(0xffffffffu, words, offset);
    }
    if (lane == 0) {
      FoldSlot& slot = nin.weight_fold->mine();
      atomicAdd(&slot.sum, fold);
      atomicAdd(&slot.words, words);
    }
  }
}

// Eight inputs of an activated token (GemmActivatedInput) as load16 would give them from the
// activation kernel's output: that kernel's expression (siluMul).
__device__ __forceinline__ uint4 activatedLoad(const float* gate, const float* up, bool valid) {
  if (!valid) return make_uint4(0, 0, 0, 0);
  const float4 g_lo = reinterpret_cast<const float4*>(gate)[0],
               g_hi = reinterpret_cast<const float4*>(gate)[1];
  const float4 u_lo = reinterpret_cast<const float4*>(up)[0],
               u_hi = reinterpret_cast<const float4*>(up)[1];
  const float g[8] = {g_lo.x, g_lo.y, g_lo.z, g_lo.w, g_hi.x, g_hi.y, g_hi.z, g_hi.w};
  const float u[8] = {u_lo.x, u_lo.y, u_lo.z, u_lo.w, u_hi.x, u_hi.y, u_hi.z, u_hi.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 o =
        __halves2bfloat162(siluMul(g[2 * i], u[2 * i]), siluMul(g[2 * i + 1], u[2 * i + 1]));
    memcpy(&out[i], &o, 4);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__host__ __device__ inline bool activatedHasChecks(const GemmActivatedInput& a) {
  return a.gate_role >= 0 || a.up_role >= 0 || a.consumer.role >= 0;
}

// The check tile of an activated product: the gate and up products' produced sums and this
// product's expected and bound, for the k blocks of this warp's lane and the tokens of this
// block's group (lanes as the product's: token g, inputs 8c .. 8c + 7 of a k block).
template <int kGroups>
__device__ void activatedChecks(const GemmActivatedInput& a, int m0, int m, int k, int first_kb,
                                int stride) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, k_blocks = (k + 31) / 32;
  double sums[kGroups][6] = {};  // gate, up, gate^2, up^2, expected, bound
  for (int kb = first_kb; kb < k_blocks; kb += stride) {
    const int k0 = 32 * kb + 8 * c;
    if (k0 >= k) continue;
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      const int token = m0 + 8 * t + g;
      if (token >= m) continue;
      const float* gate = a.gate_up + size_t(token) * a.ld + k0;
      float act[8];
      unpackTokens(activatedLoad(gate, gate + k, true), act);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const double gj = gate[j], uj = gate[k + j];
        sums[t][0] += gj;
        sums[t][1] += uj;
        sums[t][2] += gj * gj;
        sums[t][3] += uj * uj;
        if (a.consumer.role >= 0) {
          sums[t][4] += double(a.consumer.colsum[k0 + j]) * act[j];
          sums[t][5] += double(a.consumer.abssum[k0 + j]) * fabsf(act[j]);
        }
      }
    }
  }
  sumOverTokenLanes(sums);
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    const int token = m0 + 8 * t + g;
    if (c != 0 || token >= m) continue;
    ProductCheck* row = a.checks.products + size_t(token) * a.checks.roles;
    if (a.gate_role >= 0) {
      atomicAdd(&row[a.gate_role].produced, sums[t][0]);
      atomicAdd(&row[a.gate_role].produced_sq, sums[t][2]);
    }
    if (a.up_role >= 0) {
      atomicAdd(&row[a.up_role].produced, sums[t][1]);
      atomicAdd(&row[a.up_role].produced_sq, sums[t][3]);
    }
    if (a.consumer.role >= 0) {
      atomicAdd(&row[a.consumer.role].expected, sums[t][4]);
      atomicAdd(&row[a.consumer.role].bound, sums[t][5]);
    }
  }
}

// The fold's integer mma: d += a (16 x 32 bytes) * b (32 x 8 keys), wrapping.
__device__ __forceinline__ void foldMma(uint32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Lane (g, c)'s key registers: column g, positions 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3.
__device__ __forceinline__ uint32_t foldKeys(int g, int first) {
  uint32_t keys = 0;
  for (int i = 0; i < 4; ++i) keys |= productFoldKey(uint32_t(g), uint32_t(first + i)) << (8 * i);
  return keys;
}

// An output's final value: into y, or added to the residual (res.x). Every lane of a warp
// reaches it together, for consecutive rows of one token where a block's rows are a multiple of
// 16: a norm tile's 16 outputs (row / 16 the same) are 16 lanes of one warp.
template <bool kResidual>
__device__ __forceinline__ void storeOutput(int row, int token, float value, int n, int m,
                                            float* __restrict__ y, int ldy,
                                            const GemmResidual& res) {
  const bool valid = row < n && token < m;
  if constexpr (!kResidual) {
    if (valid) {
      y[size_t(token) * ldy + row] = value;
      if (res.rows_to != nullptr) res.rows_to[token][row] = value;
    }
    return;
  }
  if (valid && res.fault == (long long)token * n + row)
    value = __uint_as_float(__float_as_uint(value) ^ 0x40000000u);
  float square = 0.0f;
  double produced[2] = {};
  if (valid) {
    float* at = res.x + size_t(token) * res.ldx + row;
    const float updated = __fadd_rn(*at, value);
    *at = updated;
    square = __fmul_rn(updated, updated);
    produced[0] = double(value);
    produced[1] = double(value) * double(value);
  }
  square = normTilePartialOfLanes(square);
#pragma unroll
  for (int i = 0; i < 2; ++i)
    for (int offset = kNormTile / 2; offset > 0; offset /= 2)
      produced[i] += __shfl_xor_sync(0xffffffffu, produced[i], offset);
  if (row % kNormTile == 0 && valid) {
    res.partials[size_t(token) * res.ldp + row / kNormTile] = square;
    if (res.checks != nullptr) {
      ProductCheck& p = res.checks[size_t(token) * res.roles + res.role];
      atomicAdd(&p.produced, produced[0]);
      atomicAdd(&p.produced_sq, produced[1]);
    }
  }
}

// The weight of a fused product (GemmFold) that row `row` belongs to.
__device__ __forceinline__ int foldSegment(const GemmFold& fold, int row) {
  return (fold.weights > 1 && row >= fold.row_end[0]) +
         (fold.weights > 2 && row >= fold.row_end[1]);
}
__device__ __forceinline__ FoldAccount* foldAccount(const GemmFold& fold, int segment) {
  return segment == 0 ? fold.account[0] : segment == 1 ? fold.account[1] : fold.account[2];
}

// Lane (g, c)'s share of the fold of the 16-row tile from `tile_row` (a tile lies within one
// weight): fold accumulator j is weight row g (+ 8 for j >= 2) of the tile and key column
// 2c + j % 2, weighted by the row and the weight's salt (gemm.cuh productFold). Summed over a
// warp's lanes: the fold of the words of the tile that the warp loaded.
__device__ __forceinline__ unsigned long long tileFold(const GemmFold& fold, int tile_row, int g,
                                                       int c, const uint32_t (&fold_acc)[4]) {
  const int segment = foldSegment(fold, tile_row);
  const int segment_begin = segment == 0 ? 0 : segment == 1 ? fold.row_end[0] : fold.row_end[1];
  const uint32_t salt = segment == 0 ? fold.salt[0] : segment == 1 ? fold.salt[1] : fold.salt[2];
  const uint32_t lo_row = 2 * uint32_t(tile_row + g - segment_begin) + 1, hi_row = lo_row + 16;
  return (2 * salt + 1) * (lo_row * ((4 * c + 1) * fold_acc[0] + (4 * c + 3) * fold_acc[1]) +
                           hi_row * ((4 * c + 1) * fold_acc[2] + (4 * c + 3) * fold_acc[3]));
}

// A block's sums of its kOutputs outputs (block_sum, in shared memory) stored through
// store(e, value). With splits > 1 the cluster's blocks are the tile's k splits: rank r adds up
// the outputs r, r + splits, ... over the blocks in rank order, and keeps its shared memory
// until every rank has read it. Every thread of the block calls it; tid is its index among the
// kThreads threads whose sums block_sum holds (a block of gemmKernel may hold two such).
template <int kOutputs, typename Store>
__device__ __forceinline__ void storeBlockSums(float* block_sum, int rank, int splits,
                                               Store&& store, int tid = threadIdx.x) {
  if (splits == 1) {
    __syncthreads();
    for (int e = tid; e < kOutputs; e += kThreads) store(e, block_sum[e]);
    return;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int e = rank * kThreads + tid; e < kOutputs; e += splits * kThreads) {
    float total = *cluster.map_shared_rank(&block_sum[e], 0);
    for (int r = 1; r < splits; ++r) total += *cluster.map_shared_rank(&block_sum[e], r);
    store(e, total);
  }
  cluster.sync();
}

// Where a product's tokens come from (the kernel's kInput): bf16 x, a normed input
// (GemmNormedInput) or an activated one (GemmActivatedInput).
constexpr int kTokenInput = 0, kNormedInput = 1, kActivatedInput = 2;

// kGroups groups of 8 tokens per block; kUnroll k blocks loaded together. kPipelined: two sets of
// registers, so that one round's loads are in flight while the round before multiplies. kTiles:
// weight tiles of 16 rows per warp, multiplied by the same token fragments, so that many rows
// load each token once from the L2 cache instead of once a tile. Every output gets the same
// operations in the same order in all of them: only when loads are issued and how many tiles
// share them change. kResidual: the epilogue adds into the residual stream (GemmResidual);
// kInput: where the tokens come from (a normed or activated input has more blocks,
// its check tile, when it has checks to add). kPairs: kPairs sets of kWarps warps a block, each
// the work of one block of the others (consecutive cells: weight tiles, or check tiles), so that
// their warps of one lane read the same tokens at about the same time and the later reads come
// from the L1 cache.
template <int kGroups, int kUnroll, bool kPipelined, int kTiles, bool kResidual, int kInput,
          bool kInterleaved = false, int kPairs = 1>
__global__ void __launch_bounds__(kThreads* kPairs)
    gemmKernel(const __nv_bfloat16* __restrict__ x, int m, const __nv_bfloat16* __restrict__ w,
               int n, int k, float* __restrict__ y, int ldy, GemmFold fold, int splits,
               int token_blocks, GemmResidual res, GemmNormedInput nin, GemmActivatedInput act) {
  constexpr bool kNormed = kInput == kNormedInput, kActivated = kInput == kActivatedInput;
  constexpr int kRows = 16 * kTiles;  // weight rows per block
  constexpr int kOutputs = kRows * 8 * kGroups;
  constexpr int kSets = kPipelined ? 2 : 1;
  // One float of padding a row: the reduction below reads down a column, which would otherwise
  // put a warp's reads in one bank.
  static_assert(kPairs == 1 || !kInterleaved);
  __shared__ float pair_partial[kPairs][kWarps][kRows][8 * kGroups + 1];
  __shared__ float pair_block_sum[kPairs][kOutputs];
  __shared__ unsigned long long pair_fold_scratch[kPairs][kWarps][kTiles];
  // Unsigned, and constants with one cell a block: signed or computed indices gave the kernels of
  // one cell other registers (the one-row pipelined kernel 138 instead of 128).
  const unsigned pair = kPairs == 1 ? 0u : threadIdx.x / kThreads,
                 tid = kPairs == 1 ? threadIdx.x : threadIdx.x % kThreads;
  auto& partial = pair_partial[pair];
  float* const block_sum = pair_block_sum[pair];
  auto& fold_scratch = pair_fold_scratch[pair];
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  // A cluster of `splits` blocks per (weight tile, token block). kInterleaved: the token_blocks
  // blocks of a tile are neighbours along x (launched together, so the tile's later reads come
  // from the L2 cache); otherwise the token blocks go along y.
  // The check tile's clusters (past the weight's tiles in the tile numbers below) come first in
  // the grid, so that they run beside the product's first blocks rather than after its last.
  // With pairs, the weight's tiles are padded to a multiple of kPairs (a tile past the weight's
  // rows loads and stores nothing), and so are the check tiles, so that no block holds both.
  const int rank = int(blockIdx.x) % splits, cell = int(blockIdx.x) / splits * kPairs + int(pair);
  const int weight_tiles = ((n + 15) / 16 + kTiles - 1) / kTiles,
            check_tiles = int(gridDim.x) / splits * kPairs / token_blocks -
                          (weight_tiles + kPairs - 1) / kPairs * kPairs,
            placed = kInterleaved ? cell / token_blocks : cell,
            tile = placed < check_tiles ? weight_tiles + placed : placed - check_tiles,
            token_block = kInterleaved ? cell % token_blocks : int(blockIdx.y);
  const int n0 = tile * kRows, m0 = token_block * 8 * kGroups;
  const int k_blocks = (k + 31) / 32, lanes = splits * kWarps;
  bool row_lo[kTiles], row_hi[kTiles];
  const __nv_bfloat16 *w_lo[kTiles], *w_hi[kTiles];
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    row_lo[i] = n0 + 16 * i + g < n;
    row_hi[i] = n0 + 16 * i + g + 8 < n;
    w_lo[i] = w + size_t(row_lo[i] ? n0 + 16 * i + g : 0) * k + 8 * c;
    w_hi[i] = w + size_t(row_hi[i] ? n0 + 16 * i + g + 8 : 0) * k + 8 * c;
  }
  const __nv_bfloat16* x_row[kGroups];
  const float* xf_row[kGroups];  // normed: the residual's rows; activated: the gate's
  bool token[kGroups];
#pragma unroll
  for (int t = 0; t < kGroups; ++t) {
    token[t] = m0 + 8 * t + g < m;
    if constexpr (kNormed)
      xf_row[t] = nin.x + size_t(token[t] ? m0 + 8 * t + g : 0) * nin.ldx + 8 * c;
    else if constexpr (kActivated)
      xf_row[t] = act.gate_up + size_t(token[t] ? m0 + 8 * t + g : 0) * act.ld + 8 * c;
    else
      x_row[t] = x + size_t(token[t] ? m0 + 8 * t + g : 0) * k + 8 * c;
  }
  float inv[kGroups] = {};  // normed: token g's 1 / rms
  // The blocks of the first token group fold what they load: every word once a launch. A tile
  // lies within one weight (the boundaries are multiples of 16).
  const bool folding = fold.weights > 0 && token_block == 0;
  const uint32_t key_lo = foldKeys(g, 4 * c), key_hi = foldKeys(g, 16 + 4 * c);
  uint32_t fold_acc[kTiles][4] = {};
  float acc[kTiles][kGroups][4] = {};
  uint4 a_lo[kSets][kUnroll][kTiles], a_hi[kSets][kUnroll][kTiles], b[kSets][kUnroll][kGroups];
  auto inK = [&](int kb) { return kb < k_blocks && 32 * kb + 8 * c < k; };
  auto loadWeights = [&](int set, int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kb = base + u * lanes;
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        a_lo[set][u][i] = load16(w_lo[i] + 32 * kb, inK(kb) && row_lo[i]);
        a_hi[set][u][i] = load16(w_hi[i] + 32 * kb, inK(kb) && row_hi[i]);
      }
    }
  };
  auto loadTokens = [&](int set, int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int kb = base + u * lanes;
#pragma unroll
      for (int t = 0; t < kGroups; ++t) {
        if constexpr (kNormed)
          b[set][u][t] = normedLoad(xf_row[t] + 32 * kb, nin.weight + 32 * kb + 8 * c, inv[t],
                                    inK(kb) && token[t]);
        else if constexpr (kActivated)
          b[set][u][t] =
              activatedLoad(xf_row[t] + 32 * kb, xf_row[t] + k + 32 * kb, inK(kb) && token[t]);
        else
          b[set][u][t] = load16(x_row[t] + 32 * kb, inK(kb) && token[t]);
      }
    }
  };
  // One round's multiplies and fold (its weights already loaded; its tokens too unless asked to
  // load them first).
  auto multiply = [&](int set, int base, bool load_tokens) {
    if (load_tokens) loadTokens(set, base);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * lanes >= k_blocks) break;  // the same for the whole warp
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
#pragma unroll
        for (int t = 0; t < kGroups; ++t) {
          const uint4 &lo = a_lo[set][u][i], &hi = a_hi[set][u][i], &tok = b[set][u][t];
          mmaBf16(acc[i][t], lo.x, hi.x, lo.y, hi.y, tok.x, tok.y);
          mmaBf16(acc[i][t], lo.z, hi.z, lo.w, hi.w, tok.z, tok.w);
        }
      }
    }
    if (folding) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * lanes >= k_blocks) break;  // the same for the whole warp
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const uint4 &lo = a_lo[set][u][i], &hi = a_hi[set][u][i];
          foldMma(fold_acc[i], lo.x, hi.x, lo.y, hi.y, key_lo, key_hi);
          foldMma(fold_acc[i], lo.z, hi.z, lo.w, hi.w, key_lo, key_hi);
        }
      }
    }
  };
  // The first round's weights (which no kernel writes) load before the wait for the kernel
  // before, whose output (the tokens) loads after it; that round is peeled off so that the
  // loop keeps one shape (the compiler schedules its loads together).
  const int round = lanes * kUnroll;
  int base = rank * kWarps + warp;
  // Normed or activated with checks: the clusters past the weight's tiles are the check tile
  // (no weight rows), their lanes interleaved over the k blocks.
  const bool check_tile =
      ((kNormed && normedHasChecks(nin)) || (kActivated && activatedHasChecks(act)) ||
       (kInput == kTokenInput && tokenHasChecks(nin))) &&
      placed < check_tiles;
  const int check_first = (tile - weight_tiles) * lanes + base, check_stride = check_tiles * lanes;
  if constexpr (kInput == kTokenInput) {
    if (check_tile) {  // its own path from here, with its own loads before the wait
      tokenChecks<kGroups>(x, nin, m0, m, k, check_first);
      return;  // the whole cluster
    }
  }
  if (base < k_blocks && !check_tile) loadWeights(0, base);
  awaitKernelBefore();
  if constexpr (kActivated) {
    if (check_tile) {
      activatedChecks<kGroups>(act, m0, m, k, check_first, check_stride);
      return;  // the whole cluster, as below
    }
  }
  if constexpr (kNormed) {
    // Each token's 1 / rms from its partials, as the norm kernel takes it; a warp-wide sum a
    // token, lane g keeping token g's.
#pragma unroll
    for (int t = 0; t < kGroups; ++t)
      for (int tt = 0; tt < 8 && m0 + 8 * t + tt < m; ++tt) {
        const float total =
            rowSumOfSquares(nin.partials + size_t(m0 + 8 * t + tt) * nin.ldp, normTiles(k));
        if (g == tt) inv[t] = 1.0f / sqrtf(total / float(k) + nin.eps);
      }
    if (check_tile) {
      normedChecks<kGroups>(nin, inv, m0, m, k, check_first, check_stride);
      return;  // the whole cluster: every block of the check tile returns here
    }
  }
  if constexpr (!kPipelined) {
    if (base < k_blocks) {
      multiply(0, base, true);
      base += round;
    }
    for (; base < k_blocks; base += round) {
      loadWeights(0, base);
      multiply(0, base, true);
    }
  } else {
    loadTokens(0, base);
    // Set 1 loads while set 0 multiplies, then the other way round.
    while (base < k_blocks) {
      loadWeights(1, base + round);
      loadTokens(1, base + round);
      multiply(0, base, false);
      base += round;
      if (base >= k_blocks) break;
      loadWeights(0, base + round);
      loadTokens(0, base + round);
      multiply(1, base, false);
      base += round;
    }
  }
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int t = 0; t < kGroups; ++t) {
      partial[warp][16 * i + g][8 * t + 2 * c] = acc[i][t][0];
      partial[warp][16 * i + g][8 * t + 2 * c + 1] = acc[i][t][1];
      partial[warp][16 * i + g + 8][8 * t + 2 * c] = acc[i][t][2];
      partial[warp][16 * i + g + 8][8 * t + 2 * c + 1] = acc[i][t][3];
    }
  }
  if (folding) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const unsigned long long folded = warpSum64(tileFold(fold, n0 + 16 * i, g, c, fold_acc[i]));
      if (lane == 0) fold_scratch[warp][i] = folded;
    }
  }
  __syncthreads();
  // Output e is weight row e % kRows and token e / kRows: neighbouring threads store
  // neighbouring outputs.
  for (int e = tid; e < kOutputs; e += kThreads) {
    float total = partial[0][e % kRows][e / kRows];
#pragma unroll
    for (int v = 1; v < kWarps; ++v) total += partial[v][e % kRows][e / kRows];
    block_sum[e] = total;
  }
  // Output e is weight row e % kRows and token e / kRows (storeOutput).
  auto store = [&](int e, float value) {
    storeOutput<kResidual>(n0 + e % kRows, m0 + e / kRows, value, n, m, y, ldy, res);
  };
  storeBlockSums<kOutputs>(block_sum, rank, splits, store, tid);
  if (folding && tid == 0) {
    // The block's fold of each tile into its weight's account: the ranks' folds add up to the
    // tile's (integers: in any order), and rank 0 counts the tile's words.
    for (int i = 0; i < kTiles; ++i) {
      const int tile_row = n0 + 16 * i;
      if (tile_row >= n) break;  // past the weight's last row: nothing was loaded
      unsigned long long block_fold = 0;
      for (int v = 0; v < kWarps; ++v) block_fold += fold_scratch[v][i];
      FoldSlot& slot = foldAccount(fold, foldSegment(fold, tile_row))->mine();
      atomicAdd(&slot.sum, block_fold);
      if (rank == 0)
        atomicAdd(&slot.words, (unsigned long long)min(16, n - tile_row) * uint32_t(k / 2));
    }
  }
}

// A product kernel's launch: 128 threads a block (times `pairs`), clusters of `splits` blocks
// along x (the k splits of a tile), programmatic where the stream is. Holds the attributes its
// config points to.
struct ProductLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attrs[2];
  ProductLaunch(dim3 grid, int splits, cudaStream_t stream, int pairs = 1) {
    config.gridDim = grid;
    config.blockDim = dim3(unsigned(kThreads * pairs));
    config.stream = stream;
    unsigned count = 0;
    if (splits > 1) {
      attrs[count].id = cudaLaunchAttributeClusterDimension;
      attrs[count].val.clusterDim.x = unsigned(splits);
      attrs[count].val.clusterDim.y = 1;
      attrs[count].val.clusterDim.z = 1;
      ++count;
    }
    config.attrs = attrs;
    config.numAttrs = addProgrammaticAttribute(stream, attrs, count);
  }
  ProductLaunch(const ProductLaunch&) = delete;
  ProductLaunch& operator=(const ProductLaunch&) = delete;
};

// kInterleaved: the token blocks of each weight tile side by side (token_blocks in the kernel);
// kPairs: cells a block (gemmKernel).
template <int kGroups, int kUnroll, bool kPipelined = false, int kTiles = 1,
          bool kInterleaved = false, int kPairs = 1>
cudaError_t launch(int splits, const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k,
                   float* y, int ldy, cudaStream_t stream, const GemmFold& fold,
                   const GemmResidual& res, const GemmNormedInput& nin,
                   const GemmActivatedInput& act) {
  const bool checks = (nin.x != nullptr && normedHasChecks(nin)) ||
                      (act.gate_up != nullptr && activatedHasChecks(act)) ||
                      (act.gate_up == nullptr && tokenHasChecks(nin));
  // The check tile: enough clusters that a warp of it takes at most 8 k blocks (its loads are
  // not unrolled as the product's are, and it should finish no later than the product); one for
  // a product's own checks of bf16 tokens.
  const int lanes = splits * kWarps, k_blocks = (k + 31) / 32;
  // A product of bf16 tokens checks its own input with a check lane for each consumer's k block
  // (tokenChecks).
  const int token_checks = act.gate_up == nullptr ? tokenConsumers(nin) * k_blocks : 0;
  const int check_clusters = !checks            ? 0
                             : token_checks > 0 ? (token_checks + lanes - 1) / lanes
                                                : (k_blocks + 8 * lanes - 1) / (8 * lanes);
  // Cells (weight tiles, then check tiles), each padded to whole blocks of kPairs cells.
  auto wholeBlocks = [](int cells) { return (cells + kPairs - 1) / kPairs; };
  const int blocks =
      wholeBlocks(((n + 15) / 16 + kTiles - 1) / kTiles) + wholeBlocks(check_clusters);
  const int token_blocks = (m + 8 * kGroups - 1) / (8 * kGroups);
  const int interleaved = kInterleaved ? token_blocks : 1;  // token input only
  ProductLaunch setup(
      dim3(unsigned(blocks * splits * interleaved), unsigned(token_blocks / interleaved)), splits,
      stream, kPairs);
  auto go = [&](auto kernel) {
    return cudaLaunchKernelEx(&setup.config, kernel, x, m, w, n, k, y, ldy, fold, splits,
                              interleaved, res, nin, act);
  };
  if constexpr (kGroups == 1) {  // the inputs computed as they load: 1-8 rows
    if (act.gate_up != nullptr)
      return res.x != nullptr
                 ? go(gemmKernel<kGroups, kUnroll, kPipelined, kTiles, true, kActivatedInput>)
                 : go(gemmKernel<kGroups, kUnroll, kPipelined, kTiles, false, kActivatedInput>);
    if (nin.x != nullptr)
      return go(gemmKernel<kGroups, kUnroll, kPipelined, kTiles, false, kNormedInput>);
  }
  if (res.x != nullptr)
    return go(
        gemmKernel<kGroups, kUnroll, kPipelined, kTiles, true, kTokenInput, kInterleaved, kPairs>);
  return go(
      gemmKernel<kGroups, kUnroll, kPipelined, kTiles, false, kTokenInput, kInterleaved, kPairs>);
}

// The tiled schedule's kernel (from kTiledFromRows rows: large decode steps and prefill): a block
// of four warps takes kTiledRows weight rows by kTiledTokens tokens and stages each k block of
// both in shared memory (cp.async, kStageBlocks k blocks a stage, several stages in flight);
// warp w multiplies rows 32 (w / 2) .. + 31 by tokens 32 (w % 2) .. + 31, so each loaded byte
// feeds four times the multiplies a gemmKernel warp gets from it. The k splits are a cluster's
// blocks as in gemmKernel: rank r runs lanes r * kWarps .. + kWarps - 1 of gemmKernel's
// `lanes` = splits x kWarps (lane v's k blocks v, v + lanes, ... in increasing order, from zero)
// one after another, adding them in lane order as gemmKernel's warps are added, and the ranks'
// sums are added in rank order through distributed shared memory (storeBlockSums). So every
// output is the same sequence of operations as in every other schedule. A lane with no k block
// adds its zero, as an idle warp does there.
constexpr int kTiledRows = 64, kTiledTokens = 64;

// Where the tiled kernel's run stands: lane v at k block kb (lanes up to `end` without a k block
// skipped).
struct TiledCursor {
  int v, kb;
  __device__ void skipEmpty(int k_blocks, int end) {
    while (kb >= k_blocks && v < end) kb = ++v;
  }
  __device__ void advance(int lanes, int k_blocks, int end) {
    kb += lanes;
    skipEmpty(k_blocks, end);
  }
};

template <bool kResidual>
__global__ void __launch_bounds__(kThreads)
    tiledGemmKernel(const __nv_bfloat16* __restrict__ x, int m, const __nv_bfloat16* __restrict__ w,
                    int n, int k, float* __restrict__ y, int ldy, GemmFold fold, int splits,
                    int token_blocks, GemmResidual res, GemmNormedInput nin) {
  constexpr int kWeightPieces = kTiledRows * 4, kTokenPieces = kTiledTokens * 4;  // 16 bytes each
  constexpr int kStagePieces = kWeightPieces + kTokenPieces;
  constexpr int kOutputs = kTiledRows * kTiledTokens;
  static_assert(kWeightPieces % kThreads == 0 && kTokenPieces % kThreads == 0 &&
                kOutputs % kThreads == 0);
  constexpr int kStageBlocks = 2, kStages = 3;
  static_assert(kStages * kStageBlocks * kStagePieces * 16 >= kOutputs * 4);
  // kStages stages of kStageBlocks k blocks ([stage][block][weight rows, then tokens][piece])
  // while multiplying; the block's sums ([token][row]) after.
  __shared__ uint4 shared[kStages * kStageBlocks * kStagePieces];
  float* const block_sum = reinterpret_cast<float*>(shared);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int rank = int(blockIdx.x) % splits, cell = int(blockIdx.x) / splits;
  const int tile = cell / token_blocks, token_block = cell % token_blocks;
  const int n0 = tile * kTiledRows, m0 = token_block * kTiledTokens;
  const int k_blocks = (k + 31) / 32, lanes = splits * kWarps;
  const int first_lane = rank * kWarps, end_lane = first_lane + kWarps;  // the rank's lanes
  const int weight_tiles = (n + kTiledRows - 1) / kTiledRows;
  if (tile >= weight_tiles) {
    // The blocks past the weight's tiles: the product's own side of its consumers' checks (a
    // warp for each consumer and k block, as gemmKernel's check tile).
    // A tile of check blocks takes `lanes` check lanes, over its ranks.
    tokenChecks<kTiledTokens / 8>(x, nin, m0, m, k,
                                  (tile - weight_tiles) * lanes + first_lane + warp);
    return;  // the whole cluster
  }
  const int rows0 = 32 * (warp / 2), tokens0 = 32 * (warp % 2);  // the warp's part of the tile
  const bool folding = fold.weights > 0 && token_block == 0 && tokens0 == 0;
  const uint32_t key_lo = foldKeys(g, 4 * c), key_hi = foldKeys(g, 16 + 4 * c);
  uint32_t fold_acc[2][4] = {};

  // Thread t stages 16-byte piece t % 4 of weight rows t / 4 and t / 4 + 32 and of the same two
  // tokens: the same four sources every k block, at offsets 32 kb.
  static_assert(kWeightPieces == 2 * kThreads && kTokenPieces == 2 * kThreads);
  const int piece_row = threadIdx.x / 4, piece = threadIdx.x % 4;
  const __nv_bfloat16 *weight_from[2], *token_from[2];
  bool weight_in[2], token_in[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    weight_in[h] = n0 + piece_row + 32 * h < n;
    token_in[h] = m0 + piece_row + 32 * h < m;
    weight_from[h] = w + size_t(weight_in[h] ? n0 + piece_row + 32 * h : 0) * k + 8 * piece;
    token_from[h] = x + size_t(token_in[h] ? m0 + piece_row + 32 * h : 0) * k + 8 * piece;
  }
  TiledCursor loading{first_lane, first_lane};
  loading.skipEmpty(k_blocks, end_lane);
  TiledCursor multiplying = loading;
  int items = 0;
  for (int v = first_lane; v < end_lane; ++v)
    if (v < k_blocks) items += (k_blocks - v + lanes - 1) / lanes;
  // The run's next kStageBlocks k blocks into stage `buffer` (zeros past the weight's rows, the
  // step's tokens or k); one commit group either way.
  auto stage = [&](int buffer) {
#pragma unroll
    for (int u = 0; u < kStageBlocks; ++u) {
      if (loading.v >= end_lane) break;
      uint4* const into = shared + (buffer * kStageBlocks + u) * kStagePieces + threadIdx.x;
      const int at = 32 * loading.kb;
      const bool k_in = at + 8 * piece < k;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        cpAsync16(into + h * kThreads, weight_from[h] + (k_in ? at : 0), weight_in[h] && k_in);
        cpAsync16(into + kWeightPieces + h * kThreads, token_from[h] + (k_in ? at : 0),
                  token_in[h] && k_in);
      }
      loading.advance(lanes, k_blocks, end_lane);
    }
    cpAsyncCommit();
  };
  float acc[2][4][4] = {}, rank_sum[2][4][4] = {};
  int lane_now = first_lane;  // the lane whose k blocks acc sums
  auto finishLane = [&]() {
    const int j = lane_now % kWarps;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          rank_sum[i][t][q] = j == 0 ? acc[i][t][q] : rank_sum[i][t][q] + acc[i][t][q];
          acc[i][t][q] = 0.0f;
        }
    ++lane_now;
  };
  // The tokens are the kernel before's output; the weights could load before the wait, but a
  // prefill step's products are long enough that it would not show.
  awaitKernelBefore();
#pragma unroll
  for (int s = 0; s + 1 < kStages; ++s) stage(s);
  const int rounds = (items + kStageBlocks - 1) / kStageBlocks;
  for (int round = 0; round < rounds; ++round) {
    cpAsyncWait<kStages - 2>();  // this round's k blocks have arrived (for this thread) ...
    __syncthreads();  // ... and for the block, which is also past the round before's stage
    stage((round + kStages - 1) % kStages);
#pragma unroll
    for (int u = 0; u < kStageBlocks; ++u) {
      if (round * kStageBlocks + u >= items) break;  // the same for the whole block
      while (lane_now < multiplying.v) finishLane();
      const uint4* const weights = shared + ((round % kStages) * kStageBlocks + u) * kStagePieces;
      const uint4* const tokens = weights + kWeightPieces;
      uint4 lo[2], hi[2], tok[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        lo[i] = weights[(rows0 + 16 * i + g) * 4 + c];
        hi[i] = weights[(rows0 + 16 * i + 8 + g) * 4 + c];
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) tok[t] = tokens[(tokens0 + 8 * t + g) * 4 + c];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          mmaBf16(acc[i][t], lo[i].x, hi[i].x, lo[i].y, hi[i].y, tok[t].x, tok[t].y);
          mmaBf16(acc[i][t], lo[i].z, hi[i].z, lo[i].w, hi[i].w, tok[t].z, tok[t].w);
        }
      if (folding) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          foldMma(fold_acc[i], lo[i].x, hi[i].x, lo[i].y, hi[i].y, key_lo, key_hi);
          foldMma(fold_acc[i], lo[i].z, hi[i].z, lo[i].w, hi[i].w, key_lo, key_hi);
        }
      }
      multiplying.advance(lanes, k_blocks, end_lane);
    }
  }
  while (lane_now < end_lane) finishLane();  // the last lane, then any with no k block (zero)
  cpAsyncWait<0>();
  __syncthreads();  // every warp is past its last multiply: the buffers take the sums

  // Accumulator q is weight row g (+ 8 for q >= 2) of a 16-row tile and token 2c + q % 2 of a
  // group of 8.
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        block_sum[(tokens0 + 8 * t + 2 * c + q % 2) * kTiledRows + rows0 + 16 * i + g +
                  8 * (q / 2)] = rank_sum[i][t][q];
  if (folding) {
    // This warp's two tiles, whose k blocks it folded (the ranks' folds add up to the tiles'); it
    // counts their words (rank 0).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tile_row = n0 + rows0 + 16 * i;
      const unsigned long long folded = warpSum64(tileFold(fold, tile_row, g, c, fold_acc[i]));
      if (lane == 0 && tile_row < n) {
        FoldSlot& slot = foldAccount(fold, foldSegment(fold, tile_row))->mine();
        atomicAdd(&slot.sum, folded);
        if (rank == 0)
          atomicAdd(&slot.words, (unsigned long long)min(16, n - tile_row) * uint32_t(k / 2));
      }
    }
  }
  // Output e is weight row e % kTiledRows and token e / kTiledRows: a warp's lanes store
  // neighbouring rows of one token (storeOutput).
  static_assert(kOutputs % (kMaxSplits * kThreads) == 0);
  storeBlockSums<kOutputs>(block_sum, rank, splits, [&](int e, float value) {
    storeOutput<kResidual>(n0 + e % kTiledRows, m0 + e / kTiledRows, value, n, m, y, ldy, res);
  });
}

// The tiled kernel for a product of bf16 tokens: a tile's token blocks side by side, each a
// cluster of the splits' blocks, then the blocks of the product's own checks (a warp each consumer
// and k block).
cudaError_t launchTiled(int splits, const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n,
                        int k, float* y, int ldy, cudaStream_t stream, const GemmFold& fold,
                        const GemmResidual& res, const GemmNormedInput& nin) {
  const int token_checks = tokenConsumers(nin) * ((k + 31) / 32);
  const int check_lanes = splits * kWarps;  // a tile of check blocks
  const int tiles =
      (n + kTiledRows - 1) / kTiledRows + (token_checks + check_lanes - 1) / check_lanes;
  const int token_blocks = (m + kTiledTokens - 1) / kTiledTokens;
  ProductLaunch setup(dim3(unsigned(tiles * token_blocks * splits)), splits, stream);
  auto go = [&](auto kernel) {
    return cudaLaunchKernelEx(&setup.config, kernel, x, m, w, n, k, y, ldy, fold, splits,
                              token_blocks, res, nin);
  };
  return res.x != nullptr ? go(tiledGemmKernel<true>) : go(tiledGemmKernel<false>);
}

}  // namespace

uint32_t productFold(const std::byte* data, size_t rows, int k, uint32_t first_row, uint32_t salt) {
  uint32_t q[64];
  for (uint32_t o = 0; o < 64; ++o) {
    q[o] = 0;
    for (uint32_t j = 0; j < 8; ++j)
      q[o] += (2 * j + 1) * productFoldKey(j, productFoldPosition(o));
  }
  const size_t row_bytes = size_t(k) * 2;
  uint32_t fold = 0;
  for (size_t r = 0; r < rows; ++r) {
    const auto* row = reinterpret_cast<const uint8_t*>(data + r * row_bytes);
    uint32_t sum = 0;
    size_t o = 0;
    for (; o + 64 <= row_bytes; o += 64)
      for (size_t i = 0; i < 64; ++i) sum += uint32_t(row[o + i]) * q[i];
    for (; o < row_bytes; ++o) sum += uint32_t(row[o]) * q[o % 64];
    fold += (2 * (first_row + uint32_t(r)) + 1) * sum;
  }
  return (2 * salt + 1) * fold;
}

namespace {

// The schedule gemmScheduleName gives this name, if any.
std::optional<GemmSchedule> scheduleNamed(std::string_view name) {
  for (const GemmSchedule s : kGemmSchedules)
    if (name == gemmScheduleName(s)) return s;
  return std::nullopt;
}

// Every schedule's name, comma-separated, for the parsers' messages.
std::string scheduleNames() {
  std::string names;
  for (const GemmSchedule s : kGemmSchedules)
    names += (names.empty() ? "" : ", ") + std::string(gemmScheduleName(s));
  return names;
}

}  // namespace

Result<GemmScheduleBuckets> parseGemmSchedules(std::string_view text) {
  std::vector<GemmSchedule> named;
  size_t at = 0;
  while (true) {
    const size_t comma = text.find(',', at);
    const std::string_view name =
        text.substr(at, comma == std::string_view::npos ? comma : comma - at);
    const std::optional<GemmSchedule> schedule = scheduleNamed(name);
    if (!schedule)
      return invalidArgument("product schedule \"" + std::string(name) +
                             "\" (known: " + scheduleNames() + ")");
    named.push_back(*schedule);
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  if (named.size() != 1 && named.size() != 4)
    return invalidArgument(
        "product schedules: one name, or four (rows 1-8, 9-16, 17-32, 33+), not " +
        std::to_string(named.size()));
  GemmScheduleBuckets buckets;
  for (size_t b = 0; b < buckets.size(); ++b) buckets[b] = named[named.size() == 1 ? 0 : b];
  return buckets;
}

namespace {

// "NxK=VALUE[,NxK=VALUE...]", each VALUE read by `value(n, k, VALUE)` (nullopt: not one): the
// items in order, or nullopt with `bad` the first item that is not one.
template <typename T, typename Value>
std::optional<std::vector<T>> parseShapeList(std::string_view text, Value value, std::string& bad) {
  std::vector<T> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item(text.substr(at, comma - at));
    int n = 0, k = 0, used = 0;
    char x = 0, eq = 0;
    std::optional<T> parsed;
    if (std::sscanf(item.c_str(), "%d%c%d%c%n", &n, &x, &k, &eq, &used) == 4 && x == 'x' &&
        eq == '=' && n > 0 && k > 0 && used < int(item.size()))
      parsed = value(n, k, item.substr(size_t(used)));
    if (!parsed) {
      bad = item;
      return std::nullopt;
    }
    out.push_back(*parsed);
    at = comma + 1;
  }
  return out;
}

}  // namespace

Result<std::vector<GemmSplitsFor>> parseGemmSplits(std::string_view text) {
  std::string bad;
  auto out = parseShapeList<GemmSplitsFor>(
      text,
      [](int n, int k, const std::string& value) -> std::optional<GemmSplitsFor> {
        int splits = 0, used = 0;
        if (std::sscanf(value.c_str(), "%d%n", &splits, &used) != 1 || used != int(value.size()) ||
            splits < 1 || splits > kMaxSplits)
          return std::nullopt;
        return GemmSplitsFor{n, k, splits};
      },
      bad);
  if (!out)
    return invalidArgument("product split count \"" + bad + "\" (NxK=S, S from 1 to " +
                           std::to_string(kMaxSplits) + ")");
  return std::move(*out);
}

Result<std::vector<GemmScheduleFor>> parseGemmShapeSchedules(std::string_view text) {
  std::string bad;
  auto out = parseShapeList<GemmScheduleFor>(
      text,
      [](int n, int k, const std::string& value) -> std::optional<GemmScheduleFor> {
        if (const std::optional<GemmSchedule> s = scheduleNamed(value))
          return GemmScheduleFor{n, k, *s};
        return std::nullopt;
      },
      bad);
  if (!out)
    return invalidArgument("product schedule for a shape \"" + bad +
                           "\" (NxK=NAME: " + scheduleNames() + ")");
  return std::move(*out);
}

GemmSchedule gemmScheduleAt33To64(int n, int k) {
  if (gemmSplits(n, k) > 1) return n > k ? GemmSchedule::kTwoTiles : GemmSchedule::kPaired;
  return n >= 8192 ? GemmSchedule::kTwoTiles : GemmSchedule::kInterleaved;
}

int gemmSplits(int n, int k) {
  const int tiles = (n + 15) / 16, k_blocks = (k + 31) / 32;
  int splits = 1;
  // Past 256 blocks a split pays only where each warp keeps 8 k blocks or more (H100, bench-gemm:
  // 3584 x 3584 at 2 splits against 4, 11.0 against 12.6 us at one row, 14.9 against 18.9 at 32).
  while (splits < kMaxSplits && k_blocks >= 32 * splits &&
         (tiles * splits < 256 || (tiles * splits < 512 && k_blocks >= 64 * splits)))
    splits *= 2;
  return splits;
}

Status launchGemm(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
                  int ldy, cudaStream_t stream, const GemmFold& fold, GemmSchedule schedule,
                  int forced_splits, const GemmResidual& residual, const GemmNormedInput& normed,
                  const GemmActivatedInput& activated) {
  const bool to_residual = residual.x != nullptr, is_normed = normed.x != nullptr,
             is_activated = activated.gate_up != nullptr;
  if (m <= 0 || n <= 0 || k <= 0 || k % 8 != 0 || (!to_residual && ldy < n) ||
      (!is_normed && !is_activated && uintptr_t(x) % 16 != 0) || uintptr_t(w) % 16 != 0)
    return invalidArgument("product of " + std::to_string(m) + "x" + std::to_string(k) + " by " +
                           std::to_string(n) + "x" + std::to_string(k) + " (k a multiple of 8, " +
                           "16-byte aligned operands)");
  if (fold.weights < 0 || fold.weights > 3 ||
      (fold.weights > 0 && fold.row_end[fold.weights - 1] != n))
    return invalidArgument("product fold over " + std::to_string(fold.weights) +
                           " weights does not end at row " + std::to_string(n));
  for (int s = 0; s + 1 < fold.weights; ++s)
    if (fold.row_end[s] % 16 != 0)
      return invalidArgument("product fold boundary at row " + std::to_string(fold.row_end[s]) +
                             " is not a multiple of 16");
  if (to_residual && residual.rows_to != nullptr)
    return invalidArgument("a product into the residual stores no rows elsewhere (rows_to)");
  if (to_residual &&
      (residual.ldx < n || residual.partials == nullptr || residual.ldp < normTiles(n) ||
       (residual.checks != nullptr && (residual.role < 0 || residual.role >= residual.roles))))
    return invalidArgument("product into the residual: " + std::to_string(n) +
                           " outputs a row, rows " + std::to_string(residual.ldx) +
                           " apart, partials " + std::to_string(residual.ldp) +
                           " apart, check role " + std::to_string(residual.role));
  if (is_normed && (to_residual || m > kMaxNormedRows || normed.ldx < k || normed.ldx % 4 != 0 ||
                    uintptr_t(normed.x) % 16 != 0 || uintptr_t(normed.weight) % 16 != 0 ||
                    normed.partials == nullptr || normed.ldp < normTiles(k)))
    return invalidArgument("normed product of " + std::to_string(m) + " rows (at most " +
                           std::to_string(kMaxNormedRows) + ", not into the residual) of " +
                           std::to_string(k) + " inputs, rows " + std::to_string(normed.ldx) +
                           " apart, 16-byte aligned");
  if (is_activated &&
      (is_normed || m > kMaxNormedRows || activated.ld < 2 * k || activated.ld % 4 != 0 ||
       uintptr_t(activated.gate_up) % 16 != 0 ||
       ((activated.gate_role >= 0 || activated.up_role >= 0 || activated.consumer.role >= 0) &&
        activated.checks.products == nullptr) ||
       std::max({activated.gate_role, activated.up_role, activated.consumer.role}) >=
           activated.checks.roles ||
       (activated.consumer.role >= 0 &&
        (activated.consumer.colsum == nullptr || activated.consumer.abssum == nullptr))))
    return invalidArgument("activated product of " + std::to_string(m) + " rows (at most " +
                           std::to_string(kMaxNormedRows) + ") of " + std::to_string(k) +
                           " inputs, gate/up rows " + std::to_string(activated.ld) +
                           " apart, 16-byte aligned, with its checks' roles and sums");
  const bool token_checks = tokenHasChecks(normed);
  if (token_checks && (is_activated || normed.weight_fold != nullptr ||
                       (normed.consumers[0].role < 0 && normed.consumers[1].role >= 0) ||
                       (normed.consumers[1].role < 0 && normed.consumers[2].role >= 0)))
    return invalidArgument(
        "a product's own checks of its bf16 input: consumers from the first, no computed input");
  for (const ConsumerSums& consumer : normed.consumers)
    if ((is_normed || token_checks) && consumer.role >= 0 &&
        (consumer.colsum == nullptr || consumer.abssum == nullptr ||
         (token_checks &&  // loaded 16 bytes at a time
          (uintptr_t(consumer.colsum) % 16 != 0 || uintptr_t(consumer.abssum) % 16 != 0)) ||
         consumer.role >= normed.checks.roles || normed.checks.products == nullptr))
      return invalidArgument(std::string(is_normed ? "normed" : "token") +
                             " product's check of role " + std::to_string(consumer.role));
  if (forced_splits < 0 || forced_splits > kMaxSplits)
    return invalidArgument("product split over " + std::to_string(forced_splits) +
                           " blocks (0 to " + std::to_string(kMaxSplits) + ")");
  const int splits = forced_splits > 0 ? forced_splits : gemmSplits(n, k);
  cudaError_t launched;
  // Tiled below kTiledFromRows is pipelined (faster there in bench-engine decode on both shapes;
  // cuda/PERFORMANCE.md), and so is a weight too small to give kTiledMinBlocks blocks.
  const int tiled_blocks =
      (n + kTiledRows - 1) / kTiledRows * ((m + kTiledTokens - 1) / kTiledTokens) * splits;
  if (schedule == GemmSchedule::kTiled &&
      (m < kTiledFromRows || (forced_splits == 0 && tiled_blocks < kTiledMinBlocks)))
    schedule = GemmSchedule::kPipelined;
  if (schedule == GemmSchedule::kPaired && (m <= 8 || m > 64 || is_normed || is_activated))
    schedule = GemmSchedule::kPipelined;
  if (schedule == GemmSchedule::kPipelined) {
    if (m <= 8)
      launched = launch<1, 4, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed,
                                    activated);
    else if (m <= 16)
      launched = launch<2, 2, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed,
                                    activated);
    else if (m <= 32)
      launched = launch<4, 1, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed,
                                    activated);
    else if (m <= 64)
      launched = launch<8, 1, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed,
                                    activated);
    else  // several token blocks: each tile's side by side, its later reads from the L2 cache
      launched = launch<8, 1, true, 1, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                             normed, activated);
  } else if (schedule == GemmSchedule::kTwoTiles) {
    if (m <= 8)
      launched = launch<1, 4, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                        normed, activated);
    else if (m <= 16)
      launched = launch<2, 2, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                        normed, activated);
    else if (m <= 32)
      launched = launch<4, 1, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                        normed, activated);
    else
      launched = launch<8, 1, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                        normed, activated);
  } else if (schedule == GemmSchedule::kPaired) {
    if (m <= 16)
      launched = launch<2, 2, true, 1, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold,
                                                 residual, normed, activated);
    else if (m <= 32)
      launched = launch<4, 1, true, 1, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold,
                                                 residual, normed, activated);
    else
      launched = launch<8, 1, true, 1, false, 2>(splits, x, m, w, n, k, y, ldy, stream, fold,
                                                 residual, normed, activated);
  } else if (schedule == GemmSchedule::kTiled && !is_normed && !is_activated) {
    launched = launchTiled(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed);
  } else if (schedule == GemmSchedule::kInterleaved && m > 32) {
    launched = launch<4, 2, false, 1, true>(splits, x, m, w, n, k, y, ldy, stream, fold, residual,
                                            normed, activated);
  } else if (m <= 8)
    launched =
        launch<1, 8>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed, activated);
  else if (m <= 16)
    launched =
        launch<2, 4>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed, activated);
  else if (m <= 32)
    launched =
        launch<4, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed, activated);
  else
    launched =
        launch<8, 2>(splits, x, m, w, n, k, y, ldy, stream, fold, residual, normed, activated);
  BULKHEAD_CUDA_RETURN_IF_ERROR(launched);
  BULKHEAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return okStatus();
}

}  // namespace bulkhead::cuda
