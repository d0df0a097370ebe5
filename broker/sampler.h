// Sampling in the broker, from verified logits rows. Every random draw is keyed by
// (seed, position) with a counter-based generator, never by step or batch, so a seeded request
// yields the same tokens whatever it is batched with, and a replay after a worker restart
// continues exactly as the original would have.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shared/status.h"

namespace bulkhead {

struct SamplingConfig {
  float temperature = 0.0f;  // 0: greedy
  uint32_t top_k = 0;        // 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  uint32_t top_logprobs = 0;
};

struct TokenChoice {
  uint32_t token = 0;
  float logprob = 0;                            // under the model's raw distribution
  std::vector<std::pair<uint32_t, float>> top;  // top_logprobs alternatives, most likely first
};

// Uniform in [0, 1) from (seed, position): splitmix64 over both.
double uniformAt(uint64_t seed, uint64_t position);

class Sampler {
 public:
  // Chooses the token at `position` (its index in the whole sequence) from `logits`, given the
  // sequence's prompt and generated tokens (for the penalties). Uses internal scratch space; one
  // Sampler per thread.
  TokenChoice sample(std::span<const float> logits, const SamplingConfig& config,
                     std::span<const uint32_t> prompt, std::span<const uint32_t> generated,
                     uint64_t position);

 private:
  std::vector<float> adjusted_;
  std::vector<uint32_t> order_;
  std::vector<uint32_t> counts_;
};

}  // namespace bulkhead
// TEMPORARY
#include "broker/row_pool.h"
#include "shared/logits_arena.h"
namespace bulkhead {
struct RowToSample {
  std::span<const float> logits;
  uint64_t expected_checksum = 0;
  const SamplingConfig* config = nullptr;
  std::span<const uint32_t> prompt, generated;
  uint64_t position = 0;
};
struct SampledRow {
  IntegrityCheck failed = IntegrityCheck::kNone;
  TokenChoice choice;
};
void verifyAndSample(RowPool& pool, std::span<const RowToSample> rows, std::span<SampledRow> out);
}  // namespace bulkhead
