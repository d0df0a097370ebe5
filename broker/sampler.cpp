// Sampler: the (seed, position) draw, and single-row sampling through RowSampler.
#include "broker/sampler.h"

#include <cmath>
#include <limits>

#include "broker/row_sampling.h"
#include "shared/checksum.h"
#include "shared/mix.h"
#include "shared/work_pool.h"

namespace bulkhead {

double uniformAt(uint64_t seed, uint64_t position) {
  const uint64_t bits = splitmix64(seed ^ splitmix64(position ^ 0x5bd1e9955bd1e995ull));
  return double(bits >> 11) * 0x1.0p-53;
}

double drawUniform(uint64_t seed, uint64_t position, uint32_t attempt) {
  if (attempt == 0) return uniformAt(seed, position);
  return uniformAt(splitmix64(seed ^ (0x9e3779b97f4a7c15ull * attempt)), position);
}

Sampler::Sampler()
    : pool_(std::make_unique<WorkPool>(1)), rows_(std::make_unique<RowSampler>(*pool_)) {}
Sampler::~Sampler() = default;

TokenChoice Sampler::sample(std::span<const float> logits, const SamplingConfig& config,
                            std::span<const uint32_t> prompt, std::span<const uint32_t> generated,
                            uint64_t position) {
  const RowToSample row{.logits = logits,
                        .expected_checksum = checksumBytes(std::as_bytes(logits)),
                        .config = &config,
                        .prompt = prompt,
                        .generated = generated,
                        .position = position};
  SampledRow out;
  rows_->verifyAndSample(std::span(&row, 1), std::span(&out, 1));
  if (out.failed != IntegrityCheck::kNone) {
    TokenChoice none;
    none.logprob = std::numeric_limits<float>::quiet_NaN();
    return none;
  }
  return std::move(out.choice);
}

}  // namespace bulkhead
