// The RMSNorm's sum of squares, kept in parts by the kernels that write the residual stream: for
// every row, one partial per 16 consecutive elements (a "norm tile"), each the same fixed tree of
// the 16 squares, so that the norm after them only adds the row's partials up, in a fixed order,
// and never waits on a reduction of its own. The residual's writers are the embedding and the
// products with a residual epilogue (cuda/gemm.cuh GemmResidual); whoever writes a tile, its
// partial is the same bits, and the row's sum depends on the row alone.
#pragma once

#include <cuda_runtime.h>

namespace bulkhead::cuda {

constexpr int kNormTile = 16;

// Partials a row of `hidden` elements has.
__host__ __device__ inline constexpr int normTiles(int hidden) {
  return (hidden + kNormTile - 1) / kNormTile;
}

#ifdef __CUDACC__

// One norm tile's partial from its 16 squares (0 past the row's end), as 16 lanes of a warp get
// it from a butterfly of offsets 8, 4, 2, 1 (each lane adding the other lane's value to its
// own): the tree the product epilogue runs with shuffles, computed here in one thread.
__device__ inline float normTilePartial(const float (&squares)[kNormTile]) {
  float s[kNormTile];
#pragma unroll
  for (int j = 0; j < kNormTile; ++j) s[j] = squares[j];
#pragma unroll
  for (int offset = kNormTile / 2; offset > 0; offset /= 2) {
    float t[kNormTile];
#pragma unroll
    for (int j = 0; j < kNormTile; ++j) t[j] = __fadd_rn(s[j], s[j ^ offset]);
#pragma unroll
    for (int j = 0; j < kNormTile; ++j) s[j] = t[j];
  }
  return s[0];
}

// The same tree over 16 lanes of a warp (lanes 16h .. 16h + 15 one tile): every lane of the warp
// must reach it, and every lane of a tile gets the tile's partial.
__device__ inline float normTilePartialOfLanes(float square) {
#pragma unroll
  for (int offset = kNormTile / 2; offset > 0; offset /= 2)
    square = __fadd_rn(square, __shfl_xor_sync(0xffffffffu, square, offset));
  return square;
}

// A row's sum of squares from its `count` partials: lane l adds partials l, l + 32, ... in order,
// then the warp's butterfly. Every lane of the warp must reach it; all get the same bits.
__device__ inline float rowSumOfSquares(const float* partials, int count) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
  for (int p = lane; p < count; p += 32) s = __fadd_rn(s, partials[p]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
  return s;
}

#endif

}  // namespace bulkhead::cuda
