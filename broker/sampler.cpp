// Sampler: penalties, temperature, top-k, top-p, min-p, logprobs.
#include "broker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "shared/mix.h"

namespace bulkhead {
namespace {

// Orders candidates by value, descending, ties by lower token id: a total order, so the
// selection never depends on how a sort treated equal values.
struct ByValueDesc {
  const float* v;
  bool operator()(uint32_t a, uint32_t b) const { return v[a] > v[b] || (v[a] == v[b] && a < b); }
};

}  // namespace

double uniformAt(uint64_t seed, uint64_t position) {
  const uint64_t bits = splitmix64(seed ^ splitmix64(position ^ 0x5bd1e9955bd1e995ull));
  return double(bits >> 11) * 0x1.0p-53;
}

TokenChoice Sampler::sample(std::span<const float> logits, const SamplingConfig& c,
                            std::span<const uint32_t> prompt, std::span<const uint32_t> generated,
                            uint64_t position) {
  const uint32_t vocab = uint32_t(logits.size());
  adjusted_.assign(logits.begin(), logits.end());

  // Penalties: repetition over prompt and output (divide positive logits, multiply negative);
  // presence and frequency over the output only.
  if (c.repetition_penalty != 1.0f || c.presence_penalty != 0.0f || c.frequency_penalty != 0.0f) {
    counts_.assign(vocab, 0);
    for (uint32_t t : generated) ++counts_[t];
    if (c.repetition_penalty != 1.0f) {
      auto penalise = [&](uint32_t t) {
        float& l = adjusted_[t];
        const float original = logits[t];
        l = original > 0 ? original / c.repetition_penalty : original * c.repetition_penalty;
      };
      for (uint32_t t : prompt) penalise(t);
      for (uint32_t t : generated) penalise(t);
    }
    for (uint32_t t = 0; t < vocab; ++t) {
      if (counts_[t] == 0) continue;
      adjusted_[t] -= c.frequency_penalty * float(counts_[t]) + c.presence_penalty;
    }
  }

  TokenChoice choice;
  if (c.temperature == 0.0f) {
    choice.token =
        uint32_t(std::max_element(adjusted_.begin(), adjusted_.end()) - adjusted_.begin());
  } else {
    // Softmax of adjusted / temperature, in place, in double for the sums.
    const float max_logit = *std::max_element(adjusted_.begin(), adjusted_.end());
    double total = 0;
    for (float& v : adjusted_) {
      v = float(std::exp(double(v - max_logit) / double(c.temperature)));
      total += v;
    }
    for (float& v : adjusted_) v = float(v / total);

    order_.clear();
    const bool filtered = c.top_k != 0 || c.top_p < 1.0f || c.min_p > 0.0f;
    if (!filtered) {
      // Plain temperature: walk the vocabulary in id order.
      double u = uniformAt(c.seed, position), cumulative = 0;
      choice.token = vocab - 1;
      for (uint32_t t = 0; t < vocab; ++t) {
        cumulative += adjusted_[t];
        if (u < cumulative) {
          choice.token = t;
          break;
        }
      }
    } else {
      // top-k, min-p and top-p each keep a prefix of the candidates sorted by probability, so
      // the result is the shortest of the three prefixes, whatever order they apply in.
      order_.resize(vocab);
      for (uint32_t t = 0; t < vocab; ++t) order_[t] = t;
      const ByValueDesc cmp{adjusted_.data()};
      uint32_t keep = vocab;
      if (c.top_k != 0 && c.top_k < vocab) {
        std::nth_element(order_.begin(), order_.begin() + c.top_k, order_.end(), cmp);
        keep = c.top_k;
      }
      if (c.min_p > 0.0f) {
        const float floor = c.min_p * *std::max_element(adjusted_.begin(), adjusted_.end());
        keep = uint32_t(std::partition(order_.begin(), order_.begin() + keep,
                                       [&](uint32_t t) { return adjusted_[t] >= floor; }) -
                        order_.begin());
      }
      // Sort only as much as top-p needs: a growing prefix until its mass is covered.
      uint32_t target = c.top_p < 1.0f ? std::min<uint32_t>(keep, 256) : keep;
      while (true) {
        std::partial_sort(order_.begin(), order_.begin() + target, order_.begin() + keep, cmp);
        if (c.top_p < 1.0f) {
          double mass = 0;
          uint32_t cut = 0;
          for (uint32_t i = 0; i < target && cut == 0; ++i) {
            mass += adjusted_[order_[i]];
            if (mass >= double(c.top_p)) cut = i + 1;
          }
          if (cut != 0) {
            keep = cut;
            break;
          }
        }
        if (target == keep) break;
        target = std::min<uint32_t>(keep, target * 4);
      }
      double mass = 0;
      for (uint32_t i = 0; i < keep; ++i) mass += adjusted_[order_[i]];
      const double u = uniformAt(c.seed, position) * mass;
      double cumulative = 0;
      choice.token = order_[keep - 1];
      for (uint32_t i = 0; i < keep; ++i) {
        cumulative += adjusted_[order_[i]];
        if (u < cumulative) {
          choice.token = order_[i];
          break;
        }
      }
    }
  }

  // Log-probabilities under the raw distribution.
  const float max_raw = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float v : logits) sum += std::exp(double(v - max_raw));
  const double log_z = double(max_raw) + std::log(sum);
  choice.logprob = float(double(logits[choice.token]) - log_z);
  if (c.top_logprobs > 0) {
    const uint32_t n = std::min(c.top_logprobs, vocab);
    order_.resize(vocab);
    for (uint32_t t = 0; t < vocab; ++t) order_[t] = t;
    std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), ByValueDesc{logits.data()});
    for (uint32_t i = 0; i < n; ++i)
      choice.top.emplace_back(order_[i], float(double(logits[order_[i]]) - log_z));
  }
  return choice;
}

}  // namespace bulkhead
// TEMPORARY
#include "shared/checksum.h"
namespace bulkhead {
void verifyAndSample(RowPool& pool, std::span<const RowToSample> rows, std::span<SampledRow> out) {
  pool.parallelFor(rows.size(), [&](size_t i) {
    const RowCheck c = checkRow(rows[i].logits.data(), rows[i].logits.size());
    out[i].failed = c.checksum != rows[i].expected_checksum ? IntegrityCheck::kPayloadChecksum
                    : !c.finite                             ? IntegrityCheck::kNonFinite
                                                            : IntegrityCheck::kNone;
    if (out[i].failed == IntegrityCheck::kNone && rows[i].config) {
      Sampler s;
      out[i].choice = s.sample(rows[i].logits, *rows[i].config, rows[i].prompt, rows[i].generated,
                               rows[i].position);
    }
  });
}
}  // namespace bulkhead
