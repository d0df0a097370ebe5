// Our tensor-core product: every row of y is bit-identical whatever the number of rows (1 to 64,
// and prefill sizes past one tile), on the products of the Qwen2.5 0.5B and 7B models (fused
// q/k/v and gate/up included) and on ragged shapes; it computes the product (against double
// precision) and agrees with cuBLAS, its reference, to fp32 accumulation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemm.cuh"
#include "cuda/launch.cuh"
#include "cuda/matmul.cuh"
#include "cuda/rms_norm.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

struct Shape {
  int n, k;  // w is n x k: n outputs of k inputs
};

const Shape kShapes[] = {{896, 896},    {1152, 896},    {9728, 896},  {896, 4864},
                         {151936, 896}, {4608, 3584},   {3584, 3584}, {37888, 3584},
                         {3584, 18944}, {152064, 3584}, {128, 64},    {352, 64},
                         {64, 176},     {10, 24},       {33, 40},     {100, 4008}};
constexpr int kMaxRows = 300;  // from cuda::kTiledFromRows: the tiled schedule's own kernel

class GemmGpuTest : public testing::TestWithParam<Shape> {};

TEST_P(GemmGpuTest, RowsAreBitIdenticalForEveryRowCountAndMatchTheProduct) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [n, k] = GetParam();
  std::mt19937 rng{uint32_t(n * 31 + k)};
  std::normal_distribution<float> weight(0.0f, 0.05f), input(0.0f, 1.0f);
  std::vector<__nv_bfloat16> w(size_t(n) * k), x(size_t(kMaxRows) * k);
  for (auto& v : w) v = __float2bfloat16(weight(rng));
  for (auto& v : x) v = __float2bfloat16(input(rng));
  test::DeviceBuffer<__nv_bfloat16> dw(w), dx(x);
  test::DeviceBuffer<float> dy(size_t(kMaxRows) * n);
  auto product = [&](int m, cuda::GemmSchedule schedule = cuda::GemmSchedule::kPlain,
                     int splits = 0) {
    EXPECT_EQ(cudaMemset(dy.p, 0xff, size_t(kMaxRows) * n * 4), cudaSuccess);
    const Status s = cuda::launchGemm(dx.p, m, dw.p, n, k, dy.p, n, nullptr, {}, schedule, splits);
    EXPECT_TRUE(s.ok()) << s.toString();
    return dy.read(0, size_t(m) * n);
  };
  const std::vector<float> all = product(kMaxRows);

  test::expectMatchesProduct(all, x, w, n, k, {0, 63, 64, kMaxRows - 1});

  // Every row count from 1 to 64, then prefill sizes (the big shapes: a spread of them).
  const bool big = int64_t(n) * k > int64_t(20) << 20;
  std::vector<int> counts;
  for (int m = 1; m <= 64; ++m)
    if (!big || m <= 3 || m == 8 || m == 9 || m == 17 || m == 33 || m == 64) counts.push_back(m);
  for (int m : {65, cuda::kTiledFromRows - 1, cuda::kTiledFromRows, 257, kMaxRows})
    counts.push_back(m);
  // Every schedule gives the same bits.
  for (auto schedule : cuda::kGemmSchedules) {
    for (int m : counts) {
      const std::vector<float> part = product(m, schedule);
      for (int r = 0; r < m; ++r)
        ASSERT_EQ(
            std::memcmp(part.data() + size_t(r) * n, all.data() + size_t(r) * n, size_t(n) * 4), 0)
            << "row " << r << " of " << m << " differs from the same row of " << kMaxRows
            << " (shape " << n << "x" << k << ", schedule " << cuda::gemmScheduleName(schedule)
            << ")";
    }
  }
  // The tiled kernel itself on every shape: a small weight runs pipelined unless its split count
  // is forced (here the one it has anyway, so the same order).
  for (int m : counts) {
    if (m < cuda::kTiledFromRows) continue;
    const std::vector<float> part = product(m, cuda::GemmSchedule::kTiled, cuda::gemmSplits(n, k));
    ASSERT_EQ(std::memcmp(part.data(), all.data(), part.size() * 4), 0)
        << m << " rows through the tiled kernel differ (shape " << n << "x" << k << ")";
  }

  // Another split of k (bench-gemm's comparison): another order, still the product, and still
  // the same bits whatever the number of rows.
  if (!big) {
    for (int splits : {1, 2, 4, 8}) {
      const std::vector<float> split_all = product(kMaxRows, cuda::GemmSchedule::kPlain, splits);
      test::expectMatchesProduct(split_all, x, w, n, k, {0, kMaxRows - 1});
      for (auto schedule : cuda::kGemmSchedules) {
        for (int m : {1, 9, 64}) {
          const std::vector<float> part = product(m, schedule, splits);
          ASSERT_EQ(std::memcmp(part.data(), split_all.data(), part.size() * 4), 0)
              << m << " rows split over " << splits << " blocks (shape " << n << "x" << k
              << ", schedule " << cuda::gemmScheduleName(schedule) << ")";
        }
      }
    }
    EXPECT_FALSE(
        cuda::launchGemm(dx.p, 1, dw.p, n, k, dy.p, n, nullptr, {}, cuda::GemmSchedule::kPlain, 9)
            .ok());
  }

  // cuBLAS (no workspace), the reference: the same sums in another order.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    auto cublas = cuda::Matmul::create(stream);
    ASSERT_TRUE(cublas.ok()) << cublas.status().toString();
    ASSERT_TRUE((*cublas)->run(dx.p, kMaxRows, dw.p, n, k, dy.p, false).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  const std::vector<float> reference = dy.read(0, size_t(kMaxRows) * n);
  double worst = 0;
  for (size_t i = 0; i < all.size(); ++i)
    worst = std::max(worst, double(std::fabs(all[i] - reference[i])));
  EXPECT_LE(worst, 1e-3) << "largest difference from cuBLAS";
  RecordProperty("max_abs_difference_from_cublas", std::to_string(worst));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  EXPECT_FALSE(cuda::launchGemm(dx.p, 0, dw.p, n, k, dy.p, n, nullptr).ok());
  EXPECT_FALSE(cuda::launchGemm(dx.p, 1, dw.p, n, k + 1, dy.p, n, nullptr).ok());
}

// The fold of the weight words, on the tensor cores: what the kernel folds is what the host
// computes from the same bytes (every row count, split and weight boundary of a fused product),
// every word counted once a launch; one flipped bit in the weight changes it.
TEST_P(GemmGpuTest, FoldsEveryWeightWordAsTheHostDoes) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [n, k] = GetParam();
  if (int64_t(n) * k > int64_t(64) << 20) GTEST_SKIP() << "covered by the smaller shapes";
  std::mt19937 rng{uint32_t(n * 17 + k)};
  std::vector<__nv_bfloat16> w(size_t(n) * k), x(size_t(kMaxRows) * k);
  for (auto& v : w) v = __float2bfloat16(std::normal_distribution<float>(0.0f, 0.05f)(rng));
  for (auto& v : x) v = __float2bfloat16(std::normal_distribution<float>(0.0f, 1.0f)(rng));
  test::DeviceBuffer<__nv_bfloat16> dw(w), dx(x);
  test::DeviceBuffer<float> dy(size_t(kMaxRows) * n);
  test::DeviceBuffer<cuda::FoldAccount> accounts(3);
  // Two weights back to back where a tile boundary allows it, as fused q/k/v and gate/up are; the
  // boundary after an odd number of tiles, so that one block of two tiles holds rows of both.
  int split = n >= 32 ? n / 32 * 16 : n;
  if (split < n && split / 16 % 2 == 0 && split + 16 < n) split += 16;
  cuda::GemmFold fold;
  fold.weights = split < n ? 2 : 1;
  fold.row_end[0] = split;
  fold.row_end[1] = n;
  fold.salt[0] = 0x1234567u;
  fold.salt[1] = 0x89abcdeu;
  for (int s = 0; s < 2; ++s) fold.account[s] = accounts.p + s;
  const auto* bytes = reinterpret_cast<const std::byte*>(w.data());
  const uint32_t want[2] = {
      cuda::productFold(bytes, size_t(split), k, 0, fold.salt[0]),
      cuda::productFold(bytes + size_t(split) * k * 2, size_t(n - split), k, 0, fold.salt[1])};
  for (auto schedule : cuda::kGemmSchedules) {
    for (int m : {1, 7, 9, 33, 64, 130, kMaxRows}) {
      // The split a step uses, and the extremes (a cluster of 8 adds its blocks' folds).
      const int splits = m == 7 ? 1 : m == 33 ? 8 : 0;
      ASSERT_EQ(cudaMemset(accounts.p, 0, 3 * sizeof(cuda::FoldAccount)), cudaSuccess);
      const Status s =
          cuda::launchGemm(dx.p, m, dw.p, n, k, dy.p, n, nullptr, fold, schedule, splits);
      ASSERT_TRUE(s.ok()) << s.toString();
      const std::vector<cuda::FoldAccount> got = accounts.read();
      for (int i = 0; i < fold.weights; ++i) {
        const uint64_t rows = uint64_t(i == 0 ? split : n - split);
        EXPECT_EQ(uint32_t(got[size_t(i)].sum()), want[i])
            << "weight " << i << ", " << m << " rows, schedule "
            << cuda::gemmScheduleName(schedule);
        EXPECT_EQ(got[size_t(i)].words(), rows * uint64_t(k / 2))
            << "weight " << i << ", " << m << " rows, schedule "
            << cuda::gemmScheduleName(schedule);
      }
    }
  }
  // One bit of one word, low in a mantissa, where the arithmetic check cannot see it.
  std::vector<__nv_bfloat16> flipped = w;
  reinterpret_cast<uint8_t*>(flipped.data())[size_t(n - 1) * k * 2 + 3] ^= 1;
  test::DeviceBuffer<__nv_bfloat16> dflipped(flipped);
  for (auto schedule : cuda::kGemmSchedules) {
    ASSERT_EQ(cudaMemset(accounts.p, 0, 3 * sizeof(cuda::FoldAccount)), cudaSuccess);
    ASSERT_TRUE(cuda::launchGemm(dx.p, 1, dflipped.p, n, k, dy.p, n, nullptr, fold, schedule).ok());
    EXPECT_NE(uint32_t(accounts.read()[size_t(fold.weights - 1)].sum()), want[fold.weights - 1])
        << "schedule " << cuda::gemmScheduleName(schedule);
  }
}

// Launched programmatically after the kernel that writes its tokens (an RMSNorm, as in a step),
// the product may start while that kernel runs: it must still read the tokens that kernel wrote,
// in every schedule (its weights may load before the wait; its tokens may not). Repeated, since a
// load issued too early shows only when the two kernels overlap.
TEST(GemmProgrammatic, ReadsTheTokensTheKernelBeforeWroteInEverySchedule) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  if (!cuda::programmaticLaunchSupported()) GTEST_SKIP() << "no programmatic launch here";
  const int n = 4608, k = 3584;
  std::mt19937 rng{5};
  std::vector<__nv_bfloat16> w(size_t(n) * k), ones(size_t(k), __float2bfloat16(1.0f));
  std::vector<float> x(size_t(kMaxRows) * k);
  for (auto& v : w) v = __float2bfloat16(std::normal_distribution<float>(0.0f, 0.05f)(rng));
  for (auto& v : x) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  test::DeviceBuffer<__nv_bfloat16> dw(w), norm_weight(ones), tokens(size_t(kMaxRows) * k);
  test::DeviceBuffer<float> dx(x), dy(size_t(kMaxRows) * n);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto run = [&](int m, cuda::GemmSchedule schedule) {
    EXPECT_EQ(cudaMemsetAsync(tokens.p, 0, size_t(kMaxRows) * k * 2, stream), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(dy.p, 0xff, size_t(kMaxRows) * n * 4, stream), cudaSuccess);
    Status s = cuda::launchRmsNorm(dx.p, m, k, norm_weight.p, 1e-6f, tokens.p, stream);
    if (s.ok()) s = cuda::launchGemm(tokens.p, m, dw.p, n, k, dy.p, n, stream, {}, schedule);
    EXPECT_TRUE(s.ok()) << s.toString();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return dy.read(0, size_t(m) * n);
  };
  for (int m : {1, 64, kMaxRows}) {
    const std::vector<float> want = run(m, cuda::GemmSchedule::kPlain);  // launched in order
    cuda::setProgrammaticLaunch(stream, true);
    for (auto schedule : cuda::kGemmSchedules) {
      for (int repeat = 0; repeat < 20; ++repeat)
        ASSERT_EQ(std::memcmp(run(m, schedule).data(), want.data(), want.size() * 4), 0)
            << m << " rows, schedule " << cuda::gemmScheduleName(schedule) << ", repeat " << repeat;
    }
    cuda::setProgrammaticLaunch(stream, false);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The schedules a step's products use, per bucket of rows (no device needed).
TEST(GemmSchedules, OneNameForEveryBucketOrOneABucket) {
  auto all = cuda::parseGemmSchedules("two_tiles");
  ASSERT_TRUE(all.ok()) << all.status().toString();
  for (const cuda::GemmSchedule s : *all) EXPECT_EQ(s, cuda::GemmSchedule::kTwoTiles);
  auto interleaved = cuda::parseGemmSchedules("interleaved");
  ASSERT_TRUE(interleaved.ok()) << interleaved.status().toString();
  EXPECT_EQ((*interleaved)[3], cuda::GemmSchedule::kInterleaved);
  auto tiled = cuda::parseGemmSchedules("pipelined,plain,tiled,tiled");
  ASSERT_TRUE(tiled.ok()) << tiled.status().toString();
  EXPECT_EQ((*tiled)[2], cuda::GemmSchedule::kTiled);
  EXPECT_EQ((*tiled)[3], cuda::GemmSchedule::kTiled);
  for (const cuda::GemmSchedule s : cuda::kGemmSchedules) {
    auto named = cuda::parseGemmSchedules(cuda::gemmScheduleName(s));
    ASSERT_TRUE(named.ok()) << named.status().toString();
    EXPECT_EQ((*named)[0], s) << "each schedule's name reads back as it";
  }
  auto each = cuda::parseGemmSchedules("plain,pipelined,two_tiles,plain");
  ASSERT_TRUE(each.ok()) << each.status().toString();
  EXPECT_EQ((*each)[0], cuda::GemmSchedule::kPlain);
  EXPECT_EQ((*each)[1], cuda::GemmSchedule::kPipelined);
  EXPECT_EQ((*each)[2], cuda::GemmSchedule::kTwoTiles);
  EXPECT_EQ((*each)[3], cuda::GemmSchedule::kPlain);
  EXPECT_EQ(cuda::gemmBucket(1), 0);
  EXPECT_EQ(cuda::gemmBucket(8), 0);
  EXPECT_EQ(cuda::gemmBucket(9), 1);
  EXPECT_EQ(cuda::gemmBucket(32), 2);
  EXPECT_EQ(cuda::gemmBucket(33), 3);
  for (const char* bad : {"", "fast", "plain,pipelined", "plain,,two_tiles,plain",
                          "plain,pipelined,two_tiles,plain,plain"}) {
    const auto parsed = cuda::parseGemmSchedules(bad);
    EXPECT_FALSE(parsed.ok()) << "\"" << bad << "\" was accepted";
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find("schedule"), std::string::npos)
          << parsed.status().toString();
    }
  }
}

// Steps of 33 to 64 rows take the schedule from the weight's shape (no device needed): the
// choices bench-gemm and bench-engine measured fastest on the Qwen2.5 shapes.
TEST(GemmSchedules, ThirtyThreeToSixtyFourRowsTakeTheScheduleOfTheShape) {
  using S = cuda::GemmSchedule;
  struct Case {
    int n, k;
    S want;
  };
  const Case cases[] = {
      {1152, 896, S::kInterleaved}, {896, 896, S::kInterleaved},   // 0.5B q/k/v, o: one split
      {9728, 896, S::kTwoTiles},    {151936, 896, S::kTwoTiles},   // gate/up, lm_head
      {896, 4864, S::kPaired},                                     // down: k split
      {4608, 3584, S::kTwoTiles},   {3584, 3584, S::kPaired},      // 7B q/k/v, o: k split
      {37888, 3584, S::kTwoTiles},  {152064, 3584, S::kTwoTiles},  // gate/up, lm_head
      {3584, 18944, S::kPaired}};                                  // down
  for (const Case& c : cases)
    EXPECT_EQ(cuda::gemmScheduleAt33To64(c.n, c.k), c.want)
        << c.n << "x" << c.k << " (" << cuda::gemmSplits(c.n, c.k) << " splits)";
}

// Split counts and schedules for some shapes, as bench-engine --gemm-splits and
// --gemm-shape-schedules read them (no device needed).
TEST(GemmSchedules, SplitCountsAndSchedulesReadAsShapeAndValue) {
  auto two = cuda::parseGemmSplits("896x4864=8,896x896=2");
  ASSERT_TRUE(two.ok()) << two.status().toString();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0].n, 896);
  EXPECT_EQ((*two)[0].k, 4864);
  EXPECT_EQ((*two)[0].splits, 8);
  EXPECT_EQ((*two)[1].k, 896);
  EXPECT_EQ((*two)[1].splits, 2);
  for (const char* bad : {"", "896x896", "896x896=0", "896x896=9", "896*896=2", "896x896=2,",
                          "896x896=2x", "-1x896=2"})
    EXPECT_FALSE(cuda::parseGemmSplits(bad).ok()) << bad;
  auto named = cuda::parseGemmShapeSchedules("37888x3584=plain,4608x3584=two_tiles");
  ASSERT_TRUE(named.ok()) << named.status().toString();
  ASSERT_EQ(named->size(), 2u);
  EXPECT_EQ((*named)[0].n, 37888);
  EXPECT_EQ((*named)[0].schedule, cuda::GemmSchedule::kPlain);
  EXPECT_EQ((*named)[1].k, 3584);
  EXPECT_EQ((*named)[1].schedule, cuda::GemmSchedule::kTwoTiles);
  for (const char* bad : {"", "37888x3584=", "37888x3584=fast", "37888x3584=plain,", "x3584=plain"})
    EXPECT_FALSE(cuda::parseGemmShapeSchedules(bad).ok()) << bad;
}

// The host side of the fold (no device needed): every single flipped bit of a weight changes it,
// and so do two rows swapped and another weight's salt.
TEST(ProductFold, SeesEveryFlippedBitSwappedRowsAndAnotherSalt) {
  const int rows = 4, k = 40;  // a partial last k block
  std::vector<uint8_t> w(size_t(rows) * k * 2);
  std::mt19937 rng{3};
  for (auto& b : w) b = uint8_t(rng());
  auto fold = [&](uint32_t salt) {
    return cuda::productFold(reinterpret_cast<const std::byte*>(w.data()), rows, k, 5, salt);
  };
  const uint32_t clean = fold(77);
  for (size_t bit = 0; bit < 8 * w.size(); ++bit) {
    w[bit / 8] ^= uint8_t(1 << (bit % 8));
    EXPECT_NE(fold(77), clean) << "bit " << bit;
    w[bit / 8] ^= uint8_t(1 << (bit % 8));
  }
  EXPECT_NE(fold(78), clean);
  std::swap_ranges(w.begin(), w.begin() + k * 2, w.begin() + k * 2);
  EXPECT_NE(fold(77), clean);
}

// A weight's fold computed over ranges of its rows (as a worker's start spreads it over its cores)
// adds up, modulo 2^32, to the fold of the whole weight.
TEST(ProductFold, RangesOfRowsAddUpToTheWhole) {
  const int rows = 37, k = 72;
  std::vector<uint8_t> w(size_t(rows) * k * 2);
  std::mt19937 rng{4};
  for (auto& b : w) b = uint8_t(rng());
  const auto* data = reinterpret_cast<const std::byte*>(w.data());
  const uint32_t whole = cuda::productFold(data, rows, k, 0, 91);
  for (int range : {1, 5, 16, 36}) {
    uint32_t sum = 0;
    for (int r = 0; r < rows; r += range)
      sum += cuda::productFold(data + size_t(r) * k * 2, size_t(std::min(range, rows - r)), k,
                               uint32_t(r), 91);
    EXPECT_EQ(sum, whole) << "ranges of " << range << " rows";
  }
}

INSTANTIATE_TEST_SUITE_P(ModelShapes, GemmGpuTest, testing::ValuesIn(kShapes),
                         [](const testing::TestParamInfo<Shape>& i) {
                           return std::to_string(i.param.n) + "x" + std::to_string(i.param.k);
                         });

}  // namespace
}  // namespace bulkhead
