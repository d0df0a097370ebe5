// Verification and sampling of a step's logits rows, fused and spread over a WorkPool. A row is
// read from shared memory exactly once, into a private copy that is checksummed as it is read;
// everything after works on that copy, so what is sampled is what was verified.
//
// Sampling, pinned (every step is fixed-order or exact, so a row's result depends only on the
// row, its config, its history and its position, never on the thread count or the batch):
// - Penalties adjust only the tokens in the history: repetition (prompt and generated: positive
//   logits divided by it, negative multiplied), then frequency * count + presence subtracted
//   for generated tokens. Adjusted logits a_i; raw logits r_i.
// - Greedy (temperature <= 0): the lowest id among the largest a_i.
// - Otherwise weights e_i = exp32((a_i - max a) * (1/T)) in float, with exp32 the polynomial of
//   broker/vector_exp.h (e of the top token is exactly 1). Masses m_i = round(e_i * 2^40) are
//   integers, so every mass sum is exact and order-free.
// - Kept set: the shortest prefix of the tokens ordered by (e desc, id asc) with at most top_k
//   tokens and prefix mass >= ceil(top_p * total mass), cut to the tokens with e >= min_p.
// - Draw from a set S: u = drawUniform(seed, position, attempt) = U * 2^-53; target =
//   floor(U * mass(S) / 2^53); the chosen token is the first token of S, in ascending id order,
//   whose running mass sum exceeds target.
// - Without top-p, one draw (attempt 0) from the kept set, whose boundary comes from radix
//   selection on the bit patterns of e, never from a sort.
// - With top-p, by rejection: S starts as every token; draw t from S (attempt 0, 1, ...); t is
//   kept if it is the most likely token, or if fewer than top_k tokens and less than the goal's
//   mass precede it and e_t >= min_p. Then t is the token. Otherwise every kept token precedes t,
//   so S becomes the tokens before t and the next attempt draws. After kRejectionDraws (4)
//   rejected draws, attempt 4 draws from the kept set, selected as above. Each accepted token is
//   distributed as a draw from the kept set, and the common case costs one extra vector pass
//   over the row instead of a selection; less where a row runs on one thread, whose pass stops
//   once the tokens before t so far, with every token of the chunks not yet read, stay under the
//   goal and top_k (t is then kept whatever those chunks hold).
// - logprob (only when the config asks for logprobs or top_logprobs; otherwise the row's raw
//   log-sum-exp is never computed) = r_t - (R + log(sum_c s_c * exp32(R_c - R))), R the raw max,
//   R_c a 4096-token chunk's raw max and s_c the chunk's float sum of exp32(r_i - R_c) over 8 fixed
//   lanes. top_logprobs: the N largest r_i (value desc, id asc) with their logprobs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "broker/sampler.h"
#include "shared/logits_arena.h"
#include "shared/work_pool.h"

namespace bulkhead {

struct RowToSample {
  std::span<const float> logits;           // payload in shared memory, not yet verified
  uint64_t expected_checksum = 0;          // checksumBytes of the payload, as its header claims
  const SamplingConfig* config = nullptr;  // nullptr: verify only, choose nothing
  std::span<const uint32_t> prompt, generated;  // for the penalties
  uint64_t position = 0;  // index in the whole sequence of the token being chosen
};

struct SampledRow {
  IntegrityCheck failed = IntegrityCheck::kNone;  // kPayloadChecksum, kNonFinite, kRowLength
  TokenChoice choice;  // valid only when failed == kNone and config != nullptr
};

// Owns the scratch space, kept between calls: two private floats per vocabulary entry per pool
// thread, and a few kilobytes per row. One RowSampler per calling thread.
class RowSampler {
 public:
  // wide_vectors: 16-lane AVX-512 loops where the processor has them (off: 8-lane loops only; the
  // results are the same, which the tests check).
  explicit RowSampler(WorkPool& pool, bool wide_vectors = true);
  ~RowSampler();
  RowSampler(const RowSampler&) = delete;
  RowSampler& operator=(const RowSampler&) = delete;

  // Verifies each row (payload checksum equals expected_checksum, every value finite) and
  // samples the rows that pass. Work spreads over the pool by rows and, when rows are fewer than
  // threads, by fixed-size chunks of a row. out.size() must equal rows.size(). An empty row fails
  // kRowLength when it has a config.
  void verifyAndSample(std::span<const RowToSample> rows, std::span<SampledRow> out);

  // Whether this processor runs the passes 16 lanes at a time (AVX-512).
  static bool sixteenLanes();

 private:
  struct Buffers;
  struct RowWork;
  WorkPool& pool_;
  bool wide_vectors_;
  std::vector<std::unique_ptr<Buffers>> buffers_;
  std::vector<std::unique_ptr<RowWork>> work_;
};

// The same, with scratch allocated for this call only: for tests and one-off use.
void verifyAndSample(WorkPool& pool, std::span<const RowToSample> rows, std::span<SampledRow> out);

}  // namespace bulkhead
