// verifyAndSample: verification faults, independence from threads and batch, agreement with a
// sort-based reference, sampling statistics, and pinned results that catch any arithmetic change.
#include "broker/row_sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include "broker/row_sampling_avx512.h"
#include "broker/vector_exp.h"
#include "shared/checksum.h"
#include "shared/mix.h"

namespace bulkhead {
namespace {

constexpr uint32_t kVocab = 152064;

// Logits in [-spread/2, spread/2) from splitmix64; `levels` > 0 quantises them (heavy ties).
std::vector<float> syntheticRow(uint64_t seed, uint32_t n, float spread, int levels = 0) {
  std::vector<float> row(n);
  for (uint32_t i = 0; i < n; ++i) {
    const double u = double(splitmix64(seed * 0x100000001b3ull + i) >> 11) * 0x1p-53;
    row[i] = levels > 0 ? float(std::floor(u * levels)) * spread / float(levels) - spread / 2
                        : float((u - 0.5) * spread);
  }
  return row;
}

// A full-size row as trained models give them: 16 likely tokens (10 to 13.75, at ids from
// splitmix64(first_id + j)) above a spread of unlikely ones.
std::vector<float> peakedRow(uint64_t seed, uint64_t first_id) {
  std::vector<float> row = syntheticRow(seed, kVocab, 8.0f);
  for (uint32_t j = 0; j < 16; ++j)
    row[splitmix64(first_id + j) % kVocab] = 10.0f + 0.25f * float(j);
  return row;
}

uint64_t checksumOf(const std::vector<float>& row) {
  return checksumBytes(std::as_bytes(std::span(row)));
}

RowToSample rowOf(const std::vector<float>& logits, const SamplingConfig* config,
                  uint64_t position = 0, std::span<const uint32_t> prompt = {},
                  std::span<const uint32_t> generated = {}) {
  return RowToSample{.logits = logits,
                     .expected_checksum = checksumOf(logits),
                     .config = config,
                     .prompt = prompt,
                     .generated = generated,
                     .position = position};
}

SampledRow sampleOne(WorkPool& pool, const RowToSample& row) {
  SampledRow out;
  verifyAndSample(pool, std::span(&row, 1), std::span(&out, 1));
  return out;
}

uint32_t floatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// The penalised logits, naively.
std::vector<float> adjustedLogits(const std::vector<float>& raw, const SamplingConfig& c,
                                  std::span<const uint32_t> prompt,
                                  std::span<const uint32_t> generated) {
  std::vector<float> a = raw;
  std::vector<uint32_t> counts(raw.size(), 0);
  for (uint32_t t : generated) ++counts[t];
  if (c.repetition_penalty != 1.0f) {
    auto penalise = [&](uint32_t t) {
      a[t] = raw[t] > 0 ? raw[t] / c.repetition_penalty : raw[t] * c.repetition_penalty;
    };
    for (uint32_t t : prompt) penalise(t);
    for (uint32_t t : generated) penalise(t);
  }
  for (uint32_t t = 0; t < raw.size(); ++t)
    if (counts[t] != 0) a[t] -= c.frequency_penalty * float(counts[t]) + c.presence_penalty;
  return a;
}

// The documented semantics with a full sort: the kept set, then the draw.
uint32_t referenceToken(const std::vector<float>& raw, const SamplingConfig& c, uint64_t position,
                        std::span<const uint32_t> prompt = {},
                        std::span<const uint32_t> generated = {}) {
  const std::vector<float> a = adjustedLogits(raw, c, prompt, generated);
  const uint32_t n = uint32_t(a.size());
  const float amax = *std::max_element(a.begin(), a.end());
  if (!(c.temperature > 0)) return uint32_t(std::find(a.begin(), a.end(), amax) - a.begin());
  const float inv_t = 1.0f / c.temperature;
  std::vector<float> e(n);
  std::vector<uint64_t> m(n);
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; ++i) {
    e[i] = exp1((a[i] - amax) * inv_t);
    m[i] = uint64_t(std::nearbyint(double(e[i]) * 0x1p40));
    total += m[i];
  }
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(),
            [&](uint32_t x, uint32_t y) { return e[x] > e[y] || (e[x] == e[y] && x < y); });
  uint32_t keep = c.top_k != 0 ? std::min(c.top_k, n) : n;
  if (c.top_p < 1.0f) {
    const uint64_t goal = uint64_t(std::ceil(double(c.top_p) * double(total)));
    uint64_t mass = 0;
    for (uint32_t i = 0; i < n; ++i) {
      mass += m[order[i]];
      if (mass >= goal) {
        keep = std::min(keep, i + 1);
        break;
      }
    }
  }
  if (c.min_p > 0) {
    const float floor = std::min(c.min_p, 1.0f);
    uint32_t above = 0;
    while (above < n && e[order[above]] >= floor) ++above;
    keep = std::min(keep, above);
  }
  std::vector<bool> kept(n, false);
  for (uint32_t i = 0; i < keep; ++i) kept[order[i]] = true;
  // One draw from the tokens `in`, in ascending id order.
  auto drawFrom = [&](const std::vector<bool>& in, uint32_t attempt) {
    uint64_t in_mass = 0;
    for (uint32_t i = 0; i < n; ++i)
      if (in[i]) in_mass += m[i];
    const uint64_t u = uint64_t(drawUniform(c.seed, position, attempt) * 0x1p53);
    const uint64_t target = uint64_t((unsigned __int128)u * in_mass >> 53);
    uint64_t running = 0;
    uint32_t last = 0;
    for (uint32_t i = 0; i < n; ++i) {
      if (!in[i]) continue;
      last = i;
      running += m[i];
      if (running > target) return i;
    }
    return last;
  };
  if (!(c.top_p < 1.0f)) return drawFrom(kept, 0);
  // Top-p: draws from the shrinking set of tokens before the last rejected one, then the kept set.
  std::vector<bool> candidates(n, true);
  for (uint32_t attempt = 0; attempt < 4; ++attempt) {
    const uint32_t t = drawFrom(candidates, attempt);
    if (kept[t]) return t;
    for (uint32_t i = 0; i < n; ++i) candidates[i] = e[i] > e[t] || (e[i] == e[t] && i < t);
  }
  return drawFrom(kept, 4);
}

double referenceLogprob(const std::vector<float>& raw, uint32_t t) {
  const float max = *std::max_element(raw.begin(), raw.end());
  double sum = 0;
  for (float v : raw) sum += std::exp(double(v) - double(max));
  return double(raw[t]) - double(max) - std::log(sum);
}

SamplingConfig temperature(float t, uint64_t seed = 11) {
  SamplingConfig c;
  c.temperature = t;
  c.seed = seed;
  return c;
}

TEST(VectorExp, MatchesTheLibraryWithinTwoUlp) {
  for (double x = -87.0; x <= 88.0; x += 0.01234) {
    const float got = exp1(float(x));
    const double want = std::exp(double(float(x)));
    EXPECT_LE(std::abs(got - want),
              2.5 * std::abs(std::nextafter(float(want), INFINITY) - float(want)))
        << "x = " << x;
  }
  EXPECT_EQ(exp1(0.0f), 1.0f);
  EXPECT_EQ(exp1(-100.0f), 0.0f);
  EXPECT_EQ(exp1(-INFINITY), 0.0f);
}

TEST(VerifyAndSample, FlippedBitNaNAndInfinityFailOnlyTheirRows) {
  WorkPool pool(3);
  const SamplingConfig cfg = temperature(0.8f);
  std::vector<std::vector<float>> logits;
  for (uint32_t r = 0; r < 6; ++r) logits.push_back(syntheticRow(r, r == 0 ? 5000 : 1000, 6));
  std::vector<RowToSample> rows;
  for (auto& l : logits) rows.push_back(rowOf(l, &cfg, 3));
  std::vector<SampledRow> clean(rows.size());
  verifyAndSample(pool, rows, clean);
  for (const SampledRow& s : clean) ASSERT_EQ(s.failed, IntegrityCheck::kNone);

  // Row 1: one payload bit flips after the header was written.
  uint32_t bits = floatBits(logits[1][77]) ^ 0x10;
  std::memcpy(&logits[1][77], &bits, 4);
  // Rows 2 and 3: a NaN and an infinity that the header's checksum covers.
  logits[2][999] = std::nanf("");
  rows[2].expected_checksum = checksumOf(logits[2]);
  logits[3][0] = -INFINITY;
  rows[3].expected_checksum = checksumOf(logits[3]);
  // Row 4: verify only, and clean.
  rows[4].config = nullptr;
  for (unsigned threads : {1u, 4u}) {
    WorkPool p(threads);
    std::vector<SampledRow> out(rows.size());
    verifyAndSample(p, rows, out);
    EXPECT_EQ(out[0].failed, IntegrityCheck::kNone);
    EXPECT_EQ(out[1].failed, IntegrityCheck::kPayloadChecksum);
    EXPECT_EQ(out[2].failed, IntegrityCheck::kNonFinite);
    EXPECT_EQ(out[3].failed, IntegrityCheck::kNonFinite);
    EXPECT_EQ(out[4].failed, IntegrityCheck::kNone);
    EXPECT_EQ(out[5].failed, IntegrityCheck::kNone);
    for (size_t r : {size_t(0), size_t(5)}) {
      EXPECT_EQ(out[r].choice.token, clean[r].choice.token);
      EXPECT_EQ(floatBits(out[r].choice.logprob), floatBits(clean[r].choice.logprob));
    }
  }
  // A wrong claimed checksum on a clean row, and an empty row that has to be sampled.
  RowToSample wrong = rowOf(logits[5], &cfg);
  wrong.expected_checksum ^= 1;
  EXPECT_EQ(sampleOne(pool, wrong).failed, IntegrityCheck::kPayloadChecksum);
  const std::vector<float> empty;
  EXPECT_EQ(sampleOne(pool, rowOf(empty, &cfg)).failed, IntegrityCheck::kRowLength);
}

TEST(VerifyAndSample, ChecksumIsTheSharedOneForEveryLengthAndAlignment) {
  WorkPool pool(2);
  for (uint32_t n : {1u, 7u, 8u, 9u, 4095u, 4096u, 4097u, 10001u}) {
    std::vector<float> backing = syntheticRow(n, n + 3, 10);
    for (uint32_t skew = 0; skew < 3; ++skew) {
      const std::span<const float> row(backing.data() + skew, n);
      RowToSample r = rowOf({}, nullptr);
      r.logits = row;
      r.expected_checksum = checksumBytes(std::as_bytes(row));
      EXPECT_EQ(sampleOne(pool, r).failed, IntegrityCheck::kNone) << n << " skew " << skew;
      r.expected_checksum += 1;
      EXPECT_EQ(sampleOne(pool, r).failed, IntegrityCheck::kPayloadChecksum);
    }
  }
}

// A mixed batch of 64 rows: every config kind, flat and peaked rows, ties, penalties.
struct Batch {
  std::vector<std::vector<float>> logits;
  std::vector<SamplingConfig> configs;
  std::vector<uint32_t> history = {5, 17, 17, 3000, 42, 151000, 5, 9};
  std::vector<RowToSample> rows;

  Batch() {
    logits.reserve(64);
    configs.resize(64);
    for (uint32_t r = 0; r < 64; ++r) {
      const uint32_t n = r % 4 == 3 ? 1000 + r : kVocab;
      logits.push_back(syntheticRow(100 + r, n, r % 3 == 0 ? 1.0f : 12.0f, r % 5 == 0 ? 8 : 0));
      SamplingConfig& c = configs[r];
      c.seed = r;
      c.temperature = r % 7 == 0 ? 0.0f : 0.8f;
      if (r % 6 == 1) c.top_p = 0.9f;
      if (r % 6 == 2) c.top_k = 40;
      if (r % 6 == 3) c.min_p = 0.05f;
      if (r % 6 == 4) c.top_p = 0.5f, c.top_k = 1000, c.min_p = 0.01f;
      if (r % 4 == 1) c.repetition_penalty = 1.3f, c.presence_penalty = 0.4f;
      if (r % 8 == 5) c.frequency_penalty = 0.3f, c.top_logprobs = 5;
    }
    for (uint32_t r = 0; r < 64; ++r) {
      const std::span<const uint32_t> h(history);
      rows.push_back(
          rowOf(logits[r], r % 9 == 8 ? nullptr : &configs[r], 1000 + r, h.first(3), h.subspan(3)));
    }
  }
};

void expectSame(const SampledRow& a, const SampledRow& b, const std::string& what) {
  EXPECT_EQ(a.failed, b.failed) << what;
  EXPECT_EQ(a.choice.token, b.choice.token) << what;
  EXPECT_EQ(floatBits(a.choice.logprob), floatBits(b.choice.logprob)) << what;
  ASSERT_EQ(a.choice.top.size(), b.choice.top.size()) << what;
  for (size_t i = 0; i < a.choice.top.size(); ++i) {
    EXPECT_EQ(a.choice.top[i].first, b.choice.top[i].first) << what;
    EXPECT_EQ(floatBits(a.choice.top[i].second), floatBits(b.choice.top[i].second)) << what;
  }
}

TEST(VerifyAndSample, ResultsIndependentOfThreadsAndBatch) {
  Batch batch;
  WorkPool serial(1);
  std::vector<SampledRow> want(64);
  verifyAndSample(serial, batch.rows, want);
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    WorkPool pool(threads);
    RowSampler sampler(pool);
    for (int repeat = 0; repeat < 2; ++repeat) {  // scratch reused between calls
      std::vector<SampledRow> got(64);
      sampler.verifyAndSample(batch.rows, got);
      for (size_t r = 0; r < 64; ++r)
        expectSame(got[r], want[r],
                   "batch, " + std::to_string(threads) + " threads, row " + std::to_string(r));
    }
    for (size_t r = 0; r < 64; r += 3) {
      SampledRow alone;
      sampler.verifyAndSample(std::span(&batch.rows[r], 1), std::span(&alone, 1));
      expectSame(alone, want[r],
                 "alone, " + std::to_string(threads) + " threads, row " + std::to_string(r));
      std::vector<SampledRow> few(3);
      sampler.verifyAndSample(std::span(batch.rows).subspan(r > 1 ? r - 2 : 0, 3), few);
      expectSame(few[r > 1 ? 2 : r], want[r], "among three, row " + std::to_string(r));
    }
  }
}

// The 16-lane loops (where the processor has AVX-512) and the 8-lane ones: the same results for
// every kind of row, and the same verdicts on damaged rows wherever the damage sits.
TEST(VerifyAndSample, WideAndNarrowVectorsGiveTheSameResults) {
  Batch batch;
  // Damage in the 16-lane part of a chunk, in its 8-lane rest and in its masked tail.
  std::vector<std::vector<float>> damaged;
  for (uint32_t at : {0u, 17u, 4090u, 4095u, 4101u, 10004u, 10006u}) {
    for (int kind = 0; kind < 3; ++kind) {
      damaged.push_back(syntheticRow(at + uint32_t(kind), 10007, 4.0f));
      if (kind == 0) damaged.back()[at] = std::nanf("");
      if (kind == 1) damaged.back()[at] = INFINITY;
    }
  }
  std::vector<RowToSample> rows = batch.rows;
  for (size_t i = 0; i < damaged.size(); ++i) {
    rows.push_back(rowOf(damaged[i], &batch.configs[i % 64], 7));
    if (i % 3 == 2) rows.back().expected_checksum ^= uint64_t(1) << (i % 64);
  }
  for (unsigned threads : {1u, 3u}) {
    WorkPool pool(threads);
    RowSampler wide(pool, true), narrow(pool, false);
    std::vector<SampledRow> a(rows.size()), b(rows.size());
    wide.verifyAndSample(rows, a);
    narrow.verifyAndSample(rows, b);
    for (size_t r = 0; r < rows.size(); ++r) {
      expectSame(a[r], b[r], std::to_string(threads) + " threads, row " + std::to_string(r));
      if (r < 64) continue;
      EXPECT_EQ(a[r].failed,
                (r - 64) % 3 == 2 ? IntegrityCheck::kPayloadChecksum : IntegrityCheck::kNonFinite)
          << "row " << r;
    }
  }
}

// The 16-lane weights and kept passes, value by value: every weight is exp8's bits (also where
// the result is subnormal or underflows) and the masses are the exact sums of round(e * 2^40).
TEST(VerifyAndSample, SixteenLanePassesGiveTheEightLaneWeightsAndExactMasses) {
  if (!RowSampler::sixteenLanes()) GTEST_SKIP() << "this processor has no AVX-512";
  // Far below -87.33 first, where the 16-lane exp relies on its zeroing alone (it has no
  // clamps); then every 89th float from -0 down to -88, and every one where e^x is subnormal or
  // near it.
  std::vector<float> x = {-89.0f, -104.0f, -1000.0f, -1e30f, -FLT_MAX, -INFINITY};
  for (uint32_t b = 0x80000000u; b <= 0xc2b00000u; b += 89) x.push_back(std::bit_cast<float>(b));
  for (uint32_t b = 0xc2a00000u; b <= 0xc2b00000u; ++b) x.push_back(std::bit_cast<float>(b));
  x.resize(x.size() / 16 * 16);
  std::vector<float> wide(x.size()), narrow(x.size());
  const avx512::WeightsTotals wide_totals =
      avx512::weightsSixteens(x.data(), wide.data(), uint32_t(x.size() / 16), 0.0f, 1.0f);
  uint64_t mass = 0;
  uint32_t max_key = 0;
  size_t differ = 0;
  for (size_t i = 0; i < x.size(); i += 8) {
    _mm256_storeu_ps(narrow.data() + i, exp8(_mm256_loadu_ps(x.data() + i)));
    for (size_t j = i; j < i + 8; ++j) {
      differ += std::bit_cast<uint32_t>(wide[j]) != std::bit_cast<uint32_t>(narrow[j]);
      mass += uint64_t(std::nearbyint(double(narrow[j]) * 0x1p40));
      max_key = std::max(max_key, std::bit_cast<uint32_t>(narrow[j]));
    }
  }
  EXPECT_EQ(differ, 0u) << "of " << x.size() << " weights";
  EXPECT_EQ(wide_totals.mass, mass);
  EXPECT_EQ(wide_totals.max_key, max_key) << "the largest weight's bits";
  EXPECT_EQ(max_key, std::bit_cast<uint32_t>(1.0f)) << "e^-0 is among them";
  // The kept pass over the same weights, cut at a key inside the range, ties by id.
  const uint32_t cut_key = std::bit_cast<uint32_t>(narrow[x.size() / 2]), cut_id = 1000;
  uint64_t kept_mass = 0;
  uint32_t kept = 0;
  for (uint32_t i = 0; i < x.size(); ++i) {
    const uint32_t key = std::bit_cast<uint32_t>(narrow[i]);
    if (key > cut_key || (key == cut_key && i <= cut_id)) {
      ++kept;
      kept_mass += uint64_t(std::nearbyint(double(narrow[i]) * 0x1p40));
    }
  }
  const avx512::KeptTotals totals =
      avx512::keptSixteens(wide.data(), uint32_t(x.size() / 16), 0, cut_key, cut_id);
  EXPECT_EQ(totals.count, kept);
  EXPECT_EQ(totals.mass, kept_mass);
}

TEST(VerifyAndSample, KeptSetsAndDrawsMatchASortBasedReference) {
  WorkPool pool(3);
  struct Case {
    uint32_t n;
    float spread;
    int levels;
  };
  const std::vector<Case> cases = {{kVocab, 1.0f, 0},
                                   {kVocab, 0.05f, 0},
                                   {kVocab, 4.0f, 3},
                                   {5000, 20.0f, 0},
                                   {5000, 6.0f, 2},
                                   {300, 0.0f, 0},
                                   {9, 3.0f, 0},
                                   {4097, 8.0f, 16},
                                   // Boundaries far below 2^-15, and among weights of 0.
                                   {5000, 60.0f, 0},
                                   {5000, 200.0f, 0}};
  std::vector<SamplingConfig> configs;
  for (float top_p : {1.0f, 0.9f, 0.3f, 1e-6f})
    for (uint32_t top_k : {0u, 1u, 40u, 2000u})
      for (float min_p : {0.0f, 0.05f, 0.9f}) {
        SamplingConfig c = temperature(0.8f);
        c.top_p = top_p, c.top_k = top_k, c.min_p = min_p;
        configs.push_back(c);
      }
  uint64_t position = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto logits = syntheticRow(k, cases[k].n, cases[k].spread, cases[k].levels);
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      // The near-flat full-size rows are slow to sort: fewer configs there.
      if (cases[k].n == kVocab && ci % 5 != 0) continue;
      for (int draw = 0; draw < 3; ++draw, ++position) {
        const SampledRow got = sampleOne(pool, rowOf(logits, &configs[ci], position));
        ASSERT_EQ(got.failed, IntegrityCheck::kNone);
        ASSERT_EQ(got.choice.token, referenceToken(logits, configs[ci], position))
            << "case " << k << " config " << ci << " position " << position;
        EXPECT_NEAR(got.choice.logprob, referenceLogprob(logits, got.choice.token), 1e-5);
      }
    }
  }
}

// Rows as trained models give them: a few likely tokens in a few chunks above a spread of
// unlikely ones, so the kept passes skip every chunk whose largest weight is below the cut. The
// draws are still the reference's.
TEST(VerifyAndSample, PeakedRowsMatchTheReference) {
  WorkPool pool(3);
  const std::vector<float> logits = peakedRow(11, 1000);
  uint64_t position = 0;
  for (float top_p : {1.0f, 0.9f, 0.5f})
    for (uint32_t top_k : {0u, 3u})
      for (float min_p : {0.0f, 0.2f}) {
        SamplingConfig c = temperature(0.8f);
        c.top_p = top_p, c.top_k = top_k, c.min_p = min_p;
        for (int draw = 0; draw < 4; ++draw, ++position) {
          const SampledRow got = sampleOne(pool, rowOf(logits, &c, position));
          ASSERT_EQ(got.failed, IntegrityCheck::kNone);
          ASSERT_EQ(got.choice.token, referenceToken(logits, c, position))
              << "top_p " << top_p << " top_k " << top_k << " min_p " << min_p << " position "
              << position;
        }
      }
}

// Rows that each run on one thread (as many rows as threads or more): there a top-p test stops
// reading once the token is sure to be kept, and goes through every chunk when it is rejected
// (the next draw needs the mass before it). Flat and peaked rows, tokens kept and rejected, with
// top_k and min_p: the reference's draws.
TEST(VerifyAndSample, RowModeTopPTestsMatchTheReference) {
  WorkPool pool(1);
  RowSampler sampler(pool);
  const std::vector<std::vector<float>> rows = {syntheticRow(13, kVocab, 1.0f), peakedRow(12, 2000),
                                                syntheticRow(14, 5000, 20.0f, 0)};
  uint64_t position = 0;
  int rejected = 0;
  for (const std::vector<float>& logits : rows)
    for (float top_p : {0.9f, 0.5f, 0.1f})
      for (uint32_t top_k : {0u, 3u, 60000u})
        for (float min_p : {0.0f, 0.2f}) {
          SamplingConfig c = temperature(0.8f);
          c.top_p = top_p, c.top_k = top_k, c.min_p = min_p;
          for (int draw = 0; draw < 3; ++draw, ++position) {
            const RowToSample row = rowOf(logits, &c, position);
            SampledRow got;
            sampler.verifyAndSample(std::span(&row, 1), std::span(&got, 1));
            ASSERT_EQ(got.failed, IntegrityCheck::kNone);
            const uint32_t want = referenceToken(logits, c, position);
            ASSERT_EQ(got.choice.token, want)
                << "n " << logits.size() << " top_p " << top_p << " top_k " << top_k << " min_p "
                << min_p << " position " << position;
            // The first draw (attempt 0) from every token, taken or not.
            SamplingConfig whole = c;
            whole.top_p = 1.0f, whole.top_k = 0, whole.min_p = 0.0f;
            rejected += referenceToken(logits, whole, position) != want;
          }
        }
  // Both outcomes of a test ran: tokens kept at once and tokens rejected.
  EXPECT_GT(rejected, 0);
  EXPECT_LT(rejected, int(position));
}

TEST(VerifyAndSample, PenalisedDrawsMatchTheReference) {
  WorkPool pool(2);
  const auto logits = syntheticRow(7, 20000, 3.0f);
  std::vector<uint32_t> prompt, generated;
  for (uint32_t i = 0; i < 300; ++i) prompt.push_back(uint32_t(splitmix64(i) % 20000));
  for (uint32_t i = 0; i < 200; ++i) generated.push_back(uint32_t(splitmix64(i + 999) % 400));
  SamplingConfig c = temperature(0.7f);
  c.repetition_penalty = 1.2f, c.presence_penalty = 0.3f, c.frequency_penalty = 0.2f;
  c.top_p = 0.8f;
  for (uint64_t pos = 0; pos < 40; ++pos) {
    const SampledRow got = sampleOne(pool, rowOf(logits, &c, pos, prompt, generated));
    EXPECT_EQ(got.choice.token, referenceToken(logits, c, pos, prompt, generated)) << pos;
  }
  c.temperature = 0;
  const SampledRow greedy = sampleOne(pool, rowOf(logits, &c, 0, prompt, generated));
  EXPECT_EQ(greedy.choice.token, referenceToken(logits, c, 0, prompt, generated));
}

// A positive repeated logit divided by a tiny repetition penalty overflows the float range: the
// penalised token must then be the one drawn (its adjusted logit is by far the largest), with or
// without top-p, not whatever a row of zero weights falls back to.
TEST(VerifyAndSample, ATinyRepetitionPenaltyMakesTheRepeatedTokenWin) {
  WorkPool pool(2);
  std::vector<float> logits = syntheticRow(5, 10000, 2.0f);
  logits[42] = 1.5f, logits[7] = -0.5f;
  const std::vector<uint32_t> prompt = {42, 7};
  for (const float top_p : {1.0f, 0.9f}) {
    for (const float penalty : {1e-38f, 1.4e-45f}) {
      SamplingConfig c = temperature(1.0f);
      c.top_p = top_p;
      c.repetition_penalty = penalty;
      for (uint64_t pos = 0; pos < 8; ++pos) {
        const SampledRow got = sampleOne(pool, rowOf(logits, &c, pos, prompt));
        ASSERT_EQ(got.failed, IntegrityCheck::kNone);
        EXPECT_EQ(got.choice.token, 42u) << "penalty " << penalty << ", top_p " << top_p;
      }
    }
  }
}

TEST(VerifyAndSample, GreedyIsTheFirstArgmax) {
  WorkPool pool(2);
  const SamplingConfig greedy;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    // Quantised rows: the maximum is shared by many tokens, the lowest id wins.
    auto logits = syntheticRow(seed, seed % 2 ? kVocab : 777, 5.0f, seed < 3 ? 4 : 0);
    const uint32_t want = uint32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const SampledRow got = sampleOne(pool, rowOf(logits, &greedy));
    EXPECT_EQ(got.choice.token, want);
    EXPECT_NEAR(got.choice.logprob, referenceLogprob(logits, want), 1e-5);
  }
}

// Greedy without logprobs or penalties keeps its argmax as it reads (no copy of the row): the
// first index of the max wherever the copies of the max sit (a chunk's 16-lane part, in either
// of its sets of maxima, the even vectors' and the odd ones', its 8-lane rest, its masked tail,
// later chunks), with 16 lanes and with 8.
TEST(VerifyAndSample, PlainGreedyIsTheFirstArgmaxWhereverItsTiesSit) {
  SamplingConfig plain;
  plain.logprobs = false;
  const uint32_t n = 4096 + 4096 + 13;  // two whole chunks and a short one
  const std::vector<std::vector<uint32_t>> placements = {
      {5},       {4089},       {4095},     {4100, 4107}, {8191},    {8192, 8203},
      {8204, 3}, {4092, 4093}, {17, 4095}, {8204},       {0, 8204}, {4088, 16, 4096},
      {40, 16},  {48, 32},     {36, 20},   {4112, 4128}};
  for (unsigned threads : {1u, 2u}) {
    WorkPool pool(threads);
    RowSampler wide(pool, true), narrow(pool, false);
    for (const auto& at : placements) {
      std::vector<float> logits = syntheticRow(at[0], n, 3.0f);
      for (uint32_t i : at) logits[i] = 9.0f;
      const uint32_t want =
          uint32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      for (RowSampler* sampler : {&wide, &narrow}) {
        const RowToSample row = rowOf(logits, &plain);
        SampledRow got;
        sampler->verifyAndSample(std::span(&row, 1), std::span(&got, 1));
        EXPECT_EQ(got.failed, IntegrityCheck::kNone);
        EXPECT_EQ(got.choice.token, want)
            << "max first at " << at[0] << ", " << threads << " threads, "
            << (sampler == &wide ? "16" : "8") << " lanes";
      }
    }
  }
}

TEST(VerifyAndSample, TopLogprobsAreTheLargestRawLogitsWithTiesByLowerId) {
  WorkPool pool(2);
  const auto logits = syntheticRow(3, 9000, 4.0f, 40);
  SamplingConfig c = temperature(1.0f);
  c.top_logprobs = 20;
  c.repetition_penalty = 3.0f;  // penalties never move the raw logprobs
  const std::vector<uint32_t> prompt = {1, 2, 3};
  const SampledRow got = sampleOne(pool, rowOf(logits, &c, 0, prompt));
  std::vector<uint32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return logits[a] > logits[b]; });
  ASSERT_EQ(got.choice.top.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(got.choice.top[i].first, order[i]);
    EXPECT_NEAR(got.choice.top[i].second, referenceLogprob(logits, order[i]), 1e-5);
  }
}

TEST(VerifyAndSample, TemperatureFrequenciesFollowTheSoftmax) {
  WorkPool pool(2);
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, -30.0f};
  const SamplingConfig c = temperature(0.8f, 2024);
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < logits.size(); ++i) z += p[i] = std::exp(logits[i] / 0.8);
  constexpr int kDraws = 20000;
  std::vector<int> counts(logits.size(), 0);
  for (uint64_t pos = 0; pos < kDraws; ++pos)
    ++counts[sampleOne(pool, rowOf(logits, &c, pos)).choice.token];
  for (size_t i = 0; i < logits.size(); ++i) {
    // Five standard deviations of a binomial proportion, at least 0.002.
    const double q = p[i] / z, sd = std::sqrt(q * (1 - q) / kDraws);
    EXPECT_NEAR(counts[i] / double(kDraws), q, std::max(5 * sd, 0.002)) << "token " << i;
  }
}

// Top-p by rejection must still draw from the kept set in proportion to the masses: with p
// sorted as {2.0, 1.0, 0.5, 0.0, -1.0, -30.0} / 0.8 (cumulative 0.647, 0.832, 0.932, ...) and
// top-p 0.9, the kept set is the three most likely tokens; top_k 2 on top keeps two.
TEST(VerifyAndSample, TopPFrequenciesFollowTheKeptSoftmax) {
  WorkPool pool(2);
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, -30.0f};
  std::vector<double> w(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) w[i] = std::exp((logits[i] - 2.0) / 0.8);
  for (uint32_t top_k : {0u, 2u}) {
    SamplingConfig c = temperature(0.8f, 77);
    c.top_p = 0.9f;
    c.top_k = top_k;
    const std::vector<size_t> kept =
        top_k == 2 ? std::vector<size_t>{2, 1} : std::vector<size_t>{2, 1, 4};
    double z = 0;
    for (size_t i : kept) z += w[i];
    constexpr int kDraws = 20000;
    std::vector<int> counts(logits.size(), 0);
    for (uint64_t pos = 0; pos < kDraws; ++pos)
      ++counts[sampleOne(pool, rowOf(logits, &c, pos)).choice.token];
    for (size_t i = 0; i < logits.size(); ++i) {
      const bool in = std::find(kept.begin(), kept.end(), i) != kept.end();
      const double q = in ? w[i] / z : 0.0, sd = std::sqrt(q * (1 - q) / kDraws);
      EXPECT_NEAR(counts[i] / double(kDraws), q, std::max(5 * sd, 0.002))
          << "top_k " << top_k << " token " << i;
    }
  }
}

TEST(VerifyAndSample, SeededDrawsRepeatAndDependOnSeedAndPosition) {
  WorkPool pool(2);
  const auto logits = syntheticRow(5, kVocab, 1.0f);
  SamplingConfig c = temperature(0.8f, 99);
  c.top_p = 0.9f;
  std::vector<uint32_t> first;
  for (uint64_t pos = 0; pos < 20; ++pos)
    first.push_back(sampleOne(pool, rowOf(logits, &c, pos)).choice.token);
  for (uint64_t pos = 0; pos < 20; ++pos)
    EXPECT_EQ(sampleOne(pool, rowOf(logits, &c, pos)).choice.token, first[pos]);
  EXPECT_GT(std::set<uint32_t>(first.begin(), first.end()).size(), 15u);
  c.seed = 100;
  int same = 0;
  for (uint64_t pos = 0; pos < 20; ++pos)
    same += sampleOne(pool, rowOf(logits, &c, pos)).choice.token == first[pos];
  EXPECT_LT(same, 3);
}

// Fixed rows and configs with their results written down: any change to the arithmetic (exp,
// masses, selection, draw, log-sum-exp) shows up here. Regenerate only for an intended change.
TEST(VerifyAndSample, PinnedResults) {
  WorkPool pool(2);
  const auto big = syntheticRow(20260101, kVocab, 4.0f);
  const auto small = syntheticRow(20260102, 1000, 16.0f);
  const std::vector<uint32_t> prompt = {1, 2, 3, 500, 700}, generated = {700, 700, 12, 999};
  std::vector<SamplingConfig> configs(6);
  configs[1] = temperature(0.8f, 7);
  configs[2] = temperature(0.8f, 7);
  configs[2].top_p = 0.9f;
  configs[3] = temperature(0.8f, 7);
  configs[3].top_k = 40;
  configs[4] = temperature(0.8f, 7);
  configs[4].min_p = 0.05f;
  configs[5] = temperature(0.8f, 7);
  configs[5].repetition_penalty = 1.3f, configs[5].presence_penalty = 0.5f;
  configs[5].frequency_penalty = 0.2f;
  for (size_t c = 0; c < configs.size(); ++c) configs[c].seed = 7 + c;
  struct Pinned {
    uint32_t token;
    float logprob;
  };
  // [row][config]: big then small.
  const Pinned pinned[2][6] = {{{150484, -10.531126f},
                                {115891, -10.7312803f},
                                {78485, -11.0412273f},
                                {62474, -10.5319042f},
                                {22333, -12.4563208f},
                                {39859, -11.0788631f}},
                               {{524, -4.11277723f},
                                {790, -5.12352753f},
                                {524, -4.11277723f},
                                {418, -4.37753773f},
                                {135, -5.01421785f},
                                {284, -4.56798458f}}};
  for (int which = 0; which < 2; ++which) {
    const auto& logits = which == 0 ? big : small;
    for (size_t c = 0; c < configs.size(); ++c) {
      const SampledRow got = sampleOne(pool, rowOf(logits, &configs[c], 17, prompt, generated));
      EXPECT_EQ(got.choice.token, pinned[which][c].token) << which << " " << c;
      EXPECT_NEAR(got.choice.logprob, pinned[which][c].logprob, 1e-6) << which << " " << c;
    }
  }
}

}  // namespace
}  // namespace bulkhead
