// Attention on the tensor cores: see cuda/attention_mma.cuh. Block (tile, z): the tile's items,
// lane (g, c) of warp w holding items 16 w + g and 16 w + g + 8 as mma.sync's fragments hold rows
// g and g + 8; the block stages each chunk's keys and values in shared memory once for its four
// warps.
#include "cuda/attention_mma.cuh"

#include <cstring>
#include <string>

#include "cuda/cp_async.cuh"
#include "cuda/cuda_check.cuh"
#include "cuda/launch.cuh"
#include "cuda/warp_mma.cuh"

namespace bulkhead::cuda {
namespace {

constexpr int kChunk = 64;  // key positions a chunk
constexpr int kWarps = kMmaTileItems / 16;
constexpr int kThreads = 32 * kWarps;
static_assert(kAttentionSplit % kChunk == 0, "a split is whole chunks");

// A lane's two items: their online softmax over one split (or the fold of several), and the
// lane's dimensions of their outputs (o[d][2 i], o[d][2 i + 1]: item i, dimensions 8 d + 2 c and
// 8 d + 2 c + 1).
template <int HD>
struct State {
  float max[2], sum[2];
  float o[HD / 8][4];
  __device__ void clear() {
    max[0] = max[1] = -INFINITY;
    sum[0] = sum[1] = 0.0f;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] = 0.0f;
  }
};

// The splits folded so far: each item's maximum and sum in registers, the lane's output values
// in shared memory (value k of thread t at k * kThreads + t), where registers are short.
struct Folded {
  float max[2], sum[2];
};

// Folds item i of split result `s` (split `split` of the item) into `into` and `o` (which hold
// splits 0 .. split - 1), by the formula cuda/attention.cu's foldSplit uses; split 0 is copied.
template <int HD>
__device__ __forceinline__ void foldItem(Folded& into, float* o, const State<HD>& s, int i,
                                         uint32_t split) {
  if (split == 0) {
    into.max[i] = s.max[i];
    into.sum[i] = s.sum[i];
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
#pragma unroll
      for (int e = 0; e < 2; ++e) o[(4 * d + 2 * i + e) * kThreads] = s.o[d][2 * i + e];
    return;
  }
  const float m = fmaxf(into.max[i], s.max[i]);
  const float a = expf(into.max[i] - m), b = expf(s.max[i] - m);
  into.sum[i] = fmaf(into.sum[i], a, s.sum[i] * b);
#pragma unroll
  for (int d = 0; d < HD / 8; ++d)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& v = o[(4 * d + 2 * i + e) * kThreads];
      v = fmaf(v, a, s.o[d][2 * i + e] * b);
    }
  into.max[i] = m;
}

struct Tile {
  int first, count, kvh, items, group;
};

__device__ __forceinline__ Tile tileOf(const MmaAttentionArgs& a) {
  const uint32_t word = a.tiles[2 * blockIdx.x];
  Tile t;
  t.first = int(word & 0xffffffu);
  t.count = int(word >> 24);
  t.kvh = int(a.tiles[2 * blockIdx.x + 1]);
  t.group = a.heads / a.kv_heads;
  t.items = t.count * t.group;
  return t;
}

// A staged key or value row in bf16, padded against bank conflicts.
__host__ __device__ constexpr int stagedStride(int head_dim) {
  return head_dim + 8;
}

// Elements of one staged chunk of keys (or values).
__host__ __device__ constexpr int chunkElems(int head_dim) {
  return kChunk * stagedStride(head_dim);
}

// Dynamic shared memory a block uses: two chunks' keys and values (one computed on while the
// next loads), and the folded outputs.
constexpr size_t sharedBytes(int head_dim) {
  return size_t(4) * chunkElems(head_dim) * 2 + size_t(head_dim / 2) * kThreads * 4;
}

template <int HD>
__global__ void __launch_bounds__(kThreads) mmaAttentionKernel(MmaAttentionArgs a) {
  constexpr int kStride = stagedStride(HD);
  constexpr int kPieces = HD / 8;  // 16-byte pieces a row
  extern __shared__ __align__(16) unsigned char shared[];
  // Buffer b: keys at staged + 2 b chunkElems, values after them.
  __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(shared);
  float* fo = reinterpret_cast<float*>(staged + 4 * chunkElems(HD)) + threadIdx.x;
  __shared__ bool last;
  const Tile tile = tileOf(a);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  int row[2], head[2];
  uint32_t end[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int item = 16 * warp + g + 8 * i;
    const bool valid = item < tile.items;
    row[i] = valid ? tile.first + item / tile.group : -1;
    head[i] = valid ? tile.kvh * tile.group + item % tile.group : 0;
    end[i] = valid ? a.positions[row[i]] + 1 : 0;
  }
  uint32_t block_end = 0;
  for (int r = 0; r < tile.count; ++r) block_end = max(block_end, a.positions[tile.first + r] + 1);
  const uint32_t* table = a.block_tables + a.row_table[tile.first];
  const size_t head_offset = size_t(tile.kvh) * a.block_size * HD,
               block_stride = size_t(a.kv_heads) * a.block_size * HD;
  auto cacheRow = [&](uint32_t p) {
    return size_t(table[p / uint32_t(a.block_size)]) * block_stride + head_offset +
           size_t(p % uint32_t(a.block_size)) * HD;
  };
  const uint32_t splits = (block_end + kAttentionSplit - 1) / kAttentionSplit;
  awaitKernelBefore();  // the queries and the cache are the kernels' before
  // The items' queries as mma.sync's A fragments, every k16 step of the head (zeros for an
  // empty row), rounded to bf16.
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int s = 0; s < HD / 16; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int it = i % 2, col = 16 * s + 2 * c + 8 * (i / 2);
      const float* q = a.q + size_t(row[it] < 0 ? 0 : row[it]) * a.q_stride + head[it] * HD + col;
      qf[s][i] = row[it] >= 0 ? packRounded(q[0], q[1]) : 0u;
    }
  State<HD> run;
  Folded folded;
  // Starts loading a chunk's keys and values into buffer `b` (cp.async, one group). Positions
  // past the tile's last are zeros: the cache there may hold anything, and 0 times NaN is NaN.
  auto loadChunk = [&](uint32_t chunk, int b) {
    __nv_bfloat16* ks = staged + 2 * b * chunkElems(HD);
    __nv_bfloat16* vs = ks + chunkElems(HD);
    for (int e = threadIdx.x; e < kChunk * kPieces; e += kThreads) {
      const int p = e / kPieces, piece = e % kPieces;
      const uint32_t position = chunk + uint32_t(p);
      const bool valid = position < block_end;
      const size_t at = valid ? cacheRow(position) + 8 * piece : 0;
      cpAsync16(ks + p * kStride + 8 * piece, a.k_cache + at, valid);
      cpAsync16(vs + p * kStride + 8 * piece, a.v_cache + at, valid);
    }
    cpAsyncCommit();
  };
  // One split's online softmax over chunks of kChunk positions from `begin`, into `run`.
  auto attendSplit = [&](uint32_t begin, uint32_t split_end) {
    run.clear();
    __syncthreads();  // every warp is done with both buffers (the split before)
    loadChunk(begin, 0);
    int b = 0;
    for (uint32_t chunk = begin; chunk < split_end; chunk += kChunk, b ^= 1) {
      // The next chunk loads while this one is computed on: its buffer was last read in the
      // iteration before, which every warp has left (the barrier at the end of it).
      if (chunk + kChunk < split_end) {
        loadChunk(chunk + kChunk, b ^ 1);
        cpAsyncWait<1>();
      } else {
        cpAsyncWait<0>();
      }
      __syncthreads();  // this chunk's copies, from every thread, have landed
      const __nv_bfloat16* ks = staged + 2 * b * chunkElems(HD);
      const __nv_bfloat16* vs = ks + chunkElems(HD);
      float sc[kChunk / 8][4] = {};
#pragma unroll
      for (int s = 0; s < HD / 16; ++s)
#pragma unroll
        for (int j = 0; j < kChunk / 8; ++j) {
          const __nv_bfloat16* key = ks + (8 * j + g) * kStride + 16 * s + 2 * c;
          mmaBf16(sc[j], qf[s][0], qf[s][1], qf[s][2], qf[s][3], pairOf(key), pairOf(key + 8));
        }
      float chunk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2;
          const uint32_t position = chunk + uint32_t(8 * j + 2 * c + e % 2);
          const float s = position < end[i] ? __fmul_rn(sc[j][e], a.scale) : -INFINITY;
          sc[j][e] = s;
          chunk_max[i] = fmaxf(chunk_max[i], s);
        }
      float alpha[2], chunk_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 1));
        chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 2));
        const float new_max = fmaxf(run.max[i], chunk_max[i]);
        // 1 for an item this chunk does not reach (its maximum stays); 0 on an item's first.
        alpha[i] = run.max[i] == new_max ? 1.0f : expf(run.max[i] - new_max);
        run.max[i] = new_max;
      }
      uint32_t pf[kChunk / 8][2];
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float p[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float s = sc[j][2 * i + e];
            p[e] =
                s == -INFINITY ? 0.0f : __bfloat162float(__float2bfloat16_rn(expf(s - run.max[i])));
            chunk_sum[i] += p[e];
          }
          pf[j][i] = packRounded(p[0], p[1]);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        chunk_sum[i] += __shfl_xor_sync(0xffffffffu, chunk_sum[i], 1);
        chunk_sum[i] += __shfl_xor_sync(0xffffffffu, chunk_sum[i], 2);
        run.sum[i] = fmaf(run.sum[i], alpha[i], chunk_sum[i]);
      }
#pragma unroll
      for (int d = 0; d < HD / 8; ++d) {
        run.o[d][0] *= alpha[0];
        run.o[d][1] *= alpha[0];
        run.o[d][2] *= alpha[1];
        run.o[d][3] *= alpha[1];
      }
#pragma unroll
      for (int s = 0; s < kChunk / 16; ++s)
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
          uint32_t b0, b1;
          loadTransposed(b0, b1, vs + (16 * s + lane % 16) * kStride + 8 * d);
          mmaBf16(run.o[d], pf[2 * s][0], pf[2 * s][1], pf[2 * s + 1][0], pf[2 * s + 1][1], b0, b1);
        }
      __syncthreads();  // every warp is done with this buffer before the next load into it
    }
  };
  const uint32_t step = uint32_t(a.split_blocks);
  unsigned mine = 0;
  for (uint32_t s = blockIdx.y; s < splits; s += step, ++mine) {
    const uint32_t begin = s * kAttentionSplit;
    attendSplit(begin, min(block_end, begin + uint32_t(kAttentionSplit)));
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (end[i] <= begin) continue;  // the split holds none of this item's positions
      if (step > 1) {
        float* at =
            a.split_partials + ((size_t(row[i]) * a.heads + head[i]) * a.max_splits + s) * (HD + 2);
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
          at[8 * d + 2 * c] = run.o[d][2 * i];
          at[8 * d + 2 * c + 1] = run.o[d][2 * i + 1];
        }
        if (c == 0) {
          at[HD] = run.max[i];
          at[HD + 1] = run.sum[i];
        }
      } else {
        foldItem(folded, fo, run, i, s);
      }
    }
  }
  if (step > 1) {
    // The block that completes the tile's last split folds every split's partials in order. A
    // block with no split of its own counts nothing: adding its zero after the last block's add
    // and before its reset would make it a second "last" block, folding (and adding the checks'
    // sums) again.
    if (mine == 0) return;  // the whole block
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned* count = a.split_counts + blockIdx.x;
      last = atomicAdd(count, mine) + mine == splits;
      if (last) *count = 0;  // left zero for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (row[i] < 0) continue;
      const uint32_t item_splits = (end[i] + kAttentionSplit - 1) / kAttentionSplit;
      for (uint32_t s = 0; s < item_splits; ++s) {
        const float* at =
            a.split_partials + ((size_t(row[i]) * a.heads + head[i]) * a.max_splits + s) * (HD + 2);
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
          run.o[d][2 * i] = __ldcg(at + 8 * d + 2 * c);
          run.o[d][2 * i + 1] = __ldcg(at + 8 * d + 2 * c + 1);
        }
        run.max[i] = __ldcg(at + HD);
        run.sum[i] = __ldcg(at + HD + 1);
        foldItem(folded, fo, run, i, s);
      }
    }
  }
  // The outputs, and the o product's expected sum and bound from them (a quad's four lanes hold
  // an item's dimensions).
  double sums[2][2] = {};  // [item][expected, bound]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row[i] < 0) continue;
    __nv_bfloat16* out = a.out + size_t(row[i]) * a.heads * HD + size_t(head[i]) * HD;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int dim = 8 * d + 2 * c + e;
        const __nv_bfloat16 o =
            __float2bfloat16_rn(fo[(4 * d + 2 * i + e) * kThreads] / folded.sum[i]);
        out[dim] = o;
        if (a.consumer.role >= 0) {
          const float of = __bfloat162float(o);
          const int col = head[i] * HD + dim;
          sums[i][0] += double(a.consumer.colsum[col]) * of;
          sums[i][1] += double(a.consumer.abssum[col]) * fabsf(of);
        }
      }
  }
  if (a.consumer.role < 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      sums[i][v] += __shfl_xor_sync(0xffffffffu, sums[i][v], 1);
      sums[i][v] += __shfl_xor_sync(0xffffffffu, sums[i][v], 2);
    }
  if (c != 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row[i] < 0) continue;
    ProductCheck& p = a.checks.products[size_t(row[i]) * a.checks.roles + a.consumer.role];
    atomicAdd(&p.expected, sums[i][0]);
    atomicAdd(&p.bound, sums[i][1]);
  }
}

}  // namespace

bool mmaAttentionSupportsHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

Status launchMmaAttention(const MmaAttentionArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads != 0 ||
      a.heads / a.kv_heads > kMmaTileItems || !mmaAttentionSupportsHeadDim(a.head_dim) ||
      a.block_size <= 0 || a.q_stride < a.heads * a.head_dim || a.tiles == nullptr ||
      a.split_blocks < 1)
    return invalidArgument("tensor-core attention of " + std::to_string(a.heads) + " heads over " +
                           std::to_string(a.kv_heads) + " kv heads of " +
                           std::to_string(a.head_dim) + " in tiles");
  if (a.split_blocks > 1 &&
      (a.split_partials == nullptr || a.split_counts == nullptr || a.max_splits <= 0))
    return invalidArgument(
        "tensor-core attention with splits side by side needs partials and counts");
  if (a.tile_count == 0) return okStatus();
  const dim3 grid(unsigned(a.tile_count), unsigned(a.split_blocks));
  auto launch = [&](auto kernel, int head_dim) {
    const size_t bytes = sharedBytes(head_dim);
    cudaError_t set =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    // The smallest shared-memory carveout that holds one block. Left to itself the driver gives
    // the head size 128's blocks (102 KB) the largest, two a multiprocessor; under programmatic
    // launch the multiprocessors never drain, so the products after it kept 28 KB of L1 cache,
    // and a 7B step at 64 rows ran slower with this kernel, though the kernel itself was faster.
    cudaFuncAttributes attributes{};
    if (set == cudaSuccess) set = cudaFuncGetAttributes(&attributes, kernel);
    if (set == cudaSuccess)
      set = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 carveoutPercent(bytes + attributes.sharedSizeBytes));
    return set != cudaSuccess ? set : launchKernelShared(kernel, grid, kThreads, bytes, stream, a);
  };
  BULKHEAD_CUDA_RETURN_IF_ERROR(a.head_dim == 64 ? launch(mmaAttentionKernel<64>, 64)
                                                 : launch(mmaAttentionKernel<128>, 128));
  return okStatus();
}

}  // namespace bulkhead::cuda
