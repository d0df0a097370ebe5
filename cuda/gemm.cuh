// Our matrix multiply for every product of a step: y[m][n] = sum_k x[m][k] * w[n][k], bf16 in,
// fp32 out, on the tensor cores (mma.sync m16n8k16). A row's result is the same whatever the
// number of rows, by construction rather than by observation: each output element is one fixed
// sequence of operations that depends on the shape (n, k) alone. The weight rows go on the
// instruction's 16-row side and the tokens on its 8-column side, so a decode step of one token
// wastes only token columns, not weight bandwidth; k is split over the warps of a cluster of
// blocks in a fixed interleave (gemmSplits blocks, from the shape alone) and their sums are added
// in a fixed order. Any number of rows, any n, k a multiple of 8; x, w 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cuda/step_checks.cuh"
#include "shared/mix.h"
#include "shared/status.h"

namespace bulkhead::cuda {

// The in-step fold of a product's weight words runs on the tensor cores, beside the product: the
// weight fragments the kernel already holds go through an integer mma (u8 x u8 -> s32, wrapping)
// against a constant key matrix of 32 k positions by 8 columns, so a word costs no integer
// instruction. Column 0's keys are all 1 (a plain sum of the bytes, which any flipped bit
// changes); the others are even and keyed by position. At the end each accumulator is weighted
// by its weight row and column and the weight's salt:
//   fold = sum over rows R, bytes o of the row: (2R + 1) * (2 salt + 1) * byte * Q(o mod 64)
// modulo 2^32, with Q(o) = sum_j (2j + 1) * key(j, p(o)) odd, so every single flipped bit, every
// pair of swapped rows and the right bytes read in another weight's role change it.
BULKHEAD_HOST_DEVICE constexpr uint32_t productFoldKey(uint32_t column, uint32_t p) {
  return column == 0 ? 1u : checksumTerm(column * 32 + p, 0x5bd1e995u) & 0xfeu;
}

// The mma k position (0..31) of byte o (0..63) of a 64-byte k block of a weight row: lane c of a
// group loads bytes 16c .. 16c + 15, as words x, y, z, w; x and z are fragment registers a0 of
// two mmas (positions 4c .. 4c + 3), y and w registers a2 (positions 16 + 4c ..).
BULKHEAD_HOST_DEVICE constexpr uint32_t productFoldPosition(uint32_t o) {
  return (o % 16 / 4 % 2 == 0 ? 0u : 16u) + 4 * (o / 16) + o % 4;
}

// What `rows` rows of k bf16 each (the weight's rows first_row onwards) fold to on the host.
uint32_t productFold(const std::byte* data, size_t rows, int k, uint32_t first_row, uint32_t salt);

// The in-step check of the weight words a product loads: every word is folded (productFold, the
// low 32 bits of the account's sum) into its weight's account, once per launch. w may hold up to
// three weights one after another (fused q/k/v, gate/up): weight s has rows [row_end[s - 1],
// row_end[s]), each boundary a multiple of 16.
struct GemmFold {
  int weights = 0;  // 0: nothing is folded
  FoldAccount* account[3] = {};
  uint32_t salt[3] = {};
  int row_end[3] = {};
};

// A product whose outputs go straight into the fp32 residual stream (the attention output's and
// the MLP's down product), instead of into y: x[r][j] += y[r][j], in the epilogue that stores
// them. The same epilogue keeps what the norm after it needs (cuda/norm_partials.cuh): each 16
// outputs' sum of squares of the updated x, in [row][ldp]; and the product's own side of the
// arithmetic check (produced, produced_sq of row r's ProductCheck), which it computes from the
// very values it adds.
struct GemmResidual {
  float* x = nullptr;  // null: store y
  int ldx = 0;
  float* partials = nullptr;
  int ldp = 0;
  ProductCheck* checks = nullptr;  // row r's checks at checks[r * roles + role]; null: none
  int roles = 0;
  int role = -1;
  // Fault injection (a faulty multiplier): output row * n + column has its highest exponent bit
  // flipped before it is used; -1: none.
  long long fault = -1;
  // Without x: each output also stored to rows_to[token][column] (device-visible pointers, such
  // as the logits rows' slots in the host-registered arena), so the rows cross PCIe while the
  // product runs rather than in a copy after it. Null: y only.
  float* const* rows_to = nullptr;
};

// A product whose input is the RMSNorm of the residual stream, normalised as its tokens load
// rather than read from a norm kernel's output (steps of 1 to 8 rows): input row r is
// bf16(weight[i] * (x[r][i] * inv_r)), inv_r from the row's norm partials (cuda/norm_partials.cuh)
// as the norm kernel takes it, so the same bits. More blocks (a check tile) add the norm's side of
// the checks: its consumers' expected and bound (one ConsumerSums a weight of the product, in
// row order, as GemmFold's weights) and the norm weight's fold, once a token row.
// Without x (the input is the bf16 x), consumers that name roles make the product add its own
// side of those checks from the tokens it multiplies (a check tile, any number of rows): what the
// kernel that wrote x would otherwise add. weight_fold must then be null.
struct GemmNormedInput {
  const float* x = nullptr;  // null: the input is the bf16 x
  int ldx = 0;
  const float* partials = nullptr;
  int ldp = 0;
  const __nv_bfloat16* weight = nullptr;  // k values
  float eps = 0;
  uint32_t weight_salt = 0;
  FoldAccount* weight_fold = nullptr;  // null: not folded
  ConsumerSums consumers[3];
  CheckView checks;
};
inline constexpr int kMaxNormedRows = 8;

// A product whose input is the MLP's activation, silu(gate) * up, computed as its tokens load
// from the gate/up product's fp32 output rather than read from the activation kernel's (steps of
// 1 to kMaxNormedRows rows): input row r is the activation kernel's very expression (cuda/
// activation.cu), so the same bits. More blocks (a check tile) add that kernel's side of the
// checks: the gate and up products' produced sums, and this product's expected and bound.
struct GemmActivatedInput {
  const float* gate_up = nullptr;  // [row][ld]: gate at [0, k), up at [k, 2k); null: bf16 x
  int ld = 0;
  int gate_role = -1, up_role = -1;  // -1: no check
  ConsumerSums consumer;             // this product's weight
  CheckView checks;
};

// How many blocks share each 16 weight rows' k blocks, from the weight's shape alone: enough
// blocks to keep the GPU's memory busy on a small weight, without splitting a long row thinner
// than 32 k blocks a block, nor past 256 blocks to fewer than 8 k blocks a warp.
int gemmSplits(int n, int k);

// When a warp issues its loads. All give every output the same sequence of operations (the same
// bits); a step uses its bucket's (kDefaultGemmSchedules unless asked otherwise), and
// `bulkhead bench-gemm` measures each against cuBLAS.
enum class GemmSchedule {
  kPlain,        // a round's loads, then its multiplies
  kPipelined,    // the next round's loads in flight while a round multiplies (half the unroll);
                 // over 64 rows (prefill) the token blocks of each weight tile are launched side
                 // by side, as kInterleaved's are, so the tile is read from memory once
  kTwoTiles,     // two weight tiles a warp, multiplied by each token fragment it loads (half the
                 // unroll): the tokens are read from the L2 cache half as often
  kInterleaved,  // plain's 32-row blocks for more than 32 rows, the token blocks of each weight
                 // tile launched side by side: the tile's second and later reads come from the
                 // L2 cache (plain for up to 32 rows)
  kPaired,       // pipelined's warps, two cells (weight tiles) a block of 256 threads: the warps
                 // of one lane in both read the same tokens at about the same time, so the later
                 // reads come from the L1 cache (9 to 64 rows; pipelined at others)
  kTiled,        // from kTiledFromRows rows, blocks of 64 weight rows by 64 tokens, both staged
                 // in shared memory two k blocks a stage (three stages in flight), each warp 32
                 // rows by 32 tokens, the k splits a cluster's blocks as in the other schedules
                 // (a product of bf16 tokens; others run plain); pipelined below, and where
                 // its blocks would be fewer than kTiledMinBlocks (a small weight)
};
inline constexpr int kTiledFromRows = 96;
// 64 x 64 blocks (times the k splits) a product needs for tiled; bench-gemm at 128 rows, H100:
// the 0.5B q/k/v (36 blocks) 13.6 us tiled against 7.3 pipelined, o (28) 13.6 against 6.7, down
// (112) 15.2 against 24.8. A forced split count (bench-gemm, tests) keeps tiled where asked.
inline constexpr int kTiledMinBlocks = 64;
inline constexpr GemmSchedule kGemmSchedules[] = {
    GemmSchedule::kPlain,       GemmSchedule::kPipelined, GemmSchedule::kTwoTiles,
    GemmSchedule::kInterleaved, GemmSchedule::kPaired,    GemmSchedule::kTiled};
// The schedule a step's products use, per bucket of rows (1-8, 9-16, 17-32, 33 or more: the
// kernel's token groups). Every schedule gives the same bits, so this choice changes speed only.
using GemmScheduleBuckets = std::array<GemmSchedule, 4>;
inline int gemmBucket(int rows) {
  return rows <= 8 ? 0 : rows <= 16 ? 1 : rows <= 32 ? 2 : 3;
}
// The fastest of each bucket in bench-engine on Qwen2.5 0.5B and 7B shapes (H100, cuda/
// PERFORMANCE.md): pipelined at 1-8 and 65-95 rows, plain at 17-32, tiled from 96 (large
// decode steps and prefill), and at 33-64 one by the weight's shape (gemmScheduleAt33To64);
// 9-16 not yet measured.
inline constexpr GemmScheduleBuckets kDefaultGemmSchedules = {
    GemmSchedule::kPipelined, GemmSchedule::kPlain, GemmSchedule::kPlain, GemmSchedule::kTiled};
// With the default buckets, steps of 33 to 64 rows run the schedule this gives for the weight's
// shape rather than the bucket's (the same bits: speed only). From `bench-gemm` at 64 rows on the
// Qwen2.5 0.5B and 7B shapes (H100, cuda/PERFORMANCE.md) and bench-engine at 40 to 64 rows: where
// k is split over blocks, paired (two cells a block, the tokens' second reads from the L1
// cache), or two tiles a warp when the weight has more rows than columns (the 7B's q/k/v); with
// one split, two tiles a warp on
// large weights (n of 8,192 and more: the token fragments read half as often), else plain's
// 32-row blocks side by side (interleaved: more blocks for a small weight).
GemmSchedule gemmScheduleAt33To64(int n, int k);

// "NAME" for every bucket, or four names, comma-separated, one a bucket: plain, pipelined,
// two_tiles, interleaved, paired, tiled.
Result<GemmScheduleBuckets> parseGemmSchedules(std::string_view text);

// A split count other than gemmSplits' for one weight shape (measurement: `bulkhead bench-engine
// --gemm-splits`): another fixed sum order for that shape, the same for every row count, so
// the rows keep their invariance but not their bits.
struct GemmSplitsFor {
  int n = 0, k = 0, splits = 0;
};
// "NxK=S[,NxK=S...]", S from 1 to 8.
Result<std::vector<GemmSplitsFor>> parseGemmSplits(std::string_view text);
// A schedule other than the bucket's for one weight shape in steps of 33 to kTiledFromRows - 1
// rows (measurement: `bulkhead bench-engine --gemm-shape-schedules`). Every schedule gives the
// same bits, so this changes speed only.
struct GemmScheduleFor {
  int n = 0, k = 0;
  GemmSchedule schedule = GemmSchedule::kPlain;
};
// "NxK=NAME[,NxK=NAME...]".
Result<std::vector<GemmScheduleFor>> parseGemmShapeSchedules(std::string_view text);

inline const char* gemmScheduleName(GemmSchedule s) {
  return s == GemmSchedule::kPlain         ? "plain"
         : s == GemmSchedule::kPipelined   ? "pipelined"
         : s == GemmSchedule::kTwoTiles    ? "two_tiles"
         : s == GemmSchedule::kInterleaved ? "interleaved"
         : s == GemmSchedule::kPaired      ? "paired"
                                           : "tiled";
}

// x: m x k row-major; w: n x k row-major (a checkpoint's linear layer); y: m rows of n floats,
// `ldy` apart (unused with a residual); x unused with a normed or activated input. Device memory,
// asynchronous on `stream`. splits: 0 takes gemmSplits(n, k), as every step does; 1 to 8 forces
// that many (another fixed sum order, still the same for every row count: for `bulkhead bench-gemm`
// to compare).
Status launchGemm(const __nv_bfloat16* x, int m, const __nv_bfloat16* w, int n, int k, float* y,
                  int ldy, cudaStream_t stream, const GemmFold& fold = {},
                  GemmSchedule schedule = GemmSchedule::kPlain, int splits = 0,
                  const GemmResidual& residual = {}, const GemmNormedInput& normed = {},
                  const GemmActivatedInput& activated = {});

}  // namespace bulkhead::cuda
