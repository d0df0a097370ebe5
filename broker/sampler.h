// Sampling in the broker, from verified logits rows (the arithmetic lives in
// broker/row_sampling.h). Every random draw is keyed by
// (seed, position) with a counter-based generator, never by step or batch, so a seeded request
// yields the same tokens whatever it is batched with, and a replay after a worker restart
// continues exactly as the original would have.
#pragma once

#include <cstdint>
#include <memory>
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
  bool logprobs = true;  // the chosen token's logprob (top_logprobs > 0 needs it too)
};

struct TokenChoice {
  uint32_t token = 0;
  bool has_logprob = false;                     // computed (SamplingConfig::logprobs)
  float logprob = 0;                            // under the model's raw distribution
  std::vector<std::pair<uint32_t, float>> top;  // top_logprobs alternatives, most likely first
};

// Uniform in [0, 1) from (seed, position): splitmix64 over both.
double uniformAt(uint64_t seed, uint64_t position);
// The uniform of a token's draw number `attempt` (top-p sampling may draw more than once):
// attempt 0 is uniformAt(seed, position), later ones use a seed derived from both.
double drawUniform(uint64_t seed, uint64_t position, uint32_t attempt);

class WorkPool;
class RowSampler;

// One row at a time on the calling thread, with the semantics of broker/row_sampling.h.
class Sampler {
 public:
  Sampler();
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  // Chooses the token at `position` (its index in the whole sequence) from `logits`, given the
  // sequence's prompt and generated tokens (for the penalties). The row must already be verified
  // (finite); a non-finite row yields token 0 with a NaN logprob. Uses internal scratch space;
  // one Sampler per thread.
  TokenChoice sample(std::span<const float> logits, const SamplingConfig& config,
                     std::span<const uint32_t> prompt, std::span<const uint32_t> generated,
                     uint64_t position);

 private:
  std::unique_ptr<WorkPool> pool_;
  std::unique_ptr<RowSampler> rows_;
};

}  // namespace bulkhead
