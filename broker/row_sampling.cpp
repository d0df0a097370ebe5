// Fused verification and sampling of logits rows: a row moves through stages (read, weights,
// radix refinement, tie cut, kept mass), each a pass over the row's fixed 4096-token chunks
// followed by a short combine. Chunks are the unit of arithmetic whether one thread runs a whole
// row or many threads share it, which is what makes the result independent of the split.
#include "broker/row_sampling.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "broker/row_sampling_avx512.h"
#include "broker/vector_exp.h"
#include "shared/checksum.h"
#include "shared/mix.h"

namespace bulkhead {
namespace {

constexpr uint32_t kChunk = 4096;
constexpr uint32_t kAllIds = uint32_t(std::numeric_limits<int32_t>::max());
// Radix selection over a weight's bit pattern (its key; weights lie in [0, 1], so keys are below
// 2^30). The first level has 16 buckets per octave for weights in [2^-15, 1], where top-p
// boundaries fall, and one bucket for everything smaller; each later level splits the boundary
// bucket's key range into at most kBuckets equal parts, down to single keys.
constexpr uint32_t kBuckets = 256;
constexpr int kFirstShift = 19;
constexpr uint32_t kFirstLow = 112u << 23;  // the key of 2^-15

inline uint32_t firstBucket(uint32_t key) {
  return key < kFirstLow ? 0 : ((key - kFirstLow) >> kFirstShift) + 1;
}
inline uint32_t firstBucketLow(uint32_t b) {
  return b == 0 ? 0 : kFirstLow + ((b - 1) << kFirstShift);
}
inline uint32_t firstBucketHigh(uint32_t b) {
  return kFirstLow + (b << kFirstShift);
}
constexpr uint32_t kFirstBuckets = ((0x3f800000u - kFirstLow) >> kFirstShift) + 2;
static_assert(kFirstBuckets <= kBuckets);

enum class Stage { kPrepare, kRead, kWeights, kHistogram, kRefine, kTies, kKept, kDone };

// Top-p draws from the whole candidate set first and tests the token; this many draws are tried
// before the kept set is found by radix selection and drawn from directly.
constexpr uint32_t kRejectionDraws = 4;

struct ChunkStats {
  uint64_t checksum = 0;
  bool non_finite = false;
  bool penalised = false;  // weights_ holds this chunk's adjusted logits after the read
  float raw_max = 0;
  uint32_t raw_arg = 0;
  double raw_sum = 0;  // sum of exp32(r - raw_max) over the chunk
  float adj_max = 0;
  uint32_t adj_arg = 0;
  uint64_t mass = 0;
  uint32_t max_key = 0;  // the bits of the chunk's largest weight e (the weights pass)
  uint64_t kept_mass = 0;
  uint32_t kept_count = 0;
  uint32_t ties = 0;
  uint32_t candidates = 0;
};

struct PenaltyEntry {
  uint32_t token;
  bool repeated;       // in the prompt or the output: repetition penalty applies
  uint32_t generated;  // times in the output: frequency and presence apply when > 0
};

inline uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// round(e * 2^40), exactly, by the 2^52 trick: the same arithmetic as biasedMass4 below.
inline uint64_t massOf(float e) {
  const double d = double(e) * 0x1p40 + 0x1p52;
  uint64_t b;
  std::memcpy(&b, &d, 8);
  return b - 0x4330000000000000ull;
}

// massOf of four weights with 2^52 still in each lane's bits, the multiply and add fused (the
// product is exact, so one rounding either way): sums of these lanes drop kMassBias a lane once,
// at the end.
constexpr uint64_t kMassBias = 0x4330000000000000ull;  // the bits of 2^52
inline __m256i biasedMass4(__m128 e) {
  return _mm256_castpd_si256(
      _mm256_fmadd_pd(_mm256_cvtps_pd(e), _mm256_set1_pd(0x1p40), _mm256_set1_pd(0x1p52)));
}

inline __m256i biasedMass8Sum(__m256 e) {
  return _mm256_add_epi64(biasedMass4(_mm256_castps256_ps128(e)),
                          biasedMass4(_mm256_extractf128_ps(e, 1)));
}

inline uint64_t sum64(__m256i v) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

inline float maxOf(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  return m;
}

// Lanes [0, valid) set.
inline __m256i laneMask(uint32_t valid) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(valid)), lane);
}

inline __m256 loadLanes(const float* p, uint32_t valid) {
  return valid == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, laneMask(valid));
}

inline void storeLanes(float* p, __m256 v, uint32_t valid) {
  if (valid == 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, laneMask(valid), v);
}

// Lanes of weights kept by a cut: key > cut_key, or key == cut_key and id <= cut_id.
inline __m256i keptLanes(__m256i key, __m256i id, __m256i cut_key, __m256i cut_id) {
  return _mm256_or_si256(
      _mm256_cmpgt_epi32(key, cut_key),
      _mm256_andnot_si256(_mm256_cmpgt_epi32(id, cut_id), _mm256_cmpeq_epi32(key, cut_key)));
}

// Index of the first value equal to v (v is present).
uint32_t firstEqual(const float* p, uint32_t n, float v) {
  const __m256 target = _mm256_set1_ps(v);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), target, _CMP_EQ_OQ));
    if (m != 0) return i + uint32_t(__builtin_ctz(unsigned(m)));
  }
  for (; i < n; ++i)
    if (p[i] == v) return i;
  return 0;
}

// Max over p[0, n) and the first index holding it.
std::pair<float, uint32_t> maxAndArg(const float* p, uint32_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (uint32_t i = 0; i < n; i += 8) {
    const uint32_t valid = std::min(8u, n - i);
    const __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), loadLanes(p + i, valid),
                                      _mm256_castsi256_ps(laneMask(valid)));
    best = _mm256_max_ps(best, v);
  }
  const uint32_t arg = firstEqual(p, n, maxOf(best));
  return {p[arg], arg};
}

// Total order of candidates: value descending, then id ascending.
bool before(const std::pair<float, uint32_t>& a, const std::pair<float, uint32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

}  // namespace

// The large scratch: one set per participating thread in row mode, per row in chunk mode, so the
// working set stays in cache however many rows a call carries.
struct RowSampler::Buffers {
  std::vector<float> values;         // the verified private copy of the row
  std::vector<float> weights;        // adjusted logits of penalised chunks, then the weights e
  std::vector<uint32_t> hist_count;  // per chunk, kBuckets each
  std::vector<uint64_t> hist_mass;
  // From the first refinement on, the ids still in play, each chunk's at its own offset: later
  // levels and the tie cut visit only these.
  std::vector<uint32_t> candidates;
  // Penalties: per-token marks kept zeroed between rows, so preparing costs O(history).
  std::vector<uint32_t> marks;
  std::vector<uint32_t> touched;
};

struct RowSampler::RowWork {
  const RowToSample* in = nullptr;
  SampledRow* out = nullptr;
  Stage stage = Stage::kDone;
  uint32_t n = 0, chunks = 0;

  Buffers* buf = nullptr;
  bool wide_vectors = true;
  // Greedy with no logprobs and no penalties: sampled from the read pass alone, without a copy.
  bool plain_greedy = false;
  std::vector<ChunkStats> stats;
  uint32_t top_n = 0;
  std::vector<std::pair<float, uint32_t>> top;  // per chunk, top_n each, best first
  std::vector<uint32_t> top_count;

  std::vector<PenaltyEntry> penalties;  // grouped by chunk
  std::vector<uint32_t> penalty_start;  // chunks + 1 offsets into penalties

  // The weights e once computed: in place of the row's copy unless its raw values are still
  // wanted (logprobs), so a row's working set is one copy, not two.
  float* e_data = nullptr;
  float amax = 0, inv_t = 1;
  uint32_t aarg = 0;
  double log_z = 0;
  bool lse = false;  // the raw log-sum-exp is wanted (logprobs or top_logprobs)

  // Selection: the kept set is {key > cut_key} + {key == cut_key and id <= cut_id}.
  bool radix = false;
  // Top-p by rejection: `testing` while the kept pass measures the tokens before test_token.
  // `test_kept`: a row-mode pass found the token kept before reading every chunk.
  bool reject = false, testing = false, test_kept = false;
  uint32_t attempt = 0, test_token = 0;
  uint32_t top_k = 0;
  uint64_t total = 0, mass_goal = 0;
  int level = 0;
  uint32_t range_low = 0, range_high = 0;  // keys of the boundary bucket, once level > 0
  int shift = 0;                           // bucket width 2^shift within that range
  uint32_t count_above = 0;
  uint64_t mass_above = 0;
  uint32_t cut_key = 0, cut_id = kAllIds, tie_rank = 0;

  void prepare();
  void chunk(uint32_t c);
  void combine();

  void readChunk(uint32_t c);
  void weightsChunk(uint32_t c);
  void histogramChunk(uint32_t c);
  void refineChunk(uint32_t c);
  void tiesChunk(uint32_t c);
  void keptChunk(uint32_t c);
  // Every chunk of the stage, in order, on this thread (row mode).
  void allChunks();

  void finishRead();
  void walk(const uint32_t* count, const uint64_t* mass);
  // The key of the smallest weight min_p keeps (0: min_p is off; e of the top token is 1).
  uint32_t minPKey() const {
    const float min_p = in->config->min_p;
    return min_p > 0.0f ? bitsOf(std::min(min_p, 1.0f)) : 0;
  }
  void applyMinP();
  uint32_t pick();
  void test(uint32_t token);
  void judge();
  void draw();
  void finish(IntegrityCheck failed);
  void choose(uint32_t token);
  uint32_t begin(uint32_t c) const { return c * kChunk; }
  uint32_t size(uint32_t c) const { return std::min(kChunk, n - c * kChunk); }
  bool hasChunkWork() const {
    return stage == Stage::kRead || stage == Stage::kWeights || stage == Stage::kHistogram ||
           stage == Stage::kRefine || stage == Stage::kTies || stage == Stage::kKept;
  }
};

void RowSampler::RowWork::finish(IntegrityCheck failed) {
  out->failed = failed;
  stage = Stage::kDone;
}

void RowSampler::RowWork::choose(uint32_t token) {
  out->choice.token = token;
  out->choice.has_logprob = lse;
  out->choice.logprob = lse ? float(double(buf->values[token]) - log_z) : 0.0f;
}

void RowSampler::RowWork::prepare() {
  n = uint32_t(in->logits.size());
  chunks = (n + kChunk - 1) / kChunk;
  *out = SampledRow{};
  const SamplingConfig* c = in->config;
  if (n == 0 && c != nullptr) return finish(IntegrityCheck::kRowLength);
  if (buf->values.size() < n) {
    buf->values.resize(n);
    buf->weights.resize(n);
  }
  stats.assign(chunks, ChunkStats{});
  penalty_start.assign(chunks + 1, 0);
  penalties.clear();
  top_n = c != nullptr ? std::min(c->top_logprobs, n) : 0;
  lse = c != nullptr && (c->logprobs || top_n > 0);
  if (top_n > 0) {
    top.resize(size_t(chunks) * top_n);
    top_count.assign(chunks, 0);
  }
  stage = Stage::kRead;
  plain_greedy = false;
  if (c == nullptr) return;
  const bool repetition = c->repetition_penalty != 1.0f;
  const bool penalised = repetition || c->presence_penalty != 0.0f || c->frequency_penalty != 0.0f;
  plain_greedy = !(c->temperature > 0.0f) && !lse && !penalised;
  if (!penalised) return;
  if (buf->marks.size() < n) buf->marks.resize(n, 0);
  // marks: bit 0 = repeated, bits 1.. = times generated.
  auto mark = [&](uint32_t t, uint32_t add) {
    if (t >= n) return;  // out of this vocabulary: nothing to penalise
    if (buf->marks[t] == 0) buf->touched.push_back(t);
    buf->marks[t] = (buf->marks[t] + add) | uint32_t(repetition);
  };
  if (repetition)
    for (uint32_t t : in->prompt) mark(t, 0);
  for (uint32_t t : in->generated) mark(t, 2);
  for (uint32_t t : buf->touched) ++penalty_start[t / kChunk + 1];
  for (uint32_t i = 0; i < chunks; ++i) penalty_start[i + 1] += penalty_start[i];
  penalties.resize(buf->touched.size());
  std::vector<uint32_t> fill(penalty_start.begin(), penalty_start.end() - 1);
  for (uint32_t t : buf->touched) {
    penalties[fill[t / kChunk]++] = {t, (buf->marks[t] & 1) != 0, buf->marks[t] >> 1};
    buf->marks[t] = 0;
  }
  buf->touched.clear();
}

namespace {

const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");

}  // namespace

void RowSampler::RowWork::readChunk(uint32_t c) {
  ChunkStats& s = stats[c];
  const uint32_t len = size(c);
  // Verification alone reads nothing twice; nor does a plain greedy row, whose argmax is kept as
  // it is read.
  const bool copy = in->config != nullptr && !plain_greedy;
  const bool track = plain_greedy;
  const uint32_t base = begin(c);
  float* dst = buf->values.data() + base;
  avx512::ReadTotals wide;
  const uint32_t sixteens = wide_vectors && kHaveAvx512 ? len / 16 : 0;
  if (sixteens > 0)
    wide = avx512::readSixteens(in->logits.data() + base, dst, sixteens, base, copy, track);
  // The 8-lane loop takes what the 16-lane one left.
  const uint32_t done = 16 * sixteens, rest = len - done;
  const float* src8 = in->logits.data() + base + done;
  float* dst8 = dst + done;
  // index * kGolden for the 8 lanes, advanced by addition (the same bits as the multiply).
  __m256i keyed = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_set1_epi32(int(base + done)),
                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                     _mm256_set1_epi32(int(avx512::kGolden)));
  const __m256i keyed_step = _mm256_set1_epi32(int(8 * avx512::kGolden));
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  const __m256i low32 = _mm256_set1_epi64x(0xffffffffll);
  __m256i sum = _mm256_setzero_si256(), bad = _mm256_setzero_si256();
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best_index = index;
  // The one read of shared memory: copy, checksum terms, finiteness and max together. Whole
  // vectors first, then the chunk's tail under a lane mask.
  auto take = [&](__m256 v, const __m256i* mask) {
    const __m256i w = _mm256_castps_si256(v);
    __m256i t = _mm256_mullo_epi32(_mm256_xor_si256(w, keyed), _mm256_set1_epi32(int(0x85ebca77u)));
    keyed = _mm256_add_epi32(keyed, keyed_step);
    t = _mm256_xor_si256(t, _mm256_srli_epi32(t, 13));
    t = _mm256_mullo_epi32(t, _mm256_set1_epi32(int(0xc2b2ae3du)));
    t = _mm256_xor_si256(t, _mm256_srli_epi32(t, 16));
    if (mask != nullptr) {
      t = _mm256_and_si256(t, *mask);
      v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(*mask));
    }
    sum = _mm256_add_epi64(sum, _mm256_and_si256(t, low32));
    sum = _mm256_add_epi64(sum, _mm256_srli_epi64(t, 32));
    // (Masked-off lanes load as 0, which is finite.)
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(w, exponent), exponent));
    if (track) {
      const __m256 larger = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, larger);
      best_index = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), larger));
      index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
    } else {
      best = _mm256_max_ps(best, v);
    }
  };
  const uint32_t whole = rest / 8 * 8;
  if (copy) {
    for (uint32_t i = 0; i < whole; i += 8) {
      const __m256 v = _mm256_loadu_ps(src8 + i);
      _mm256_storeu_ps(dst8 + i, v);
      take(v, nullptr);
    }
  } else {
    for (uint32_t i = 0; i < whole; i += 8) take(_mm256_loadu_ps(src8 + i), nullptr);
  }
  if (whole < rest) {
    const uint32_t valid = rest - whole;
    const __m256i mask = laneMask(valid);
    const __m256 v = loadLanes(src8 + whole, valid);
    if (copy) storeLanes(dst8 + whole, v, valid);
    take(v, &mask);
  }
  s.checksum = sum64(sum) + wide.checksum;
  s.non_finite = !_mm256_testz_si256(bad, bad) || wide.non_finite;
  if (s.non_finite || in->config == nullptr) return;
  if (track) {
    // The first index of the max: the 16-lane part's (lower indices) unless the rest's is larger.
    const float rest_max = maxOf(best);
    alignas(32) float values[8];
    alignas(32) uint32_t indices[8];
    _mm256_store_ps(values, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index);
    uint32_t rest_arg = UINT32_MAX;
    for (int l = 0; l < 8; ++l)
      if (values[l] == rest_max) rest_arg = std::min(rest_arg, indices[l]);
    const bool wide_wins = sixteens > 0 && (rest == 0 || !(rest_max > wide.max));
    s.raw_max = wide_wins ? wide.max : rest_max;
    s.raw_arg = base + (wide_wins ? wide.arg : done + rest_arg);
    s.adj_max = s.raw_max;
    s.adj_arg = s.raw_arg;
    return;
  }
  s.raw_arg = firstEqual(dst, len, std::max(maxOf(best), wide.max));
  s.raw_max = dst[s.raw_arg];
  s.raw_arg += base;

  // The chunk's log-sum-exp part, from the copy (now in cache), over 8 fixed lanes.
  if (lse) {
    // Whole vectors of 16 first where the processor has them (the same adds in the same order),
    // then 8 lanes for the rest.
    alignas(32) float lanes[8] = {};
    const uint32_t wide_done = wide_vectors && kHaveAvx512 ? len / 16 * 16 : 0;
    if (wide_done > 0) avx512::expSumSixteens(dst, wide_done / 16, s.raw_max, lanes);
    __m256 acc = _mm256_load_ps(lanes);
    const __m256 m = _mm256_set1_ps(s.raw_max);
    for (uint32_t i = wide_done; i < len; i += 8) {
      const uint32_t valid = std::min(8u, len - i);
      const __m256 e = exp8(_mm256_sub_ps(loadLanes(dst + i, valid), m));
      acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(laneMask(valid))));
    }
    _mm256_store_ps(lanes, acc);
    s.raw_sum = 0;
    for (float l : lanes) s.raw_sum += double(l);
  }

  if (top_n > 0) {
    auto* best_n = top.data() + size_t(c) * top_n;
    uint32_t& count = top_count[c];
    for (uint32_t i = 0; i < len; ++i) {
      const float v = dst[i];
      if (count == top_n && !(v > best_n[top_n - 1].first)) continue;
      uint32_t p = std::min(count, top_n - 1);
      while (p > 0 && best_n[p - 1].first < v) {
        best_n[p] = best_n[p - 1];
        --p;
      }
      best_n[p] = {v, base + i};
      count = std::min(count + 1, top_n);
    }
  }

  s.adj_max = s.raw_max;
  s.adj_arg = s.raw_arg;
  const SamplingConfig& cfg = *in->config;
  if (penalty_start[c] == penalty_start[c + 1]) return;
  float* adjusted = buf->weights.data() + base;
  std::memcpy(adjusted, dst, len * sizeof(float));
  for (uint32_t p = penalty_start[c]; p < penalty_start[c + 1]; ++p) {
    const PenaltyEntry& e = penalties[p];
    float a = buf->values[e.token];
    if (e.repeated) a = a > 0 ? a / cfg.repetition_penalty : a * cfg.repetition_penalty;
    if (e.generated > 0) a -= cfg.frequency_penalty * float(e.generated) + cfg.presence_penalty;
    // A tiny repetition penalty divides a positive logit past the largest float: it stays the
    // largest finite one (the infinity would make every weight 0 and the draw meaningless).
    adjusted[e.token - base] = std::clamp(a, -FLT_MAX, FLT_MAX);
  }
  s.penalised = true;
  auto [am, aa] = maxAndArg(adjusted, len);
  s.adj_max = am;
  s.adj_arg = base + aa;
}

void RowSampler::RowWork::weightsChunk(uint32_t c) {
  ChunkStats& s = stats[c];
  const uint32_t base = begin(c), len = size(c);
  const float* src = (s.penalised ? buf->weights.data() : buf->values.data()) + base;
  float* dst = e_data + base;
  const __m256 m = _mm256_set1_ps(amax), scale = _mm256_set1_ps(inv_t);
  __m256i mass = _mm256_setzero_si256(), max_key = _mm256_setzero_si256();
  // Whole vectors of 16 first where the processor has them, then 8 lanes for the rest.
  const uint32_t done = wide_vectors && kHaveAvx512 ? len / 16 * 16 : 0;
  const avx512::WeightsTotals wide = done > 0
                                         ? avx512::weightsSixteens(src, dst, done / 16, amax, inv_t)
                                         : avx512::WeightsTotals{};
  for (uint32_t i = done; i < len; i += 8) {
    const uint32_t valid = std::min(8u, len - i);
    const __m256 x = _mm256_mul_ps(_mm256_sub_ps(loadLanes(src + i, valid), m), scale);
    const __m256 e = _mm256_and_ps(exp8(x), _mm256_castsi256_ps(laneMask(valid)));
    storeLanes(dst + i, e, valid);
    mass = _mm256_add_epi64(mass, biasedMass8Sum(e));
    max_key = _mm256_max_epi32(max_key, _mm256_castps_si256(e));  // non-negative: bits order
  }
  s.mass = sum64(mass) - uint64_t(len - done + 7) / 8 * 8 * kMassBias + wide.mass;
  alignas(32) uint32_t keys[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(keys), max_key);
  s.max_key = std::max(wide.max_key, *std::max_element(keys, keys + 8));
  if (radix && !reject) histogramChunk(c);
}

void RowSampler::RowWork::histogramChunk(uint32_t c) {
  const float* w = e_data + begin(c);
  uint32_t* count = buf->hist_count.data() + size_t(c) * kBuckets;
  uint64_t* hmass = buf->hist_mass.data() + size_t(c) * kBuckets;
  std::fill_n(count, kBuckets, 0);
  std::fill_n(hmass, kBuckets, 0);
  for (uint32_t i = 0, len = size(c); i < len; ++i) {
    const uint32_t b = firstBucket(bitsOf(w[i]));
    ++count[b];
    hmass[b] += massOf(w[i]);
  }
}

void RowSampler::RowWork::refineChunk(uint32_t c) {
  const uint32_t base = begin(c), len = size(c);
  const float* w = e_data;
  uint32_t* count = buf->hist_count.data() + size_t(c) * kBuckets;
  uint64_t* hmass = buf->hist_mass.data() + size_t(c) * kBuckets;
  std::fill_n(count, kBuckets, 0);
  std::fill_n(hmass, kBuckets, 0);
  uint32_t* kept = buf->candidates.data() + base;
  auto add = [&](uint32_t id) {
    const uint32_t b = (bitsOf(w[id]) - range_low) >> shift;
    ++count[b];
    hmass[b] += massOf(w[id]);
  };
  auto inRange = [&](uint32_t key) { return key >= range_low && key < range_high; };
  if (level > 1) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < stats[c].candidates; ++i) {
      const uint32_t id = kept[i];
      if (!inRange(bitsOf(w[id]))) continue;
      kept[k++] = id;
      add(id);
    }
    stats[c].candidates = k;
    return;
  }
  // The first refinement scans the chunk and keeps the ids of the boundary bucket.
  // Keys are below 2^30, so signed comparisons order them.
  const __m256i low = _mm256_set1_epi32(int(range_low) - 1),
                high = _mm256_set1_epi32(int(range_high));
  uint32_t k = 0;
  for (uint32_t i = 0; i < len; i += 8) {
    const uint32_t valid = std::min(8u, len - i);
    const __m256i keys = _mm256_castps_si256(loadLanes(w + base + i, valid));
    const __m256i in =
        _mm256_and_si256(_mm256_cmpgt_epi32(keys, low), _mm256_cmpgt_epi32(high, keys));
    int hits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(in, laneMask(valid))));
    while (hits != 0) {
      const uint32_t id = base + i + uint32_t(__builtin_ctz(unsigned(hits)));
      hits &= hits - 1;
      kept[k++] = id;
      add(id);
    }
  }
  stats[c].candidates = k;
}

void RowSampler::RowWork::tiesChunk(uint32_t c) {
  // Ties are resolved at the last level, so every tie is among the chunk's candidates.
  const uint32_t* kept = buf->candidates.data() + begin(c);
  uint32_t ties = 0;
  for (uint32_t i = 0; i < stats[c].candidates; ++i) ties += bitsOf(e_data[kept[i]]) == cut_key;
  stats[c].ties = ties;
}

void RowSampler::RowWork::keptChunk(uint32_t c) {
  if (stats[c].max_key < cut_key) {  // no weight of the chunk reaches the cut: nothing kept
    stats[c].kept_mass = 0;
    stats[c].kept_count = 0;
    return;
  }
  const uint32_t base = begin(c), len = size(c);
  const float* w = e_data + base;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i key = _mm256_set1_epi32(int(cut_key)), id_cut = _mm256_set1_epi32(int(cut_id));
  __m256i mass = _mm256_setzero_si256();
  // Whole vectors of 16 first where the processor has them, then 8 lanes for the rest.
  const uint32_t done = wide_vectors && kHaveAvx512 ? len / 16 * 16 : 0;
  const avx512::KeptTotals wide =
      done > 0 ? avx512::keptSixteens(w, done / 16, base, cut_key, cut_id) : avx512::KeptTotals{};
  uint32_t count = wide.count;
  for (uint32_t i = done; i < len; i += 8) {
    const uint32_t valid = std::min(8u, len - i);
    const __m256 e = loadLanes(w + i, valid);
    const __m256i k = _mm256_castps_si256(e);
    const __m256i id = _mm256_add_epi32(_mm256_set1_epi32(int(base + i)), lane);
    const __m256i kept = keptLanes(k, id, key, id_cut);
    const __m256 in = _mm256_castsi256_ps(_mm256_and_si256(kept, laneMask(valid)));
    count += uint32_t(__builtin_popcount(unsigned(_mm256_movemask_ps(in))));
    mass = _mm256_add_epi64(mass, biasedMass8Sum(_mm256_and_ps(e, in)));
  }
  stats[c].kept_mass = sum64(mass) - uint64_t(len - done + 7) / 8 * 8 * kMassBias + wide.mass;
  stats[c].kept_count = count;
}

void RowSampler::RowWork::chunk(uint32_t c) {
  switch (stage) {
    case Stage::kRead:
      return readChunk(c);
    case Stage::kWeights:
      return weightsChunk(c);
    case Stage::kHistogram:
      return histogramChunk(c);
    case Stage::kRefine:
      return refineChunk(c);
    case Stage::kTies:
      return tiesChunk(c);
    case Stage::kKept:
      return keptChunk(c);
    default:
      return;
  }
}

void RowSampler::RowWork::allChunks() {
  if (!(stage == Stage::kKept && testing && bitsOf(e_data[test_token]) >= minPKey())) {
    for (uint32_t c = 0; c < chunks; ++c) chunk(c);
    return;
  }
  // A test whose token reaches min_p is kept once the tokens before it so far, with every token
  // of the chunks not yet read, stay under the goal's mass and top_k: whatever those chunks
  // hold, so they are not read. judge() decides the same as after a whole pass; only a rejected
  // token needs every chunk's mass before it (the next draw is from those tokens).
  uint64_t before_mass = 0, rest_mass = total;
  uint32_t before_count = 0, rest_count = n;
  for (uint32_t c = 0; c < chunks; ++c) {
    if (before_mass + rest_mass < mass_goal && before_count + rest_count < top_k) {
      test_kept = true;
      return;
    }
    keptChunk(c);
    before_mass += stats[c].kept_mass;
    before_count += stats[c].kept_count;
    rest_mass -= stats[c].mass;
    rest_count -= size(c);
  }
}

void RowSampler::RowWork::finishRead() {
  uint64_t checksum = 0;
  bool non_finite = false;
  for (const ChunkStats& s : stats) {
    checksum += s.checksum;
    non_finite |= s.non_finite;
  }
  if (checksum != in->expected_checksum) return finish(IntegrityCheck::kPayloadChecksum);
  if (non_finite) return finish(IntegrityCheck::kNonFinite);
  const SamplingConfig* cfg = in->config;
  if (cfg == nullptr) return finish(IntegrityCheck::kNone);

  float raw_max = stats[0].raw_max;
  amax = stats[0].adj_max;
  aarg = stats[0].adj_arg;
  for (const ChunkStats& s : stats) {
    raw_max = std::max(raw_max, s.raw_max);
    if (s.adj_max > amax) {  // equal: the earlier chunk holds the lower id
      amax = s.adj_max;
      aarg = s.adj_arg;
    }
  }
  if (lse) {
    double sum = 0;
    for (const ChunkStats& s : stats) sum += s.raw_sum * double(exp1(s.raw_max - raw_max));
    log_z = double(raw_max) + std::log(sum);
  }

  if (top_n > 0) {
    std::vector<std::pair<float, uint32_t>> all;
    for (uint32_t c = 0; c < chunks; ++c)
      all.insert(all.end(), top.begin() + size_t(c) * top_n,
                 top.begin() + size_t(c) * top_n + top_count[c]);
    std::partial_sort(all.begin(), all.begin() + top_n, all.end(), before);
    out->choice.top.clear();
    for (uint32_t i = 0; i < top_n; ++i)
      out->choice.top.emplace_back(all[i].second, float(double(all[i].first) - log_z));
  }

  if (!(cfg->temperature > 0.0f)) {
    choose(aarg);
    return finish(IntegrityCheck::kNone);
  }
  inv_t = std::min(1.0f / cfg->temperature, FLT_MAX);
  e_data = lse ? buf->weights.data() : buf->values.data();
  top_k = cfg->top_k != 0 && cfg->top_k < n ? cfg->top_k : n;
  radix = top_k < n || cfg->top_p < 1.0f;
  reject = cfg->top_p < 1.0f;
  testing = false;
  attempt = 0;
  if (radix) {
    buf->hist_count.resize(size_t(chunks) * kBuckets);
    buf->hist_mass.resize(size_t(chunks) * kBuckets);
    if (buf->candidates.size() < n) buf->candidates.resize(n);
  }
  stage = Stage::kWeights;
}

// Finds the bucket of this level where the prefix constraint (top_k count, top_p mass) is met.
void RowSampler::RowWork::walk(const uint32_t* count, const uint64_t* mass) {
  const uint32_t buckets = level == 0 ? kFirstBuckets : ((range_high - range_low - 1) >> shift) + 1;
  for (uint32_t j = buckets; j-- > 0;) {
    if (count[j] == 0) continue;
    const uint32_t c2 = count_above + count[j];
    const uint64_t m2 = mass_above + mass[j];
    if (c2 < top_k && m2 < mass_goal) {
      count_above = c2;
      mass_above = m2;
      continue;
    }
    const uint32_t low = level == 0 ? firstBucketLow(j) : range_low + (j << shift);
    const uint32_t high =
        level == 0 ? firstBucketHigh(j) : std::min(range_high, low + (1u << shift));
    if (count[j] == 1) {
      // A lone token: keeping every key from the bucket's lowest keeps exactly it.
      cut_key = low;
      cut_id = kAllIds;
      stage = Stage::kKept;
      return;
    }
    if (high - low > 1) {
      range_low = low;
      range_high = high;
      shift = 0;
      while (((high - low - 1) >> shift) >= kBuckets) ++shift;
      ++level;
      stage = Stage::kRefine;
      return;
    }
    // Ties: every token here has this exact weight and mass; keep the lowest ids needed.
    cut_key = low;
    const uint64_t each = mass[j] / count[j];
    const uint64_t by_count = top_k - count_above;
    const uint64_t by_mass = each == 0 || mass_goal == std::numeric_limits<uint64_t>::max()
                                 ? count[j]
                                 : (mass_goal - std::min(mass_goal, mass_above) + each - 1) / each;
    tie_rank = uint32_t(std::clamp<uint64_t>(std::min(by_count, by_mass), 1, count[j]));
    cut_id = kAllIds;
    stage = tie_rank == count[j] ? Stage::kKept : Stage::kTies;
    return;
  }
  cut_key = 0;  // the goal is never met (top_p rounding at 1): keep everything
  cut_id = kAllIds;
  stage = Stage::kKept;
}

void RowSampler::RowWork::applyMinP() {
  const uint32_t floor_key = minPKey();
  if (floor_key > cut_key) {
    cut_key = floor_key;
    cut_id = kAllIds;
  }
}

// The draw number `attempt` from the kept set (per-chunk kept masses in stats): the first kept
// token, in ascending id order, whose running mass exceeds the target.
uint32_t RowSampler::RowWork::pick() {
  uint64_t kept = 0;
  for (const ChunkStats& s : stats) kept += s.kept_mass;
  const uint64_t u = uint64_t(drawUniform(in->config->seed, in->position, attempt) * 0x1p53);
  const uint64_t target = uint64_t((unsigned __int128)u * kept >> 53);
  uint64_t running = 0;
  uint32_t c = 0;
  while (c < chunks && running + stats[c].kept_mass <= target) running += stats[c++].kept_mass;
  auto isKept = [&](uint32_t i) {
    const uint32_t k = bitsOf(e_data[i]);
    return k > cut_key || (k == cut_key && i <= cut_id);
  };
  if (c < chunks) {
    // Whole blocks of 64 weights while the target lies beyond them (exact integer sums, so the
    // token found is the one a token-by-token walk finds), then token by token.
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i key = _mm256_set1_epi32(int(cut_key)), id_cut = _mm256_set1_epi32(int(cut_id));
    uint32_t i = begin(c);
    for (; i + 64 <= begin(c) + size(c); i += 64) {
      __m256i mass = _mm256_setzero_si256();
      for (uint32_t j = i; j < i + 64; j += 8) {
        const __m256 e = _mm256_loadu_ps(e_data + j);
        const __m256i k = _mm256_castps_si256(e);
        const __m256i id = _mm256_add_epi32(_mm256_set1_epi32(int(j)), lane);
        const __m256i kept = keptLanes(k, id, key, id_cut);
        mass = _mm256_add_epi64(mass, biasedMass8Sum(_mm256_and_ps(e, _mm256_castsi256_ps(kept))));
      }
      const uint64_t block = sum64(mass) - 64 * kMassBias;
      if (running + block > target) break;
      running += block;
    }
    for (; i < begin(c) + size(c); ++i) {
      if (!isKept(i)) continue;
      running += massOf(e_data[i]);
      if (running > target) return i;
    }
  }
  for (uint32_t i = n; i-- > 0;)
    if (isKept(i)) return i;
  return aarg;
}

void RowSampler::RowWork::draw() {
  const uint32_t token = pick();
  choose(token);
  finish(IntegrityCheck::kNone);
}

// Measures the tokens ordered before `token` (e desc, id asc) in a kept pass; judge() decides.
void RowSampler::RowWork::test(uint32_t token) {
  test_token = token;
  test_kept = false;
  const uint32_t key = bitsOf(e_data[token]);
  if (token == 0) {
    cut_key = key + 1;  // keys are below 2^30
    cut_id = kAllIds;
  } else {
    cut_key = key;
    cut_id = token - 1;
  }
  testing = true;
  stage = Stage::kKept;
}

// The tested token is kept when it is the most likely, or when fewer than top_k tokens and less
// than the top-p goal's mass precede it and its weight reaches min_p. Otherwise every kept token
// precedes it, so the next draw is from the tokens before it; after kRejectionDraws draws the
// kept set is selected exactly and drawn from.
void RowSampler::RowWork::judge() {
  if (test_kept) {
    choose(test_token);
    return finish(IntegrityCheck::kNone);
  }
  uint64_t before_mass = 0;
  uint32_t before_count = 0;
  for (const ChunkStats& s : stats) {
    before_mass += s.kept_mass;
    before_count += s.kept_count;
  }
  const bool kept = before_count == 0 || (before_count < top_k && before_mass < mass_goal &&
                                          bitsOf(e_data[test_token]) >= minPKey());
  if (kept) {
    choose(test_token);
    return finish(IntegrityCheck::kNone);
  }
  ++attempt;
  if (attempt < kRejectionDraws) return test(pick());
  testing = false;
  stage = Stage::kHistogram;
}

void RowSampler::RowWork::combine() {
  switch (stage) {
    case Stage::kPrepare:
      return prepare();
    case Stage::kRead:
      return finishRead();
    case Stage::kWeights: {
      total = 0;
      for (const ChunkStats& s : stats) total += s.mass;
      const float top_p = in->config->top_p;
      mass_goal = top_p < 1.0f ? uint64_t(std::ceil(double(top_p) * double(total)))
                               : std::numeric_limits<uint64_t>::max();
      if (!radix || reject) {
        cut_key = 0;
        cut_id = kAllIds;
        for (ChunkStats& s : stats) s.kept_mass = s.mass;
        if (reject) return test(pick());
        applyMinP();
        if (cut_key == 0) return draw();
        stage = Stage::kKept;
        return;
      }
      [[fallthrough]];
    }
    case Stage::kHistogram:
      level = 0;
      count_above = 0;
      mass_above = 0;
      [[fallthrough]];
    case Stage::kRefine: {
      // Merge the chunks' histograms: integer sums, so the order does not matter.
      uint32_t count[kBuckets] = {};
      uint64_t mass[kBuckets] = {};
      for (uint32_t c = 0; c < chunks; ++c) {
        const uint32_t* hc = buf->hist_count.data() + size_t(c) * kBuckets;
        const uint64_t* hm = buf->hist_mass.data() + size_t(c) * kBuckets;
        for (uint32_t b = 0; b < kBuckets; ++b) {
          count[b] += hc[b];
          mass[b] += hm[b];
        }
      }
      walk(count, mass);
      if (stage == Stage::kKept) applyMinP();
      return;
    }
    case Stage::kTies: {
      uint32_t seen = 0, c = 0;
      while (seen + stats[c].ties < tie_rank) seen += stats[c++].ties;
      const uint32_t* kept = buf->candidates.data() + begin(c);
      for (uint32_t i = 0;; ++i) {
        if (bitsOf(e_data[kept[i]]) == cut_key && ++seen == tie_rank) {
          cut_id = kept[i];
          break;
        }
      }
      applyMinP();
      stage = Stage::kKept;
      return;
    }
    case Stage::kKept:
      return testing ? judge() : draw();
    case Stage::kDone:
      return;
  }
}

bool RowSampler::sixteenLanes() {
  return kHaveAvx512;
}

RowSampler::RowSampler(WorkPool& pool, bool wide_vectors)
    : pool_(pool), wide_vectors_(wide_vectors) {}
RowSampler::~RowSampler() = default;

void RowSampler::verifyAndSample(std::span<const RowToSample> rows, std::span<SampledRow> out) {
  while (work_.size() < rows.size()) {
    work_.push_back(std::make_unique<RowWork>());
    work_.back()->wide_vectors = wide_vectors_;
  }
  const size_t sets = std::min<size_t>(rows.size(), pool_.threads());
  while (buffers_.size() < sets) buffers_.push_back(std::make_unique<Buffers>());
  for (size_t r = 0; r < rows.size(); ++r) {
    work_[r]->in = &rows[r];
    work_[r]->out = &out[r];
    work_[r]->stage = Stage::kPrepare;
  }
  if (rows.size() >= pool_.threads()) {
    // Enough rows to go round: each row start to finish on one thread, in its cache, with the
    // buffers of the slot that claimed it.
    std::atomic<size_t> next{0};
    pool_.parallelFor(sets, [&](size_t slot) {
      for (size_t r; (r = next.fetch_add(1, std::memory_order_relaxed)) < rows.size();) {
        RowWork& w = *work_[r];
        w.buf = buffers_[slot].get();
        while (w.stage != Stage::kDone) {
          if (w.hasChunkWork()) w.allChunks();
          w.combine();
        }
      }
    });
    return;
  }
  // Few rows: every stage's chunks of every row in one burst, then the rows' combines.
  for (size_t r = 0; r < rows.size(); ++r) work_[r]->buf = buffers_[r].get();
  std::vector<std::pair<uint32_t, uint32_t>> tasks;
  while (true) {
    tasks.clear();
    bool busy = false;
    for (size_t r = 0; r < rows.size(); ++r) {
      RowWork& w = *work_[r];
      busy |= w.stage != Stage::kDone;
      if (w.hasChunkWork())
        for (uint32_t c = 0; c < w.chunks; ++c) tasks.emplace_back(uint32_t(r), c);
    }
    if (!busy) return;
    // One chunk a claim: a helper that wakes late (a cold pool) finds only what is left, where a
    // fixed share per thread would make the step wait for it.
    pool_.parallelFor(tasks.size(),
                      [&](size_t i) { work_[tasks[i].first]->chunk(tasks[i].second); });
    for (size_t r = 0; r < rows.size(); ++r) work_[r]->combine();
  }
}

void verifyAndSample(WorkPool& pool, std::span<const RowToSample> rows, std::span<SampledRow> out) {
  RowSampler sampler(pool);
  sampler.verifyAndSample(rows, out);
}

}  // namespace bulkhead
