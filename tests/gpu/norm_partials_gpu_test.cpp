// The residual stream's norm partials (cuda/norm_partials.cuh): a product's residual epilogue adds
// exactly its outputs into the stream, keeps each norm tile's partial and its own check sums, and
// flips the armed fault; the embedding keeps the same partials of the rows it writes; a norm from
// partials gives what their fixed order gives. The host recomputes every fixed order bit for bit
// (IEEE float, no contraction).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/activation.cuh"
#include "cuda/embedding.cuh"
#include "cuda/gemm.cuh"
#include "cuda/norm_partials.cuh"
#include "cuda/rms_norm.cuh"
#include "cuda/step_checks.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace bulkhead {
namespace {

// One tile's partial: the squares, then the butterfly of offsets 8, 4, 2, 1 (lane 0's result).
float hostTilePartial(const float* v, int count) {
  float s[cuda::kNormTile];
  for (int j = 0; j < cuda::kNormTile; ++j) s[j] = j < count ? v[j] * v[j] : 0.0f;
  for (int offset = cuda::kNormTile / 2; offset > 0; offset /= 2) {
    float t[cuda::kNormTile];
    for (int j = 0; j < cuda::kNormTile; ++j) t[j] = s[j] + s[j ^ offset];
    std::memcpy(s, t, sizeof(s));
  }
  return s[0];
}

std::vector<float> hostPartials(const float* row, int hidden) {
  std::vector<float> out;
  for (int t = 0; t < cuda::normTiles(hidden); ++t)
    out.push_back(hostTilePartial(row + t * cuda::kNormTile,
                                  std::min(cuda::kNormTile, hidden - t * cuda::kNormTile)));
  return out;
}

// A row's sum from its partials: 32 lanes in order, then the warp's butterfly.
float hostRowSum(const std::vector<float>& partials) {
  float lane[32] = {};
  for (size_t p = 0; p < partials.size(); ++p) lane[p % 32] += partials[p];
  for (int offset = 16; offset > 0; offset /= 2) {
    float t[32];
    for (int l = 0; l < 32; ++l) t[l] = lane[l] + lane[l ^ offset];
    std::memcpy(lane, t, sizeof(lane));
  }
  return lane[0];
}

uint32_t bitsOf(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

float withTopExponentBitFlipped(float v) {
  const uint32_t b = bitsOf(v) ^ 0x40000000u;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The launches a computed-input test compares: every schedule at the shape's own splits, and
// the one in use also split over 4 and 8 blocks (another sum order: its reference goes through
// the same splits).
struct ScheduleRun {
  cuda::GemmSchedule schedule;
  int splits;
  std::string name() const {
    return std::string(cuda::gemmScheduleName(schedule)) + ", splits " + std::to_string(splits);
  }
};
std::vector<ScheduleRun> scheduleRuns() {
  std::vector<ScheduleRun> runs;
  for (const cuda::GemmSchedule schedule : cuda::kGemmSchedules) runs.push_back({schedule, 0});
  runs.push_back({cuda::GemmSchedule::kPlain, 4});
  runs.push_back({cuda::GemmSchedule::kPlain, 8});
  return runs;
}

struct ResidualCase {
  int n, k, rows, splits;
};

void PrintTo(const ResidualCase& c, std::ostream* os) {
  *os << c.n << "x" << c.k << ", " << c.rows << " rows, splits " << c.splits;
}

class ResidualEpilogue : public testing::TestWithParam<ResidualCase> {};

TEST_P(ResidualEpilogue, AddsItsOutputsWithTheirPartialsChecksAndFault) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto [n, k, rows, splits] = GetParam();
  std::mt19937 rng{uint32_t(n + 7 * k + rows)};
  std::normal_distribution<float> weight(0.0f, 0.05f), value(0.0f, 1.0f);
  std::vector<__nv_bfloat16> w(size_t(n) * k), x(size_t(rows) * k);
  for (auto& v : w) v = __float2bfloat16(weight(rng));
  for (auto& v : x) v = __float2bfloat16(value(rng));
  const int ldx = n + 3, ldp = cuda::normTiles(n) + 1, roles = 2, role = 1;
  std::vector<float> residual(size_t(rows) * ldx);
  for (auto& v : residual) v = value(rng);
  test::DeviceBuffer<__nv_bfloat16> dw(w), dx(x);
  test::DeviceBuffer<float> dy(size_t(rows) * n);
  ASSERT_TRUE(cuda::launchGemm(dx.p, rows, dw.p, n, k, dy.p, n, nullptr, {},
                               cuda::GemmSchedule::kPlain, splits)
                  .ok());
  const std::vector<float> y = dy.read();
  // The fault on an output below 1 in magnitude, so that the flipped exponent bit makes it large
  // and finite (from [1, 2) it would be a NaN, whose payload the host's add keeps and the
  // device's does not).
  long long faulted = (long long)(rows - 1) * n + n / 2;
  while (std::fabs(y[size_t(faulted)]) >= 1.0f) faulted = (faulted + 1) % (long long)y.size();
  for (const long long fault : {-1LL, faulted}) {
    test::DeviceBuffer<float> stream(residual), partials(size_t(rows) * ldp);
    test::DeviceBuffer<cuda::ProductCheck> checks(size_t(rows) * roles);
    ASSERT_EQ(cudaMemset(checks.p, 0, checks.n * sizeof(cuda::ProductCheck)), cudaSuccess);
    cuda::GemmResidual r;
    r.x = stream.p;
    r.ldx = ldx;
    r.partials = partials.p;
    r.ldp = ldp;
    r.checks = checks.p;
    r.roles = roles;
    r.role = role;
    r.fault = fault;
    for (const cuda::GemmSchedule schedule : cuda::kGemmSchedules) {
      // Each schedule adds once into a fresh copy of the stream.
      ASSERT_EQ(cudaMemcpy(stream.p, residual.data(), residual.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(checks.p, 0, checks.n * sizeof(cuda::ProductCheck)), cudaSuccess);
      const Status s =
          cuda::launchGemm(dx.p, rows, dw.p, n, k, nullptr, 0, nullptr, {}, schedule, splits, r);
      ASSERT_TRUE(s.ok()) << s.toString();
      const std::vector<float> got = stream.read(), got_partials = partials.read();
      const std::vector<cuda::ProductCheck> got_checks = checks.read();
      for (int t = 0; t < rows; ++t) {
        std::vector<float> want(residual.begin() + long(t) * ldx,
                                residual.begin() + long(t) * ldx + ldx);
        double produced = 0, produced_sq = 0;
        for (int j = 0; j < n; ++j) {
          float out = y[size_t(t) * n + j];
          if ((long long)t * n + j == fault) out = withTopExponentBitFlipped(out);
          want[size_t(j)] += out;
          produced += out;
          produced_sq += double(out) * out;
        }
        for (int j = 0; j < ldx; ++j)
          ASSERT_EQ(bitsOf(got[size_t(t) * ldx + j]), bitsOf(want[size_t(j)]))
              << "row " << t << ", output " << j << ", fault " << fault << ", "
              << cuda::gemmScheduleName(schedule);
        const std::vector<float> want_partials = hostPartials(want.data(), n);
        for (size_t p = 0; p < want_partials.size(); ++p)
          ASSERT_EQ(bitsOf(got_partials[size_t(t) * ldp + p]), bitsOf(want_partials[p]))
              << "row " << t << ", partial " << p;
        const cuda::ProductCheck& c = got_checks[size_t(t) * roles + role];
        EXPECT_NEAR(c.produced, produced, 1e-9 * (1 + std::fabs(produced))) << "row " << t;
        EXPECT_NEAR(c.produced_sq, produced_sq, 1e-9 * (1 + produced_sq)) << "row " << t;
        EXPECT_EQ(got_checks[size_t(t) * roles].produced, 0.0) << "another role's check";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ResidualEpilogue,
                         testing::Values(ResidualCase{896, 896, 1, 0},
                                         ResidualCase{896, 4864, 3, 0},
                                         ResidualCase{896, 896, 20, 0},
                                         ResidualCase{3584, 3584, 8, 0},
                                         ResidualCase{3584, 18944, 40, 0},
                                         ResidualCase{100, 64, 37, 1}, ResidualCase{100, 64, 9, 2},
                                         ResidualCase{33, 40, 70, 4}, ResidualCase{33, 40, 300, 2}),
                         [](const testing::TestParamInfo<ResidualCase>& info) {
                           const ResidualCase& c = info.param;
                           return std::to_string(c.n) + "x" + std::to_string(c.k) + "_rows" +
                                  std::to_string(c.rows) + "_splits" + std::to_string(c.splits);
                         });

// The embedding's partials are the tree of its rows' squares, and the norm from partials is the
// norm of that sum: the same bits as the host's, for rows that end inside a tile too.
TEST(NormPartials, EmbeddingKeepsThemAndTheNormUsesThem) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  for (const int hidden : {64, 200, 896, 3584}) {
    const int vocab = 50, rows = 9, ldp = cuda::normTiles(hidden) + 2;
    const float eps = 1e-6f;
    std::mt19937 rng{uint32_t(hidden)};
    std::normal_distribution<float> value(0.0f, 2.0f);
    std::vector<__nv_bfloat16> table(size_t(vocab) * hidden),
        norm_weight(static_cast<size_t>(hidden));
    for (auto& v : table) v = __float2bfloat16(value(rng));
    for (auto& v : norm_weight) v = __float2bfloat16(1.0f + 0.1f * value(rng));
    std::vector<uint32_t> tokens(rows);
    for (auto& t : tokens) t = rng() % vocab;
    test::DeviceBuffer<__nv_bfloat16> dtable(table), dweight(norm_weight),
        dout(size_t(rows) * hidden);
    test::DeviceBuffer<uint32_t> dtokens(tokens);
    test::DeviceBuffer<float> dx(size_t(rows) * hidden), dpartials(size_t(rows) * ldp);
    ASSERT_TRUE(cuda::launchEmbedding(dtable.p, hidden, dtokens.p, rows, dx.p, nullptr, nullptr, 0,
                                      dpartials.p, ldp)
                    .ok());
    cuda::RmsNormArgs norm;
    norm.x = dx.p;
    norm.rows = rows;
    norm.hidden = hidden;
    norm.weight = dweight.p;
    norm.eps = eps;
    norm.out = dout.p;
    norm.partials = dpartials.p;
    norm.partials_stride = ldp;
    // Into other out rows (the final norm's gather), one row skipped: each still normalised by
    // its own partials.
    std::vector<int> out_row(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) out_row[size_t(r)] = r == 3 ? -1 : rows - 1 - r;
    test::DeviceBuffer<int> dout_row(out_row);
    norm.out_row = dout_row.p;
    ASSERT_TRUE(cuda::launchRmsNorm(norm, nullptr).ok());
    const std::vector<float> x = dx.read(), partials = dpartials.read();
    const std::vector<__nv_bfloat16> out = dout.read();
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < hidden; ++i)
        ASSERT_EQ(x[size_t(r) * hidden + i],
                  __bfloat162float(table[size_t(tokens[size_t(r)]) * hidden + i]));
      const std::vector<float> want = hostPartials(x.data() + size_t(r) * hidden, hidden);
      for (size_t p = 0; p < want.size(); ++p)
        ASSERT_EQ(bitsOf(partials[size_t(r) * ldp + p]), bitsOf(want[p]))
            << "hidden " << hidden << ", row " << r << ", partial " << p;
      const float inv = 1.0f / std::sqrt(hostRowSum(want) / float(hidden) + eps);
      const int o = out_row[size_t(r)];
      for (int i = 0; i < hidden && o >= 0; ++i) {
        const float v = x[size_t(r) * hidden + i];
        const __nv_bfloat16 want_out =
            __float2bfloat16_rn(__bfloat162float(norm_weight[size_t(i)]) * (v * inv));
        uint16_t a, b;
        std::memcpy(&a, &want_out, 2);
        std::memcpy(&b, &out[size_t(o) * hidden + i], 2);
        ASSERT_EQ(a, b) << "hidden " << hidden << ", row " << r << ", element " << i;
      }
    }
  }
}

// A product of 1 to 8 rows that normalises its own tokens gives the rows the norm kernel's output
// gives the same product, in every schedule, and the norm's side of the checks: its consumers'
// expected and bound, and the norm weight's fold once a row.
TEST(NormedProduct, GivesTheNormKernelsRowsAndChecks) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int k, n, rows;
  };
  for (const Case cs :
       {Case{896, 1152, 1}, Case{896, 1152, 8}, Case{200, 96, 3}, Case{3584, 4608, 5}}) {
    const int k = cs.k, n = cs.n, rows = cs.rows, vocab = 40, ldp = cuda::normTiles(k);
    const int roles = 4, segments = 3, segment_rows = n / segments;  // n / 3: multiples of 16
    ASSERT_EQ(segment_rows % 16, 0);
    std::mt19937 rng{uint32_t(k + n + rows)};
    std::normal_distribution<float> value(0.0f, 1.0f);
    std::vector<__nv_bfloat16> table(size_t(vocab) * k), norm_weight(static_cast<size_t>(k)),
        w(size_t(n) * k);
    for (auto& v : table) v = __float2bfloat16(value(rng));
    for (auto& v : norm_weight) v = __float2bfloat16(1.0f + 0.1f * value(rng));
    for (auto& v : w) v = __float2bfloat16(0.05f * value(rng));
    std::vector<float> sums(size_t(2 * segments) * k);
    for (auto& v : sums) v = value(rng);
    std::vector<uint32_t> tokens(static_cast<size_t>(rows));
    for (auto& t : tokens) t = rng() % vocab;
    test::DeviceBuffer<__nv_bfloat16> dtable(table), dnorm(norm_weight), dw(w),
        dxn(size_t(rows) * k);
    test::DeviceBuffer<float> dsums(sums), dx(size_t(rows) * k), dpartials(size_t(rows) * ldp),
        dy(size_t(rows) * n);
    test::DeviceBuffer<uint32_t> dtokens(tokens);
    test::DeviceBuffer<cuda::ProductCheck> checks(size_t(rows) * roles);
    test::DeviceBuffer<cuda::FoldAccount> fold(1);
    ASSERT_TRUE(cuda::launchEmbedding(dtable.p, k, dtokens.p, rows, dx.p, nullptr, nullptr, 0,
                                      dpartials.p, ldp)
                    .ok());
    cuda::CheckView view{checks.p, roles, fold.p};
    cuda::ConsumerSums consumers[3];
    for (int s = 0; s < segments; ++s)
      consumers[s] = {1 + s, dsums.p + size_t(2 * s) * k, dsums.p + size_t(2 * s + 1) * k};
    auto clear = [&] {
      ASSERT_EQ(cudaMemset(checks.p, 0, checks.n * sizeof(cuda::ProductCheck)), cudaSuccess);
      ASSERT_EQ(cudaMemset(fold.p, 0, sizeof(cuda::FoldAccount)), cudaSuccess);
    };
    // The norm kernel, then the product of its output.
    clear();
    cuda::RmsNormArgs norm;
    norm.x = dx.p;
    norm.rows = rows;
    norm.hidden = k;
    norm.weight = dnorm.p;
    norm.weight_salt = 77;
    norm.weight_fold = 0;
    norm.eps = 1e-6f;
    norm.out = dxn.p;
    norm.partials = dpartials.p;
    norm.partials_stride = ldp;
    for (int s = 0; s < segments; ++s) norm.consumers[s] = consumers[s];
    norm.checks = view;
    ASSERT_TRUE(cuda::launchRmsNorm(norm, nullptr).ok());
    ASSERT_TRUE(cuda::launchGemm(dxn.p, rows, dw.p, n, k, dy.p, n, nullptr).ok());
    const std::vector<float> want_default = dy.read();
    const std::vector<cuda::ProductCheck> want_checks = checks.read();
    const cuda::FoldAccount want_fold = fold.read()[0];
    ASSERT_EQ(want_fold.words(), uint64_t(rows) * uint64_t(k / 2));
    cuda::GemmNormedInput normed;
    normed.x = dx.p;
    normed.ldx = k;
    normed.partials = dpartials.p;
    normed.ldp = ldp;
    normed.weight = dnorm.p;
    normed.eps = norm.eps;
    normed.weight_salt = norm.weight_salt;
    normed.weight_fold = fold.p;
    for (int s = 0; s < segments; ++s) normed.consumers[s] = consumers[s];
    normed.checks = view;
    for (const ScheduleRun& run : scheduleRuns()) {
      const auto [schedule, splits] = run;
      const std::string how =
          "k " + std::to_string(k) + ", " + std::to_string(rows) + " rows, " + run.name();
      std::vector<float> want = want_default;
      if (splits != 0) {
        ASSERT_TRUE(cuda::launchGemm(dxn.p, rows, dw.p, n, k, dy.p, n, nullptr, {},
                                     cuda::GemmSchedule::kPlain, splits)
                        .ok());
        want = dy.read();
      }
      clear();
      ASSERT_EQ(cudaMemset(dy.p, 0xff, dy.n * 4), cudaSuccess);
      const Status launched = cuda::launchGemm(nullptr, rows, dw.p, n, k, dy.p, n, nullptr, {},
                                               schedule, splits, {}, normed);
      ASSERT_TRUE(launched.ok()) << launched.toString();
      const std::vector<float> got = dy.read();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(bitsOf(got[i]), bitsOf(want[i])) << how << ": output " << i;
      const std::vector<cuda::ProductCheck> got_checks = checks.read();
      for (size_t i = 0; i < got_checks.size(); ++i) {
        const cuda::ProductCheck &a = got_checks[i], &b = want_checks[i];
        EXPECT_NEAR(a.expected, b.expected, 1e-9 * (1 + std::fabs(b.expected))) << how << " " << i;
        EXPECT_NEAR(a.bound, b.bound, 1e-9 * (1 + std::fabs(b.bound))) << how << " " << i;
        EXPECT_EQ(i % roles == 0, b.expected == 0.0) << "role 0 is no consumer's";
      }
      const cuda::FoldAccount got_fold = fold.read()[0];
      EXPECT_EQ(got_fold.sum(), want_fold.sum()) << how;
      EXPECT_EQ(got_fold.words(), want_fold.words()) << how;
    }
    // More rows than the normed products take are refused, not computed wrongly.
    if (rows == 8) {
      EXPECT_FALSE(cuda::launchGemm(nullptr, 9, dw.p, n, k, dy.p, n, nullptr, {},
                                    cuda::GemmSchedule::kPlain, 0, {}, normed)
                       .ok());
    }
  }
}

// A product of bf16 tokens that adds its own weights' side of the checks (a GemmNormedInput
// without x: the check tile) gives the same outputs as without, in every schedule, at 4 and 8
// splits, into y and into the residual, and each named consumer's expected sum and bound of
// every row: the column sums dotted with that row's inputs, as the host computes them in double.
TEST(TokenChecks, AProductAddsItsOwnExpectedSumsAndBounds) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int k, n, rows;
  };
  for (const Case cs :
       {Case{896, 1152, 1}, Case{896, 1152, 8}, Case{200, 96, 3}, Case{896, 4864, 33},
        Case{4864, 896, 64}, Case{3584, 4608, 100}, Case{200, 96, 300}}) {
    const int k = cs.k, n = cs.n, rows = cs.rows, roles = 4, segments = 3;
    std::mt19937 rng{uint32_t(3 * k + n + rows)};
    std::normal_distribution<float> value(0.0f, 1.0f);
    std::vector<__nv_bfloat16> x(size_t(rows) * k), w(size_t(n) * k);
    for (auto& v : x) v = __float2bfloat16(value(rng));
    for (auto& v : w) v = __float2bfloat16(0.05f * value(rng));
    std::vector<float> sums(size_t(2 * segments) * k);
    for (auto& v : sums) v = value(rng);
    test::DeviceBuffer<__nv_bfloat16> dx(x), dw(w);
    test::DeviceBuffer<float> dsums(sums), dy(size_t(rows) * n), dres(size_t(rows) * n),
        dpartials(size_t(rows) * cuda::normTiles(n));
    test::DeviceBuffer<cuda::ProductCheck> checks(size_t(rows) * roles);
    cuda::GemmNormedInput own;
    for (int s = 0; s < segments; ++s)
      own.consumers[s] = {1 + s, dsums.p + size_t(2 * s) * k, dsums.p + size_t(2 * s + 1) * k};
    own.checks = {checks.p, roles, nullptr};
    // What the host expects of row r, consumer s: expected, then bound.
    std::vector<double> want(size_t(rows) * segments * 2);
    for (int r = 0; r < rows; ++r)
      for (int s = 0; s < segments; ++s) {
        double e = 0, b = 0;
        for (int i = 0; i < k; ++i) {
          const double xi = __bfloat162float(x[size_t(r) * k + i]);
          e += double(sums[size_t(2 * s) * k + i]) * xi;
          b += double(sums[size_t(2 * s + 1) * k + i]) * std::fabs(xi);
        }
        want[(size_t(r) * segments + s) * 2] = e;
        want[(size_t(r) * segments + s) * 2 + 1] = b;
      }
    for (const ScheduleRun& run : scheduleRuns()) {
      const auto [schedule, splits] = run;
      for (const bool to_residual : {false, true}) {
        const std::string how = "k " + std::to_string(k) + ", n " + std::to_string(n) + ", " +
                                std::to_string(rows) + " rows, " + run.name() +
                                (to_residual ? ", residual" : "");
        cuda::GemmResidual residual;
        if (to_residual) {
          residual.x = dres.p;
          residual.ldx = n;
          residual.partials = dpartials.p;
          residual.ldp = cuda::normTiles(n);
        }
        auto reset = [&] {
          ASSERT_EQ(cudaMemset(dy.p, 0, dy.n * 4), cudaSuccess);
          ASSERT_EQ(cudaMemset(dres.p, 0, dres.n * 4), cudaSuccess);
          ASSERT_EQ(cudaMemset(checks.p, 0, checks.n * sizeof(cuda::ProductCheck)), cudaSuccess);
        };
        reset();
        ASSERT_TRUE(cuda::launchGemm(dx.p, rows, dw.p, n, k, dy.p, n, nullptr, {}, schedule, splits,
                                     residual)
                        .ok());
        const std::vector<float> plain = to_residual ? dres.read() : dy.read();
        reset();
        const Status launched = cuda::launchGemm(dx.p, rows, dw.p, n, k, dy.p, n, nullptr, {},
                                                 schedule, splits, residual, own);
        ASSERT_TRUE(launched.ok()) << how << ": " << launched.toString();
        const std::vector<float> got = to_residual ? dres.read() : dy.read();
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(bitsOf(got[i]), bitsOf(plain[i])) << how << ": output " << i;
        const std::vector<cuda::ProductCheck> got_checks = checks.read();
        for (int r = 0; r < rows; ++r) {
          EXPECT_EQ(got_checks[size_t(r) * roles].expected, 0.0) << how << ": role 0 is no one's";
          for (int s = 0; s < segments; ++s) {
            const cuda::ProductCheck& p = got_checks[size_t(r) * roles + 1 + s];
            const double e = want[(size_t(r) * segments + s) * 2],
                         b = want[(size_t(r) * segments + s) * 2 + 1];
            EXPECT_NEAR(p.expected, e, 1e-9 * (1 + std::fabs(b))) << how << ", row " << r;
            EXPECT_NEAR(p.bound, b, 1e-9 * (1 + std::fabs(b))) << how << ", row " << r;
            EXPECT_EQ(p.produced, 0.0) << how << ": only the expected side";
          }
        }
      }
    }
  }
  // With a computed input, or a fold of the norm's weight, it is refused.
  cuda::GemmNormedInput bad;
  bad.consumers[0] = {0, reinterpret_cast<const float*>(16), reinterpret_cast<const float*>(16)};
  bad.checks = {reinterpret_cast<cuda::ProductCheck*>(16), 1, nullptr};
  bad.weight_fold = reinterpret_cast<cuda::FoldAccount*>(16);
  EXPECT_FALSE(cuda::launchGemm(reinterpret_cast<const __nv_bfloat16*>(16), 1,
                                reinterpret_cast<const __nv_bfloat16*>(16), 16, 16,
                                reinterpret_cast<float*>(16), 16, nullptr, {},
                                cuda::GemmSchedule::kPlain, 0, {}, bad)
                   .ok());
}

// A product of 1 to 8 rows that computes the MLP's activation as it loads its tokens gives the
// rows the activation kernel's output gives the same product (plain and into the residual), in
// every schedule and at 4 and 8 splits, and that kernel's side of the checks: the gate and up
// products' produced sums, and this product's expected and bound.
TEST(ActivatedProduct, GivesTheActivationKernelsRowsAndChecks) {
  if (!test::haveDevice()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int inter, n, rows;
  };
  for (const Case cs :
       {Case{4864, 896, 1}, Case{4864, 896, 8}, Case{200, 48, 3}, Case{18944, 3584, 5}}) {
    const int k = cs.inter, n = cs.n, rows = cs.rows, roles = 4, gate_role = 1, up_role = 2,
              down_role = 3;
    std::mt19937 rng{uint32_t(k + n + rows)};
    std::normal_distribution<float> value(0.0f, 2.0f);
    std::vector<float> gate_up(size_t(rows) * 2 * k), sums(size_t(2) * k),
        residual(size_t(rows) * n);
    for (auto& v : gate_up) v = value(rng);
    for (auto& v : sums) v = value(rng);
    for (auto& v : residual) v = value(rng);
    std::vector<__nv_bfloat16> w(size_t(n) * k);
    for (auto& v : w) v = __float2bfloat16(0.02f * value(rng));
    test::DeviceBuffer<float> dgate_up(gate_up), dsums(sums), dy(size_t(rows) * n),
        dstream(residual), dpartials(size_t(rows) * cuda::normTiles(n));
    test::DeviceBuffer<__nv_bfloat16> dw(w), dact(size_t(rows) * k);
    test::DeviceBuffer<cuda::ProductCheck> checks(size_t(rows) * roles);
    const cuda::CheckView view{checks.p, roles, nullptr};
    const cuda::ConsumerSums down{down_role, dsums.p, dsums.p + k};
    auto clear = [&] {
      ASSERT_EQ(cudaMemset(checks.p, 0, checks.n * sizeof(cuda::ProductCheck)), cudaSuccess);
    };
    cuda::GemmResidual into;
    into.x = dstream.p;
    into.ldx = n;
    into.partials = dpartials.p;
    into.ldp = cuda::normTiles(n);
    // The activation kernel, then the products of its output (plain, then into the residual).
    clear();
    cuda::SiluMulArgs sa;
    sa.gate_up = dgate_up.p;
    sa.rows = rows;
    sa.inter = k;
    sa.out = dact.p;
    sa.gate_role = gate_role;
    sa.up_role = up_role;
    sa.down = down;
    sa.checks = view;
    ASSERT_TRUE(cuda::launchSiluMul(sa, nullptr).ok());
    const std::vector<cuda::ProductCheck> want_checks = checks.read();
    cuda::GemmActivatedInput activated{dgate_up.p, 2 * k, gate_role, up_role, down, view};
    for (const bool to_residual : {false, true}) {
      for (const ScheduleRun& run : scheduleRuns()) {
        const auto [schedule, splits] = run;
        const std::string how = "k " + std::to_string(k) + ", " + std::to_string(rows) + " rows, " +
                                run.name() + (to_residual ? ", residual" : "");
        auto reset = [&] {
          ASSERT_EQ(
              cudaMemcpy(dstream.p, residual.data(), residual.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
          ASSERT_EQ(cudaMemset(dy.p, 0xff, dy.n * 4), cudaSuccess);
        };
        reset();
        ASSERT_TRUE(cuda::launchGemm(dact.p, rows, dw.p, n, k, dy.p, n, nullptr, {}, schedule,
                                     splits, to_residual ? into : cuda::GemmResidual{})
                        .ok());
        const std::vector<float> want = to_residual ? dstream.read() : dy.read();
        reset();
        clear();
        const Status launched =
            cuda::launchGemm(nullptr, rows, dw.p, n, k, dy.p, n, nullptr, {}, schedule, splits,
                             to_residual ? into : cuda::GemmResidual{}, {}, activated);
        ASSERT_TRUE(launched.ok()) << launched.toString();
        const std::vector<float> got = to_residual ? dstream.read() : dy.read();
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(bitsOf(got[i]), bitsOf(want[i])) << how << ": output " << i;
        const std::vector<cuda::ProductCheck> got_checks = checks.read();
        for (size_t i = 0; i < got_checks.size(); ++i) {
          const cuda::ProductCheck &a = got_checks[i], &b = want_checks[i];
          for (const auto& [x, y] :
               {std::pair{a.produced, b.produced}, std::pair{a.produced_sq, b.produced_sq},
                std::pair{a.expected, b.expected}, std::pair{a.bound, b.bound}})
            EXPECT_NEAR(x, y, 1e-9 * (1 + std::fabs(y))) << how << ", check " << i;
        }
      }
    }
    EXPECT_FALSE(cuda::launchGemm(nullptr, 9, dw.p, n, k, dy.p, n, nullptr, {},
                                  cuda::GemmSchedule::kPlain, 0, {}, {}, activated)
                     .ok())
        << "9 rows";
  }
}

}  // namespace
}  // namespace bulkhead
