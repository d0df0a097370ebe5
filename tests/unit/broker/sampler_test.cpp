// Sampler: greedy, filters, penalties, logprobs, and the (seed, position) keying.
#include "broker/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <set>

namespace bulkhead {
namespace {

std::vector<float> randomLogits(uint32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

uint32_t argmax(const std::vector<float>& v) {
  return uint32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

TEST(Sampler, GreedyIsArgmaxWithLogprob) {
  Sampler s;
  const auto logits = randomLogits(1000, 1);
  TokenChoice c = s.sample(logits, {}, {}, {}, 5);
  EXPECT_EQ(c.token, argmax(logits));
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  EXPECT_NEAR(c.logprob, logits[c.token] - std::log(z), 1e-4);
}

TEST(Sampler, TopLogprobsAreTheMostLikelyInOrder) {
  Sampler s;
  const auto logits = randomLogits(500, 2);
  SamplingConfig cfg;
  cfg.top_logprobs = 5;
  TokenChoice c = s.sample(logits, cfg, {}, {}, 0);
  ASSERT_EQ(c.top.size(), 5u);
  EXPECT_EQ(c.top[0].first, argmax(logits));
  for (size_t i = 1; i < c.top.size(); ++i) EXPECT_GE(c.top[i - 1].second, c.top[i].second);
}

TEST(Sampler, SameSeedAndPositionSameToken) {
  Sampler a, b;
  const auto logits = randomLogits(2000, 3);
  SamplingConfig cfg;
  cfg.temperature = 1.0f;
  cfg.seed = 42;
  for (uint64_t pos = 0; pos < 50; ++pos) {
    EXPECT_EQ(a.sample(logits, cfg, {}, {}, pos).token, b.sample(logits, cfg, {}, {}, pos).token);
  }
  // Different positions draw differently.
  std::set<uint32_t> seen;
  for (uint64_t pos = 0; pos < 50; ++pos) seen.insert(a.sample(logits, cfg, {}, {}, pos).token);
  EXPECT_GT(seen.size(), 5u);
}

TEST(Sampler, TemperatureSamplingFollowsTheDistribution) {
  Sampler s;
  std::vector<float> logits = {0.0f, std::log(3.0f), -100.0f};  // p = 1/4, 3/4, ~0
  SamplingConfig cfg;
  cfg.temperature = 1.0f;
  cfg.seed = 7;
  std::map<uint32_t, int> counts;
  for (uint64_t pos = 0; pos < 4000; ++pos) ++counts[s.sample(logits, cfg, {}, {}, pos).token];
  EXPECT_NEAR(counts[1] / 4000.0, 0.75, 0.03);
  EXPECT_EQ(counts[2], 0);
}

TEST(Sampler, FiltersRestrictTheCandidates) {
  Sampler s;
  const auto logits = randomLogits(5000, 4);
  std::vector<uint32_t> order(logits.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return logits[a] > logits[b]; });
  SamplingConfig cfg;
  cfg.temperature = 2.0f;
  cfg.seed = 1;
  cfg.top_k = 3;
  for (uint64_t pos = 0; pos < 300; ++pos) {
    const uint32_t t = s.sample(logits, cfg, {}, {}, pos).token;
    EXPECT_TRUE(t == order[0] || t == order[1] || t == order[2]);
  }
  // top_p this small keeps only the most likely token; so does top_k = 1.
  cfg.top_k = 0;
  cfg.top_p = 1e-6f;
  EXPECT_EQ(s.sample(logits, cfg, {}, {}, 9).token, order[0]);
  cfg.top_p = 1.0f;
  cfg.top_k = 1;
  EXPECT_EQ(s.sample(logits, cfg, {}, {}, 9).token, order[0]);
  // min_p = 1 keeps only tokens as likely as the best.
  cfg.top_k = 0;
  cfg.min_p = 1.0f;
  EXPECT_EQ(s.sample(logits, cfg, {}, {}, 9).token, order[0]);
}

TEST(Sampler, TopPOnAFlatDistributionKeepsMostTokens) {
  // A flat distribution over 5000 tokens: top_p 0.9 keeps ~4500 of them, all tied, and the
  // chosen token must still come from the kept mass.
  Sampler s;
  std::vector<float> logits(5000, 0.0f);
  logits[17] = 0.5f;
  SamplingConfig cfg;
  cfg.temperature = 1.0f;
  cfg.top_p = 0.9f;
  std::set<uint32_t> seen;
  for (uint64_t pos = 0; pos < 500; ++pos) {
    cfg.seed = pos;
    seen.insert(s.sample(logits, cfg, {}, {}, pos).token);
  }
  EXPECT_GT(seen.size(), 300u);
  // Ties break by lower id, so the kept set is a prefix of ids (after token 17): ids near the
  // end of the vocabulary are never drawn.
  EXPECT_LT(*seen.rbegin(), 4600u);
}

TEST(Sampler, PenaltiesPushRepeatedTokensDown) {
  Sampler s;
  std::vector<float> logits = {1.0f, 0.9f, 0.0f};
  const std::vector<uint32_t> generated = {0, 0};
  SamplingConfig cfg;
  EXPECT_EQ(s.sample(logits, cfg, {}, generated, 0).token, 0u);
  cfg.repetition_penalty = 1.5f;  // 1.0 / 1.5 < 0.9
  EXPECT_EQ(s.sample(logits, cfg, {}, generated, 0).token, 1u);
  cfg = {};
  cfg.frequency_penalty = 0.1f;  // 1.0 - 0.2 < 0.9
  EXPECT_EQ(s.sample(logits, cfg, {}, generated, 0).token, 1u);
  cfg = {};
  cfg.presence_penalty = 0.05f;  // 1.0 - 0.05 > 0.9
  EXPECT_EQ(s.sample(logits, cfg, {}, generated, 0).token, 0u);
  cfg.presence_penalty = 0.2f;
  EXPECT_EQ(s.sample(logits, cfg, {}, generated, 0).token, 1u);
  // Repetition penalty also counts prompt tokens; presence/frequency do not.
  cfg = {};
  cfg.repetition_penalty = 2.0f;
  const std::vector<uint32_t> prompt = {0};
  EXPECT_EQ(s.sample(logits, cfg, prompt, {}, 0).token, 1u);
}

TEST(Sampler, UniformDrawIsInRangeAndKeyed) {
  for (uint64_t seed : {0ull, 1ull, ~0ull}) {
    for (uint64_t pos = 0; pos < 100; ++pos) {
      const double u = uniformAt(seed, pos);
      EXPECT_GE(u, 0.0);
      EXPECT_LT(u, 1.0);
    }
  }
  EXPECT_NE(uniformAt(1, 2), uniformAt(2, 1));
}

}  // namespace
}  // namespace bulkhead
